// WorkerDaemon: `pstrain-worker --server HOST:PORT`. Registers with the
// coordinator, heartbeats, runs the jobs it is assigned with the engine and a
// RemoteUpdater, reports progress and its share of the final evaluation, and
// goes back to the pool when the job ends.
//
//   WorkerDaemon::Options options;
//   options.coordinator_address = "127.0.0.1:7070";
//   options.device = "cpu";
//   options.num_threads = 1;
//   PSTRAIN_ASSIGN_OR_RETURN(auto daemon, WorkerDaemon::Create(options));
//   std::thread stopper([&] { WaitForSignal(); daemon->Shutdown(); });
//   absl::Status status = daemon->Run();  // Until Shutdown().
//
// Life of an assignment (one job, one generation):
//   RegisterWorker (WorkerInfo: host, backend, device, GPUs) ▸ Heartbeat
//   every heartbeat_interval_ms ▸ ACTION_RUN: an AssignmentRun
//   (assignment_run.h) on its own thread loads the data, builds the model,
//   connects to every shard, trains epoch by epoch as EpochPlan says,
//   evaluates its rank's shard of the test set and reports `finished` with
//   it ▸ idle again.
// A new generation of the same run (a member was lost) changes the push
// generation at once.
// A new run of a job (Assignment.run_id: the job was resumed from its
// checkpoint, e.g. after server 0 restarted) replaces the old run, even for a
// job this worker finished or failed before.
// ACTION_STOP, a progress answer `stop`, or Shutdown() stop the run within
// one step.
// Command jobs (JobSpec.command), with Options::command_roots only:
// ACTION_LAUNCH starts the job's command (worker/command_run.h) once the
// program resolves under a root, else the refusal is reported; the process
// joins the job as a worker of its own (pstrain.torch). Every heartbeat
// names the job whose command runs (the coordinator counts this daemon busy
// and adopts the command after it restarted) and, once, how it ended
// (HeartbeatRequest.command_end). ACTION_STOP (its job ended) gives it
// Options::command_stop_grace to exit by itself, then sends its process
// group SIGTERM and, one grace later, SIGKILL, while the heartbeats go on;
// Shutdown() stops it at once. Its
// credentials file (the daemon's TLS and token file paths) lives in a
// private temporary directory removed with it. ACTION_REREGISTER (the coordinator restarted) stops the run and
// registers again, asking for the same worker id back. A coordinator that
// does not answer is retried with exponential backoff (capped at 5 s)
// forever, with one log line per change of state.
//
// Threads: Run() blocks the calling thread (the heartbeat loop), which
// starts, updates, stops and joins the runs, one thread each; Shutdown() may
// be called from any thread (and from nowhere else but a signal-handling
// thread, not a signal handler).
#ifndef PSTRAIN_WORKER_DAEMON_H_
#define PSTRAIN_WORKER_DAEMON_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/data/path_policy.h"
#include "common/storage/storage.h"
#include "common/process.h"
#include "common/rpc/channel.h"
#include "common/rpc/security.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "worker/assignment_run.h"
#include "worker/command_run.h"
#include "worker/training_metrics.h"

namespace prometheus {
class Registry;
}

namespace pstrain {

class WorkerDaemon {
 public:
  struct Options {
    std::string coordinator_address = "127.0.0.1:7070";
    std::string device = "auto";  // auto | cpu | cuda | cuda:N
    int num_threads = 0;          // CPU backend OpenMP threads; 0 = the backend's default.
    // Deadline of every coordinator call.
    absl::Duration rpc_timeout = absl::Seconds(10);
    // Deadline of every parameter-server call (a sync pull waits for the
    // slowest worker, or for a dead one to be dropped).
    absl::Duration ps_rpc_timeout = absl::Seconds(120);
    // PsClient::Options::connections_per_shard.
    int connections_per_shard = 1;
    // Used until the coordinator sends its own interval.
    absl::Duration heartbeat_interval = absl::Seconds(1);
    absl::Duration max_backoff = absl::Seconds(5);
    int progress_every_steps = 20;
    // TensorBoard scalars ("" = none): each assignment writes under
    // <tensorboard_dir>/<job id>/worker-<rank at start> the train/* scalars of
    // every progress report and this rank's test/shard_* figures at the end.
    // A directory that cannot be written is logged and skipped, not an error.
    std::string tensorboard_dir;
    std::string metrics_address;  // Advertised in WorkerInfo ("" = none).
    std::string hostname;         // "" = gethostname().
    // Metrics go here when set (pstrain_worker_*); owned by the caller.
    std::shared_ptr<prometheus::Registry> registry;
    // Log lines (default: stderr with a timestamp).
    std::function<void(const std::string&)> log;
    // Called from Run()'s thread whenever the coordinator becomes reachable
    // (registered and heartbeating: true) or stops being so (false); first
    // call with the first outcome. Feeds the worker's health status.
    std::function<void(bool connected)> on_coordinator_state;
    // TLS and the worker token for every call (common/rpc/security_flags.h).
    // `identity` also receives the worker credential at each registration;
    // channel.identity must be the same object (or both null).
    ChannelOptions channel;
    std::shared_ptr<CallIdentity> identity;
    // BENCH ONLY (pstrain-worker --bench_only_fixed_compute_ms): replaces
    // forward/backward of every step after the first with a sleep of this
    // length (TrainerOptions::bench_only_fixed_compute). Zero: train for
    // real. Set only from the command line, never from a job.
    absl::Duration bench_only_fixed_compute = absl::ZeroDuration();
    // Directories a job's dataset may be read from (common/data/
    // path_policy.h); a dataset path elsewhere fails the job with the rule
    // before any file is opened. Empty: none (synthetic data only).
    std::vector<std::string> data_roots;
    // How s3:// dataset paths are reached (storage::StorageOptionsFromFlags);
    // without S3 settings such a path fails the job with that reason.
    storage::StorageOptions storage;
    // Directories whose programs a job's command may name (--command-root;
    // docs/SECURITY.md). Empty: this daemon runs no commands.
    std::vector<std::string> command_roots;
    // The files a command's process reads to join its job (the daemon's TLS
    // files and worker token file; PSTRAIN_CREDENTIALS).
    LauncherCredentials launcher_credentials;
    // How long a command has to exit after its job ended, and after SIGTERM
    // before SIGKILL.
    absl::Duration command_stop_grace = absl::Seconds(10);
    // Bound to one job (`pstrain-worker --job`, a Spark barrier task through
    // pstrain._native): registers for that job only (WorkerInfo.job_id; the
    // job takes bound workers, JobSpec.bound_workers), trains it when it
    // starts, and Run() returns once the job has ended. A coordinator that
    // refuses the registration (an unknown job, one that ended or takes
    // no bound workers) ends Run() with its refusal. Runs no commands.
    std::string job_id;
  };

  static absl::StatusOr<std::unique_ptr<WorkerDaemon>> Create(Options options);
  ~WorkerDaemon();  // Shutdown() and joins the runner.
  WorkerDaemon(const WorkerDaemon&) = delete;
  WorkerDaemon& operator=(const WorkerDaemon&) = delete;

  // The heartbeat loop; returns OK after Shutdown(), or for a bound daemon
  // once its job has ended (or with the coordinator's refusal).
  absl::Status Run();
  // Stops the runner (within one step) and makes Run() return.
  void Shutdown();

  // For tests and logs.
  std::string worker_id() const;
  // The job whose command runs here ("" when none).
  std::string command_job() const;
  std::string current_job() const;
  int jobs_finished() const;

 private:
  // Where the heartbeat loop stands with its coordinator (Run()'s thread).
  struct Contact;

  explicit WorkerDaemon(Options options);
  void Log(const std::string& line) const;
  // The heartbeat loop's steps.
  absl::Status Register();
  grpc::Status SendHeartbeat(const std::string& worker_id, v1::HeartbeatResponse* response);
  void HandleHeartbeat(const v1::HeartbeatResponse& response);
  // The coordinator could not be reached (`what`: "register with", ...):
  // logged once per change of problem, then a backoff.
  void LostContact(Contact& contact, const std::string& what, absl::StatusCode code,
                   const std::string& detail);
  void InContact(Contact& contact);
  // Runs: started, updated and stopped on the heartbeat thread.
  void JoinEndedRun();
  void FollowAssignment(const v1::Assignment& assignment);
  void StartRun(const v1::Assignment& assignment);
  void StopRun(const std::string& why);
  // On the run's thread when its Run() returned: its outcome, logged,
  // counted and (a failure) reported.
  void OnRunEnd(AssignmentRun& run, const absl::Status& status);
  AssignmentRun::Options RunOptions() const ABSL_LOCKS_EXCLUDED(mu_);
  void SleepFor(absl::Duration d);
  // Commands (Run()'s thread): start one, take its end when it exited, end it.
  void LaunchCommand(const v1::Assignment& assignment);
  void PollCommand();
  void StopCommand(const std::string& why);
  void CommandEnded(v1::CommandEnd end);
  grpc::Status CoordinatorCall(grpc::ClientContext* ctx, const std::function<grpc::Status()>& call)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;
  const std::function<void(const std::string&)> log_;  // options_.log, or stderr.
  std::optional<data::DataPathPolicy> data_policy_;    // Set by Create().
  std::unique_ptr<storage::Storage> storage_;          // Set by Create(); runs share it.
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::unique_ptr<TrainingMetrics> metrics_;
  v1::WorkerInfo info_;

  mutable absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // The heartbeat loop's coordinator call in flight (null: none), cancelled
  // by Shutdown() so that a daemon stops at once even while its coordinator
  // does not answer.
  grpc::ClientContext* coordinator_call_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> shards_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<AssignmentRun> run_ ABSL_GUARDED_BY(mu_);  // The latest (null: none).
  // The id held before the coordinator asked to register again: asked back
  // at the next registration.
  std::string previous_worker_id_ ABSL_GUARDED_BY(mu_);
  // The run (Assignment.run_id) finished or failed here: not rerun. A new
  // run of the same job (resumed after a restart) is run.
  std::string done_run_ ABSL_GUARDED_BY(mu_);
  int jobs_finished_ ABSL_GUARDED_BY(mu_) = 0;
  // Bound (Options::job_id): the coordinator said the job is over while no
  // run of it was going on here. Run()'s thread only.
  bool bound_job_over_ = false;
  // The command running here (Run()'s thread starts, polls and stops it),
  // the private directory of its credentials file, and an end not yet told
  // to the coordinator.
  std::unique_ptr<CommandRun> command_ ABSL_GUARDED_BY(mu_);
  std::string command_dir_;
  std::optional<v1::CommandEnd> command_end_;
  // Its job ended: when the command gets SIGTERM, then SIGKILL, if it has
  // not exited.
  bool command_ending_ = false;
  absl::Time command_stop_at_ = absl::InfiniteFuture();
  absl::Time command_kill_at_ = absl::InfiniteFuture();
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_DAEMON_H_
