// Tests for server/checkpoint_writer.{h,cc}: which checkpoints are
// consistent cuts, and the data position a checkpoint records. (Writing one
// through fake shards is covered by tests/server/coordinator_test.cc.)
#include "server/checkpoint_writer.h"

#include <utility>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

CheckpointWork Work(CheckpointWork::Kind kind, v1::ConsistencyMode mode) {
  CheckpointWork work;
  work.kind = kind;
  work.job_id = "job-1";
  work.spec.set_mode(mode);
  work.spec.set_epochs(4);
  work.position = {.epoch = 1, .step = 130};
  return work;
}

TEST(CheckpointWriterTest, EpochAndIntervalCheckpointsOfSyncAndAverageAreCuts) {
  for (v1::ConsistencyMode mode : {v1::CONSISTENCY_SYNC, v1::CONSISTENCY_AVERAGE}) {
    EXPECT_TRUE(IsCut(Work(CheckpointWork::kEpoch, mode)));
    EXPECT_TRUE(IsCut(Work(CheckpointWork::kInterval, mode)));
    EXPECT_FALSE(IsCut(Work(CheckpointWork::kFinal, mode)));
    EXPECT_FALSE(IsCut(Work(CheckpointWork::kStop, mode)));
  }
  for (v1::ConsistencyMode mode : {v1::CONSISTENCY_ASYNC, v1::CONSISTENCY_SSP}) {
    EXPECT_FALSE(IsCut(Work(CheckpointWork::kEpoch, mode)));
  }
}

TEST(CheckpointWriterTest, OnlyASyncCutTakesItsPositionFromTheCutVersion) {
  CheckpointWork async = Work(CheckpointWork::kEpoch, v1::CONSISTENCY_ASYNC);
  async.steps_per_epoch = 100;
  DataPosition p = CheckpointPosition(async, 999);
  EXPECT_EQ(p.epoch, 1);  // The members' position.
  EXPECT_EQ(p.step, 130);

  CheckpointWork sync = Work(CheckpointWork::kEpoch, v1::CONSISTENCY_SYNC);
  p = CheckpointPosition(sync, 250);  // Steps per epoch unknown: the version is the step.
  EXPECT_EQ(p.epoch, 1);
  EXPECT_EQ(p.step, 250);
  sync.steps_per_epoch = 100;
  p = CheckpointPosition(sync, 250);
  EXPECT_EQ(p.epoch, 2);
  EXPECT_EQ(p.step, 250);
  p = CheckpointPosition(sync, 900);  // Never past the job's epochs.
  EXPECT_EQ(p.epoch, 4);
}

TEST(CheckpointWriterTest, ThePlannersPositionPlacesAVersionInsideAnEpochWithTails) {
  CheckpointWork sync = Work(CheckpointWork::kInterval, v1::CONSISTENCY_SYNC);
  sync.steps_per_epoch = 100;
  // A lost worker's tail added 5 versions to epoch 1: version 230 is 25
  // steps into epoch 2's share.
  sync.position_of_version = [](int64_t version) {
    return std::pair<int, int64_t>{2, version - 205};
  };
  const DataPosition p = CheckpointPosition(sync, 230);
  EXPECT_EQ(p.epoch, 2);
  EXPECT_EQ(p.step, 225);
}

}  // namespace
}  // namespace pstrain
