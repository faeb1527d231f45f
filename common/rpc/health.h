// The standard gRPC health service (grpc.health.v1.Health) and server
// reflection on every pstrain daemon, so that clients we did not write
// (grpc_health_probe, Kubernetes' `grpc:` probes, grpcurl) can ask whether a
// daemon serves and what it serves.
//
//   pstrain::EnableHealthAndReflection();         // before building any server
//   grpc::ServerBuilder builder;  ...  auto server = builder.BuildAndStart();
//   pstrain::SetServing(server.get(), {"pstrain.v1.Coordinator"}, true);
//   ...
//   pstrain::SetServing(server.get(), {}, false);  // at shutdown: all NOT_SERVING
//
// The overall status (service "") is SERVING once a server is built; each
// named service is NOT_FOUND until SetServing names it. Threads: any thread.
#ifndef PSTRAIN_COMMON_RPC_HEALTH_H_
#define PSTRAIN_COMMON_RPC_HEALTH_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server.h"

namespace pstrain {

// Turns on gRPC's built-in health service and the reflection plugin for every
// server built afterwards in this process. Idempotent.
void EnableHealthAndReflection();

// Sets each of `services` to SERVING or NOT_SERVING. With serving == false
// and no services, the whole health service shuts down: every service,
// "" included, reports NOT_SERVING from then on (a draining daemon).
void SetServing(grpc::Server* server, const std::vector<std::string>& services, bool serving);

// A plaintext gRPC server that serves grpc.health.v1.Health alone (no
// reflection, no other service), for probes that cannot speak TLS (the
// servers' and workers' --health-port). Binds `address` ("HOST:PORT"; port 0
// picks one).
struct HealthServer {
  // Answers every method but Health's with UNIMPLEMENTED. Declared before
  // `server`, which must go first.
  std::unique_ptr<grpc::CallbackGenericService> others;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};
absl::StatusOr<HealthServer> StartHealthServer(const std::string& address);

// grpc.health.v1.HealthCheckResponse.ServingStatus.
enum class ServingStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
const char* ServingStatusName(ServingStatus status);

// Asks `channel`'s grpc.health.v1.Health/Check for `service` ("" = the whole
// server) within `timeout`. The RPC's error (NOT_FOUND for an unknown
// service, UNAVAILABLE, DEADLINE_EXCEEDED) comes back as the Status. The two
// messages are encoded by hand: no health proto is compiled into pstrain.
absl::StatusOr<ServingStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                          const std::string& service, absl::Duration timeout);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_HEALTH_H_
