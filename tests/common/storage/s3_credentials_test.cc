#include "common/storage/s3_credentials.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::storage {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

EnvLookup FakeEnv(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

class S3CredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/s3_credentials_", getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_ + "/home/.aws");
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  std::string dir_;
};

TEST_F(S3CredentialsTest, EnvironmentComesFirst) {
  Write("home/.aws/credentials", "[default]\naws_access_key_id = FILEKEY\n"
                                 "aws_secret_access_key = filesecret\n");
  ASSERT_OK_AND_ASSIGN(S3Settings s,
                       ResolveS3Settings(FakeEnv({{"HOME", dir_ + "/home"},
                                                  {"AWS_ACCESS_KEY_ID", "ENVKEY1234"},
                                                  {"AWS_SECRET_ACCESS_KEY", "envsecret"},
                                                  {"AWS_SESSION_TOKEN", "envtoken"}}),
                                         {}));
  EXPECT_EQ(s.credentials.access_key_id, "ENVKEY1234");
  EXPECT_EQ(s.credentials.secret_access_key, "envsecret");
  EXPECT_EQ(s.credentials.session_token, "envtoken");
  EXPECT_EQ(s.credentials.source, "environment");
  // The description names the source and the key's tail, never the secret.
  EXPECT_THAT(s.Describe(), HasSubstr("...1234"));
  EXPECT_THAT(s.Describe(), Not(HasSubstr("envsecret")));
  EXPECT_THAT(s.Describe(), Not(HasSubstr("envtoken")));
  EXPECT_THAT(s.Describe(), Not(HasSubstr("ENVKEY1234")));
}

TEST_F(S3CredentialsTest, SharedFileProfileThenExplicitFile) {
  Write("home/.aws/credentials",
        "# comment\n[default]\naws_access_key_id=DEFKEY\naws_secret_access_key=defsecret\n"
        "[profile training]\naws_access_key_id = TRAINKEY\naws_secret_access_key = trainsecret\n");
  ASSERT_OK_AND_ASSIGN(S3Settings def,
                       ResolveS3Settings(FakeEnv({{"HOME", dir_ + "/home"}}), {}));
  EXPECT_EQ(def.credentials.access_key_id, "DEFKEY");
  EXPECT_THAT(def.credentials.source, HasSubstr("[default]"));
  ASSERT_OK_AND_ASSIGN(
      S3Settings training,
      ResolveS3Settings(FakeEnv({{"HOME", dir_ + "/home"}, {"AWS_PROFILE", "training"}}), {}));
  EXPECT_EQ(training.credentials.secret_access_key, "trainsecret");

  // No shared file: the explicit file.
  S3Flags flags;
  flags.credentials_file = Write("explicit.ini", "[default]\naws_access_key_id=EXPKEY\n"
                                                 "aws_secret_access_key=expsecret\n");
  ASSERT_OK_AND_ASSIGN(S3Settings expl,
                       ResolveS3Settings(FakeEnv({{"HOME", dir_ + "/nohome"}}), flags));
  EXPECT_EQ(expl.credentials.access_key_id, "EXPKEY");
  EXPECT_THAT(expl.credentials.source, HasSubstr("--s3-credentials"));
  // Nothing anywhere: anonymous, not an error.
  ASSERT_OK_AND_ASSIGN(S3Settings none,
                       ResolveS3Settings(FakeEnv({{"HOME", dir_ + "/nohome"}}), {}));
  EXPECT_TRUE(none.credentials.empty());
  EXPECT_EQ(none.credentials.source, "none");
}

TEST_F(S3CredentialsTest, BadFilesSayWhatIsWrongWithoutQuotingSecrets) {
  S3Flags flags;
  flags.credentials_file = Write("bad.ini", "[default]\naws_access_key_id=K\nsupersecretvalue\n");
  absl::StatusOr<S3Settings> bad = ResolveS3Settings(FakeEnv({}), flags);
  EXPECT_THAT(bad.status(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("bad.ini:3: expected key = value")));
  EXPECT_THAT(bad.status().message(), Not(HasSubstr("supersecret")));
  flags.credentials_file = Write("half.ini", "[default]\naws_access_key_id=K\n");
  EXPECT_THAT(ResolveS3Settings(FakeEnv({}), flags).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs both")));
  flags.credentials_file = Write("other.ini", "[other]\naws_access_key_id=K\n");
  EXPECT_THAT(ResolveS3Settings(FakeEnv({}), flags).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no profile [default]")));
  flags.credentials_file = dir_ + "/missing.ini";
  EXPECT_THAT(ResolveS3Settings(FakeEnv({}), flags).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("--s3-credentials")));
  // A key id without its secret in the environment.
  EXPECT_THAT(ResolveS3Settings(FakeEnv({{"AWS_ACCESS_KEY_ID", "K"}}), {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("AWS_SECRET_ACCESS_KEY")));
}

TEST_F(S3CredentialsTest, EndpointAndRegion) {
  ASSERT_OK_AND_ASSIGN(S3Settings aws, ResolveS3Settings(FakeEnv({{"AWS_REGION", "eu-west-3"}}), {}));
  EXPECT_EQ(aws.endpoint.endpoint, "https://s3.eu-west-3.amazonaws.com");
  EXPECT_EQ(aws.endpoint.region, "eu-west-3");
  EXPECT_FALSE(aws.endpoint.path_style);
  ASSERT_OK_AND_ASSIGN(
      S3Settings local,
      ResolveS3Settings(FakeEnv({{"AWS_ENDPOINT_URL", "http://127.0.0.1:9000/"}}), {}));
  EXPECT_EQ(local.endpoint.endpoint, "http://127.0.0.1:9000");
  EXPECT_TRUE(local.endpoint.path_style);
  EXPECT_EQ(local.endpoint.region, "us-east-1");
  S3Flags flags;
  flags.endpoint = "https://minio.lan:9000";
  flags.region = "rack-1";
  flags.ca_file = "/etc/ca.pem";
  ASSERT_OK_AND_ASSIGN(
      S3Settings flagged,
      ResolveS3Settings(FakeEnv({{"AWS_ENDPOINT_URL", "http://ignored"}}), flags));
  EXPECT_EQ(flagged.endpoint.endpoint, "https://minio.lan:9000");
  EXPECT_EQ(flagged.endpoint.region, "rack-1");
  EXPECT_EQ(flagged.endpoint.ca_file, "/etc/ca.pem");
  flags.endpoint = "minio.lan:9000";
  EXPECT_THAT(ResolveS3Settings(FakeEnv({}), flags).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("http://")));
}

}  // namespace
}  // namespace pstrain::storage
