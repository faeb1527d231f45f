#include "common/data/epoch_work.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/data/dataset.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain::data {
namespace {

using ::testing::ElementsAre;

TEST(EpochWorkTest, BaseRangesCoverTheEpochAndMatchEpochOrder) {
  for (int world : {1, 2, 3, 7}) {
    int64_t next = 0;
    const std::vector<int64_t> whole = EpochOrder(1001, 5, 3, 0, 1, true);
    for (int rank = 0; rank < world; ++rank) {
      const WorkRange r = BaseRange(1001, 3, rank, world);
      EXPECT_EQ(r.begin, next);
      EXPECT_EQ(r.size(), ShardSize(1001, rank, world));
      // A range of the whole epoch's order is the rank's EpochOrder shard.
      const std::vector<int64_t> shard = EpochOrder(1001, 5, 3, rank, world, true);
      EXPECT_TRUE(std::equal(shard.begin(), shard.end(), whole.begin() + r.begin));
      next = r.end;
    }
    EXPECT_EQ(next, 1001);
  }
}

TEST(EpochWorkTest, EveryRankStepsAlikeAndTheLastStepTakesTheRest) {
  // 60000 samples on 2 workers at batch 64: 468 steps of 64, the last one 96.
  EXPECT_EQ(BaseSteps(60000, 2, 64), 468);
  const std::vector<int64_t> ends = BatchEnds(30000, 468, 64);
  ASSERT_EQ(ends.size(), 468u);
  EXPECT_EQ(ends[466], 467 * 64);
  EXPECT_EQ(ends.back(), 30000);
  // Shares 128 and 127 at batch 64: one step each (128 samples fit: < 2B).
  EXPECT_EQ(BaseSteps(255, 2, 64), 1);
  EXPECT_THAT(BatchEnds(128, 1, 64), ElementsAre(128));
  // A share smaller than a batch is one step of itself.
  EXPECT_EQ(GroupSteps(10, 64), 1);
  EXPECT_EQ(GroupSteps(0, 64), 0);
  EXPECT_TRUE(BatchEnds(0, 3, 64).empty());
  // The same without building the list (the coordinator walks plans of any size).
  for (int64_t k = 0; k <= 470; ++k) {
    EXPECT_EQ(SamplesAfter(30000, 468, 64, k), k == 0 ? 0 : ends[std::min<int64_t>(k, 468) - 1]);
  }
  EXPECT_EQ(StepCount(30000, 468), 468);
  EXPECT_EQ(StepCount(5, 9), 5);
  EXPECT_EQ(SamplesAfter(int64_t{1} << 40, int64_t{1} << 40, 1, 3), 3);
}

TEST(EpochWorkTest, SplitRangeGivesEvenContiguousPieces) {
  const std::vector<WorkRange> pieces = SplitRange({2, 100, 111}, 3);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0], (WorkRange{2, 100, 104}));
  EXPECT_EQ(pieces[1], (WorkRange{2, 104, 108}));
  EXPECT_EQ(pieces[2], (WorkRange{2, 108, 111}));
  const std::vector<WorkRange> tiny = SplitRange({0, 5, 6}, 3);
  EXPECT_EQ(tiny[0].size(), 1);
  EXPECT_EQ(tiny[1].size(), 0);
  EXPECT_EQ(tiny[2].size(), 0);
}

TEST(EpochWorkTest, ProgressThroughSplitsAtTheStepReached) {
  const std::vector<WorkSegment> segments = {{{0, 0, 200}, 3}, {{1, 500, 550}, 1}};
  // Steps of 64, 64, 72, then 50.
  WorkProgress p = ProgressThrough(segments, 2, 64);
  EXPECT_EQ(p.trained_samples, 128);
  EXPECT_THAT(p.trained, ElementsAre(WorkRange{0, 0, 128}));
  EXPECT_THAT(p.left, ElementsAre(WorkRange{0, 128, 200}, WorkRange{1, 500, 550}));
  p = ProgressThrough(segments, 3, 64);
  EXPECT_THAT(p.left, ElementsAre(WorkRange{1, 500, 550}));
  p = ProgressThrough(segments, 99, 64);
  EXPECT_EQ(p.trained_samples, 250);
  EXPECT_EQ(p.steps_used, 4);
  EXPECT_TRUE(p.left.empty());
  p = ProgressThrough(segments, 0, 64);
  EXPECT_EQ(p.trained_samples, 0);
  EXPECT_EQ(p.left.size(), 2u);
}

}  // namespace
}  // namespace pstrain::data
