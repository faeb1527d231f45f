// Coordinator: the job queue, worker registry and job state machine of
// server 0. No gRPC here: server/coordinator_service.* decodes the wire and
// calls this.
//
//   ShardController shards(...);
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator,
//                            Coordinator::Create({.state_dir = "/var/lib/pstrain"}, &shards));
//   PSTRAIN_ASSIGN_OR_RETURN(std::string job_id, coordinator->SubmitJob(spec));  // "job-1"
//   PSTRAIN_ASSIGN_OR_RETURN(v1::RegisterWorkerResponse w,
//                            coordinator->RegisterWorker(info));                // "worker-1"
//   PSTRAIN_ASSIGN_OR_RETURN(v1::HeartbeatResponse hb,
//                            coordinator->Heartbeat(w.worker_id(), ""));        // ACTION_RUN
//
// Job life: SubmitJob validates the spec (INVALID_ARGUMENT with the
// validation message, nothing queued) and queues it (QUEUED, reason "waiting
// for 2 idle workers, 1 available"). The background work (Tick) starts a
// queued job once enough idle live workers exist: it configures every shard
// with the initial values (or the job's last checkpoint when it resumes),
// then publishes assignments (rank 0..n-1, generation 1) that the workers
// receive on their next heartbeat (RUNNING). Workers report progress; the
// job's epoch and step are the slowest member's, its loss and accuracy the
// mean of the members' last reports, its samples/s their sum. After every
// epoch of the slowest member, and every checkpoint_interval, a checkpoint is
// written (server/checkpointer.h). When every member reported `finished`
// with its test shard, the confusion matrices are merged into
// JobStatus.test, the final checkpoint is written, and the job SUCCEEDED.
// A worker error fails the job (FAILED, reason names the worker); a cancel
// marks it CANCELLED at once (its model is saved) and the workers get
// ACTION_STOP.
//
// Membership: a worker silent for Options::heartbeat_timeout is marked dead.
// If it was training, it leaves its job: the generation is bumped, the
// shards get the survivors (a sync barrier waiting for it completes), and the
// survivors get new ranks 0..n-2 and world size n-1 on their next heartbeat.
// A job that loses every worker goes back to the queue and resumes from its
// last checkpoint. A dead worker that heartbeats again is alive and idle.
// A worker dead and idle for Options::forget_dead_workers_after is forgotten
// (its next heartbeat gets ACTION_REREGISTER).
//
// External models (a PyTorch module: JobSpec.external_model): the job is
// submitted with its framework only and starts on workers bound to it
// (WorkerInfo.job_id; pool workers never take it, bound workers take
// nothing else) once one of them declared the tensors and initial values
// (DeclareModel); the values start its first run, and any run that starts
// before a checkpoint is on disk.
//
// Command jobs (JobSpec.command; server/coordinator_workers.cc): while
// such a job is queued with fewer launched processes than its `workers`,
// idle daemons that run commands (WorkerInfo.runs_commands) are told to run
// it (ACTION_LAUNCH), one process each; such a daemon is busy until it
// reports the process's end. The processes register as workers bound to the
// job (WorkerInfo.launched_by names the daemon) and the job starts as any
// external-model job. The end a daemon reports (HeartbeatRequest.
// command_end) is taken only from the daemon told to run that job: a
// refusal, or a status other than 0 from a process that was a member or
// before the job started, fails the job with the daemon's words and the
// process's last output; a signal (kill -9) drops its process from the run
// as a lost worker (a queued job launches again); status 0 from a member
// that had not finished drops it too. A daemon that says it runs a job's
// command (after this server restarted) is counted for that job, or told to
// stop it when the job ended; a server that loaded queued jobs at its start
// launches nothing for one heartbeat timeout, so that their daemons and
// processes are back first.
//
// Limits (each an Options field; INVALID_ARGUMENT for a request beyond a
// size limit, RESOURCE_EXHAUSTED for a full registry; nothing changes): the
// model's parameters and bytes and the names of a job (job_limits), ids in
// requests (max_id_bytes), WorkerInfo (max_worker_info_bytes), queued jobs
// (max_queued_jobs), registered workers (max_workers, after forgetting dead
// ones), test samples claimed by a job's eval shards together (the test
// set's size when the spec states it, else max_eval_samples); a worker's
// error message is cut to max_reason_bytes. Saved jobs beyond the limits
// fail when they are loaded instead of being queued again.
//
// Persistence: every change of a job is saved to <state_dir>/jobs/<id>/
// status.pb (written to a temporary file, fsync'ed and renamed). Create()
// loads them: finished jobs are listed again, QUEUED and RUNNING jobs are
// queued again and resume from their last checkpoint (from scratch when
// there is none; an unreadable newest checkpoint falls back to an older
// one); the shards then start with the checkpoint's values and optimizer
// state at version = its step (0 in average mode), and the workers from its
// data position (Assignment.start_epoch, start_step). Temporary files of
// writes a crash interrupted are removed at start.
// Checkpoints: in sync and average mode a checkpoint is a consistent cut,
// every chunk on every shard as it was at one model version (the highest
// version any chunk had when the checkpoint was due: the ones below it are
// waited for, up to Options::cut_wait, else the checkpoint is tried again
// on a later tick); in sync mode that version is the global step, so a
// resumed run repeats no update and skips none. Async and ssp have no
// common version: the chunks are read as they are, each with its version
// recorded (Checkpoint.chunk_versions), and the data position is the
// slowest member's. The last Options::keep_checkpoints are kept.
// A job that loses every worker is resumed the same way, and so is a job
// that a shard lost (the shard restarted: the background work asks every
// shard every shard_check_interval whether it holds each running job).
// Every start of a
// job is a new run (JobStatus.runs; Assignment.run_id, unique across
// restarts of this server): workers start a new run over from its data
// position (start_epoch, start_step) even when they ran the same job
// before, and JobStatus.steps_lost counts the steps the resumes trained
// again.
//
// Parts: the jobs are server/job_registry.h, one job's state changes
// server/job_record.h, one run of a job (members, epoch plans, stragglers,
// aggregates, the checkpoint codec) server/job_run.h, the workers
// server/worker_registry.h; writing a checkpoint is
// server/checkpoint_writer.h; files are server/job_store.h and
// server/checkpointer.h; test shards server/eval_merge.h. The workers'
// calls are implemented in server/coordinator_workers.cc.
//
// Threads: thread-safe. The public calls only touch memory (and write small
// status files) and return promptly; everything that talks to shards or
// writes checkpoints runs in Tick(), on the background thread the
// Coordinator owns (or on the test's thread when
// Options::start_background_thread is false). The lock annotations say so:
// shards_ is guarded by tick_mu_, which only Tick takes, and Tick's phases
// exclude mu_ while they talk to a shard. Lock order: tick_mu_, persist_mu_,
// mu_.
#ifndef PSTRAIN_SERVER_COORDINATOR_H_
#define PSTRAIN_SERVER_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/chunking.h"
#include "common/job_spec.h"
#include "common/model_graph.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/service.pb.h"
#include "server/checkpoint_writer.h"
#include "server/checkpointer.h"
#include "server/job_record.h"
#include "server/job_registry.h"
#include "server/job_run.h"
#include "server/job_store.h"
#include "server/shard_controller.h"
#include "server/worker_registry.h"

namespace pstrain {

// A job's status together with a counter that grows on every change (for
// watchers).
struct JobUpdate {
  v1::JobStatus status;
  int64_t revision = 0;
};

// Counts for /metrics.
struct CoordinatorStats {
  std::map<v1::JobState, int> jobs_by_state;
  int workers_alive = 0;
  int workers_registered = 0;
  int stragglers = 0;             // Over running jobs.
  int64_t max_model_version = 0;  // Highest model version read at a checkpoint.
};

class Coordinator {
 public:
  struct Options {
    // Job statuses and checkpoints live in <state_dir>/jobs/<job_id>/. Empty:
    // nothing is persisted and DownloadModel has nothing to offer.
    std::string state_dir;
    // A running job is checkpointed at least this often (and after every
    // epoch), so that a crash loses at most about this much training.
    absl::Duration checkpoint_interval = absl::Seconds(60);
    int keep_checkpoints = 3;  // Newest checkpoints kept per job.
    // The numbered checkpoints go to this object-store prefix
    // (s3://bucket/prefix, server/checkpointer.h) instead of under
    // state_dir, through `storage` (non-null when set; owned by the caller).
    // Empty: under state_dir.
    std::string checkpoint_dir;
    storage::Storage* storage = nullptr;
    // Longest wait for a consistent cut (sync and average mode: every chunk
    // at one version); a cut not reached in time is tried again later.
    absl::Duration cut_wait = absl::Seconds(5);
    // How often every shard is asked whether it still holds each running
    // job, and how long one answer may take. A shard that answers that it
    // does not (it restarted empty) sends the job back to the queue: it
    // resumes from its latest checkpoint on every shard, as a new run.
    absl::Duration shard_check_interval = absl::Seconds(1);
    absl::Duration shard_check_timeout = absl::Seconds(2);
    // How often every shard lists its jobs (the first time at start): a job
    // that ended, or that this server does not know, is dropped from it
    // (it ended while this server or the shard was down, or its DropJob
    // failed).
    absl::Duration stray_job_check_interval = absl::Seconds(30);
    // Stragglers: a member silent for three heartbeat intervals, or behind
    // the others' steps (heartbeat run_steps) without progress for
    // straggler_report_after, is listed in JobStatus.stragglers; in sync
    // mode one behind for straggler_timeout is dropped like a dead worker
    // (zero: never).
    absl::Duration straggler_report_after = absl::Seconds(5);
    absl::Duration straggler_timeout = absl::Seconds(60);
    absl::Duration heartbeat_timeout = absl::Seconds(10);
    absl::Duration heartbeat_interval = absl::Seconds(1);
    // Every shard's ParameterService address, index = shard (sent to workers).
    std::vector<std::string> shard_addresses;
    int max_workers_per_job = 64;
    // --- Limits (docs/ARCHITECTURE.md, "Limits"; flags of pstrain-server).
    JobLimits job_limits = {};
    int max_queued_jobs = 1000;
    int max_workers = 10000;
    absl::Duration forget_dead_workers_after = absl::Minutes(10);
    int max_id_bytes = 128;
    int max_worker_info_bytes = 4096;
    int max_reason_bytes = 4096;
    // Test samples a job's eval shards may claim in total when the spec
    // does not say how large the test set is (TestSetBound).
    int64_t max_eval_samples = 100'000'000;
    // Points of a job's history kept (v1::JobHistory; >= 2): past it every
    // other point goes and the step gap doubles.
    int max_history_points = 2000;
    // The clock; tests inject their own.
    std::function<absl::Time()> clock = [] { return absl::Now(); };
    // Run Tick() on an owned thread every tick_interval (and at once after
    // events). Off: the caller calls Tick() itself (tests).
    bool start_background_thread = true;
    absl::Duration tick_interval = absl::Milliseconds(200);
    // Where event lines go ("job-1: RUNNING on worker-1, worker-2"); default stderr.
    std::function<void(const std::string&)> log;
  };

  // Creates the state directory if needed and loads the jobs saved there.
  // `shards` must outlive the Coordinator. Errors: the state directory
  // cannot be created or read, or a saved status is corrupt (DATA_LOSS naming
  // the file).
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(Options options,
                                                             ShardController* shards);
  // Stops the background thread.
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // --- Jobs ---------------------------------------------------------------
  // Validates `spec` (model inline, ValidateJobSpec, ValidateOptimizerSpec,
  // 1 <= workers <= max_workers_per_job; workers 0 means 1; job_limits; a
  // chunk plan) and queues it. Returns the new job id. RESOURCE_EXHAUSTED
  // when max_queued_jobs are queued.
  absl::StatusOr<std::string> SubmitJob(v1::JobSpec spec);
  // NOT_FOUND for an unknown id.
  absl::StatusOr<v1::JobStatus> GetJob(const std::string& job_id) const;
  // The job's loss, accuracy and throughput over its steps. NOT_FOUND for
  // an unknown id.
  absl::StatusOr<v1::JobHistory> GetJobHistory(const std::string& job_id) const;
  // Newest first.
  std::vector<v1::JobStatus> ListJobs() const;
  // Idempotent: a finished job comes back unchanged.
  // `reason` ("": by the user) goes into the job's status.
  absl::StatusOr<v1::JobStatus> CancelJob(const std::string& job_id,
                                          const std::string& reason = "");
  // Waits until the job's revision exceeds `after_revision` or `deadline`
  // passes, then returns its current status and revision. NOT_FOUND for an
  // unknown id.
  absl::StatusOr<JobUpdate> WaitForJobUpdate(const std::string& job_id, int64_t after_revision,
                                             absl::Time deadline) const;
  // The path of the job's latest checkpoint file. NOT_FOUND for an unknown
  // job, FAILED_PRECONDITION when none has been written yet.
  absl::StatusOr<std::string> CheckpointPath(const std::string& job_id) const;

  // --- Workers ------------------------------------------------------------
  // INVALID_ARGUMENT when `info` exceeds max_worker_info_bytes;
  // RESOURCE_EXHAUSTED when max_workers are registered and none can be
  // forgotten. `previous_worker_id` (the id the caller held before this
  // server restarted; the caller proved it, see CoordinatorService) is given
  // back when this state directory issued it and nobody holds it now; else
  // a new id. With a state directory ids are never issued twice, across
  // restarts too (the next number is saved before an id is handed out).
  absl::StatusOr<v1::RegisterWorkerResponse> RegisterWorker(
      const v1::WorkerInfo& info, const std::string& previous_worker_id = "");
  // Records the heartbeat and says what the worker must do. An unknown
  // worker id gets ACTION_REREGISTER (not an error); a worker bound to a
  // job that ended (WorkerInfo.job_id) gets ACTION_STOP.
  // `run_id` and `run_steps` (HeartbeatRequest): the run the worker trains
  // and the steps it completed in it, for straggler detection.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const std::string& worker_id,
                                                  const std::string& job_id,
                                                  const std::string& run_id = "",
                                                  int64_t run_steps = -1);
  // The same, with a daemon's command fields (command_job_id, command_end;
  // see "Command jobs" above).
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);
  // Records a worker's progress, test shard or error. Returns true when the
  // worker must stop (job cancelled, failed or the worker is no longer a
  // member). NOT_FOUND for an unknown worker or job; INVALID_ARGUMENT for
  // a malformed eval shard (counts that do not add up, or more samples than
  // the test set holds, counting the other members' shards).
  absl::StatusOr<bool> ReportProgress(const v1::ReportProgressRequest& report);
  std::vector<v1::WorkerStatus> ListWorkers() const;
  // A job's external model, declared by `worker_id`, a worker bound to the
  // job (WorkerInfo.job_id): its tensors and their initial values (one
  // vector per tensor, in order). The job can start once it has them. True
  // when this call's model and values became the job's; false when the job
  // had them and `model` names the same tensors. NOT_FOUND for an unknown
  // worker or job; FAILED_PRECONDITION for a worker not bound to the job, a
  // job without an external model, or one that ended; INVALID_ARGUMENT for
  // a model SubmitJob would refuse (bad tensors, the job limits, the chunk
  // plan), values that do not match the shapes or are not finite, or
  // tensors other than the ones declared before.
  absl::StatusOr<bool> DeclareModel(const std::string& worker_id, const std::string& job_id,
                                    const v1::ExternalModel& model,
                                    std::vector<std::vector<float>> values);
  // A member's work in one epoch of its run (server/epoch_planner.h), and
  // its samples trained so far. `wait` while a lost member's work is being
  // redistributed. NOT_FOUND for an unknown worker or job;
  // FAILED_PRECONDITION when the job is not running or the worker is not a
  // member; ABORTED for a run that is not the job's current one;
  // INVALID_ARGUMENT for an epoch outside the job, a batch size that is not
  // the job's, or an epoch length that differs between members.
  absl::StatusOr<v1::EpochPlanResponse> EpochPlan(const v1::EpochPlanRequest& request);

  // --- Background work ----------------------------------------------------
  // One round: drops dead workers, updates shard membership, starts queued
  // jobs, writes due checkpoints, finishes jobs and drops finished jobs from
  // the shards, saves changed statuses. Called by the background thread;
  // tests without the thread call it themselves. Calls are serialised.
  void Tick();

  CoordinatorStats Stats() const;

  // Replaces Options::shard_addresses (sent to workers that register from
  // now on); for a server that learns its own port only once it listens.
  void SetShardAddresses(std::vector<std::string> addresses);

 private:
  Coordinator(Options options, ShardController* shards);

  // --- Restore and persist (<state_dir>, server/job_store.h) ---------------
  absl::Status LoadState();
  // Saves every status and history that changed since it was last saved.
  void PersistChangedJobs() ABSL_LOCKS_EXCLUDED(mu_);

  // --- Checks ---------------------------------------------------------------
  // Everything SubmitJob checks of a spec (defaults applied); the graph.
  absl::StatusOr<ModelGraph> ValidateJob(const v1::JobSpec& spec) const;
  absl::Status CheckId(const char* what, const std::string& id) const;

  // --- Job changes that reach beyond the job (mu_ held) ------------------
  // A member's progress report (figures, its test shard or its error).
  absl::Status ApplyProgress(JobRecord& job, RegisteredWorker& worker, RunMember& member,
                             const v1::ReportProgressRequest& report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefreshQueueReasons() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Idle live workers: the pool's, and those bound to a job (by job id),
  // each by id number.
  struct IdleWorkers {
    std::vector<RegisteredWorker*> pool;
    std::map<std::string, std::vector<RegisteredWorker*>> bound;
  };
  IdleWorkers IdleWorkersByJob() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish(JobRecord& job, v1::JobState state, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveMember(JobRecord& job, const std::string& worker_id, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the job's current run: back to the queue, to resume from its latest
  // checkpoint as a new run (its members are idle again and take it first).
  void RequeueRun(JobRecord& job, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Command jobs (server/coordinator_workers.cc).
  // Tells idle daemons that run commands to run the commands of queued
  // command jobs short of launched processes.
  void LaunchCommands() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The daemons running (or told to run) the job's command: those launching
  // it and those that launched a live worker bound to it.
  std::set<std::string> Launchers(const std::string& job_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A heartbeat of a daemon that runs, or was told to run, a command.
  v1::HeartbeatResponse AnswerLauncher(RegisteredWorker& daemon, const std::string& running)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A daemon's report that its command ended (or was refused).
  void CommandEnded(RegisteredWorker& daemon, const v1::CommandEnd& end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Elastic scale-up: a running job with fewer members than it wants,
  // whose epoch-`epoch` checkpoint was just written, goes back to the queue
  // when enough workers are idle (a dropped worker that came back, a new
  // one) and no older job waits for them; it resumes at once from that
  // checkpoint with all of them, as a new run.
  void ReformIfWorkersWait(JobRecord& job, int epoch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // --- Background work --------------------------------------------------------
  // Only Tick talks to shards: every phase that does requires tick_mu_,
  // which guards shards_ (and the checkpoint writer), and none holds mu_
  // while it waits for a shard.
  void BackgroundLoop();
  void Wake() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { wake_ = true; }
  void Log(const std::string& line) const;
  absl::Time Now() const { return options_.clock(); }

  // Tick's phases, in order.
  void DropDeadWorkers() ABSL_LOCKS_EXCLUDED(mu_);
  void FindStragglers() ABSL_LOCKS_EXCLUDED(mu_);
  void CheckShards() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  void DropStrayJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Why a shard should drop `job_id` ("" when it should keep it).
  std::string WhyStray(const std::string& job_id) const ABSL_LOCKS_EXCLUDED(mu_);
  void SyncMembership() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Starting a queued job: reserve idle workers (under mu_), prepare the
  // shards' values (PrepareLaunch, server/job_record.h: initial or decoded
  // from the checkpoint) and configure the shards (without), launch the run
  // or fail the job (under mu_).
  void StartQueuedJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<RunReservation> ReserveWorkers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void LaunchRun(const RunReservation& work, const absl::Status& status, DataPosition start)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checkpoints: decide (under mu_), write (without), take the outcome
  // (under mu_: the job succeeds after its final one).
  void WriteDueCheckpoints() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<CheckpointWork> DueCheckpoints() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WriteCheckpoint(const CheckpointWork& work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  void CheckpointDone(JobRecord& job, const CheckpointWork& work, const absl::Status& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishEvaluated(JobRecord& job, const absl::Status& final_checkpoint)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropFinishedJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(tick_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;
  const int num_shards_;
  const int64_t chunk_bytes_;
  // Random, drawn at construction: run ids of this process differ from
  // those of an earlier process on the same state directory.
  const uint64_t incarnation_;
  const JobStore store_;
  const Checkpointer checkpointer_;

  // Serialises Tick(), the only code that talks to shards.
  absl::Mutex tick_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  ShardController* const shards_ ABSL_PT_GUARDED_BY(tick_mu_);
  CheckpointWriter checkpoint_writer_ ABSL_GUARDED_BY(tick_mu_);
  // Serialises status-file writes.
  absl::Mutex persist_mu_ ABSL_ACQUIRED_AFTER(tick_mu_) ABSL_ACQUIRED_BEFORE(mu_);

  mutable absl::Mutex mu_;
  JobRegistry jobs_ ABSL_GUARDED_BY(mu_);
  WorkerRegistry workers_ ABSL_GUARDED_BY(mu_);
  int64_t max_model_version_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> shard_addresses_ ABSL_GUARDED_BY(mu_);
  bool wake_ ABSL_GUARDED_BY(mu_) = false;  // Also set when stopping.
  absl::Time last_shard_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_stray_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Until then, command jobs resumed after a restart launch nothing.
  absl::Time launch_grace_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();

  std::thread background_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_COORDINATOR_H_
