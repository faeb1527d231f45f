// The cluster commands: workers, health.
#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/cli_internal.h"
#include "common/rpc/health.h"

ABSL_FLAG(std::string, service, "",
          "The service to ask about (\"\": the whole daemon; pstrain.v1.Coordinator, "
          "pstrain.v1.ParameterService, pstrain.v1.ShardControl, pstrain-worker)");
ABSL_FLAG(bool, plaintext, false, "Dial without TLS (a daemon's plaintext --health-port)");

namespace pstrain::cli_internal {

// workers -----------------------------------------------------------------------

int Cli::Workers(const std::vector<std::string>& args) {
  static const Command kWorkers = {
      "workers",
      "usage: pstrain workers [--json]\n"
      "  Lists the registered workers, their devices and jobs; with --json the\n"
      "  ListWorkersResponse as JSON.\n",
      {&absl::GetFlagReflectionHandle(FLAGS_json)}};
  bool json = false;
  Parsed parsed = ParseCommand(kWorkers, args, [&] { json = absl::GetFlag(FLAGS_json); });
  if (parsed.exit_code) return *parsed.exit_code;
  if (!parsed.positional.empty()) return Usage(kWorkers, "takes no arguments");
  v1::ListWorkersResponse response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().ListWorkers(&ctx, v1::ListWorkersRequest(), &response);
  if (!rpc.ok()) return ReportRpcError("workers", rpc);
  if (json) return PrintJson("workers", response);
  out_ << absl::StrFormat("%-10s %-16s %-6s %-5s %-10s %-8s %s\n", "WORKER", "HOST", "BACKEND",
                          "GPUS", "JOB", "STATE", "LAST_HEARTBEAT");
  const int64_t now_ms = absl::ToUnixMillis(absl::Now());
  for (const v1::WorkerStatus& w : response.workers()) {
    out_ << absl::StrFormat("%-10s %-16s %-6s %-5d %-10s %-8s %s ago\n", w.worker_id(),
                            w.info().hostname(), w.info().backend(), w.info().gpus(),
                            w.job_id().empty() ? "-" : w.job_id(),
                            w.alive() ? (w.job_id().empty() ? "idle" : "busy") : "lost",
                            FormatDuration((now_ms - w.last_heartbeat_unix_ms()) / 1000.0));
  }
  out_ << std::flush;
  return kExitOk;
}

// health ------------------------------------------------------------------------

int Cli::Health(const std::vector<std::string>& args) {
  static const Command kHealth = {
      "health",
      "usage: pstrain health [ADDRESS] [--service NAME] [--plaintext]\n"
      "  Asks the gRPC health service (grpc.health.v1.Health/Check) of a pstrain-server\n"
      "  (ADDRESS defaults to --server) or of a pstrain-worker's --health-port, and prints\n"
      "  the status. --service: \"\" (default) is the whole daemon; pstrain.v1.Coordinator,\n"
      "  pstrain.v1.ParameterService and pstrain.v1.ShardControl on a server;\n"
      "  pstrain-worker (coordinator reachable) on a worker. Exit 0 if SERVING, else 1.\n"
      "  Container health checks use it. TLS as for every command (a server's main port\n"
      "  with a certificate); --plaintext for the plaintext --health-port of a daemon.\n",
      {&absl::GetFlagReflectionHandle(FLAGS_service),
       &absl::GetFlagReflectionHandle(FLAGS_plaintext)}};
  std::string service;
  bool plaintext = false;
  Parsed parsed = ParseCommand(kHealth, args, [&] {
    service = absl::GetFlag(FLAGS_service);
    plaintext = absl::GetFlag(FLAGS_plaintext);
  });
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() > 1) return Usage(kHealth, "expected one address");
  const std::string address = parsed.positional.empty() ? server_ : parsed.positional[0];
  // The health ports of --health-port are plaintext; a server's main port
  // speaks TLS when the server has a certificate.
  const ChannelOptions options = plaintext ? ChannelOptions() : *ChannelOptionsOnce();
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

}  // namespace pstrain::cli_internal
