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

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/testing/status_matchers.h"

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
  EXPECT_OK(ValidateOptimizerSpec(Sgd(0.1f)));
  v1::OptimizerSpec momentum = Sgd(0.1f);
  momentum.set_momentum(0.9f);
  momentum.set_nesterov(true);
  momentum.set_weight_decay(5e-4f);
  EXPECT_OK(ValidateOptimizerSpec(momentum));
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
  EXPECT_OK(ValidateOptimizerSpec(adamw));
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
  EXPECT_FLOAT_EQ(schedule.RateAt(0), 0.1f);  // Before the first key: base.
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
  EXPECT_FLOAT_EQ(schedule.RateAt(10), 0.1f);     // Decay starts after warm-up.
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

// ---------------------------------------------------------------------------
// Optimizer on the CPU backend against a double-precision reference
// ---------------------------------------------------------------------------

// PyTorch's update rules in double precision, one parameter tensor.
struct Reference {
  v1::OptimizerSpec spec;
  std::vector<double> p, slot1, slot2;  // param, momentum / Adam m, Adam v.

  void Step(const std::vector<float>& grad, int64_t step) {
    const double lr = LearningRateSchedule(spec).RateAt(step);
    const double wd = spec.weight_decay();
    if (spec.type() == v1::OPTIMIZER_SGD) {
      const double mu = spec.momentum();
      for (size_t i = 0; i < p.size(); ++i) {
        double g = grad[i] + wd * p[i];
        if (mu > 0) {
          slot1[i] = mu * slot1[i] + g;
          p[i] -= lr * (spec.nesterov() ? g + mu * slot1[i] : slot1[i]);
        } else {
          p[i] -= lr * g;
        }
      }
      return;
    }
    const bool adamw = spec.type() == v1::OPTIMIZER_ADAMW;
    const double b1 = spec.beta1() > 0 ? spec.beta1() : 0.9;
    const double b2 = spec.beta2() > 0 ? spec.beta2() : 0.999;
    const double eps = spec.epsilon() > 0 ? spec.epsilon() : 1e-8;
    const double t = static_cast<double>(step + 1);
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = grad[i] + (adamw ? 0.0 : wd * p[i]);
      if (adamw) p[i] -= lr * wd * p[i];
      slot1[i] = b1 * slot1[i] + (1 - b1) * g;
      slot2[i] = b2 * slot2[i] + (1 - b2) * g * g;
      const double m_hat = slot1[i] / (1 - std::pow(b1, t));
      const double v_hat = slot2[i] / (1 - std::pow(b2, t));
      p[i] -= lr * m_hat / (std::sqrt(v_hat) + eps);
    }
  }
};

class OptimizerApplyTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = CreateCpuBackend(); }

  Tensor Upload(const std::vector<float>& host) {
    absl::StatusOr<Tensor> t = backend_->AllocateTensor(Shape{static_cast<int64_t>(host.size())});
    EXPECT_OK(t);
    EXPECT_OK(backend_->CopyHostToDevice(t->data(), host.data(), t->bytes()));
    return *std::move(t);
  }
  std::vector<float> Download(const Tensor& t) {
    std::vector<float> host(static_cast<size_t>(t.num_elements()));
    EXPECT_OK(backend_->CopyDeviceToHost(host.data(), t.data(), t.bytes()));
    EXPECT_OK(backend_->Synchronize());
    return host;
  }

  static std::vector<float> RandomVector(size_t n, std::mt19937& rng, float scale) {
    std::normal_distribution<float> dist(0.f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
  }

  static void ExpectNear(const std::vector<float>& actual, const std::vector<double>& expected,
                         const std::string& what) {
    ASSERT_EQ(actual.size(), expected.size()) << what;
    for (size_t i = 0; i < actual.size(); ++i) {
      ASSERT_NEAR(actual[i], expected[i], 2e-6 + 2e-5 * std::abs(expected[i]))
          << what << " element " << i;
    }
  }

  // Runs `steps` updates of two parameters through the optimizer and the
  // reference, comparing parameters and state after every step.
  void RunAndCompare(const v1::OptimizerSpec& spec, int64_t steps) {
    absl::StatusOr<std::unique_ptr<Optimizer>> created = Optimizer::Create(spec, backend_.get());
    ASSERT_OK(created);
    Optimizer& opt = **created;
    std::mt19937 rng(1234);
    const std::vector<size_t> sizes = {37, 1000};  // Odd size and a vector-friendly one.
    std::vector<Tensor> params;
    std::vector<Reference> refs;
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<float> init = RandomVector(sizes[k], rng, 1.f);
      params.push_back(Upload(init));
      Reference ref{spec, std::vector<double>(init.begin(), init.end()),
                    std::vector<double>(sizes[k], 0.0), std::vector<double>(sizes[k], 0.0)};
      refs.push_back(std::move(ref));
      absl::StatusOr<int> index = opt.AddParameter(absl::StrCat("layer", k, "/weight"), sizes[k]);
      ASSERT_OK(index);
      ASSERT_EQ(*index, static_cast<int>(k));
    }
    for (int64_t step = 0; step < steps; ++step) {
      for (size_t k = 0; k < sizes.size(); ++k) {
        std::vector<float> grad = RandomVector(sizes[k], rng, 0.5f);
        Tensor device_grad = Upload(grad);
        ASSERT_OK(opt.Apply(static_cast<int>(k), params[k].data(), device_grad.data(), step));
        refs[k].Step(grad, step);
        ExpectNear(Download(params[k]), refs[k].p, absl::StrCat("param ", k, " step ", step));
      }
    }
    // State tensors hold the reference's state.
    std::vector<std::pair<std::string, Tensor*>> state = opt.StateTensors();
    const bool adam = spec.type() != v1::OPTIMIZER_SGD;
    const bool momentum = !adam && spec.momentum() > 0;
    ASSERT_EQ(state.size(), sizes.size() * (adam ? 2 : momentum ? 1 : 0));
    for (size_t k = 0; k < sizes.size() && (adam || momentum); ++k) {
      const std::string prefix = absl::StrCat("layer", k, "/weight/");
      const size_t first = adam ? 2 * k : k;
      EXPECT_EQ(state[first].first, absl::StrCat(prefix, adam ? "adam_m" : "momentum"));
      ExpectNear(Download(*state[first].second), refs[k].slot1, state[first].first);
      if (adam) {
        EXPECT_EQ(state[first + 1].first, absl::StrCat(prefix, "adam_v"));
        ExpectNear(Download(*state[first + 1].second), refs[k].slot2, state[first + 1].first);
      }
    }
  }

  std::unique_ptr<Backend> backend_;
};

TEST_F(OptimizerApplyTest, PlainSgdWithWarmup) {
  v1::OptimizerSpec spec = Sgd(0.1f);
  spec.mutable_schedule()->set_warmup_steps(3);
  RunAndCompare(spec, 6);
}

TEST_F(OptimizerApplyTest, SgdWeightDecayWithStepMap) {
  v1::OptimizerSpec spec = Sgd(0.1f);
  spec.set_weight_decay(0.05f);
  (*spec.mutable_schedule()->mutable_step_map())[2] = 0.02f;
  RunAndCompare(spec, 5);
}

TEST_F(OptimizerApplyTest, HeavyBallMomentumWithWeightDecay) {
  v1::OptimizerSpec spec = Sgd(0.05f);
  spec.set_momentum(0.9f);
  spec.set_weight_decay(1e-3f);
  RunAndCompare(spec, 6);
}

TEST_F(OptimizerApplyTest, NesterovMomentumWithCosine) {
  v1::OptimizerSpec spec = Sgd(0.05f);
  spec.set_momentum(0.8f);
  spec.set_nesterov(true);
  spec.set_weight_decay(1e-2f);
  spec.mutable_schedule()->set_cosine_decay_steps(4);
  spec.mutable_schedule()->set_min_learning_rate(0.005f);
  RunAndCompare(spec, 6);
}

TEST_F(OptimizerApplyTest, AdamWithDefaultsAndL2) {
  v1::OptimizerSpec spec;
  spec.set_type(v1::OPTIMIZER_ADAM);
  spec.set_learning_rate(1e-2f);
  spec.set_weight_decay(0.1f);  // L2: added to the gradient.
  RunAndCompare(spec, 6);
}

TEST_F(OptimizerApplyTest, AdamWDecoupledDecayWithCustomBetasAndWarmup) {
  v1::OptimizerSpec spec;
  spec.set_type(v1::OPTIMIZER_ADAMW);
  spec.set_learning_rate(3e-2f);
  spec.set_beta1(0.8f);
  spec.set_beta2(0.95f);
  spec.set_epsilon(1e-6f);
  spec.set_weight_decay(0.1f);
  spec.mutable_schedule()->set_warmup_steps(2);
  RunAndCompare(spec, 6);
}

// Adam and AdamW differ only in where weight decay goes; with decay they
// must diverge (guards against the flag being dropped on the way down).
TEST_F(OptimizerApplyTest, AdamAndAdamWDiffer) {
  std::vector<float> out[2];
  const v1::OptimizerType types[2] = {v1::OPTIMIZER_ADAM, v1::OPTIMIZER_ADAMW};
  for (int i = 0; i < 2; ++i) {
    v1::OptimizerSpec spec;
    spec.set_type(types[i]);
    spec.set_learning_rate(0.1f);
    spec.set_weight_decay(0.5f);
    auto opt = Optimizer::Create(spec, backend_.get());
    ASSERT_OK(opt);
    ASSERT_OK((*opt)->AddParameter("w", 4));
    Tensor w = Upload({1.f, -2.f, 3.f, -4.f});
    Tensor g = Upload({0.1f, 0.1f, -0.1f, 0.f});
    for (int64_t step = 0; step < 3; ++step) {
      ASSERT_OK((*opt)->Apply(0, w.data(), g.data(), step));
    }
    out[i] = Download(w);
  }
  EXPECT_NE(out[0], out[1]);
}

TEST_F(OptimizerApplyTest, StateStartsAtZeroAndPointersSurviveMoreParameters) {
  v1::OptimizerSpec spec;
  spec.set_type(v1::OPTIMIZER_ADAM);
  spec.set_learning_rate(1e-3f);
  auto opt = Optimizer::Create(spec, backend_.get());
  ASSERT_OK(opt);
  ASSERT_OK((*opt)->AddParameter("a", 3));
  std::vector<std::pair<std::string, Tensor*>> before = (*opt)->StateTensors();
  ASSERT_EQ(before.size(), 2u);
  for (int i = 0; i < 50; ++i) { ASSERT_OK((*opt)->AddParameter(absl::StrCat("p", i), 5)); }
  std::vector<std::pair<std::string, Tensor*>> after = (*opt)->StateTensors();
  ASSERT_EQ(after.size(), 102u);
  EXPECT_EQ(after[0].second, before[0].second);
  EXPECT_EQ(after[1].second, before[1].second);
  EXPECT_EQ(Download(*before[0].second), std::vector<float>(3, 0.f));
  EXPECT_EQ(Download(*after[101].second), std::vector<float>(5, 0.f));
  EXPECT_EQ(after[101].first, "p49/adam_v");
}

TEST_F(OptimizerApplyTest, PlainSgdHasNoState) {
  auto opt = Optimizer::Create(Sgd(0.1f), backend_.get());
  ASSERT_OK(opt);
  ASSERT_OK((*opt)->AddParameter("w", 10));
  EXPECT_TRUE((*opt)->StateTensors().empty());
}

TEST_F(OptimizerApplyTest, RejectsBadRegistrationsAndCalls) {
  auto opt = Optimizer::Create(Sgd(0.1f), backend_.get());
  ASSERT_OK(opt);
  ASSERT_OK((*opt)->AddParameter("w", 4));
  EXPECT_EQ((*opt)->AddParameter("w", 4).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ((*opt)->AddParameter("", 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*opt)->AddParameter("neg", -1).status().code(), absl::StatusCode::kInvalidArgument);
  Tensor w = Upload({1, 2, 3, 4});
  Tensor g = Upload({1, 1, 1, 1});
  EXPECT_EQ((*opt)->Apply(1, w.data(), g.data(), 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*opt)->Apply(-1, w.data(), g.data(), 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*opt)->Apply(0, w.data(), g.data(), -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*opt)->Apply(0, nullptr, g.data(), 0).code(), absl::StatusCode::kInvalidArgument);
  // None of the rejected calls touched the parameter.
  EXPECT_EQ(Download(w), (std::vector<float>{1, 2, 3, 4}));
}

}  // namespace
}  // namespace pstrain
