// DaemonSecurityFromFlags: what the security flags both daemons share turn
// into. --require-client-cert on a worker guards its HTTPS /metrics (the only
// port it serves with TLS), so it needs the worker's certificate, key and CA.
#include "common/rpc/security_flags.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(bool, require_client_cert);

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

class SecurityFlagsTest : public ::testing::Test {
 protected:
  // A CA and certificates, made by the script users run.
  static void SetUpTestSuite() {
    certs_ = new std::string(
        absl::StrCat(::testing::TempDir(), "/security_flags_test_", getpid()));
    std::filesystem::remove_all(*certs_);
    const std::string command = absl::StrCat(
        PSTRAIN_SOURCE_DIR, "/deploy/local/make-certs.sh ", *certs_, " --force >/dev/null");
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }
  static void TearDownTestSuite() { delete certs_; }

  static std::string* certs_;
  absl::FlagSaver flag_saver_;  // Each test's flags end with it.
};

std::string* SecurityFlagsTest::certs_ = nullptr;

TEST_F(SecurityFlagsTest, AWorkerTakesRequireClientCertForItsMetrics) {
  absl::SetFlag(&FLAGS_tls_cert, *certs_ + "/worker.pem");
  absl::SetFlag(&FLAGS_tls_key, *certs_ + "/worker-key.pem");
  absl::SetFlag(&FLAGS_tls_ca, *certs_ + "/ca.pem");
  absl::SetFlag(&FLAGS_require_client_cert, true);
  absl::StatusOr<DaemonSecurity> security = DaemonSecurityFromFlags(/*server=*/false);
  ASSERT_OK(security.status());
  EXPECT_TRUE(security->tls.require_client_cert);
  EXPECT_EQ(security->tls.ca_file, *certs_ + "/ca.pem");
  EXPECT_NE(security->channel.credentials, nullptr);
}

TEST_F(SecurityFlagsTest, AWorkerRequiringClientCertificatesNeedsItsOwn) {
  absl::SetFlag(&FLAGS_tls_ca, *certs_ + "/ca.pem");
  absl::SetFlag(&FLAGS_require_client_cert, true);
  EXPECT_THAT(DaemonSecurityFromFlags(/*server=*/false).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-cert")));
}

TEST_F(SecurityFlagsTest, AServerRequiringClientCertificatesNeedsTheirCa) {
  absl::SetFlag(&FLAGS_tls_cert, *certs_ + "/server.pem");
  absl::SetFlag(&FLAGS_tls_key, *certs_ + "/server-key.pem");
  absl::SetFlag(&FLAGS_require_client_cert, true);
  EXPECT_THAT(DaemonSecurityFromFlags(/*server=*/true).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--tls-ca")));
}

}  // namespace
}  // namespace pstrain
