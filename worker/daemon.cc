#include "worker/daemon.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/data/dataset.h"
#include "common/data/load_dataset.h"
#include "common/data/epoch_work.h"
#include "common/eval_metrics.h"
#include "common/metrics.h"
#include "common/rpc/channel.h"
#include "common/status_macros.h"
#include "common/tfevents.h"
#include "kernels/backend.h"
#include "kernels/backend_loader.h"
#include "kernels/cpu/cpu_backend.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "worker/evaluation.h"
#include "worker/model.h"
#include "worker/ps_client.h"
#include "worker/remote_updater.h"
#include "worker/trainer.h"

namespace pstrain {

// pstrain_worker_* metrics; every member is null when there is no registry.
struct WorkerDaemon::Metrics {
  prometheus::Gauge* samples_per_second = nullptr;
  prometheus::Gauge* loss = nullptr;
  prometheus::Gauge* train_accuracy = nullptr;
  prometheus::Counter* steps = nullptr;
  prometheus::Counter* resyncs = nullptr;
  prometheus::Histogram* pull_wait = nullptr;
  prometheus::Histogram* compute = nullptr;
  prometheus::Histogram* push_wait = nullptr;
  prometheus::Histogram* total = nullptr;
  prometheus::Counter* data_wait_seconds = nullptr;
  prometheus::Counter* samples = nullptr;
  prometheus::Histogram* data_wait = nullptr;
  prometheus::Gauge* prefetch_queue_depth = nullptr;
  prometheus::Gauge* loss_scale = nullptr;
  prometheus::Counter* overflowed_steps = nullptr;

  explicit Metrics(prometheus::Registry* registry) {
    if (registry == nullptr) return;
    samples_per_second = &prometheus::BuildGauge()
                              .Name("pstrain_worker_samples_per_second")
                              .Help("Training throughput of this worker over its current epoch")
                              .Register(*registry)
                              .Add({});
    loss = &prometheus::BuildGauge()
                .Name("pstrain_worker_loss")
                .Help("Mean training loss of this worker over its current epoch")
                .Register(*registry)
                .Add({});
    train_accuracy = &prometheus::BuildGauge()
                          .Name("pstrain_worker_train_accuracy_ratio")
                          .Help("Training accuracy of this worker over its current epoch")
                          .Register(*registry)
                          .Add({});
    steps = &prometheus::BuildCounter()
                 .Name("pstrain_worker_steps_total")
                 .Help("Training steps completed by this worker")
                 .Register(*registry)
                 .Add({});
    resyncs = &prometheus::BuildCounter()
                   .Name("pstrain_worker_resyncs_total")
                   .Help(
                       "Times the worker re-pulled every chunk after an ABORTED or "
                       "UNAVAILABLE parameter-server call")
                   .Register(*registry)
                   .Add({});
    data_wait_seconds = &prometheus::BuildCounter()
                             .Name("pstrain_worker_data_wait_seconds_total")
                             .Help("Time the training loop waited for the data prefetcher")
                             .Register(*registry)
                             .Add({});
    samples = &prometheus::BuildCounter()
                   .Name("pstrain_worker_samples_total")
                   .Help("Training samples processed by this worker (at each progress report)")
                   .Register(*registry)
                   .Add({});
    auto& phases = prometheus::BuildHistogram()
                       .Name("pstrain_worker_step_phase_seconds")
                       .Help(
                           "Time of each training step by phase: data_wait (waiting for "
                           "the prefetched batch), pull (waiting for the step's parameters), "
                           "compute (forward and backward), push (waiting for the gradients "
                           "to be accepted), total")
                       .Register(*registry);
    const prometheus::Histogram::BucketBoundaries buckets = {
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
    pull_wait = &phases.Add({{"phase", "pull"}}, buckets);
    compute = &phases.Add({{"phase", "compute"}}, buckets);
    push_wait = &phases.Add({{"phase", "push"}}, buckets);
    total = &phases.Add({{"phase", "total"}}, buckets);
    data_wait = &phases.Add({{"phase", "data_wait"}}, buckets);
    prefetch_queue_depth = &prometheus::BuildGauge()
                                .Name("pstrain_worker_prefetch_queue_depth")
                                .Help("Batches ready in the data prefetcher after the last step")
                                .Register(*registry)
                                .Add({});
    loss_scale = &prometheus::BuildGauge()
                      .Name("pstrain_worker_loss_scale")
                      .Help(
                          "The factor the loss gradient is scaled by: fp16 mixed precision's "
                          "dynamic loss scale, 1 otherwise")
                      .Register(*registry)
                      .Add({});
    overflowed_steps = &prometheus::BuildCounter()
                            .Name("pstrain_worker_overflowed_steps_total")
                            .Help(
                                "fp16 mixed precision: steps whose gradients overflowed (pushed "
                                "as zeros; the loss scale halves)")
                            .Register(*registry)
                            .Add({});
  }

  // The model's loss scale, and the overflowed steps since `*seen`.
  void ObservePrecision(const Model& model, int64_t* seen) {
    if (loss_scale == nullptr) return;
    loss_scale->Set(model.loss_scale());
    if (model.overflowed_steps() > *seen) {
      overflowed_steps->Increment(static_cast<double>(model.overflowed_steps() - *seen));
      *seen = model.overflowed_steps();
    }
  }

  void ObserveData(double wait_seconds, int queue_depth) {
    if (data_wait == nullptr) return;
    data_wait->Observe(std::max(wait_seconds, 0.0));
    prefetch_queue_depth->Set(queue_depth);
  }

  void ObserveStep(const StepTimings& t) {
    if (steps == nullptr) return;
    steps->Increment();
    pull_wait->Observe(t.pull_wait_seconds);
    compute->Observe(t.compute_seconds);
    push_wait->Observe(t.push_wait_seconds);
    total->Observe(t.total_seconds);
  }
  void ObserveProgress(const StepProgress& p) {
    if (loss == nullptr) return;
    samples_per_second->Set(p.samples_per_sec);
    loss->Set(p.mean_loss);
    train_accuracy->Set(p.train_accuracy);
  }
  void ObserveEpoch(const EpochStats& stats) {
    if (data_wait_seconds == nullptr) return;
    data_wait_seconds->Increment(std::max(stats.data_wait_seconds, 0.0));
    samples->Increment(static_cast<double>(std::max<int64_t>(stats.samples, 0)));
  }
};

// One assignment being trained, on its own thread. The heartbeat thread
// updates the assignment (new generation, rank, world size) and stops it.
struct WorkerDaemon::Runner {
  explicit Runner(const v1::Assignment& a)
      : job_id(a.job_id()), run_id(RunIdOf(a)), assignment(a) {}

  // The run an assignment belongs to (the job id for a coordinator that
  // sends no run id).
  static std::string RunIdOf(const v1::Assignment& a) {
    return a.run_id().empty() ? a.job_id() : a.run_id();
  }

  const std::string job_id;  // Constant.
  const std::string run_id;  // Constant.
  std::atomic<int64_t> steps{0};  // Completed in this run (sent with heartbeats).
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<bool> done{false};

  absl::Mutex mu;
  v1::Assignment assignment ABSL_GUARDED_BY(mu);         // The latest one.
  RemoteUpdater* updater ABSL_GUARDED_BY(mu) = nullptr;  // While training.
  PsClient* client ABSL_GUARDED_BY(mu) = nullptr;
  // A ReportProgressAsync call whose callback has not finished yet.
  bool report_in_flight ABSL_GUARDED_BY(mu) = false;

  // Takes the one slot for an asynchronous report; false when it is taken.
  bool BeginReport() {
    absl::MutexLock lock(&mu);
    if (report_in_flight) return false;
    report_in_flight = true;
    return true;
  }
  // The callback's last touch of this Runner (and of the daemon).
  void EndReport() {
    absl::MutexLock lock(&mu);
    report_in_flight = false;
  }
  // Waits until no asynchronous report is in flight; false if one still is
  // at `deadline` (absl::InfiniteFuture(): wait as long as it takes).
  bool AwaitNoReport(absl::Time deadline) {
    absl::MutexLock lock(&mu);
    return mu.AwaitWithDeadline(absl::Condition(this, &Runner::NoReportInFlight), deadline);
  }
  bool NoReportInFlight() const ABSL_SHARED_LOCKS_REQUIRED(mu) { return !report_in_flight; }

  void Cancel() {
    stop.store(true);
    absl::MutexLock lock(&mu);
    if (updater != nullptr) updater->Cancel();
  }
  v1::Assignment Snapshot() {
    absl::MutexLock lock(&mu);
    return assignment;
  }
  // A new generation of the same run: pushes carry it from now on. The
  // coordinator sends the spec only until the run started: it is kept.
  void Update(const v1::Assignment& a) {
    absl::MutexLock lock(&mu);
    v1::JobSpec spec = std::move(*assignment.mutable_spec());
    assignment = a;
    if (!a.has_spec()) *assignment.mutable_spec() = std::move(spec);
    if (client != nullptr) client->SetGeneration(a.generation());
    if (updater != nullptr) updater->SetRank(a.rank());
  }
  void Attach(RemoteUpdater* u, PsClient* c) {
    absl::MutexLock lock(&mu);
    updater = u;
    client = c;
    // The generation may have moved while the client was being created.
    if (client != nullptr) client->SetGeneration(assignment.generation());
    if (updater != nullptr) {
      updater->SetRank(assignment.rank());
      if (stop.load()) updater->Cancel();
    }
  }
};

namespace {

std::string Hostname() {
  char buffer[256] = {};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) return "unknown";
  return buffer;
}

bool Transient(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

absl::StatusOr<std::unique_ptr<Backend>> OpenBackend(const std::string& device, int threads) {
  PSTRAIN_ASSIGN_OR_RETURN(DeviceSpec spec, ParseDeviceSpec(device));
  const bool cpu = spec.automatic ? !CudaAvailable() : spec.type == DeviceType::kCpu;
  if (cpu) {
    CpuBackendOptions options;
    options.num_threads = threads;
    return CreateCpuBackend(options);
  }
  return CreateBackend(spec);
}

v1::EvalMetrics EvalShardProto(const EvaluationShard& shard) {
  ClassificationMetrics m = shard.confusion.Compute();
  m.loss = shard.samples > 0 ? shard.loss_sum / shard.samples : 0;
  v1::EvalMetrics proto = EvalMetricsProto(m);
  proto.set_samples(shard.samples);  // As the evaluation counted them, not the matrix.
  return proto;
}

}  // namespace

// --- MetricsEndpoint ---------------------------------------------------------------

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsEndpoint::Start(
    const std::string& host, int port, std::shared_ptr<prometheus::Registry> registry,
    const MetricsTls* tls) {
  if (registry == nullptr) return absl::InvalidArgumentError("MetricsEndpoint: null registry");
  return MetricsHttpServer::Start(host, port, PrometheusTextOf(std::move(registry)), tls);
}

// --- WorkerDaemon ------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<WorkerDaemon>> WorkerDaemon::Create(Options options) {
  if (options.coordinator_address.empty()) {
    return absl::InvalidArgumentError("the coordinator address is empty (--server HOST:PORT)");
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads must be >= 0, got ", options.num_threads));
  }
  PSTRAIN_RETURN_IF_ERROR(ParseDeviceSpec(options.device).status());
  PSTRAIN_ASSIGN_OR_RETURN(data::DataPathPolicy policy,
                           data::DataPathPolicy::Create(options.data_roots));
  std::unique_ptr<WorkerDaemon> daemon(new WorkerDaemon(std::move(options)));
  daemon->data_policy_ = std::move(policy);
  // Describe this machine once (the backend is opened again per job).
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           OpenBackend(daemon->options_.device, daemon->options_.num_threads));
  daemon->info_.set_hostname(daemon->options_.hostname.empty() ? Hostname()
                                                               : daemon->options_.hostname);
  daemon->info_.set_backend(backend->type() == DeviceType::kCuda ? "cuda" : "cpu");
  daemon->info_.set_device_info(backend->Describe());
  daemon->info_.set_gpus(CudaDeviceCount());
  daemon->info_.set_metrics_address(daemon->options_.metrics_address);
  return daemon;
}

WorkerDaemon::WorkerDaemon(Options options)
    : options_(std::move(options)),
      stub_(
          v1::Coordinator::NewStub(CreateChannel(options_.coordinator_address, options_.channel))),
      metrics_(std::make_unique<Metrics>(options_.registry.get())),
      heartbeat_interval_(options_.heartbeat_interval) {}

WorkerDaemon::~WorkerDaemon() {
  Shutdown();
  std::shared_ptr<Runner> runner;
  {
    absl::MutexLock lock(&mu_);
    runner = std::move(runner_);
  }
  if (runner != nullptr) {
    if (runner->thread.joinable()) runner->thread.join();
    // An asynchronous progress report may still hold the stub: its callback
    // runs by the call's deadline (rpc_timeout) and must find both alive.
    runner->AwaitNoReport(absl::InfiniteFuture());
  }
}

void WorkerDaemon::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
    return;
  }
  std::cerr << absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::Now(), absl::LocalTimeZone())
            << " pstrain-worker: " << line << std::endl;
}

std::string WorkerDaemon::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

std::string WorkerDaemon::current_job() const {
  absl::MutexLock lock(&mu_);
  return runner_ != nullptr && !runner_->done.load() ? runner_->job_id : "";
}

int WorkerDaemon::jobs_finished() const {
  absl::MutexLock lock(&mu_);
  return jobs_finished_;
}

void WorkerDaemon::Shutdown() {
  std::shared_ptr<Runner> runner;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    runner = runner_;
    if (coordinator_call_ != nullptr) coordinator_call_->TryCancel();
  }
  if (runner != nullptr) runner->Cancel();
}

// Runs `call` with `ctx` registered as the call in flight; CANCELLED at once
// after Shutdown().
grpc::Status WorkerDaemon::CoordinatorCall(grpc::ClientContext* ctx,
                                           const std::function<grpc::Status()>& call) {
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return grpc::Status(grpc::StatusCode::CANCELLED, "shutting down");
    coordinator_call_ = ctx;
  }
  grpc::Status status = call();
  absl::MutexLock lock(&mu_);
  coordinator_call_ = nullptr;
  return status;
}

void WorkerDaemon::SleepFor(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(&shutdown_), d);
}

// --- Heartbeat loop -------------------------------------------------------------

absl::Status WorkerDaemon::Register() {
  v1::RegisterWorkerRequest request;
  *request.mutable_info() = info_;
  {
    absl::MutexLock lock(&mu_);
    request.set_previous_worker_id(previous_worker_id_);
  }
  v1::RegisterWorkerResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
  grpc::Status status =
      CoordinatorCall(&ctx, [&] { return stub_->RegisterWorker(&ctx, request, &response); });
  if (!status.ok()) return ToAbslStatus(status);
  // From now on every call carries the credential of this registration.
  if (options_.identity != nullptr) {
    options_.identity->set_worker_credential(response.worker_credential());
  }
  absl::MutexLock lock(&mu_);
  worker_id_ = response.worker_id();
  shards_.assign(response.shards().begin(), response.shards().end());
  if (shards_.empty()) shards_.push_back(options_.coordinator_address);
  if (response.heartbeat_interval_ms() > 0) {
    heartbeat_interval_ = absl::Milliseconds(response.heartbeat_interval_ms());
  }
  Log(absl::StrCat("registered as ", worker_id_, " (", info_.device_info(), "); ", shards_.size(),
                   " parameter shard(s)"));
  return absl::OkStatus();
}

absl::Status WorkerDaemon::Run() {
  Log(absl::StrCat("coordinator ", options_.coordinator_address, ", device ", info_.device_info()));
  if (info_.backend() == "cpu" && options_.device == "auto") {
    Log(absl::StrCat("training on the CPU: ", CudaModule().Summary()));
  }
  absl::Duration backoff = absl::Milliseconds(100);
  std::string last_problem;  // What failed and its code: logged once per change.
  std::optional<bool> connected;  // Last state given to on_coordinator_state.
  auto set_connected = [&](bool now) {
    if (connected == now) return;
    connected = now;
    if (options_.on_coordinator_state) options_.on_coordinator_state(now);
  };
  auto trouble = [&](const std::string& what, absl::StatusCode code, const std::string& detail) {
    set_connected(false);
    const std::string problem = absl::StrCat(what, " ", absl::StatusCodeToString(code));
    if (problem != last_problem) {
      Log(absl::StrCat("cannot ", what, " ", options_.coordinator_address, ": ", detail,
                       "; retrying with backoff"));
    }
    last_problem = problem;
    SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  };
  for (;;) {
    std::string worker_id;
    absl::Duration interval;
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) break;
      worker_id = worker_id_;
      interval = heartbeat_interval_;
    }
    if (worker_id.empty()) {
      absl::Status status = Register();
      if (!status.ok()) {
        trouble("register with", status.code(), std::string(status.message()));
        continue;
      }
      continue;
    }
    v1::HeartbeatRequest request;
    request.set_worker_id(worker_id);
    {
      absl::MutexLock lock(&mu_);
      if (runner_ != nullptr && !runner_->done.load()) {
        request.set_job_id(runner_->job_id);
        request.set_run_id(runner_->run_id);
        request.set_run_steps(runner_->steps.load());
      }
    }
    v1::HeartbeatResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
    grpc::Status status =
        CoordinatorCall(&ctx, [&] { return stub_->Heartbeat(&ctx, request, &response); });
    if (!status.ok()) {
      trouble("heartbeat to", static_cast<absl::StatusCode>(status.error_code()),
              status.error_message());
      continue;
    }
    if (!last_problem.empty()) Log("coordinator reachable again");
    last_problem.clear();
    set_connected(true);
    backoff = absl::Milliseconds(100);
    HandleHeartbeat(response);
    SleepFor(interval);
  }
  StopRunner("shutting down");
  Log("stopped");
  return absl::OkStatus();
}

void WorkerDaemon::HandleHeartbeat(const v1::HeartbeatResponse& response) {
  std::shared_ptr<Runner> runner;
  {
    absl::MutexLock lock(&mu_);
    runner = runner_;
  }
  // A runner that ended is joined here, on the heartbeat thread.
  if (runner != nullptr && runner->done.load()) {
    if (runner->thread.joinable()) runner->thread.join();
    absl::MutexLock lock(&mu_);
    if (runner_ == runner) runner_.reset();
    runner.reset();
  }
  switch (response.action()) {
    case v1::HeartbeatResponse::ACTION_REREGISTER: {
      StopRunner("the coordinator does not know this worker");
      absl::MutexLock lock(&mu_);
      if (!worker_id_.empty()) previous_worker_id_ = worker_id_;
      worker_id_.clear();
      return;
    }
    case v1::HeartbeatResponse::ACTION_STOP:
      StopRunner("the coordinator asked to stop");
      return;
    case v1::HeartbeatResponse::ACTION_RUN:
      break;
    default:
      return;
  }
  const v1::Assignment& a = response.assignment();
  {
    absl::MutexLock lock(&mu_);
    if (Runner::RunIdOf(a) == done_run_) return;  // Already finished (or failed) here.
  }
  if (runner != nullptr && runner->run_id == Runner::RunIdOf(a) && !runner->done.load()) {
    const v1::Assignment current = runner->Snapshot();
    if (current.generation() != a.generation()) {
      Log(absl::StrCat(a.job_id(), ": generation ", a.generation(), ", rank ", a.rank(), " of ",
                       a.world_size(), " (was ", current.rank(), " of ", current.world_size(),
                       ")"));
      runner->Update(a);
    }
    return;
  }
  // A new run comes with its spec; one without (the heartbeat crossed the
  // runner's end) is taken from the next heartbeat.
  if (!a.has_spec()) return;
  StopRunner(runner != nullptr && runner->job_id == a.job_id()
                 ? absl::StrCat("a new run of ", a.job_id(), " starts")
                 : absl::StrCat("assigned to ", a.job_id()));
  StartRunner(a);
}

void WorkerDaemon::StartRunner(const v1::Assignment& assignment) {
  auto runner = std::make_shared<Runner>(assignment);
  Log(absl::StrCat(assignment.job_id(), ": rank ", assignment.rank(), " of ",
                   assignment.world_size(), ", run ", runner->run_id, ", generation ",
                   assignment.generation(), ", from epoch ", assignment.start_epoch(),
                   assignment.start_step() > 0
                       ? absl::StrCat(" (step ", assignment.start_step(), ")")
                       : std::string()));
  absl::MutexLock lock(&mu_);
  runner_ = runner;
  runner->thread = std::thread([this, runner] { RunAssignment(runner.get()); });
}

void WorkerDaemon::StopRunner(const std::string& why) {
  std::shared_ptr<Runner> runner;
  {
    absl::MutexLock lock(&mu_);
    runner = std::move(runner_);
  }
  if (runner == nullptr) return;
  if (!runner->done.load()) Log(absl::StrCat(runner->job_id, ": stopping (", why, ")"));
  runner->Cancel();
  if (runner->thread.joinable()) runner->thread.join();
}

// --- Running an assignment --------------------------------------------------------

void WorkerDaemon::RunAssignment(Runner* runner) {
  absl::Status status = Train(runner);
  if (status.ok()) {
    Log(absl::StrCat(runner->job_id, ": finished"));
    absl::MutexLock lock(&mu_);
    done_run_ = runner->run_id;
    ++jobs_finished_;
  } else if (runner->stop.load()) {
    Log(absl::StrCat(runner->job_id, ": stopped"));
  } else {
    Log(absl::StrCat(runner->job_id, ": failed: ", status.ToString()));
    v1::Assignment a = runner->Snapshot();
    v1::ReportProgressRequest report;
    report.set_job_id(runner->job_id);
    report.set_run_id(runner->run_id);
    report.set_generation(a.generation());
    report.set_error(absl::StrCat(info_.hostname(), ": ", status.ToString()));
    SendFinalReport(runner, report);
    absl::MutexLock lock(&mu_);
    done_run_ = runner->run_id;
  }
  runner->done.store(true);
}

absl::Status WorkerDaemon::Train(Runner* runner) {
  v1::Assignment a = runner->Snapshot();
  const v1::JobSpec job = a.spec();  // A copy: `a` is reassigned below.
  std::string worker_id;
  std::vector<std::string> shards;
  {
    absl::MutexLock lock(&mu_);
    worker_id = worker_id_;
    shards = shards_;
  }

  // Phase: OpenBackend, LoadData, BuildModel.
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           OpenBackend(options_.device, options_.num_threads));
  // Jobs come from the network: their dataset must lie under --data-root.
  if (job.dataset().format() != v1::DATASET_FORMAT_SYNTHETIC) {
    PSTRAIN_RETURN_IF_ERROR(data_policy_->Check(job.dataset().path()));
  }
  PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits splits, data::LoadDataset(job.dataset()));
  PSTRAIN_ASSIGN_OR_RETURN(data::Preprocess preprocess,
                           data::Preprocess::FromSpec(job.dataset(), splits.train.channels));
  ModelOptions model_options;
  model_options.precision = DataTypeOf(job.precision());
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                           Model::Create(job.model(), backend.get(), model_options));
  PSTRAIN_RETURN_IF_ERROR(model->InitializeParameters());

  // Phase: Connect to every shard and pull the current model.
  PSTRAIN_ASSIGN_OR_RETURN(ChunkPlan plan,
                           PlanChunks(model->graph(), static_cast<int>(shards.size())));
  PsClient::Options client_options;
  client_options.shard_addresses = shards;
  client_options.job_id = a.job_id();
  client_options.worker_id = worker_id;
  client_options.generation = a.generation();
  client_options.rpc_timeout = options_.ps_rpc_timeout;
  client_options.connections_per_shard = options_.connections_per_shard;
  client_options.channel = options_.channel;
  client_options.compression = job.compression();
  client_options.pace_pushes = job.mode() == v1::CONSISTENCY_SYNC;
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<PsClient> client,
                           PsClient::Create(client_options, std::move(plan)));
  RemoteUpdaterOptions updater_options = RemoteUpdaterOptionsFromJob(job, a.rank());
  Metrics* metrics = metrics_.get();
  int resyncs_seen = 0;
  RemoteUpdater* updater_ptr = nullptr;
  Trainer* trainer_ptr = nullptr;  // Set whenever the trainer is (re)built below.
  int64_t overflowed_seen = 0;
  Model* const model_ptr = model.get();
  updater_options.on_step = [this, metrics, runner, &resyncs_seen, &updater_ptr, &trainer_ptr,
                             model_ptr, &overflowed_seen](const StepTimings& t) {
    runner->steps.fetch_add(1);
    if (options_.bench_only_fixed_compute > absl::ZeroDuration()) {
      // One line per step for bench/cluster_emulation.sh (BENCH ONLY runs).
      Log(absl::StrFormat(
          "%s: BENCH ONLY bench_only_fixed_compute_ms=%d step %d end_unix_us %d total_ms %.3f "
          "pull_wait_ms %.3f compute_ms %.3f push_wait_ms %.3f",
          runner->job_id, absl::ToInt64Milliseconds(options_.bench_only_fixed_compute), t.step,
          absl::ToUnixMicros(absl::Now()), 1e3 * t.total_seconds, 1e3 * t.pull_wait_seconds,
          1e3 * t.compute_seconds, 1e3 * t.push_wait_seconds));
    }
    metrics->ObserveStep(t);
    metrics->ObservePrecision(*model_ptr, &overflowed_seen);
    if (trainer_ptr != nullptr) {
      metrics->ObserveData(trainer_ptr->last_data_wait_seconds(),
                           trainer_ptr->prefetch_queue_depth());
    }
    if (updater_ptr != nullptr && metrics->resyncs != nullptr &&
        updater_ptr->resyncs() > resyncs_seen) {
      metrics->resyncs->Increment(updater_ptr->resyncs() - resyncs_seen);
      resyncs_seen = updater_ptr->resyncs();
    }
  };
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<RemoteUpdater> updater,
                           RemoteUpdater::Create(updater_options, model.get(), client.get()));
  updater_ptr = updater.get();
  runner->Attach(updater.get(), client.get());
  struct Detach {
    Runner* runner;
    ~Detach() { runner->Attach(nullptr, nullptr); }
  } detach{runner};
  PSTRAIN_RETURN_IF_ERROR(updater->Start());

  // Phase: OpenTensorBoard (optional; a failure only costs the scalars).
  std::unique_ptr<TfEventsWriter> tensorboard;
  // The job id names a directory: one path component, never a way out.
  const bool job_id_is_a_name = !runner->job_id.empty() && runner->job_id != "." &&
                                runner->job_id != ".." &&
                                runner->job_id.find('/') == std::string::npos;
  if (!options_.tensorboard_dir.empty() && !job_id_is_a_name) {
    Log(absl::StrCat(runner->job_id, ": no TensorBoard output: the job id is not a file name"));
  } else if (!options_.tensorboard_dir.empty()) {
    const std::string dir = (std::filesystem::path(options_.tensorboard_dir) / runner->job_id /
                             absl::StrCat("worker-", a.rank()))
                                .string();
    absl::StatusOr<std::unique_ptr<TfEventsWriter>> writer = TfEventsWriter::Create(dir);
    if (writer.ok()) {
      tensorboard = *std::move(writer);
    } else {
      Log(absl::StrCat(runner->job_id, ": no TensorBoard output: ", writer.status().message()));
    }
  }
  // Flushed at every write: progress reports are tens of steps apart.
  auto write_scalars = [this, &tensorboard, runner](int64_t step, std::vector<TfScalar> scalars) {
    if (tensorboard == nullptr) return;
    absl::Status status = tensorboard->WriteScalars(step, scalars);
    if (status.ok()) status = tensorboard->Flush();
    if (!status.ok()) {
      Log(absl::StrCat(runner->job_id, ": no more TensorBoard output: ", status.message()));
      tensorboard.reset();
    }
  };

  // Phase: Train, epoch by epoch. The coordinator names each epoch's rank
  // and world size (the same for every member) and hands out the samples a
  // lost member did not train as tails, trained after this member's share.
  TrainerOptions trainer_options = TrainerOptionsFromJob(job);
  trainer_options.bench_only_fixed_compute = options_.bench_only_fixed_compute;
  if (options_.bench_only_fixed_compute > absl::ZeroDuration()) {
    Log(absl::StrCat(runner->job_id, ": BENCH ONLY: bench_only_fixed_compute_ms=",
                     absl::ToInt64Milliseconds(options_.bench_only_fixed_compute),
                     ": every step after the first sleeps instead of forward/backward and "
                     "pushes the first step's gradients again; this job does not learn"));
  }
  std::unique_ptr<Trainer> trainer;
  int64_t global_step = -1;
  std::map<int, int64_t> trained;  // Samples trained in this run, per epoch.
  auto progress_for = [&](int epoch) {
    return [&, epoch](const StepProgress& p) {
      metrics_->ObserveProgress(p);
      v1::ReportProgressRequest report;
      report.set_job_id(runner->job_id);
      report.set_run_id(runner->run_id);
      report.set_generation(runner->Snapshot().generation());
      // The epoch counts as done only after its tails (below): an epoch
      // checkpoint, and a re-formed run, must not start before them.
      report.set_epoch(epoch);
      report.set_step(p.global_step);
      report.set_loss(p.mean_loss);
      report.set_train_accuracy(p.train_accuracy);
      report.set_samples_per_sec(p.samples_per_sec);
      report.set_steps_per_epoch(p.steps_in_epoch);
      ReportProgressAsync(runner, std::move(report));
      write_scalars(p.global_step, {{"train/loss", p.mean_loss},
                                    {"train/accuracy", p.train_accuracy},
                                    {"train/samples_per_sec", p.samples_per_sec}});
    };
  };
  for (int epoch = a.start_epoch(); epoch < job.epochs(); ++epoch) {
    const int64_t epoch_length =
        job.dataset().balance() == v1::BALANCE_OVERSAMPLE
            ? data::BalancedEpochLength(splits.train.labels, splits.train.num_classes)
            : splits.train.size();
    PSTRAIN_ASSIGN_OR_RETURN(v1::EpochPlanResponse plan,
                             AskEpochPlan(runner, epoch, epoch_length, false, 0, trained));
    if (trainer == nullptr || plan.rank() != trainer_options.rank ||
        plan.world_size() != trainer_options.world_size) {
      trainer_options.rank = plan.rank();
      trainer_options.world_size = std::max(1, plan.world_size());
      trainer_ptr = nullptr;
      trainer.reset();
      PSTRAIN_ASSIGN_OR_RETURN(trainer, Trainer::Create(model.get(), updater.get(), &splits.train,
                                                        preprocess, trainer_options));
      trainer_ptr = trainer.get();
    }
    if (plan.base_steps() != trainer->steps_per_epoch()) {
      return absl::InternalError(absl::StrCat("epoch ", epoch + 1, ": the coordinator plans ",
                                              plan.base_steps(), " steps, this worker counts ",
                                              trainer->steps_per_epoch()));
    }
    int64_t first_step = 0;
    if (global_step < 0) {
      // The run's data position: start_step's steps into the first epoch
      // when this worker's steps per epoch put it there (same world size).
      const int64_t into = a.start_step() - epoch * trainer->steps_per_epoch();
      if (into > 0 && into < trainer->steps_per_epoch()) first_step = into;
      if (first_step > 0) {
        Log(absl::StrCat(runner->job_id, ": resuming epoch ", epoch + 1, " at step ", first_step,
                         " of ", trainer->steps_per_epoch()));
      }
    }
    global_step = epoch * trainer->steps_per_epoch() + first_step;
    trainer->set_global_step(global_step);
    a = runner->Snapshot();
    const data::WorkSegment base = trainer->BaseSegment(epoch);
    if (first_step > 0) {
      trained[epoch] +=
          data::SamplesAfter(base.range.size(), base.steps, job.batch_size(), first_step);
    }
    PSTRAIN_ASSIGN_OR_RETURN(
        EpochStats stats,
        trainer->RunEpoch(epoch, progress_for(epoch), options_.progress_every_steps, first_step));
    trained[epoch] += stats.applied_samples;
    // Tails: ask until every one handed out is trained (the epoch ends
    // for this member with that answer).
    int tails_done = 0;
    for (;;) {
      PSTRAIN_ASSIGN_OR_RETURN(
          plan, AskEpochPlan(runner, epoch, epoch_length, true, tails_done, trained));
      if (plan.tails_size() <= tails_done) break;
      for (; tails_done < plan.tails_size(); ++tails_done) {
        const v1::WorkSegment& t = plan.tails(tails_done);
        const data::WorkSegment segment{{t.epoch(), t.begin(), t.end()}, t.steps()};
        Log(absl::StrCat(runner->job_id, ": epoch ", epoch + 1, ": training ", segment.range.size(),
                         " samples a lost worker left (epoch ", t.epoch() + 1, " positions ",
                         t.begin(), "..", t.end(), ", ", t.steps(), " steps)"));
        SegmentOptions tail;
        tail.tail = true;
        tail.tail_index = tails_done;
        tail.progress_every = 0;
        PSTRAIN_ASSIGN_OR_RETURN(EpochStats tail_stats,
                                 trainer->RunSegment(epoch, segment, nullptr, tail));
        trained[t.epoch()] += tail_stats.applied_samples;
        stats.samples += tail_stats.samples;
        stats.seconds += tail_stats.seconds;
      }
    }
    global_step = trainer->global_step();
    {
      v1::ReportProgressRequest report;
      report.set_job_id(runner->job_id);
      report.set_run_id(runner->run_id);
      report.set_generation(runner->Snapshot().generation());
      report.set_epoch(epoch + 1);
      report.set_step(global_step);
      report.set_loss(stats.mean_loss);
      report.set_train_accuracy(stats.train_accuracy);
      report.set_samples_per_sec(stats.samples_per_sec);
      report.set_steps_per_epoch(trainer->steps_per_epoch());
      // Not dropped for a periodic report still in flight: the epoch's
      // checkpoint waits for this one.
      runner->AwaitNoReport(absl::Now() + options_.rpc_timeout);
      ReportProgressAsync(runner, std::move(report));
    }
    metrics_->ObserveEpoch(stats);
    Log(absl::StrFormat(
        "%s: epoch %d/%d  loss %.4f  train_acc %.4f  %.1f samples/s  %.1f s  "
        "(%d samples trained)",
        runner->job_id, epoch + 1, job.epochs(), stats.mean_loss, stats.train_accuracy,
        stats.samples_per_sec, stats.seconds, trained[epoch]));
  }
  trainer.reset();

  // Phase: Finish (the server's final model into ours), then Evaluate this
  // rank's shard of the test set.
  PSTRAIN_RETURN_IF_ERROR(updater->Finish());
  if (runner->stop.load()) return absl::CancelledError("the job was stopped");
  a = runner->Snapshot();
  EvaluateOptions eval;
  eval.batch_size = std::max(job.batch_size(), 256);
  eval.rank = a.rank();
  eval.world_size = std::max(1, a.world_size());
  PSTRAIN_ASSIGN_OR_RETURN(EvaluationShard shard,
                           EvaluateShard(*model, splits.test, preprocess, eval));
  v1::ReportProgressRequest report;
  report.set_job_id(runner->job_id);
  report.set_run_id(runner->run_id);
  report.set_generation(a.generation());
  report.set_epoch(job.epochs());
  report.set_step(global_step < 0 ? 0 : global_step);
  *report.mutable_eval_shard() = EvalShardProto(shard);
  report.set_finished(true);
  write_scalars(report.step(), {{"test/shard_accuracy", report.eval_shard().accuracy()},
                                {"test/shard_loss", report.eval_shard().loss()}});
  Log(absl::StrFormat("%s: test shard %d/%d: accuracy %.4f on %d samples", runner->job_id,
                      eval.rank, eval.world_size, report.eval_shard().accuracy(), shard.samples));
  SendFinalReport(runner, report);
  return absl::OkStatus();
}

absl::StatusOr<v1::EpochPlanResponse> WorkerDaemon::AskEpochPlan(
    Runner* runner, int epoch, int64_t epoch_length, bool share_done, int tails_done,
    const std::map<int, int64_t>& trained) {
  v1::EpochPlanRequest request;
  request.set_worker_id(worker_id());
  request.set_job_id(runner->job_id);
  request.set_run_id(runner->run_id);
  request.set_epoch(epoch);
  request.set_epoch_length(epoch_length);
  request.set_share_done(share_done);
  request.set_tails_done(tails_done);
  request.set_batch_size(runner->Snapshot().spec().batch_size());
  for (const auto& [e, samples] : trained) {
    v1::EpochSamples* t = request.add_trained();
    t->set_epoch(e);
    t->set_samples(samples);
  }
  // A loss being redistributed answers `wait`; the coordinator may restart.
  // Both are bounded by the parameter-server deadline (a sync step waits as
  // long for a lost member).
  const absl::Time give_up = absl::Now() + options_.ps_rpc_timeout;
  absl::Duration backoff = absl::Milliseconds(20);
  for (;;) {
    if (runner->stop.load()) return absl::CancelledError("the job was stopped");
    v1::EpochPlanResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
    grpc::Status status = stub_->EpochPlan(&ctx, request, &response);
    if (status.error_code() == grpc::StatusCode::UNIMPLEMENTED) {
      // An older coordinator: the assignment's rank and world size, no tails.
      const v1::Assignment a = runner->Snapshot();
      response.Clear();
      response.set_rank(a.rank());
      response.set_world_size(std::max(1, a.world_size()));
      response.set_base_steps(
          data::BaseSteps(epoch_length, response.world_size(), request.batch_size()));
      return response;
    }
    if (status.ok() && !response.wait()) return response;
    // ABORTED, NOT_FOUND, FAILED_PRECONDITION: this run was replaced (server
    // 0 restarted, the job went back to the queue); the heartbeat stops this
    // runner within a second, so wait for that rather than fail.
    const bool replaced = status.error_code() == grpc::StatusCode::ABORTED ||
                          status.error_code() == grpc::StatusCode::NOT_FOUND ||
                          status.error_code() == grpc::StatusCode::FAILED_PRECONDITION;
    if (!status.ok() && !Transient(status) && !replaced) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat("epoch plan: ", status.error_message()));
    }
    if (absl::Now() + backoff > give_up) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no plan for epoch ", epoch + 1, " within ",
          absl::FormatDuration(options_.ps_rpc_timeout),
          status.ok() ? " (the coordinator kept redistributing a lost member's samples)"
                      : absl::StrCat(": ", status.error_message())));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(1));
  }
}

void WorkerDaemon::ReportProgressAsync(Runner* runner, v1::ReportProgressRequest request) {
  if (!runner->BeginReport()) return;  // One at a time; this one is dropped.
  struct Call {
    grpc::ClientContext ctx;
    v1::ReportProgressRequest request;
    v1::ReportProgressResponse response;
  };
  auto* call = new Call;
  call->request = std::move(request);
  call->request.set_worker_id(worker_id());
  call->ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
  stub_->async()->ReportProgress(
      &call->ctx, &call->request, &call->response, [this, runner, call](grpc::Status status) {
        if (status.ok() && call->response.stop()) {
          Log(absl::StrCat(runner->job_id, ": the coordinator says stop"));
          runner->Cancel();
        }
        delete call;
        runner->EndReport();
      });
}

void WorkerDaemon::SendFinalReport(Runner* runner, const v1::ReportProgressRequest& request_in) {
  // Wait for a periodic report still in flight, so that the final one is last.
  // Its call ends by its own deadline (rpc_timeout); past that and a margin
  // the final report goes anyway.
  if (!runner->AwaitNoReport(absl::Now() + options_.rpc_timeout + absl::Seconds(5))) {
    Log(absl::StrCat(runner->job_id, ": a progress report is still in flight; final report sent"));
  }
  v1::ReportProgressRequest request = request_in;
  request.set_worker_id(worker_id());
  absl::Duration backoff = absl::Milliseconds(100);
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  for (;;) {
    v1::ReportProgressResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
    grpc::Status status = stub_->ReportProgress(&ctx, request, &response);
    if (status.ok()) return;
    if (!Transient(status) || absl::Now() + backoff > give_up) {
      Log(absl::StrCat(runner->job_id, ": final report not delivered: ", status.error_message()));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return;
    }
    if (runner->stop.load()) return;  // This run was replaced or stopped.
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

}  // namespace pstrain
