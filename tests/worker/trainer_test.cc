// Trainer on the CPU: a share is trained whole (its last step takes the
// rest, issue 9 part 6), tails run without moving the data position, and a
// step beyond the trainer's largest batch is refused; the bench-only fixed
// compute time replaces forward/backward after the first step.
#include "worker/trainer.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
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

// Records what the trainer hands an updater: the layers announced per step
// and the gradient of "fc/weight" at each ApplyUpdate. Changes no parameter.
class RecordingUpdater final : public ParameterUpdater {
 public:
  void OnGradientsReady(int64_t step, int layer, absl::Span<const int> params) override {
    ready_layers.push_back({step, layer});
  }
  absl::Status ApplyUpdate(int64_t step, Model& model) override {
    const int p = model.FindParam("fc/weight");
    std::vector<float> grad(model.grad(p).num_elements());
    std::memcpy(grad.data(), model.grad(p).data(), grad.size() * sizeof(float));
    grads.push_back(std::move(grad));
    return absl::OkStatus();
  }
  std::vector<std::pair<int64_t, int>> ready_layers;
  std::vector<std::vector<float>> grads;
};

// One epoch of rank 1 of 3 over 1000 samples (5 steps, the last of 77
// samples: larger than the first) with `fixed_compute`, recorded.
std::unique_ptr<RecordingUpdater> RunRecorded(absl::Duration fixed_compute, EpochStats* stats) {
  std::unique_ptr<Backend> backend = CreateCpuBackend();
  data::ImageDataset train = data::testing::CountingDataset(1000);
  auto model = *Model::Create(Tiny(), backend.get());
  EXPECT_OK(model->InitializeParameters());
  auto updater = std::make_unique<RecordingUpdater>();
  TrainerOptions options;
  options.batch_size = 64;
  options.rank = 1;
  options.world_size = 3;
  options.bench_only_fixed_compute = fixed_compute;
  auto trainer = *Trainer::Create(model.get(), updater.get(), &train, data::Preprocess(), options);
  absl::StatusOr<EpochStats> epoch = trainer->RunEpoch(0, nullptr);
  EXPECT_OK(epoch.status());
  if (epoch.ok()) *stats = *epoch;
  return updater;
}

TEST(TrainerTest, BenchOnlyFixedComputeRunsOneRealStepThenReplaysItsGradients) {
  EpochStats stats;
  auto updater = RunRecorded(absl::Milliseconds(1), &stats);
  EXPECT_EQ(stats.steps, 5);
  EXPECT_EQ(stats.samples, 333);
  // Every step announces the one trainable layer ("fc", index 1) once.
  ASSERT_EQ(updater->ready_layers.size(), 5u);
  for (int64_t step = 0; step < 5; ++step) {
    EXPECT_EQ(updater->ready_layers[step], std::make_pair(step, 1));
  }
  // No forward/backward after the first step: its gradient, pushed again.
  ASSERT_EQ(updater->grads.size(), 5u);
  for (size_t i = 1; i < updater->grads.size(); ++i) {
    EXPECT_EQ(updater->grads[i], updater->grads[0]) << "step " << i;
  }
}

TEST(TrainerTest, WithoutFixedComputeEveryStepComputesItsOwnGradients) {
  // The reference for the test above: the same steps, real gradients differ.
  EpochStats stats;
  auto updater = RunRecorded(absl::ZeroDuration(), &stats);
  EXPECT_EQ(stats.steps, 5);
  ASSERT_EQ(updater->grads.size(), 5u);
  EXPECT_NE(updater->grads[1], updater->grads[0]);
}

// Two dense layers, so that one layer's update can land while the other's
// backward is still to run.
v1::ModelSpec TwoLayers() {
  v1::ModelSpec spec = Tiny();
  spec.clear_layers();
  for (const char* name : {"flatten", "fc0", "fc1", "loss"}) {
    auto* layer = spec.add_layers();
    layer->set_name(name);
    if (std::string(name) == "flatten") layer->mutable_flatten();
    if (std::string(name) == "fc0") layer->mutable_dense()->set_units(8);
    if (std::string(name) == "fc1") layer->mutable_dense()->set_units(10);
    if (std::string(name) == "loss") layer->mutable_softmax_cross_entropy();
  }
  return spec;
}

// Passes everything to a LocalUpdater, except (when `defer`) the per-layer
// announcements, so that every update waits for ApplyUpdate. When fc0's
// gradients are announced it records whether fc1's weights had already
// changed this step.
class ForwardingUpdater final : public ParameterUpdater {
 public:
  ForwardingUpdater(LocalUpdater* inner, Model* model, bool defer)
      : inner_(inner), model_(model), defer_(defer) {}
  absl::Status BeforeStep(int64_t step, Model& model) override {
    fc1_before_ = Fc1();
    return inner_->BeforeStep(step, model);
  }
  void OnGradientsReady(int64_t step, int layer, absl::Span<const int> params) override {
    if (model_->graph().layers[layer].name == "fc0")
      fc1_changed_early.push_back(Fc1() != fc1_before_);
    if (!defer_) inner_->OnGradientsReady(step, layer, params);
  }
  absl::Status ApplyUpdate(int64_t step, Model& model) override {
    return inner_->ApplyUpdate(step, model);
  }
  std::vector<bool> fc1_changed_early;

 private:
  std::vector<float> Fc1() const {
    Tensor& t = model_->param(model_->FindParam("fc1/weight"));
    std::vector<float> v(t.num_elements());
    std::memcpy(v.data(), t.data(), t.bytes());
    return v;
  }
  LocalUpdater* inner_;
  Model* model_;
  const bool defer_;
  std::vector<float> fc1_before_;
};

TEST(TrainerTest, LocalUpdaterUpdatesEachLayerAsSoonAsItsGradientsAreReadyWithTheSameResult) {
  for (v1::OptimizerType type : {v1::OPTIMIZER_SGD, v1::OPTIMIZER_ADAM}) {
    std::vector<std::vector<float>> finals[2];
    for (bool defer : {false, true}) {
      std::unique_ptr<Backend> backend = CreateCpuBackend();
      data::ImageDataset train = data::testing::CountingDataset(300);
      std::unique_ptr<Model> model = *Model::Create(TwoLayers(), backend.get());
      ASSERT_OK(model->InitializeParameters());
      v1::OptimizerSpec spec;
      spec.set_type(type);
      spec.set_learning_rate(0.01f);
      if (type == v1::OPTIMIZER_SGD) spec.set_momentum(0.9f);
      std::unique_ptr<LocalUpdater> local = *LocalUpdater::Create(spec, model.get());
      ForwardingUpdater updater(local.get(), model.get(), defer);
      TrainerOptions options;
      options.batch_size = 32;
      std::unique_ptr<Trainer> trainer =
          *Trainer::Create(model.get(), &updater, &train, data::Preprocess(), options);
      ASSERT_OK(trainer->RunEpoch(0, nullptr).status());
      ASSERT_FALSE(updater.fc1_changed_early.empty());
      for (bool changed : updater.fc1_changed_early) EXPECT_EQ(changed, !defer);
      for (int p = 0; p < model->num_params(); ++p) {
        Tensor& t = model->param(p);
        std::vector<float> v(t.num_elements());
        std::memcpy(v.data(), t.data(), t.bytes());
        finals[defer].push_back(std::move(v));
      }
    }
    EXPECT_EQ(finals[0], finals[1]) << "optimizer " << type;
  }
}

}  // namespace
}  // namespace pstrain
