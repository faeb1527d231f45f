#include "common/rpc/health.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace pstrain {

namespace {

// The name gRPC's reflection plugin gives itself
// (grpc::reflection::ProtoServerReflectionPlugin::name()).
constexpr char kReflectionPluginName[] = "proto_server_reflection";

// A builder option that drops the reflection plugin, which
// InitProtoReflectionServerBuilderPlugin adds to every builder of the process:
// the plaintext health port serves grpc.health.v1.Health and nothing else.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
      return plugin->name() == kReflectionPluginName;
    });
  }
};

// Every call but Health's on the plaintext port: UNIMPLEMENTED, before
// reading a byte of it. Registering it also gives gRPC a callback service to
// poll for, without which it refuses to build a server whose only service is
// the default health service ("At least one of the completion queues must be
// frequently polled").
class Unimplemented final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Refusal final : public grpc::ServerGenericBidiReactor {
     public:
      Refusal() {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "this port serves grpc.health.v1.Health only"));
      }
      void OnDone() override { delete this; }
    };
    return new Refusal;
  }
};

}  // namespace

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
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // One port, one server.
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &result.port);
  // Health checks are tiny; a small thread pool bounds what a flood can take.
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 2);
  builder.SetOption(std::make_unique<WithoutReflection>());
  result.others = std::make_unique<Unimplemented>();
  builder.RegisterCallbackGenericService(result.others.get());
  result.server = builder.BuildAndStart();
  if (result.server == nullptr || result.port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address,
                                               " (health service; is another process listening "
                                               "there?)"));
  }
  return result;
}

const char* ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

absl::StatusOr<ServingStatus> CheckHealth(const std::shared_ptr<grpc::Channel>& channel,
                                          const std::string& service, absl::Duration timeout) {
  if (service.size() > 4096) return absl::InvalidArgumentError("health: service name too long");
  // HealthCheckRequest { string service = 1; }: tag 0x0a, varint length, bytes.
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    for (size_t n = service.size(); ; n >>= 7) {
      if (n < 0x80) {
        request.push_back(static_cast<char>(n));
        break;
      }
      request.push_back(static_cast<char>((n & 0x7f) | 0x80));
    }
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);
  grpc::ByteBuffer response_buffer;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::GenericStub stub(channel);
  absl::Mutex mu;
  bool done = false;
  grpc::Status rpc_status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request_buffer,
                 &response_buffer, [&](grpc::Status status) {
                   absl::MutexLock lock(&mu);
                   rpc_status = std::move(status);
                   done = true;
                 });
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&done));  // The deadline above bounds the wait.
  }
  if (!rpc_status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(rpc_status.error_code()),
                        rpc_status.error_message());
  }
  std::vector<grpc::Slice> slices;
  if (!response_buffer.Dump(&slices).ok()) {
    return absl::DataLossError("health: unreadable response");
  }
  std::string response;
  for (const grpc::Slice& s : slices) {
    response.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  // HealthCheckResponse { ServingStatus status = 1; }: tag 0x08, varint. An
  // empty message is the default, UNKNOWN; other fields are not expected.
  if (response.empty()) return ServingStatus::kUnknown;
  if (response.size() < 2 || response[0] != '\x08' || (response[1] & 0x80) != 0) {
    return absl::DataLossError("health: malformed HealthCheckResponse");
  }
  const int value = response[1];
  if (value < 0 || value > 3) return absl::DataLossError("health: unknown serving status");
  return static_cast<ServingStatus>(value);
}

}  // namespace pstrain
