// Tests for server/job_record.{h,cc}: a job's state changes across its runs
// (reserve, launch, lose members, back to the queue, end), its restore, and
// which checkpoint is due.
#include "server/job_record.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/shard_fixtures.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

JobRecord Queued(int workers = 2) {
  v1::JobSpec spec = ::pstrain::testing::DenseJob("rec", 8, 3, 7, v1::CONSISTENCY_SYNC);
  spec.set_workers(workers);
  spec.set_epochs(3);
  ModelGraph graph = *BuildModelGraph(spec.model());
  return JobRecord("job-4", spec, graph, kStart);
}

TEST(JobRecordTest, AJobRunsAsNewRunsWithRisingGenerations) {
  JobRecord job = Queued();
  EXPECT_EQ(job.status.state(), v1::JOB_STATE_QUEUED);
  EXPECT_TRUE(job.SetQueueReason(1));
  EXPECT_EQ(job.status.reason(), "waiting for 2 idle workers, 1 available");
  EXPECT_FALSE(job.SetQueueReason(1));

  RunReservation first = job.Reserve({"worker-1", "worker-2"}, kStart);
  EXPECT_EQ(job.phase, JobPhase::kStarting);
  EXPECT_EQ(first.generation, 1);
  EXPECT_FALSE(first.resume);
  job.Launch(first, {}, "job-4.1.x", kStart);
  EXPECT_TRUE(job.running());
  EXPECT_EQ(job.status.runs(), 1);
  EXPECT_EQ(job.status.reason(), "training on 2 workers");

  EXPECT_TRUE(job.LoseMember("worker-2"));
  EXPECT_EQ(job.status.workers_lost(), 1);
  EXPECT_TRUE(job.running());
  EXPECT_TRUE(job.LoseMember("worker-1"));
  EXPECT_EQ(job.phase, JobPhase::kQueued);  // Nobody left.

  job.status.set_step(40);  // Trained, then lost without a checkpoint.
  RunReservation second = job.Reserve({"worker-3", "worker-4"}, kStart);
  EXPECT_EQ(second.generation, 4);  // After the run's two removals.
  job.Launch(second, {}, "job-4.2.x", kStart);
  EXPECT_EQ(job.status.runs(), 2);
  EXPECT_EQ(job.status.steps_lost(), 40);
  EXPECT_THAT(job.status.reason(), HasSubstr("started again from the beginning"));
  EXPECT_THAT(job.BackToQueue(), ElementsAre("worker-3", "worker-4"));
  EXPECT_EQ(job.status.state(), v1::JOB_STATE_QUEUED);
}

TEST(JobRecordTest, CheckpointsComeAfterAnEpochAnIntervalAndTheEvaluation) {
  JobRecord job = Queued(1);
  job.Launch(job.Reserve({"worker-1"}, kStart), {}, "r", kStart);
  const absl::Duration interval = absl::Seconds(60);
  EXPECT_EQ(job.CheckpointDue(interval, kStart + absl::Seconds(1)), std::nullopt);
  EXPECT_EQ(job.CheckpointDue(interval, kStart + absl::Seconds(61)), CheckpointWork::kInterval);
  job.status.set_epoch(1);
  EXPECT_EQ(job.CheckpointDue(interval, kStart), CheckpointWork::kEpoch);
  const CheckpointWork work = job.CheckpointOf(CheckpointWork::kEpoch);
  EXPECT_EQ(work.job_id, "job-4");
  EXPECT_EQ(work.position.epoch, 1);
  job.CheckpointWritten(work, absl::OkStatus(), /*kept=*/true, kStart);
  EXPECT_TRUE(job.has_checkpoint);
  EXPECT_EQ(job.CheckpointDue(interval, kStart), std::nullopt);

  v1::ReportProgressRequest done;
  done.set_worker_id("worker-1");
  done.set_finished(true);
  job.RecordProgress(*job.run->FindMember("worker-1"), done, 100, kStart);
  EXPECT_EQ(job.CheckpointDue(interval, kStart), CheckpointWork::kFinal);
  EXPECT_EQ(job.phase, JobPhase::kFinalizing);
  EXPECT_THAT(job.End(v1::JOB_STATE_SUCCEEDED, "done", kStart), ElementsAre("worker-1"));
  EXPECT_EQ(job.CheckpointDue(interval, kStart), std::nullopt);
  job.save_on_stop = true;
  EXPECT_EQ(job.CheckpointDue(interval, kStart), CheckpointWork::kStop);
}

TEST(JobRecordTest, ReportsOfAnEndedJobOrAReplacedRunAreAnsweredWithoutBeingRecorded) {
  JobRecord job = Queued(1);
  job.Launch(job.Reserve({"worker-1"}, kStart), {}, "r", kStart);
  RunMember* member = job.run->FindMember("worker-1");
  v1::ReportProgressRequest report;
  report.set_run_id("r");
  EXPECT_EQ(job.AnswerWithoutRecording(report, member), std::nullopt);
  EXPECT_EQ(job.AnswerWithoutRecording(report, nullptr), true);
  report.set_run_id("old");
  EXPECT_EQ(job.AnswerWithoutRecording(report, member), true);
  job.End(v1::JOB_STATE_SUCCEEDED, "done", kStart);
  EXPECT_EQ(job.AnswerWithoutRecording(report, member), false);
}

TEST(JobRecordTest, ARestoredJobQueuesAgainOrFailsWhenItNoLongerValidates) {
  v1::JobStatus running = Queued().status;
  running.set_state(v1::JOB_STATE_RUNNING);
  running.set_epoch(2);
  JobRecord resumed(running, BuildModelGraph(running.spec().model()), true, kStart);
  EXPECT_EQ(resumed.phase, JobPhase::kQueued);
  EXPECT_THAT(resumed.status.reason(), HasSubstr("resumes from the checkpoint of epoch 2"));
  EXPECT_GT(resumed.revision, resumed.persisted_revision);  // Saved again.

  JobRecord invalid(running, absl::InvalidArgumentError("too big"), false, kStart);
  EXPECT_EQ(invalid.status.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(invalid.status.reason(), HasSubstr("too big"));

  v1::JobStatus ended = running;
  ended.set_state(v1::JOB_STATE_CANCELLED);
  JobRecord listed(ended, BuildModelGraph(ended.spec().model()), false, kStart);
  EXPECT_EQ(listed.phase, JobPhase::kDone);
  EXPECT_EQ(listed.revision, listed.persisted_revision);  // Nothing to save.
  EXPECT_THAT(listed.status.workers(), IsEmpty());
}

}  // namespace
}  // namespace pstrain
