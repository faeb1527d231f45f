// AssignmentRun: one run of one job on this worker (an Assignment with its
// run id), from loading the data to the final report. The worker daemon
// (daemon.h) starts one per run it is assigned and stops it when the
// coordinator says so; this is the worker-side twin of the coordinator's
// record of the run.
//
//   AssignmentRun::Options options;  // The daemon's settings, its coordinator
//   ...                              // stub, shards, worker id, metrics, log.
//   std::shared_ptr<AssignmentRun> run = AssignmentRun::Create(assignment, options);
//   run->Start([](AssignmentRun& r, const absl::Status& status) {
//     if (!status.ok() && !r.stopped()) r.ReportFailure(status);
//   });
//   ...
//   run->Update(newer_assignment);  // A new generation: new rank, world size.
//   run->Cancel();                  // Stops it within one step.
//   run->Join();
//
// Run() is these phases, in order:
//   BuildModel       OpenBackend, the job's data (checked against the
//                    worker's data roots first) and its model
//                    (job_setup.h: the same as --standalone).
//   ConnectAndPull   a PsClient to every shard, a RemoteUpdater in the
//                    job's mode, and the current model pulled.
//   OpenTensorBoard  optional; a failure costs only the scalars.
//   TrainEpochs      epoch by epoch from Assignment.start_epoch (and
//                    start_step's steps into it, where this worker's steps
//                    per epoch put them): each epoch asks EpochPlan for this
//                    member's rank and world size (the same for every
//                    member), trains its share, then asks again for the
//                    tails (samples a lost member did not train) until none
//                    is left; progress goes to the coordinator every
//                    `progress_every_steps` steps and at each epoch's end.
//   FinishAndEvaluate  the server's final model into ours, then this rank's
//                    shard of the test set, sent as the final report.
// A failing phase ends Run() with its status; ReportFailure() sends it.
//
// Threads: Create, Start and Join on one thread (the daemon's heartbeat
// thread), which must Join() before it drops its last reference. Run()
// and ReportFailure() on the run's own thread only (Start() makes it; tests
// may call Run() directly). Everything else from any thread. A progress
// report's callback (a gRPC thread) holds a reference of its own until it
// ends: the run outlives it.
#ifndef PSTRAIN_WORKER_ASSIGNMENT_RUN_H_
#define PSTRAIN_WORKER_ASSIGNMENT_RUN_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/data/path_policy.h"
#include "common/storage/storage.h"
#include "common/rpc/channel.h"
#include "common/tfevents.h"
#include "kernels/backend.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "worker/job_setup.h"
#include "worker/ps_client.h"
#include "worker/remote_updater.h"
#include "worker/trainer.h"
#include "worker/training_metrics.h"

namespace pstrain {

class AssignmentRun : public std::enable_shared_from_this<AssignmentRun> {
 public:
  // What the daemon lends every run. Pointers must outlive the run.
  struct Options {
    std::string device = "auto";  // auto | cpu | cuda | cuda:N
    int num_threads = 0;          // CPU backend OpenMP threads; 0 = its default.
    // The datasets a job may read (non-null; synthetic data needs none).
    const data::DataPathPolicy* data_policy = nullptr;
    // Where datasets are read from (local paths and s3://); null: local only.
    storage::Storage* storage = nullptr;
    std::string worker_id;                         // This worker's id at the coordinator.
    std::string hostname;                          // Names this worker in a failure report.
    std::vector<std::string> shards;               // The parameter shards' addresses.
    v1::Coordinator::Stub* coordinator = nullptr;  // Non-null.
    ChannelOptions channel;                        // For the shards.
    int connections_per_shard = 1;
    absl::Duration rpc_timeout = absl::Seconds(10);      // Every coordinator call.
    absl::Duration ps_rpc_timeout = absl::Seconds(120);  // Shard calls; EpochPlan's waits.
    absl::Duration max_backoff = absl::Seconds(5);       // The final report's retries.
    int progress_every_steps = 20;
    // TensorBoard scalars under <tensorboard_dir>/<job id>/worker-<rank>
    // ("" = none; see WorkerDaemon::Options).
    std::string tensorboard_dir;
    // BENCH ONLY: TrainerOptions::bench_only_fixed_compute.
    absl::Duration bench_only_fixed_compute = absl::ZeroDuration();
    TrainingMetrics* metrics = nullptr;           // Non-null.
    std::function<void(const std::string&)> log;  // Non-empty; any thread.
  };

  // `assignment` must carry the run's spec (the coordinator sends it until
  // the run has started).
  static std::shared_ptr<AssignmentRun> Create(const v1::Assignment& assignment, Options options);
  ~AssignmentRun();
  AssignmentRun(const AssignmentRun&) = delete;
  AssignmentRun& operator=(const AssignmentRun&) = delete;

  // Runs Run() on the run's own thread, then `on_end` with its status there;
  // done() turns true after on_end returns.
  void Start(std::function<void(AssignmentRun&, const absl::Status&)> on_end);
  // Waits for the thread Start() made (none: returns at once).
  void Join();

  // The phases (see the top of this file), then the training state is
  // released on this thread. CANCELLED after Cancel().
  absl::Status Run();
  // Sends `status` as the run's error ("<hostname>: <status>") in its final
  // report, after any report in flight.
  void ReportFailure(const absl::Status& status);

  const std::string& job_id() const { return job_id_; }
  const std::string& run_id() const { return run_id_; }
  // Steps completed in this run (sent with heartbeats).
  int64_t steps() const { return steps_.load(); }
  bool stopped() const { return stop_.load(); }
  bool done() const { return done_.load(); }
  // The latest assignment (its spec kept from the first).
  v1::Assignment Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  // A new generation of the same run: pushes carry it, and the updater the
  // new rank, from now on. The coordinator sends the spec only until the
  // run started: it is kept.
  void Update(const v1::Assignment& assignment) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the run within one step: every shard call in flight ends at once.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no asynchronous progress report is in flight; false if one
  // still is at `deadline` (absl::InfiniteFuture(): as long as it takes).
  bool AwaitNoReport(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  AssignmentRun(const v1::Assignment& assignment, Options options);
  void Log(const std::string& line) const { options_.log(absl::StrCat(job_id_, ": ", line)); }

  // The phases of Run().
  absl::Status RunPhases();
  absl::Status BuildModel();
  absl::Status ConnectAndPull();
  void OpenTensorBoard();
  absl::Status TrainEpochs();
  absl::Status FinishAndEvaluate();
  // Destroys the training state in the reverse order of its making.
  void ReleaseTraining();

  // TrainEpochs, one epoch: the plan, the share, the tails, the report.
  absl::Status TrainEpoch(int epoch, int64_t epoch_length);
  // A trainer for the plan's rank and world size (kept while they stay).
  absl::Status TrainerFor(const v1::EpochPlanResponse& plan, int epoch);
  // The step of `epoch` this run starts at: start_step's steps into the
  // run's first epoch when this worker's steps per epoch put it there.
  int64_t FirstStep(int epoch);
  // The tails handed out for `epoch`, until the coordinator hands out no
  // more; their samples and seconds are added to `stats`.
  absl::Status TrainTails(int epoch, int64_t epoch_length, EpochStats* stats);
  void ReportEpochEnd(int epoch, const EpochStats& stats);

  // Hooks: the updater's on_step and the trainer's progress (this thread).
  void OnStep(const StepTimings& t);
  void OnProgress(int epoch, const StepProgress& p);
  // Flushed at every write; a failure ends the TensorBoard output.
  void WriteScalars(int64_t step, const std::vector<TfScalar>& scalars);

  // The coordinator's plan for this member in `epoch` (EpochPlan), asked
  // again while it says wait or the run is being replaced, within
  // ps_rpc_timeout.
  absl::StatusOr<v1::EpochPlanResponse> AskEpochPlan(int epoch, int64_t epoch_length,
                                                     bool share_done, int tails_done);
  // One asynchronous report at a time: dropped while one is in flight. A
  // `stop` answer cancels the run.
  void ReportProgressAsync(v1::ReportProgressRequest request);
  // After the report in flight (within rpc_timeout and a margin); retried
  // while the coordinator is unreachable, for 2 minutes or until stopped.
  void SendFinalReport(v1::ReportProgressRequest request);
  v1::ReportProgressRequest NewReport() const;
  bool BeginReport() ABSL_LOCKS_EXCLUDED(mu_);
  void EndReport() ABSL_LOCKS_EXCLUDED(mu_);
  bool NoReportInFlight() const ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !report_in_flight_; }
  // The updater and client that Cancel() and Update() reach (null: none).
  void Attach(RemoteUpdater* updater, PsClient* client) ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;
  const std::string job_id_;
  const std::string run_id_;

  std::thread thread_;  // Start() and Join() only.
  std::atomic<int64_t> steps_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> done_{false};

  mutable absl::Mutex mu_;
  v1::Assignment assignment_ ABSL_GUARDED_BY(mu_);                  // The latest one.
  RemoteUpdater* attached_updater_ ABSL_GUARDED_BY(mu_) = nullptr;  // While training.
  PsClient* attached_client_ ABSL_GUARDED_BY(mu_) = nullptr;
  // A ReportProgressAsync call whose callback has not finished yet.
  bool report_in_flight_ ABSL_GUARDED_BY(mu_) = false;

  // The run's thread only, while Run() runs.
  v1::Assignment start_;  // The assignment as the run started.
  v1::JobSpec job_;       // start_'s spec.
  std::unique_ptr<Backend> backend_;
  std::optional<JobSetup> setup_;  // Data, preprocessing, model.
  std::unique_ptr<PsClient> client_;
  std::unique_ptr<RemoteUpdater> updater_;
  TrainerOptions trainer_options_;
  std::unique_ptr<Trainer> trainer_;  // For the current rank and world size.
  std::unique_ptr<TfEventsWriter> tensorboard_;
  int64_t global_step_ = -1;        // -1 until the first epoch starts.
  std::map<int, int64_t> trained_;  // Samples trained in this run, per epoch.
  int resyncs_seen_ = 0;            // Metrics already counted.
  int64_t overflowed_seen_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_ASSIGNMENT_RUN_H_
