// Standalone training and evaluation: the whole engine on one machine, no
// server. `pstrain-worker --standalone JOB.json` and `--evaluate CKPT` are thin
// wrappers over these.
//
//   StandaloneOptions options;
//   options.device = "cpu";
//   PSTRAIN_ASSIGN_OR_RETURN(StandaloneResult result, RunStandalone(job, options, std::cout));
#ifndef PSTRAIN_WORKER_STANDALONE_H_
#define PSTRAIN_WORKER_STANDALONE_H_

#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain::storage {
class Storage;
}  // namespace pstrain::storage

namespace pstrain {

struct StandaloneOptions {
  std::string device = "auto";   // auto | cpu | cuda[:N]
  int epochs = 0;                // > 0 overrides the job's epochs.
  int batch_size = 0;            // > 0 overrides the job's batch size.
  int64_t limit = 0;             // > 0 trains on only the first `limit` samples.
  std::string checkpoint_path;   // Where to save the final checkpoint ("" = none).
  bool progress = true;          // Per-epoch progress lines on `out`.
  // TensorBoard log directory ("" = none): per epoch train/loss,
  // train/accuracy and train/samples_per_sec at the global step, then
  // test/accuracy and test/loss at the last step (common/tfevents.h).
  std::string tensorboard_dir;
  // Where the dataset is read from (local paths and s3://); null: local only.
  storage::Storage* storage = nullptr;
};

struct StandaloneResult {
  ClassificationMetrics test;
  double train_seconds = 0;
  double train_samples_per_sec = 0;  // Over all epochs, data waits included.
  double final_train_loss = 0;
  double first_epoch_loss = 0;
  double final_train_accuracy = 0;
  int epochs = 0;
  int64_t steps = 0;
  std::string training_precision = "fp32";  // JobSpec.precision: fp32, bf16 or fp16.
  int64_t skipped_steps = 0;                // fp16: steps whose gradients overflowed (not applied).
  std::string device;       // "cpu" or "cuda:N".
  std::string device_info;  // Backend::Describe().
};

// Validates the job, loads the data, trains, evaluates on the test split and
// saves a checkpoint. Progress lines go to `out`. A TensorBoard directory
// that cannot be created fails the run before training; a later write error
// is reported on `out` and ends the TensorBoard output, not the training.
absl::StatusOr<StandaloneResult> RunStandalone(const v1::JobSpec& job,
                                               const StandaloneOptions& options,
                                               std::ostream& out);

// What `pstrain-worker --evaluate` does beyond the metrics.
struct EvaluateCheckpointOptions {
  int64_t limit = 0;  // Only the first N test samples (0 = all).
  // When set, the logits [N, classes] and the model inputs [N, C, H, W] (as
  // preprocessed) of the evaluated samples, in order, are written there as
  // float32 NumPy .npy files (for comparisons with other runtimes, e.g. the
  // ONNX export's test).
  std::string logits_out;
  std::string inputs_out;
};

// Loads a checkpoint and evaluates it on the test split of `data_dir` (or the
// checkpoint job's dataset path when empty).
absl::StatusOr<ClassificationMetrics> EvaluateCheckpoint(
    const std::string& checkpoint_path, const std::string& data_dir, const std::string& device,
    std::string* device_name, const EvaluateCheckpointOptions& options = {});

// Writes `values` as a little-endian float32 NumPy .npy array of `shape`
// (atomically). shape's product must equal values.size().
absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const std::vector<float>& values);

// The one-line JSON summary printed last by `pstrain-worker --standalone`.
std::string StandaloneResultJson(const StandaloneResult& result);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_STANDALONE_H_
