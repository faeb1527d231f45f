// MetricsHttpServer: the /metrics endpoint both daemons share.
#include "common/metrics_http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "tests/testing/http_get.h"
#include "prometheus/counter.h"

namespace pstrain {
namespace {

using ::pstrain::testing::HttpGet;

TEST(MetricsHttpServerTest, ServesTheRenderedTextOnEveryScrape) {
  std::atomic<int> scrapes{0};
  auto server = MetricsHttpServer::Start("127.0.0.1", 0, [&scrapes] {
    return "pstrain_test_scrapes_total " + std::to_string(++scrapes) + "\n";
  });
  ASSERT_TRUE(server.ok()) << server.status();
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
  ASSERT_TRUE(server.ok()) << server.status();
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
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string response = HttpGet((*server)->port(), "/metrics");
  EXPECT_NE(response.find("# TYPE pstrain_test_events_total counter"), std::string::npos)
      << response;
  EXPECT_NE(response.find("pstrain_test_events_total{kind=\"a\"} 3"), std::string::npos)
      << response;
}

TEST(MetricsHttpServerTest, BusyPortIsUnavailableNotACrash) {
  auto first = MetricsHttpServer::Start("127.0.0.1", 0, [] { return std::string(); });
  ASSERT_TRUE(first.ok()) << first.status();
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
    ASSERT_TRUE(server.ok()) << server.status();
    port = (*server)->port();
  }
  EXPECT_EQ(HttpGet(port, "/metrics"), "");
  auto again = MetricsHttpServer::Start("127.0.0.1", port, [] { return std::string(); });
  EXPECT_TRUE(again.ok()) << again.status();
}

}  // namespace
}  // namespace pstrain
