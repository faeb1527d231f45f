#include "worker/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "common/rng.h"

namespace pstrain {

// --- LocalUpdater --------------------------------------------------------------

absl::StatusOr<std::unique_ptr<LocalUpdater>> LocalUpdater::Create(const v1::OptimizerSpec& spec,
                                                                   Model* model) {
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Optimizer> optimizer,
                           Optimizer::Create(spec, model->backend()));
  std::unique_ptr<LocalUpdater> updater(new LocalUpdater(std::move(optimizer)));
  for (int i = 0; i < model->num_params(); ++i) {
    const ParamInfo& p = model->param_info(i);
    if (!p.trainable) continue;
    PSTRAIN_ASSIGN_OR_RETURN(int index,
                             updater->optimizer_->AddParameter(p.name, p.shape.num_elements()));
    updater->slots_.emplace_back(i, index);
  }
  return updater;
}

absl::Status LocalUpdater::ApplyUpdate(int64_t step, Model& model) {
  for (const auto& [param, index] : slots_) {
    PSTRAIN_RETURN_IF_ERROR(
        optimizer_->Apply(index, model.param(param).data(), model.grad(param).data(), step));
  }
  return absl::OkStatus();
}

// --- Trainer --------------------------------------------------------------------

TrainerOptions TrainerOptionsFromJob(const v1::JobSpec& job) {
  TrainerOptions options;
  options.batch_size = job.batch_size();
  options.seed = job.seed();
  options.augment = job.dataset().augmentation().random_flip() ||
                    job.dataset().augmentation().crop_padding() > 0;
  options.balance = job.dataset().balance() == v1::BALANCE_OVERSAMPLE;
  options.prefetch_batches =
      job.dataset().prefetch_batches() > 0 ? job.dataset().prefetch_batches() : 4;
  options.loader_threads = job.dataset().loader_threads() > 0 ? job.dataset().loader_threads() : 1;
  return options;
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(Model* model, ParameterUpdater* updater,
                                                         const data::ImageDataset* train,
                                                         data::Preprocess preprocess,
                                                         TrainerOptions options) {
  if (model == nullptr || updater == nullptr || train == nullptr) {
    return absl::InvalidArgumentError("Trainer::Create: null model, updater or dataset");
  }
  const Shape& input = model->graph().input_shape;
  if (train->sample_elements() != input.num_elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset samples are ", train->channels, "x", train->height, "x", train->width,
        " but the model's input_shape is ", input.ToString()));
  }
  if (train->num_classes > model->graph().num_classes) {
    return absl::InvalidArgumentError(absl::StrCat("dataset has ", train->num_classes,
                                                   " classes but the model's num_classes is ",
                                                   model->graph().num_classes));
  }
  std::unique_ptr<Trainer> trainer(new Trainer(model, updater, options));
  PrefetchOptions prefetch;
  prefetch.batch_size = options.batch_size;
  prefetch.prefetch_batches = options.prefetch_batches;
  prefetch.threads = options.loader_threads;
  prefetch.seed = options.seed;
  prefetch.rank = options.rank;
  prefetch.world_size = options.world_size;
  prefetch.shuffle = true;
  prefetch.augment = options.augment;
  prefetch.balance = options.balance;
  // Every step uses a full batch: equal steps on every rank keep the
  // synchronous modes in lock-step, and BN statistics stay well defined.
  prefetch.drop_last = true;
  PSTRAIN_ASSIGN_OR_RETURN(trainer->prefetcher_,
                           DataPrefetcher::Create(model->backend(), train, std::move(preprocess),
                                                  prefetch));
  // Shards differ by at most one sample, which can still cross a batch
  // boundary: every rank runs as many steps as the smallest shard allows, so
  // that synchronous modes see the same number of steps from every worker.
  const int64_t epoch_length = options.balance
                                   ? data::BalancedEpochLength(train->labels, train->num_classes)
                                   : train->size();
  int64_t smallest_shard = epoch_length;
  for (int r = 0; r < options.world_size; ++r) {
    smallest_shard = std::min(smallest_shard, data::ShardSize(epoch_length, r, options.world_size));
  }
  trainer->steps_per_epoch_ = smallest_shard / options.batch_size;
  if (trainer->steps_per_epoch_ == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the smallest training shard has ", smallest_shard,
        " samples, fewer than one batch of ", options.batch_size));
  }
  const int classes = model->graph().num_classes;
  const size_t bytes = sizeof(float) + static_cast<size_t>(options.batch_size) *
                                           (classes * sizeof(float) + sizeof(int32_t));
  for (int slot = 0; slot < 2; ++slot) {
    PSTRAIN_ASSIGN_OR_RETURN(PinnedBuffer host, model->backend()->AllocatePinned(bytes));
    trainer->stats_host_.push_back(std::move(host));
    trainer->stats_event_.emplace_back();
    trainer->stats_batch_.push_back(0);
  }
  model->SetGradientReadyCallback([t = trainer.get()](int layer, absl::Span<const int> params) {
    t->updater_->OnGradientsReady(t->global_step_, layer, params);
  });
  return trainer;
}

absl::Status Trainer::RunStep(const DeviceBatch& batch) {
  PSTRAIN_RETURN_IF_ERROR(updater_->BeforeStep(global_step_, *model_));
  const uint64_t dropout_seed = MixBits(options_.seed ^ 0xd50u, global_step_ * 1024 + options_.rank);
  PSTRAIN_RETURN_IF_ERROR(model_->Forward(batch.images, batch.labels, batch.n, true, dropout_seed));
  PSTRAIN_RETURN_IF_ERROR(model_->Backward());
  return updater_->ApplyUpdate(global_step_, *model_);
}

// Layout of a stats slot: [loss][logits: n x classes][labels: n].
absl::Status Trainer::EnqueueStats(const DeviceBatch& batch, int slot) {
  Backend* backend = model_->backend();
  const int classes = model_->graph().num_classes;
  char* host = static_cast<char*>(stats_host_[slot].data());
  PSTRAIN_RETURN_IF_ERROR(backend->CopyDeviceToHost(host, model_->loss(), sizeof(float)));
  PSTRAIN_RETURN_IF_ERROR(backend->CopyDeviceToHost(host + sizeof(float), model_->logits(),
                                                    sizeof(float) * batch.n * classes));
  PSTRAIN_RETURN_IF_ERROR(
      backend->CopyDeviceToHost(host + sizeof(float) * (1 + batch.n * classes), batch.labels,
                                sizeof(int32_t) * batch.n));
  PSTRAIN_ASSIGN_OR_RETURN(stats_event_[slot], backend->RecordEvent());
  stats_batch_[slot] = batch.n;
  return absl::OkStatus();
}

absl::Status Trainer::CollectStats(int slot) {
  if (stats_event_[slot] == nullptr) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(stats_event_[slot]->Wait());
  stats_event_[slot].reset();
  const int classes = model_->graph().num_classes;
  const int n = stats_batch_[slot];
  const char* host = static_cast<const char*>(stats_host_[slot].data());
  float loss;
  std::memcpy(&loss, host, sizeof(float));
  const float* logits = reinterpret_cast<const float*>(host + sizeof(float));
  const int32_t* labels =
      reinterpret_cast<const int32_t*>(host + sizeof(float) * (1 + n * classes));
  if (!std::isfinite(loss)) {
    return absl::InternalError(absl::StrCat(
        "training diverged: loss is ", loss, " at step ", global_step_,
        " (lower the learning rate or check the data normalisation)"));
  }
  for (int i = 0; i < n; ++i) {
    const float* row = logits + static_cast<int64_t>(i) * classes;
    int predicted = static_cast<int>(std::max_element(row, row + classes) - row);
    epoch_correct_ += predicted == labels[i];
  }
  epoch_seen_ += n;
  epoch_loss_sum_ += loss;
  epoch_loss_batches_ += 1;
  return absl::OkStatus();
}

absl::StatusOr<EpochStats> Trainer::RunEpoch(int epoch, const ProgressFn& progress,
                                             int64_t progress_every, int64_t first_step) {
  const absl::Time start = absl::Now();
  epoch_loss_sum_ = 0;
  epoch_correct_ = epoch_seen_ = epoch_loss_batches_ = 0;
  PSTRAIN_RETURN_IF_ERROR(prefetcher_->StartEpoch(epoch, first_step));
  EpochStats stats;
  stats.epoch = epoch;
  const int64_t steps = steps_per_epoch_;
  auto report = [&](int64_t step_in_epoch) {
    if (!progress) return;
    StepProgress p;
    p.epoch = epoch;
    p.step_in_epoch = step_in_epoch;
    p.steps_in_epoch = steps;
    p.global_step = global_step_;
    p.mean_loss = epoch_loss_batches_ ? epoch_loss_sum_ / epoch_loss_batches_ : 0;
    p.train_accuracy = epoch_seen_ ? static_cast<double>(epoch_correct_) / epoch_seen_ : 0;
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    p.samples_per_sec = seconds > 0 ? stats.samples / seconds : 0;
    progress(p);
  };
  int slot = 0;
  for (int64_t s = first_step; s < steps; ++s) {
    // NextBatch: already assembled in the background and copied to the device.
    PSTRAIN_ASSIGN_OR_RETURN(DeviceBatch batch, prefetcher_->Next());
    last_data_wait_seconds_ = prefetcher_->last_wait_seconds();
    stats.data_wait_seconds += last_data_wait_seconds_;
    if (batch.n == 0) {
      return absl::InternalError(absl::StrCat("data ran out after ", s, " of ", steps, " steps"));
    }
    PSTRAIN_RETURN_IF_ERROR(RunStep(batch));
    PSTRAIN_RETURN_IF_ERROR(EnqueueStats(batch, slot));
    slot ^= 1;
    PSTRAIN_RETURN_IF_ERROR(CollectStats(slot));  // The previous step's.
    ++global_step_;
    ++stats.steps;
    stats.samples += batch.n;
    if (progress_every > 0 && (s + 1) % progress_every == 0 && s + 1 < steps) report(s + 1);
  }
  PSTRAIN_RETURN_IF_ERROR(CollectStats(slot ^ 1));
  PSTRAIN_RETURN_IF_ERROR(model_->backend()->Synchronize());
  stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  stats.mean_loss = epoch_loss_batches_ ? epoch_loss_sum_ / epoch_loss_batches_ : 0;
  stats.train_accuracy = epoch_seen_ ? static_cast<double>(epoch_correct_) / epoch_seen_ : 0;
  stats.samples_per_sec = stats.seconds > 0 ? stats.samples / stats.seconds : 0;
  report(stats.steps);
  return stats;
}

}  // namespace pstrain
