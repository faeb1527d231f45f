// The pstrain command line: dispatch, the global options, the channel and
// error reporting. The commands live in cli_jobs.cc, cli_models.cc and
// cli_cluster.cc (see cli_internal.h).
#include "client/cli.h"

#include <grpcpp/grpcpp.h>

#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/cli_internal.h"
#include "common/build_info.h"
#include "common/status_macros.h"

ABSL_FLAG(std::string, server, "",
          "The coordinator (server 0), HOST:PORT; default $PSTRAIN_SERVER, else 127.0.0.1:7070");
ABSL_FLAG(int, timeout_ms, 10000,
          "Deadline of every call, in ms; streams give up (download) or warn (watch) after "
          "this long without data");
ABSL_FLAG(std::string, tls_ca, "", "The servers' CA certificate (PEM); default $PSTRAIN_TLS_CA");
ABSL_FLAG(std::string, tls_cert, "",
          "This client's certificate for mTLS (PEM); default $PSTRAIN_TLS_CERT");
ABSL_FLAG(std::string, tls_key, "", "The key of --tls-cert (PEM); default $PSTRAIN_TLS_KEY");
ABSL_FLAG(std::string, tls_server_name, "",
          "The name the server's certificate must carry (default: the host dialled)");
ABSL_FLAG(std::string, token_file, "",
          "The file holding the admin token (never the token itself on the command line); "
          "default $PSTRAIN_TOKEN_FILE");
ABSL_FLAG(bool, json, false,
          "Print the result as one line of JSON: the proto3 JSON mapping of the response "
          "message");
ABSL_FLAG(std::string, output, "", "The file to write");

namespace pstrain {
namespace cli_internal {
namespace {

constexpr char kCommands[] =
    "usage: pstrain [global options] <command> [args]\n"
    "\n"
    "commands:\n"
    "  submit JOB.json [--workers N] [--mode sync|async|ssp|average] [--staleness S]\n"
    "                  [--averaging-frequency K] [--epochs N]\n"
    "                  [--compression none|fp16|bf16|topk[:RATIO]|onebit]\n"
    "                  [--pull-compression METHOD] [--watch] [--json]\n"
    "                                submit a job (and follow it with --watch)\n"
    "  status JOB [--json] [--report FILE.html]\n"
    "                                show a job's state, progress and test metrics\n"
    "  report JOB -o FILE.html       write the job's report: loss and accuracy curves,\n"
    "                                confusion heat map, per-class metrics, spec, timing\n"
    "  list [--json]                 list the jobs, newest first\n"
    "  watch JOB                     follow a job until it ends (progress bar)\n"
    "  cancel JOB                    cancel a queued or running job\n"
    "  download JOB -o FILE          save the job's latest checkpoint\n"
    "  export CKPT|JOB -o FILE.onnx  write the trained inference graph as ONNX\n"
    "  prepare JOB.json -o DIR       pack the job's dataset once into checksummed shards\n"
    "                                of decoded images (dataset format DATASET_FORMAT_PACKED)\n"
    "  run -n N [options] -- COMMAND  train a pstrain.torch script with N worker processes\n"
    "                                (a local server unless --server is given)\n"
    "  workers [--json]              list the registered workers\n"
    "  summary JOB.json              print the model's layers and parameter counts\n"
    "  health [ADDRESS] [--service S] ask a daemon's grpc.health.v1.Health (exit 0 if SERVING)\n"
    "  version                       print the build (version, git commit)\n"
    "\n"
    "global options (anywhere on the line):\n";

constexpr char kUsageTail[] =
    "\n"
    "--json prints the proto3 JSON mapping of the RPC's response (JobStatus,\n"
    "ListJobsResponse, ListWorkersResponse), as Python's json_format.MessageToDict.\n"
    "Exit codes: 0 success, 1 failed job or RPC error, 2 usage error or invalid job spec.\n"
    "Every command takes --help.\n";

// The options every command takes, wherever they appear on the line.
std::vector<const absl::CommandLineFlag*> GlobalFlags() {
  return {&absl::GetFlagReflectionHandle(FLAGS_server),
          &absl::GetFlagReflectionHandle(FLAGS_timeout_ms),
          &absl::GetFlagReflectionHandle(FLAGS_tls_ca),
          &absl::GetFlagReflectionHandle(FLAGS_tls_cert),
          &absl::GetFlagReflectionHandle(FLAGS_tls_key),
          &absl::GetFlagReflectionHandle(FLAGS_tls_server_name),
          &absl::GetFlagReflectionHandle(FLAGS_token_file)};
}

std::string TopUsage() { return absl::StrCat(kCommands, FlagsHelp(GlobalFlags()), kUsageTail); }

// The index of the command's name in `args`: the first argument that is
// neither a global option nor its value (args.size() when there is none).
size_t CommandIndex(const std::vector<std::string>& args) {
  const std::vector<const absl::CommandLineFlag*> globals = GlobalFlags();
  for (size_t i = 0; i < args.size(); ++i) {
    if (FindOption(args[i], globals) == nullptr) return i;
    if (args[i].find('=') == std::string::npos) ++i;  // Its value.
  }
  return args.size();
}

}  // namespace

std::string FormatDuration(double seconds) {
  if (seconds < 0 || !std::isfinite(seconds)) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s % 3600) / 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

// --- Dispatch -------------------------------------------------------------------

int Cli::Run(const std::vector<std::string>& args) {
  const size_t index = CommandIndex(args);
  if (index == args.size()) {
    err_ << TopUsage();
    return kExitUsage;
  }
  const std::string& command = args[index];
  std::vector<std::string> rest = args;
  rest.erase(rest.begin() + static_cast<std::ptrdiff_t>(index));
  if (command == "help" || command == "--help" || command == "-h") {
    out_ << TopUsage();
    return kExitOk;
  }
  if (command == "version" || command == "--version") {
    out_ << BuildId() << "\n";
    return kExitOk;
  }
  using Method = int (Cli::*)(const std::vector<std::string>&);
  static const auto* kMethods = new std::map<std::string, Method>{
      {"submit", &Cli::Submit},     {"status", &Cli::Status},   {"report", &Cli::Report},
      {"list", &Cli::List},         {"watch", &Cli::Watch},     {"cancel", &Cli::Cancel},
      {"download", &Cli::Download}, {"export", &Cli::Export},   {"prepare", &Cli::Prepare},
      {"workers", &Cli::Workers},   {"summary", &Cli::Summary}, {"health", &Cli::Health},
      {"run", &Cli::RunWorkers}};
  auto it = kMethods->find(command);
  if (it == kMethods->end()) {
    err_ << "pstrain: unknown command '" << command << "'\n\n" << TopUsage();
    return kExitUsage;
  }
  return (this->*(it->second))(rest);
}

Cli::Parsed Cli::ParseCommand(const Command& command, const std::vector<std::string>& args,
                              absl::FunctionRef<void()> read_flags) {
  std::vector<const absl::CommandLineFlag*> flags = GlobalFlags();
  flags.insert(flags.end(), command.flags.begin(), command.flags.end());
  absl::StatusOr<CommandLine> line;
  {
    absl::MutexLock lock(&FlagsMutex());
    line = ParseFlags(args, flags);
    if (line.ok() && !line->help) {
      server_ = absl::GetFlag(FLAGS_server);
      timeout_ms_ = absl::GetFlag(FLAGS_timeout_ms);
      tls_.ca_file = absl::GetFlag(FLAGS_tls_ca);
      tls_.cert_file = absl::GetFlag(FLAGS_tls_cert);
      tls_.key_file = absl::GetFlag(FLAGS_tls_key);
      tls_.server_name = absl::GetFlag(FLAGS_tls_server_name);
      token_file_ = absl::GetFlag(FLAGS_token_file);
      read_flags();
    }
  }
  Parsed parsed;
  if (!line.ok()) {
    parsed.exit_code = Usage(command, std::string(line.status().message()));
  } else if (line->help) {
    parsed.exit_code = Usage(command, "");
  }
  if (parsed.exit_code) return parsed;
  auto or_else = [](std::string& value, const std::string& fallback) {
    if (value.empty()) value = fallback;
  };
  or_else(server_, env_.server_env.empty() ? kDefaultServerAddress : env_.server_env);
  or_else(tls_.ca_file, env_.tls_ca_env);
  or_else(tls_.cert_file, env_.tls_cert_env);
  or_else(tls_.key_file, env_.tls_key_env);
  or_else(token_file_, env_.token_file_env);
  if (timeout_ms_ < 1) {
    parsed.exit_code =
        Usage(command, absl::StrCat("--timeout-ms must be a positive integer, got ", timeout_ms_));
  } else if (command.dials_server) {
    parsed.exit_code = CheckChannelOptions();
  }
  parsed.positional = std::move(line->positional);
  return parsed;
}

int Cli::Usage(const Command& command, const std::string& error) {
  std::string usage = command.usage;
  if (!command.flags.empty()) absl::StrAppend(&usage, "options:\n", FlagsHelp(command.flags));
  absl::StrAppend(&usage, "(and the global options of `pstrain --help`)\n");
  if (error.empty()) {
    out_ << usage;
    return kExitOk;
  }
  err_ << "pstrain " << command.name << ": " << error << "\n" << usage;
  return kExitUsage;
}

// --- The channel and errors ---------------------------------------------------------

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

std::optional<int> Cli::CheckChannelOptions() {
  absl::StatusOr<ChannelOptions> options = ChannelOptionsOnce();
  if (options.ok()) return std::nullopt;
  err_ << "pstrain: " << options.status().message() << std::endl;
  return kExitUsage;
}

v1::Coordinator::Stub& Cli::stub() {
  if (stub_ == nullptr) {
    // Commands check the TLS and token files (CheckChannelOptions) before
    // they dial, so the options are good here.
    channel_ = CreateChannel(server_, *ChannelOptionsOnce());
    stub_ = v1::Coordinator::NewStub(channel_);
  }
  return *stub_;
}

int Cli::PrintJson(const std::string& what, const google::protobuf::Message& message) {
  absl::StatusOr<std::string> json = ProtoJson(message);
  if (!json.ok()) {
    err_ << "pstrain " << what << ": error: " << json.status().message() << std::endl;
    return kExitFailed;
  }
  out_ << *json << std::endl;
  return kExitOk;
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

}  // namespace cli_internal

int RunCli(const std::vector<std::string>& args, const CliEnvironment& env, std::ostream& out,
           std::ostream& err) {
  cli_internal::Cli cli(env, out, err);
  return cli.Run(args);
}

}  // namespace pstrain
