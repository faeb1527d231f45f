#include "worker/daemon.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/backend_loader.h"
#include "worker/job_setup.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;

std::string Hostname() {
  char buffer[256] = {};
  if (gethostname(buffer, sizeof(buffer) - 1) != 0) return "unknown";
  return buffer;
}

// Options::log, or stderr with a timestamp. Holds no reference to the
// daemon: a run's last progress callback may log after the daemon is gone.
std::function<void(const std::string&)> LogSink(std::function<void(const std::string&)> log) {
  if (log) return log;
  return [](const std::string& line) {
    std::cerr << absl::FormatTime("%Y-%m-%d %H:%M:%S", absl::Now(), absl::LocalTimeZone())
              << " pstrain-worker: " << line << std::endl;
  };
}

}  // namespace

// Where the heartbeat loop stands with its coordinator.
struct WorkerDaemon::Contact {
  absl::Duration backoff = absl::Milliseconds(100);
  std::string last_problem;       // What failed and its code: logged once per change.
  std::optional<bool> connected;  // Last state given to on_coordinator_state.
};

// --- WorkerDaemon ------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<WorkerDaemon>> WorkerDaemon::Create(Options options) {
  if (options.coordinator_address.empty()) {
    return absl::InvalidArgumentError("the coordinator address is empty (--server HOST:PORT)");
  }
  if (!options.job_id.empty() && !options.command_roots.empty()) {
    return absl::InvalidArgumentError(
        "a worker bound to a job (--job) runs no commands: drop --command-root");
  }
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads must be >= 0, got ", options.num_threads));
  }
  PSTRAIN_RETURN_IF_ERROR(ParseDeviceSpec(options.device).status());
  PSTRAIN_ASSIGN_OR_RETURN(data::DataPathPolicy policy,
                           data::DataPathPolicy::Create(options.data_roots));
  for (std::string& root : options.command_roots) {
    std::error_code ec;
    const fs::path real = fs::canonical(root, ec);
    if (ec || !fs::is_directory(real, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--command-root ", root, " is not a directory"));
    }
    root = real.string();
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<storage::Storage> store,
                           storage::OpenStorage(options.storage));
  std::unique_ptr<WorkerDaemon> daemon(new WorkerDaemon(std::move(options)));
  daemon->data_policy_ = std::move(policy);
  daemon->storage_ = std::move(store);
  // Describe this machine once (the backend is opened again per job).
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                           OpenBackend(daemon->options_.device, daemon->options_.num_threads));
  daemon->info_.set_hostname(daemon->options_.hostname.empty() ? Hostname()
                                                               : daemon->options_.hostname);
  daemon->info_.set_backend(backend->type() == DeviceType::kCuda ? "cuda" : "cpu");
  daemon->info_.set_device_info(backend->Describe());
  daemon->info_.set_gpus(CudaDeviceCount());
  daemon->info_.set_metrics_address(daemon->options_.metrics_address);
  daemon->info_.set_runs_commands(!daemon->options_.command_roots.empty());
  daemon->info_.set_job_id(daemon->options_.job_id);
  return daemon;
}

WorkerDaemon::WorkerDaemon(Options options)
    : options_(std::move(options)),
      log_(LogSink(options_.log)),
      stub_(
          v1::Coordinator::NewStub(CreateChannel(options_.coordinator_address, options_.channel))),
      metrics_(std::make_unique<TrainingMetrics>(options_.registry.get())),
      heartbeat_interval_(options_.heartbeat_interval) {}

WorkerDaemon::~WorkerDaemon() {
  Shutdown();
  std::shared_ptr<AssignmentRun> run;
  {
    absl::MutexLock lock(&mu_);
    run = std::move(run_);
  }
  if (run != nullptr) {
    run->Join();
    // An asynchronous progress report may still hold the stub: its callback
    // runs by the call's deadline (rpc_timeout).
    run->AwaitNoReport(absl::InfiniteFuture());
  }
}

void WorkerDaemon::Log(const std::string& line) const { log_(line); }

std::string WorkerDaemon::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

std::string WorkerDaemon::command_job() const {
  absl::MutexLock lock(&mu_);
  return command_ != nullptr ? command_->job_id() : "";
}

std::string WorkerDaemon::current_job() const {
  absl::MutexLock lock(&mu_);
  return run_ != nullptr && !run_->done() ? run_->job_id() : "";
}

int WorkerDaemon::jobs_finished() const {
  absl::MutexLock lock(&mu_);
  return jobs_finished_;
}

void WorkerDaemon::Shutdown() {
  std::shared_ptr<AssignmentRun> run;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    run = run_;
    if (coordinator_call_ != nullptr) coordinator_call_->TryCancel();
  }
  if (run != nullptr) run->Cancel();
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
  if (!options_.command_roots.empty()) {
    Log(absl::StrCat("runs job commands under ", absl::StrJoin(options_.command_roots, ", ")));
  }
  if (info_.backend() == "cpu" && options_.device == "auto") {
    Log(absl::StrCat("training on the CPU: ", CudaModule().Summary()));
  }
  Contact contact;
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
      if (!status.ok() && !options_.job_id.empty() &&
          (absl::IsFailedPrecondition(status) || absl::IsNotFound(status) ||
           absl::IsInvalidArgument(status) || absl::IsPermissionDenied(status) ||
           absl::IsUnauthenticated(status))) {
        // Bound: the coordinator's answer about the job is final.
        StopRun("the coordinator refused the registration");
        Log(absl::StrCat("cannot work on ", options_.job_id, ": ", status.message()));
        return status;
      }
      if (!status.ok()) {
        LostContact(contact, "register with", status.code(), std::string(status.message()));
      }
      continue;
    }
    PollCommand();
    v1::HeartbeatResponse response;
    bool running = false;
    {
      absl::MutexLock lock(&mu_);
      running = run_ != nullptr && !run_->done();
    }
    grpc::Status status = SendHeartbeat(worker_id, &response);
    if (status.ok()) command_end_.reset();  // Told.
    if (!status.ok()) {
      LostContact(contact, "heartbeat to", static_cast<absl::StatusCode>(status.error_code()),
                  status.error_message());
      continue;
    }
    InContact(contact);
    // Bound: a stop while nothing of the job runs here means the job is
    // over (a stop during a run may only drop this worker from it).
    if (!options_.job_id.empty() && !running &&
        response.action() == v1::HeartbeatResponse::ACTION_STOP) {
      bound_job_over_ = true;
    }
    HandleHeartbeat(response);
    if (bound_job_over_) {
      JoinEndedRun();
      Log(absl::StrCat(options_.job_id, " has ended"));
      break;
    }
    SleepFor(interval);
  }
  StopRun("shutting down");
  StopCommand("shutting down");
  Log("stopped");
  return absl::OkStatus();
}

grpc::Status WorkerDaemon::SendHeartbeat(const std::string& worker_id,
                                         v1::HeartbeatResponse* response) {
  v1::HeartbeatRequest request;
  request.set_worker_id(worker_id);
  {
    absl::MutexLock lock(&mu_);
    if (run_ != nullptr && !run_->done()) {
      request.set_job_id(run_->job_id());
      request.set_run_id(run_->run_id());
      request.set_run_steps(run_->steps());
    }
    if (command_ != nullptr) request.set_command_job_id(command_->job_id());
  }
  if (command_end_) *request.mutable_command_end() = *command_end_;
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
  return CoordinatorCall(&ctx, [&] { return stub_->Heartbeat(&ctx, request, response); });
}

void WorkerDaemon::LostContact(Contact& contact, const std::string& what, absl::StatusCode code,
                               const std::string& detail) {
  if (contact.connected != false) {
    contact.connected = false;
    if (options_.on_coordinator_state) options_.on_coordinator_state(false);
  }
  const std::string problem = absl::StrCat(what, " ", absl::StatusCodeToString(code));
  if (problem != contact.last_problem) {
    Log(absl::StrCat("cannot ", what, " ", options_.coordinator_address, ": ", detail,
                     "; retrying with backoff"));
  }
  contact.last_problem = problem;
  SleepFor(contact.backoff);
  contact.backoff = std::min(contact.backoff * 2, options_.max_backoff);
}

void WorkerDaemon::InContact(Contact& contact) {
  if (!contact.last_problem.empty()) Log("coordinator reachable again");
  contact.last_problem.clear();
  if (contact.connected != true) {
    contact.connected = true;
    if (options_.on_coordinator_state) options_.on_coordinator_state(true);
  }
  contact.backoff = absl::Milliseconds(100);
}

void WorkerDaemon::HandleHeartbeat(const v1::HeartbeatResponse& response) {
  JoinEndedRun();
  switch (response.action()) {
    case v1::HeartbeatResponse::ACTION_REREGISTER: {
      StopRun("the coordinator does not know this worker");
      absl::MutexLock lock(&mu_);
      if (!worker_id_.empty()) previous_worker_id_ = worker_id_;
      worker_id_.clear();
      return;
    }
    case v1::HeartbeatResponse::ACTION_STOP:
      StopRun("the coordinator asked to stop");
      // The process learns that its job ended too, and may still be saving
      // what it trained: it has the grace to exit before it is stopped.
      if (!command_ending_ && !command_job().empty()) {
        command_ending_ = true;
        command_stop_at_ = absl::Now() + options_.command_stop_grace;
        Log(absl::StrCat(command_job(), ": the job ended; its command has ",
                         absl::FormatDuration(options_.command_stop_grace), " to exit"));
      }
      return;
    case v1::HeartbeatResponse::ACTION_LAUNCH:
      LaunchCommand(response.assignment());
      return;
    case v1::HeartbeatResponse::ACTION_RUN:
      FollowAssignment(response.assignment());
      return;
    default:
      return;
  }
}

// --- Runs ----------------------------------------------------------------------------

// A run that ended is joined here, on the heartbeat thread.
void WorkerDaemon::JoinEndedRun() {
  std::shared_ptr<AssignmentRun> run;
  {
    absl::MutexLock lock(&mu_);
    run = run_;
  }
  if (run == nullptr || !run->done()) return;
  run->Join();
  absl::MutexLock lock(&mu_);
  if (run_ == run) run_.reset();
}

void WorkerDaemon::FollowAssignment(const v1::Assignment& a) {
  std::shared_ptr<AssignmentRun> run;
  {
    absl::MutexLock lock(&mu_);
    // Every run has an id (Assignment.run_id); one finished (or failed)
    // here is not run again.
    if (a.run_id().empty() || a.run_id() == done_run_) return;
    run = run_;
  }
  if (run != nullptr && run->run_id() == a.run_id() && !run->done()) {
    const v1::Assignment current = run->Snapshot();
    if (current.generation() != a.generation()) {
      Log(absl::StrCat(a.job_id(), ": generation ", a.generation(), ", rank ", a.rank(), " of ",
                       a.world_size(), " (was ", current.rank(), " of ", current.world_size(),
                       ")"));
      run->Update(a);
    }
    return;
  }
  // A new run comes with its spec; one without (the heartbeat crossed the
  // run's end) is taken from the next heartbeat.
  if (!a.has_spec()) return;
  StopRun(run != nullptr && run->job_id() == a.job_id()
              ? absl::StrCat("a new run of ", a.job_id(), " starts")
              : absl::StrCat("assigned to ", a.job_id()));
  StartRun(a);
}

AssignmentRun::Options WorkerDaemon::RunOptions() const {
  AssignmentRun::Options run;
  run.device = options_.device;
  run.num_threads = options_.num_threads;
  run.data_policy = &*data_policy_;
  run.storage = storage_.get();
  run.hostname = info_.hostname();
  run.coordinator = stub_.get();
  run.channel = options_.channel;
  run.connections_per_shard = options_.connections_per_shard;
  run.rpc_timeout = options_.rpc_timeout;
  run.ps_rpc_timeout = options_.ps_rpc_timeout;
  run.max_backoff = options_.max_backoff;
  run.progress_every_steps = options_.progress_every_steps;
  run.tensorboard_dir = options_.tensorboard_dir;
  run.bench_only_fixed_compute = options_.bench_only_fixed_compute;
  run.metrics = metrics_.get();
  run.log = log_;
  absl::MutexLock lock(&mu_);
  run.worker_id = worker_id_;
  run.shards = shards_;
  return run;
}

void WorkerDaemon::StartRun(const v1::Assignment& a) {
  std::shared_ptr<AssignmentRun> run = AssignmentRun::Create(a, RunOptions());
  Log(absl::StrCat(
      a.job_id(), ": rank ", a.rank(), " of ", a.world_size(), ", run ", run->run_id(),
      ", generation ", a.generation(), ", from epoch ", a.start_epoch(),
      a.start_step() > 0 ? absl::StrCat(" (step ", a.start_step(), ")") : std::string()));
  absl::MutexLock lock(&mu_);
  run_ = run;
  run->Start([this](AssignmentRun& r, const absl::Status& status) { OnRunEnd(r, status); });
}

void WorkerDaemon::StopRun(const std::string& why) {
  std::shared_ptr<AssignmentRun> run;
  {
    absl::MutexLock lock(&mu_);
    run = std::move(run_);
  }
  if (run == nullptr) return;
  if (!run->done()) Log(absl::StrCat(run->job_id(), ": stopping (", why, ")"));
  run->Cancel();
  run->Join();
}

void WorkerDaemon::OnRunEnd(AssignmentRun& run, const absl::Status& status) {
  if (status.ok()) {
    Log(absl::StrCat(run.job_id(), ": finished"));
    absl::MutexLock lock(&mu_);
    done_run_ = run.run_id();
    ++jobs_finished_;
  } else if (run.stopped()) {
    Log(absl::StrCat(run.job_id(), ": stopped"));
  } else {
    Log(absl::StrCat(run.job_id(), ": failed: ", status.ToString()));
    run.ReportFailure(status);
    absl::MutexLock lock(&mu_);
    done_run_ = run.run_id();
  }
}

// --- Commands ----------------------------------------------------------------------

void WorkerDaemon::LaunchCommand(const v1::Assignment& a) {
  {
    absl::MutexLock lock(&mu_);
    if (command_ != nullptr && command_->job_id() == a.job_id()) return;  // Running.
  }
  StopCommand(absl::StrCat("launching the command of ", a.job_id()));
  if (!a.spec().has_command() || command_end_) return;  // The last end goes first.
  auto refuse = [&](const std::string& why) {
    Log(absl::StrCat(a.job_id(), ": refusing its command: ", why));
    v1::CommandEnd end;
    end.set_job_id(a.job_id());
    end.set_refused(why);
    command_end_ = end;
  };
  absl::StatusOr<std::string> program =
      ResolveCommand(a.spec().command().argv(0), options_.command_roots);
  if (!program.ok()) return refuse(std::string(program.status().message()));
  std::string dir = (fs::temp_directory_path() / "pstrain-command-XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) {
    return refuse(absl::StrCat("cannot make a temporary directory: ", std::strerror(errno)));
  }
  const std::string credentials = (fs::path(dir) / "credentials.json").string();
  if (absl::Status s = WriteLauncherCredentials(credentials, options_.launcher_credentials);
      !s.ok()) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    return refuse(std::string(s.message()));
  }
  CommandRun::Options run;
  run.env = {{"PSTRAIN_SERVER", options_.coordinator_address},
             {"PSTRAIN_JOB", a.job_id()},
             {"PSTRAIN_CREDENTIALS", credentials},
             {"PSTRAIN_LAUNCHER", worker_id()},
             {"PSTRAIN_DEVICE", options_.device},
             {"PSTRAIN_MODE", absl::AsciiStrToLower(absl::StripPrefix(
                                  v1::ConsistencyMode_Name(a.spec().mode()), "CONSISTENCY_"))}};
  if (std::string path = BuildTreePythonPath(); !path.empty()) run.env["PYTHONPATH"] = path;
  run.stop_grace = options_.command_stop_grace;
  run.log = log_;
  absl::StatusOr<std::unique_ptr<CommandRun>> started =
      CommandRun::Start(a.job_id(), *program, a.spec().command(), std::move(run));
  if (!started.ok()) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    return refuse(absl::StrCat("cannot start it: ", started.status().message()));
  }
  Log(absl::StrCat(a.job_id(), ": running its command ", *program, " (pid ", (*started)->pid(),
                   ")"));
  command_dir_ = dir;
  absl::MutexLock lock(&mu_);
  command_ = *std::move(started);
}

void WorkerDaemon::PollCommand() {
  std::optional<v1::CommandEnd> end;
  {
    absl::MutexLock lock(&mu_);
    if (command_ == nullptr) return;
    end = command_->Poll();
  }
  if (end) {
    CommandEnded(*std::move(end));
    return;
  }
  // Its job ended: SIGTERM once the grace is over, SIGKILL one grace later,
  // without blocking the heartbeats.
  const absl::Time now = absl::Now();
  const int sig = now >= command_kill_at_ ? SIGKILL : now >= command_stop_at_ ? SIGTERM : 0;
  if (sig == 0) return;
  absl::MutexLock lock(&mu_);
  if (command_ == nullptr) return;
  Log(absl::StrCat(command_->job_id(), ": its command did not exit ",
                   sig == SIGKILL ? "after SIGTERM; SIGKILL" : "after its job ended; SIGTERM",
                   " to its process group"));
  command_->Signal(sig);
  if (sig == SIGTERM) {
    command_stop_at_ = absl::InfiniteFuture();
    command_kill_at_ = now + options_.command_stop_grace;
  } else {
    command_kill_at_ = absl::InfiniteFuture();
  }
}

void WorkerDaemon::StopCommand(const std::string& why) {
  std::unique_ptr<CommandRun> command;
  {
    absl::MutexLock lock(&mu_);
    if (command_ == nullptr) return;
    command = std::move(command_);
  }
  Log(absl::StrCat(command->job_id(), ": stopping its command (", why, ")"));
  v1::CommandEnd end = command->Stop();
  command.reset();
  CommandEnded(std::move(end));
}

void WorkerDaemon::CommandEnded(v1::CommandEnd end) {
  {
    absl::MutexLock lock(&mu_);
    command_.reset();  // Joins its output reader.
  }
  std::error_code ec;
  if (!command_dir_.empty()) fs::remove_all(command_dir_, ec);
  command_dir_.clear();
  command_ending_ = false;
  command_stop_at_ = absl::InfiniteFuture();
  command_kill_at_ = absl::InfiniteFuture();
  command_end_ = std::move(end);
}

}  // namespace pstrain
