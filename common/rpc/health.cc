#include "common/rpc/health.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace pstrain {

void EnableHealthAndReflection() {
  static absl::once_flag once;
  absl::call_once(once, [] {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  });
}

void SetServing(grpc::Server* server, const std::vector<std::string>& services, bool serving) {
  if (server == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health == nullptr) return;  // EnableHealthAndReflection() was not called.
  if (!serving && services.empty()) {
    health->Shutdown();
    return;
  }
  for (const std::string& service : services) health->SetServingStatus(service, serving);
}

absl::StatusOr<HealthServer> StartHealthServer(const std::string& address) {
  EnableHealthAndReflection();
  HealthServer result;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &result.port);
  // Health checks are tiny; a small thread pool bounds what a flood can take.
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 2);
  result.server = builder.BuildAndStart();
  if (result.server == nullptr || result.port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address, " (health service)"));
  }
  return result;
}

}  // namespace pstrain
