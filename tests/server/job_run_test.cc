// Tests for server/job_run.{h,cc}: one run of a job (members, generation,
// the epoch-plan broker, stragglers, aggregates, history) and the checkpoint
// codec, whose encode and decode are inverses.
#include "server/job_run.h"

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/model_graph.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/shard_fixtures.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

v1::JobSpec Spec(v1::ConsistencyMode mode, int epochs = 3, int batch_size = 4) {
  v1::JobSpec spec = ::pstrain::testing::DenseJob("run", 8, 3, 7, mode);
  spec.set_epochs(epochs);
  spec.set_batch_size(batch_size);
  return spec;
}

v1::ReportProgressRequest Progress(const std::string& worker, int epoch, int64_t step,
                                   double loss) {
  v1::ReportProgressRequest r;
  r.set_worker_id(worker);
  r.set_epoch(epoch);
  r.set_step(step);
  r.set_loss(loss);
  r.set_train_accuracy(0.5);
  r.set_samples_per_sec(100);
  return r;
}

TEST(JobRunTest, AReservedRunRanksItsMembersAndLaunchesFromItsStart) {
  JobRun run(Spec(v1::CONSISTENCY_SYNC), {"worker-1", "worker-2"}, 4, kStart);
  EXPECT_FALSE(run.launched());
  EXPECT_EQ(run.run_id(), "");
  ASSERT_EQ(run.members().size(), 2u);
  EXPECT_EQ(run.members()[1].worker_id, "worker-2");
  EXPECT_EQ(run.members()[1].rank, 1);
  EXPECT_EQ(run.generation(), 4);

  run.Launch("job-1.2.abc", {.epoch = 1, .step = 20}, kStart + absl::Seconds(3));
  EXPECT_TRUE(run.launched());
  EXPECT_EQ(run.run_id(), "job-1.2.abc");
  EXPECT_EQ(run.start().epoch, 1);
  EXPECT_EQ(run.start().step, 20);
  EXPECT_EQ(run.last_checkpoint_epoch(), 1);
  EXPECT_EQ(run.last_checkpoint_time(), kStart + absl::Seconds(3));

  // Before any report the job stands where the run started.
  v1::JobStatus status;
  run.Aggregate(&status);
  EXPECT_EQ(status.epoch(), 1);
  EXPECT_EQ(status.step(), 20);
  EXPECT_THAT(status.workers(), ElementsAre("worker-1", "worker-2"));
}

TEST(JobRunTest, AggregatesAreTheSlowestPositionAndTheMeanFigures) {
  JobRun run(Spec(v1::CONSISTENCY_SYNC, /*epochs=*/3), {"worker-1", "worker-2"}, 1, kStart);
  run.Launch("r", {}, kStart);
  v1::ReportProgressRequest a = Progress("worker-1", 2, 200, 1.0);
  a.set_steps_per_epoch(100);
  run.RecordProgress(*run.FindMember("worker-1"), a, 3);
  run.RecordProgress(*run.FindMember("worker-2"), Progress("worker-2", 1, 150, 3.0), 3);
  v1::JobStatus status;
  run.Aggregate(&status);
  EXPECT_EQ(status.epoch(), 1);
  EXPECT_EQ(status.step(), 150);
  EXPECT_DOUBLE_EQ(status.loss(), 2.0);
  EXPECT_DOUBLE_EQ(status.samples_per_sec(), 200);
  EXPECT_EQ(status.total_steps(), 300);  // epochs x the reported steps per epoch.
  EXPECT_EQ(run.StepsPerEpoch(), 100);
}

TEST(JobRunTest, RemovingAMemberClosesTheRanksAndHoldsPlansUntilTheShardsCountedIt) {
  JobRun run(Spec(v1::CONSISTENCY_SYNC), {"worker-1", "worker-2", "worker-3"}, 1, kStart);
  run.Launch("r", {}, kStart);
  EXPECT_FALSE(run.TakeMembershipChange().has_value());
  EXPECT_FALSE(run.RemoveMember("worker-9"));
  ASSERT_TRUE(run.RemoveMember("worker-2"));
  EXPECT_EQ(run.generation(), 2);
  EXPECT_EQ(run.FindMember("worker-3")->rank, 1);

  v1::EpochPlanRequest request;
  request.set_run_id("r");
  request.set_worker_id("worker-1");
  request.set_job_id("job-1");
  request.set_batch_size(4);
  request.set_epoch_length(96);
  EXPECT_OK(run.CheckPlanRequest(request));
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse waiting, run.Plan(request));
  EXPECT_TRUE(waiting.wait());

  std::optional<MembershipChange> change = run.TakeMembershipChange();
  ASSERT_TRUE(change.has_value());
  EXPECT_THAT(change->members, ElementsAre("worker-1", "worker-3"));
  EXPECT_THAT(change->lost, ElementsAre("worker-2"));
  EXPECT_EQ(change->generation, 2);
  EXPECT_FALSE(run.TakeMembershipChange().has_value());  // Once.
  run.MembersLost(*change, {{"worker-2", 0}});
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse plan, run.Plan(request));
  EXPECT_FALSE(plan.wait());
}

TEST(JobRunTest, PlanRequestsOfAnotherRunOrANonMemberAreRefused) {
  JobRun run(Spec(v1::CONSISTENCY_SYNC), {"worker-1"}, 1, kStart);
  run.Launch("r", {}, kStart);
  v1::EpochPlanRequest request;
  request.set_run_id("old");
  request.set_worker_id("worker-1");
  request.set_batch_size(4);
  EXPECT_THAT(run.CheckPlanRequest(request),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("old")));
  request.set_run_id("r");
  request.set_worker_id("worker-7");
  EXPECT_THAT(run.CheckPlanRequest(request),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("worker-7")));
  request.set_worker_id("worker-1");
  request.set_batch_size(8);
  EXPECT_THAT(run.CheckPlanRequest(request),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("batch size 8")));
}

TEST(JobRunTest, ASyncRunDropsAStragglerPastTheTimeoutAndListsTheSilent) {
  const StragglerPolicy policy{.report_after = absl::Seconds(5), .timeout = absl::Seconds(60)};
  for (v1::ConsistencyMode mode : {v1::CONSISTENCY_SYNC, v1::CONSISTENCY_ASYNC}) {
    JobRun run(Spec(mode), {"worker-1", "worker-2", "worker-3"}, 1, kStart);
    run.Launch("r", {}, kStart);
    run.RecordRunSteps(*run.FindMember("worker-1"), 50, kStart + absl::Seconds(61));
    run.RecordRunSteps(*run.FindMember("worker-3"), 50, kStart + absl::Seconds(61));
    const StragglerScan scan = run.FindStragglers(kStart + absl::Seconds(62), policy, {"worker-3"});
    if (mode == v1::CONSISTENCY_SYNC) {
      ASSERT_EQ(scan.to_drop.size(), 1u);
      EXPECT_EQ(scan.to_drop[0].worker_id, "worker-2");
      EXPECT_EQ(scan.to_drop[0].run_steps, 0);
      EXPECT_EQ(scan.to_drop[0].lead, 50);
      EXPECT_EQ(scan.to_drop[0].stalled, absl::Seconds(62));
      EXPECT_THAT(scan.listed, ElementsAre("worker-3"));
    } else {
      EXPECT_THAT(scan.to_drop, IsEmpty());  // Only sync drops.
      EXPECT_THAT(scan.listed, ElementsAre("worker-2", "worker-3"));
    }
  }
}

TEST(JobRunTest, AFinishedMemberTakesEveryEpochAndItsTestShard) {
  JobRun run(Spec(v1::CONSISTENCY_SYNC, /*epochs=*/2), {"worker-1", "worker-2"}, 1, kStart);
  run.Launch("r", {}, kStart);
  v1::ReportProgressRequest done = Progress("worker-1", 0, 40, 0);
  done.set_finished(true);
  done.mutable_eval_shard()->set_samples(30);
  run.RecordProgress(*run.FindMember("worker-1"), done, 2);
  const RunMember& m = *run.FindMember("worker-1");
  EXPECT_TRUE(m.finished);
  EXPECT_EQ(m.epoch, 2);
  EXPECT_EQ(m.step, 40);
  EXPECT_FALSE(run.AllFinished());
  EXPECT_EQ(run.TestSamplesClaimedByOthers("worker-2"), 30);
  EXPECT_EQ(run.TestSamplesClaimedByOthers("worker-1"), 0);
  EXPECT_FALSE(run.RemoveMember("worker-1"));  // A finished member stays.
  EXPECT_THAT(run.ReleaseMembers(), ElementsAre("worker-1", "worker-2"));
  EXPECT_THAT(run.members(), IsEmpty());
}

TEST(JobRunTest, HistoryKeepsAGapAndThinsPastItsLimit) {
  JobRun run(Spec(v1::CONSISTENCY_SYNC), {"worker-1"}, 1, kStart);
  run.Launch("r", {}, kStart);
  v1::JobStatus status;
  v1::JobHistory history;
  EXPECT_FALSE(run.RecordHistory(status, 4, kStart, &history));  // Nobody reported yet.
  run.RecordProgress(*run.FindMember("worker-1"), Progress("worker-1", 0, 1, 1.0), 3);
  for (int64_t step = 1; step <= 5; ++step) {
    status.set_step(step);
    EXPECT_TRUE(run.RecordHistory(status, 4, kStart, &history)) << step;
  }
  // Five points over the limit of four: every other one went, the gap doubled.
  ASSERT_EQ(history.points_size(), 3);
  EXPECT_EQ(history.points(0).step(), 1);
  EXPECT_EQ(history.points(2).step(), 5);
  EXPECT_EQ(history.min_step_gap(), 2);
  status.set_step(6);
  EXPECT_FALSE(run.RecordHistory(status, 4, kStart, &history));
  EXPECT_TRUE(DropHistoryAfter(2, &history));
  EXPECT_EQ(history.points_size(), 1);
  EXPECT_FALSE(DropHistoryAfter(2, &history));
}

// --- Checkpoint codec ---------------------------------------------------------

CheckpointContents Contents(const ModelGraph& graph) {
  CheckpointContents c;
  float next = 0.25f;
  for (const ParamInfo& p : graph.params) {
    std::vector<float> values(static_cast<size_t>(p.shape.num_elements()));
    for (float& v : values) v = (next += 0.5f);
    c.optimizer_state[p.name + "/momentum"] = std::vector<float>(values.size(), -next);
    c.params.push_back(std::move(values));
  }
  c.chunk_versions = {7, 9, 8};
  c.position = {.epoch = 2, .step = 345};
  return c;
}

TEST(JobRunTest, DecodeCheckpointInvertsEncodeCheckpoint) {
  const v1::JobSpec spec = Spec(v1::CONSISTENCY_ASYNC);
  ASSERT_OK_AND_ASSIGN(const ModelGraph graph, BuildModelGraph(spec.model()));
  const CheckpointContents in = Contents(graph);
  const v1::Checkpoint ckpt = EncodeCheckpoint(spec, graph, in, kStart);
  EXPECT_EQ(ckpt.job().name(), spec.name());
  EXPECT_EQ(ckpt.created_unix_ms(), absl::ToUnixMillis(kStart));

  ASSERT_OK_AND_ASSIGN(const CheckpointContents out, DecodeCheckpoint(ckpt, graph));
  EXPECT_EQ(out.params, in.params);
  EXPECT_EQ(out.optimizer_state, in.optimizer_state);
  EXPECT_EQ(out.chunk_versions, in.chunk_versions);
  EXPECT_EQ(out.position.epoch, 2);
  EXPECT_EQ(out.position.step, 345);
  // And back: the same bytes.
  EXPECT_EQ(EncodeCheckpoint(spec, graph, out, kStart).SerializeAsString(),
            ckpt.SerializeAsString());
}

TEST(JobRunTest, DecodeCheckpointNamesAMissingParameter) {
  const v1::JobSpec spec = Spec(v1::CONSISTENCY_SYNC);
  ASSERT_OK_AND_ASSIGN(const ModelGraph graph, BuildModelGraph(spec.model()));
  v1::Checkpoint ckpt = EncodeCheckpoint(spec, graph, Contents(graph), kStart);
  ckpt.mutable_parameters()->RemoveLast();
  EXPECT_THAT(DecodeCheckpoint(ckpt, graph),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(graph.params.back().name)));
}

TEST(JobRunTest, AResumedLaunchGoesOnFromTheCheckpointsVersionsByMode) {
  const v1::JobSpec spec = Spec(v1::CONSISTENCY_SYNC);
  ASSERT_OK_AND_ASSIGN(const ModelGraph graph, BuildModelGraph(spec.model()));
  JobLaunch sync, ssp, average;
  ResumeLaunchFrom(Contents(graph), v1::CONSISTENCY_SYNC, &sync);
  EXPECT_EQ(sync.initial_version, 345);  // The cut's global step.
  EXPECT_THAT(sync.chunk_versions, IsEmpty());
  EXPECT_EQ(sync.params, Contents(graph).params);
  ResumeLaunchFrom(Contents(graph), v1::CONSISTENCY_SSP, &ssp);
  EXPECT_THAT(ssp.chunk_versions, ElementsAre(7, 9, 8));
  EXPECT_EQ(ssp.initial_version, 9);  // The newest, for a plan of another size.
  ResumeLaunchFrom(Contents(graph), v1::CONSISTENCY_AVERAGE, &average);
  EXPECT_EQ(average.initial_version, 0);  // Average mode counts rounds afresh.
}

}  // namespace
}  // namespace pstrain
