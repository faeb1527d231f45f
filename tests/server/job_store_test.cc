// Tests for server/job_store.{h,cc}: statuses and the worker id counter
// round-trip through the state directory; corrupt files are DATA_LOSS.
#include "server/job_store.h"

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

class JobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/job_store_test_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(JobStoreTest, StatusesComeBackInJobNumberOrder) {
  JobStore store(dir_);
  for (const char* id : {"job-10", "job-2", "job-1"}) {
    v1::JobStatus status;
    status.set_job_id(id);
    status.set_runs(3);
    ASSERT_OK(store.SaveJob(status));
  }
  fs::create_directories(dir_ + "/jobs/not-a-job");
  ASSERT_OK_AND_ASSIGN(std::vector<v1::JobStatus> jobs, store.LoadJobs());
  ASSERT_EQ(jobs.size(), 3u);
  EXPECT_EQ(jobs[0].job_id(), "job-1");
  EXPECT_EQ(jobs[1].job_id(), "job-2");
  EXPECT_EQ(jobs[2].job_id(), "job-10");
  EXPECT_EQ(jobs[2].runs(), 3);
}

TEST_F(JobStoreTest, ACorruptStatusIsDataLossNamingTheFile) {
  JobStore store(dir_);
  v1::JobStatus status;
  status.set_job_id("job-1");
  ASSERT_OK(store.SaveJob(status));
  status.set_job_id("job-2");
  ASSERT_OK(store.SaveJob(status));
  // job-2's file claims to be job-1.
  fs::copy_file(dir_ + "/jobs/job-1/status.pb", dir_ + "/jobs/job-2/status.pb",
                fs::copy_options::overwrite_existing);
  EXPECT_THAT(store.LoadJobs().status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("job-2/status.pb")));
}

TEST_F(JobStoreTest, TheWorkerIdCounterRoundTrips) {
  JobStore store(dir_);
  ASSERT_OK_AND_ASSIGN(int64_t next, store.LoadNextWorkerId());
  EXPECT_EQ(next, 1);
  ASSERT_OK(store.SaveNextWorkerId(42));
  ASSERT_OK_AND_ASSIGN(next, JobStore(dir_).LoadNextWorkerId());
  EXPECT_EQ(next, 42);
  std::ofstream(dir_ + "/next_worker_id") << "-3";
  EXPECT_THAT(store.LoadNextWorkerId().status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("next_worker_id")));
}

TEST_F(JobStoreTest, WithoutAStateDirectoryNothingIsStored) {
  JobStore store("");
  v1::JobStatus status;
  status.set_job_id("job-1");
  EXPECT_OK(store.SaveJob(status));
  ASSERT_OK_AND_ASSIGN(std::vector<v1::JobStatus> jobs, store.LoadJobs());
  EXPECT_TRUE(jobs.empty());
}

}  // namespace
}  // namespace pstrain
