#include "worker/standalone.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/checkpoint.h"
#include "common/data/file_io.h"
#include "common/data/dataset.h"
#include "common/data/load_dataset.h"
#include "common/job_spec.h"
#include "common/status_macros.h"
#include "common/tfevents.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "worker/evaluation.h"
#include "worker/job_setup.h"
#include "worker/model.h"
#include "worker/trainer.h"

namespace pstrain {
namespace {

absl::StatusOr<v1::Checkpoint> MakeCheckpoint(const v1::JobSpec& job, Model& model,
                                              LocalUpdater& updater, int64_t step, int epoch) {
  v1::Checkpoint ckpt;
  *ckpt.mutable_job() = job;
  std::vector<v1::TensorProto> params;
  PSTRAIN_RETURN_IF_ERROR(model.ExportParameters(&params));
  for (auto& t : params) *ckpt.add_parameters() = std::move(t);
  Backend* backend = model.backend();
  for (const auto& [name, tensor] : updater.optimizer().StateTensors()) {
    std::vector<float> host(tensor->num_elements());
    PSTRAIN_RETURN_IF_ERROR(backend->CopyDeviceToHost(host.data(), tensor->data(), tensor->bytes()));
    PSTRAIN_RETURN_IF_ERROR(backend->Synchronize());
    *ckpt.add_optimizer_state() = MakeTensorProto(name, tensor->shape().dims(), host.data());
  }
  ckpt.set_step(step);
  ckpt.set_epoch(epoch);
  ckpt.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
  return ckpt;
}

}  // namespace

absl::StatusOr<StandaloneResult> RunStandalone(const v1::JobSpec& job_in,
                                               const StandaloneOptions& options,
                                               std::ostream& out) {
  // Phase: ResolveJob.
  v1::JobSpec job = job_in;
  if (options.epochs > 0) job.set_epochs(options.epochs);
  if (options.batch_size > 0) job.set_batch_size(options.batch_size);
  if (options.limit > 0) job.mutable_dataset()->set_train_limit(options.limit);
  PSTRAIN_RETURN_IF_ERROR(ValidateJobSpec(job));
  PSTRAIN_RETURN_IF_ERROR(ValidateOptimizerSpec(job.optimizer()));

  // Phase: OpenBackend, LoadData, BuildModel.
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           OpenBackend(options.device, /*cpu_threads=*/0));
  PSTRAIN_ASSIGN_OR_RETURN(JobSetup setup, LoadDataAndBuildModel(job, backend.get(), options.storage));
  const data::DatasetSplits& splits = setup.splits;
  const data::Preprocess& preprocess = setup.preprocess;
  Model* const model = setup.model.get();
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<LocalUpdater> updater,
                           LocalUpdater::Create(job.optimizer(), model));
  TrainerOptions trainer_options = TrainerOptionsFromJob(job);
  PSTRAIN_ASSIGN_OR_RETURN(
      std::unique_ptr<Trainer> trainer,
      Trainer::Create(model, updater.get(), &splits.train, preprocess, trainer_options));

  StandaloneResult result;
  result.device = backend->DeviceName();
  result.device_info = backend->Describe();
  if (options.progress) {
    out << absl::StrFormat(
               "pstrain-worker: training %s on %s: %d train / %d test samples, %d epochs, "
               "batch %d, %d steps per epoch, %d parameters",
               job.model().name(), result.device_info, splits.train.size(), splits.test.size(),
               job.epochs(), job.batch_size(), trainer->steps_per_epoch(),
               model->graph().trainable_params)
        << std::endl;
  }

  // Phase: OpenTensorBoard. Its scalars are flushed after every write, so
  // that TensorBoard shows each epoch as it ends.
  std::unique_ptr<TfEventsWriter> tensorboard;
  if (!options.tensorboard_dir.empty()) {
    PSTRAIN_ASSIGN_OR_RETURN(tensorboard, TfEventsWriter::Create(options.tensorboard_dir));
    if (options.progress) out << "tensorboard: " << tensorboard->path() << std::endl;
  }
  auto write_scalars = [&tensorboard, &out](int64_t step, std::vector<TfScalar> scalars) {
    if (tensorboard == nullptr) return;
    absl::Status status = tensorboard->WriteScalars(step, scalars);
    if (status.ok()) status = tensorboard->Flush();
    if (!status.ok()) {
      out << "tensorboard: " << status.message() << "; no more TensorBoard output" << std::endl;
      tensorboard.reset();
    }
  };

  // Phase: Train.
  int64_t samples = 0;
  for (int epoch = 0; epoch < job.epochs(); ++epoch) {
    PSTRAIN_ASSIGN_OR_RETURN(EpochStats stats, trainer->RunEpoch(epoch, nullptr));
    samples += stats.samples;
    result.train_seconds += stats.seconds;
    if (epoch == 0) result.first_epoch_loss = stats.mean_loss;
    result.final_train_loss = stats.mean_loss;
    result.final_train_accuracy = stats.train_accuracy;
    write_scalars(trainer->global_step(), {{"train/loss", stats.mean_loss},
                                           {"train/accuracy", stats.train_accuracy},
                                           {"train/samples_per_sec", stats.samples_per_sec}});
    if (options.progress) {
      out << absl::StrFormat(
                 "epoch %d/%d  loss %.4f  train_acc %.4f  %.1f samples/s  %.1f s  (data wait "
                 "%.2f s)",
                 epoch + 1, job.epochs(), stats.mean_loss, stats.train_accuracy,
                 stats.samples_per_sec, stats.seconds, stats.data_wait_seconds)
          << std::endl;
    }
  }
  result.epochs = job.epochs();
  result.steps = trainer->global_step();
  result.training_precision = DataTypeName(model->precision());
  result.skipped_steps = model->overflowed_steps();
  result.train_samples_per_sec = result.train_seconds > 0 ? samples / result.train_seconds : 0;

  // Phase: Evaluate.
  EvaluateOptions eval;
  eval.batch_size = std::max(job.batch_size(), 256);
  PSTRAIN_ASSIGN_OR_RETURN(result.test, Evaluate(*model, splits.test, preprocess, eval));
  if (static_cast<int>(setup.splits.class_names.size()) == result.test.num_classes) {
    result.test.class_names = setup.splits.class_names;
  }
  write_scalars(result.steps,
                {{"test/accuracy", result.test.accuracy}, {"test/loss", result.test.loss}});
  if (tensorboard != nullptr) {
    if (absl::Status status = tensorboard->Close(); !status.ok()) {
      out << "tensorboard: " << status.message() << std::endl;
    }
  }
  if (options.progress) {
    out << absl::StrFormat(
               "test: accuracy %.4f  loss %.4f  precision %.4f  recall %.4f  f1 %.4f  (%d "
               "samples)",
               result.test.accuracy, result.test.loss, result.test.macro_precision,
               result.test.macro_recall, result.test.macro_f1, result.test.samples)
        << "\n"
        << FormatConfusionMatrix(result.test) << std::flush;
  }

  // Phase: SaveCheckpoint.
  if (!options.checkpoint_path.empty()) {
    PSTRAIN_ASSIGN_OR_RETURN(v1::Checkpoint ckpt,
                             MakeCheckpoint(job, *model, *updater, trainer->global_step(),
                                            job.epochs()));
    PSTRAIN_RETURN_IF_ERROR(WriteCheckpointFile(options.checkpoint_path, ckpt));
    if (options.progress) out << "checkpoint: " << options.checkpoint_path << std::endl;
  }
  return result;
}

absl::Status WriteNpyFloat32(const std::string& path, const std::vector<int64_t>& shape,
                             const std::vector<float>& values) {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  if (count != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteNpyFloat32: shape holds ", count, " values, got ", values.size()));
  }
  // Format 1.0: magic, version, header length, a Python dict literal padded
  // with spaces and ended by a newline so the data starts 64-byte aligned.
  std::string dims;
  for (int64_t d : shape) absl::StrAppend(&dims, d, ",");
  if (shape.size() > 1) dims.pop_back();
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header.push_back('\n');
  std::string bytes("\x93NUMPY\x01\x00", 8);
  bytes.push_back(static_cast<char>(header.size() & 0xff));
  bytes.push_back(static_cast<char>(header.size() >> 8));
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return data::WriteFileAtomically(path, bytes);
}

absl::StatusOr<ClassificationMetrics> EvaluateCheckpoint(const std::string& checkpoint_path,
                                                         const std::string& data_dir,
                                                         const std::string& device,
                                                         std::string* device_name,
                                                         const EvaluateCheckpointOptions& options) {
  PSTRAIN_ASSIGN_OR_RETURN(v1::Checkpoint ckpt, ReadCheckpointFile(checkpoint_path));
  v1::JobSpec job = ckpt.job();
  if (!data_dir.empty()) job.mutable_dataset()->set_path(data_dir);
  job.mutable_dataset()->set_train_limit(1);  // Only the test split is used.
  if (options.limit > 0) job.mutable_dataset()->set_test_limit(options.limit);
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           OpenBackend(device, /*cpu_threads=*/0));
  if (device_name != nullptr) *device_name = backend->DeviceName();
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Create(job.model(), backend.get()));
  std::vector<v1::TensorProto> params(ckpt.parameters().begin(), ckpt.parameters().end());
  PSTRAIN_RETURN_IF_ERROR(model->ImportParameters(params));
  PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits splits, data::LoadDataset(job.dataset()));
  PSTRAIN_ASSIGN_OR_RETURN(data::Preprocess preprocess,
                           data::Preprocess::FromSpec(job.dataset(), splits.test.channels));
  EvaluateOptions eval;
  std::vector<float> logits, inputs;
  if (!options.logits_out.empty()) eval.logits = &logits;
  if (!options.inputs_out.empty()) eval.inputs = &inputs;
  PSTRAIN_ASSIGN_OR_RETURN(ClassificationMetrics metrics,
                           Evaluate(*model, splits.test, preprocess, eval));
  const int64_t n = metrics.samples;
  if (!options.logits_out.empty()) {
    PSTRAIN_RETURN_IF_ERROR(
        WriteNpyFloat32(options.logits_out, {n, model->graph().num_classes}, logits));
  }
  if (!options.inputs_out.empty()) {
    std::vector<int64_t> shape = {n};
    for (int64_t d : model->graph().input_shape.dims()) shape.push_back(d);
    PSTRAIN_RETURN_IF_ERROR(WriteNpyFloat32(options.inputs_out, shape, inputs));
  }
  return metrics;
}

std::string StandaloneResultJson(const StandaloneResult& r) {
  return absl::StrFormat(
      "{\"test_accuracy\": %.6f, \"test_loss\": %.6f, \"precision\": %.6f, \"recall\": %.6f, "
      "\"f1\": %.6f, \"test_samples\": %d, \"train_samples_per_sec\": %.2f, "
      "\"train_seconds\": %.2f, \"final_train_loss\": %.6f, \"epochs\": %d, \"steps\": %d, "
      "\"training_precision\": \"%s\", \"skipped_steps\": %d, \"device\": \"%s\"}",
      r.test.accuracy, r.test.loss, r.test.macro_precision, r.test.macro_recall, r.test.macro_f1,
      r.test.samples, r.train_samples_per_sec, r.train_seconds, r.final_train_loss, r.epochs,
      r.steps, r.training_precision, r.skipped_steps, r.device);
}

}  // namespace pstrain
