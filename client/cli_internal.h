// Internal to client/: the Cli class behind RunCli (client/cli.h) and what
// its command files share. One file per group of commands:
//
//   cli.cc          dispatch, global options, the channel, error reporting
//   cli_flags.cc    the command-line parser over Abseil flags, --help text
//   cli_jobs.cc     submit, status, report, list, watch, cancel
//   cli_models.cc   download, export, summary, prepare
//   cli_cluster.cc  workers, health
//
// Adding a command: declare its options with ABSL_FLAG in its file (type,
// default and help text live there; a name with '_' is spelled with '-' on
// the command line), describe it with a Command (usage text, flags), write a
// Cli method that starts with ParseCommand, and add it to the table in
// Cli::Run (cli.cc) and to kUsage.
#ifndef PSTRAIN_CLIENT_CLI_INTERNAL_H_
#define PSTRAIN_CLIENT_CLI_INTERNAL_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/declare.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/cli.h"
#include "common/data/packed_format.h"
#include "common/rpc/channel.h"
#include "common/rpc/security.h"
#include "google/protobuf/message.h"
#include "pstrain/v1/checkpoint.pb.h"
#include "pstrain/v1/service.grpc.pb.h"

// Options that several commands take (defined in cli.cc).
ABSL_DECLARE_FLAG(bool, json);
ABSL_DECLARE_FLAG(std::string, output);

namespace pstrain::cli_internal {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;

// --- The parser ------------------------------------------------------------------

// The arguments of one command line that are not options.
struct CommandLine {
  std::vector<std::string> positional;
  bool help = false;  // --help or -h was given.
};

// Resets `flags` to their defaults, then sets them from `args`: "--name value", "--name=value",
// "-name" (one dash works too), and for a bool flag "--name", "--noname" and
// "--name=true|false" (never the next argument). Dashes in a name stand for
// underscores (--timeout-ms is the flag timeout_ms); -o is --output.
// Everything that does not start with '-' (and "-" itself) is positional.
// Looks names up with absl::FindCommandLineFlag and parses with
// CommandLineFlag::ParseFrom. Returns INVALID_ARGUMENT, with the message the
// user sees ("unknown option '--bogus'", "--epochs needs a value"), for a
// name not in `flags` or a value its flag refuses; flags may then be half set.
//
// Threads: flags are process-wide; the caller holds FlagsMutex() from before
// this call until it has read the values.
absl::StatusOr<CommandLine> ParseFlags(const std::vector<std::string>& args,
                                       absl::Span<const absl::CommandLineFlag* const> flags);

// The flag of `flags` that the command-line argument `arg` ("--tls-ca",
// "--server=HOST:PORT", "-o") names, else nullptr.
const absl::CommandLineFlag* FindOption(absl::string_view arg,
                                        absl::Span<const absl::CommandLineFlag* const> flags);

// The option list of a --help: one "  --name VALUE  help (default: X)" line
// per flag, from the flag's Help() and DefaultValue(); the default is left
// out where it is the type's zero ("", false, 0): such flags mean "not given".
std::string FlagsHelp(absl::Span<const absl::CommandLineFlag* const> flags);

// Serialises every use of the process-wide flags (RunCli may run on several
// threads at once; each parses and reads its flags under this lock).
absl::Mutex& FlagsMutex();

// One command: its usage text (the synopsis and a description; --help adds
// the option list) and the flags it takes besides the global options.
struct Command {
  const char* name;
  const char* usage;
  std::vector<const absl::CommandLineFlag*> flags;
  // Whether it needs the TLS and token files (read and checked before the
  // command runs); commands that work offline check them when they dial.
  bool dials_server = true;
};

// --- Job specs ------------------------------------------------------------------------

// submit's and run's overrides of a job spec, as given on the command line.
struct SubmitOverrides {
  std::optional<int> workers, staleness, averaging_frequency, epochs;
  std::string mode, compression, pull_compression, precision;
  std::optional<int64_t> min_compress_bytes;
};

// Applies `o` to `job`; INVALID_ARGUMENT names the bad option (cli_jobs.cc).
absl::Status ApplyOverrides(const SubmitOverrides& o, v1::JobSpec& job);

// --- JSON ---------------------------------------------------------------------------

// `message` in the proto3 JSON mapping on one line: field names as in the
// .proto, every scalar and repeated field even when it is its default, enum
// values by name, 64-bit integers as strings. What --json prints, and what
// google.protobuf.json_format.MessageToDict(message,
// preserving_proto_field_name=True, including_default_value_fields=True)
// gives in Python. Fails only for a message the printer cannot describe (an
// Any of an unknown type).
absl::StatusOr<std::string> ProtoJson(const google::protobuf::Message& message);

// --- The commands -------------------------------------------------------------------

// Runs one command line. Not thread-safe; RunCli makes one per call.
class Cli {
 public:
  Cli(const CliEnvironment& env, std::ostream& out, std::ostream& err)
      : env_(env), out_(out), err_(err) {}

  int Run(const std::vector<std::string>& args);

 private:
  // cli_jobs.cc
  int Submit(const std::vector<std::string>& args);
  int Status(const std::vector<std::string>& args);
  int Report(const std::vector<std::string>& args);
  int List(const std::vector<std::string>& args);
  int Watch(const std::vector<std::string>& args);
  int Cancel(const std::vector<std::string>& args);
  // GetJobHistory, then the HTML page of `status` written to `path`.
  int WriteReport(const std::string& what, const v1::JobStatus& status, const std::string& path);
  // Follows the job to its end; returns its last status (or the error).
  absl::StatusOr<v1::JobStatus> Follow(const std::string& job_id, bool quiet);

  // cli_models.cc
  int Download(const std::vector<std::string>& args);
  int Export(const std::vector<std::string>& args);
  int Summary(const std::vector<std::string>& args);
  int Prepare(const std::vector<std::string>& args);
  int PrepareBson(const v1::DatasetSpec& spec, const std::string& dir,
                  const data::PackOptions& options);
  // Downloads the job's latest checkpoint to `path` (through path.tmp,
  // verified, renamed) and parses it into `ckpt`; reports errors as `what`.
  int FetchCheckpoint(const std::string& what, const std::string& job_id, const std::string& path,
                      v1::Checkpoint* ckpt, int64_t* bytes);

  // cli_run.cc
  int RunWorkers(const std::vector<std::string>& args);

  // cli_cluster.cc
  int Workers(const std::vector<std::string>& args);
  int Health(const std::vector<std::string>& args);

  // cli.cc
  //
  // What ParseCommand leaves to the command: its positional arguments, or
  // the exit code when it is done already (--help printed: 0; a usage error
  // or an unreadable TLS or token file reported: 2).
  struct Parsed {
    std::vector<std::string> positional;
    std::optional<int> exit_code;
  };
  // Parses `args` (the line without the command's name) into the global
  // options and `command`'s flags, then calls `read_flags`, which copies the
  // command's flag values out (absl::GetFlag) while they are in effect.
  Parsed ParseCommand(const Command& command, const std::vector<std::string>& args,
                      absl::FunctionRef<void()> read_flags);
  // Reads the TLS and token files once; reports a bad one (exit code 2).
  std::optional<int> CheckChannelOptions();
  int ReportRpcError(const std::string& what, const grpc::Status& status);
  // `message` as one line of ProtoJson on out_ (exit 0), or the error (1).
  int PrintJson(const std::string& what, const google::protobuf::Message& message);
  // The command's usage with its option list: to out_ when `error` is
  // empty (exit 0), else to err_ after the error (exit 2).
  int Usage(const Command& command, const std::string& error);
  v1::Coordinator::Stub& stub();
  absl::StatusOr<ChannelOptions> ChannelOptionsOnce();
  // Every unary call: a deadline, and wait-for-ready, so that a call made
  // while the channel connects (a server that just began listening) waits
  // for it within the deadline instead of failing on the first UNAVAILABLE.
  void Deadline(grpc::ClientContext* ctx) const {
    ctx->set_deadline(DeadlineFromNow(absl::Milliseconds(timeout_ms_)));
    ctx->set_wait_for_ready(true);
  }

  // Constant after construction.
  const CliEnvironment& env_;
  std::ostream& out_;
  std::ostream& err_;

  // The global options (set by ParseCommand).
  std::string server_;
  int timeout_ms_ = 10000;
  TlsOptions tls_;
  std::string token_file_;

  // Built on first use.
  std::optional<absl::StatusOr<ChannelOptions>> channel_options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

// --- Shared helpers ---------------------------------------------------------------

// "1h02m", "3m05s", "9s"; "?" for a negative or unknown duration.
std::string FormatDuration(double seconds);

// Calls `on_timeout` when Kick() was not called for `idle` (repeatedly, once
// per idle period), on its own thread. Stops on destruction.
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

}  // namespace pstrain::cli_internal

#endif  // PSTRAIN_CLIENT_CLI_INTERNAL_H_
