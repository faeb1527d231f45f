// The `pstrain` command line: job submission and monitoring against the
// coordinator (server 0). pstrain_main.cc only forwards argv here, so that
// tests drive the same code against an in-process fake coordinator.
//
//   CliEnvironment env;
//   env.server_env = getenv("PSTRAIN_SERVER") ? getenv("PSTRAIN_SERVER") : "";
//   env.stdout_is_tty = isatty(1);
//   int code = RunCli({"--server", "127.0.0.1:7070", "status", "job-1", "--json"}, env,
//                     std::cout, std::cerr);
//
// `--json` prints the proto3 JSON mapping of the RPC's response on one line
// (status and submit: v1.JobStatus; list: v1.ListJobsResponse; workers:
// v1.ListWorkersResponse), the same object as Python's
// json_format.MessageToDict(..., preserving_proto_field_name=True,
// including_default_value_fields=True) of the message the Python client gets.
//
// Options are Abseil flags, parsed per command (never
// absl::ParseCommandLine): "--name value", "--name=value", "--noname" for a
// switch; each call starts from the flags' defaults.
//
// Global options (anywhere on the line): --server HOST:PORT (else
// $PSTRAIN_SERVER, else 127.0.0.1:7070); TLS with --tls-ca FILE (the
// servers' CA; else $PSTRAIN_TLS_CA), --tls-cert/--tls-key FILE for mTLS
// ($PSTRAIN_TLS_CERT, $PSTRAIN_TLS_KEY) and --tls-server-name NAME; the admin
// token from --token-file FILE (else $PSTRAIN_TOKEN_FILE; never a token on
// the command line); and --timeout-ms N (default 10000):
// the deadline of every unary call; streams (watch, download) instead give up
// when nothing arrives for that long (download) or warn (watch, every
// `watch_silence_warning`).
//
// Exit codes: 0 success (submit --watch and watch: the job SUCCEEDED), 1 a
// failed, cancelled or unknown job or an RPC error, 2 a usage error or an
// invalid job spec.
//
// Threads: RunCli may run on any thread, and on several at once (each call
// parses and reads the process-wide flags under one lock); it blocks until
// the command ends.
#ifndef PSTRAIN_CLIENT_CLI_H_
#define PSTRAIN_CLIENT_CLI_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

inline constexpr char kDefaultServerAddress[] = "127.0.0.1:7070";

struct CliEnvironment {
  std::string server_env;      // $PSTRAIN_SERVER ("" when unset).
  std::string token_file_env;  // $PSTRAIN_TOKEN_FILE
  std::string tls_ca_env;      // $PSTRAIN_TLS_CA
  std::string tls_cert_env;    // $PSTRAIN_TLS_CERT
  std::string tls_key_env;     // $PSTRAIN_TLS_KEY
  bool stdout_is_tty = false;  // Redraw one progress line with \r.
  // watch: a warning line when no event arrived for this long.
  absl::Duration watch_silence_warning = absl::Seconds(30);
  // watch: how long reconnection attempts go on after the stream broke.
  absl::Duration watch_reconnect_limit = absl::Seconds(60);
};

// Runs `pstrain ARGS...` (ARGS without the program name); returns the exit code.
int RunCli(const std::vector<std::string>& args, const CliEnvironment& env, std::ostream& out,
           std::ostream& err);

// The one-line progress text of a running job, e.g. "job-3 RUNNING epoch
// 2/5 step 340/1170 [#####-----] 29% loss 0.4123 acc 0.8512 1234 samples/s
// ETA 1m05s". `steps_per_sec` (<= 0: unknown) gives the ETA.
std::string FormatProgressLine(const v1::JobStatus& status, double steps_per_sec);

// The final report of a finished job: state and reason, test metrics and
// the confusion matrix when the job SUCCEEDED.
std::string FormatFinalReport(const v1::JobStatus& status);

}  // namespace pstrain

#endif  // PSTRAIN_CLIENT_CLI_H_
