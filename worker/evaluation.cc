#include "worker/evaluation.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data_prefetcher.h"

namespace pstrain {

absl::StatusOr<EvaluationShard> EvaluateShard(Model& model, const data::ImageDataset& dataset,
                                              const data::Preprocess& preprocess,
                                              const EvaluateOptions& options) {
  const int classes = model.graph().num_classes;
  if (dataset.sample_elements() != model.graph().input_shape.num_elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "evaluation data samples are ", dataset.channels, "x", dataset.height, "x", dataset.width,
        " but the model's input_shape is ", model.graph().input_shape.ToString()));
  }
  if (dataset.num_classes > classes) {
    return absl::InvalidArgumentError(absl::StrCat("evaluation data has ", dataset.num_classes,
                                                   " classes but the model has ", classes));
  }
  PrefetchOptions prefetch;
  prefetch.batch_size = options.batch_size;
  prefetch.rank = options.rank;
  prefetch.world_size = options.world_size;
  prefetch.shuffle = false;
  prefetch.augment = false;
  prefetch.drop_last = false;
  PSTRAIN_ASSIGN_OR_RETURN(
      std::unique_ptr<DataPrefetcher> prefetcher,
      DataPrefetcher::Create(model.backend(), &dataset, preprocess, prefetch));
  PSTRAIN_RETURN_IF_ERROR(prefetcher->StartEpoch(0));
  EvaluationShard shard{ConfusionMatrix(classes)};
  std::vector<float> logits;
  std::vector<int32_t> labels;
  Backend* backend = model.backend();
  for (;;) {
    PSTRAIN_ASSIGN_OR_RETURN(DeviceBatch batch, prefetcher->Next());
    if (batch.n == 0) break;
    PSTRAIN_RETURN_IF_ERROR(model.Forward(batch.images, batch.labels, batch.n, false, 0));
    logits.resize(static_cast<size_t>(batch.n) * classes);
    labels.resize(batch.n);
    float loss = 0;
    PSTRAIN_RETURN_IF_ERROR(
        backend->CopyDeviceToHost(logits.data(), model.logits(), logits.size() * sizeof(float)));
    PSTRAIN_RETURN_IF_ERROR(
        backend->CopyDeviceToHost(labels.data(), batch.labels, labels.size() * sizeof(int32_t)));
    PSTRAIN_RETURN_IF_ERROR(backend->CopyDeviceToHost(&loss, model.loss(), sizeof(float)));
    if (options.inputs != nullptr) {
      const size_t elements = static_cast<size_t>(batch.n) * dataset.sample_elements();
      const size_t at = options.inputs->size();
      options.inputs->resize(at + elements);
      PSTRAIN_RETURN_IF_ERROR(backend->CopyDeviceToHost(options.inputs->data() + at, batch.images,
                                                        elements * sizeof(float)));
    }
    PSTRAIN_RETURN_IF_ERROR(backend->Synchronize());
    if (options.logits != nullptr) {
      options.logits->insert(options.logits->end(), logits.begin(), logits.end());
    }
    for (int i = 0; i < batch.n; ++i) {
      const float* row = logits.data() + static_cast<size_t>(i) * classes;
      int predicted = static_cast<int>(std::max_element(row, row + classes) - row);
      shard.confusion.Add(labels[i], predicted);
    }
    shard.loss_sum += static_cast<double>(loss) * batch.n;
    shard.samples += batch.n;
  }
  return shard;
}

absl::StatusOr<ClassificationMetrics> Evaluate(Model& model, const data::ImageDataset& dataset,
                                               const data::Preprocess& preprocess,
                                               const EvaluateOptions& options) {
  PSTRAIN_ASSIGN_OR_RETURN(EvaluationShard shard, EvaluateShard(model, dataset, preprocess, options));
  ClassificationMetrics metrics = shard.confusion.Compute();
  metrics.loss = shard.samples ? shard.loss_sum / shard.samples : 0;
  return metrics;
}

}  // namespace pstrain
