// gRPC plumbing shared by every edge (server/, worker/, client/): channels
// with the project's arguments, server-builder settings that match them, and
// the absl::Status <-> grpc::Status mapping (codes map 1:1).
//
//   std::shared_ptr<grpc::Channel> channel = CreateChannel("127.0.0.1:7070");
//   auto stub = v1::Coordinator::NewStub(channel);
//   grpc::ClientContext ctx;
//   ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
//   PSTRAIN_RETURN_IF_ERROR(ToAbslStatus(stub->GetJob(&ctx, request, &status)));
//
//   grpc::ServerBuilder builder;
//   ConfigureServerBuilder(&builder);  // before BuildAndStart()
//
// Threads: every function is thread-safe. Channels are meant to be created
// once per peer and shared.
#ifndef PSTRAIN_COMMON_RPC_CHANNEL_H_
#define PSTRAIN_COMMON_RPC_CHANNEL_H_

#include <grpcpp/channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/channel_arguments.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/message.h"

namespace pstrain {

class CallIdentity;  // common/rpc/security.h

struct ChannelOptions {
  // Insecure when null (loopback and tests); TLS credentials otherwise
  // (ChannelCredentialsFor in common/rpc/security.h).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // TLS: the name the server's certificate must carry when it is not the
  // host dialled ("" = the host dialled).
  std::string tls_server_name;
  // Bearer token and worker credential sent as metadata with every call
  // (null: none).
  std::shared_ptr<const CallIdentity> identity;
  // Channels to one address share a connection unless their names differ
  // ("" = the shared one): a channel argument that keeps gRPC from reusing
  // another channel's subchannel.
  std::string connection_name;
  // HTTP/2 keepalive pings while calls are open, so a dead peer is noticed
  // during a long blocking pull.
  absl::Duration keepalive_time = absl::Seconds(20);
  absl::Duration keepalive_timeout = absl::Seconds(10);
};

// Channel arguments: unlimited send/receive message sizes (tensor frames are
// bounded by the services themselves), keepalive while calls are open, and a
// capped reconnect backoff (1 s) so workers find a restarted server quickly.
grpc::ChannelArguments DefaultChannelArguments(const ChannelOptions& options = {});

// A channel to `address` ("host:port") with DefaultChannelArguments.
std::shared_ptr<grpc::Channel> CreateChannel(const std::string& address,
                                             const ChannelOptions& options = {});

// Sets the server's receive limit to max_receive_message_bytes (-1:
// unlimited, for tests; daemons pass the largest of their services' limits,
// each service checking its own) and accepts the clients' keepalive pings
// (every 10 s or slower, also without data in flight). Call once per builder
// before BuildAndStart().
void ConfigureServerBuilder(grpc::ServerBuilder* builder, int max_receive_message_bytes = -1);

// RESOURCE_EXHAUSTED naming `service` and `flag` when `request` serialises
// to more than max_bytes (a service's own limit, below the server's).
grpc::Status CheckMessageSize(const google::protobuf::Message& request, int64_t max_bytes,
                              const char* service, const char* flag);

// absl -> gRPC and back; codes are numerically identical, messages kept.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status ToAbslStatus(const grpc::Status& status);

// A deadline for ClientContext::set_deadline.
std::chrono::system_clock::time_point DeadlineFromNow(absl::Duration timeout);

// Lets glibc keep large freed blocks instead of unmapping them (mmap and trim
// thresholds raised to 32 and 512 MiB), so that receiving 1 MiB frames does not map,
// fault in and unmap memory every time (the transport lessons' 2-4x). For
// daemons' main(); affects the whole process; no-op without glibc.
void TuneAllocatorForLargeMessages();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_CHANNEL_H_
