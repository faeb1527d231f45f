// One port, one server. gRPC listens with SO_REUSEPORT by default, so a
// second pstrain-server started on a port already in use listened too, and
// the kernel split new connections between the two processes: a CLI call
// reached the wrong server and failed its TLS handshake (a flaky
// `pstrain watch` in the suite, where tests run side by side on ports freed
// a moment before). The second server must refuse to start, and the first
// must go on serving every connection.
#include <signal.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/integration/process_util.h"

namespace pstrain::testing {
namespace {

TEST(ServerPortTest, ASecondServerOnAPortInUseFailsAndTheFirstKeepsEveryConnection) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string dir = absl::StrCat(::testing::TempDir(), "/server-port-", getpid());
  const std::string address = Address(port);
  ChildProcess first(
      {BinPath("pstrain-server"), "--listen", address, "--state-dir", dir + "/first"});
  ASSERT_TRUE(first.WaitForOutput("listening on", absl::Seconds(30))) << first.output();

  ChildProcess second(
      {BinPath("pstrain-server"), "--listen", address, "--state-dir", dir + "/second"});
  EXPECT_GT(second.Wait(absl::Seconds(30)), 0) << second.output();  // -1: still running.
  EXPECT_TRUE(absl::StrContains(second.output(), "cannot listen on " + address)) << second.output();
  EXPECT_FALSE(absl::StrContains(second.output(), "listening on")) << second.output();

  // Every new connection reaches the first server: a job submitted through
  // one CLI call is known to each of the next ones.
  CommandResult submit = RunCommand({BinPath("pstrain"), "--server", address, "submit",
                                     SourcePath("examples/fashion-mnist.json")});
  ASSERT_EQ(submit.exit_code, 0) << submit.output;
  for (int i = 0; i < 8; ++i) {
    CommandResult status = RunCommand({BinPath("pstrain"), "--server", address, "status", "job-1"});
    EXPECT_EQ(status.exit_code, 0) << status.output;
  }
}

}  // namespace
}  // namespace pstrain::testing
