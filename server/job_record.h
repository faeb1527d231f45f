// JobRecord: one job as the coordinator's registry holds it, across its
// runs: its status (what users see), its history, where it stands
// (JobPhase), its current run (server/job_run.h) and the revisions that tell
// watchers and the state directory what changed. Its methods are the job's
// state changes and touch nothing else: the Coordinator frees the workers
// they name, refreshes the queue, logs and wakes Tick.
//
//   JobRecord job("job-1", spec, graph, now);               // QUEUED
//   RunReservation r = job.Reserve({"worker-1"}, now);      // kStarting
//   job.Launch(r, /*start=*/{}, "job-1.1.00ab", now);       // RUNNING, run 1
//   std::optional<CheckpointWork::Kind> due = job.CheckpointDue(interval, now);
//   std::vector<std::string> freed = job.End(v1::JOB_STATE_SUCCEEDED, "done", now);
//
// Phases: kQueued -> kStarting (workers reserved, the shards being
// configured) -> kRunning -> kFinalizing (every member finished; the final
// checkpoint being written) -> kDone; a run that loses every member, or
// that a shard lost, goes back to kQueued and resumes as a new run.
//
// Threads: thread-compatible. The Coordinator calls it under its mutex; it
// does no I/O and never blocks.
#ifndef PSTRAIN_SERVER_JOB_RECORD_H_
#define PSTRAIN_SERVER_JOB_RECORD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model_graph.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/service.pb.h"
#include "server/checkpoint_writer.h"
#include "server/checkpointer.h"
#include "server/job_run.h"

namespace pstrain {

enum class JobPhase {
  kQueued,      // Waiting for workers.
  kStarting,    // Workers reserved; shards being configured (inside Tick).
  kRunning,     // Assignments published.
  kFinalizing,  // Every member finished; final checkpoint being written.
  kDone,        // Terminal state.
};

// A run about to start: what Tick needs to configure the shards for it.
struct RunReservation {
  std::string job_id;
  v1::JobSpec spec;
  ModelGraph graph;
  std::vector<std::string> members;  // Rank order.
  int64_t generation = 0;
  bool resume = false;      // From the job's latest checkpoint.
  int64_t step_before = 0;  // The job's step when it was interrupted.
  // An external model's initial values, as its worker declared them (null:
  // the graph's InitialParameterValues). Used when the run does not resume.
  std::shared_ptr<const std::vector<std::vector<float>>> initial_values;
};

// The shards' start of a reserved run, and the data position it trains from.
struct RunLaunch {
  JobLaunch shards;
  DataPosition start;
};
// The model's deterministic initial values, or, when the run resumes, the
// job's latest checkpoint decoded (server/job_run.h): the checkpointer's or
// the codec's error.
absl::StatusOr<RunLaunch> PrepareLaunch(const RunReservation& reservation,
                                        const Checkpointer& checkpoints);

struct JobRecord {
  // A job just submitted (spec with defaults applied, its graph): QUEUED.
  JobRecord(const std::string& job_id, v1::JobSpec spec, ModelGraph graph, absl::Time now);
  // A job saved by an earlier process (its spec with the defaults applied:
  // ApplyJobDefaults). `graph`: the saved spec validated
  // again (an error fails a job that would run); `has_checkpoint`: on disk.
  // Ended jobs are listed as they were; the others queue again.
  JobRecord(v1::JobStatus saved, absl::StatusOr<ModelGraph> graph, bool has_checkpoint,
            absl::Time now);

  void Touch() { revision++; }
  bool running() const { return phase == JobPhase::kRunning; }

  // kQueued: the status reason for `idle` idle workers it may take (pool
  // workers, or for an external model the workers bound to it). True when
  // it changed. `launched`: a command job's processes launched so far (its
  // daemons), of `command_daemons` idle daemons that run commands.
  bool SetQueueReason(int idle, int launched = 0, int command_daemons = 0);
  // --- An external model (JobSpec.external_model) ---
  // The workers declare it (Coordinator::DeclareModel). `graph` is that of
  // the job's spec with `model`, checked, and `values` match its params.
  // True: `model` and `values` are the job's now; false: the job had them,
  // and `model` names the same tensors. INVALID_ARGUMENT when it names
  // others; FAILED_PRECONDITION for a job without an external model or one
  // that ended.
  absl::StatusOr<bool> DeclareModel(const v1::ExternalModel& model, ModelGraph graph,
                                    std::vector<std::vector<float>> values);
  // Whether the job can start: a ModelSpec always; an external model once
  // declared, with its initial values or a checkpoint.
  bool ReadyToStart() const;
  // kQueued -> kStarting with `workers` reserved (a new run).
  RunReservation Reserve(const std::vector<std::string>& workers, absl::Time now);
  // kStarting -> kRunning: the run `run_id` trains from `start` (the
  // checkpoint's position when resuming). Counts the steps a restart lost.
  void Launch(const RunReservation& reservation, DataPosition start, std::string run_id,
              absl::Time now);
  // -> kDone in `state`. Returns the members to free (the run keeps them,
  // for the test shards).
  std::vector<std::string> End(v1::JobState state, const std::string& reason, absl::Time now);
  // -> kQueued, to resume as a new run. Returns the members to free.
  std::vector<std::string> BackToQueue();
  // Removes an unfinished member of the current run (workers_lost + 1).
  // True when it was one; the job is back in the queue when it was the last.
  bool LoseMember(const std::string& worker_id);
  // A member's progress (checked): its figures, the job's aggregates and
  // history.
  void RecordProgress(RunMember& member, const v1::ReportProgressRequest& report,
                      int max_history_points, absl::Time now);
  // The member whose assignment a running job publishes for `worker_id`
  // (an unfinished member of the current run), or null.
  RunMember* PublishedMember(const std::string& worker_id) const;
  // `member`'s assignment; the spec (model included) only for a worker that
  // does not run this run yet (`worker_run_id` is another's).
  v1::Assignment AssignmentOf(const RunMember& member, const std::string& worker_run_id) const;
  // The check of a finished member's test shard (server/eval_merge.h)
  // against the test set's size, or `max_eval_samples` when the spec does
  // not state it, less the other members' shards.
  absl::Status CheckEvalShard(const v1::ReportProgressRequest& report,
                              int64_t max_eval_samples) const;
  // The shards applied `change` (SetMembers): the lost members' work is
  // redistributed. Ignored unless the change is of the running run.
  void ShardsUpdated(const MembershipChange& change,
                     const std::map<std::string, int64_t>& removed_steps);
  // What a progress report from a member (or a non-member: null) gets
  // without being recorded: true (stop) when the job ended unsuccessfully,
  // is not running, or the report is of a replaced run; false when it
  // succeeded or the member already finished. nullopt: record it.
  std::optional<bool> AnswerWithoutRecording(const v1::ReportProgressRequest& report,
                                             const RunMember* member) const;
  // A checkpoint of `work.kind` was written (`written` OK), or not; `kept`:
  // it went to disk (a state directory is set).
  void CheckpointWritten(const CheckpointWork& work, const absl::Status& written, bool kept,
                         absl::Time now);
  // JobStatus.stragglers. True when it changed.
  bool ListStragglers(const std::vector<std::string>& stragglers);

  // The checkpoint due now, if any: kStop for a cancelled job whose model is
  // kept, kFinal once every member finished (-> kFinalizing), kEpoch after
  // an epoch, kInterval after `interval`.
  std::optional<CheckpointWork::Kind> CheckpointDue(absl::Duration interval, absl::Time now);
  // What CheckpointWriter needs for a checkpoint of `kind` (a copy).
  CheckpointWork CheckpointOf(CheckpointWork::Kind kind) const;
  // Every member's test shard merged into JobStatus.test, epochs complete;
  // the job's final figures (the caller ends it SUCCEEDED).
  v1::EvalMetrics Evaluated();

  v1::JobStatus status;
  ModelGraph graph;
  JobPhase phase = JobPhase::kQueued;
  // The current run: set while kStarting, kRunning and kFinalizing, and
  // after one ended (kDone, or kQueued again: the last run, whose
  // generation the next one goes on from). Null before the first start.
  std::unique_ptr<JobRun> run;
  bool shards_configured = false;  // The shards hold the job (DropJob when done).
  bool save_on_stop = false;       // Save the model before dropping it (cancel).
  bool has_checkpoint = false;
  // An external model's declared initial values (null: none), kept until a
  // checkpoint is on disk: a run that starts again without one starts from
  // them. A job loaded without a checkpoint waits for a new declaration.
  std::shared_ptr<const std::vector<std::vector<float>>> initial_values;
  int64_t revision = 1;  // Bumped with every change to `status` (WaitForJobUpdate).
  int64_t persisted_revision = 0;
  v1::JobHistory history;
  int64_t history_revision = 0;  // Bumped with every change to `history`.
  int64_t persisted_history_revision = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_JOB_RECORD_H_
