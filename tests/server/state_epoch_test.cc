#include "server/state_epoch.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

class StateEpochTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/state_epoch_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(StateEpochTest, IsMadeOnceAndKept) {
  ASSERT_OK_AND_ASSIGN(const std::string first, LoadOrCreateStateEpoch(dir_));
  EXPECT_EQ(first.size(), 32u);
  EXPECT_EQ(first.find_first_not_of("0123456789abcdef"), std::string::npos) << first;
  ASSERT_OK_AND_ASSIGN(const std::string again, LoadOrCreateStateEpoch(dir_));
  EXPECT_EQ(again, first);
  EXPECT_TRUE(fs::exists(dir_ + "/state_epoch"));
}

TEST_F(StateEpochTest, AnotherStateDirectoryGetsAnotherEpoch) {
  const std::string other = dir_ + "/other";
  fs::create_directories(other);
  ASSERT_OK_AND_ASSIGN(const std::string a, LoadOrCreateStateEpoch(dir_));
  ASSERT_OK_AND_ASSIGN(const std::string b, LoadOrCreateStateEpoch(other));
  EXPECT_NE(a, b);
}

TEST_F(StateEpochTest, AnEditedFileIsDataLossNamingIt) {
  std::ofstream(dir_ + "/state_epoch") << "not an epoch\n";
  EXPECT_THAT(LoadOrCreateStateEpoch(dir_),
              StatusIs(absl::StatusCode::kDataLoss,
                       ::testing::AllOf(HasSubstr(dir_ + "/state_epoch"),
                                        HasSubstr("does not hold a state epoch"))));
}

TEST_F(StateEpochTest, AMissingDirectoryIsAnError) {
  EXPECT_FALSE(LoadOrCreateStateEpoch(dir_ + "/missing").ok());
}

}  // namespace
}  // namespace pstrain
