// MetricsHttpServer: the one `/metrics` endpoint of every pstrain daemon
// (pstrain-server and pstrain-worker). It answers `GET /metrics` with the text
// a render callback returns (Prometheus text format 0.0.4) over plain
// HTTP/1.0, one connection at a time on its own thread, and 404 for any other
// path.
//
//   auto registry = std::make_shared<prometheus::Registry>();
//   PSTRAIN_ASSIGN_OR_RETURN(
//       std::unique_ptr<MetricsHttpServer> endpoint,
//       MetricsHttpServer::Start("127.0.0.1", 9100, PrometheusTextOf(registry)));
//   std::cout << "metrics on port " << endpoint->port();
//
// With a certificate and key (MetricsTls) it serves HTTPS instead, so that
// a scraper on another host reads /metrics over TLS (Prometheus'
// `scheme: https` with `tls_config.ca_file`). With a client CA as well
// (MetricsTls::client_ca_file, set by the daemons' --require-client-cert) it
// refuses the handshake of a scraper without a certificate signed by that CA
// (Prometheus' `tls_config.cert_file` and `key_file`), as their gRPC port
// refuses a client without one.
//
// Why not prometheus-cpp's Exposer: it serves through civetweb, whose
// threads cannot start in a process that loaded cuBLAS 13 ("Cannot create
// threads"), and it reports a failed bind by throwing. This server uses
// prometheus-cpp's registry and TextSerializer only (PrometheusTextOf), so
// both daemons expose the same way and a bind failure is a Status.
//
// Threads: Start and the destructor from one thread. `render` runs on the
// endpoint's thread, once per scrape; it must be thread-safe with respect to
// whatever else touches what it reads (a prometheus::Registry is).
#ifndef PSTRAIN_COMMON_METRICS_HTTP_H_
#define PSTRAIN_COMMON_METRICS_HTTP_H_

#include <atomic>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX, kept out of this header.

namespace pstrain {

// HTTPS for the endpoint: the daemon's PEM certificate (chain) and key, and
// optionally the CA every scraper's client certificate must be signed by.
struct MetricsTls {
  std::string cert_file;
  std::string key_file;
  // Non-empty: a handshake without a client certificate signed by this PEM CA
  // (with clientAuth among its extended key usages, when it lists any) is
  // refused, and nothing is rendered. Empty: any client may scrape.
  std::string client_ca_file;
};

class MetricsHttpServer {
 public:
  // Binds host:port (an IPv4 address; port 0 picks a free port, see port())
  // and starts serving. INVALID_ARGUMENT for a host that is not an IPv4
  // address, a port outside [0, 65535] or an empty `render`; UNAVAILABLE when
  // the port cannot be bound; INVALID_ARGUMENT for a certificate, key or
  // client CA that cannot be loaded (tls: HTTPS; null: plain HTTP).
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& host, int port, std::function<std::string()> render,
      const MetricsTls* tls = nullptr);
  ~MetricsHttpServer();  // Stops serving (within 200 ms) and joins the thread.
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return host_; }
  bool https() const { return tls_context_ != nullptr; }

 private:
  MetricsHttpServer(int fd, std::string host, int port, std::function<std::string()> render,
                    ssl_ctx_st* tls_context);
  void Serve();
  void Answer(int connection);

  // Constant after construction.
  const int fd_;
  const std::string host_;
  const int port_;
  const std::function<std::string()> render_;
  ssl_ctx_st* const tls_context_;  // OpenSSL's SSL_CTX; null: plain HTTP. Owned.

  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A render callback for MetricsHttpServer: the registry's metrics in
// Prometheus text format. Callers link prometheus-cpp (core).
inline std::function<std::string()> PrometheusTextOf(
    std::shared_ptr<prometheus::Registry> registry) {
  return [registry = std::move(registry)] {
    std::ostringstream text;
    prometheus::TextSerializer().Serialize(text, registry->Collect());
    return text.str();
  };
}

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_METRICS_HTTP_H_
