// MetricsHttpServer: the /metrics endpoint both daemons share.
#include "common/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "tests/testing/http_get.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::HttpGet;
using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

TEST(MetricsHttpServerTest, ServesTheRenderedTextOnEveryScrape) {
  std::atomic<int> scrapes{0};
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, [&scrapes] {
    return "pstrain_test_scrapes_total " + std::to_string(++scrapes) + "\n";
  });
  ASSERT_OK(server);
  ASSERT_GT((*server)->port(), 0);
  const std::string first = HttpGet((*server)->port(), "/metrics");
  EXPECT_EQ(first.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << first;
  EXPECT_NE(first.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  EXPECT_NE(first.find("Content-Length: 29\r\n"), std::string::npos) << first;
  EXPECT_NE(first.find("\r\n\r\npstrain_test_scrapes_total 1\n"), std::string::npos) << first;
  const std::string second = HttpGet((*server)->port(), "/metrics?format=text");
  EXPECT_NE(second.find("pstrain_test_scrapes_total 2\n"), std::string::npos) << second;
}

TEST(MetricsHttpServerTest, OtherPathsAre404AndNotRendered) {
  std::atomic<int> scrapes{0};
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, [&scrapes] {
    ++scrapes;
    return std::string("x 1\n");
  });
  ASSERT_OK(server);
  for (const char* path : {"/", "/metricsfoo", "/other"}) {
    const std::string response = HttpGet((*server)->port(), path);
    EXPECT_EQ(response.rfind("HTTP/1.0 404 Not Found\r\n", 0), 0u) << path << ": " << response;
  }
  EXPECT_EQ(scrapes.load(), 0);
}

TEST(MetricsHttpServerTest, RegistryTextIsPrometheusFormat) {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("pstrain_test_events_total")
      .Help("Events")
      .Register(*registry)
      .Add({{"kind", "a"}})
      .Increment(3);
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, PrometheusTextOf(registry));
  ASSERT_OK(server);
  const std::string response = HttpGet((*server)->port(), "/metrics");
  EXPECT_NE(response.find("# TYPE pstrain_test_events_total counter"), std::string::npos)
      << response;
  EXPECT_NE(response.find("pstrain_test_events_total{kind=\"a\"} 3"), std::string::npos)
      << response;
}

TEST(MetricsHttpServerTest, BusyPortIsUnavailableNotACrash) {
  auto first = MetricsHttpServer::Start("127.0.0.1", 0, [] { return std::string(); });
  ASSERT_OK(first);
  auto second =
      MetricsHttpServer::Start("127.0.0.1", (*first)->port(), [] { return std::string(); });
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find(std::to_string((*first)->port())), std::string::npos);
}

TEST(MetricsHttpServerTest, BadArgumentsAreInvalid) {
  auto render = [] { return std::string(); };
  EXPECT_EQ(MetricsHttpServer::Start("localhost", 0, render).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1", 70000, render).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MetricsHttpServer::Start("127.0.0.1", 0, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsHttpServerTest, StopsPromptlyAndFreesThePort) {
  int port = 0;
  {
    auto server = MetricsHttpServer::Start("127.0.0.1", 0, [] { return std::string("x 1\n"); });
    ASSERT_OK(server);
    port = (*server)->port();
  }
  EXPECT_EQ(HttpGet(port, "/metrics"), "");
  auto again = MetricsHttpServer::Start("127.0.0.1", port, [] { return std::string(); });
  EXPECT_OK(again);
}

// ---- HTTPS -----------------------------------------------------------------

// A CA with server, worker, admin and Prometheus certificates, made by the
// script users run. Two calls with different names make two unrelated CAs.
std::string MakeCerts(const std::string& name) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/metrics_http_test_", getpid(), "_", name);
  std::filesystem::remove_all(dir);
  const std::string command =
      absl::StrCat(PSTRAIN_SOURCE_DIR, "/deploy/local/make-certs.sh ", dir, " --force >/dev/null");
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return dir;
}

// What a scraper presents: the CA it verifies the endpoint against and,
// optionally, its own certificate and key.
struct Scraper {
  std::string ca_file;
  std::string cert_file;  // Empty: no client certificate.
  std::string key_file;
};

// "GET path" over TLS to 127.0.0.1:port, verifying the server's certificate
// (named 127.0.0.1) against scraper.ca_file. The whole response, or "" when
// the handshake or the exchange fails (with TLS 1.3 a server refuses the
// client's certificate after the client's side of the handshake is done, so
// the refusal shows as a response that never comes).
std::string HttpsGet(int port, const std::string& path, const Scraper& scraper) {
  SSL_CTX* context = SSL_CTX_new(TLS_client_method());
  if (context == nullptr) return "";
  SSL_CTX_set_verify(context, SSL_VERIFY_PEER, nullptr);
  std::string response;
  const bool configured =
      SSL_CTX_load_verify_locations(context, scraper.ca_file.c_str(), nullptr) == 1 &&
      (scraper.cert_file.empty() ||
       (SSL_CTX_use_certificate_chain_file(context, scraper.cert_file.c_str()) == 1 &&
        SSL_CTX_use_PrivateKey_file(context, scraper.key_file.c_str(), SSL_FILETYPE_PEM) == 1));
  EXPECT_TRUE(configured) << "cannot load the scraper's files";
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  SSL* ssl = SSL_new(context);
  if (configured && ssl != nullptr &&
      connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      SSL_set_fd(ssl, fd) == 1 && SSL_set1_host(ssl, "127.0.0.1") == 1 && SSL_connect(ssl) == 1) {
    const std::string request = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
    if (SSL_write(ssl, request.data(), static_cast<int>(request.size())) > 0) {
      char buffer[4096];
      int n;
      while ((n = SSL_read(ssl, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
    }
  }
  ERR_clear_error();
  SSL_free(ssl);
  close(fd);
  SSL_CTX_free(context);
  return response;
}

class MetricsHttpsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    certs_ = new std::string(MakeCerts("cluster"));
    other_certs_ = new std::string(MakeCerts("other"));
  }
  static void TearDownTestSuite() {
    delete certs_;
    delete other_certs_;
  }

  // The daemon's side: the cluster's server certificate; with
  // require_client_cert, the cluster CA for clients too.
  static MetricsTls Tls(bool require_client_cert) {
    return MetricsTls{*certs_ + "/server.pem", *certs_ + "/server-key.pem",
                      require_client_cert ? *certs_ + "/ca.pem" : ""};
  }
  static Scraper WithCertificate(const std::string& dir) {
    return Scraper{*certs_ + "/ca.pem", dir + "/prometheus.pem", dir + "/prometheus-key.pem"};
  }
  static Scraper WithoutCertificate() { return Scraper{*certs_ + "/ca.pem", "", ""}; }

  // Starts an endpoint whose every render is counted in scrapes_.
  std::unique_ptr<MetricsHttpServer> StartEndpoint(const MetricsTls& tls) {
    auto server = MetricsHttpServer::Start(
        "127.0.0.1", 0,
        [this] { return "pstrain_test_scrapes_total " + std::to_string(++scrapes_) + "\n"; },
        &tls);
    EXPECT_OK(server.status());
    return server.ok() ? *std::move(server) : nullptr;
  }

  static std::string* certs_;
  static std::string* other_certs_;
  std::atomic<int> scrapes_{0};
};

std::string* MetricsHttpsTest::certs_ = nullptr;
std::string* MetricsHttpsTest::other_certs_ = nullptr;

TEST_F(MetricsHttpsTest, WithoutAClientCaAnyTlsClientScrapes) {
  std::unique_ptr<MetricsHttpServer> server = StartEndpoint(Tls(/*require_client_cert=*/false));
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(server->https());
  const std::string response = HttpsGet(server->port(), "/metrics", WithoutCertificate());
  EXPECT_NE(response.find("\r\n\r\npstrain_test_scrapes_total 1\n"), std::string::npos)
      << response;
  // TLS only: a plain-HTTP request gets no metrics.
  EXPECT_EQ(HttpGet(server->port(), "/metrics").find("pstrain_test"), std::string::npos);
  EXPECT_EQ(scrapes_.load(), 1);
}

TEST_F(MetricsHttpsTest, WithAClientCaTheClusterScraperGetsTheMetrics) {
  std::unique_ptr<MetricsHttpServer> server = StartEndpoint(Tls(/*require_client_cert=*/true));
  ASSERT_NE(server, nullptr);
  const std::string response = HttpsGet(server->port(), "/metrics", WithCertificate(*certs_));
  EXPECT_EQ(response.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << response;
  EXPECT_NE(response.find("\r\n\r\npstrain_test_scrapes_total 1\n"), std::string::npos)
      << response;
}

TEST_F(MetricsHttpsTest, WithAClientCaAScraperWithoutACertificateIsRefused) {
  std::unique_ptr<MetricsHttpServer> server = StartEndpoint(Tls(/*require_client_cert=*/true));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(HttpsGet(server->port(), "/metrics", WithoutCertificate()), "");
  EXPECT_EQ(scrapes_.load(), 0);
  // The refusal does not stop the endpoint: the cluster's scraper still gets in.
  EXPECT_NE(HttpsGet(server->port(), "/metrics", WithCertificate(*certs_))
                .find("pstrain_test_scrapes_total 1\n"),
            std::string::npos);
}

TEST_F(MetricsHttpsTest, WithAClientCaACertificateOfAnotherCaIsRefused) {
  std::unique_ptr<MetricsHttpServer> server = StartEndpoint(Tls(/*require_client_cert=*/true));
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(HttpsGet(server->port(), "/metrics", WithCertificate(*other_certs_)), "");
  EXPECT_EQ(scrapes_.load(), 0);
}

TEST_F(MetricsHttpsTest, UnreadableFilesAreInvalidArguments) {
  auto render = [] { return std::string(); };
  MetricsTls no_client_ca = Tls(/*require_client_cert=*/true);
  no_client_ca.client_ca_file = *certs_ + "/missing-ca.pem";
  EXPECT_THAT(MetricsHttpServer::Start("127.0.0.1", 0, render, &no_client_ca).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("missing-ca.pem")));
  MetricsTls no_key = Tls(/*require_client_cert=*/false);
  no_key.key_file = *certs_ + "/missing-key.pem";
  EXPECT_THAT(MetricsHttpServer::Start("127.0.0.1", 0, render, &no_key).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("missing-key.pem")));
}

}  // namespace
}  // namespace pstrain
