// JobRun: one run of one job on the coordinator, from the workers reserved
// for it to its end. Every start of a job is a new run (a resume after a lost
// worker set, a restarted shard or a re-forming, with a new run id); the
// job's record (status, history, place in the queue: server/job_record.h)
// outlives its runs and hands each its status to aggregate into.
//
//   JobRun run(spec, {"worker-1", "worker-2"}, /*generation=*/1, now);  // reserved
//   run.Launch("job-1.1.0f3c...", {.epoch = 2, .step = 240}, now);      // shards configured
//   run.RecordProgress(*run.FindMember("worker-1"), report);
//   run.Aggregate(&status);  // epoch, step, loss, samples/s ... of the job
//   PSTRAIN_ASSIGN_OR_RETURN(v1::EpochPlanResponse plan, run.Plan(request));
//
// A run owns:
//  * its lifecycle: reserved (members chosen, the shards being configured),
//    launched (run id, data position it starts from, epoch planner), and its
//    members' release when it ends;
//  * its members in rank order, their last figures and finished test shards;
//    the generation, bumped by every removal;
//  * the epoch-plan broker: the run's EpochPlanner and the members lost
//    whose untrained work the shards have not yet counted (Plan answers
//    `wait` until MembersLost);
//  * liveness: which members straggle, and which a sync run drops;
//  * aggregates: the job's figures from its members', the epoch sample
//    counts, and the points of the job's history;
//  * the checkpoint codec (EncodeCheckpoint and DecodeCheckpoint, at the
//    end): the run's model as the shards hold it <-> v1::Checkpoint.
//
// Threads: thread-compatible. Its JobRecord owns it, and the Coordinator
// calls both only under its own mutex; a run never talks to a shard, never
// does I/O and never blocks.
#ifndef PSTRAIN_SERVER_JOB_RUN_H_
#define PSTRAIN_SERVER_JOB_RUN_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model_graph.h"
#include "pstrain/v1/checkpoint.pb.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/service.pb.h"
#include "server/epoch_planner.h"
#include "server/shard_controller.h"

namespace pstrain {

// Where training stands: epochs completed and the global step.
struct DataPosition {
  int epoch = 0;
  int64_t step = 0;
};

// One member of a run, as its heartbeats and reports last said.
struct RunMember {
  std::string worker_id;
  int rank = 0;
  bool reported = false;  // Sent progress in this run (else its figures are not in yet).
  int epoch = 0;
  int64_t step = 0;
  int64_t steps_per_epoch = 0;  // As last reported; 0 = unknown.
  double loss = 0, train_accuracy = 0, samples_per_sec = 0;
  bool finished = false;
  v1::EvalMetrics eval;         // Its test shard, once finished.
  int64_t run_steps = 0;        // As its heartbeats last said.
  absl::Time steps_changed_at;  // When run_steps last changed (or the run was reserved).
};

// When a member straggles (Coordinator::Options has the same fields).
struct StragglerPolicy {
  absl::Duration report_after;  // Behind without progress this long: a straggler.
  absl::Duration timeout;       // Sync: behind this long, dropped. Zero: never.
};

// A member a sync run drops for being too slow.
struct Straggler {
  std::string worker_id;
  int64_t run_steps = 0;   // Steps it completed in the run.
  int64_t lead = 0;        // The most steps any member completed.
  absl::Duration stalled;  // Since its steps last changed.
};

struct StragglerScan {
  std::vector<std::string> listed;  // For JobStatus.stragglers, rank order.
  std::vector<Straggler> to_drop;
};

// A new member set for the shards' SetMembers, after removals.
struct MembershipChange {
  std::vector<std::string> members;  // Rank order.
  int64_t generation = 0;
  std::string run_id;
  std::vector<std::string> lost;  // Removed since the last change was applied.
};

class JobRun {
 public:
  // A run reserved for `workers` (rank = index), the shards not configured
  // yet. `spec` is the job's, defaults applied (its mode is set).
  JobRun(const v1::JobSpec& spec, const std::vector<std::string>& workers, int64_t generation,
         absl::Time now);

  // --- Lifecycle ----------------------------------------------------------
  // The shards hold the job: the run trains from `start` as `run_id`, with a
  // fresh epoch planner; its checkpoint clock starts at `now`. Called once.
  void Launch(std::string run_id, DataPosition start, absl::Time now);
  bool launched() const { return planner_ != nullptr; }
  // Ends the run's hold on its members: returns their ids (rank order) and
  // forgets them.
  std::vector<std::string> ReleaseMembers();

  const std::string& run_id() const { return run_id_; }  // "" until launched.
  int64_t generation() const { return generation_; }
  const DataPosition& start() const { return start_; }

  // --- Members ------------------------------------------------------------
  const std::vector<RunMember>& members() const { return members_; }
  std::vector<std::string> MemberIds() const;
  // Null when `worker_id` is not a member.
  RunMember* FindMember(const std::string& worker_id);
  // Every member reported its test shard (false without members).
  bool AllFinished() const;
  // Removes an unfinished member: ranks close up, the generation goes up and
  // its work waits to be redistributed (MembershipChange). False when
  // `worker_id` is no unfinished member.
  bool RemoveMember(const std::string& worker_id);
  // The change the shards must get, once (clears it); nullopt when none.
  std::optional<MembershipChange> TakeMembershipChange();
  // After the shards applied `change`: the lost members' untrained samples
  // go to the survivors within their epochs (`removed_steps`: the steps the
  // shards held of each lost member). A change of another run is ignored.
  void MembersLost(const MembershipChange& change,
                   const std::map<std::string, int64_t>& removed_steps);

  // --- Heartbeats and progress ---------------------------------------------
  void RecordRunSteps(RunMember& member, int64_t run_steps, absl::Time now);
  // A progress report (figures) or a final one (`finished`: every epoch done,
  // its test shard, which the caller checked). `epochs`: the job's.
  void RecordProgress(RunMember& member, const v1::ReportProgressRequest& report, int epochs);
  // Test samples claimed by the finished members other than `worker_id`.
  int64_t TestSamplesClaimedByOthers(const std::string& worker_id) const;
  // Every finished member's test shard merged (server/eval_merge.h).
  v1::EvalMetrics MergedTest() const;

  // --- Epoch-plan broker ----------------------------------------------------
  // ABORTED for another run's request; FAILED_PRECONDITION when the worker
  // is no member; INVALID_ARGUMENT for another batch size.
  absl::Status CheckPlanRequest(const v1::EpochPlanRequest& request) const;
  // Records what the member trained and plans its epoch (`wait` while a lost
  // member's work is being redistributed). INVALID_ARGUMENT for more trained
  // epochs than the job has, or what EpochPlanner::Plan refuses. Needs
  // launched() and a request CheckPlanRequest passed.
  absl::StatusOr<v1::EpochPlanResponse> Plan(const v1::EpochPlanRequest& request);
  // A copy of the planner's PositionOfVersion, for use without the lock
  // (empty before launch).
  std::function<std::pair<int, int64_t>(int64_t)> PositionOfVersion() const;

  // --- Liveness -------------------------------------------------------------
  // Unfinished members behind the lead (the most run steps) without
  // progress, and those in `silent` (workers whose heartbeats stopped): a
  // sync run of several members drops one behind past the timeout, the
  // others are listed.
  StragglerScan FindStragglers(absl::Time now, const StragglerPolicy& policy,
                               const std::set<std::string>& silent) const;

  // --- Aggregates -----------------------------------------------------------
  // The job's epoch and step (the slowest member's), loss and accuracy (the
  // reporting members' mean), samples/s (their sum), total steps and
  // workers. No change without members.
  void Aggregate(v1::JobStatus* status) const;
  // JobStatus.epoch_samples from the planner (epochs from the run's start).
  void CountEpochSamples(v1::JobStatus* status) const;
  // Steps per epoch as the slowest member reports it; 0 = unknown.
  int64_t StepsPerEpoch() const;
  // Adds a point for `status` to `history` when its step moved on by the
  // history's gap and a member reported in this run; past `max_points`,
  // every other point goes and the gap doubles. True when it changed.
  bool RecordHistory(const v1::JobStatus& status, int max_points, absl::Time now,
                     v1::JobHistory* history) const;

  // --- Checkpoints ----------------------------------------------------------
  int last_checkpoint_epoch() const { return last_checkpoint_epoch_; }
  absl::Time last_checkpoint_time() const { return last_checkpoint_time_; }
  void CheckpointWritten(absl::Time now) { last_checkpoint_time_ = now; }
  void EpochCheckpointWritten(int epoch) { last_checkpoint_epoch_ = epoch; }

 private:
  // Constant after construction.
  const v1::ConsistencyMode mode_;
  const int batch_size_;
  const int epochs_;

  std::vector<RunMember> members_;  // Rank order.
  int64_t generation_;
  std::string run_id_;
  DataPosition start_;
  std::unique_ptr<EpochPlanner> planner_;  // Null until launched.
  // Removed members whose untrained work is not redistributed yet.
  std::vector<std::string> lost_pending_;
  bool membership_dirty_ = false;  // The shards need SetMembers.
  int last_checkpoint_epoch_ = -1;
  absl::Time last_checkpoint_time_;  // Of this run (its launch until the first).
};

// A resumed run drops the history points past the step it resumes from
// (they belong to the model thrown away). True when it changed.
bool DropHistoryAfter(int64_t step, v1::JobHistory* history);

// --- Checkpoint codec ---------------------------------------------------------
// A run's model as a checkpoint keeps it: the shards' values and optimizer
// state, the chunks' versions, and the data position they were trained to.
struct CheckpointContents {
  std::vector<std::vector<float>> params;  // ModelGraph::params order.
  // "<parameter>/<slot>" -> values (slots of the graph's parameters).
  std::map<std::string, std::vector<float>> optimizer_state;
  std::vector<int64_t> chunk_versions;  // By chunk id; may be empty.
  DataPosition position;
};

// The checkpoint of `spec`'s job holding `contents`, written at `created`.
// `contents` matches `graph` (ModelSnapshot from ShardController does):
// an optimizer slot of a parameter the graph lacks is left out.
v1::Checkpoint EncodeCheckpoint(const v1::JobSpec& spec, const ModelGraph& graph,
                                const CheckpointContents& contents, absl::Time created);
// The inverse: DATA_LOSS when the checkpoint lacks a parameter of `graph`,
// the error of a tensor that does not decode.
absl::StatusOr<CheckpointContents> DecodeCheckpoint(const v1::Checkpoint& checkpoint,
                                                    const ModelGraph& graph);
// Sets `launch`'s values, optimizer state and versions to resume a job in
// `mode` from `contents`: sync and ssp/async go on from the checkpoint's
// versions, average from 0 (server/coordinator.cc says why).
void ResumeLaunchFrom(CheckpointContents contents, v1::ConsistencyMode mode, JobLaunch* launch);

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_JOB_RUN_H_
