// JobWorker: a process that trains one job as a worker bound to it (the
// worker protocol as a library, for pstrain.torch through pstrain._native).
// It registers with the coordinator for that job only (WorkerInfo.job_id),
// heartbeats on its own thread, declares the job's external model, waits for
// the job to start, and then answers what a training loop asks: its epoch
// plans, progress and final reports, and a PsClient to the shards.
//
//   JobWorker::Options options;
//   options.coordinator_address = "127.0.0.1:7070";
//   options.job_id = "job-3";
//   PSTRAIN_ASSIGN_OR_RETURN(auto worker, JobWorker::Create(options));      // registered
//   PSTRAIN_RETURN_IF_ERROR(worker->DeclareModel(model, values));          // tensors, init
//   PSTRAIN_ASSIGN_OR_RETURN(v1::Assignment a, worker->AwaitStart(absl::Minutes(5)));
//   PSTRAIN_ASSIGN_OR_RETURN(auto client, worker->ConnectShards());
//   ... ExternalUpdater over `client` (worker/external_updater.h) ...
//   PSTRAIN_ASSIGN_OR_RETURN(v1::EpochPlanResponse plan, worker->EpochPlan(request));
//   worker->ReportProgress(report);  // and at the end, report.finished = true
//
// Membership: heartbeats bring the run's new generation, rank and world
// size after a member is lost (generation() and assignment(); the PsClient
// made by ConnectShards follows the generation by itself). A heartbeat that
// says stop (the job was cancelled or failed, or this worker was dropped)
// ends every shard call in flight and makes stopped() true; so does
// Shutdown(). A coordinator that restarted asks the worker to register
// again: it ends the old run's shard calls (its PsClient is cancelled; the
// run is over), registers asking for its id back, declares the model again when
// the coordinator lost it (a restart before the first checkpoint), from
// the values that DeclareModel's source holds then.
//
// A new run: when the job resumes from its checkpoint as a new run (server
// 0 restarted, or every member was lost) with this worker as a member, the
// worker takes the new assignment (run_number() counts the runs), and ends
// the old run's shard calls (its PsClient is cancelled; ConnectShards makes
// the new run's). EpochPlan and ReportProgress requests that name the old
// run_id are refused with ABORTED. The training loop rewinds to the new
// run's start: AwaitNewRun tells it when.
//
// Threads: thread-safe. Create starts the heartbeat thread, which the
// destructor (or Shutdown) joins.
#ifndef PSTRAIN_WORKER_JOB_WORKER_H_
#define PSTRAIN_WORKER_JOB_WORKER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/rpc/channel.h"
#include "common/rpc/security.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "worker/ps_client.h"

namespace pstrain {

class JobWorker {
 public:
  struct Options {
    std::string coordinator_address = "127.0.0.1:7070";
    std::string job_id;  // The job this worker is bound to; non-empty.
    // TLS and the worker token for every call; `identity` receives the
    // worker credential at registration (channel.identity must be the same
    // object, or both null).
    ChannelOptions channel;
    std::shared_ptr<CallIdentity> identity;
    v1::WorkerInfo info;  // hostname, backend, device; job_id is set from job_id.
    absl::Duration rpc_timeout = absl::Seconds(10);      // Every coordinator call.
    absl::Duration ps_rpc_timeout = absl::Seconds(120);  // Every shard call.
    // How long registration and re-registration keep trying an unreachable
    // coordinator (UNAVAILABLE, DEADLINE_EXCEEDED), with backoff.
    absl::Duration connect_timeout = absl::Seconds(60);
    std::function<void(const std::string&)> log;  // Default: stderr.
  };

  // Registers (retrying an unreachable coordinator within connect_timeout)
  // and starts heartbeating. The coordinator's refusal (an unknown job, one
  // that ended or trains a ModelSpec) is returned as it said it.
  static absl::StatusOr<std::unique_ptr<JobWorker>> Create(Options options);
  ~JobWorker();  // Shutdown().
  JobWorker(const JobWorker&) = delete;
  JobWorker& operator=(const JobWorker&) = delete;

  // Declares the job's model: its tensors and, through `values`, their
  // initial values (values(i) must return tensor i's elements, fp32; it is
  // called now and again if the coordinator needs a new declaration after a
  // restart, so it must stay callable until Shutdown). True when this
  // declaration became the job's; false when another worker declared the
  // same model first. The coordinator's INVALID_ARGUMENT (a different
  // model, bad values) is returned as it said it.
  absl::StatusOr<bool> DeclareModel(const v1::ExternalModel& model,
                                    std::function<absl::Span<const float>(int)> values);

  // Waits until the job starts with this worker as a member (or stop, or
  // `timeout`: DEADLINE_EXCEEDED naming the job's queue reason when known).
  // Returns the assignment, with the spec (the model as declared).
  absl::StatusOr<v1::Assignment> AwaitStart(absl::Duration timeout);

  // A PsClient to every shard for the current run (the job's compression,
  // this worker's id, generation and credentials). Needs AwaitStart.
  absl::StatusOr<std::shared_ptr<PsClient>> ConnectShards();

  // The coordinator calls of a member (worker_id and job_id are filled in,
  // and run_id when the request leaves it empty; a request for a run that
  // was replaced is refused with ABORTED). EpochPlan asks again while the
  // answer is `wait`, within ps_rpc_timeout. ReportProgress: true when the
  // coordinator says stop (the job ended, or this run was replaced: the
  // heartbeats then bring the stop or the new run). Both (and DeclareModel)
  // are made again while the coordinator is unreachable, within
  // connect_timeout.
  absl::StatusOr<v1::EpochPlanResponse> EpochPlan(v1::EpochPlanRequest request);
  absl::StatusOr<bool> ReportProgress(v1::ReportProgressRequest request);
  // The steps this worker completed in the run, sent with every heartbeat
  // (the coordinator's straggler detection).
  void SetRunSteps(int64_t steps) { run_steps_.store(steps); }

  // Stops heartbeating and ends the shard calls in flight (idempotent).
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  std::string worker_id() const ABSL_LOCKS_EXCLUDED(mu_);
  // The latest assignment (empty before the start).
  v1::Assignment assignment() const ABSL_LOCKS_EXCLUDED(mu_);
  bool stopped() const { return stopped_.load(); }
  // 1 once the job started with this worker, one more for every new run it
  // took since (0 before the start).
  int64_t run_number() const ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until run_number() exceeds `from` (true), or the worker stops or
  // `timeout` passes (false).
  bool AwaitNewRun(int64_t from, absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Why it stopped ("" while running).
  std::string stop_reason() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit JobWorker(Options options);
  void Log(const std::string& line) const;
  absl::Status Register(const std::string& previous_id) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<bool> SendDeclaration() ABSL_LOCKS_EXCLUDED(mu_);
  // An idempotent coordinator call, made again while the coordinator is
  // unreachable (UNAVAILABLE, DEADLINE_EXCEEDED), within connect_timeout.
  absl::Status CallWithRetries(const std::function<grpc::Status(grpc::ClientContext*)>& call);
  void HeartbeatLoop();
  // One heartbeat and what it says; false when the loop should end.
  bool Beat();
  void Stop(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // Fills an empty `run_id` with the current run's; ABORTED for another run.
  absl::Status FillRun(std::string* run_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Constant after construction.
  const Options options_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;

  std::thread heartbeats_;
  std::atomic<bool> stopped_{false};
  std::atomic<int64_t> run_steps_{0};

  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // Signalled on a new assignment or a stop.
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> shards_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(1);
  v1::Assignment assignment_ ABSL_GUARDED_BY(mu_);  // Latest; its spec kept from its run's first.
  int64_t run_number_ ABSL_GUARDED_BY(mu_) = 0;
  // False from a re-registration until the heartbeats bring a run: they
  // then name no run (the coordinator that restarted knows none of them).
  bool in_run_ ABSL_GUARDED_BY(mu_) = false;
  std::string stop_reason_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // The declaration to repeat after a re-registration (empty model: none).
  v1::ExternalModel declared_ ABSL_GUARDED_BY(mu_);
  std::function<absl::Span<const float>(int)> values_ ABSL_GUARDED_BY(mu_);
  std::weak_ptr<PsClient> client_ ABSL_GUARDED_BY(mu_);  // The latest ConnectShards'.
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_JOB_WORKER_H_
