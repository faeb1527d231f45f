#include "common/data/path_policy.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using ::pstrain::testing::StatusIs;

class DataPathPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = absl::StrCat(::testing::TempDir(), "/path_policy_", getpid());
    fs::remove_all(base_);
    fs::create_directories(base_ + "/data/fmnist");
    fs::create_directories(base_ + "/data-evil");
    fs::create_directories(base_ + "/outside");
    std::ofstream(base_ + "/outside/secret.txt") << "secret contents";
    std::ofstream(base_ + "/data/fmnist/train.idx") << "x";
  }
  void TearDown() override { fs::remove_all(base_); }

  DataPathPolicy Policy() {
    absl::StatusOr<DataPathPolicy> policy = DataPathPolicy::Create({base_ + "/data"});
    EXPECT_OK(policy);
    return *policy;
  }

  std::string base_;
};

TEST_F(DataPathPolicyTest, PathsUnderARootAreAllowedMissingOnesToo) {
  DataPathPolicy policy = Policy();
  EXPECT_OK(policy.Check(base_ + "/data"));
  EXPECT_OK(policy.Check(base_ + "/data/fmnist"));
  EXPECT_OK(policy.Check(base_ + "/data/fmnist/./train.idx"));
  EXPECT_OK(policy.Check(base_ + "/data/not-there-yet"));  // The reader reports it.
}

TEST_F(DataPathPolicyTest, DotDotAndPrefixTricksAreRefused) {
  DataPathPolicy policy = Policy();
  EXPECT_EQ(policy.Check(base_ + "/data/../outside/secret.txt").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(policy.Check(base_ + "/data/fmnist/../../outside").code(),
            absl::StatusCode::kPermissionDenied);
  // "/x/data-evil" starts with "/x/data" but is not below it.
  EXPECT_EQ(policy.Check(base_ + "/data-evil").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(policy.Check("/etc/passwd").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(policy.Check("").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(policy.Check("relative/path").code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(DataPathPolicyTest, ASymlinkOutOfARootIsRefused) {
  fs::create_directory_symlink(base_ + "/outside", base_ + "/data/escape");
  DataPathPolicy policy = Policy();
  EXPECT_EQ(policy.Check(base_ + "/data/escape").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(policy.Check(base_ + "/data/escape/secret.txt").code(),
            absl::StatusCode::kPermissionDenied);
  // A symlink that points into a root is fine.
  fs::create_directory_symlink(base_ + "/data/fmnist", base_ + "/outside/link-in");
  EXPECT_OK(policy.Check(base_ + "/outside/link-in"));
}

TEST_F(DataPathPolicyTest, TheMessageNamesTheRuleNotTheFileOrWhetherItExists) {
  DataPathPolicy policy = Policy();
  const absl::Status existing = policy.Check(base_ + "/outside/secret.txt");
  const absl::Status missing = policy.Check(base_ + "/outside/no-such-file");
  EXPECT_EQ(existing, missing);  // No existence oracle.
  EXPECT_THAT(existing.message(), HasSubstr("--data-root allow-list"));
  EXPECT_THAT(existing.message(), HasSubstr(fs::canonical(base_ + "/data").string()));
  EXPECT_THAT(existing.message(), Not(HasSubstr("secret")));
}

TEST_F(DataPathPolicyTest, RootsMustBeDirectoriesAndNoRootsAllowNothing) {
  EXPECT_EQ(DataPathPolicy::Create({base_ + "/nope"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DataPathPolicy::Create({base_ + "/outside/secret.txt"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<DataPathPolicy> none = DataPathPolicy::Create({});
  ASSERT_OK(none);
  EXPECT_THAT(none->Check(base_ + "/data").message(), HasSubstr("--data-root DIR"));
  absl::StatusOr<DataPathPolicy> all = DataPathPolicy::Create({"/"});
  ASSERT_OK(all);
  EXPECT_OK(all->Check("/etc/passwd"));
}

TEST_F(DataPathPolicyTest, BucketRootsAllowTheirPrefixByWholeSegments) {
  ASSERT_OK_AND_ASSIGN(DataPathPolicy policy,
                       DataPathPolicy::Create({base_ + "/data", "s3://train-data/fmnist/"}));
  EXPECT_OK(policy.Check("s3://train-data/fmnist"));
  EXPECT_OK(policy.Check("s3://train-data/fmnist/"));
  EXPECT_OK(policy.Check("s3://train-data/fmnist/packed/train-00000-of-00001.pspack"));
  EXPECT_OK(policy.Check(base_ + "/data/fmnist"));
  // Another prefix that starts with the same letters, another bucket, the
  // bucket's root: all outside.
  EXPECT_THAT(policy.Check("s3://train-data/fmnist-private/x"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("allow-list")));
  EXPECT_THAT(policy.Check("s3://train-data2/fmnist/x"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("allow-list")));
  EXPECT_THAT(policy.Check("s3://train-data"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("allow-list")));
  // ".." cannot climb out of the prefix: such keys are refused outright.
  EXPECT_THAT(policy.Check("s3://train-data/fmnist/../secrets/key"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("segments")));
  // The local root "/" does not open buckets.
  ASSERT_OK_AND_ASSIGN(DataPathPolicy all, DataPathPolicy::Create({"/"}));
  EXPECT_THAT(all.Check("s3://train-data/fmnist"),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("allow-list")));
  // A whole bucket.
  ASSERT_OK_AND_ASSIGN(DataPathPolicy bucket, DataPathPolicy::Create({"s3://train-data"}));
  EXPECT_OK(bucket.Check("s3://train-data/anything/below"));
  EXPECT_THAT(DataPathPolicy::Create({"s3://Bad_Bucket"}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bucket name")));
}

}  // namespace
}  // namespace pstrain::data
