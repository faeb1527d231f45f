#include "server/epoch_planner.h"

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/data/epoch_work.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;

constexpr int64_t kLength = 60000;
constexpr int kBatch = 64;

EpochPlanner::RunStart Start(bool barrier = true, int start_epoch = 0, int64_t start_step = 0) {
  return {.start_epoch = start_epoch,
          .start_step = start_step,
          .batch_size = kBatch,
          .epochs = 3,
          .barrier = barrier};
}

// Positions a member trains in `epoch` per its plan: its base share (from
// `first_step` on), then its tails.
std::vector<data::WorkSegment> SegmentsOf(const v1::EpochPlanResponse& plan, int epoch) {
  std::vector<data::WorkSegment> out = {
      {data::BaseRange(kLength, epoch, plan.rank(), plan.world_size()), plan.base_steps()}};
  for (const v1::WorkSegment& t : plan.tails()) {
    out.push_back({{t.epoch(), t.begin(), t.end()}, t.steps()});
  }
  return out;
}

// Every position of one epoch exactly once, over the given ranges.
void ExpectEveryPositionOnce(const std::vector<data::WorkRange>& ranges, int epoch) {
  std::vector<int> seen(kLength, 0);
  for (const data::WorkRange& r : ranges) {
    if (r.epoch != epoch) continue;
    for (int64_t p = r.begin; p < r.end; ++p) seen[p]++;
  }
  for (int64_t p = 0; p < kLength; ++p) ASSERT_EQ(seen[p], 1) << "position " << p;
}

TEST(EpochPlannerTest, AnEpochIsFrozenAtTheFirstAskAndEndsWhenEveryTailIsTrained) {
  EpochPlanner planner(Start());
  const std::vector<std::string> members = {"w1", "w2"};
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse a, planner.Plan("w1", 0, kLength, false, 0, members));
  EXPECT_EQ(a.rank(), 0);
  EXPECT_EQ(a.world_size(), 2);
  EXPECT_EQ(a.base_steps(), 468);
  EXPECT_EQ(a.tails_size(), 0);
  // Later asks get the frozen plan, whatever the member list says now.
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse b, planner.Plan("w2", 0, kLength, false, 0, {"w2"}));
  EXPECT_EQ(b.rank(), 1);
  EXPECT_EQ(b.world_size(), 2);
  planner.RecordTrained("w1", 0, 30000);
  planner.RecordTrained("w2", 0, 30000);
  EXPECT_EQ(planner.TrainedSamples().at(0), kLength);
}

TEST(EpochPlannerTest, ALostMembersUntrainedSamplesGoToTheSurvivorsAsEvenTails) {
  EpochPlanner planner(Start());
  const std::vector<std::string> members = {"w1", "w2", "w3"};
  for (const std::string& w : members)
    ASSERT_OK(planner.Plan(w, 0, kLength, false, 0, members).status());
  // w2 trained 100 of its 312 steps (6400 of its 20000 samples).
  planner.MemberLost("w2", 100, {"w1", "w3"});
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p1,
                       planner.Plan("w1", 0, kLength, false, 0, {"w1", "w3"}));
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p3,
                       planner.Plan("w3", 0, kLength, false, 0, {"w1", "w3"}));
  ASSERT_EQ(p1.tails_size(), 1);
  ASSERT_EQ(p3.tails_size(), 1);
  EXPECT_EQ(p1.tails(0).end() - p1.tails(0).begin(), 6800);
  EXPECT_EQ(p3.tails(0).end() - p3.tails(0).begin(), 6800);
  EXPECT_EQ(p1.tails(0).steps(), p3.tails(0).steps());  // They step together.
  // The survivors' shares, their tails and what w2 trained cover the epoch once.
  std::vector<data::WorkRange> ranges;
  for (const auto& plan : {p1, p3}) {
    for (const data::WorkSegment& s : SegmentsOf(plan, 0)) ranges.push_back(s.range);
  }
  ranges.push_back({0, 20000, 26400});  // w2's trained part.
  ExpectEveryPositionOnce(ranges, 0);
  // Counts: w2's trained samples from the walk, the survivors' reports.
  planner.RecordTrained("w1", 0, 20000 + 6800);
  planner.RecordTrained("w3", 0, 20000 + 6800);
  planner.RecordTrained("w2", 0, 99999);  // A lost member's report no longer counts.
  EXPECT_EQ(planner.TrainedSamples().at(0), kLength);
}

TEST(EpochPlannerTest, TailsOfALostMembersTailAreHandedOnAgain) {
  EpochPlanner planner(Start());
  const std::vector<std::string> members = {"w1", "w2", "w3"};
  for (const std::string& w : members)
    ASSERT_OK(planner.Plan(w, 0, kLength, false, 0, members).status());
  planner.MemberLost("w3", 0, {"w1", "w2"});  // Nothing trained: 20000 to hand out.
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p2,
                       planner.Plan("w2", 0, kLength, false, 0, {"w1", "w2"}));
  ASSERT_EQ(p2.tails_size(), 1);
  // w2 then dies after its share and 10 steps of its tail.
  planner.MemberLost("w2", p2.base_steps() + 10, {"w1"});
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p1, planner.Plan("w1", 0, kLength, true, 1, {"w1"}));
  std::vector<data::WorkRange> ranges;
  for (const data::WorkSegment& s : SegmentsOf(p1, 0)) ranges.push_back(s.range);
  ranges.push_back(data::BaseRange(kLength, 0, 1, 3));                            // w2's share.
  ranges.push_back({0, p2.tails(0).begin(), p2.tails(0).begin() + 10 * kBatch});  // Its tail part.
  ExpectEveryPositionOnce(ranges, 0);
  EXPECT_EQ(planner.TrainedSamples().at(0), 20000 + 10 * kBatch);  // w2's, from the walk.
}

TEST(EpochPlannerTest, AMemberLostBeforeStartingAPlannedEpochLeavesItsWholeShare) {
  EpochPlanner planner(Start());
  const std::vector<std::string> members = {"w1", "w2"};
  for (const std::string& w : members)
    ASSERT_OK(planner.Plan(w, 0, kLength, false, 0, members).status());
  ASSERT_OK(planner.Plan("w1", 0, kLength, true, 0, members).status());   // w1 ends epoch 0...
  ASSERT_OK(planner.Plan("w1", 1, kLength, false, 0, members).status());  // ...and freezes epoch 1.
  // w2 trained all of epoch 0 (468 steps) and nothing of epoch 1.
  planner.MemberLost("w2", 468, {"w1"});
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p1, planner.Plan("w1", 1, kLength, false, 0, {"w1"}));
  ASSERT_EQ(p1.tails_size(), 1);
  EXPECT_EQ(p1.tails(0).epoch(), 1);
  EXPECT_EQ(p1.tails(0).begin(), 30000);
  EXPECT_EQ(p1.tails(0).end(), 60000);
  EXPECT_EQ(planner.TrainedSamples().at(0), 30000);  // w2's epoch 0, from the walk.
}

TEST(EpochPlannerTest, AsyncTailsWhenEverySurvivorEndedTheEpochGoToTheNextOne) {
  EpochPlanner planner(Start(/*barrier=*/false));
  const std::vector<std::string> members = {"w1", "w2"};
  for (const std::string& w : members)
    ASSERT_OK(planner.Plan(w, 0, kLength, false, 0, members).status());
  ASSERT_OK(planner.Plan("w1", 0, kLength, true, 0, members).status());  // w1 ended epoch 0.
  planner.MemberLost("w2", 200, {"w1"});
  // Nobody is left in epoch 0: the rest waits for epoch 1's plan.
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p1, planner.Plan("w1", 1, kLength, false, 0, {"w1"}));
  ASSERT_EQ(p1.tails_size(), 1);
  EXPECT_EQ(p1.tails(0).epoch(), 0);  // Samples of epoch 0, trained in epoch 1.
  EXPECT_EQ(p1.tails(0).begin(), 30000 + 200 * kBatch);
  EXPECT_EQ(p1.tails(0).end(), 60000);
}

TEST(EpochPlannerTest, BarrierModesPadAPieceSoThatEveryReceiverSteps) {
  // 8 samples at batch 1 on 4 members: shares of 2 in 2 steps each.
  EpochPlanner planner({.batch_size = 1, .epochs = 1, .barrier = true});
  const std::vector<std::string> members = {"w1", "w2", "w3", "w4"};
  for (const std::string& w : members) ASSERT_OK(planner.Plan(w, 0, 8, false, 0, members).status());
  planner.MemberLost("w4", 1, {"w1", "w2", "w3"});  // One sample left for three.
  std::set<int64_t> positions;
  for (const char* w : {"w1", "w2", "w3"}) {
    ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p,
                         planner.Plan(w, 0, 8, false, 0, {"w1", "w2", "w3"}));
    ASSERT_EQ(p.tails_size(), 1) << w;
    EXPECT_EQ(p.tails(0).end() - p.tails(0).begin(), 1);
    EXPECT_EQ(p.tails(0).steps(), 1);
    positions.insert(p.tails(0).begin());
  }
  EXPECT_EQ(positions, std::set<int64_t>{7});  // The one left, trained by all three.
  // Without a barrier only one member takes it.
  EpochPlanner async({.batch_size = 1, .epochs = 1, .barrier = false});
  for (const std::string& w : members) ASSERT_OK(async.Plan(w, 0, 8, false, 0, members).status());
  async.MemberLost("w4", 1, {"w1", "w2", "w3"});
  int tails = 0;
  for (const char* w : {"w1", "w2", "w3"}) {
    ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p,
                         async.Plan(w, 0, 8, false, 0, {"w1", "w2", "w3"}));
    tails += p.tails_size();
  }
  EXPECT_EQ(tails, 1);
}

TEST(EpochPlannerTest, VersionsMapToDataPositionsAcrossTails) {
  EpochPlanner planner(Start());
  const std::vector<std::string> members = {"w1", "w2"};
  for (const std::string& w : members)
    ASSERT_OK(planner.Plan(w, 0, kLength, false, 0, members).status());
  EXPECT_EQ(planner.PositionOfVersion(100), (std::pair<int, int64_t>{0, 100}));
  planner.MemberLost("w2", 100, {"w1"});
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p1, planner.Plan("w1", 0, kLength, false, 0, {"w1"}));
  ASSERT_EQ(p1.tails_size(), 1);
  const int64_t tail_steps = p1.tails(0).steps();
  EXPECT_EQ(planner.PositionOfVersion(468), (std::pair<int, int64_t>{1, 0}));  // In the tail.
  ASSERT_OK(planner.Plan("w1", 0, kLength, true, 1, {"w1"}).status());
  ASSERT_OK(planner.Plan("w1", 1, kLength, false, 0, {"w1"}).status());
  // Epoch 1 starts after the tail's steps.
  EXPECT_EQ(planner.PositionOfVersion(468 + tail_steps + 5), (std::pair<int, int64_t>{1, 5}));
}

TEST(EpochPlannerTest, AResumedRunSkipsItsFirstEpochsTrainedSteps) {
  // Resumed at epoch 1, step 468 + 40 (40 steps into epoch 1).
  EpochPlanner planner(Start(true, 1, 468 + 40));
  const std::vector<std::string> members = {"w1", "w2"};
  for (const std::string& w : members)
    ASSERT_OK(planner.Plan(w, 1, kLength, false, 0, members).status());
  EXPECT_EQ(planner.FirstStep(1, 468), 40);
  EXPECT_EQ(planner.PositionOfVersion(468 + 50), (std::pair<int, int64_t>{1, 50}));
  // w2 trained 10 steps of this run: 50 of its share with the skipped 40.
  planner.MemberLost("w2", 10, {"w1"});
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p1, planner.Plan("w1", 1, kLength, false, 0, {"w1"}));
  ASSERT_EQ(p1.tails_size(), 1);
  EXPECT_EQ(p1.tails(0).begin(), 30000 + 50 * kBatch);
  EXPECT_EQ(planner.TrainedSamples().at(1), 50 * kBatch);
}

TEST(EpochPlannerTest, BadAsksAreRefused) {
  EpochPlanner planner(Start());
  EXPECT_THAT(planner.Plan("w1", 3, kLength, false, 0, {"w1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(planner.Plan("w1", -1, kLength, false, 0, {"w1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(planner.Plan("w1", 0, 0, false, 0, {"w1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(planner.Plan("w1", 0, int64_t{1} << 50, false, 0, {"w1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(planner.Plan("w1", 0, 10, false, 0, {"w1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  ASSERT_OK(planner.Plan("w1", 0, kLength, false, 0, {"w1"}).status());
  EXPECT_THAT(planner.Plan("w1", 0, kLength + 1, false, 0, {"w1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(planner.Plan("w9", 0, kLength, false, 0, {"w1", "w9"}),
              StatusIs(absl::StatusCode::kFailedPrecondition, ::testing::_));
  EXPECT_THAT(planner.Plan("w1", 0, kLength, true, -1, {"w1"}),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
}

}  // namespace
}  // namespace pstrain
