// Mixed-precision training (ModelOptions::precision) end to end on a model:
// one step in bf16 and fp16 against the same step in fp32 on the GPU, fp16's
// dynamic loss scaling on an overflow, a short training run, and the CPU's
// refusal.
//
// Tolerances of a whole step. The op-level parity tests
// (tests/kernels/mixed_precision_parity_test.cc) bound each op's rounding
// tightly; a whole step compounds them and adds decisions that rounding
// changes: a ReLU input near zero changes sign, a max-pool window whose two
// largest inputs round to one value sends its gradient to the other one
// (for bf16, a few percent of 2x2 windows), and a batch-norm beta gradient
// is a sum of terms that mostly cancel, so its relative error is the sum's
// rounding over a small result. On an H200 one step measured, in relative L2
// error per gradient: bf16 up to 0.23 (a batch-norm beta; convolution
// weights 0.07-0.12), fp16 up to 0.07; and for the loss, 1.3e-4 (bf16) and
// 4.6e-5 (fp16). The bounds are 0.35 (bf16) and 0.12 (fp16) per gradient,
// and 2 u for the loss (u = 2^-8 bf16, 2^-11 fp16). What the test is for is
// wiring: a gradient not unscaled, not converted, or computed from the wrong
// type is off by 1 or more. Each case prints what it measured.
//
// GPU cases skip themselves without a CUDA device.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/testing/kernel_configs.h"
#include "worker/model.h"
#include "worker/trainer.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

v1::ModelSpec ParseModel(const std::string& json) {
  v1::ModelSpec spec;
  auto status = google::protobuf::util::JsonStringToMessage(json, &spec);
  EXPECT_OK(status) << status.ToString() << "\n" << json;
  return spec;
}

// fmnist-cnn as in examples/models (conv-relu-pool twice, dense, dropout).
const char* kFmnistCnn = R"({"name":"fmnist-cnn","input_shape":[1,28,28],"num_classes":10,
  "init_seed":11,"layers":[
  {"name":"conv1","conv2d":{"filters":32,"kernel_size":5,"padding":2}},{"name":"relu1","relu":{}},
  {"name":"pool1","max_pool":{"pool_size":2}},
  {"name":"conv2","conv2d":{"filters":64,"kernel_size":5,"padding":2}},{"name":"relu2","relu":{}},
  {"name":"pool2","max_pool":{"pool_size":2}},{"name":"flat","flatten":{}},
  {"name":"fc1","dense":{"units":128}},{"name":"relu3","relu":{}},
  {"name":"drop","dropout":{"rate":0.25}},{"name":"fc2","dense":{"units":10}},
  {"name":"loss","softmax_cross_entropy":{}}]})";

// A residual network in small: conv-BN-ReLU, a residual block with a
// shortcut read twice, a strided block, average pooling.
const char* kResnetSmall = R"({"name":"res","input_shape":[3,16,16],"num_classes":10,
  "init_seed":5,"layers":[
  {"name":"stem","conv2d":{"filters":16,"kernel_size":3,"padding":1,"no_bias":true}},
  {"name":"stem_bn","batch_norm":{}},{"name":"stem_relu","relu":{}},
  {"name":"b1c1","conv2d":{"filters":16,"kernel_size":3,"padding":1,"no_bias":true}},
  {"name":"b1bn1","batch_norm":{}},{"name":"b1r1","relu":{}},
  {"name":"b1c2","conv2d":{"filters":16,"kernel_size":3,"padding":1,"no_bias":true}},
  {"name":"b1bn2","batch_norm":{}},
  {"name":"b1add","add":{},"inputs":["b1bn2","stem_relu"]},{"name":"b1r2","relu":{}},
  {"name":"b2c1","conv2d":{"filters":32,"kernel_size":3,"stride":2,"padding":1,"no_bias":true}},
  {"name":"b2bn1","batch_norm":{}},{"name":"b2r1","relu":{}},
  {"name":"b2c2","conv2d":{"filters":32,"kernel_size":3,"padding":1,"no_bias":true}},
  {"name":"b2bn2","batch_norm":{}},
  {"name":"b2sc","conv2d":{"filters":32,"kernel_size":1,"stride":2,"no_bias":true},
   "inputs":["b1r2"]},
  {"name":"b2add","add":{},"inputs":["b2bn2","b2sc"]},{"name":"b2r2","relu":{}},
  {"name":"gap","avg_pool":{"pool_size":8}},{"name":"flat","flatten":{}},
  {"name":"fc","dense":{"units":10}},{"name":"loss","softmax_cross_entropy":{}}]})";

struct StepResult {
  float loss = 0;
  std::vector<std::vector<float>> grads;  // Trainable parameters, in order.
  std::vector<std::string> names;
};

struct Batch {
  std::vector<float> x;
  std::vector<int32_t> labels;
};

Batch MakeBatch(const v1::ModelSpec& spec, int n, uint32_t seed) {
  int64_t per_sample = 1;
  for (int64_t d : spec.input_shape()) per_sample *= d;
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  Batch b;
  b.x.resize(per_sample * n);
  for (float& v : b.x) v = dist(gen);
  for (int i = 0; i < n; ++i)
    b.labels.push_back(static_cast<int32_t>((i * 3 + 1) % spec.num_classes()));
  return b;
}

bool HaveCuda() { return CudaDeviceCount() > 0; }

std::unique_ptr<Backend> Cuda() {
  absl::StatusOr<std::unique_ptr<Backend>> backend = ::pstrain::testing::CreateCudaBackend();
  EXPECT_OK(backend);
  return backend.ok() ? *std::move(backend) : nullptr;
}

// One training step of `json` in `precision` on `backend`, from the model's
// deterministic initial parameters.
StepResult RunStep(Backend& backend, const std::string& json, DataType precision,
                   const Batch& batch) {
  StepResult result;
  ModelOptions options;
  options.precision = precision;
  absl::StatusOr<std::unique_ptr<Model>> model_or =
      Model::Create(ParseModel(json), &backend, options);
  EXPECT_OK(model_or);
  if (!model_or.ok()) return result;
  Model& model = **model_or;
  EXPECT_OK(model.InitializeParameters());
  const int n = static_cast<int>(batch.labels.size());
  absl::StatusOr<Tensor> x = backend.AllocateTensor(Shape{static_cast<int64_t>(batch.x.size())});
  absl::StatusOr<DeviceBuffer> labels = backend.Allocate(n * sizeof(int32_t));
  EXPECT_OK(x);
  EXPECT_OK(labels);
  EXPECT_OK(backend.CopyHostToDevice(x->data(), batch.x.data(), x->bytes()));
  EXPECT_OK(backend.CopyHostToDevice(labels->data(), batch.labels.data(), n * sizeof(int32_t)));
  absl::Status status = model.Forward(x->data(), static_cast<const int32_t*>(labels->data()), n,
                                      /*training=*/true, /*seed=*/7);
  EXPECT_OK(status);
  status = model.Backward();
  EXPECT_OK(status);
  EXPECT_FALSE(model.last_backward_overflowed());
  EXPECT_OK(backend.CopyDeviceToHost(&result.loss, model.loss(), sizeof(float)));
  for (int p = 0; p < model.num_params(); ++p) {
    if (!model.param_info(p).trainable) continue;
    std::vector<float> g(model.grad(p).num_elements());
    EXPECT_OK(backend.CopyDeviceToHost(g.data(), model.grad(p).data(), model.grad(p).bytes()));
    result.grads.push_back(std::move(g));
    result.names.push_back(model.param_info(p).name);
  }
  EXPECT_OK(backend.Synchronize());
  return result;
}

double RelativeL2(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - ref[i]) * (static_cast<double>(a[i]) - ref[i]);
    norm += static_cast<double>(ref[i]) * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

double UnitRoundoff(DataType dtype) {
  return dtype == DataType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}

class MixedPrecisionModelTest : public ::testing::TestWithParam<DataType> {
 protected:
  void SetUp() override {
    if (!HaveCuda()) GTEST_SKIP() << "no CUDA device visible";
    backend_ = Cuda();
    ASSERT_NE(backend_, nullptr);
  }
  std::unique_ptr<Backend> backend_;
};

TEST_P(MixedPrecisionModelTest, OneStepMatchesFp32WithinTheRoundingOfItsLayers) {
  const DataType dtype = GetParam();
  const double u = UnitRoundoff(dtype);
  for (const char* json : {kFmnistCnn, kResnetSmall}) {
    const v1::ModelSpec spec = ParseModel(json);
    SCOPED_TRACE(spec.name());
    const Batch batch = MakeBatch(spec, 32, 17);
    const StepResult ref = RunStep(*backend_, json, DataType::kF32, batch);
    const StepResult got = RunStep(*backend_, json, dtype, batch);
    ASSERT_EQ(got.grads.size(), ref.grads.size());
    ASSERT_GT(ref.loss, 0.f);
    const double loss_error = std::abs(got.loss - ref.loss) / ref.loss;
    std::printf("%s %s: loss %.6f (fp32 %.6f, relative error %.2e)\n", spec.name().c_str(),
                DataTypeName(dtype), got.loss, ref.loss, loss_error);
    EXPECT_LE(loss_error, 2 * u) << "loss " << got.loss << " against fp32 " << ref.loss;
    const double bound = dtype == DataType::kBF16 ? 0.35 : 0.12;
    for (size_t i = 0; i < ref.grads.size(); ++i) {
      const double error = RelativeL2(got.grads[i], ref.grads[i]);
      std::printf("  %-14s gradient relative L2 error %.2e\n", ref.names[i].c_str(), error);
      EXPECT_LE(error, bound) << ref.names[i];
    }
  }
}

TEST_P(MixedPrecisionModelTest, TrainsAFixedBatchDown) {
  const DataType dtype = GetParam();
  ModelOptions options;
  options.precision = dtype;
  const v1::ModelSpec spec = ParseModel(kResnetSmall);
  absl::StatusOr<std::unique_ptr<Model>> model_or = Model::Create(spec, backend_.get(), options);
  ASSERT_OK(model_or);
  Model& model = **model_or;
  ASSERT_OK(model.InitializeParameters());
  v1::OptimizerSpec opt;
  opt.set_type(v1::OPTIMIZER_SGD);
  opt.set_learning_rate(0.05f);
  opt.set_momentum(0.9f);
  absl::StatusOr<std::unique_ptr<LocalUpdater>> updater = LocalUpdater::Create(opt, &model);
  ASSERT_OK(updater);
  model.SetGradientReadyCallback([&](int layer, absl::Span<const int> params) {
    (*updater)->OnGradientsReady(0, layer, params);
  });
  const Batch batch = MakeBatch(spec, 64, 23);
  absl::StatusOr<Tensor> x = backend_->AllocateTensor(Shape{static_cast<int64_t>(batch.x.size())});
  absl::StatusOr<DeviceBuffer> labels = backend_->Allocate(64 * sizeof(int32_t));
  ASSERT_OK(x);
  ASSERT_OK(labels);
  ASSERT_OK(backend_->CopyHostToDevice(x->data(), batch.x.data(), x->bytes()));
  ASSERT_OK(backend_->CopyHostToDevice(labels->data(), batch.labels.data(), 64 * sizeof(int32_t)));
  float first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    ASSERT_OK((*updater)->BeforeStep(step, model));
    ASSERT_OK(model
                    .Forward(x->data(), static_cast<const int32_t*>(labels->data()), 64, true,
                             static_cast<uint64_t>(step)));
    ASSERT_OK(model.Backward());
    ASSERT_OK((*updater)->ApplyUpdate(step, model));
    float loss = 0;
    ASSERT_OK(backend_->CopyDeviceToHost(&loss, model.loss(), sizeof(float)));
    ASSERT_OK(backend_->Synchronize());
    ASSERT_TRUE(std::isfinite(loss)) << "step " << step;
    if (step == 0) first = loss;
    last = loss;
  }
  EXPECT_EQ(model.overflowed_steps(), 0);
  EXPECT_LT(last, 0.2f * first) << "first loss " << first << ", last " << last;
}

INSTANTIATE_TEST_SUITE_P(ReducedTypes, MixedPrecisionModelTest,
                         ::testing::Values(DataType::kBF16, DataType::kF16),
                         [](const ::testing::TestParamInfo<DataType>& info) {
                           return std::string(DataTypeName(info.param));
                         });

// A loss scale far too large: every fp16 gradient overflows. The step's
// gradients are zero, the local optimizer skips it (the parameters do not
// move), and the scale halves each time until steps go through.
TEST(Fp16LossScalingTest, AnOverflowedStepIsSkippedAndTheScaleBacksOff) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device visible";
  std::unique_ptr<Backend> backend = Cuda();
  ASSERT_NE(backend, nullptr);
  ModelOptions options;
  options.precision = DataType::kF16;
  options.initial_loss_scale = std::ldexp(1.f, 40);
  const v1::ModelSpec spec = ParseModel(kFmnistCnn);
  absl::StatusOr<std::unique_ptr<Model>> model_or = Model::Create(spec, backend.get(), options);
  ASSERT_OK(model_or);
  Model& model = **model_or;
  ASSERT_OK(model.InitializeParameters());
  v1::OptimizerSpec opt;
  opt.set_type(v1::OPTIMIZER_SGD);
  opt.set_learning_rate(0.1f);
  absl::StatusOr<std::unique_ptr<LocalUpdater>> updater = LocalUpdater::Create(opt, &model);
  ASSERT_OK(updater);
  model.SetGradientReadyCallback([&](int layer, absl::Span<const int> params) {
    (*updater)->OnGradientsReady(0, layer, params);
  });
  const Batch batch = MakeBatch(spec, 16, 5);
  absl::StatusOr<Tensor> x = backend->AllocateTensor(Shape{static_cast<int64_t>(batch.x.size())});
  absl::StatusOr<DeviceBuffer> labels = backend->Allocate(16 * sizeof(int32_t));
  ASSERT_OK(x);
  ASSERT_OK(labels);
  ASSERT_OK(backend->CopyHostToDevice(x->data(), batch.x.data(), x->bytes()));
  ASSERT_OK(backend->CopyHostToDevice(labels->data(), batch.labels.data(), 16 * sizeof(int32_t)));
  const int w = model.FindParam("fc2/weight");
  ASSERT_GE(w, 0);
  std::vector<float> before(model.param(w).num_elements()), after(before.size()),
      grad(before.size());
  ASSERT_OK(backend->CopyDeviceToHost(before.data(), model.param(w).data(), model.param(w).bytes()));

  ASSERT_OK((*updater)->BeforeStep(0, model));
  ASSERT_OK(model.Forward(x->data(), static_cast<const int32_t*>(labels->data()), 16, true, 1));
  ASSERT_OK(model.Backward());
  ASSERT_OK((*updater)->ApplyUpdate(0, model));
  EXPECT_TRUE(model.last_backward_overflowed());
  EXPECT_FALSE((*updater)->LastUpdateApplied());
  EXPECT_EQ(model.loss_scale(), std::ldexp(1.f, 39));
  ASSERT_OK(backend->CopyDeviceToHost(after.data(), model.param(w).data(), model.param(w).bytes()));
  ASSERT_OK(backend->CopyDeviceToHost(grad.data(), model.grad(w).data(), model.grad(w).bytes()));
  ASSERT_OK(backend->Synchronize());
  EXPECT_EQ(after, before) << "an overflowed step moved the parameters";
  for (float g : grad) ASSERT_EQ(g, 0.f);

  // Down to a workable scale (2^16 or below: 24 more halvings at most), then
  // a step goes through and moves the parameters.
  int steps = 1;
  while (model.last_backward_overflowed() && steps < 40) {
    ASSERT_OK((*updater)->BeforeStep(steps, model));
    ASSERT_OK(model.Forward(x->data(), static_cast<const int32_t*>(labels->data()), 16, true, 1));
    ASSERT_OK(model.Backward());
    ASSERT_OK((*updater)->ApplyUpdate(steps, model));
    ++steps;
  }
  EXPECT_FALSE(model.last_backward_overflowed()) << "still overflowing after " << steps << " steps";
  EXPECT_TRUE((*updater)->LastUpdateApplied());
  EXPECT_EQ(model.overflowed_steps(), steps - 1);
  ASSERT_OK(backend->CopyDeviceToHost(after.data(), model.param(w).data(), model.param(w).bytes()));
  ASSERT_OK(backend->Synchronize());
  EXPECT_NE(after, before);
}

// --- Runs everywhere -------------------------------------------------------------

TEST(MixedPrecisionCpuTest, TheCpuRefusesReducedPrecisionWithAClearMessage) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  for (DataType dtype : {DataType::kBF16, DataType::kF16}) {
    ModelOptions options;
    options.precision = dtype;
    absl::StatusOr<std::unique_ptr<Model>> model =
        Model::Create(ParseModel(kFmnistCnn), cpu.get(), options);
    ASSERT_FALSE(model.ok());
    EXPECT_EQ(model.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(model.status().message(), HasSubstr("needs a CUDA device"));
    EXPECT_THAT(model.status().message(), HasSubstr(DataTypeName(dtype)));
  }
  ModelOptions fp32;
  EXPECT_OK(Model::Create(ParseModel(kFmnistCnn), cpu.get(), fp32));
}

TEST(MixedPrecisionCpuTest, JobPrecisionMapsToTheActivationType) {
  EXPECT_EQ(DataTypeOf(v1::PRECISION_FP32), DataType::kF32);
  EXPECT_EQ(DataTypeOf(v1::PRECISION_BF16), DataType::kBF16);
  EXPECT_EQ(DataTypeOf(v1::PRECISION_FP16), DataType::kF16);
}

TEST(Fp16LossScalingTest, ABadInitialLossScaleIsRefused) {
  if (!HaveCuda()) GTEST_SKIP() << "no CUDA device visible";
  std::unique_ptr<Backend> backend = Cuda();
  ModelOptions options;
  options.precision = DataType::kF16;
  options.initial_loss_scale = 0.5f;
  absl::StatusOr<std::unique_ptr<Model>> model =
      Model::Create(ParseModel(kFmnistCnn), backend.get(), options);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(model.status().message(), HasSubstr("initial_loss_scale"));
}

}  // namespace
}  // namespace pstrain
