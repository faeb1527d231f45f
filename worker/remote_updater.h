// RemoteUpdater: the ParameterUpdater that trains against the parameter
// servers through a PsClient, in the job's consistency mode.
//
//   RemoteUpdaterOptions options = RemoteUpdaterOptionsFromJob(assignment.spec(), rank);
//   PSTRAIN_ASSIGN_OR_RETURN(auto updater,
//                            RemoteUpdater::Create(options, model.get(), ps_client.get()));
//   PSTRAIN_RETURN_IF_ERROR(updater->Start());        // pulls the current model
//   ... Trainer::Create(model.get(), updater.get(), ...); trainer->RunEpoch(...) ...
//   PSTRAIN_RETURN_IF_ERROR(updater->Finish());       // the server's final model
//
// Step flow (sync, async, ssp):
//   BeforeStep(t)        waits for the pull issued at the end of step t-1 and
//                        puts the values into model.param(i).
//   OnGradientsReady     (during backward, per layer) stages the layer's
//                        gradients on the host and hands them to the PsClient:
//                        backward never waits for the network.
//   ApplyUpdate(t)       pushes what is left (batch-norm running statistics as
//                        KIND_PARAMETERS), waits for every push of step t and
//                        issues the pull for step t+1, which travels while the
//                        trainer takes the next batch.
// In sync mode the pull asks for version v+1 of every chunk (the barrier); in
// async and ssp for any version (ssp passes its clock so that the server can
// hold a worker that is more than `staleness` steps ahead).
//
// Average mode (K = averaging_frequency): a LocalUpdater applies the job's
// optimizer every step; every K steps the parameters (and the optimizer state
// when average_optimizer_state) are pushed as round r and round r+1 (the mean
// over the workers) is pulled and replaces them. Finish() runs a last round
// when local steps are left over, so that the server holds the final model.
//
// Versions are tracked per chunk: a membership change (new generation) can
// leave chunks one step apart. When a push or pull fails with ABORTED,
// UNAVAILABLE or NOT_FOUND (stale generation, a version that moved on, a
// server restart, a shard that restarted empty),
// the updater drops that step's contribution, pulls every chunk again at its
// current version, and goes on; it retries with backoff until
// `resync_timeout`, then fails.
//
// On the CPU backend the PsClient reads gradients from, and writes pulled
// values into, the model's own tensors (no staging copy); on CUDA it uses
// pinned host buffers filled with asynchronous copies, and a dispatcher
// thread issues each push once the copy's event has completed.
//
// Threads: BeforeStep, OnGradientsReady, ApplyUpdate, Start and Finish are
// called on the trainer's thread only. Cancel() and SetRank() may be called
// from any thread.
#ifndef PSTRAIN_WORKER_REMOTE_UPDATER_H_
#define PSTRAIN_WORKER_REMOTE_UPDATER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/chunking.h"
#include "kernels/backend.h"
#include "pstrain/v1/job.pb.h"
#include "worker/model.h"
#include "worker/ps_client.h"
#include "worker/trainer.h"

namespace pstrain {

// Where the time of one step went, as seen by the updater. Seconds.
struct StepTimings {
  int64_t step = 0;
  double pull_wait_seconds = 0;  // BeforeStep waiting for the pull (and resyncs).
  double compute_seconds = 0;    // BeforeStep's end to ApplyUpdate (forward + backward).
  double push_wait_seconds = 0;  // ApplyUpdate waiting for the step's pushes.
  double total_seconds = 0;      // BeforeStep's start to ApplyUpdate's end.
};

struct RemoteUpdaterOptions {
  v1::ConsistencyMode mode = v1::CONSISTENCY_SYNC;
  int rank = 0;
  // Average mode.
  v1::OptimizerSpec optimizer;  // The local optimizer.
  int averaging_frequency = 1;  // K > 0.
  bool average_optimizer_state = false;
  // Gradients of consecutive layers are gathered into one Push until they
  // reach this many bytes (small tensors cost a call each otherwise), and
  // while an earlier push of the step is still in flight (where the network
  // is the bottleneck a step's pushes then go as two: a shard answers a
  // sync pull in push order, and pushes side by side delivered every
  // layer's chunks late; docs/BENCHMARKS.md, "One push at a time").
  int64_t min_push_bytes = int64_t{256} << 10;
  // Sync mode with JobSpec.pull_compression: parameter pulls offer the
  // values held as the base of a delta (PsClient::ChunkDest::held).
  bool compress_pulls = false;
  // How long a resync keeps retrying ABORTED / UNAVAILABLE.
  absl::Duration resync_timeout = absl::Seconds(60);
  // Called on the trainer's thread at the end of every ApplyUpdate. Cheap.
  std::function<void(const StepTimings&)> on_step;
};

// The options for a job's spec (mode, optimizer, K, state averaging).
RemoteUpdaterOptions RemoteUpdaterOptionsFromJob(const v1::JobSpec& job, int rank);

class RemoteUpdater final : public ParameterUpdater {
 public:
  // `model` and `client` must outlive the updater; the client's plan must be
  // the plan of the model's graph. INVALID_ARGUMENT when they disagree or the
  // options are invalid.
  static absl::StatusOr<std::unique_ptr<RemoteUpdater>> Create(RemoteUpdaterOptions options,
                                                               Model* model, PsClient* client);
  // Waits for the operations in flight (their buffers belong to this object).
  ~RemoteUpdater() override;

  // Pulls every chunk at its current version into the model (blocking).
  // Call once before the first step, and again after an interruption.
  absl::Status Start();

  absl::Status BeforeStep(int64_t step, Model& model) override;
  void OnGradientsReady(int64_t step, int layer, absl::Span<const int> params) override;
  absl::Status ApplyUpdate(int64_t step, Model& model) override;
  // False when the latest step's pushes failed and its contribution was
  // dropped (average mode: always true; a lost round is not tracked).
  bool LastUpdateApplied() const override { return last_applied_; }

  // Ends training: waits for what is in flight and leaves the server's latest
  // model in the model's parameters (average mode: after a last round when
  // local steps are left over; with pull compression, the master values,
  // which checkpoints and downloads hold, in one more pull).
  absl::Status Finish();

  // Makes the next BeforeStep (and any resync) return CANCELLED, and every
  // push and pull in flight end at once (PsClient::CancelAll). Any thread.
  void Cancel() {
    cancelled_.store(true);
    client_->CancelAll();
  }
  bool cancelled() const { return cancelled_.load(); }
  // The worker's rank after a membership change (who pushes running
  // statistics in async and ssp).
  void SetRank(int rank) { rank_.store(rank); }

  // The lowest chunk version the model's parameters hold.
  int64_t version() const;
  // Steps pushed by this worker (the ssp clock).
  int clock() const { return clock_; }
  // Number of resyncs so far (tests and logs).
  int resyncs() const { return resyncs_; }

 private:
  // A float tensor of the model (parameter, gradient or optimizer state) and
  // its host side: the tensor itself on the CPU, a pinned buffer on CUDA.
  struct HostView {
    Tensor* tensor = nullptr;
    float* host = nullptr;
    PinnedBuffer staging;
  };
  struct PushTask {
    std::unique_ptr<Event> ready;  // Null on the CPU.
    v1::ChunkHeader::Kind kind = v1::ChunkHeader::KIND_GRADIENT;
    int clock = 0;
    std::vector<int> chunks;
    const std::vector<HostView>* views = nullptr;
  };
  struct PullOp {
    std::unique_ptr<PendingOp> op;
    std::vector<int> chunks;
  };

  RemoteUpdater(RemoteUpdaterOptions options, Model* model, PsClient* client);
  absl::Status Init();
  bool direct() const { return model_->backend()->type() == DeviceType::kCpu; }
  bool PushesRunningStats() const;

  // Phases of a step.
  absl::Status WaitPulls();
  absl::Status CopyPulledIntoModel();
  // Gathers a layer's gradients into the next push; pushes them once they
  // reach Options::min_push_bytes, unless a gradient push of the step is
  // still in flight: then they wait for the next layers', and go as one push
  // (at the latest FlushGradients, at the end of backward).
  void StageGradients(absl::Span<const int> params);
  void FlushGradients();
  // A gradient push of this step queued, dispatching or not yet answered.
  bool GradientPushInFlight();
  absl::Status PushRunningStats();
  absl::Status WaitPushes();
  void IssuePulls();
  absl::Status AverageRound();

  // Helpers.
  void Dispatch(PushTask task);
  void DispatcherLoop();
  std::vector<std::unique_ptr<PendingOp>> PushChunks(v1::ChunkHeader::Kind kind, int slot,
                                                     int clock, const std::vector<int>& chunks,
                                                     const std::vector<HostView>& views);
  // Sync and average: grouped by chunk_version_ + version_delta; async and
  // ssp: any version. `one_per_chunk` issues a pull per chunk (resync: learns
  // every chunk's own version).
  // `master`: the master values whole (pull compression: Finish).
  std::vector<PullOp> PullChunks(v1::ChunkHeader::Kind kind, int slot,
                                 const std::vector<int>& chunks, std::vector<HostView>& views,
                                 int64_t version_delta, bool one_per_chunk, bool master = false);
  // Waits for `ops`; records each group's version. First error.
  absl::Status WaitPullOps(std::vector<PullOp>& ops, bool record_versions);
  absl::Status Resync();
  // Pull compression: every chunk's master values at its version, whole.
  absl::Status PullMaster();
  absl::Status CopyStateIntoModel();
  static bool Retryable(const absl::Status& status);

  // Constant after construction.
  const RemoteUpdaterOptions options_;
  Model* const model_;
  PsClient* const client_;
  const ChunkPlan plan_;

  // Trainer thread only.
  std::vector<HostView> params_;  // Index = model parameter.
  std::vector<HostView> grads_;   // Trainable parameters only.
  std::vector<std::vector<HostView>> state_;  // [slot][param]: optimizer state (average).
  std::vector<int> state_params_;             // Params with optimizer state (average).
  std::vector<int64_t> chunk_version_;        // Version each chunk's values are at.
  // By chunk: what its parameter values hold, as the shard sent them (pull
  // compression). Sized once: pulls in flight point into it.
  std::vector<PsClient::HeldValues> held_;
  std::vector<int> all_chunks_, trainable_chunks_, running_stat_chunks_;
  // Every chunk in the order a step pushes them: trainable parameters layer by
  // layer in backward order (Model::Backward's), then running statistics.
  // The pipelined sync pull asks for chunks in this order because a shard
  // answers a pull's chunks in request order and each only once its barrier
  // is complete; in forward order a shard's first chunk would be its first
  // layer's, pushed last, and hold back all the others behind it.
  std::vector<int> push_order_chunks_;
  std::vector<PullOp> pulls_;          // Issued by ApplyUpdate.
  bool pulled_not_copied_ = false;     // CUDA: staging holds values not yet in the model.
  absl::Status staging_error_;         // From OnGradientsReady, reported by ApplyUpdate.
  std::unique_ptr<Event> h2d_done_;                 // CUDA: pulled values consumed.
  std::vector<int> gradient_batch_;                 // Chunks staged, not yet pushed.
  int64_t gradient_batch_bytes_ = 0;
  bool need_resync_ = false;
  bool last_applied_ = true;
  int clock_ = 0;
  int resyncs_ = 0;
  int64_t local_steps_ = 0;  // Average mode: steps since the last round.
  std::unique_ptr<LocalUpdater> local_;
  absl::Time step_start_, compute_start_;
  StepTimings timings_;

  std::atomic<bool> cancelled_{false};
  std::atomic<int> rank_{0};

  // Push dispatch (CUDA: a thread waits on each task's event, then pushes).
  absl::Mutex mu_;
  std::deque<PushTask> tasks_ ABSL_GUARDED_BY(mu_);
  int tasks_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::unique_ptr<PendingOp>> pushes_ ABSL_GUARDED_BY(mu_);
  absl::Status dispatch_error_ ABSL_GUARDED_BY(mu_);
  bool stop_dispatcher_ ABSL_GUARDED_BY(mu_) = false;
  std::thread dispatcher_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_REMOTE_UPDATER_H_
