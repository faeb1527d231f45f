// AggregationPolicy: what one consistency mode does with the pushes and
// pulls of a job's chunks. ShardJob (server/shard_job.cc) is the store of
// one job on a shard: it finds the chunk, validates the call (ids, generation,
// membership, element count, finite values, exactly-once records) and holds
// the chunk's lock; the policy, chosen once when the job is configured,
// decides what a validated push does to the chunk and what a pull returns.
// A policy sees chunks, members and versions, never a model: any worker that
// cuts its parameters into chunks can use it.
//
//   AggregationConfig config;
//   config.job_id = "j";
//   config.mode = v1::CONSISTENCY_SYNC;
//   config.optimizer = spec.optimizer();
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<AggregationPolicy> policy,
//                            CreateAggregationPolicy(config));
//   { absl::MutexLock lock(&chunk.mu); policy->AddChunk(chunk, initial); }
//   ...
//   absl::MutexLock lock(&chunk.mu);
//   PSTRAIN_RETURN_IF_ERROR(policy->Push(chunk, args, gradient, &outcome));
//
// The modes (versions count updates of a chunk):
//  * sync (sync_policy.h): a barrier per version; the mean gradient is
//    applied once with the server's optimizer. Pull compression and push
//    pacing are sync's.
//  * async (async_policy.h): every push applied on arrival, staleness
//    recorded.
//  * ssp (ssp_policy.h): async, and a pull waits for the slowest member's
//    clock within the staleness bound.
//  * average (average_policy.h): a barrier per round; the mean of the pushed
//    parameters (and optimizer state) becomes the next version.
//
// To add a mode: implement this interface in server/aggregation/<mode>_policy.
// {h,cc}, add its case to CreateAggregationPolicy, and give it a test in
// tests/server/aggregation/.
//
// Threads: the configuration calls (AddChunk, FinishConfiguration) come
// first, from one thread. After them every method may be called from any
// thread at once; those annotated with a chunk's `mu` are called with it
// held, and may take no other lock. The others are called with no store
// lock held, except the membership hooks, which the store serialises (its
// control mutex). A policy's own mutexes are leaves.
#ifndef PSTRAIN_SERVER_AGGREGATION_AGGREGATION_POLICY_H_
#define PSTRAIN_SERVER_AGGREGATION_AGGREGATION_POLICY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "pstrain/v1/job.pb.h"
#include "server/pace_lead_tuner.h"
#include "server/shard_calls.h"
#include "server/shard_chunk.h"

namespace pstrain {

// The optimizer-state slots of one trainable parameter, named as in
// Optimizer::StateTensors() and v1::OptimizerSlot.
std::vector<std::string> OptimizerSlotNames(const v1::OptimizerSpec& spec);

// What a policy is made from. Each field says which modes read it.
struct AggregationConfig {
  std::string job_id;
  v1::ConsistencyMode mode = v1::CONSISTENCY_SYNC;  // Not UNSPECIFIED.
  // sync, async, ssp: the server's optimizer. Every mode: the slot names.
  v1::OptimizerSpec optimizer;
  int staleness = 0;                     // ssp: the bound s.
  bool average_optimizer_state = false;  // average.
  // async, ssp: pushes more than this many versions ahead are refused.
  int64_t max_version_lead = 0;
  // sync: pull compression, and the chunks (by id) it sends whole anyway
  // (ChunksSentWhole, common/rpc/gradient_codec.h).
  v1::CompressionSpec pull_compression;
  std::vector<bool> chunks_sent_whole;
  // sync: push pacing (PushPacer, push_pacer.h). 0: not paced;
  // PushPacer::kAutoLead: chosen by a PaceLeadTuner with `pace_tuner`.
  int pace_lead_frames = 0;
  PaceLeadTuner::Options pace_tuner = {};
  // Told what the lead tuner chose (null: not told).
  std::function<void(const std::string&)> log = nullptr;
  // Times barrier waits and pacing steps.
  std::function<absl::Time()> clock = [] { return absl::Now(); };
};

class AggregationPolicy {
 public:
  explicit AggregationPolicy(const AggregationConfig& config);
  virtual ~AggregationPolicy() = default;
  AggregationPolicy(const AggregationPolicy&) = delete;
  AggregationPolicy& operator=(const AggregationPolicy&) = delete;

  // "sync", "async", "ssp" or "average", for messages.
  virtual const char* name() const = 0;
  const std::string& job_id() const { return job_id_; }
  // The optimizer slots of each trainable chunk, in order.
  const std::vector<std::string>& slot_names() const { return slot_names_; }

  // --- Configuration (first, one thread) ---
  // Readies a chunk the store has filled (id, count, trainable, version,
  // values, membership) for this mode. `initial` holds its configured values
  // and slots, already checked against slot_names().
  virtual absl::Status AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) = 0;
  // After the last AddChunk.
  virtual absl::Status FinishConfiguration() { return absl::OkStatus(); }

  // --- What the mode accepts ---
  // The kind a push to `chunk` carries: KIND_GRADIENT or KIND_PARAMETERS.
  virtual v1::ChunkHeader::Kind PushKind(const ShardChunk& chunk) const = 0;
  // True when `chunk`'s optimizer slots are pushed and pulled too
  // (KIND_OPTIMIZER_STATE).
  virtual bool ExchangesState(const ShardChunk& /*chunk*/) const { return false; }
  // True when every chunk goes through the same versions, so that a job can
  // be read as a consistent cut at one (ParameterShard::ReadChunks).
  virtual bool HasCommonVersions() const = 0;

  // --- Pushes ---
  // Applies, or records until its barrier completes, a validated push of
  // the kind PushKind or ExchangesState allow, not applied before. Checks
  // the version (INVALID_ARGUMENT from the future, ABORTED when stale where
  // the mode refuses those). Sets outcome->duplicate for a push it
  // acknowledges without applying. On error the chunk is unchanged.
  virtual absl::Status Push(ShardChunk& chunk, const PushArgs& args, absl::Span<const float> values,
                            PushOutcome* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) = 0;
  // After an accepted push (duplicates included), with the chunk's lock
  // released: `membership` is the chunk's when the push was accepted.
  virtual void Pushed(const PushArgs& /*args*/, const ShardMembership& /*membership*/,
                      bool /*duplicate*/) {}

  // --- Pulls ---
  // Before a pull waits for its version: waits for what else the mode asks
  // (ssp: the slowest member's clock) until `deadline` (DEADLINE_EXCEEDED);
  // ABORTED when the caller was removed or the job dropped meanwhile.
  virtual absl::Status AwaitPull(const PullArgs& /*args*/, absl::Time /*deadline*/) {
    return absl::OkStatus();
  }
  // What a pull that found the chunk at its version gets: the values (or
  // the slot args.slot for KIND_OPTIMIZER_STATE) and the version.
  virtual PulledChunk Pulled(const ShardChunk& chunk, const PullArgs& args) const
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu);

  // --- Membership (serialised by the store) ---
  // The job's member set becomes `next` (configuration, SetMembers, and
  // Drop with next->dropped), before the chunks adopt it.
  virtual void AdoptMembership(std::shared_ptr<const ShardMembership> /*next*/) {}
  // `chunk` has adopted a new member set (SetMembers): completes what the
  // members removed no longer hold back.
  virtual absl::Status ChunkAdopted([[maybe_unused]] ShardChunk& chunk, PushOutcome* /*outcome*/)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
    return absl::OkStatus();
  }
  // Every chunk has adopted `membership` (SetMembers).
  virtual void MembershipAdopted(const ShardMembership& /*membership*/) {}

  // --- Reading (checkpoints) ---
  // Appends a trainable chunk's optimizer slots, as this mode keeps them.
  virtual absl::Status ReadSlots(const ShardChunk& chunk, v1::ChunkValues* out)
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu) = 0;

  // --- Push pacing (ParameterShard::WatchPace, PaceSlack) ---
  // Unpaced modes: false, and a slack no push reaches.
  static constexpr int64_t kUnpaced = int64_t{1} << 40;
  virtual bool WatchPace(std::weak_ptr<PaceWatcher> /*watcher*/) { return false; }
  virtual int64_t PaceSlack(const std::string& /*worker_id*/, int64_t /*version*/) const {
    return kUnpaced;
  }

 private:
  const std::string job_id_;
  const std::vector<std::string> slot_names_;
};

// The policy of config.mode; INVALID_ARGUMENT for a mode it does not know,
// or the optimizer's error.
absl::StatusOr<std::unique_ptr<AggregationPolicy>> CreateAggregationPolicy(
    const AggregationConfig& config);

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_AGGREGATION_AGGREGATION_POLICY_H_
