// Trainer on the CPU: a share is trained whole (its last step takes the
// rest, issue 9 part 6), tails run without moving the data position, and a
// step beyond the trainer's largest batch is refused.
#include "worker/trainer.h"

#include <cstdint>
#include <memory>
#include <vector>

#include "common/data/dataset.h"
#include "common/data/epoch_work.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/common/data_test_util.h"
#include "tests/testing/status_matchers.h"
#include "worker/model.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;

v1::ModelSpec Tiny() {
  v1::ModelSpec spec;
  spec.set_name("tiny");
  for (int d : {1, 2, 2}) spec.add_input_shape(d);
  spec.set_num_classes(10);
  spec.set_init_seed(3);
  auto* flatten = spec.add_layers();
  flatten->set_name("flatten");
  flatten->mutable_flatten();
  auto* fc = spec.add_layers();
  fc->set_name("fc");
  fc->mutable_dense()->set_units(10);
  auto* loss = spec.add_layers();
  loss->set_name("loss");
  loss->mutable_softmax_cross_entropy();
  return spec;
}

struct Setup {
  std::unique_ptr<Backend> backend = CreateCpuBackend();
  data::ImageDataset train;
  std::unique_ptr<Model> model;
  std::unique_ptr<LocalUpdater> updater;
  std::unique_ptr<Trainer> trainer;
};

std::unique_ptr<Setup> Make(int64_t samples, int rank, int world_size) {
  auto s = std::make_unique<Setup>();
  s->train = data::testing::CountingDataset(samples);
  s->model = *Model::Create(Tiny(), s->backend.get());
  EXPECT_OK(s->model->InitializeParameters());
  v1::OptimizerSpec sgd;
  sgd.set_type(v1::OPTIMIZER_SGD);
  sgd.set_learning_rate(0.01f);
  s->updater = *LocalUpdater::Create(sgd, s->model.get());
  TrainerOptions options;
  options.batch_size = 64;
  options.rank = rank;
  options.world_size = world_size;
  s->trainer =
      *Trainer::Create(s->model.get(), s->updater.get(), &s->train, data::Preprocess(), options);
  return s;
}

TEST(TrainerTest, AShareIsTrainedWholeAndItsLastStepTakesTheRest) {
  // 1000 samples on 3 ranks: rank 1 holds 333, in 5 steps (the last of 77).
  auto s = Make(1000, 1, 3);
  EXPECT_EQ(s->trainer->steps_per_epoch(), 5);
  ASSERT_OK_AND_ASSIGN(EpochStats stats, s->trainer->RunEpoch(0, nullptr));
  EXPECT_EQ(stats.steps, 5);
  EXPECT_EQ(stats.samples, 333);
  EXPECT_EQ(stats.applied_samples, 333);
  EXPECT_EQ(s->trainer->global_step(), 5);
  // Resumed two steps in: the rest of the share.
  ASSERT_OK_AND_ASSIGN(stats, s->trainer->RunEpoch(1, nullptr, 100, 2));
  EXPECT_EQ(stats.steps, 3);
  EXPECT_EQ(stats.samples, 333 - 128);
}

TEST(TrainerTest, ATailRunsWithoutMovingTheDataPosition) {
  auto s = Make(1000, 0, 1);
  s->trainer->set_global_step(15);
  SegmentOptions tail;
  tail.tail = true;
  ASSERT_OK_AND_ASSIGN(EpochStats stats,
                       s->trainer->RunSegment(0, {{0, 100, 230}, 2}, nullptr, tail));
  EXPECT_EQ(stats.steps, 2);
  EXPECT_EQ(stats.samples, 130);
  EXPECT_EQ(s->trainer->global_step(), 15);
}

TEST(TrainerTest, AStepLargerThanTwoBatchesIsRefused) {
  auto s = Make(1000, 0, 1);
  EXPECT_THAT(s->trainer->RunSegment(0, {{0, 0, 500}, 1}, nullptr, SegmentOptions()),
              StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("more than 2")));
}

}  // namespace
}  // namespace pstrain
