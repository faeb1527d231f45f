#include "common/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pstrain {
namespace {

std::string OpenSslError() {
  char text[256];
  ERR_error_string_n(ERR_get_error(), text, sizeof(text));
  ERR_clear_error();
  return text;
}

// The endpoint's TLS: TLS 1.2 or later with the daemon's certificate and key;
// with tls.client_ca_file, a client certificate signed by that CA is
// required (OpenSSL checks its purpose as a TLS client's). The caller owns
// the context (SSL_CTX_free).
absl::StatusOr<SSL_CTX*> NewTlsContext(const MetricsTls& tls) {
  SSL_CTX* context = SSL_CTX_new(TLS_server_method());
  if (context == nullptr || SSL_CTX_set_min_proto_version(context, TLS1_2_VERSION) != 1 ||
      SSL_CTX_use_certificate_chain_file(context, tls.cert_file.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(context, tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(context) != 1) {
    const std::string error = OpenSslError();
    SSL_CTX_free(context);
    return absl::InvalidArgumentError(absl::StrCat("/metrics TLS: cannot use --tls-cert ",
                                                   tls.cert_file, " and --tls-key ",
                                                   tls.key_file, ": ", error));
  }
  if (tls.client_ca_file.empty()) return context;
  // The CA verifies the client's chain; its name goes into the handshake's
  // CertificateRequest so that a client holding several certificates picks
  // the right one.
  STACK_OF(X509_NAME)* client_ca_names = SSL_load_client_CA_file(tls.client_ca_file.c_str());
  if (client_ca_names == nullptr ||
      SSL_CTX_load_verify_locations(context, tls.client_ca_file.c_str(), nullptr) != 1) {
    const std::string error = OpenSslError();
    sk_X509_NAME_pop_free(client_ca_names, X509_NAME_free);
    SSL_CTX_free(context);
    return absl::InvalidArgumentError(absl::StrCat(
        "/metrics TLS: cannot use --tls-ca ", tls.client_ca_file, " for client certificates: ",
        error));
  }
  SSL_CTX_set_client_CA_list(context, client_ca_names);  // Takes ownership.
  SSL_CTX_set_verify(context, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  return context;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host, int port, std::function<std::string()> render, const MetricsTls* tls) {
  if (!render) return absl::InvalidArgumentError("MetricsHttpServer: empty render callback");
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics port ", port, " is outside [0, 65535]"));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", host, "' is not an IPv4 address"));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 16) != 0) {
    const std::string error = std::strerror(errno);
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot serve /metrics on ", host, ":", port, ": ", error));
  }
  SSL_CTX* context = nullptr;
  if (tls != nullptr) {
    absl::StatusOr<SSL_CTX*> made = NewTlsContext(*tls);
    if (!made.ok()) {
      close(fd);
      return made.status();
    }
    context = *made;
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(fd, host, ntohs(addr.sin_port), std::move(render), context));
}

MetricsHttpServer::MetricsHttpServer(int fd, std::string host, int port,
                                     std::function<std::string()> render, SSL_CTX* tls_context)
    : fd_(fd),
      host_(std::move(host)),
      port_(port),
      render_(std::move(render)),
      tls_context_(tls_context) {
  thread_ = std::thread([this] { Serve(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_.store(true);
  thread_.join();
  close(fd_);
  SSL_CTX_free(tls_context_);
}

void MetricsHttpServer::Serve() {
  while (!stop_.load()) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, /*timeout=*/200) <= 0) continue;
    const int connection = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) continue;
    Answer(connection);
    close(connection);
  }
}

void MetricsHttpServer::Answer(int connection) {
  timeval timeout{1, 0};  // A client that sends nothing does not hold the endpoint.
  setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  // Plain HTTP, or TLS over the same socket (the timeouts above bound the
  // handshake too).
  SSL* ssl = nullptr;
  if (tls_context_ != nullptr) {
    ssl = SSL_new(tls_context_);
    if (ssl == nullptr || SSL_set_fd(ssl, connection) != 1 || SSL_accept(ssl) != 1) {
      ERR_clear_error();
      SSL_free(ssl);
      return;
    }
  }
  auto receive = [&](char* data, size_t size) -> ssize_t {
    if (ssl == nullptr) return recv(connection, data, size, 0);
    return SSL_read(ssl, data, static_cast<int>(size));
  };
  auto send_some = [&](const char* data, size_t size) -> ssize_t {
    if (ssl == nullptr) return send(connection, data, size, MSG_NOSIGNAL);
    return SSL_write(ssl, data, static_cast<int>(std::min<size_t>(size, 1 << 20)));
  };
  std::string request;
  char buffer[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.size() < 8192) {
    const ssize_t n = receive(buffer, sizeof(buffer));
    if (n <= 0) break;
    request.append(buffer, static_cast<size_t>(n));
  }
  // "GET /metrics", "GET /metrics?x=y" and "GET /metrics HTTP/1.1" are
  // /metrics; "GET /metricsfoo" is not.
  const std::string prefix = "GET /metrics";
  const bool is_metrics = request.rfind(prefix, 0) == 0 && request.size() > prefix.size() &&
                          (request[prefix.size()] == ' ' || request[prefix.size()] == '?' ||
                           request[prefix.size()] == '\r');
  std::string status = "200 OK", body;
  if (is_metrics) {
    body = render_();
  } else {
    status = "404 Not Found";
    body = "only /metrics is served here\n";
  }
  const std::string response =
      absl::StrCat("HTTP/1.0 ", status, "\r\nContent-Type: text/plain; version=0.0.4\r\n",
                   "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
  size_t sent = 0;
  while (sent < response.size()) {
    const ssize_t n = send_some(response.data() + sent, response.size() - sent);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  if (ssl != nullptr) {
    SSL_shutdown(ssl);
    SSL_free(ssl);
    ERR_clear_error();
  }
}

}  // namespace pstrain
