// ParameterShard: the versioned parameter store of one server shard, for
// every job, with the consistency modes and the server-side optimizer. No
// gRPC here: server/ps_service.* decodes the wire and calls this.
//
//   ParameterShard shard({.shard_index = 0});
//   PSTRAIN_RETURN_IF_ERROR(shard.ConfigureJob(config, initial_chunks));
//   // A worker's push of chunk 3's gradient computed from version 7:
//   PSTRAIN_ASSIGN_OR_RETURN(int64_t v, shard.Push(args, gradient));
//   // Its pull of chunk 3 at version >= 8 (blocks until the sync step applied):
//   PSTRAIN_ASSIGN_OR_RETURN(PulledChunk c, shard.Pull(pull_args, deadline));
//
// Versions count updates of a chunk. The job's mode chooses, once, its
// aggregation policy (server/aggregation/, each file with the details):
//  * sync (sync_policy.h): version t -> t+1 once every member has pushed its
//    gradient for t; the mean gradient is applied once with the optimizer. A
//    push for another version than the chunk's current one is rejected
//    (future: INVALID_ARGUMENT, past: ABORTED).
//  * async (async_policy.h): every push is applied on arrival (version += 1);
//    its staleness (current version - pushed version) is recorded. Future
//    versions: INVALID_ARGUMENT.
//  * ssp (bound s; ssp_policy.h): as async; in addition a Pull from a worker
//    whose clock is c waits until every member's clock (steps pushed) is
//    >= c - s.
//  * average (K; average_policy.h): pushes carry parameters (and optimizer
//    state when average_optimizer_state) for round t; once every member
//    pushed, the mean becomes version t+1. No optimizer runs on the server.
// Non-trainable chunks (batch-norm running statistics) take KIND_PARAMETERS
// pushes in every mode: sync and average keep the mean over members per
// version like trainable ones in average mode; async and ssp take the last
// write. Their version follows the pushes.
//
// Exactly once: a push with an update id (PushArgs::incarnation non-zero,
// update_seq) is applied at most once. Per chunk the shard remembers, for
// every member, its current incarnation and the last update_seq applied to
// the chunk's values and to each optimizer slot; a push at or below it is a
// duplicate (a retry of an update already applied, e.g. after a cut
// stream) and is acknowledged with the chunk's version without being
// applied. A newer incarnation of a member replaces the record. In the
// barrier modes a member that already contributed to the pending barrier
// and pushes a newer update for the same version (it resynchronised after a
// failed step) is acknowledged too: its first contribution stands. The
// records are bounded by the member set (SetMembers forgets the others).
// Pushes without an update id are applied as before, and a second one for
// the same barrier is INVALID_ARGUMENT.
//
// Every push is validated before anything is touched (unknown job or worker,
// stale generation, chunk not owned here, wrong element count or kind for the
// mode, non-finite values when rejected, version from the future, values
// whose sum with the other members' overflows float in sync and average
// modes); on error the model is unchanged.
//
// Membership (SetMembers):
//  * A removed member's push already in a pending barrier stays in its mean
//    (it was computed from the right version); the barrier then completes as
//    soon as every remaining member has pushed.
//  * A pull checks job, generation and membership once, on entry; an admitted
//    pull of a member that stays keeps waiting across a generation change.
//  * ssp: a member that joins starts at the slowest clock of those that stay.
//  * A generation older than the current one is INVALID_ARGUMENT.
//  * A member that stays may go on pushing and pulling with any generation
//    from the one it joined at to the current one (it learns the new one
//    from its next heartbeat; its updates in between are valid).
//  * Each trainable chunk records the highest worker_clock accepted from
//    each member; SetMembers reports a removed member's steps (the lowest
//    over the chunks), from which server 0 knows what it did not train.
// Pull compression (JobSpec.pull_compression, sync mode; sync_policy.h):
// each step's change of a trainable chunk is encoded once and sent as a
// delta to a worker holding the previous version of the job's current values
// epoch (drawn by ConfigureJob); any other pull gets the published values
// whole. ReadChunks (checkpoints) and pulls with PullArgs::master read the
// master values.
//
// Optimizer state is pulled (KIND_OPTIMIZER_STATE) only in average mode with
// average_optimizer_state; in the other modes it lives in the server's
// optimizer and is read with ReadChunks (checkpoints). ConfigureJob accepts
// a chunk's version and slots (as ReadChunks returns them) to resume.
//
// Threads: thread-safe. Pull blocks the calling thread until the version is
// there or the deadline passes; everything else returns promptly. Pushes to
// different chunks run in parallel (one lock per chunk); an update wakes only
// the pulls of its chunk. A PulledChunk's values never change: an update
// writes in place only when no snapshot of the chunk is held, else it copies
// (server/shard_chunk.h). Destroy the shard only when no call is in flight.
// The locks and their order: the top of shard_job.h.
#ifndef PSTRAIN_SERVER_PARAMETER_SHARD_H_
#define PSTRAIN_SERVER_PARAMETER_SHARD_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/chunking.h"
#include "common/job_spec.h"
#include "common/model_graph.h"
#include "common/rpc/gradient_codec.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/service.pb.h"
#include "server/pace_lead_tuner.h"
#include "server/shard_calls.h"

namespace pstrain {

struct ShardJobConfig {
  std::string job_id;
  v1::JobSpec spec;  // Model inline.
  int num_shards = 1;
  int64_t chunk_bytes = kAutoChunkBytes;  // 0: AutoChunkBytes, as workers plan.
  std::vector<std::string> members;       // Active worker ids.
  int64_t generation = 1;
};

// Counters for /metrics and tests. Monotonic.
struct ShardStats {
  int64_t pushes = 0, pulls = 0;
  // push_bytes: payload bytes received; push_represented_bytes: the F32
  // bytes those payloads decode to (their ratio is the compression).
  int64_t push_bytes = 0, push_represented_bytes = 0, pull_bytes = 0;
  // The F32 bytes the pulls' payloads stand for (pull compression sends
  // deltas: fewer bytes than this).
  int64_t pull_represented_bytes = 0;
  int64_t rejected_pushes = 0;
  // Pushes acknowledged without being applied: a retried update already
  // applied, or a second gradient of a member for a barrier it is in.
  int64_t duplicate_pushes = 0;
  int64_t applied_updates = 0;
  std::vector<int64_t> staleness_counts;  // [s] = pushes with staleness s (last bucket: >=).
  // Sync and average barriers completed, by how long each waited from its
  // first member's push to its last: [i] = waits <= kBarrierWaitBounds[i],
  // the last bucket the rest. What the slowest member costs the others.
  std::vector<int64_t> barrier_wait_counts;
  double barrier_wait_seconds = 0;  // Their sum.
  // Highest chunk version a push or pull of each configured job has seen
  // (its live model version); a job leaves the map when it is dropped.
  std::map<std::string, int64_t> model_version_by_job;
  // Gauges, not counts: pulls admitted (caller checked) and waiting now for a
  // version, a barrier or the slowest clock; ReadChunks cuts waiting now for
  // their version. Over the configured jobs.
  int64_t waiting_pulls = 0, waiting_cuts = 0;
};

// Upper bounds of ShardStats::barrier_wait_counts' buckets, in seconds.
inline constexpr double kBarrierWaitBounds[] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                                                0.2,   0.5,   1,     2,    5,    10};

// What ParameterShard::ReadChunks returns (see there).
struct ShardReadOptions {
  int64_t at_version = 0;      // > 0: a consistent cut at this version.
  bool versions_only = false;  // Chunk ids and versions only.
};

class ShardJob;  // server/shard_job.h: one job on this shard.

class ParameterShard {
 public:
  static constexpr int kAutoPaceLead = -1;  // Options::pace_lead_frames.
  struct Options {
    int shard_index = 0;
    bool reject_non_finite = true;
    // Pushes more than this many versions ahead are "from the future".
    int64_t max_version_lead = 0;
    int staleness_buckets = 16;
    // ConfigureJob refuses a job beyond these (INVALID_ARGUMENT), and ids
    // (job, members) longer than max_id_bytes.
    JobLimits job_limits = {};
    int max_id_bytes = 128;
    // Push pacing of sync jobs: a member may push at most this many frames
    // of a version more than the slowest member has pushed here (0: no
    // pacing). Frames of one version reach the shards' ports in step, so
    // that a chunk's barrier does not wait for the push that TCP served
    // last (docs/BENCHMARKS.md, "Push pacing"). kAutoPaceLead: each job
    // chooses among pace_tuner.leads by timing its steps (PaceLeadTuner).
    int pace_lead_frames = kAutoPaceLead;
    PaceLeadTuner::Options pace_tuner = {};
    // Told what a job's lead tuner chose, when the choice is first made or
    // changes (null: not told).
    std::function<void(const std::string&)> log = nullptr;
    // Times barrier waits (tests pass a fake one).
    std::function<absl::Time()> clock = [] { return absl::Now(); };
  };
  explicit ParameterShard(Options options);
  ~ParameterShard();

  // Creates or replaces a job. `chunks` holds the initial values (and,
  // optionally, optimizer slots) of every chunk this shard owns in
  // PlanChunks(...).by_shard[shard_index] order. INVALID_ARGUMENT when they
  // do not match the plan or the spec is invalid.
  absl::Status ConfigureJob(const ShardJobConfig& config,
                            const std::vector<v1::ChunkValues>& chunks);
  // New member set and generation: removed members leave every barrier at
  // once (a pending sync step completes if the rest have pushed) and their
  // blocked pulls fail with ABORTED. `response` (may be null) receives, for
  // each member removed, its steps held here (SetMembersResponse.removed).
  absl::Status SetMembers(const std::string& job_id, const std::vector<std::string>& members,
                          int64_t generation, v1::SetMembersResponse* response = nullptr);
  // Forgets the job; blocked pulls fail with ABORTED.
  absl::Status DropJob(const std::string& job_id);
  // The ids of the jobs held, sorted.
  std::vector<std::string> JobIds() const;

  // Validates and applies (or records, until its barrier completes) one
  // chunk. Returns the chunk's version after the call.
  absl::StatusOr<int64_t> Push(const PushArgs& args, absl::Span<const float> values);
  // Waits until the chunk reaches args.min_version (and the ssp bound allows
  // the requester's clock), or `deadline` (DEADLINE_EXCEEDED).
  absl::StatusOr<PulledChunk> Pull(const PullArgs& args, absl::Time deadline);

  // Push pacing (sync jobs when Options::pace_lead_frames != 0; false for
  // others): `watcher`, held weakly, is told whenever the job's slowest
  // member has pushed more here or left.
  absl::StatusOr<bool> WatchPace(const std::string& job_id, std::weak_ptr<PaceWatcher> watcher);
  // How many more frames of `version` `worker_id` may push here now: the
  // slowest member's frames of that version, plus the lead, less its own
  // (>= 0; a large number for a version already past).
  absl::StatusOr<int64_t> PaceSlack(const std::string& job_id, const std::string& worker_id,
                                    int64_t version) const;

  // Every owned chunk with its version and optimizer slots (checkpoints).
  // `options.at_version` > 0 (sync and average modes): a consistent cut,
  // each chunk as it was when it reached that version; a chunk below it is
  // waited for until `deadline` (DEADLINE_EXCEEDED), one past it is
  // FAILED_PRECONDITION. `options.versions_only`: ids and versions only.
  using ReadOptions = ShardReadOptions;
  absl::StatusOr<std::vector<v1::ChunkValues>> ReadChunks(const std::string& job_id,
                                                          ReadOptions options = {},
                                                          absl::Time deadline = absl::Now());
  // The chunk plan of a job (for validation at the wire).
  absl::StatusOr<ChunkPlan> Plan(const std::string& job_id) const;

  ShardStats stats() const;
  int shard_index() const { return options_.shard_index; }

 private:
  absl::Status CheckId(const char* what, const std::string& id) const;
  // The job, or NOT_FOUND.
  absl::StatusOr<std::shared_ptr<ShardJob>> FindJob(const std::string& job_id) const;
  void RecordBarrierWaits(absl::Span<const absl::Duration> waits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;  // Constant after construction.
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<ShardJob>> jobs_ ABSL_GUARDED_BY(mu_);
  ShardStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_PARAMETER_SHARD_H_
