// Tests for kernels/optimizer.{h,cc}: spec validation, learning-rate
// schedules (pure functions), and several steps of every optimizer on the CPU
// backend against a double-precision reference of PyTorch's formulas.
#include "kernels/optimizer.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

v1::OptimizerSpec Sgd(float lr) {
  v1::OptimizerSpec spec;
  spec.set_type(v1::OPTIMIZER_SGD);
  spec.set_learning_rate(lr);
  return spec;
}

// ---------------------------------------------------------------------------
// ValidateOptimizerSpec
// ---------------------------------------------------------------------------

TEST(ValidateOptimizerSpecTest, AcceptsTypicalSpecs) {
  EXPECT_TRUE(ValidateOptimizerSpec(Sgd(0.1f)).ok());
  v1::OptimizerSpec momentum = Sgd(0.1f);
  momentum.set_momentum(0.9f);
  momentum.set_nesterov(true);
  momentum.set_weight_decay(5e-4f);
  EXPECT_TRUE(ValidateOptimizerSpec(momentum).ok());
  v1::OptimizerSpec adamw;
  adamw.set_type(v1::OPTIMIZER_ADAMW);
  adamw.set_learning_rate(1e-3f);
  adamw.set_beta1(0.8f);
  adamw.set_beta2(0.99f);
  adamw.set_epsilon(1e-6f);
  adamw.set_weight_decay(0.01f);
  adamw.mutable_schedule()->set_cosine_decay_steps(1000);
  adamw.mutable_schedule()->set_min_learning_rate(1e-5f);
  adamw.mutable_schedule()->set_warmup_steps(100);
  EXPECT_TRUE(ValidateOptimizerSpec(adamw).ok());
}

struct BadSpecCase {
  std::string label;
  v1::OptimizerSpec spec;
  std::string message;  // Expected substring.
};

std::vector<BadSpecCase> BadSpecs() {
  std::vector<BadSpecCase> cases;
  auto add = [&](std::string label, v1::OptimizerSpec spec, std::string message) {
    cases.push_back({std::move(label), std::move(spec), std::move(message)});
  };
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_type(v1::OPTIMIZER_UNSPECIFIED);
    add("unspecified type", s, "optimizer.type");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_type(static_cast<v1::OptimizerType>(42));
    add("unknown type", s, "optimizer.type");
  }
  add("zero rate", Sgd(0.f), "optimizer.learning_rate must be finite and > 0, got 0");
  add("negative rate", Sgd(-1.f), "optimizer.learning_rate must be finite and > 0, got -1");
  add("nan rate", Sgd(std::nanf("")), "optimizer.learning_rate");
  add("inf rate", Sgd(INFINITY), "optimizer.learning_rate");
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_momentum(1.5f);
    add("momentum 1.5", s, "optimizer.momentum must be in [0, 1), got 1.5");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_momentum(1.f);
    add("momentum 1", s, "optimizer.momentum must be in [0, 1), got 1");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_momentum(-0.1f);
    add("negative momentum", s, "optimizer.momentum");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_nesterov(true);
    add("nesterov without momentum", s, "optimizer.nesterov requires optimizer.momentum > 0");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_type(v1::OPTIMIZER_ADAM);
    s.set_momentum(0.9f);
    s.set_nesterov(true);
    add("nesterov with adam", s, "optimizer.nesterov requires type OPTIMIZER_SGD");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_beta1(1.f);
    add("beta1 1", s, "optimizer.beta1 must be in [0, 1), got 1");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_beta2(-0.5f);
    add("beta2 negative", s, "optimizer.beta2 must be in [0, 1), got -0.5");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_epsilon(-1e-8f);
    add("negative epsilon", s, "optimizer.epsilon");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_weight_decay(-0.01f);
    add("negative weight decay", s, "optimizer.weight_decay");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.set_weight_decay(std::nanf(""));
    add("nan weight decay", s, "optimizer.weight_decay");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    (*s.mutable_schedule()->mutable_step_map())[-1] = 0.01f;
    add("negative step key", s, "optimizer.schedule.step_map keys");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    (*s.mutable_schedule()->mutable_step_map())[10] = 0.f;
    add("zero step value", s, "optimizer.schedule.step_map[10] must be finite and > 0, got 0");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.mutable_schedule()->set_cosine_decay_steps(-5);
    add("negative cosine steps", s, "optimizer.schedule.cosine_decay_steps must be >= 0");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.mutable_schedule()->set_cosine_decay_steps(100);
    s.mutable_schedule()->set_min_learning_rate(0.2f);
    add("min above base", s, "optimizer.schedule.min_learning_rate must be in [0, learning_rate");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.mutable_schedule()->set_min_learning_rate(-0.01f);
    add("negative min", s, "optimizer.schedule.min_learning_rate");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    s.mutable_schedule()->set_warmup_steps(-1);
    add("negative warmup", s, "optimizer.schedule.warmup_steps must be >= 0, got -1");
  }
  {
    v1::OptimizerSpec s = Sgd(0.1f);
    (*s.mutable_schedule()->mutable_step_map())[10] = 0.01f;
    s.mutable_schedule()->set_cosine_decay_steps(100);
    add("map and cosine", s, "mutually exclusive");
  }
  return cases;
}

TEST(ValidateOptimizerSpecTest, RejectsEachBadFieldWithItsName) {
  for (const BadSpecCase& c : BadSpecs()) {
    absl::Status status = ValidateOptimizerSpec(c.spec);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.label;
    EXPECT_THAT(status.message(), HasSubstr(c.message)) << c.label;
  }
}

TEST(OptimizerCreateTest, RejectsInvalidSpecBeforeTouchingTheBackend) {
  absl::StatusOr<std::unique_ptr<Optimizer>> opt = Optimizer::Create(Sgd(-1.f), nullptr);
  EXPECT_EQ(opt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(opt.status().message(), HasSubstr("learning_rate"));
}

TEST(OptimizerCreateTest, RejectsNullBackend) {
  EXPECT_EQ(Optimizer::Create(Sgd(0.1f), nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// LearningRateSchedule
// ---------------------------------------------------------------------------

TEST(LearningRateScheduleTest, ConstantWithoutSchedule) {
  LearningRateSchedule schedule(Sgd(0.25f));
  for (int64_t i : {0, 1, 7, 1000, 1 << 30}) EXPECT_FLOAT_EQ(schedule.RateAt(i), 0.25f) << i;
}

TEST(LearningRateScheduleTest, StepMapFollowsDl4jMapSchedule) {
  v1::OptimizerSpec spec = Sgd(0.1f);
  auto& map = *spec.mutable_schedule()->mutable_step_map();
  // Inserted out of order on purpose: the proto map has no order.
  map[300] = 0.001f;
  map[100] = 0.05f;
  map[200] = 0.01f;
  LearningRateSchedule schedule(spec);
  EXPECT_FLOAT_EQ(schedule.RateAt(0), 0.1f);     // Before the first key: base.
  EXPECT_FLOAT_EQ(schedule.RateAt(99), 0.1f);
  EXPECT_FLOAT_EQ(schedule.RateAt(100), 0.05f);  // Key is inclusive.
  EXPECT_FLOAT_EQ(schedule.RateAt(150), 0.05f);
  EXPECT_FLOAT_EQ(schedule.RateAt(199), 0.05f);
  EXPECT_FLOAT_EQ(schedule.RateAt(200), 0.01f);
  EXPECT_FLOAT_EQ(schedule.RateAt(299), 0.01f);
  EXPECT_FLOAT_EQ(schedule.RateAt(300), 0.001f);
  EXPECT_FLOAT_EQ(schedule.RateAt(1000000), 0.001f);
}

TEST(LearningRateScheduleTest, StepMapKeyZeroReplacesBaseImmediately) {
  v1::OptimizerSpec spec = Sgd(0.1f);
  (*spec.mutable_schedule()->mutable_step_map())[0] = 0.02f;
  (*spec.mutable_schedule()->mutable_step_map())[5] = 0.2f;  // Rates may also rise.
  LearningRateSchedule schedule(spec);
  EXPECT_FLOAT_EQ(schedule.RateAt(0), 0.02f);
  EXPECT_FLOAT_EQ(schedule.RateAt(4), 0.02f);
  EXPECT_FLOAT_EQ(schedule.RateAt(5), 0.2f);
}

TEST(LearningRateScheduleTest, CosineDecaysFromBaseToMinimum) {
  v1::OptimizerSpec spec = Sgd(0.1f);
  spec.mutable_schedule()->set_cosine_decay_steps(100);
  spec.mutable_schedule()->set_min_learning_rate(0.001f);
  LearningRateSchedule schedule(spec);
  auto expected = [](int64_t t) {
    double tt = std::min<double>(t, 100);
    return 0.001 + (0.1 - 0.001) * 0.5 * (1 + std::cos(std::numbers::pi * tt / 100));
  };
  EXPECT_FLOAT_EQ(schedule.RateAt(0), 0.1f);
  EXPECT_NEAR(schedule.RateAt(50), 0.0505, 1e-7);  // Half-way: the mid-point.
  EXPECT_FLOAT_EQ(schedule.RateAt(100), 0.001f);
  EXPECT_FLOAT_EQ(schedule.RateAt(101), 0.001f);  // Stays at the minimum.
  EXPECT_FLOAT_EQ(schedule.RateAt(100000), 0.001f);
  float previous = schedule.RateAt(0);
  for (int64_t i = 1; i <= 120; ++i) {
    EXPECT_NEAR(schedule.RateAt(i), expected(i), 1e-8) << i;
    EXPECT_LE(schedule.RateAt(i), previous) << i;  // Monotone non-increasing.
    previous = schedule.RateAt(i);
  }
}

TEST(LearningRateScheduleTest, CosineWithZeroMinimumReachesZero) {
  v1::OptimizerSpec spec = Sgd(1.f);
  spec.mutable_schedule()->set_cosine_decay_steps(4);
  LearningRateSchedule schedule(spec);
  EXPECT_FLOAT_EQ(schedule.RateAt(0), 1.f);
  EXPECT_NEAR(schedule.RateAt(1), 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-7);
  EXPECT_NEAR(schedule.RateAt(2), 0.5, 1e-7);
  EXPECT_NEAR(schedule.RateAt(4), 0.0, 1e-7);
  EXPECT_NEAR(schedule.RateAt(9), 0.0, 1e-7);
}

TEST(LearningRateScheduleTest, LinearWarmupReachesBaseAtTheLastWarmupStep) {
  v1::OptimizerSpec spec = Sgd(0.4f);
  spec.mutable_schedule()->set_warmup_steps(4);
  LearningRateSchedule schedule(spec);
  EXPECT_FLOAT_EQ(schedule.RateAt(0), 0.1f);
  EXPECT_FLOAT_EQ(schedule.RateAt(1), 0.2f);
  EXPECT_FLOAT_EQ(schedule.RateAt(2), 0.3f);
  EXPECT_FLOAT_EQ(schedule.RateAt(3), 0.4f);
  EXPECT_FLOAT_EQ(schedule.RateAt(4), 0.4f);
  EXPECT_FLOAT_EQ(schedule.RateAt(1000), 0.4f);
}

TEST(LearningRateScheduleTest, WarmupThenCosineCountsDecayAfterWarmup) {
  v1::OptimizerSpec spec = Sgd(0.1f);
  spec.mutable_schedule()->set_warmup_steps(10);
  spec.mutable_schedule()->set_cosine_decay_steps(20);
  spec.mutable_schedule()->set_min_learning_rate(0.01f);
  LearningRateSchedule schedule(spec);
  for (int64_t i = 0; i < 10; ++i) {
    EXPECT_NEAR(schedule.RateAt(i), 0.1 * (i + 1) / 10.0, 1e-8) << i;
  }
  EXPECT_FLOAT_EQ(schedule.RateAt(10), 0.1f);  // Decay starts after warm-up.
  EXPECT_NEAR(schedule.RateAt(20), 0.055, 1e-7);  // Half of the decay.
  EXPECT_FLOAT_EQ(schedule.RateAt(30), 0.01f);
  EXPECT_FLOAT_EQ(schedule.RateAt(31), 0.01f);
}

TEST(LearningRateScheduleTest, WarmupScalesTheStepMapRate) {
  v1::OptimizerSpec spec = Sgd(0.1f);
  spec.mutable_schedule()->set_warmup_steps(5);
  (*spec.mutable_schedule()->mutable_step_map())[2] = 0.5f;
  LearningRateSchedule schedule(spec);
  EXPECT_NEAR(schedule.RateAt(0), 0.1 * 1 / 5, 1e-8);
  EXPECT_NEAR(schedule.RateAt(1), 0.1 * 2 / 5, 1e-8);
  EXPECT_NEAR(schedule.RateAt(2), 0.5 * 3 / 5, 1e-7);
  EXPECT_NEAR(schedule.RateAt(4), 0.5, 1e-7);
  EXPECT_NEAR(schedule.RateAt(5), 0.5, 1e-7);
}

TEST(LearningRateScheduleTest, NegativeIterationIsTreatedAsZero) {
  v1::OptimizerSpec spec = Sgd(0.4f);
  spec.mutable_schedule()->set_warmup_steps(4);
  LearningRateSchedule schedule(spec);
  EXPECT_FLOAT_EQ(schedule.RateAt(-3), schedule.RateAt(0));
}

}  // namespace
}  // namespace pstrain
