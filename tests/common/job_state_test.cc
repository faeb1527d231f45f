// Tests for common/job_state.{h,cc}: a job state's name and terminality.
#include "common/job_state.h"

#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(JobStateTest, NamesDropThePrefix) {
  EXPECT_EQ(JobStateName(v1::JOB_STATE_QUEUED), "QUEUED");
  EXPECT_EQ(JobStateName(v1::JOB_STATE_RUNNING), "RUNNING");
  EXPECT_EQ(JobStateName(v1::JOB_STATE_CANCELLED), "CANCELLED");
  EXPECT_EQ(JobStateName(v1::JOB_STATE_UNSPECIFIED), "UNSPECIFIED");
  EXPECT_EQ(JobStateName(static_cast<v1::JobState>(42)), "UNKNOWN");
}

TEST(JobStateTest, OnlySucceededFailedAndCancelledAreTerminal) {
  EXPECT_TRUE(IsTerminal(v1::JOB_STATE_SUCCEEDED));
  EXPECT_TRUE(IsTerminal(v1::JOB_STATE_FAILED));
  EXPECT_TRUE(IsTerminal(v1::JOB_STATE_CANCELLED));
  EXPECT_FALSE(IsTerminal(v1::JOB_STATE_QUEUED));
  EXPECT_FALSE(IsTerminal(v1::JOB_STATE_RUNNING));
  EXPECT_FALSE(IsTerminal(v1::JOB_STATE_UNSPECIFIED));
}

}  // namespace
}  // namespace pstrain
