// ExternalUpdater: a job's consistency mode over tensors the caller owns (a
// framework's host fp32 parameters and gradients: pstrain.torch through
// pstrain._native), through a PsClient. The twin of RemoteUpdater
// (worker/remote_updater.h), which does the same for the pstrain engine's
// Model; the wire, the versions and the modes' rules are the same.
//
//   ExternalUpdater updater(options, graph, client.get());  // graph: BuildJobGraph(spec)
//   PSTRAIN_RETURN_IF_ERROR(updater.Start(params));  // params[i]: tensor i's values
//   for each step:
//     ... forward, backward: as autograd finishes tensor i's gradient ...
//     updater.GradientReady(i, grad_i);             // pushed in the background
//     PSTRAIN_RETURN_IF_ERROR(updater.Step());      // the rest, then the new values
//   PSTRAIN_RETURN_IF_ERROR(updater.Finish());
//
// Step, by mode:
//   sync   pushes what GradientReady has not sent, and every buffer's values
//          (their mean over the members is the next version's), waits for
//          the pushes, then pulls version v+1 of every chunk into params:
//          the server-side optimizer's step, the same on every member.
//   async  the same, pulling whatever version the shards hold; buffers are
//   ssp    pushed by rank 0 only (the last write is kept). ssp passes the
//          worker's clock, so that a shard holds a worker that runs more
//          than the job's staleness ahead of the slowest.
//   average  nothing travels: the caller's own optimizer changed params.
//          Every K steps (JobSpec.averaging_frequency) the params are
//          pushed as round r and round r+1, the mean over the members,
//          replaces them. Finish runs a last round when steps are left over.
// Overlapped pulls (sync, Options.overlap_pulls): Step returns once the
// pushes are done and the pulls of version v+1 are issued, in buckets of
// consecutive tensors (graph order, which is the module's forward order)
// of at least pull_bucket_bytes. WaitParams(tensors) waits for the buckets
// that hold them (a forward pre-hook per module: a layer's forward waits
// only for its own weights, while the later ones are still arriving);
// Settle() waits for all of them. GradientReady, Step, Finish and
// version() settle first, so nothing reads a chunk's version, or pushes,
// before its pull is in. Until then the caller must not read a tensor it
// has not waited for.
// Finish: average mode's last round; async and ssp pull the servers' model
// (the others' last pushes came after this member's last pull); sync holds
// it already.
// A push or pull that fails with ABORTED, UNAVAILABLE or NOT_FOUND (a new
// generation after a member was lost, a restarting shard) drops the step's
// contribution and pulls every chunk again at its current version, with
// backoff, for at most resync_timeout; resyncs() counts them.
//
// Memory: params and gradients are read and written in place (no staging
// copy): params must stay valid from Start to Finish (or the destructor,
// which cancels and waits for pulls in flight), and a gradient given to
// GradientReady until the next Step returns. Nothing may write params
// while Step or Finish runs, nor a tensor whose overlapped pull is in
// flight.
//
// Threads: one thread at a time (the training loop's); Cancel() from any.
#ifndef PSTRAIN_WORKER_EXTERNAL_UPDATER_H_
#define PSTRAIN_WORKER_EXTERNAL_UPDATER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "pstrain/v1/job.pb.h"
#include "worker/ps_client.h"

namespace pstrain {

class ExternalUpdater {
 public:
  struct Options {
    v1::ConsistencyMode mode = v1::CONSISTENCY_SYNC;
    int rank = 0;
    int averaging_frequency = 5;  // Average mode's K (>= 1).
    absl::Duration resync_timeout = absl::Seconds(120);
    // Gradients GradientReady collects before it pushes them (one push
    // per call would cost a round trip per small tensor).
    int64_t min_push_bytes = int64_t{256} << 10;
    // Sync only: Step issues the next version's pulls and returns (see
    // "Overlapped pulls" above), in buckets of at least this many bytes.
    bool overlap_pulls = false;
    int64_t pull_bucket_bytes = int64_t{1} << 20;
  };
  // Options for `spec`'s mode as member `rank`.
  static Options OptionsFromJob(const v1::JobSpec& spec, int rank);

  // `client` must outlive the updater; its plan is `graph`'s.
  ExternalUpdater(Options options, const ModelGraph& graph, PsClient* client);
  ~ExternalUpdater();  // Waits for what is in flight (Cancel() first to end it at once).
  ExternalUpdater(const ExternalUpdater&) = delete;
  ExternalUpdater& operator=(const ExternalUpdater&) = delete;

  // Binds params[i] (graph.params[i]'s elements) and pulls the current
  // model into them. INVALID_ARGUMENT for a wrong count or a null pointer.
  absl::Status Start(std::vector<float*> params);
  // Trainable tensor `param`'s gradient is complete in `grad` (its
  // elements): queued for the push, sent once min_push_bytes are queued.
  // Ignored in average mode. INVALID_ARGUMENT for a buffer, an index out of
  // range, or a tensor already given this step.
  absl::Status GradientReady(int param, const float* grad);
  // Ends the step (see the top of this file). A trainable tensor whose
  // gradient never came (unused in this step's graph) pushes zeros.
  absl::Status Step();
  absl::Status Finish();
  // Overlapped pulls: waits until tensors `params` hold the new version
  // (OK at once without pulls in flight). A pull that fails settles all of
  // them, resynchronising as Step does, and returns what that returned.
  absl::Status WaitParams(const std::vector<int>& params);
  // Waits for every pull in flight (as WaitParams).
  absl::Status Settle();
  // Ends every call in flight; later calls return CANCELLED.
  void Cancel();
  // After a membership change (new rank: async and ssp buffers).
  void SetRank(int rank) { rank_.store(rank); }

  int64_t version() const;  // The lowest version the params hold.
  int resyncs() const { return resyncs_; }
  int64_t steps() const { return steps_; }

 private:
  struct PullOp {
    std::unique_ptr<PendingOp> op;
    std::vector<int> chunks;
    bool waited = false;
    absl::Status status;  // Once waited.
  };
  // Issues pulls of `chunks` (in this order) at chunk_version_ +
  // version_delta, one op per group of `bucket_bytes` (0: one per chunk).
  std::vector<PullOp> IssuePulls(const std::vector<int>& chunks, int64_t version_delta,
                                 int64_t bucket_bytes);
  // Waits for `pull` once, taking its chunks' version; its status.
  absl::Status Collect(PullOp& pull);
  void PushChunks(v1::ChunkHeader::Kind kind, const std::vector<int>& chunks,
                  const std::vector<const float*>& sources);
  void FlushGradients();
  absl::Status WaitPushes();
  absl::Status PullParams(int64_t version_delta, bool one_per_chunk);
  absl::Status Resync();
  absl::Status AverageRound();
  static bool Retryable(const absl::Status& status);
  bool cancelled() const { return cancelled_.load(); }

  // Constant after construction.
  const Options options_;
  const ModelGraph graph_;
  PsClient* const client_;
  const ChunkPlan& plan_;

  std::vector<float*> params_;
  std::vector<const float*> grads_;          // This step's, by param (null: not yet).
  std::vector<const float*> param_sources_;  // params_ as push sources.
  std::vector<std::vector<float>> zeros_;    // Gradients of unused tensors.
  std::vector<int64_t> chunk_version_;
  std::vector<int> all_chunks_, buffer_chunks_, push_order_chunks_;
  std::vector<int> pending_grads_;  // Chunks queued, not yet pushed.
  int64_t pending_bytes_ = 0;
  std::vector<std::unique_ptr<PendingOp>> pushes_;
  std::vector<int> forward_order_chunks_;      // Graph order: the overlapped pulls'.
  std::vector<PullOp> inflight_;               // Overlapped pulls not settled yet.
  std::vector<std::vector<int>> param_pulls_;  // Param -> its ops in inflight_.
  absl::Status deferred_;                      // A failed settle in GradientReady, for Step.
  int clock_ = 0;
  int64_t steps_ = 0;
  int64_t local_steps_ = 0;
  int resyncs_ = 0;
  bool started_ = false;
  std::atomic<bool> cancelled_{false};
  std::atomic<int> rank_{0};
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_EXTERNAL_UPDATER_H_
