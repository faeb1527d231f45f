#include "client/cli.h"

#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/onnx_export.h"
#include "client/report.h"
#include "client/summary.h"
#include "common/build_info.h"
#include "common/checkpoint.h"
#include "common/data/dataset.h"
#include "common/data/packed_format.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "common/rpc/channel.h"
#include "common/rpc/health.h"
#include "common/rpc/security.h"
#include "common/status_macros.h"
#include "pstrain/v1/service.grpc.pb.h"

namespace pstrain {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

constexpr char kUsage[] =
    "usage: pstrain [--server HOST:PORT] [--timeout-ms N] <command> [args]\n"
    "\n"
    "commands:\n"
    "  submit JOB.json [--workers N] [--mode sync|async|ssp|average] [--staleness S]\n"
    "                  [--averaging-frequency K] [--epochs N]\n"
    "                  [--compression none|fp16|bf16|topk[:RATIO]|onebit] [--watch] [--json]\n"
    "                                submit a job (and follow it with --watch)\n"
    "  status JOB [--json] [--report FILE.html]\n"
    "                                show a job's state, progress and test metrics\n"
    "  report JOB -o FILE.html       write the job's report: loss and accuracy curves,\n"
    "                                confusion heat map, per-class metrics, spec, timing\n"
    "  list                          list the jobs, newest first\n"
    "  watch JOB                     follow a job until it ends (progress bar)\n"
    "  cancel JOB                    cancel a queued or running job\n"
    "  download JOB -o FILE          save the job's latest checkpoint\n"
    "  export CKPT|JOB -o FILE.onnx  write the trained inference graph as ONNX\n"
    "  prepare JOB.json -o DIR       pack the job's dataset once into checksummed shards\n"
    "                                of decoded images (dataset format DATASET_FORMAT_PACKED)\n"
    "  workers                       list the registered workers\n"
    "  summary JOB.json              print the model's layers and parameter counts\n"
    "  health [ADDRESS] [--service S] ask a daemon's grpc.health.v1.Health (exit 0 if SERVING)\n"
    "  version                       print the build (version, git commit)\n"
    "\n"
    "--server defaults to $PSTRAIN_SERVER, else 127.0.0.1:7070. TLS: --tls-ca FILE\n"
    "($PSTRAIN_TLS_CA), for mTLS --tls-cert/--tls-key FILE ($PSTRAIN_TLS_CERT,\n"
    "$PSTRAIN_TLS_KEY), --tls-server-name NAME. The admin token: --token-file FILE\n"
    "($PSTRAIN_TOKEN_FILE). --timeout-ms (default 10000) is the deadline of every call.\n"
    "Exit codes: 0 success, 1 failed job or RPC error, 2 usage error or invalid job spec.\n"
    "Every command takes --help.\n";

// --- Small helpers ---------------------------------------------------------------

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string JsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  return absl::StrFormat("%.6g", v);
}

std::string FormatDuration(double seconds) {
  if (seconds < 0 || !std::isfinite(seconds)) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

bool Terminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

// Parsed command-line flags of one subcommand: "--name value", "--name=value"
// and boolean "--name"; everything else is positional.
struct ParsedArgs {
  std::vector<std::string> positional;
  std::map<std::string, std::string> values;
  std::map<std::string, bool> switches;
  std::string error;
  bool help = false;
};

ParsedArgs ParseArgs(const std::vector<std::string>& args,
                     const std::vector<std::string>& value_flags,
                     const std::vector<std::string>& switch_flags) {
  ParsedArgs parsed;
  auto is_in = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      parsed.help = true;
      continue;
    }
    if (a.size() < 2 || a[0] != '-') {
      parsed.positional.push_back(a);
      continue;
    }
    std::string name = a;
    std::optional<std::string> value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
    }
    if (is_in(switch_flags, name) && !value) {
      parsed.switches[name] = true;
    } else if (is_in(value_flags, name)) {
      if (!value) {
        if (i + 1 >= args.size()) {
          parsed.error = absl::StrCat(name, " needs a value");
          return parsed;
        }
        value = args[++i];
      }
      parsed.values[name] = *value;
    } else {
      parsed.error = absl::StrCat("unknown option '", a, "'");
      return parsed;
    }
  }
  return parsed;
}

bool ParseInt(const std::string& text, int min_value, int* out) {
  int v = 0;
  if (!absl::SimpleAtoi(text, &v) || v < min_value) return false;
  *out = v;
  return true;
}

bool ParseInt64(const std::string& text, int64_t min_value, int64_t* out) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v < min_value) return false;
  *out = v;
  return true;
}

// Calls `on_timeout` when Kick() was not called for `idle` (repeatedly, once
// per idle period). Stops on destruction.
class IdleWatchdog {
 public:
  IdleWatchdog(absl::Duration idle, std::function<void()> on_timeout)
      : idle_(idle), on_timeout_(std::move(on_timeout)), last_kick_(absl::Now()) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~IdleWatchdog() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Kick() {
    absl::MutexLock lock(&mu_);
    last_kick_ = absl::Now();
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      const absl::Time due = last_kick_ + idle_;
      if (absl::Now() >= due) {
        last_kick_ = absl::Now();
        mu_.Unlock();
        on_timeout_();
        mu_.Lock();
        continue;
      }
      mu_.AwaitWithDeadline(absl::Condition(&stop_), due);
    }
  }

  const absl::Duration idle_;
  const std::function<void()> on_timeout_;
  absl::Mutex mu_;
  absl::Time last_kick_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// --- The commands ----------------------------------------------------------------

class Cli {
 public:
  Cli(const CliEnvironment& env, std::ostream& out, std::ostream& err)
      : env_(env), out_(out), err_(err) {}

  int Run(std::vector<std::string> args);

 private:
  int Submit(const std::vector<std::string>& args);
  int Status(const std::vector<std::string>& args);
  int Report(const std::vector<std::string>& args);
  // GetJob and GetJobHistory, then the HTML page written to `path`.
  int WriteReport(const std::string& what, const v1::JobStatus& status, const std::string& path);
  int List(const std::vector<std::string>& args);
  int Watch(const std::vector<std::string>& args);
  int Cancel(const std::vector<std::string>& args);
  int Download(const std::vector<std::string>& args);
  int Export(const std::vector<std::string>& args);
  int Prepare(const std::vector<std::string>& args);
  int Workers(const std::vector<std::string>& args);
  int Summary(const std::vector<std::string>& args);
  int Health(const std::vector<std::string>& args);

  // Downloads the job's latest checkpoint to `path` (through path.tmp,
  // verified, renamed) and parses it into `ckpt`; reports errors as `what`.
  int FetchCheckpoint(const std::string& what, const std::string& job_id, const std::string& path,
                      v1::Checkpoint* ckpt, int64_t* bytes);
  // Follows the job to its end; returns its last status (or the error).
  absl::StatusOr<v1::JobStatus> Follow(const std::string& job_id, bool quiet);
  int ReportRpcError(const std::string& what, const grpc::Status& status);
  int Usage(const std::string& command, const std::string& usage, const std::string& error);
  v1::Coordinator::Stub& stub();
  // Every unary call: a deadline, and wait-for-ready, so that a call made
  // while the channel connects (a server that just began listening) waits
  // for it within the deadline instead of failing on the first UNAVAILABLE.
  void Deadline(grpc::ClientContext* ctx) const {
    ctx->set_deadline(DeadlineFromNow(absl::Milliseconds(timeout_ms_)));
    ctx->set_wait_for_ready(true);
  }

  const CliEnvironment& env_;
  std::ostream& out_;
  std::ostream& err_;
  // The channel's TLS and token, from the global options (ChannelOptions()
  // builds them on first use).
  absl::StatusOr<ChannelOptions> ChannelOptionsOnce();

  std::string server_;
  int timeout_ms_ = 10000;
  TlsOptions tls_;
  std::string token_file_;
  std::optional<absl::StatusOr<ChannelOptions>> channel_options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

absl::StatusOr<ChannelOptions> Cli::ChannelOptionsOnce() {
  if (!channel_options_) {
    channel_options_ = [this]() -> absl::StatusOr<ChannelOptions> {
      ChannelOptions options;
      PSTRAIN_ASSIGN_OR_RETURN(options.credentials, ChannelCredentialsFor(tls_));
      options.tls_server_name = tls_.server_name;
      if (!token_file_.empty()) {
        auto identity = std::make_shared<CallIdentity>();
        PSTRAIN_ASSIGN_OR_RETURN(identity->token, ReadTokenFile(token_file_));
        options.identity = std::move(identity);
      }
      return options;
    }();
  }
  return *channel_options_;
}

v1::Coordinator::Stub& Cli::stub() {
  if (stub_ == nullptr) {
    // A bad TLS or token file is reported by RunCli before any command runs,
    // so the options are good here.
    channel_ = CreateChannel(server_, *ChannelOptionsOnce());
    stub_ = v1::Coordinator::NewStub(channel_);
  }
  return *stub_;
}

int Cli::ReportRpcError(const std::string& what, const grpc::Status& status) {
  std::string hint;
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    hint = tls_.enabled()
               ? absl::StrCat(" (is pstrain-server running at ", server_,
                              "? With TLS: is its certificate signed by --tls-ca, for the name "
                              "dialled, and does it need a client certificate (--tls-cert, "
                              "--tls-key)?)")
               : absl::StrCat(" (is pstrain-server running at ", server_,
                              "? A server with TLS needs --tls-ca or PSTRAIN_TLS_CA)");
  } else if (status.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
    hint = " (the admin token: --token-file or PSTRAIN_TOKEN_FILE)";
  } else if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    // Calls wait for the channel: a deadline with no connection is a server
    // that is not there (or a TLS mismatch), not a slow one.
    const grpc_connectivity_state state =
        channel_ != nullptr ? channel_->GetState(false) : GRPC_CHANNEL_READY;
    if (state != GRPC_CHANNEL_READY) {
      hint = absl::StrCat(" (could not connect to ", server_, " within ", timeout_ms_,
                          " ms: is pstrain-server running there",
                          tls_.enabled() ? ", and do its certificate and --tls-ca match?)"
                                         : "? A server with TLS needs --tls-ca)");
    } else {
      hint = absl::StrCat(" (no answer from ", server_, " within ", timeout_ms_,
                          " ms; see --timeout-ms)");
    }
  }
  err_ << "pstrain " << what << ": error: " << status.error_message() << hint << " ["
       << absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())) << "]"
       << std::endl;
  return status.error_code() == grpc::StatusCode::INVALID_ARGUMENT ? kExitUsage : kExitFailed;
}

int Cli::Usage(const std::string& command, const std::string& usage, const std::string& error) {
  if (error.empty()) {
    out_ << usage;
    return kExitOk;
  }
  err_ << "pstrain " << command << ": " << error << "\n" << usage;
  return kExitUsage;
}

int Cli::Run(std::vector<std::string> args) {
  // Global options, wherever they appear.
  server_ = env_.server_env.empty() ? kDefaultServerAddress : env_.server_env;
  token_file_ = env_.token_file_env;
  tls_.ca_file = env_.tls_ca_env;
  tls_.cert_file = env_.tls_cert_env;
  tls_.key_file = env_.tls_key_env;
  const std::set<std::string> global_options = {"--server",         "--timeout-ms", "--token-file",
                                                "--tls-ca",         "--tls-cert",   "--tls-key",
                                                "--tls-server-name"};
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string name = args[i], value;
    bool has_value = false;
    const size_t eq = name.find('=');
    if (name.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (global_options.count(name) == 0) {
      rest.push_back(args[i]);
      continue;
    }
    if (!has_value) {
      if (i + 1 >= args.size()) {
        err_ << "pstrain: " << name << " needs a value\n" << kUsage;
        return kExitUsage;
      }
      value = args[++i];
    }
    if (name == "--server") {
      server_ = value;
    } else if (name == "--token-file") {
      token_file_ = value;
    } else if (name == "--tls-ca") {
      tls_.ca_file = value;
    } else if (name == "--tls-cert") {
      tls_.cert_file = value;
    } else if (name == "--tls-key") {
      tls_.key_file = value;
    } else if (name == "--tls-server-name") {
      tls_.server_name = value;
    } else if (!ParseInt(value, 1, &timeout_ms_)) {
      err_ << "pstrain: --timeout-ms must be a positive integer, got '" << value << "'\n";
      return kExitUsage;
    }
  }
  if (rest.empty()) {
    err_ << kUsage;
    return kExitUsage;
  }
  const std::string command = rest[0];
  rest.erase(rest.begin());
  if (command == "help" || command == "--help" || command == "-h") {
    out_ << kUsage;
    return kExitOk;
  }
  if (command == "version" || command == "--version") {
    out_ << BuildId() << "\n";
    return kExitOk;
  }
  // `export FILE` reads a local checkpoint: no server, no TLS or token.
  const bool local_export =
      command == "export" && !rest.empty() && std::filesystem::is_regular_file(rest[0]);
  if (command != "summary" && command != "prepare" && !local_export) {
    // TLS and token files are read (and their errors reported) once, here.
    absl::StatusOr<ChannelOptions> options = ChannelOptionsOnce();
    if (!options.ok()) {
      err_ << "pstrain: " << options.status().message() << std::endl;
      return kExitUsage;
    }
  }
  if (command == "submit") return Submit(rest);
  if (command == "status") return Status(rest);
  if (command == "report") return Report(rest);
  if (command == "list") return List(rest);
  if (command == "watch") return Watch(rest);
  if (command == "cancel") return Cancel(rest);
  if (command == "download") return Download(rest);
  if (command == "export") return Export(rest);
  if (command == "prepare") return Prepare(rest);
  if (command == "workers") return Workers(rest);
  if (command == "summary") return Summary(rest);
  if (command == "health") return Health(rest);
  err_ << "pstrain: unknown command '" << command << "'\n\n" << kUsage;
  return kExitUsage;
}

// submit ------------------------------------------------------------------------

// --compression none|fp16|bf16|topk[:RATIO]|onebit.
absl::StatusOr<v1::CompressionSpec> ParseCompression(const std::string& value) {
  static const std::map<std::string, v1::CompressionSpec::Method> kMethods = {
      {"none", v1::CompressionSpec::COMPRESSION_NONE},
      {"fp16", v1::CompressionSpec::COMPRESSION_FP16},
      {"bf16", v1::CompressionSpec::COMPRESSION_BF16},
      {"topk", v1::CompressionSpec::COMPRESSION_TOPK},
      {"onebit", v1::CompressionSpec::COMPRESSION_ONEBIT}};
  const size_t colon = value.find(':');
  auto it = kMethods.find(value.substr(0, colon));
  v1::CompressionSpec spec;
  if (it == kMethods.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--compression must be none, fp16, bf16, topk[:RATIO] or onebit, got '", value, "'"));
  }
  spec.set_method(it->second);
  if (colon != std::string::npos) {
    float ratio = 0;
    if (it->second != v1::CompressionSpec::COMPRESSION_TOPK ||
        !absl::SimpleAtof(value.substr(colon + 1), &ratio) || !(ratio > 0 && ratio <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--compression topk:RATIO takes a RATIO in (0, 1], got '", value, "'"));
    }
    spec.set_topk_ratio(ratio);
  }
  return spec;
}

constexpr char kSubmitUsage[] =
    "usage: pstrain submit JOB.json [--workers N] [--mode sync|async|ssp|average]\n"
    "                      [--staleness S] [--averaging-frequency K] [--epochs N]\n"
    "                      [--compression none|fp16|bf16|topk[:RATIO]|onebit]\n"
    "                      [--watch] [--json]\n"
    "  Validates the job locally, submits it and prints its id. With --watch, follows\n"
    "  it like `pstrain watch` and exits 0 only if it SUCCEEDED. With --json the last\n"
    "  line is a JSON object (job_id, state, test_accuracy, ...).\n"
    "  --mode average averages the workers' parameters every K local steps\n"
    "  (--averaging-frequency K; default 5, DL4J's default averaging frequency).\n"
    "  --compression sets how workers push gradients (sync, async, ssp): fp16 or\n"
    "  bf16 halves the bytes; topk sends the largest RATIO of each chunk (default\n"
    "  0.01) and onebit one sign bit per value, both with error feedback.\n";

int Cli::Submit(const std::vector<std::string>& args) {
  ParsedArgs parsed = ParseArgs(
      args,
      {"--workers", "--mode", "--staleness", "--averaging-frequency", "--epochs", "--compression"},
      {"--watch", "--json"});
  if (parsed.help) return Usage("submit", kSubmitUsage, "");
  if (!parsed.error.empty()) return Usage("submit", kSubmitUsage, parsed.error);
  if (parsed.positional.size() != 1) {
    return Usage("submit", kSubmitUsage, "expected exactly one job file");
  }
  absl::StatusOr<v1::JobSpec> job = LoadJobSpec(parsed.positional[0]);
  if (!job.ok()) {
    err_ << "pstrain submit: error: " << job.status().message() << std::endl;
    return kExitUsage;
  }
  // Overrides.
  for (const auto& [flag, value] : parsed.values) {
    int n = 0;
    if (flag == "--mode") {
      static const std::map<std::string, v1::ConsistencyMode> kModes = {
          {"sync", v1::CONSISTENCY_SYNC},
          {"async", v1::CONSISTENCY_ASYNC},
          {"ssp", v1::CONSISTENCY_SSP},
          {"average", v1::CONSISTENCY_AVERAGE}};
      auto it = kModes.find(value);
      if (it == kModes.end()) {
        return Usage("submit", kSubmitUsage,
                     absl::StrCat("--mode must be sync, async, ssp or average, got '", value,
                                  "'"));
      }
      job->set_mode(it->second);
      continue;
    }
    if (flag == "--compression") {
      absl::StatusOr<v1::CompressionSpec> compression = ParseCompression(value);
      if (!compression.ok()) {
        return Usage("submit", kSubmitUsage, std::string(compression.status().message()));
      }
      *job->mutable_compression() = *compression;
      continue;
    }
    const int min_value = flag == "--staleness" ? 0 : 1;
    if (!ParseInt(value, min_value, &n)) {
      return Usage("submit", kSubmitUsage,
                   absl::StrCat(flag, " must be an integer >= ", min_value, ", got '", value,
                                "'"));
    }
    if (flag == "--workers") job->set_workers(n);
    if (flag == "--staleness") job->set_staleness(n);
    if (flag == "--averaging-frequency") job->set_averaging_frequency(n);
    if (flag == "--epochs") job->set_epochs(n);
  }
  job->clear_model_file();  // LoadJobSpec inlined it.
  if (absl::Status valid = ValidateJobSpec(*job); !valid.ok()) {
    err_ << "pstrain submit: invalid job " << parsed.positional[0] << ": " << valid.message()
         << std::endl;
    return kExitUsage;
  }

  v1::SubmitJobRequest request;
  *request.mutable_spec() = *job;
  v1::SubmitJobResponse response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().SubmitJob(&ctx, request, &response);
  if (!rpc.ok()) return ReportRpcError("submit", rpc);
  const bool json = parsed.switches.count("--json") > 0;
  if (!parsed.switches.count("--watch")) {
    if (json) {
      v1::JobStatus status;
      grpc::ClientContext get_ctx;
      Deadline(&get_ctx);
      v1::GetJobRequest get;
      get.set_job_id(response.job_id());
      if (!stub().GetJob(&get_ctx, get, &status).ok()) {
        status.set_job_id(response.job_id());
        status.set_state(v1::JOB_STATE_QUEUED);
      }
      out_ << JobStatusJson(status) << std::endl;
    } else {
      out_ << response.job_id() << std::endl;
    }
    return kExitOk;
  }
  out_ << "submitted " << response.job_id() << std::endl;
  absl::StatusOr<v1::JobStatus> final_status = Follow(response.job_id(), false);
  if (!final_status.ok()) {
    err_ << "pstrain submit: lost the job: " << final_status.status().message() << std::endl;
    if (json) {
      v1::JobStatus unknown;
      unknown.set_job_id(response.job_id());
      out_ << JobStatusJson(unknown) << std::endl;
    }
    return kExitFailed;
  }
  if (json) out_ << JobStatusJson(*final_status) << std::endl;
  return final_status->state() == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitFailed;
}

// status ------------------------------------------------------------------------

constexpr char kStatusUsage[] =
    "usage: pstrain status JOB [--json] [--report FILE.html]\n"
    "  Prints the job's state, reason, progress and (once it SUCCEEDED) test metrics.\n"
    "  --report also writes the job's HTML report (see `pstrain report --help`).\n";

int Cli::Status(const std::vector<std::string>& args) {
  ParsedArgs parsed = ParseArgs(args, {"--report"}, {"--json"});
  if (parsed.help) return Usage("status", kStatusUsage, "");
  if (!parsed.error.empty()) return Usage("status", kStatusUsage, parsed.error);
  if (parsed.positional.size() != 1) return Usage("status", kStatusUsage, "expected one job id");
  v1::GetJobRequest request;
  request.set_job_id(parsed.positional[0]);
  v1::JobStatus status;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().GetJob(&ctx, request, &status);
  if (!rpc.ok()) return ReportRpcError("status", rpc);
  if (parsed.values.count("--report")) {
    if (const int rc = WriteReport("status", status, parsed.values["--report"]); rc != kExitOk) {
      return rc;
    }
  }
  if (parsed.switches.count("--json")) {
    out_ << JobStatusJson(status) << std::endl;
    return kExitOk;
  }
  if (Terminal(status.state())) {
    out_ << FormatFinalReport(status);
  } else {
    out_ << FormatProgressLine(status, 0) << "\n";
    if (!status.reason().empty()) out_ << "reason: " << status.reason() << "\n";
  }
  out_ << std::flush;
  return kExitOk;
}

// report ------------------------------------------------------------------------

int Cli::Report(const std::vector<std::string>& args) {
  static constexpr char kReportUsage[] =
      "usage: pstrain report JOB -o FILE.html\n"
      "  Writes one self-contained HTML page (no script, nothing fetched): the job's\n"
      "  loss, accuracy and throughput over its steps, the confusion matrix as a heat\n"
      "  map with per-class precision, recall and F1 once it SUCCEEDED, its spec and\n"
      "  timing. Works for a running job too.\n";
  ParsedArgs parsed = ParseArgs(args, {"-o", "--output"}, {});
  if (parsed.help) return Usage("report", kReportUsage, "");
  if (!parsed.error.empty()) return Usage("report", kReportUsage, parsed.error);
  if (parsed.positional.size() != 1) return Usage("report", kReportUsage, "expected one job id");
  std::string path = parsed.values.count("-o") ? parsed.values["-o"] : parsed.values["--output"];
  if (path.empty()) return Usage("report", kReportUsage, "-o FILE.html is required");
  v1::GetJobRequest request;
  request.set_job_id(parsed.positional[0]);
  v1::JobStatus status;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().GetJob(&ctx, request, &status);
  if (!rpc.ok()) return ReportRpcError("report", rpc);
  const int rc = WriteReport("report", status, path);
  if (rc == kExitOk) {
    out_ << status.job_id() << " " << JobStateName(status.state()) << ": report written to " << path
         << std::endl;
  }
  return rc;
}

int Cli::WriteReport(const std::string& what, const v1::JobStatus& status,
                     const std::string& path) {
  v1::GetJobRequest request;
  request.set_job_id(status.job_id());
  v1::JobHistory history;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().GetJobHistory(&ctx, request, &history);
  if (!rpc.ok()) return ReportRpcError(what, rpc);
  const std::string html = RenderJobReport(status, history, absl::Now());
  if (absl::Status s = WriteFileAtomically(path, html); !s.ok()) {
    err_ << "pstrain " << what << ": " << s.message() << std::endl;
    return kExitFailed;
  }
  return kExitOk;
}

// list --------------------------------------------------------------------------

int Cli::List(const std::vector<std::string>& args) {
  static constexpr char kListUsage[] =
      "usage: pstrain list\n  Lists every job, newest first.\n";
  ParsedArgs parsed = ParseArgs(args, {}, {});
  if (parsed.help) return Usage("list", kListUsage, "");
  if (!parsed.error.empty() || !parsed.positional.empty()) {
    return Usage("list", kListUsage, parsed.error.empty() ? "takes no arguments" : parsed.error);
  }
  v1::ListJobsResponse response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().ListJobs(&ctx, v1::ListJobsRequest(), &response);
  if (!rpc.ok()) return ReportRpcError("list", rpc);
  out_ << absl::StrFormat("%-10s %-20s %-10s %7s %13s %8s %8s  %s\n", "JOB", "NAME", "STATE",
                          "EPOCH", "STEP", "LOSS", "TEST_ACC", "REASON");
  for (const v1::JobStatus& job : response.jobs()) {
    out_ << absl::StrFormat(
        "%-10s %-20s %-10s %3d/%-3d %6d/%-6d %8.4f %8s  %s\n", job.job_id(), job.name(),
        JobStateName(job.state()), job.epoch(), job.spec().epochs(), job.step(),
        job.total_steps(), job.loss(),
        job.state() == v1::JOB_STATE_SUCCEEDED ? absl::StrFormat("%.4f", job.test().accuracy())
                                               : "-",
        job.reason());
  }
  out_ << std::flush;
  return kExitOk;
}

// watch -------------------------------------------------------------------------

absl::StatusOr<v1::JobStatus> Cli::Follow(const std::string& job_id, bool quiet) {
  v1::JobStatus last;
  bool have_last = false;
  absl::Time first_time;
  int64_t first_step = -1;
  absl::Time broken_since = absl::InfiniteFuture();
  absl::Duration backoff = absl::Milliseconds(200);
  std::string last_line;
  bool drew_progress = false;
  auto finish_progress_line = [&] {
    if (drew_progress && env_.stdout_is_tty) out_ << "\n";
    drew_progress = false;
  };
  for (;;) {
    grpc::ClientContext ctx;
    // The stream lives as long as the job; a generous deadline, renewed at
    // every reconnection, so that no watch outlives a vanished server.
    ctx.set_deadline(DeadlineFromNow(absl::Hours(24)));
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    std::unique_ptr<grpc::ClientReader<v1::JobStatus>> reader = stub().WatchJob(&ctx, request);
    {
      IdleWatchdog watchdog(env_.watch_silence_warning, [this, &job_id] {
        err_ << (env_.stdout_is_tty ? "\n" : "") << "pstrain watch: no update about " << job_id << " from " << server_ << " for "
             << absl::FormatDuration(env_.watch_silence_warning) << " (still waiting)"
             << std::endl;
      });
      v1::JobStatus status;
      while (reader->Read(&status)) {
        watchdog.Kick();
        broken_since = absl::InfiniteFuture();
        backoff = absl::Milliseconds(200);
        const absl::Time now = absl::Now();
        if (first_step < 0 && status.state() == v1::JOB_STATE_RUNNING) {
          first_step = status.step();
          first_time = now;
        }
        double steps_per_sec = 0;
        if (first_step >= 0 && status.step() > first_step) {
          steps_per_sec = (status.step() - first_step) / absl::ToDoubleSeconds(now - first_time);
        }
        last = status;
        have_last = true;
        if (Terminal(status.state())) break;
        if (quiet) continue;
        std::string line = FormatProgressLine(status, steps_per_sec);
        if (env_.stdout_is_tty) {
          out_ << "\r" << line << "\033[K" << std::flush;
          drew_progress = true;
        } else if (line != last_line) {
          out_ << line << std::endl;
        }
        last_line = line;
      }
    }
    if (have_last && Terminal(last.state())) {
      ctx.TryCancel();
      reader->Finish().IgnoreError();
      finish_progress_line();
      if (!quiet) out_ << FormatFinalReport(last) << std::flush;
      return last;
    }
    grpc::Status end = reader->Finish();
    finish_progress_line();
    if (end.error_code() == grpc::StatusCode::NOT_FOUND ||
        end.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
        end.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
        end.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      return absl::Status(static_cast<absl::StatusCode>(end.error_code()), end.error_message());
    }
    // The stream ended early (server restart, network): reconnect.
    const absl::Time now = absl::Now();
    if (broken_since == absl::InfiniteFuture()) {
      broken_since = now;
      err_ << "pstrain watch: connection to " << server_ << " lost ("
           << (end.ok() ? std::string("stream ended") : end.error_message())
           << "); reconnecting" << std::endl;
    }
    if (now - broken_since > env_.watch_reconnect_limit) {
      return absl::UnavailableError(absl::StrCat(
          "gave up reconnecting to ", server_, " after ",
          absl::FormatDuration(env_.watch_reconnect_limit), ": ", end.error_message()));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(5));
  }
}

int Cli::Watch(const std::vector<std::string>& args) {
  static constexpr char kWatchUsage[] =
      "usage: pstrain watch JOB\n"
      "  Follows the job until it ends: a live progress bar on a terminal (one line per\n"
      "  update otherwise), then the final metrics and confusion matrix. Exits 0 only if\n"
      "  the job SUCCEEDED.\n";
  ParsedArgs parsed = ParseArgs(args, {}, {});
  if (parsed.help) return Usage("watch", kWatchUsage, "");
  if (!parsed.error.empty()) return Usage("watch", kWatchUsage, parsed.error);
  if (parsed.positional.size() != 1) return Usage("watch", kWatchUsage, "expected one job id");
  absl::StatusOr<v1::JobStatus> status = Follow(parsed.positional[0], false);
  if (!status.ok()) {
    err_ << "pstrain watch: error: " << status.status().message() << std::endl;
    return kExitFailed;
  }
  return status->state() == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitFailed;
}

// cancel ------------------------------------------------------------------------

int Cli::Cancel(const std::vector<std::string>& args) {
  static constexpr char kCancelUsage[] =
      "usage: pstrain cancel JOB\n"
      "  Cancels a queued or running job (a finished job is left as it is) and prints\n"
      "  its state.\n";
  ParsedArgs parsed = ParseArgs(args, {}, {});
  if (parsed.help) return Usage("cancel", kCancelUsage, "");
  if (!parsed.error.empty()) return Usage("cancel", kCancelUsage, parsed.error);
  if (parsed.positional.size() != 1) return Usage("cancel", kCancelUsage, "expected one job id");
  v1::CancelJobRequest request;
  request.set_job_id(parsed.positional[0]);
  v1::CancelJobResponse response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().CancelJob(&ctx, request, &response);
  if (!rpc.ok()) return ReportRpcError("cancel", rpc);
  out_ << response.status().job_id() << " " << JobStateName(response.status().state());
  if (!response.status().reason().empty()) out_ << ": " << response.status().reason();
  out_ << std::endl;
  return kExitOk;
}

// prepare -----------------------------------------------------------------------

int Cli::Prepare(const std::vector<std::string>& args) {
  static constexpr char kPrepareUsage[] =
      "usage: pstrain prepare JOB.json -o DIR [--records-per-shard N]\n"
      "       pstrain prepare --format idx|cifar10|image_folder --path SRC\n"
      "                       [--image-size HxW] -o DIR [--records-per-shard N]\n"
      "  Reads a dataset once (the job file's, or SRC in the given format; image\n"
      "  folders are decoded and resized to HxW) and writes both splits to DIR as\n"
      "  shards of fixed-shape, decoded uint8 records with a CRC-32 each. A job then\n"
      "  reads them with a copy, without decoding: \"dataset\": {\"format\":\n"
      "  \"DATASET_FORMAT_PACKED\", \"path\": \"DIR\", ...} (mean, std, augmentation and\n"
      "  balance as before). Shards hold about 256 MiB unless --records-per-shard.\n";
  ParsedArgs parsed = ParseArgs(
      args, {"-o", "--output", "--format", "--path", "--image-size", "--records-per-shard"}, {});
  if (parsed.help) return Usage("prepare", kPrepareUsage, "");
  if (!parsed.error.empty()) return Usage("prepare", kPrepareUsage, parsed.error);
  const std::string dir =
      parsed.values.count("-o") ? parsed.values["-o"] : parsed.values["--output"];
  if (dir.empty() || parsed.positional.size() > 1 ||
      (parsed.positional.empty() == parsed.values["--format"].empty())) {
    return Usage("prepare", kPrepareUsage, "expected JOB.json or --format and --path, and -o DIR");
  }
  v1::DatasetSpec spec;
  if (!parsed.positional.empty()) {
    absl::StatusOr<v1::JobSpec> job = LoadJobSpec(parsed.positional[0]);
    if (!job.ok()) {
      err_ << "pstrain prepare: " << job.status().message() << std::endl;
      return kExitUsage;
    }
    spec = job->dataset();
  } else {
    const std::string& format = parsed.values["--format"];
    static const std::map<std::string, v1::DatasetFormat> kFormats = {
        {"idx", v1::DATASET_FORMAT_IDX},
        {"cifar10", v1::DATASET_FORMAT_CIFAR10},
        {"image_folder", v1::DATASET_FORMAT_IMAGE_FOLDER},
        {"image-folder", v1::DATASET_FORMAT_IMAGE_FOLDER}};
    auto it = kFormats.find(format);
    if (it == kFormats.end()) {
      return Usage(
          "prepare", kPrepareUsage,
          absl::StrCat("--format must be idx, cifar10 or image_folder, got '", format, "'"));
    }
    spec.set_format(it->second);
    spec.set_path(parsed.values["--path"]);
    const std::string& size = parsed.values["--image-size"];
    if (!size.empty()) {
      const size_t x = size.find('x');
      int h = 0, w = 0;
      if (x == std::string::npos || !absl::SimpleAtoi(size.substr(0, x), &h) ||
          !absl::SimpleAtoi(size.substr(x + 1), &w) || h <= 0 || w <= 0 || h > 65536 || w > 65536) {
        return Usage("prepare", kPrepareUsage,
                     absl::StrCat("--image-size must be HxW, e.g. 64x64, got '", size, "'"));
      }
      spec.set_image_height(h);
      spec.set_image_width(w);
    }
  }
  if (spec.format() == v1::DATASET_FORMAT_PACKED || spec.format() == v1::DATASET_FORMAT_SYNTHETIC) {
    err_ << "pstrain prepare: the dataset is " << v1::DatasetFormat_Name(spec.format())
         << " already; nothing to pack" << std::endl;
    return kExitUsage;
  }
  data::PackOptions options;
  if (parsed.values.count("--records-per-shard") &&
      !ParseInt64(parsed.values["--records-per-shard"], 1, &options.records_per_shard)) {
    return Usage("prepare", kPrepareUsage, "--records-per-shard must be a positive integer");
  }
  // Everything is packed: the job's limits apply when it reads the shards.
  spec.clear_train_limit();
  spec.clear_test_limit();
  const absl::Time start = absl::Now();
  absl::StatusOr<data::DatasetSplits> splits = data::LoadDataset(spec);
  if (!splits.ok()) {
    err_ << "pstrain prepare: error: " << splits.status().message() << std::endl;
    return kExitFailed;
  }
  const absl::Time loaded = absl::Now();
  absl::StatusOr<data::PackSummary> summary = data::WritePackedDataset(*splits, dir, options);
  if (!summary.ok()) {
    err_ << "pstrain prepare: error: " << summary.status().message() << std::endl;
    return kExitFailed;
  }
  const absl::Time written = absl::Now();
  out_ << absl::StrFormat(
              "%s: train %d samples in %d shards, test %d samples in %d shards, %dx%dx%d, %d "
              "classes, %.1f MB (read and decoded in %.2f s, written in %.2f s)\n",
              dir, summary->train_samples, summary->train_shards, summary->test_samples,
              summary->test_shards, splits->train.channels, splits->train.height,
              splits->train.width, splits->train.num_classes, summary->bytes / 1e6,
              absl::ToDoubleSeconds(loaded - start), absl::ToDoubleSeconds(written - loaded))
       << absl::StrFormat(
              "use it as: \"dataset\": {\"format\": \"DATASET_FORMAT_PACKED\", "
              "\"path\": %s, ...}\n",
              JsonString(dir))
       << std::flush;
  return kExitOk;
}

// export ------------------------------------------------------------------------

int Cli::Export(const std::vector<std::string>& args) {
  static constexpr char kExportUsage[] =
      "usage: pstrain export CKPT|JOB -o FILE.onnx\n"
      "  Writes the model of a checkpoint file (or of a job's latest checkpoint,\n"
      "  downloaded from the server) as an ONNX inference graph (opset 13): input\n"
      "  'input' [batch, C, H, W] normalised as in training ((pixel/255 - mean) /\n"
      "  std, recorded in the model's metadata), outputs 'logits' and\n"
      "  'probabilities'. Dropout is left out; batch norm uses the running\n"
      "  statistics.\n";
  ParsedArgs parsed = ParseArgs(args, {"-o", "--output"}, {});
  if (parsed.help) return Usage("export", kExportUsage, "");
  if (!parsed.error.empty()) return Usage("export", kExportUsage, parsed.error);
  std::string path = parsed.values.count("-o") ? parsed.values["-o"] : parsed.values["--output"];
  if (parsed.positional.size() != 1 || path.empty()) {
    return Usage("export", kExportUsage, "expected a checkpoint file or job id and -o FILE.onnx");
  }
  const std::string& source = parsed.positional[0];
  v1::Checkpoint ckpt;
  if (std::filesystem::is_regular_file(source)) {
    absl::StatusOr<v1::Checkpoint> read = ReadCheckpointFile(source);
    if (!read.ok()) {
      err_ << "pstrain export: error: " << read.status().message() << std::endl;
      return kExitFailed;
    }
    ckpt = *std::move(read);
  } else {
    // A job id: its latest checkpoint, downloaded beside the output.
    const std::string downloaded = path + ".ckpt";
    int64_t bytes = 0;
    const int rc = FetchCheckpoint("export", source, downloaded, &ckpt, &bytes);
    std::remove(downloaded.c_str());
    if (rc != kExitOk) return rc;
  }
  absl::StatusOr<onnx::ModelProto> model = ExportOnnx(ckpt);
  if (!model.ok()) {
    err_ << "pstrain export: error: " << model.status().message() << std::endl;
    return kExitFailed;
  }
  if (absl::Status s = WriteOnnxFile(*model, path); !s.ok()) {
    err_ << "pstrain export: error: " << s.message() << std::endl;
    return kExitFailed;
  }
  out_ << absl::StrFormat("%s: ONNX opset %d, %d nodes, %d initializers, step %d, epoch %d\n", path,
                          kOnnxOpset, model->graph().node_size(), model->graph().initializer_size(),
                          ckpt.step(), ckpt.epoch())
       << std::flush;
  return kExitOk;
}

// download ----------------------------------------------------------------------

int Cli::Download(const std::vector<std::string>& args) {
  static constexpr char kDownloadUsage[] =
      "usage: pstrain download JOB -o FILE\n"
      "  Saves the job's latest checkpoint to FILE (written to FILE.tmp, verified,\n"
      "  then renamed). Gives up when no data arrives for --timeout-ms.\n";
  ParsedArgs parsed = ParseArgs(args, {"-o", "--output"}, {});
  if (parsed.help) return Usage("download", kDownloadUsage, "");
  if (!parsed.error.empty()) return Usage("download", kDownloadUsage, parsed.error);
  std::string path = parsed.values.count("-o") ? parsed.values["-o"] : parsed.values["--output"];
  if (parsed.positional.size() != 1 || path.empty()) {
    return Usage("download", kDownloadUsage, "expected a job id and -o FILE");
  }
  v1::Checkpoint ckpt;
  int64_t bytes = 0;
  const int rc = FetchCheckpoint("download", parsed.positional[0], path, &ckpt, &bytes);
  if (rc != kExitOk) return rc;
  out_ << absl::StrFormat("%s: %d bytes, %d tensors, step %d, epoch %d\n", path, bytes,
                          ckpt.parameters_size(), ckpt.step(), ckpt.epoch())
       << std::flush;
  return kExitOk;
}

int Cli::FetchCheckpoint(const std::string& what, const std::string& job_id,
                         const std::string& path, v1::Checkpoint* ckpt, int64_t* bytes) {
  const std::string tmp = path + ".tmp";
  std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
  if (!file) {
    err_ << "pstrain " << what << ": error: cannot write " << tmp << std::endl;
    return kExitFailed;
  }
  auto fail = [&](const std::string& message) {
    file.close();
    std::remove(tmp.c_str());
    err_ << "pstrain " << what << ": error: " << message << std::endl;
    return kExitFailed;
  };
  v1::DownloadModelRequest request;
  request.set_job_id(job_id);
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineFromNow(absl::Hours(1)));
  bool idle_timeout = false;
  int64_t written = 0, total = -1;
  grpc::Status end;
  {
    IdleWatchdog watchdog(absl::Milliseconds(timeout_ms_), [&ctx, &idle_timeout] {
      idle_timeout = true;
      ctx.TryCancel();
    });
    std::unique_ptr<grpc::ClientReader<v1::ModelChunk>> reader =
        stub().DownloadModel(&ctx, request);
    v1::ModelChunk chunk;
    while (reader->Read(&chunk)) {
      watchdog.Kick();
      if (chunk.offset() != written) {
        ctx.TryCancel();
        reader->Finish().IgnoreError();
        return fail(absl::StrCat("chunk at offset ", chunk.offset(), " after ", written,
                                 " bytes: the stream is out of order"));
      }
      total = chunk.total_bytes();
      file.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
      written += static_cast<int64_t>(chunk.data().size());
    }
    end = reader->Finish();
  }
  if (idle_timeout) {
    return fail(absl::StrCat("no data from ", server_, " for ", timeout_ms_,
                             " ms (see --timeout-ms) [DEADLINE_EXCEEDED]"));
  }
  if (!end.ok()) {
    file.close();
    std::remove(tmp.c_str());
    return ReportRpcError(what, end);
  }
  if (total < 0 || written != total) {
    return fail(absl::StrCat("received ", written, " of ", total, " bytes"));
  }
  file.close();
  if (!file) return fail(absl::StrCat("writing ", tmp, " failed"));
  absl::StatusOr<v1::Checkpoint> read = ReadCheckpointFile(tmp);
  if (!read.ok()) {
    return fail(absl::StrCat("the downloaded checkpoint is invalid: ", read.status().message()));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return fail(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
  *ckpt = *std::move(read);
  *bytes = written;
  return kExitOk;
}

// workers -----------------------------------------------------------------------

int Cli::Workers(const std::vector<std::string>& args) {
  static constexpr char kWorkersUsage[] =
      "usage: pstrain workers\n  Lists the registered workers, their devices and jobs.\n";
  ParsedArgs parsed = ParseArgs(args, {}, {});
  if (parsed.help) return Usage("workers", kWorkersUsage, "");
  if (!parsed.error.empty() || !parsed.positional.empty()) {
    return Usage("workers", kWorkersUsage,
                 parsed.error.empty() ? "takes no arguments" : parsed.error);
  }
  v1::ListWorkersResponse response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().ListWorkers(&ctx, v1::ListWorkersRequest(), &response);
  if (!rpc.ok()) return ReportRpcError("workers", rpc);
  out_ << absl::StrFormat("%-10s %-16s %-6s %-5s %-10s %-8s %s\n", "WORKER", "HOST", "BACKEND",
                          "GPUS", "JOB", "STATE", "LAST_HEARTBEAT");
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  for (const v1::WorkerStatus& w : response.workers()) {
    out_ << absl::StrFormat(
        "%-10s %-16s %-6s %-5d %-10s %-8s %s ago\n", w.worker_id(), w.info().hostname(),
        w.info().backend(), w.info().gpus(), w.job_id().empty() ? "-" : w.job_id(),
        w.alive() ? (w.job_id().empty() ? "idle" : "busy") : "lost",
        FormatDuration((now_ms - w.last_heartbeat_unix_ms()) / 1000.0));
  }
  out_ << std::flush;
  return kExitOk;
}

// summary -----------------------------------------------------------------------

int Cli::Summary(const std::vector<std::string>& args) {
  static constexpr char kSummaryUsage[] =
      "usage: pstrain summary JOB.json\n"
      "  Validates the job's model and prints a table of layer, output shape and\n"
      "  parameter count, plus the totals. Exits 2 if the model is invalid.\n";
  ParsedArgs parsed = ParseArgs(args, {}, {});
  if (parsed.help) return Usage("summary", kSummaryUsage, "");
  if (!parsed.error.empty()) return Usage("summary", kSummaryUsage, parsed.error);
  if (parsed.positional.size() != 1) return Usage("summary", kSummaryUsage, "expected one file");
  absl::StatusOr<std::string> table = SummarizeJobFile(parsed.positional[0]);
  if (!table.ok()) {
    err_ << "pstrain summary: error: " << table.status().message() << std::endl;
    return kExitUsage;
  }
  out_ << *table << std::flush;
  return kExitOk;
}

// health ------------------------------------------------------------------------

int Cli::Health(const std::vector<std::string>& args) {
  static constexpr char kHealthUsage[] =
      "usage: pstrain health [ADDRESS] [--service NAME] [--plaintext]\n"
      "  Asks the gRPC health service (grpc.health.v1.Health/Check) of a pstrain-server\n"
      "  (ADDRESS defaults to --server) or of a pstrain-worker's --health-port, and prints\n"
      "  the status. --service: \"\" (default) is the whole daemon; pstrain.v1.Coordinator,\n"
      "  pstrain.v1.ParameterService and pstrain.v1.ShardControl on a server;\n"
      "  pstrain-worker (coordinator reachable) on a worker. Exit 0 if SERVING, else 1.\n"
      "  Container health checks use it. TLS as for every command (a server's main port\n"
      "  with a certificate); --plaintext for the plaintext --health-port of a daemon.\n";
  ParsedArgs parsed = ParseArgs(args, {"--service"}, {"--plaintext"});
  if (parsed.help) return Usage("health", kHealthUsage, "");
  if (!parsed.error.empty()) return Usage("health", kHealthUsage, parsed.error);
  if (parsed.positional.size() > 1) return Usage("health", kHealthUsage, "expected one address");
  const std::string address = parsed.positional.empty() ? server_ : parsed.positional[0];
  const std::string service = parsed.values.count("--service") ? parsed.values["--service"] : "";
  // The health ports of --health-port are plaintext; a server's main port
  // speaks TLS when the server has a certificate.
  const ChannelOptions options =
      parsed.switches.count("--plaintext") ? ChannelOptions() : *ChannelOptionsOnce();
  absl::StatusOr<ServingStatus> status =
      CheckHealth(CreateChannel(address, options), service, absl::Milliseconds(timeout_ms_));
  if (!status.ok()) {
    err_ << "pstrain health: " << address << (service.empty() ? "" : " " + service) << ": "
         << absl::StatusCodeToString(status.status().code()) << ": " << status.status().message()
         << std::endl;
    return kExitFailed;
  }
  out_ << ServingStatusName(*status) << std::endl;
  return *status == ServingStatus::kServing ? kExitOk : kExitFailed;
}

}  // namespace

std::string JobStateName(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  const std::string prefix = "JOB_STATE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  return name.empty() ? "UNKNOWN" : name;
}

std::string JobStatusJson(const v1::JobStatus& s) {
  const v1::EvalMetrics& t = s.test();
  std::vector<std::string> workers;
  for (const std::string& w : s.workers()) workers.push_back(JsonString(w));
  std::vector<std::string> stragglers;
  for (const std::string& w : s.stragglers()) stragglers.push_back(JsonString(w));
  std::vector<std::string> epoch_samples;
  for (const v1::EpochSamples& e : s.epoch_samples()) {
    epoch_samples.push_back(absl::StrCat("{\"epoch\": ", e.epoch(), ", \"samples\": ", e.samples(),
                                         ", \"expected\": ", e.expected(), "}"));
  }
  std::vector<std::string> rows;
  const int k = t.num_classes();
  if (k > 0 && t.confusion_size() == k * k) {
    for (int r = 0; r < k; ++r) {
      std::vector<int64_t> row(t.confusion().begin() + r * k, t.confusion().begin() + (r + 1) * k);
      rows.push_back(absl::StrCat("[", absl::StrJoin(row, ","), "]"));
    }
  }
  return absl::StrCat(
      "{\"job_id\": ", JsonString(s.job_id()), ", \"name\": ", JsonString(s.name()),
      ", \"state\": ", JsonString(JobStateName(s.state())),
      ", \"reason\": ", JsonString(s.reason()), ", \"epoch\": ", s.epoch(),
      ", \"epochs\": ", s.spec().epochs(), ", \"step\": ", s.step(),
      ", \"total_steps\": ", s.total_steps(), ", \"loss\": ", JsonNumber(s.loss()),
      ", \"train_accuracy\": ", JsonNumber(s.train_accuracy()),
      ", \"samples_per_sec\": ", JsonNumber(s.samples_per_sec()), ", \"workers\": [",
      absl::StrJoin(workers, ", "), "], \"workers_lost\": ", s.workers_lost(),
      ", \"runs\": ", s.runs(), ", \"steps_lost\": ", s.steps_lost(), ", \"stragglers\": [",
      absl::StrJoin(stragglers, ", "), "], \"stragglers_dropped\": ", s.stragglers_dropped(),
      ", \"epoch_samples\": [", absl::StrJoin(epoch_samples, ", "), "]",
      ", \"test_accuracy\": ", JsonNumber(t.accuracy()),
      ", \"precision\": ", JsonNumber(t.precision()), ", \"recall\": ", JsonNumber(t.recall()),
      ", \"f1\": ", JsonNumber(t.f1()), ", \"test_loss\": ", JsonNumber(t.loss()),
      ", \"test_samples\": ", t.samples(), ", \"confusion\": [", absl::StrJoin(rows, ", "), "]}");
}

std::string FormatProgressLine(const v1::JobStatus& s, double steps_per_sec) {
  std::string line = absl::StrCat(s.job_id(), " ", JobStateName(s.state()));
  if (s.state() == v1::JOB_STATE_QUEUED) {
    if (!s.reason().empty()) absl::StrAppend(&line, ": ", s.reason());
    return line;
  }
  const int epochs = s.spec().epochs();
  absl::StrAppend(&line, absl::StrFormat("  epoch %d/%d", std::min(s.epoch() + 1, epochs), epochs));
  if (s.total_steps() > 0) {
    constexpr int kWidth = 20;
    const double fraction =
        std::clamp(static_cast<double>(s.step()) / static_cast<double>(s.total_steps()), 0.0,
                   1.0);
    const int filled = static_cast<int>(fraction * kWidth);
    absl::StrAppend(&line, absl::StrFormat("  step %d/%d [%s%s] %3d%%", s.step(),
                                           s.total_steps(), std::string(filled, '#'),
                                           std::string(kWidth - filled, '-'),
                                           static_cast<int>(fraction * 100)));
  } else {
    absl::StrAppend(&line, absl::StrFormat("  step %d", s.step()));
  }
  absl::StrAppend(&line, absl::StrFormat("  loss %.4f  acc %.4f  %.0f samples/s", s.loss(),
                                         s.train_accuracy(), s.samples_per_sec()));
  if (steps_per_sec > 0 && s.total_steps() > s.step()) {
    absl::StrAppend(&line, "  ETA ",
                    FormatDuration((s.total_steps() - s.step()) / steps_per_sec));
  }
  if (s.stragglers_size() > 0) {
    absl::StrAppend(&line, "  waiting for ", absl::StrJoin(s.stragglers(), ", "));
  }
  return line;
}

std::string FormatFinalReport(const v1::JobStatus& s) {
  std::string report = absl::StrCat(s.job_id(), " ", JobStateName(s.state()));
  if (!s.reason().empty()) absl::StrAppend(&report, ": ", s.reason());
  absl::StrAppend(&report, absl::StrFormat("\n  epochs %d, steps %d, final loss %.4f, train "
                                           "accuracy %.4f, workers lost %d\n",
                                           s.epoch(), s.step(), s.loss(), s.train_accuracy(),
                                           s.workers_lost()));
  if (s.epoch_samples_size() > 0) {
    std::vector<std::string> counts;
    for (const v1::EpochSamples& e : s.epoch_samples()) {
      counts.push_back(e.expected() > 0 ? absl::StrCat(e.samples(), "/", e.expected())
                                        : absl::StrCat(e.samples()));
    }
    absl::StrAppend(&report, "  samples trained per epoch: ", absl::StrJoin(counts, ", "), "\n");
  }
  if (s.runs() > 1) {
    absl::StrAppend(&report,
                    absl::StrFormat("  resumed %d time%s from a checkpoint, %d steps "
                                    "trained again\n",
                                    s.runs() - 1, s.runs() == 2 ? "" : "s", s.steps_lost()));
  }
  if (s.state() == v1::JOB_STATE_SUCCEEDED && s.has_test()) {
    const v1::EvalMetrics& t = s.test();
    absl::StrAppend(&report,
                    absl::StrFormat("test: accuracy %.4f  loss %.4f  precision %.4f  recall "
                                    "%.4f  f1 %.4f  (%d samples)\n",
                                    t.accuracy(), t.loss(), t.precision(), t.recall(), t.f1(),
                                    t.samples()),
                    FormatConfusionMatrix(MetricsFromProto(t)));
  }
  return report;
}

int RunCli(const std::vector<std::string>& args, const CliEnvironment& env, std::ostream& out,
           std::ostream& err) {
  Cli cli(env, out, err);
  return cli.Run(args);
}

}  // namespace pstrain
