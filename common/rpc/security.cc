#include "common/rpc/security.h"

#include <arpa/inet.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace pstrain {
namespace {

// A token file is small; anything bigger is not one.
constexpr int64_t kMaxTokenFileBytes = 1 << 20;

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " ", path));
  std::string text;
  char buffer[4096];
  while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(text.size()) > kMaxTokenFileBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " ", path, " is larger than ", kMaxTokenFileBytes, " bytes"));
    }
  }
  return text;
}

std::array<unsigned char, 32> Sha256(absl::string_view data) {
  std::array<unsigned char, 32> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), digest.data());
  return digest;
}

bool ParseRole(absl::string_view name, Role* role) {
  static constexpr std::pair<absl::string_view, Role> kRoles[] = {
      {"admin", Role::kAdmin}, {"worker", Role::kWorker}, {"peer", Role::kPeer}};
  for (const auto& [known, value] : kRoles) {
    if (name == known) {
      *role = value;
      return true;
    }
  }
  return false;
}

// The value of `key` in the call's metadata ("" when absent).
std::string MetadataValue(const grpc::ServerContextBase& context, const char* key) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find(key);
  if (it == metadata.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kAdmin:
      return "admin";
    case Role::kWorker:
      return "worker";
    case Role::kPeer:
      return "peer";
  }
  return "unknown";
}

// ---- TLS -------------------------------------------------------------------

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentialsFor(
    const TlsOptions& tls) {
  if (tls.cert_file.empty() || tls.key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls-cert and --tls-key");
  }
  if (tls.require_client_cert && tls.ca_file.empty()) {
    return absl::InvalidArgumentError("--require-client-cert needs --tls-ca (the clients' CA)");
  }
  grpc::SslServerCredentialsOptions options(
      tls.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                              : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert = ReadSmallFile(tls.cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadSmallFile(tls.key_file, "--tls-key");
  if (!key.ok()) return key.status();
  pair.cert_chain = *std::move(cert);
  pair.private_key = *std::move(key);
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!tls.ca_file.empty()) {
    auto ca = ReadSmallFile(tls.ca_file, "--tls-ca");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
  }
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const TlsOptions& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  if (tls.ca_file.empty()) {
    return absl::InvalidArgumentError("a TLS client needs --tls-ca (the servers' CA)");
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError("a client certificate needs both --tls-cert and --tls-key");
  }
  grpc::SslCredentialsOptions options;
  auto ca = ReadSmallFile(tls.ca_file, "--tls-ca");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *std::move(ca);
  if (!tls.cert_file.empty()) {
    auto cert = ReadSmallFile(tls.cert_file, "--tls-cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadSmallFile(tls.key_file, "--tls-key");
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *std::move(cert);
    options.pem_private_key = *std::move(key);
  }
  return grpc::SslCredentials(options);
}

bool IsLoopbackAddress(const std::string& host_port) {
  std::string host = host_port;
  if (absl::StartsWith(host, "ipv4:") || absl::StartsWith(host, "ipv6:")) host = host.substr(5);
  const size_t colon = host.rfind(':');
  if (colon != std::string::npos && host.find(']') == std::string::npos &&
      host.find(':') == colon) {
    host = host.substr(0, colon);  // "a.b.c.d:port" or "name:port"
  } else if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    host = close == std::string::npos ? "" : host.substr(1, close - 1);
  }
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    static const in6_addr loopback = IN6ADDR_LOOPBACK_INIT;
    return memcmp(&v6, &loopback, sizeof(v6)) == 0;
  }
  return false;
}

absl::Status CheckListenPolicy(const std::string& what, const std::string& address,
                               bool tls_enabled, bool tokens_enabled, bool insecure,
                               std::string* warning) {
  warning->clear();
  if (IsLoopbackAddress(address) || (tls_enabled && tokens_enabled)) return absl::OkStatus();
  std::string missing;
  if (!tls_enabled) missing = "TLS (--tls-cert, --tls-key)";
  if (!tokens_enabled) {
    absl::StrAppend(&missing, missing.empty() ? "" : " and ", "tokens (--token-file)");
  }
  if (!insecure) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " ", address, " is not a loopback address and has no ", missing,
                     ": anyone who reaches it could use it. Give it ", missing,
                     ", listen on 127.0.0.1, or pass --insecure on a network you trust"));
  }
  *warning = absl::StrCat("WARNING: ", what, " ", address, " serves without ", missing,
                          " (--insecure): anyone who reaches it can use it");
  return absl::OkStatus();
}

// ---- Tokens ----------------------------------------------------------------

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadSmallFile(path, "token file");
  if (!text.ok()) return text.status();
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    Role role;
    if (fields.size() == 2 && ParseRole(fields[0], &role)) return std::string(fields[1]);
    if (fields.size() == 1) return std::string(fields[0]);
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, ": expected a token or 'ROLE TOKEN' on its first line"));
  }
  return absl::InvalidArgumentError(absl::StrCat("token file ", path, " holds no token"));
}

absl::StatusOr<std::shared_ptr<Authorizer>> Authorizer::FromTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadSmallFile(path, "token file");
  if (!text.ok()) return text.status();
  return FromText(*text, path);
}

absl::StatusOr<std::shared_ptr<Authorizer>> Authorizer::FromText(const std::string& text,
                                                                 const std::string& source) {
  std::shared_ptr<Authorizer> auth(new Authorizer());
  auth->enabled_ = true;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    Role role;
    if (fields.size() != 2 || !ParseRole(fields[0], &role)) {
      // The line is not echoed: it may hold a secret.
      return absl::InvalidArgumentError(
          absl::StrCat("token file ", source, " line ", line_number,
                       ": expected 'ROLE TOKEN' with ROLE admin, worker or peer"));
    }
    if (fields[1].size() < kMinTokenBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("token file ", source, " line ", line_number, ": a token needs at least ",
                       kMinTokenBytes, " bytes (deploy/local/make-certs.sh makes 32)"));
    }
    for (const Entry& e : auth->entries_) {
      if (e.digest == Sha256(fields[1])) {
        return absl::InvalidArgumentError(absl::StrCat("token file ", source, " line ", line_number,
                                                       ": a token may belong to one role only"));
      }
    }
    auth->entries_.push_back(Entry{role, Sha256(fields[1])});
    if (role == Role::kPeer && auth->peer_token_.empty()) {
      auth->peer_token_ = std::string(fields[1]);
    }
  }
  if (auth->peer_token_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", source,
                     " has no peer token: servers call each other and sign worker credentials "
                     "with it"));
  }
  const std::array<unsigned char, 32> key =
      Sha256(absl::StrCat("pstrain worker credential v1\n", auth->peer_token_));
  auth->credential_key_ = key;
  return auth;
}

std::shared_ptr<Authorizer> Authorizer::Disabled() {
  return std::shared_ptr<Authorizer>(new Authorizer());
}

grpc::Status Authorizer::Check(const grpc::ServerContextBase& context, Role role,
                               const char* method) const {
  if (!enabled_) return grpc::Status::OK;
  const std::string header = MetadataValue(context, kAuthorizationKey);
  if (header.empty()) {
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        absl::StrCat(method, " needs a bearer token (the ", RoleName(role), " role's token file)"));
  }
  absl::string_view token = header;
  if (!absl::ConsumePrefix(&token, "Bearer ")) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat(method, ": the authorization header is not 'Bearer TOKEN'"));
  }
  // Digests of equal length compared in constant time, every entry visited:
  // neither the token's length nor which entry matched shows in the timing.
  const std::array<unsigned char, 32> digest = Sha256(token);
  const Entry* match = nullptr;
  for (const Entry& e : entries_) {
    if (CRYPTO_memcmp(e.digest.data(), digest.data(), digest.size()) == 0) match = &e;
  }
  if (match == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat(method, ": the bearer token is not valid here"));
  }
  if (match->role != role) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        absl::StrCat(method, " needs the ", RoleName(role), " role; this token is ",
                                     RoleName(match->role), "'s"));
  }
  return grpc::Status::OK;
}

namespace {

// Separates a credential's state epoch from its MAC. Epochs are hex digits.
constexpr char kEpochSeparator = ':';

// The hex HMAC-SHA256 of `message` under `key`.
std::string HexMac(const std::array<unsigned char, 32>& key, absl::string_view message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &length);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(mac), static_cast<size_t>(length)));
}

// The credential of `worker_id` in state epoch `epoch` ("" = none).
std::string CredentialFor(const std::array<unsigned char, 32>& key, absl::string_view epoch,
                          const std::string& worker_id) {
  if (epoch.empty()) return HexMac(key, worker_id);
  return absl::StrCat(epoch, std::string(1, kEpochSeparator),
                      HexMac(key, absl::StrCat("epoch ", epoch, "\n", worker_id)));
}

bool SameBytes(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace

std::string Authorizer::IssueWorkerCredential(const std::string& worker_id) const {
  if (!enabled_) return "";
  return CredentialFor(credential_key_, state_epoch_, worker_id);
}

grpc::Status Authorizer::CheckWorkerCredential(const grpc::ServerContextBase& context,
                                               const std::string& worker_id) const {
  if (!enabled_) return grpc::Status::OK;
  return CheckWorkerCredential(WorkerCredentialOf(context), worker_id);
}

grpc::Status Authorizer::CheckWorkerCredential(const std::string& credential,
                                               const std::string& worker_id) const {
  if (!enabled_) return grpc::Status::OK;
  // The epoch the credential claims; the MAC proves the peer token signed it.
  const size_t separator = credential.find(kEpochSeparator);
  const absl::string_view epoch = separator == std::string::npos
                                      ? absl::string_view()
                                      : absl::string_view(credential).substr(0, separator);
  if (!SameBytes(credential, CredentialFor(credential_key_, epoch, worker_id))) {
    return grpc::Status(
        grpc::StatusCode::PERMISSION_DENIED,
        absl::StrCat("this call does not carry the credential of worker '", worker_id,
                     "': a worker may act only as the worker it registered as"));
  }
  if (!state_epoch_.empty() && epoch != state_epoch_) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("the credential of worker '", worker_id,
                     "' was issued by a server with another state directory (a new or reset "
                     "--state-dir numbers workers anew); the worker must register again"));
  }
  return grpc::Status::OK;
}

std::string Authorizer::WorkerCredentialOf(const grpc::ServerContextBase& context) {
  return MetadataValue(context, kWorkerCredentialKey);
}

void CallIdentity::set_worker_credential(std::string credential) {
  absl::MutexLock lock(&mu_);
  worker_credential_ = std::move(credential);
}

std::string CallIdentity::worker_credential() const {
  absl::MutexLock lock(&mu_);
  return worker_credential_;
}

}  // namespace pstrain
