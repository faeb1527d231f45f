#include "common/rpc/channel.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/support/client_interceptor.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <climits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/rpc/security.h"

namespace pstrain {
namespace {

int ToMillis(absl::Duration d) {
  const int64_t ms = absl::ToInt64Milliseconds(d);
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

// Adds the identity's bearer token and worker credential to every call.
class IdentityInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit IdentityInterceptor(std::shared_ptr<const CallIdentity> identity)
      : identity_(std::move(identity)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      std::multimap<std::string, std::string>* metadata = methods->GetSendInitialMetadata();
      if (!identity_->token.empty()) {
        metadata->emplace(kAuthorizationKey, absl::StrCat("Bearer ", identity_->token));
      }
      std::string credential = identity_->worker_credential();
      if (!credential.empty()) metadata->emplace(kWorkerCredentialKey, std::move(credential));
    }
    methods->Proceed();
  }

 private:
  const std::shared_ptr<const CallIdentity> identity_;
};

class IdentityInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit IdentityInterceptorFactory(std::shared_ptr<const CallIdentity> identity)
      : identity_(std::move(identity)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new IdentityInterceptor(identity_);
  }

 private:
  const std::shared_ptr<const CallIdentity> identity_;
};

}  // namespace

grpc::ChannelArguments DefaultChannelArguments(const ChannelOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, ToMillis(options.keepalive_time));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, ToMillis(options.keepalive_timeout));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 0);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A peer that went away is tried again soon: 100 ms after a failed
  // connection, backing off to 1 s. Each attempt is given at least 5 s to
  // finish its TCP and TLS handshakes and the server's SETTINGS (gRPC's
  // MIN_CONNECT_TIMEOUT, set by MIN_RECONNECT_BACKOFF): at 100 ms, as
  // before, a loaded machine's handshake (a CI run, a node whose cores all
  // train) could miss every attempt and never connect.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 5000);
  return args;
}

std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                             const ChannelOptions& options) {
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      options.credentials != nullptr ? options.credentials : grpc::InsecureChannelCredentials();
  grpc::ChannelArguments args = DefaultChannelArguments(options);
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  if (!options.connection_name.empty()) {
    args.SetString("pstrain.connection", options.connection_name);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  }
  if (options.identity == nullptr) return grpc::CreateCustomChannel(address, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<IdentityInterceptorFactory>(options.identity));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(factories));
}

void ConfigureServerBuilder(grpc::ServerBuilder* builder, int max_receive_message_bytes) {
  builder->SetMaxReceiveMessageSize(max_receive_message_bytes);
  builder->SetMaxSendMessageSize(-1);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

grpc::Status CheckMessageSize(const google::protobuf::Message& request, int64_t max_bytes,
                              const char* service, const char* flag) {
  const size_t bytes = request.ByteSizeLong();
  if (static_cast<int64_t>(bytes) <= max_bytes) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat(service, " request of ", bytes, " bytes exceeds the ", max_bytes,
                                   "-byte limit (", flag, ")"));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(status.code())),
                      std::string(status.message()));
}

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(status.error_code())),
                      status.error_message());
}

std::chrono::system_clock::time_point DeadlineFromNow(absl::Duration timeout) {
  return absl::ToChronoTime(absl::Now() + timeout);
}

void TuneAllocatorForLargeMessages() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's maximum on 64-bit.
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
#endif
}

}  // namespace pstrain
