#include "common/rpc/security_flags.h"

#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain) of this daemon: the server's for its port, a worker's "
          "client certificate for mTLS (deploy/local/make-certs.sh makes them)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA the other end's certificate must be signed by. Giving it turns TLS on for "
          "this daemon's outgoing calls");
ABSL_FLAG(bool, require_client_cert, false,
          "Refuse TLS handshakes without a client certificate signed by --tls-ca (mTLS): on a "
          "server's port and its HTTPS /metrics; on a worker's HTTPS /metrics");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name the servers' certificates carry when it is not the host dialled");
ABSL_FLAG(std::string, token_file, "",
          "Servers: file of 'ROLE TOKEN' lines (roles admin, worker, peer). Workers: the file "
          "holding the worker token. Tokens are read from files only, never from the command line");
ABSL_FLAG(bool, insecure, false,
          "Allow a non-loopback listen address without TLS or tokens (logs a warning): only on a "
          "network where everyone who can reach the port is trusted");

namespace pstrain {

absl::Status DaemonSecurity::CheckListen(const std::string& what,
                                         const std::string& address) const {
  std::string warning;
  absl::Status status = CheckListenPolicy(
      what, address, server_credentials != nullptr && tls.enabled(),
      authorizer != nullptr ? authorizer->enabled() : tokens_enabled(), insecure, &warning);
  if (!warning.empty()) std::cerr << warning << std::endl;
  return status;
}

absl::StatusOr<DaemonSecurity> DaemonSecurityFromFlags(bool server) {
  DaemonSecurity security;
  security.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  security.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  security.tls.ca_file = absl::GetFlag(FLAGS_tls_ca);
  security.tls.require_client_cert = absl::GetFlag(FLAGS_require_client_cert);
  security.tls.server_name = absl::GetFlag(FLAGS_tls_server_name);
  security.insecure = absl::GetFlag(FLAGS_insecure);
  if (security.tls.require_client_cert && !server && security.tls.cert_file.empty()) {
    return absl::InvalidArgumentError(
        "--require-client-cert on a worker guards its HTTPS /metrics: it needs --tls-cert, "
        "--tls-key and --tls-ca");
  }
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  security.identity = std::make_shared<CallIdentity>();
  if (server) {
    if (!security.tls.cert_file.empty() || !security.tls.key_file.empty()) {
      auto credentials = ServerCredentialsFor(security.tls);
      if (!credentials.ok()) return credentials.status();
      security.server_credentials = *std::move(credentials);
    } else if (security.tls.require_client_cert) {
      return absl::InvalidArgumentError("--require-client-cert needs --tls-cert and --tls-key");
    } else {
      security.server_credentials = grpc::InsecureServerCredentials();
    }
    if (token_file.empty()) {
      security.authorizer = Authorizer::Disabled();
    } else {
      auto authorizer = Authorizer::FromTokenFile(token_file);
      if (!authorizer.ok()) return authorizer.status();
      security.authorizer = *std::move(authorizer);
      security.identity->token = security.authorizer->peer_token();
    }
  } else if (!token_file.empty()) {
    auto token = ReadTokenFile(token_file);
    if (!token.ok()) return token.status();
    security.identity->token = *std::move(token);
  }
  // Outgoing calls: TLS when a CA is given (a server's calls to the other
  // shards present its own certificate, which the shards' mTLS accepts).
  if (!security.tls.ca_file.empty()) {
    auto credentials = ChannelCredentialsFor(security.tls);
    if (!credentials.ok()) return credentials.status();
    security.channel.credentials = *std::move(credentials);
  } else if (!server && (!security.tls.cert_file.empty() || !security.tls.key_file.empty())) {
    return absl::InvalidArgumentError(
        "--tls-cert/--tls-key on a client need --tls-ca (the servers' CA) to turn TLS on");
  }
  security.channel.tls_server_name = security.tls.server_name;
  security.channel.identity = security.identity;
  return security;
}

}  // namespace pstrain
