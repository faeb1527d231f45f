// Tests for server/job_registry.{h,cc}: ids, look-ups, what is unsaved, and
// the load of a state directory.
#include "server/job_registry.h"

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/shard_fixtures.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

v1::JobSpec Spec() {
  v1::JobSpec spec = ::pstrain::testing::DenseJob("reg", 8, 3, 7, v1::CONSISTENCY_SYNC);
  spec.set_workers(1);
  return spec;
}

TEST(JobRegistryTest, JobsGetRisingIdsAndUnknownOnesAreNotFound) {
  JobRegistry jobs;
  const ModelGraph graph = *BuildModelGraph(Spec().model());
  EXPECT_EQ(jobs.Add(Spec(), graph, kStart).status.job_id(), "job-1");
  EXPECT_EQ(jobs.Add(Spec(), graph, kStart).status.job_id(), "job-2");
  EXPECT_EQ(jobs.CountIn(JobPhase::kQueued), 2);
  ASSERT_OK_AND_ASSIGN(JobRecord * found, jobs.Get("job-2"));
  EXPECT_EQ(found, jobs.jobs()[1]);
  EXPECT_THAT(jobs.Get("job-9"), StatusIs(absl::StatusCode::kNotFound, HasSubstr("job-9")));
  EXPECT_EQ(jobs.WhyStray("job-9"), "a job this server does not know");
  EXPECT_EQ(jobs.WhyStray("job-1"), "");
}

TEST(JobRegistryTest, WhatChangedIsUnsavedUntilItIsSaved) {
  JobRegistry jobs;
  JobRecord& job = jobs.Add(Spec(), *BuildModelGraph(Spec().model()), kStart);
  JobRegistry::Unsaved unsaved = jobs.Changed();
  ASSERT_EQ(unsaved.statuses.size(), 1u);
  jobs.StatusSaved("job-1", unsaved.statuses[0].second);
  EXPECT_EQ(jobs.Changed().statuses.size(), 0u);
  job.Touch();
  EXPECT_EQ(jobs.Changed().statuses.size(), 1u);
}

TEST(JobRegistryTest, LoadRequeuesARunningJobAndListsAnEndedOne) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "job_registry_test_load");
  std::filesystem::remove_all(dir);
  const JobStore store(dir);
  v1::JobStatus running;
  running.set_job_id("job-3");
  running.set_state(v1::JOB_STATE_RUNNING);
  *running.mutable_spec() = Spec();
  running.mutable_spec()->clear_mode();  // Saved before the defaults set it.
  v1::JobStatus ended = running;
  ended.set_job_id("job-7");
  ended.set_state(v1::JOB_STATE_SUCCEEDED);
  ASSERT_OK(store.SaveJob(running));
  ASSERT_OK(store.SaveJob(ended));
  const Checkpointer checkpoints(
      {.state_dir = dir, .keep = 1, .log = nullptr, .remote_dir = "", .store = nullptr});

  JobRegistry jobs;
  std::vector<std::string> lines;
  ASSERT_OK(jobs.Load(
      store, checkpoints, [](const v1::JobSpec& spec) { return BuildModelGraph(spec.model()); },
      kStart, [&](const std::string& line) { lines.push_back(line); }));
  ASSERT_OK_AND_ASSIGN(JobRecord * requeued, jobs.Get("job-3"));
  EXPECT_EQ(requeued->phase, JobPhase::kQueued);
  EXPECT_EQ(requeued->status.spec().mode(), v1::CONSISTENCY_SYNC);
  ASSERT_OK_AND_ASSIGN(JobRecord * listed, jobs.Get("job-7"));
  EXPECT_EQ(listed->phase, JobPhase::kDone);
  EXPECT_THAT(lines, ElementsAre(HasSubstr("job-3: re-queued after a restart (from scratch)")));
  EXPECT_EQ(jobs.Add(Spec(), *BuildModelGraph(Spec().model()), kStart).status.job_id(), "job-8");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pstrain
