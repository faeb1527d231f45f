#include "common/storage/storage.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::storage {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::Field;
using ::testing::HasSubstr;

TEST(S3UriTest, ParsesBucketAndKey) {
  ASSERT_OK_AND_ASSIGN(S3Uri a, ParseS3Uri("s3://train-data/fmnist/train-00000-of-00001.pspack"));
  EXPECT_EQ(a.bucket, "train-data");
  EXPECT_EQ(a.key, "fmnist/train-00000-of-00001.pspack");
  ASSERT_OK_AND_ASSIGN(S3Uri b, ParseS3Uri("s3://train-data"));
  EXPECT_EQ(b.key, "");
  ASSERT_OK_AND_ASSIGN(S3Uri c, ParseS3Uri("s3://train-data/dir/"));
  EXPECT_EQ(c.key, "dir/");
  EXPECT_TRUE(IsS3Uri("s3://x"));
  EXPECT_FALSE(IsS3Uri("/data/s3://x"));
}

TEST(S3UriTest, RefusesWhatStoresReadDifferently) {
  for (const char* bad : {"s3://", "s3://ab", "s3://Upper", "s3://under_score/k", "s3://-dash/k",
                          "/local/path"}) {
    EXPECT_THAT(ParseS3Uri(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")))
        << bad;
  }
  for (const char* bad : {"s3://bucket/a/../b", "s3://bucket/./a", "s3://bucket/a//b",
                          "s3://bucket/a\nb"}) {
    EXPECT_EQ(ParseS3Uri(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseS3Uri(absl::StrCat("s3://bucket/", std::string(1100, 'k'))).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(JoinUriTest, OneSeparator) {
  EXPECT_EQ(JoinUri("s3://b/p", "x"), "s3://b/p/x");
  EXPECT_EQ(JoinUri("s3://b/p/", "x"), "s3://b/p/x");
  EXPECT_EQ(JoinUri("/data", "x"), "/data/x");
}

class LocalStorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/storage_test_", getpid());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(LocalStorageTest, WriteReadListDelete) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> store, OpenStorage({}));
  ASSERT_OK(store->Write(dir_ + "/sub/b.bin", "0123456789"));
  ASSERT_OK(store->Write("file://" + dir_ + "/sub/a.bin", "xy"));
  ASSERT_OK_AND_ASSIGN(std::string all, store->Read(dir_ + "/sub/b.bin"));
  EXPECT_EQ(all, "0123456789");
  ASSERT_OK_AND_ASSIGN(std::string part, store->ReadRange(dir_ + "/sub/b.bin", 3, 4));
  EXPECT_EQ(part, "3456");
  EXPECT_EQ(store->ReadRange(dir_ + "/sub/b.bin", 8, 4).status().code(),
            absl::StatusCode::kOutOfRange);
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, store->Stat(dir_ + "/sub/b.bin"));
  EXPECT_EQ(info.size, 10);
  ASSERT_OK_AND_ASSIGN(std::vector<ObjectInfo> listed, store->List(dir_ + "/sub"));
  EXPECT_THAT(listed, ElementsAre(Field(&ObjectInfo::key, "a.bin"), Field(&ObjectInfo::key, "b.bin")));
  ASSERT_OK(store->Write(dir_ + "/sub/deeper/c.bin", "z"));
  ASSERT_OK_AND_ASSIGN(std::vector<ObjectInfo> below, store->ListRecursive(dir_));
  EXPECT_THAT(below, ElementsAre(Field(&ObjectInfo::key, "sub/a.bin"),
                               Field(&ObjectInfo::key, "sub/b.bin"),
                               Field(&ObjectInfo::key, "sub/deeper/c.bin")));
  ASSERT_OK(store->Delete(dir_ + "/sub/a.bin"));
  ASSERT_OK(store->Delete(dir_ + "/sub/a.bin"));  // Already gone: fine.
  EXPECT_EQ(store->Read(dir_ + "/sub/a.bin").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->List(dir_ + "/none").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LocalStorageTest, S3WithoutSettingsAndOtherSchemesSaySo) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> store, OpenStorage({}));
  EXPECT_THAT(store->Read("s3://bucket/key").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("without S3 settings")));
  EXPECT_THAT(store->Read("hdfs://nn/x").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"hdfs://\"")));
}

TEST(S3ClientTest, AnUnreachableStoreIsRetriedThenUnavailableNamingTheObject) {
  StorageOptions options;
  S3ClientOptions& s3 = options.s3.emplace();
  s3.endpoint.endpoint = "http://127.0.0.1:1";  // Nothing listens on port 1.
  s3.endpoint.path_style = true;
  s3.credentials.access_key_id = "AKIDEXAMPLE";
  s3.credentials.secret_access_key = "do-not-print-me";
  s3.max_attempts = 3;
  s3.backoff_initial = absl::Milliseconds(1);
  s3.backoff_max = absl::Milliseconds(5);
  int retries_logged = 0;
  s3.log = [&](const std::string& line) {
    ++retries_logged;
    EXPECT_THAT(line, ::testing::Not(HasSubstr("do-not-print-me")));
  };
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> store, OpenStorage(options));
  absl::Status status = store->Read("s3://some-bucket/data/x.pspack").status();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable,
                               HasSubstr("S3 HEAD s3://some-bucket/data/x.pspack")));
  EXPECT_THAT(status.message(), HasSubstr("3 attempts"));
  EXPECT_THAT(status.message(), ::testing::Not(HasSubstr("do-not-print-me")));
  EXPECT_EQ(retries_logged, 2);
}

}  // namespace
}  // namespace pstrain::storage
