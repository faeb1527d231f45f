#include "worker/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

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
  std::unique_ptr<LocalUpdater> updater(new LocalUpdater(std::move(optimizer), model));
  updater->slot_of_param_.assign(model->num_params(), -1);
  for (int i = 0; i < model->num_params(); ++i) {
    const ParamInfo& p = model->param_info(i);
    if (!p.trainable) continue;
    PSTRAIN_ASSIGN_OR_RETURN(int index,
                             updater->optimizer_->AddParameter(p.name, p.shape.num_elements()));
    updater->slot_of_param_[i] = static_cast<int>(updater->slots_.size());
    updater->slots_.emplace_back(i, index);
  }
  updater->applied_.assign(updater->slots_.size(), false);
  return updater;
}

absl::Status LocalUpdater::BeforeStep(int64_t step, Model& model) {
  std::fill(applied_.begin(), applied_.end(), false);
  deferred_error_ = absl::OkStatus();
  return absl::OkStatus();
}

absl::Status LocalUpdater::ApplyOne(int slot, int64_t step) {
  if (applied_[slot]) return absl::OkStatus();
  const auto [param, index] = slots_[slot];
  PSTRAIN_RETURN_IF_ERROR(
      optimizer_->Apply(index, model_->param(param).data(), model_->grad(param).data(), step));
  applied_[slot] = true;
  return absl::OkStatus();
}

void LocalUpdater::OnGradientsReady(int64_t step, int layer, absl::Span<const int> params) {
  if (!deferred_error_.ok() || model_->last_backward_overflowed()) return;
  for (int param : params) {
    const int slot = param >= 0 && param < static_cast<int>(slot_of_param_.size())
                         ? slot_of_param_[param]
                         : -1;
    if (slot < 0) continue;
    deferred_error_ = ApplyOne(slot, step);
    if (!deferred_error_.ok()) return;
  }
}

absl::Status LocalUpdater::ApplyUpdate(int64_t step, Model& model) {
  if (&model != model_) {
    return absl::InvalidArgumentError("LocalUpdater::ApplyUpdate: not the model it was made for");
  }
  PSTRAIN_RETURN_IF_ERROR(std::exchange(deferred_error_, absl::OkStatus()));
  // An fp16 step whose gradients overflowed is skipped (Model: loss scaling).
  last_applied_ = !model.last_backward_overflowed();
  for (int slot = 0; last_applied_ && slot < static_cast<int>(slots_.size()); ++slot) {
    PSTRAIN_RETURN_IF_ERROR(ApplyOne(slot, step));
  }
  // The next step starts from scratch even if nobody calls BeforeStep (the
  // average mode's RemoteUpdater calls only ApplyUpdate).
  std::fill(applied_.begin(), applied_.end(), false);
  return absl::OkStatus();
}

// --- Trainer --------------------------------------------------------------------

namespace {
// The largest step, in batches: a share's (or a tail's) last step takes the
// rest, fewer than batch_size more samples (data/epoch_work.h).
constexpr int kMaxBatchFactor = 2;
}  // namespace

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
  // The last step of a segment also takes its remainder: up to 2B.
  prefetch.max_batch = kMaxBatchFactor * options.batch_size;
  prefetch.prefetch_batches = options.prefetch_batches;
  prefetch.threads = options.loader_threads;
  prefetch.seed = options.seed;
  prefetch.rank = options.rank;
  prefetch.world_size = options.world_size;
  prefetch.shuffle = true;
  prefetch.augment = options.augment;
  prefetch.balance = options.balance;
  PSTRAIN_ASSIGN_OR_RETURN(trainer->prefetcher_,
                           DataPrefetcher::Create(model->backend(), train, std::move(preprocess),
                                                  prefetch));
  trainer->train_ = train;
  // Every rank runs as many steps as the smallest share allows, so that the
  // synchronous modes see the same number of steps from every worker; the
  // last step takes the rest of the share (data/epoch_work.h).
  trainer->epoch_length_ = options.balance
                               ? data::BalancedEpochLength(train->labels, train->num_classes)
                               : train->size();
  trainer->steps_per_epoch_ =
      data::BaseSteps(trainer->epoch_length_, options.world_size, options.batch_size);
  if (trainer->epoch_length_ / options.world_size < options.batch_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the smallest training shard has ", trainer->epoch_length_ / options.world_size,
        " samples, fewer than one batch of ", options.batch_size));
  }
  const int classes = model->graph().num_classes;
  // Room for the largest step (the last one of a share takes its rest).
  const size_t bytes = sizeof(float) + static_cast<size_t>(kMaxBatchFactor * options.batch_size) *
                                           (classes * sizeof(float) + sizeof(int32_t));
  for (int slot = 0; slot < kStatsSlots; ++slot) {
    PSTRAIN_ASSIGN_OR_RETURN(PinnedBuffer host, model->backend()->AllocatePinned(bytes));
    trainer->stats_host_.push_back(std::move(host));
    trainer->stats_event_.emplace_back();
    trainer->stats_batch_.push_back(0);
    trainer->stats_step_.push_back(0);
  }
  model->SetGradientReadyCallback([t = trainer.get()](int layer, absl::Span<const int> params) {
    t->updater_->OnGradientsReady(t->global_step_, layer, params);
  });
  return trainer;
}

data::WorkSegment Trainer::BaseSegment(int epoch) const {
  return {data::BaseRange(epoch_length_, epoch, options_.rank, options_.world_size),
          steps_per_epoch_};
}

std::vector<int64_t> Trainer::SamplesOf(const data::WorkRange& range) {
  if (order_epoch_ != range.epoch) {
    order_ =
        data::TrainingOrder(*train_, epoch_length_, options_.balance, options_.seed, range.epoch);
    order_epoch_ = range.epoch;
  }
  const int64_t begin = std::clamp<int64_t>(range.begin, 0, epoch_length_);
  const int64_t end = std::clamp<int64_t>(range.end, begin, epoch_length_);
  return std::vector<int64_t>(order_.begin() + begin, order_.begin() + end);
}

absl::Status Trainer::RunStep(const DeviceBatch& batch, uint64_t dropout_seed) {
  if (FixedComputeStep()) return RunFixedComputeStep();
  PSTRAIN_RETURN_IF_ERROR(updater_->BeforeStep(global_step_, *model_));
  PSTRAIN_RETURN_IF_ERROR(model_->Forward(batch.images, batch.labels, batch.n, true, dropout_seed));
  PSTRAIN_RETURN_IF_ERROR(model_->Backward());
  ran_real_step_ = true;
  return updater_->ApplyUpdate(global_step_, *model_);
}

bool Trainer::FixedComputeStep() const {
  return ran_real_step_ && options_.bench_only_fixed_compute > absl::ZeroDuration();
}

// BENCH ONLY: BeforeStep ▸ a fixed sleep in place of Forward and Backward ▸
// every layer's gradients announced in backward order (Model::Backward's
// order) ▸ ApplyUpdate. The gradient buffers still hold the first step's.
absl::Status Trainer::RunFixedComputeStep() {
  PSTRAIN_RETURN_IF_ERROR(updater_->BeforeStep(global_step_, *model_));
  absl::SleepFor(options_.bench_only_fixed_compute);
  const ModelGraph& graph = model_->graph();
  for (int l = static_cast<int>(graph.layers.size()) - 1; l >= 0; --l) {
    std::vector<int> trainable;
    for (int p : graph.layers[l].params) {
      if (graph.params[p].trainable) trainable.push_back(p);
    }
    if (!trainable.empty()) updater_->OnGradientsReady(global_step_, l, trainable);
  }
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
  stats_step_[slot] = global_step_;
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
    return absl::InternalError(
        absl::StrCat("training diverged: loss is ", loss, " at step ", stats_step_[slot],
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
  SegmentOptions options;
  options.first_step = first_step;
  options.progress_every = progress_every;
  return RunSegment(epoch, BaseSegment(epoch), progress, options);
}

absl::StatusOr<EpochStats> Trainer::RunSegment(int epoch, const data::WorkSegment& segment,
                                               const ProgressFn& progress, SegmentOptions options) {
  const absl::Time start = absl::Now();
  epoch_loss_sum_ = 0;
  epoch_correct_ = epoch_seen_ = epoch_loss_batches_ = 0;
  EpochStats stats;
  stats.epoch = epoch;
  std::vector<int64_t> ends =
      data::BatchEnds(segment.range.size(), segment.steps, options_.batch_size);
  const int64_t steps = static_cast<int64_t>(ends.size());
  for (size_t i = 0; i < ends.size(); ++i) {
    const int64_t n = ends[i] - (i == 0 ? 0 : ends[i - 1]);
    if (n > int64_t{kMaxBatchFactor} * options_.batch_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("a step of ", n, " samples is more than ", kMaxBatchFactor, " batches of ",
                       options_.batch_size, " (segment of ", segment.range.size(), " samples in ",
                       segment.steps, " steps)"));
    }
  }
  if (options.first_step < 0 || options.first_step > steps) {
    return absl::InvalidArgumentError(
        absl::StrCat("first step ", options.first_step, " is outside [0, ", steps, "]"));
  }
  if (steps == 0 || options.first_step == steps) return stats;
  // The samples still to train, and where each of their batches ends.
  const int64_t skip = options.first_step == 0 ? 0 : ends[options.first_step - 1];
  data::WorkRange rest = segment.range;
  rest.begin += skip;
  ends.erase(ends.begin(), ends.begin() + options.first_step);
  for (int64_t& end : ends) end -= skip;
  const uint64_t aug_key =
      options.tail
          ? data::MixSeed(data::MixSeed(0x7a11u, static_cast<uint64_t>(segment.range.epoch)),
                          static_cast<uint64_t>(rest.begin))
          : data::MixSeed(data::MixSeed(static_cast<uint64_t>(segment.range.epoch),
                                        static_cast<uint64_t>(options_.rank)),
                          static_cast<uint64_t>(options_.world_size));
  PSTRAIN_RETURN_IF_ERROR(prefetcher_->StartSamples(aug_key, SamplesOf(rest), std::move(ends)));
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
  for (int64_t s = options.first_step; s < steps; ++s) {
    // NextBatch: already assembled in the background and copied to the device.
    PSTRAIN_ASSIGN_OR_RETURN(DeviceBatch batch, prefetcher_->Next());
    last_data_wait_seconds_ = prefetcher_->last_wait_seconds();
    stats.data_wait_seconds += last_data_wait_seconds_;
    if (batch.n == 0) {
      return absl::InternalError(absl::StrCat("data ran out after ", s, " of ", steps, " steps"));
    }
    const uint64_t dropout_seed =
        options.tail ? MixBits(options_.seed ^ 0x7a11u,
                               (static_cast<uint64_t>(segment.range.epoch) << 40) ^
                                   (static_cast<uint64_t>(options.tail_index) << 24) ^
                                   static_cast<uint64_t>(s * 1024 + options_.rank))
                     : MixBits(options_.seed ^ 0xd50u, global_step_ * 1024 + options_.rank);
    const bool fixed_compute = FixedComputeStep();
    PSTRAIN_RETURN_IF_ERROR(RunStep(batch, dropout_seed));
    if (!fixed_compute) {  // A bench-only step has no loss or logits of its own.
      PSTRAIN_RETURN_IF_ERROR(EnqueueStats(batch, slot));
      slot = (slot + 1) % kStatsSlots;
      PSTRAIN_RETURN_IF_ERROR(CollectStats(slot));  // The oldest step's.
    }
    if (!options.tail) ++global_step_;
    ++stats.steps;
    stats.samples += batch.n;
    if (updater_->LastUpdateApplied()) stats.applied_samples += batch.n;
    if (options.progress_every > 0 && (s + 1) % options.progress_every == 0 && s + 1 < steps) {
      report(s + 1);
    }
  }
  for (int i = 1; i < kStatsSlots; ++i) {  // The steps still pending, oldest first.
    PSTRAIN_RETURN_IF_ERROR(CollectStats((slot + i) % kStatsSlots));
  }
  PSTRAIN_RETURN_IF_ERROR(model_->backend()->Synchronize());
  stats.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  stats.mean_loss = epoch_loss_batches_ ? epoch_loss_sum_ / epoch_loss_batches_ : 0;
  stats.train_accuracy = epoch_seen_ ? static_cast<double>(epoch_correct_) / epoch_seen_ : 0;
  stats.samples_per_sec = stats.seconds > 0 ? stats.samples / stats.seconds : 0;
  report(steps);
  return stats;
}

}  // namespace pstrain
