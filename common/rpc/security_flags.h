// The security flags every daemon shares (pstrain-server, pstrain-worker):
// --tls-cert, --tls-key, --tls-ca, --require-client-cert, --tls-server-name,
// --token-file and --insecure, and what they turn into.
//
//   PSTRAIN_ASSIGN_OR_RETURN(DaemonSecurity security, DaemonSecurityFromFlags(/*server=*/true));
//   builder.AddListeningPort(listen, security.server_credentials, &port);
//   PSTRAIN_RETURN_IF_ERROR(security.CheckListen("--listen", listen));
//
// Threads: call from main() after absl::ParseCommandLine.
#ifndef PSTRAIN_COMMON_RPC_SECURITY_FLAGS_H_
#define PSTRAIN_COMMON_RPC_SECURITY_FLAGS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/rpc/channel.h"
#include "common/rpc/security.h"

namespace pstrain {

struct DaemonSecurity {
  TlsOptions tls;
  bool insecure = false;
  // Servers: TLS (or insecure) credentials for the listening port, and the
  // authorizer of every call (disabled without --token-file).
  std::shared_ptr<grpc::ServerCredentials> server_credentials;
  std::shared_ptr<Authorizer> authorizer;
  // Outgoing calls (a worker to the servers, server 0 to the other shards):
  // TLS credentials and this daemon's token (a worker's --token-file, a
  // server's peer token).
  ChannelOptions channel;
  std::shared_ptr<CallIdentity> identity;

  bool tokens_enabled() const { return identity != nullptr && !identity->token.empty(); }
  // CheckListenPolicy for a socket this daemon binds; logs the --insecure
  // warning to stderr.
  absl::Status CheckListen(const std::string& what, const std::string& address) const;
};

// Reads the flags and the files they name. server: --token-file is the
// server's "ROLE TOKEN" file; otherwise the daemon's own token.
absl::StatusOr<DaemonSecurity> DaemonSecurityFromFlags(bool server);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_SECURITY_FLAGS_H_
