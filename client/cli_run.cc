// `pstrain run -n N [options] -- COMMAND ARGS...`: one machine's launcher for
// a training script written with pstrain.torch, in the spirit of torchrun
// and horovodrun. Phases:
//   MakeSpec        the job: a model the workers declare (external), the
//                   options' mode, epochs, batch, optimizer (or --job FILE).
//   StartServer     without --server, a pstrain-server (this binary's
//                   directory) on 127.0.0.1 with --state-dir, stopped at the
//                   end (the checkpoints stay there).
//   Submit          the job, with the admin's TLS and token options.
//   StartWorkers    N processes of COMMAND, each with PSTRAIN_SERVER,
//                   PSTRAIN_JOB, PSTRAIN_CREDENTIALS (a JSON file naming
//                   the CA, the worker certificate and key and the worker
//                   token file: --worker-*) and PSTRAIN_MODE; a build
//                   tree's Python package first on PYTHONPATH.
//   Follow          the job to its end, as `pstrain watch`; a job whose
//                   workers all exited before it ended is cancelled.
// Exits 0 when the job SUCCEEDED, 1 when it did not, 2 for a usage error.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/cli_internal.h"
#include "common/job_spec.h"
#include "common/job_state.h"
#include "common/process.h"
#include "common/status_macros.h"

ABSL_DECLARE_FLAG(std::string, server);
ABSL_DECLARE_FLAG(std::string, mode);
ABSL_DECLARE_FLAG(std::optional<int>, staleness);
ABSL_DECLARE_FLAG(std::optional<int>, averaging_frequency);
ABSL_DECLARE_FLAG(std::optional<int>, epochs);
ABSL_DECLARE_FLAG(std::string, compression);
ABSL_DECLARE_FLAG(std::string, pull_compression);

ABSL_FLAG(int, n, 0, "Worker processes to start (1 to 64)");
ABSL_FLAG(std::string, job, "",
          "A job file to start from (its model must be external, or absent); the other "
          "options override it");
ABSL_FLAG(int, batch_size, 64, "Samples per step and worker (the DistributedSampler's batch)");
ABSL_FLAG(std::string, optimizer, "sgd", "The servers' optimizer: sgd, adam or adamw");
ABSL_FLAG(double, lr, 0.01, "Learning rate");
ABSL_FLAG(double, momentum, 0.0, "SGD momentum");
ABSL_FLAG(double, weight_decay, 0.0, "Weight decay (L2 for sgd and adam; decoupled for adamw)");
ABSL_FLAG(std::string, name, "", "The job's name (default: the command's script)");
ABSL_FLAG(uint64_t, seed, 0, "Shuffling seed of the epoch plan");
ABSL_FLAG(std::string, worker_token_file, "",
          "The workers' token file (with a server that checks tokens)");
ABSL_FLAG(std::string, worker_tls_cert, "", "The workers' certificate for mTLS (PEM)");
ABSL_FLAG(std::string, worker_tls_key, "", "The key of --worker-tls-cert (PEM)");
ABSL_FLAG(std::string, server_args, "",
          "Extra arguments for the local pstrain-server, space-separated (no --server): "
          "e.g. its --tls-cert, --tls-key, --tls-ca and --token-file");
ABSL_FLAG(std::string, state_dir, "pstrain-run-state",
          "The local pstrain-server's state directory: the job's status and checkpoints "
          "(no --server)");

namespace pstrain {
namespace cli_internal {
namespace {

namespace fs = std::filesystem;

struct RunOptions {
  int n = 0;
  std::string job_file, optimizer, name, worker_token_file, worker_cert, worker_key, server_args,
      state_dir;
  bool local = false;  // No --server: a local pstrain-server for the run.
  int batch_size = 64;
  double lr = 0.01, momentum = 0, weight_decay = 0;
  uint64_t seed = 0;
  SubmitOverrides overrides;
};

// The job `pstrain run` submits: external model, the options applied.
absl::StatusOr<v1::JobSpec> MakeSpec(const RunOptions& o, const std::vector<std::string>& command) {
  v1::JobSpec spec;
  if (!o.job_file.empty()) {
    PSTRAIN_ASSIGN_OR_RETURN(spec, LoadJobSpec(o.job_file));
    if (spec.has_model() || !spec.model_file().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(o.job_file,
                       " names a model; `pstrain run` trains the model the "
                       "workers declare (pstrain.torch): use `pstrain submit` for it"));
    }
  } else {
    static const auto* kOptimizers = new std::map<std::string, v1::OptimizerType>{
        {"sgd", v1::OPTIMIZER_SGD}, {"adam", v1::OPTIMIZER_ADAM}, {"adamw", v1::OPTIMIZER_ADAMW}};
    const auto type = kOptimizers->find(o.optimizer);
    if (type == kOptimizers->end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--optimizer must be sgd, adam or adamw, got '", o.optimizer, "'"));
    }
    spec.mutable_optimizer()->set_type(type->second);
    spec.mutable_optimizer()->set_learning_rate(static_cast<float>(o.lr));
    spec.mutable_optimizer()->set_momentum(static_cast<float>(o.momentum));
    spec.mutable_optimizer()->set_weight_decay(static_cast<float>(o.weight_decay));
    spec.set_epochs(1);
    spec.set_batch_size(o.batch_size);
    spec.set_seed(o.seed);
  }
  if (!spec.has_external_model()) spec.mutable_external_model()->set_framework("torch");
  spec.set_workers(o.n);
  if (spec.name().empty()) {
    spec.set_name(!o.name.empty()
                      ? o.name
                      : fs::path(command.size() > 1 ? command[1] : command[0]).filename().string());
  }
  PSTRAIN_RETURN_IF_ERROR(ApplyOverrides(o.overrides, spec));
  PSTRAIN_RETURN_IF_ERROR(ValidateJobSpec(spec));
  return spec;
}

}  // namespace

int Cli::RunWorkers(const std::vector<std::string>& all_args) {
  static const Command kRun = {
      "run",
      "usage: pstrain run -n N [options] -- COMMAND [ARGS...]\n"
      "  Trains a script written with pstrain.torch on this machine: submits a job whose\n"
      "  model the workers declare, starts N processes of COMMAND bound to it and\n"
      "  follows the job to its end (exit 0 only if it SUCCEEDED). Without --server it\n"
      "  starts a pstrain-server on 127.0.0.1 for the run and stops it afterwards.\n"
      "  Each process gets PSTRAIN_SERVER, PSTRAIN_JOB, PSTRAIN_MODE and\n"
      "  PSTRAIN_CREDENTIALS (a JSON file naming --tls-ca, --worker-tls-cert,\n"
      "  --worker-tls-key and --worker-token-file). Stop a run with Ctrl-C, which\n"
      "  reaches its server and processes too (one process group); killing only\n"
      "  `pstrain run` leaves them running.\n",
      {&absl::GetFlagReflectionHandle(FLAGS_n),
       &absl::GetFlagReflectionHandle(FLAGS_job),
       &absl::GetFlagReflectionHandle(FLAGS_mode),
       &absl::GetFlagReflectionHandle(FLAGS_epochs),
       &absl::GetFlagReflectionHandle(FLAGS_batch_size),
       &absl::GetFlagReflectionHandle(FLAGS_optimizer),
       &absl::GetFlagReflectionHandle(FLAGS_lr),
       &absl::GetFlagReflectionHandle(FLAGS_momentum),
       &absl::GetFlagReflectionHandle(FLAGS_weight_decay),
       &absl::GetFlagReflectionHandle(FLAGS_staleness),
       &absl::GetFlagReflectionHandle(FLAGS_averaging_frequency),
       &absl::GetFlagReflectionHandle(FLAGS_compression),
       &absl::GetFlagReflectionHandle(FLAGS_pull_compression),
       &absl::GetFlagReflectionHandle(FLAGS_name),
       &absl::GetFlagReflectionHandle(FLAGS_seed),
       &absl::GetFlagReflectionHandle(FLAGS_worker_token_file),
       &absl::GetFlagReflectionHandle(FLAGS_worker_tls_cert),
       &absl::GetFlagReflectionHandle(FLAGS_worker_tls_key),
       &absl::GetFlagReflectionHandle(FLAGS_server_args),
       &absl::GetFlagReflectionHandle(FLAGS_state_dir)}};
  // Everything after "--" is the command, never options.
  const auto dashes = std::find(all_args.begin(), all_args.end(), "--");
  const std::vector<std::string> args(all_args.begin(), dashes);
  const std::vector<std::string> command =
      dashes == all_args.end() ? std::vector<std::string>()
                               : std::vector<std::string>(dashes + 1, all_args.end());
  RunOptions o;
  Parsed parsed = ParseCommand(kRun, args, [&] {
    o.n = absl::GetFlag(FLAGS_n);
    o.job_file = absl::GetFlag(FLAGS_job);
    o.batch_size = absl::GetFlag(FLAGS_batch_size);
    o.optimizer = absl::GetFlag(FLAGS_optimizer);
    o.lr = absl::GetFlag(FLAGS_lr);
    o.momentum = absl::GetFlag(FLAGS_momentum);
    o.weight_decay = absl::GetFlag(FLAGS_weight_decay);
    o.name = absl::GetFlag(FLAGS_name);
    o.seed = absl::GetFlag(FLAGS_seed);
    o.worker_token_file = absl::GetFlag(FLAGS_worker_token_file);
    o.worker_cert = absl::GetFlag(FLAGS_worker_tls_cert);
    o.worker_key = absl::GetFlag(FLAGS_worker_tls_key);
    o.server_args = absl::GetFlag(FLAGS_server_args);
    o.state_dir = absl::GetFlag(FLAGS_state_dir);
    o.local = absl::GetFlag(FLAGS_server).empty();
    o.overrides.staleness = absl::GetFlag(FLAGS_staleness);
    o.overrides.averaging_frequency = absl::GetFlag(FLAGS_averaging_frequency);
    o.overrides.epochs = absl::GetFlag(FLAGS_epochs);
    o.overrides.mode = absl::GetFlag(FLAGS_mode);
    o.overrides.compression = absl::GetFlag(FLAGS_compression);
    o.overrides.pull_compression = absl::GetFlag(FLAGS_pull_compression);
  });
  if (parsed.exit_code) return *parsed.exit_code;
  if (!parsed.positional.empty()) {
    return Usage(
        kRun, absl::StrCat("unexpected '", parsed.positional[0], "': the command goes after --"));
  }
  if (command.empty()) return Usage(kRun, "no command: put it after --");
  if (o.n < 1 || o.n > 64) return Usage(kRun, absl::StrCat("-n must be in [1, 64], got ", o.n));
  if (o.worker_cert.empty() != o.worker_key.empty()) {
    return Usage(kRun, "--worker-tls-cert and --worker-tls-key go together");
  }
  absl::StatusOr<v1::JobSpec> spec = MakeSpec(o, command);
  if (!spec.ok()) {
    err_ << "pstrain run: invalid job: " << spec.status().message() << std::endl;
    return kExitUsage;
  }

  // A directory for the run's own files: the local server's log and the
  // workers' credentials file (removed when the job succeeded).
  std::string dir_template = (fs::temp_directory_path() / "pstrain-run-XXXXXX").string();
  if (mkdtemp(dir_template.data()) == nullptr) {
    err_ << "pstrain run: cannot make a temporary directory: " << std::strerror(errno) << std::endl;
    return kExitFailed;
  }
  const fs::path dir = dir_template;
  pid_t server_pid = -1;
  auto stop_server = [&] {
    if (server_pid <= 0) return;
    kill(server_pid, SIGTERM);
    int status = 0;
    for (int i = 0; i < 100 && waitpid(server_pid, &status, WNOHANG) == 0; ++i) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    if (waitpid(server_pid, &status, WNOHANG) == 0) {
      kill(server_pid, SIGKILL);
      waitpid(server_pid, &status, 0);
    }
    server_pid = -1;
  };
  auto fail = [&](const std::string& message) {
    err_ << "pstrain run: " << message << " (files in " << dir.string() << ")" << std::endl;
    stop_server();
    return kExitFailed;
  };

  // StartServer.
  if (o.local) {
    std::error_code ec;
    const fs::path self = fs::read_symlink("/proc/self/exe", ec);
    const std::string binary = (self.parent_path() / "pstrain-server").string();
    std::vector<std::string> argv = {binary, "--listen=127.0.0.1:0",
                                     absl::StrCat("--state-dir=", o.state_dir)};
    for (absl::string_view a : absl::StrSplit(o.server_args, ' ', absl::SkipEmpty())) {
      argv.emplace_back(a);
    }
    const std::string log = (dir / "server.log").string();
    SpawnOptions to_log;
    to_log.log_path = log;
    absl::StatusOr<pid_t> started = SpawnProcess(argv, {}, to_log);
    if (!started.ok()) return fail(std::string(started.status().message()));
    server_pid = *started;
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    for (;;) {
      const std::string text = ReadFileToString(log).value_or("");
      const size_t at = text.find("listening on ");
      if (at != std::string::npos && text.find(' ', at + 13) != std::string::npos) {
        server_ = text.substr(at + 13, text.find(' ', at + 13) - at - 13);
        break;
      }
      int status = 0;
      if (waitpid(server_pid, &status, WNOHANG) == server_pid) {
        server_pid = -1;
        return fail(absl::StrCat("the local pstrain-server ", ExitText(status), ":\n", text));
      }
      if (absl::Now() > deadline) return fail("the local pstrain-server did not start in 60 s");
      absl::SleepFor(absl::Milliseconds(50));
    }
    out_ << "pstrain run: local server on " << server_ << " (state in " << o.state_dir << ")"
         << std::endl;
  }
  if (std::optional<int> bad = CheckChannelOptions()) {
    stop_server();
    return *bad;
  }

  // Submit.
  v1::SubmitJobRequest request;
  *request.mutable_spec() = *spec;
  v1::SubmitJobResponse response;
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    grpc::Status status = stub().SubmitJob(&ctx, request, &response);
    if (!status.ok()) {
      const int code = ReportRpcError("run", status);
      stop_server();
      return code;
    }
  }
  const std::string job_id = response.job_id();
  out_ << "pstrain run: " << job_id << " (" << spec->name() << "), " << o.n << " worker"
       << (o.n == 1 ? "" : "s") << ", " << v1::ConsistencyMode_Name(spec->mode()) << std::endl;

  // StartWorkers.
  const std::string credentials = (dir / "credentials.json").string();
  if (absl::Status s = WriteLauncherCredentials(credentials, {.tls_ca = tls_.ca_file,
                                                              .tls_cert = o.worker_cert,
                                                              .tls_key = o.worker_key,
                                                              .tls_server_name = tls_.server_name,
                                                              .token_file = o.worker_token_file});
      !s.ok()) {
    return fail(std::string(s.message()));
  }
  std::map<std::string, std::string> env = {
      {"PSTRAIN_SERVER", server_},
      {"PSTRAIN_JOB", job_id},
      {"PSTRAIN_CREDENTIALS", credentials},
      {"PSTRAIN_MODE", absl::AsciiStrToLower(absl::StripPrefix(
                           v1::ConsistencyMode_Name(spec->mode()), "CONSISTENCY_"))}};
  // A build tree's Python package goes first on the processes' PYTHONPATH,
  // so that `import pstrain.torch` finds this build's.
  if (std::string path = BuildTreePythonPath(); !path.empty()) env["PYTHONPATH"] = path;
  std::vector<pid_t> workers;
  for (int i = 0; i < o.n; ++i) {
    absl::StatusOr<pid_t> pid = SpawnProcess(command, env, {});
    if (!pid.ok()) {
      for (pid_t w : workers) kill(w, SIGTERM);
      return fail(std::string(pid.status().message()));
    }
    workers.push_back(*pid);
  }

  // Follow, while a thread reaps the workers: when every one has exited and
  // the job has not ended, it cannot end, and is cancelled.
  std::atomic<bool> followed{false};
  std::vector<int> exits(workers.size(), 0);
  // A worker that fails before the job started leaves it short of bound
  // workers for good: it is cancelled too (the others are then told to stop).
  std::thread reaper([&] {
    auto channel = CreateChannel(server_, *ChannelOptionsOnce());
    auto stub = v1::Coordinator::NewStub(channel);
    auto cancel = [&] {
      grpc::ClientContext ctx;
      Deadline(&ctx);
      v1::CancelJobRequest request;
      request.set_job_id(job_id);
      v1::CancelJobResponse ignored;
      (void)stub->CancelJob(&ctx, request, &ignored);
    };
    auto queued = [&] {
      grpc::ClientContext ctx;
      Deadline(&ctx);
      v1::GetJobRequest request;
      request.set_job_id(job_id);
      v1::JobStatus status;
      return stub->GetJob(&ctx, request, &status).ok() && status.state() == v1::JOB_STATE_QUEUED;
    };
    size_t left = workers.size();
    bool cancelled = false;
    while (left > 0) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, 0);
      if (pid < 0) break;
      const auto it = std::find(workers.begin(), workers.end(), pid);
      if (it == workers.end()) continue;  // The local server: stop_server reaps it.
      exits[static_cast<size_t>(it - workers.begin())] = status;
      --left;
      const bool failed = !WIFEXITED(status) || WEXITSTATUS(status) != 0;
      if (failed && !cancelled && !followed.load() && queued()) {
        cancelled = true;
        cancel();
      }
    }
    if (followed.load() || cancelled) return;
    absl::SleepFor(absl::Seconds(5));  // The last reports arrive.
    if (!followed.load()) cancel();
  });
  absl::StatusOr<v1::JobStatus> last = Follow(job_id, /*quiet=*/!env_.stdout_is_tty);
  followed.store(true);
  reaper.join();
  for (size_t i = 0; i < workers.size(); ++i) {
    if (!WIFEXITED(exits[i]) || WEXITSTATUS(exits[i]) != 0) {
      err_ << "pstrain run: worker process " << i << " (pid " << workers[i] << ") "
           << ExitText(exits[i]) << std::endl;
    }
  }
  stop_server();
  if (!last.ok()) {
    err_ << "pstrain run: lost the job: " << last.status().message() << std::endl;
    return kExitFailed;
  }
  out_ << "pstrain run: " << job_id << " " << JobStateName(last->state())
       << (last->reason().empty() ? "" : absl::StrCat(" (", last->reason(), ")")) << std::endl;
  if (last->state() != v1::JOB_STATE_SUCCEEDED) return kExitFailed;
  std::error_code ec;
  fs::remove_all(dir, ec);
  return kExitOk;
}

}  // namespace cli_internal
}  // namespace pstrain
