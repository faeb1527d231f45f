// Evaluation of a model on a labelled dataset: loss, accuracy, macro
// precision / recall / F1 and the confusion matrix.
//
//   PSTRAIN_ASSIGN_OR_RETURN(ClassificationMetrics m,
//                            Evaluate(*model, splits.test, preprocess, 256));
//   std::cout << FormatConfusionMatrix(m);
//
// Threads: drives the model's backend; one thread at a time.
#ifndef PSTRAIN_WORKER_EVALUATION_H_
#define PSTRAIN_WORKER_EVALUATION_H_

#include <vector>

#include "absl/status/statusor.h"
#include "common/data/dataset.h"
#include "common/metrics.h"
#include "worker/model.h"

namespace pstrain {

struct EvaluateOptions {
  int batch_size = 256;
  int rank = 0;        // Evaluate only this rank's shard (distributed runs).
  int world_size = 1;
  // When set, every evaluated sample's logits (classes floats) and model
  // input (as preprocessed) are appended here, in order.
  std::vector<float>* logits = nullptr;
  std::vector<float>* inputs = nullptr;
};

// Runs the model in inference mode (dropout off, batch norm on running
// statistics) over `dataset` (or this rank's shard of it), in order.
absl::StatusOr<ClassificationMetrics> Evaluate(Model& model, const data::ImageDataset& dataset,
                                               const data::Preprocess& preprocess,
                                               const EvaluateOptions& options);

// Same, but returns the raw confusion counts and summed loss so that shards
// from several workers can be merged before metrics are computed.
struct EvaluationShard {
  ConfusionMatrix confusion;
  double loss_sum = 0;  // Sum of per-batch mean loss times batch size.
  int64_t samples = 0;
};
absl::StatusOr<EvaluationShard> EvaluateShard(Model& model, const data::ImageDataset& dataset,
                                              const data::Preprocess& preprocess,
                                              const EvaluateOptions& options);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_EVALUATION_H_
