// The model's channels-last path (Backend::ChannelsLast), run in CI on the
// CPU: a test backend wraps the CPU backend, asks for channels last in fp32,
// and runs each NHWC plan as the CPU's NCHW plan between exact transposes.
// A whole model must then give the same loss, logits and gradients, bit for
// bit, as on the plain CPU backend: the input's transpose, flatten and dense
// layers reading [H, W, C] inputs, and the layouts handed to the plans are
// all on that path. (On CUDA, bf16 and fp16 models take it for real; the GPU
// tests cover the NHWC kernels themselves.)
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/rng.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/model.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

// Scratch in NCHW order for one plan: x (or dx) and y (or dy) of a batch.
struct NchwScratch {
  Tensor in, d_in, out, d_out;
};

absl::StatusOr<NchwScratch> MakeScratch(Backend* b, int64_t in_count, int64_t out_count) {
  NchwScratch s;
  PSTRAIN_ASSIGN_OR_RETURN(s.in, b->AllocateTensor(Shape{in_count}));
  PSTRAIN_ASSIGN_OR_RETURN(s.d_in, b->AllocateTensor(Shape{in_count}));
  PSTRAIN_ASSIGN_OR_RETURN(s.out, b->AllocateTensor(Shape{out_count}));
  PSTRAIN_ASSIGN_OR_RETURN(s.d_out, b->AllocateTensor(Shape{out_count}));
  return s;
}

// [n, hw, c] (held) to [n, c, hw] (the wrapped plan's), and back.
absl::Status ToNchw(Backend* b, const void* x, void* y, int n, int c, int64_t hw) {
  return b->Transpose(DataType::kF32, x, y, n, hw, c);
}
absl::Status ToNhwc(Backend* b, const void* x, void* y, int n, int c, int64_t hw) {
  return b->Transpose(DataType::kF32, x, y, n, c, hw);
}

class TransposingConv final : public Conv2dPlan {
 public:
  TransposingConv(Backend* b, const Conv2dConfig& c, std::unique_ptr<Conv2dPlan> plan,
                  NchwScratch s)
      : b_(b), c_(c), plan_(std::move(plan)), s_(std::move(s)) {}
  absl::Status Forward(const void* x, const void* w, const void* bias, void* y) override {
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, x, s_.in.raw(), c_.n, c_.c, in_hw()));
    PSTRAIN_RETURN_IF_ERROR(plan_->Forward(s_.in.raw(), w, bias, s_.out.raw()));
    return ToNhwc(b_, s_.out.raw(), y, c_.n, c_.filters, out_hw());
  }
  absl::Status BackwardData(const void* dy, const void* w, void* dx) override {
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, dy, s_.d_out.raw(), c_.n, c_.filters, out_hw()));
    PSTRAIN_RETURN_IF_ERROR(plan_->BackwardData(s_.d_out.raw(), w, s_.d_in.raw()));
    return ToNhwc(b_, s_.d_in.raw(), dx, c_.n, c_.c, in_hw());
  }
  absl::Status BackwardFilter(const void* x, const void* dy, void* dw, void* dbias) override {
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, x, s_.in.raw(), c_.n, c_.c, in_hw()));
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, dy, s_.d_out.raw(), c_.n, c_.filters, out_hw()));
    return plan_->BackwardFilter(s_.in.raw(), s_.d_out.raw(), dw, dbias);
  }

 private:
  int64_t in_hw() const { return int64_t{c_.h} * c_.w; }
  int64_t out_hw() const { return int64_t{c_.out_h()} * c_.out_w(); }
  Backend* const b_;
  const Conv2dConfig c_;
  std::unique_ptr<Conv2dPlan> plan_;
  NchwScratch s_;
};

class TransposingPool final : public Pool2dPlan {
 public:
  TransposingPool(Backend* b, const Pool2dConfig& c, std::unique_ptr<Pool2dPlan> plan,
                  NchwScratch s)
      : b_(b), c_(c), plan_(std::move(plan)), s_(std::move(s)) {}
  absl::Status Forward(const void* x, void* y, bool training) override {
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, x, s_.in.raw(), c_.n, c_.c, in_hw()));
    PSTRAIN_RETURN_IF_ERROR(plan_->Forward(s_.in.raw(), s_.out.raw(), training));
    return ToNhwc(b_, s_.out.raw(), y, c_.n, c_.c, out_hw());
  }
  absl::Status Backward(const void* x, const void* y, const void* dy, void* dx) override {
    // s_.in and s_.out still hold this step's x and y in NCHW.
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, dy, s_.d_out.raw(), c_.n, c_.c, out_hw()));
    PSTRAIN_RETURN_IF_ERROR(
        plan_->Backward(s_.in.raw(), s_.out.raw(), s_.d_out.raw(), s_.d_in.raw()));
    return ToNhwc(b_, s_.d_in.raw(), dx, c_.n, c_.c, in_hw());
  }

 private:
  int64_t in_hw() const { return int64_t{c_.h} * c_.w; }
  int64_t out_hw() const { return int64_t{c_.out_h()} * c_.out_w(); }
  Backend* const b_;
  const Pool2dConfig c_;
  std::unique_ptr<Pool2dPlan> plan_;
  NchwScratch s_;
};

class TransposingBatchNorm final : public BatchNormPlan {
 public:
  TransposingBatchNorm(Backend* b, const BatchNormConfig& c, std::unique_ptr<BatchNormPlan> plan,
                       NchwScratch s)
      : b_(b), c_(c), plan_(std::move(plan)), s_(std::move(s)) {}
  absl::Status ForwardTraining(const void* x, const float* gamma, const float* beta, void* y,
                               float* running_mean, float* running_var, float* save_mean,
                               float* save_inv_std) override {
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, x, s_.in.raw(), c_.n, c_.c, c_.spatial));
    PSTRAIN_RETURN_IF_ERROR(plan_->ForwardTraining(s_.in.raw(), gamma, beta, s_.out.raw(),
                                                   running_mean, running_var, save_mean,
                                                   save_inv_std));
    return ToNhwc(b_, s_.out.raw(), y, c_.n, c_.c, c_.spatial);
  }
  absl::Status ForwardInference(const void* x, const float* gamma, const float* beta,
                                const float* running_mean, const float* running_var,
                                void* y) override {
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, x, s_.in.raw(), c_.n, c_.c, c_.spatial));
    PSTRAIN_RETURN_IF_ERROR(
        plan_->ForwardInference(s_.in.raw(), gamma, beta, running_mean, running_var, s_.out.raw()));
    return ToNhwc(b_, s_.out.raw(), y, c_.n, c_.c, c_.spatial);
  }
  absl::Status Backward(const void* x, const void* dy, const float* gamma, const float* save_mean,
                        const float* save_inv_std, void* dx, float* dgamma, float* dbeta) override {
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, x, s_.in.raw(), c_.n, c_.c, c_.spatial));
    PSTRAIN_RETURN_IF_ERROR(ToNchw(b_, dy, s_.d_out.raw(), c_.n, c_.c, c_.spatial));
    PSTRAIN_RETURN_IF_ERROR(plan_->Backward(s_.in.raw(), s_.d_out.raw(), gamma, save_mean,
                                            save_inv_std, s_.d_in.raw(), dgamma, dbeta));
    return ToNhwc(b_, s_.d_in.raw(), dx, c_.n, c_.c, c_.spatial);
  }

 private:
  Backend* const b_;
  const BatchNormConfig c_;
  std::unique_ptr<BatchNormPlan> plan_;
  NchwScratch s_;
};

// The CPU backend, asking for channels last in fp32; everything else is the
// CPU's own.
class ChannelsLastCpuBackend final : public Backend {
 public:
  ChannelsLastCpuBackend() : cpu_(CreateCpuBackend()) {}

  bool ChannelsLast(DataType dtype) const override { return dtype == DataType::kF32; }
  int plans_transposed() const { return plans_transposed_; }

  absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateConv2d(const Conv2dConfig& config) override {
    if (config.layout != TensorLayout::kNHWC) return cpu_->CreateConv2d(config);
    Conv2dConfig nchw = config;
    nchw.layout = TensorLayout::kNCHW;
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Conv2dPlan> plan, cpu_->CreateConv2d(nchw));
    PSTRAIN_ASSIGN_OR_RETURN(
        NchwScratch s,
        MakeScratch(this, int64_t{config.n} * config.c * config.h * config.w,
                    int64_t{config.n} * config.filters * config.out_h() * config.out_w()));
    ++plans_transposed_;
    return std::make_unique<TransposingConv>(this, config, std::move(plan), std::move(s));
  }
  absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreatePool2d(const Pool2dConfig& config) override {
    if (config.layout != TensorLayout::kNHWC) return cpu_->CreatePool2d(config);
    Pool2dConfig nchw = config;
    nchw.layout = TensorLayout::kNCHW;
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Pool2dPlan> plan, cpu_->CreatePool2d(nchw));
    PSTRAIN_ASSIGN_OR_RETURN(
        NchwScratch s, MakeScratch(this, int64_t{config.n} * config.c * config.h * config.w,
                                   int64_t{config.n} * config.c * config.out_h() * config.out_w()));
    ++plans_transposed_;
    return std::make_unique<TransposingPool>(this, config, std::move(plan), std::move(s));
  }
  absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateBatchNorm(
      const BatchNormConfig& config) override {
    if (config.layout != TensorLayout::kNHWC || config.spatial == 1) {
      return cpu_->CreateBatchNorm(config);
    }
    BatchNormConfig nchw = config;
    nchw.layout = TensorLayout::kNCHW;
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<BatchNormPlan> plan, cpu_->CreateBatchNorm(nchw));
    const int64_t count = int64_t{config.n} * config.c * config.spatial;
    PSTRAIN_ASSIGN_OR_RETURN(NchwScratch s, MakeScratch(this, count, count));
    ++plans_transposed_;
    return std::make_unique<TransposingBatchNorm>(this, config, std::move(plan), std::move(s));
  }

  // --- The rest is the CPU backend's.
  DeviceType type() const override { return cpu_->type(); }
  std::string Describe() const override { return "channels-last " + cpu_->Describe(); }
  std::string DeviceName() const override { return cpu_->DeviceName(); }
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override { return cpu_->Allocate(bytes); }
  absl::StatusOr<PinnedBuffer> AllocatePinned(size_t bytes) override {
    return cpu_->AllocatePinned(bytes);
  }
  void Free(void* ptr) override { cpu_->Free(ptr); }
  void FreePinned(void* ptr) override { cpu_->FreePinned(ptr); }
  absl::Status CopyHostToDevice(void* dst, const void* src, size_t bytes) override {
    return cpu_->CopyHostToDevice(dst, src, bytes);
  }
  absl::Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) override {
    return cpu_->CopyDeviceToHost(dst, src, bytes);
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    return cpu_->CopyDeviceToDevice(dst, src, bytes);
  }
  absl::Status Synchronize() override { return cpu_->Synchronize(); }
  absl::StatusOr<std::unique_ptr<Event>> RecordEvent() override { return cpu_->RecordEvent(); }
  absl::Status Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                    const float* b, float beta, float* c) override {
    return cpu_->Gemm(ta, tb, m, n, k, alpha, a, b, beta, c);
  }
  absl::Status AddBias(float* y, const float* bias, int64_t outer, int64_t channels,
                       int64_t inner) override {
    return cpu_->AddBias(y, bias, outer, channels, inner);
  }
  absl::Status BiasGrad(const float* dy, float* dbias, int64_t outer, int64_t channels,
                        int64_t inner) override {
    return cpu_->BiasGrad(dy, dbias, outer, channels, inner);
  }
  absl::Status ActivationForward(Activation kind, float alpha, const float* x, float* y,
                                 int64_t count) override {
    return cpu_->ActivationForward(kind, alpha, x, y, count);
  }
  absl::Status ActivationBackward(Activation kind, float alpha, const float* x, const float* y,
                                  const float* dy, float* dx, int64_t count) override {
    return cpu_->ActivationBackward(kind, alpha, x, y, dy, dx, count);
  }
  absl::Status DropoutForward(const float* x, float* y, float* mask, int64_t count, float rate,
                              uint64_t seed) override {
    return cpu_->DropoutForward(x, y, mask, count, rate, seed);
  }
  absl::Status Multiply(const float* a, const float* b, float* y, int64_t count) override {
    return cpu_->Multiply(a, b, y, count);
  }
  absl::Status Add(const float* a, const float* b, float* y, int64_t count) override {
    return cpu_->Add(a, b, y, count);
  }
  absl::Status Axpy(float alpha, const float* x, float* y, int64_t count) override {
    return cpu_->Axpy(alpha, x, y, count);
  }
  absl::Status Scale(float alpha, float* x, int64_t count) override {
    return cpu_->Scale(alpha, x, count);
  }
  absl::Status Fill(float* x, float value, int64_t count) override {
    return cpu_->Fill(x, value, count);
  }
  absl::Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int64_t n,
                                   int64_t classes, float* loss, float* dlogits,
                                   float* probs) override {
    return cpu_->SoftmaxCrossEntropy(logits, labels, n, classes, loss, dlogits, probs);
  }
  absl::Status SgdUpdate(float* param, const float* grad, float* velocity, int64_t count,
                         const SgdHyper& hyper) override {
    return cpu_->SgdUpdate(param, grad, velocity, count, hyper);
  }
  absl::Status AdamUpdate(float* param, const float* grad, float* m, float* v, int64_t count,
                          const AdamHyper& hyper) override {
    return cpu_->AdamUpdate(param, grad, m, v, count, hyper);
  }
  absl::Status Transpose(DataType dtype, const void* x, void* y, int64_t batch, int64_t rows,
                         int64_t cols) override {
    return cpu_->Transpose(dtype, x, y, batch, rows, cols);
  }

 private:
  std::unique_ptr<Backend> cpu_;
  int plans_transposed_ = 0;
};

// A small residual CNN with every layer whose memory order matters: conv
// (with and without bias), batch norm, max pool (fused with its ReLU),
// average pool, a residual add, flatten from 4x4 positions, and a dense
// layer straight from an image-shaped input.
constexpr char kModel[] = R"({"name":"cl","input_shape":[3,8,8],"num_classes":5,"init_seed":7,
  "layers":[
  {"name":"c1","conv2d":{"filters":6,"kernel_size":3,"padding":1}},
  {"name":"bn1","batch_norm":{}},
  {"name":"r1","relu":{}},
  {"name":"c2","conv2d":{"filters":6,"kernel_size":3,"padding":1,"no_bias":true}},
  {"name":"sum","add":{},"inputs":["c2","r1"]},
  {"name":"r2","relu":{}},
  {"name":"p1","max_pool":{"pool_size":2}},
  {"name":"a1","avg_pool":{"pool_size":3,"stride":1,"padding":1}},
  {"name":"flat","flatten":{}},
  {"name":"fc1","dense":{"units":7}},
  {"name":"fc_img","dense":{"units":7},"inputs":["p1"]},
  {"name":"both","add":{},"inputs":["fc1","fc_img"]},
  {"name":"logits","dense":{"units":5}},
  {"name":"loss","softmax_cross_entropy":{}}]})";

struct StepResult {
  float loss = 0;
  std::vector<float> logits;
  std::vector<std::vector<float>> grads;
};

StepResult TrainStep(Backend* backend) {
  StepResult r;
  v1::ModelSpec spec;
  EXPECT_OK(google::protobuf::util::JsonStringToMessage(kModel, &spec));
  absl::StatusOr<std::unique_ptr<Model>> model = Model::Create(spec, backend);
  EXPECT_OK(model);
  if (!model.ok()) return r;
  EXPECT_OK((*model)->InitializeParameters());
  const int batch = 4;
  const int64_t image = (*model)->graph().input_shape.num_elements();
  std::vector<float> x(batch * image);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 2.f * UniformFloat(5, i) - 1.f;
  const std::vector<int32_t> labels = {0, 3, 4, 1};
  absl::StatusOr<Tensor> tx = backend->AllocateTensor(Shape{batch, image});
  absl::StatusOr<DeviceBuffer> tl = backend->Allocate(batch * sizeof(int32_t));
  EXPECT_OK(tx);
  EXPECT_OK(tl);
  EXPECT_OK(backend->CopyHostToDevice(tx->data(), x.data(), tx->bytes()));
  EXPECT_OK(backend->CopyHostToDevice(tl->data(), labels.data(), batch * 4));
  const absl::Status forward = (*model)->Forward(
      tx->data(), static_cast<const int32_t*>(tl->data()), batch, /*training=*/true, 11);
  EXPECT_OK(forward);
  const absl::Status backward = (*model)->Backward();
  EXPECT_OK(backward);
  EXPECT_OK(backend->CopyDeviceToHost(&r.loss, (*model)->loss(), sizeof(float)));
  r.logits.resize(batch * 5);
  EXPECT_OK(backend->CopyDeviceToHost(r.logits.data(), (*model)->logits(), r.logits.size() * 4));
  for (int p = 0; p < (*model)->num_params(); ++p) {
    if (!(*model)->param_info(p).trainable) continue;
    Tensor& g = (*model)->grad(p);
    std::vector<float> host(g.num_elements());
    EXPECT_OK(backend->CopyDeviceToHost(host.data(), g.data(), g.bytes()));
    r.grads.push_back(std::move(host));
  }
  EXPECT_OK(backend->Synchronize());
  return r;
}

TEST(ChannelsLastModelTest, AWholeStepMatchesTheNchwModelBitForBit) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  ChannelsLastCpuBackend channels_last;
  const StepResult nchw = TrainStep(cpu.get());
  const StepResult nhwc = TrainStep(&channels_last);
  // Both convolutions, both pools and the spatial batch norm ran channels last.
  EXPECT_EQ(channels_last.plans_transposed(), 5);
  ASSERT_TRUE(std::isfinite(nchw.loss));
  EXPECT_EQ(nhwc.loss, nchw.loss);
  EXPECT_EQ(nhwc.logits, nchw.logits);
  ASSERT_EQ(nhwc.grads.size(), nchw.grads.size());
  for (size_t p = 0; p < nchw.grads.size(); ++p) {
    EXPECT_EQ(nhwc.grads[p], nchw.grads[p]) << "gradient of trainable parameter " << p;
  }
}

}  // namespace
}  // namespace pstrain
