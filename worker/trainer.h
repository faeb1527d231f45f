// The training loop, in named phases, with seams for the parameter server.
//
//   PSTRAIN_ASSIGN_OR_RETURN(auto updater, LocalUpdater::Create(job.optimizer(), model.get()));
//   PSTRAIN_ASSIGN_OR_RETURN(auto trainer,
//       Trainer::Create(model.get(), updater.get(), &splits.train, preprocess, options));
//   for (int epoch = 0; epoch < job.epochs(); ++epoch) {
//     PSTRAIN_ASSIGN_OR_RETURN(EpochStats stats, trainer->RunEpoch(epoch, nullptr));
//   }
//
// Each step runs: NextBatch (prefetched, already on the device) ▸ BeforeStep
// (the updater may swap parameters in) ▸ Forward ▸ Backward (the updater hears
// of each layer's gradients as soon as they are enqueued) ▸ ApplyUpdate (local
// optimizer step, or a remote one) ▸ statistics of the previous step (read
// one step late so the host never waits for the device in the middle).
//
// Threads: one thread drives a Trainer (and its Model and Backend). Updaters
// that talk to a network do so on their own threads: OnGradientsReady must
// only enqueue, so backward never waits for the network.
#ifndef PSTRAIN_WORKER_TRAINER_H_
#define PSTRAIN_WORKER_TRAINER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/data/dataset.h"
#include "common/data/epoch_work.h"
#include "kernels/optimizer.h"
#include "pstrain/v1/job.pb.h"
#include "worker/data_prefetcher.h"
#include "worker/model.h"

namespace pstrain {

// How parameters change after each step: the seam between the local engine
// and the parameter server.
class ParameterUpdater {
 public:
  virtual ~ParameterUpdater() = default;
  // Before the forward pass of global step `step` (0-based): may overwrite
  // model.param(i) with fresher values (e.g. pulled from a server).
  virtual absl::Status BeforeStep(int64_t step, Model& model) { return absl::OkStatus(); }
  // During backward, on the trainer's thread, once per layer as soon as its
  // gradients are enqueued. Must not block.
  virtual void OnGradientsReady(int64_t step, int layer, absl::Span<const int> params) {}
  // After backward: apply the update. Every gradient is complete here.
  virtual absl::Status ApplyUpdate(int64_t step, Model& model) = 0;
  // Whether the latest ApplyUpdate's update reached the model (false: it
  // was dropped, e.g. a remote step lost to a resync). Counts samples.
  virtual bool LastUpdateApplied() const { return true; }
};

// The standalone updater: a local Optimizer over every trainable parameter.
// Each layer's parameters are updated as soon as backward has produced their
// gradients (the layer's backward is done with them, and no earlier layer
// reads them), while the gradients are still in cache; ApplyUpdate updates
// whatever was not announced and reports the first error. Same results as
// updating everything in ApplyUpdate: each parameter's update reads only its
// own gradient and state.
class LocalUpdater final : public ParameterUpdater {
 public:
  static absl::StatusOr<std::unique_ptr<LocalUpdater>> Create(const v1::OptimizerSpec& spec,
                                                              Model* model);
  absl::Status BeforeStep(int64_t step, Model& model) override;
  void OnGradientsReady(int64_t step, int layer, absl::Span<const int> params) override;
  absl::Status ApplyUpdate(int64_t step, Model& model) override;
  // False after a step the model's fp16 loss scaling skipped.
  bool LastUpdateApplied() const override { return last_applied_; }
  Optimizer& optimizer() { return *optimizer_; }

 private:
  LocalUpdater(std::unique_ptr<Optimizer> optimizer, Model* model)
      : optimizer_(std::move(optimizer)), model_(model) {}
  absl::Status ApplyOne(int slot, int64_t step);

  std::unique_ptr<Optimizer> optimizer_;
  Model* const model_;
  std::vector<std::pair<int, int>> slots_;  // (model param index, optimizer index).
  std::vector<int> slot_of_param_;          // Per model param: index into slots_, or -1.
  std::vector<bool> applied_;               // Per slot: updated during this step.
  absl::Status deferred_error_;             // From OnGradientsReady, for ApplyUpdate.
  bool last_applied_ = true;
};

struct TrainerOptions {
  int batch_size = 64;
  uint64_t seed = 0;  // Shuffling, augmentation and dropout.
  int rank = 0;
  int world_size = 1;
  bool augment = false;
  bool balance = false;  // Class-balanced epochs (DatasetSpec.balance).
  int prefetch_batches = 4;
  int loader_threads = 1;
  // BENCH ONLY (pstrain-worker --bench_only_fixed_compute_ms; never from a
  // job spec): when positive, every step after the first runs no Forward or
  // Backward. It sleeps this long instead, then hands every layer's
  // gradients to the updater (in backward order) as backward would: the
  // gradients of the first step, which ran for real, pushed again. The
  // model does not learn and the step statistics stay at zero; the point is
  // to make the network the bottleneck on a machine without compute to
  // spare (bench/cluster_emulation.sh).
  absl::Duration bench_only_fixed_compute = absl::ZeroDuration();
};

// Batch size, seed, augmentation and prefetch settings of `job` (rank and
// world size stay 0 and 1).
TrainerOptions TrainerOptionsFromJob(const v1::JobSpec& job);

struct EpochStats {
  int epoch = 0;
  int64_t steps = 0;
  int64_t samples = 0;
  // Samples whose update reached the model (samples minus the steps the
  // updater dropped).
  int64_t applied_samples = 0;
  double mean_loss = 0;
  double train_accuracy = 0;
  double seconds = 0;
  double samples_per_sec = 0;
  double data_wait_seconds = 0;  // Time the loop waited for the prefetcher.
};

// Called every `progress_every` steps and at the end of the epoch.
struct StepProgress {
  int epoch = 0;
  int64_t step_in_epoch = 0, steps_in_epoch = 0, global_step = 0;
  double mean_loss = 0, train_accuracy = 0, samples_per_sec = 0;
};
using ProgressFn = std::function<void(const StepProgress&)>;

// How Trainer::RunSegment runs a piece of an epoch's work.
struct SegmentOptions {
  int64_t first_step = 0;  // Steps of the segment trained already (a resumed run).
  // Work redistributed from a lost worker (a tail): its steps do not move
  // global_step() (the data position) and draw their own dropout seeds.
  bool tail = false;
  int tail_index = 0;  // Distinguishes the tails of one epoch (seeds).
  int64_t progress_every = 100;
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(Model* model, ParameterUpdater* updater,
                                                         const data::ImageDataset* train,
                                                         data::Preprocess preprocess,
                                                         TrainerOptions options);

  // Runs one epoch over this rank's shard, from step `first_step` of it (a
  // resumed run; 0..steps_per_epoch()). Every sample of the shard is
  // trained: the last step also takes the shard's remainder (fewer than
  // batch_size more samples).
  absl::StatusOr<EpochStats> RunEpoch(int epoch, const ProgressFn& progress,
                                      int64_t progress_every = 100, int64_t first_step = 0);
  // Trains `segment` (positions of its epoch's order, in segment.steps
  // steps; common/data/epoch_work.h). `epoch` is the epoch being trained
  // (reports); the segment's own epoch picks the samples.
  absl::StatusOr<EpochStats> RunSegment(int epoch, const data::WorkSegment& segment,
                                        const ProgressFn& progress, SegmentOptions options);
  // This rank's share of `epoch` (BaseRange with the trainer's rank and
  // world size) and its steps.
  data::WorkSegment BaseSegment(int epoch) const;
  // Positions in one epoch's order (samples of an epoch).
  int64_t epoch_length() const { return epoch_length_; }

  // How long the current step waited for its batch, and how many batches are
  // ready in the prefetcher now (for step metrics; trainer thread only).
  double last_data_wait_seconds() const { return last_data_wait_seconds_; }
  int prefetch_queue_depth() const { return prefetcher_->queue_depth(); }

  int64_t global_step() const { return global_step_; }
  void set_global_step(int64_t step) { global_step_ = step; }
  // Equal on every rank of a job (see Create).
  int64_t steps_per_epoch() const { return steps_per_epoch_; }

 private:
  struct PendingStats;  // Loss, logits and labels of a step, read one step late.
  Trainer(Model* model, ParameterUpdater* updater, TrainerOptions options)
      : model_(model), updater_(updater), options_(options) {}
  absl::Status RunStep(const DeviceBatch& batch, uint64_t dropout_seed);
  // TrainerOptions::bench_only_fixed_compute: whether this step replaces
  // Forward and Backward (every step after the first real one).
  bool FixedComputeStep() const;
  absl::Status RunFixedComputeStep();
  // Dataset indices of `range` (cached per epoch).
  std::vector<int64_t> SamplesOf(const data::WorkRange& range);
  absl::Status EnqueueStats(const DeviceBatch& batch, int slot);
  absl::Status CollectStats(int slot);

  // Constant after construction.
  Model* const model_;
  ParameterUpdater* const updater_;
  const TrainerOptions options_;

  std::unique_ptr<DataPrefetcher> prefetcher_;
  const data::ImageDataset* train_ = nullptr;
  int64_t epoch_length_ = 0;
  int64_t steps_per_epoch_ = 0;
  int order_epoch_ = -1;        // Epoch whose order order_ holds.
  std::vector<int64_t> order_;  // Dataset index at each position.
  int64_t global_step_ = 0;
  bool ran_real_step_ = false;  // For bench_only_fixed_compute.
  double last_data_wait_seconds_ = 0;
  // Host copies of each step's loss, logits and labels, read kStatsSlots - 1
  // steps late, so that the host queues that many steps ahead of the device
  // instead of waiting for each (on a GPU, launching a small model's step
  // takes about as long as running it).
  static constexpr int kStatsSlots = 3;
  std::vector<PinnedBuffer> stats_host_;
  std::vector<std::unique_ptr<Event>> stats_event_;
  std::vector<int> stats_batch_;
  std::vector<int64_t> stats_step_;  // The global step each slot holds.
  double epoch_loss_sum_ = 0;
  int64_t epoch_correct_ = 0, epoch_seen_ = 0, epoch_loss_batches_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_TRAINER_H_
