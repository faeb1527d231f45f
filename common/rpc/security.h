// Who may call what: TLS credentials, per-role bearer tokens and the worker
// credential that binds a worker id to the caller that registered it. Shared
// by the three edges (server/, worker/, client/); docs/SECURITY.md is the
// threat model these pieces implement.
//
// Server side:
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Authorizer> auth,
//                            Authorizer::FromTokenFile("/etc/pstrain/tokens"));
//   // In a handler:
//   if (grpc::Status s = auth->Check(*context, Role::kAdmin, "SubmitJob"); !s.ok()) return s;
//   // RegisterWorker hands out the worker credential; Heartbeat checks it:
//   response->set_worker_credential(auth->IssueWorkerCredential(worker_id));
//   if (grpc::Status s = auth->CheckWorkerCredential(*context, worker_id); !s.ok()) return s;
//
// Client side (the credential is learnt at registration, sent from then on):
//
//   auto identity = std::make_shared<CallIdentity>();
//   PSTRAIN_ASSIGN_OR_RETURN(identity->token, ReadTokenFile(path));
//   ChannelOptions options;
//   options.identity = identity;
//   PSTRAIN_ASSIGN_OR_RETURN(options.credentials, ChannelCredentialsFor(tls));
//
// Token file of a server (--token-file): one "ROLE TOKEN" per line, roles
// admin, worker and peer; several tokens per role are allowed (rotation);
// '#' starts a comment. Every server of a cluster needs the same peer token
// first in its file: servers call each other with it, and it keys the worker
// credentials that every shard checks. A client's token file (the CLI's
// PSTRAIN_TOKEN_FILE, a worker's --token-file) holds its one token, or the
// same "ROLE TOKEN" lines, of which it takes the first.
//
// Threads: Authorizer and CallIdentity are thread-safe; the rest are pure
// functions.
#ifndef PSTRAIN_COMMON_RPC_SECURITY_H_
#define PSTRAIN_COMMON_RPC_SECURITY_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pstrain {

// Metadata keys (lower case, as gRPC requires).
inline constexpr char kAuthorizationKey[] = "authorization";
inline constexpr char kWorkerCredentialKey[] = "pstrain-worker-credential";

enum class Role { kAdmin, kWorker, kPeer };
const char* RoleName(Role role);

// ---- TLS -------------------------------------------------------------------

struct TlsOptions {
  std::string cert_file;  // PEM certificate chain of this end.
  std::string key_file;   // PEM private key of cert_file.
  std::string ca_file;    // PEM CA that signed the other end.
  // Refuse a handshake without a client certificate signed by ca_file: on a
  // server's port (mTLS) and on /metrics (MetricsTls). Channels ignore it.
  bool require_client_cert = false;
  // Clients: the name the server's certificate must carry when it is not the
  // host of the address dialled (for example a Kubernetes service name while
  // dialling a pod IP). Empty: the host dialled.
  std::string server_name;

  bool enabled() const { return !cert_file.empty() || !ca_file.empty(); }
};

// Server credentials from `tls` (cert and key needed; ca when a client
// certificate is required). INVALID_ARGUMENT names the missing flag, NOT_FOUND
// the unreadable file.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsOptions& tls);

// Channel credentials: TLS verifying the server against tls.ca_file (and
// presenting cert/key when given, for mTLS); insecure when !tls.enabled().
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const TlsOptions& tls);

// True for 127.0.0.0/8, ::1 and "localhost" hosts of "HOST:PORT".
bool IsLoopbackAddress(const std::string& host_port);

// The rule for every listening socket: a non-loopback `address` needs TLS and
// tokens, unless `insecure` (then a warning is returned in *warning).
// FAILED_PRECONDITION names what is missing and the flag that overrides it.
absl::Status CheckListenPolicy(const std::string& what, const std::string& address,
                               bool tls_enabled, bool tokens_enabled, bool insecure,
                               std::string* warning);

// ---- Tokens ----------------------------------------------------------------

// The token a client sends: the first token in `path` (a bare token, or the
// first "ROLE TOKEN" line). Errors name the file, never its contents.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// Decides every call on a server. A disabled authorizer (no token file)
// admits everyone as every role; CheckListenPolicy keeps that to loopback.
class Authorizer {
 public:
  // Minimum length of a token (bytes): a token is a secret, not a password.
  static constexpr size_t kMinTokenBytes = 16;

  static absl::StatusOr<std::shared_ptr<Authorizer>> FromTokenFile(const std::string& path);
  // Parses the contents of a token file (`source` names it in errors).
  static absl::StatusOr<std::shared_ptr<Authorizer>> FromText(const std::string& text,
                                                              const std::string& source);
  static std::shared_ptr<Authorizer> Disabled();

  bool enabled() const { return enabled_; }

  // OK when the call's bearer token belongs to `role`. UNAUTHENTICATED when
  // the call has no token or an unknown one, PERMISSION_DENIED when the token
  // is another role's. `method` names the call in the message.
  grpc::Status Check(const grpc::ServerContextBase& context, Role role, const char* method) const;

  // Binds the worker credentials this server issues and accepts to one
  // state: server 0 passes the epoch of its state directory
  // (server/state_epoch.h), so that a credential issued by a server with
  // another (fresh or reset) state directory, whose worker ids start over,
  // is refused even though the tokens are the same. Servers that only hold
  // shards set none and accept any epoch the peer token signed. Call before
  // the authorizer serves calls; constant after.
  void SetStateEpoch(std::string epoch) { state_epoch_ = std::move(epoch); }
  const std::string& state_epoch() const { return state_epoch_; }

  // The credential RegisterWorker hands to the worker it registered as
  // `worker_id`: HMAC-SHA256 keyed by the first peer token, so that every
  // server of the cluster can check it. With a state epoch it reads
  // "EPOCH:MAC" and the MAC covers the epoch too; without, the 64 hex digits
  // of the MAC. "" when disabled.
  std::string IssueWorkerCredential(const std::string& worker_id) const;
  // OK when the call carries the credential of `worker_id` (or when
  // disabled); PERMISSION_DENIED when it does not ("... may act only as the
  // worker it registered as"); FAILED_PRECONDITION when it is a genuine
  // credential of `worker_id` from another state epoch than this server's
  // (the worker must register again: Heartbeat tells it to).
  grpc::Status CheckWorkerCredential(const grpc::ServerContextBase& context,
                                     const std::string& worker_id) const;
  // As above, with the credential already taken from the call's metadata.
  grpc::Status CheckWorkerCredential(const std::string& credential,
                                     const std::string& worker_id) const;
  // The credential metadata of a call ("" when absent).
  static std::string WorkerCredentialOf(const grpc::ServerContextBase& context);

  // The token this server sends when it calls another server ("" when
  // disabled).
  const std::string& peer_token() const { return peer_token_; }

 private:
  struct Entry {
    Role role;
    std::array<unsigned char, 32> digest;  // SHA-256 of the token.
  };
  Authorizer() = default;

  bool enabled_ = false;
  std::vector<Entry> entries_;
  std::string peer_token_;
  std::array<unsigned char, 32> credential_key_{};
  std::string state_epoch_;  // "" = none (see SetStateEpoch).
};

// What a client sends with every call on its channels: its bearer token and,
// once registered, its worker credential. Set the token before the channel
// makes calls; the credential may be set (and replaced) at any time.
class CallIdentity {
 public:
  std::string token;  // "" = send none.

  void set_worker_credential(std::string credential) ABSL_LOCKS_EXCLUDED(mu_);
  std::string worker_credential() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::string worker_credential_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_SECURITY_H_
