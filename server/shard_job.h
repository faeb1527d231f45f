// ShardJob: one job's state on one parameter shard (server/parameter_shard.h
// holds the map of them): its chunk plan, membership and chunks
// (server/shard_chunk.h) with their versions, exactly-once records and
// consistent cuts, and the AggregationPolicy chosen once from the job's mode
// (server/aggregation/aggregation_policy.h). It validates a call, takes the
// chunk's lock and hands the chunk to the policy.
//
// Layout of the state, from coarse to fine:
//  * ShardJob::mu_ guards the job's membership (who may push, which
//    generation). ShardJob::control_mu_ serialises SetMembers and Drop, which
//    update the job, then its policy, then every chunk.
//  * ShardChunk::mu guards one chunk's version, published snapshot and
//    barrier. Pushes to different chunks run in parallel; a Pull waits on its
//    chunk's mutex (absl::Mutex::AwaitWithDeadline), so an update wakes only
//    the pulls of that chunk. Every chunk holds its own pointer to the
//    (shared, immutable) ShardMembership, replaced under ShardChunk::mu by
//    SetMembers, so that a push's membership check and the barrier it joins
//    see the same set.
//  * The policies' own mutexes: SspPolicy::clock_mu_ (the ssp clocks) and
//    PushPacer::mu_ (a sync job's push pacing).
//  * The server's optimizer takes no lock of its own (ServerOptimizer, in
//    server/aggregation/server_optimizer.h): a chunk's optimizer state is
//    touched only under that chunk's mu, so updates of different chunks of
//    one job run on as many threads as push them.
// Lock order: ShardJob::control_mu_ first. Under it, ShardJob::mu_, each
// ShardChunk::mu, SspPolicy::clock_mu_ and PushPacer::mu_ are taken one at a
// time, never two of them together. ParameterShard::mu_ is a leaf: it is
// never held while a ShardJob lock is taken.
#ifndef PSTRAIN_SERVER_SHARD_JOB_H_
#define PSTRAIN_SERVER_SHARD_JOB_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/aggregation/aggregation_policy.h"
#include "server/parameter_shard.h"
#include "server/shard_chunk.h"

namespace pstrain {

// One job on one shard. Thread-safe; see the lock notes at the top of the file.
class ShardJob {
 public:
  ShardJob() = default;
  ShardJob(const ShardJob&) = delete;
  ShardJob& operator=(const ShardJob&) = delete;

  absl::Status Init(const ShardJobConfig& config, const std::vector<v1::ChunkValues>& initial,
                    const ParameterShard::Options& options);
  // The barriers that the removal of members completed.
  absl::StatusOr<PushOutcome> SetMembers(const std::vector<std::string>& members,
                                         int64_t generation, v1::SetMembersResponse* response);
  void Drop();
  absl::StatusOr<int64_t> Push(const PushArgs& args, absl::Span<const float> values,
                               bool reject_non_finite, PushOutcome* outcome);
  absl::StatusOr<PulledChunk> Pull(const PullArgs& args, absl::Time deadline);
  absl::StatusOr<std::vector<v1::ChunkValues>> ReadChunks(
      const ParameterShard::ReadOptions& options, absl::Time deadline);
  const ChunkPlan& plan() const { return plan_; }

  // Push pacing (ParameterShard::WatchPace, PaceSlack).
  bool WatchPace(std::weak_ptr<PaceWatcher> watcher) {
    return policy_->WatchPace(std::move(watcher));
  }
  int64_t PaceSlack(const std::string& worker_id, int64_t version) const {
    return policy_->PaceSlack(worker_id, version);
  }

  // Calls admitted and waiting now (ShardStats::waiting_pulls, waiting_cuts).
  int64_t waiting_pulls() const { return waiting_pulls_.load(std::memory_order_relaxed); }
  int64_t waiting_cuts() const { return waiting_cuts_.load(std::memory_order_relaxed); }

 private:
  // Counts a call in `counter` for as long as it waits.
  class Waiting {
   public:
    explicit Waiting(std::atomic<int64_t>& counter) : counter_(counter) {
      counter_.fetch_add(1, std::memory_order_relaxed);
    }
    ~Waiting() { counter_.fetch_sub(1, std::memory_order_relaxed); }
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;

   private:
    std::atomic<int64_t>& counter_;
  };

  std::string Describe(const ShardChunk& chunk) const { return chunk.Describe(job_id_); }

  // Init's phases: the spec and its chunk plan (sets plan_), the initial
  // values against the plan, the policy, and the chunks.
  absl::StatusOr<ModelGraph> PlanJob(const ShardJobConfig& config, const JobLimits& limits,
                                     int shard_index, const std::string& where);
  absl::Status CheckInitialValues(const ModelGraph& graph,
                                  const std::vector<v1::ChunkValues>& initial, int shard_index,
                                  const std::string& where) const;
  static AggregationConfig PolicyConfig(const ShardJobConfig& config,
                                        const ParameterShard::Options& options,
                                        const ChunkPlan& plan);
  absl::Status AddChunks(const ModelGraph& graph, const std::vector<v1::ChunkValues>& initial,
                         int shard_index, std::shared_ptr<const ShardMembership> membership);

  absl::StatusOr<ShardChunk*> FindChunk(int chunk_id) const;
  absl::Status CheckPushKind(const ShardChunk& chunk, const PushArgs& args) const;
  absl::Status CheckPushValues(const ShardChunk& chunk, const PushArgs& args,
                               absl::Span<const float> values, bool reject_non_finite) const;
  absl::Status CheckPullKind(const ShardChunk& chunk, const PullArgs& args) const;
  absl::Status CheckCaller(const ShardMembership& membership, const std::string& worker_id,
                           int64_t generation) const;
  // The chunk's values, version and optimizer slots as they are now.
  absl::StatusOr<v1::ChunkValues> Snapshot(const ShardChunk& chunk)
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu);
  // Takes the chunk's snapshot when it has just reached a wanted cut.
  absl::Status CaptureIfWanted(ShardChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  // ReadChunks at options.at_version > 0: a consistent cut.
  absl::StatusOr<std::vector<v1::ChunkValues>> ReadCut(int64_t version, absl::Time deadline);

  // Constant after Init.
  std::string job_id_;
  ChunkPlan plan_;
  std::vector<std::string> slot_names_;
  std::unique_ptr<AggregationPolicy> policy_;
  std::vector<int> local_index_;  // Chunk id -> index in chunks_, or -1.
  std::vector<std::unique_ptr<ShardChunk>> chunks_;

  absl::Mutex control_mu_;  // Serialises SetMembers and Drop.

  mutable absl::Mutex mu_;
  std::shared_ptr<const ShardMembership> membership_ ABSL_GUARDED_BY(mu_);

  std::atomic<int64_t> waiting_pulls_{0}, waiting_cuts_{0};
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_SHARD_JOB_H_
