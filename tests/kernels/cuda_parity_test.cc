// Every op of the CUDA backend against the CPU backend on the same random
// inputs: relative error max|cuda - cpu| / max|cpu| <= 1e-4 (fp32, no TF32),
// dropout masks equal bit for bit. Shapes include the fmnist-cnn layers
// (batch 64) and a ResNet-style 3x3 stride-2 convolution.
//
// Every test that needs a GPU skips itself when CudaDeviceCount() == 0, so the
// suite passes on CPU-only machines and runs in full on a GPU. The test binary
// links in builds without CUDA too (it reaches the CUDA backend only through
// CreateBackend()).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/testing/kernel_configs.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::MakeConv;

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr double kTolerance = 1e-4;
constexpr int kCpu = 0;
constexpr int kCuda = 1;

std::vector<float> RandomVector(size_t count, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(count);
  for (float& v : out) v = dist(gen);
  return out;
}

// max|actual - expected| / max|expected|; also fails on non-finite values and,
// unless allow_zero, on an all-zero expectation (which would make the
// comparison vacuous).
void ExpectRelativelyClose(const std::vector<float>& actual, const std::vector<float>& expected,
                           const std::string& what, double tolerance = kTolerance,
                           bool allow_zero = false) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double max_diff = 0, max_ref = 0;
  size_t worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_TRUE(std::isfinite(actual[i])) << what << ": CUDA element " << i << " is " << actual[i];
    ASSERT_TRUE(std::isfinite(expected[i]))
        << what << ": CPU element " << i << " is " << expected[i];
    const double diff = std::abs(static_cast<double>(actual[i]) - expected[i]);
    if (diff > max_diff) {
      max_diff = diff;
      worst = i;
    }
    max_ref = std::max(max_ref, std::abs(static_cast<double>(expected[i])));
  }
  if (!allow_zero) {
    ASSERT_GT(max_ref, 0.0) << what << ": the CPU result is all zeros";
  }
  const double relative = max_ref > 0 ? max_diff / max_ref : max_diff;
  EXPECT_LE(relative, tolerance) << what << ": worst element " << worst << " cuda=" << actual[worst]
                                 << " cpu=" << expected[worst] << " (max |cpu| = " << max_ref
                                 << ")";
}

// The same buffer on both backends: t[kCpu] and t[kCuda].
struct Pair {
  std::array<Tensor, 2> t;
  float* operator[](int i) { return t[i].data(); }
};

class CudaParityTest : public ::pstrain::testing::CudaAndCpuBackendsTest {
 protected:
  Backend& backend(int i) { return i == kCpu ? *cpu_ : *cuda_; }

  // Uploads `host` to both backends (and waits, so `host` may be a temporary).
  Pair Make(const std::vector<float>& host) {
    Pair pair;
    for (int i : {kCpu, kCuda}) {
      absl::StatusOr<Tensor> t =
          backend(i).AllocateTensor(Shape{static_cast<int64_t>(host.size())});
      EXPECT_OK(t);
      if (!t.ok()) continue;
      pair.t[i] = *std::move(t);
      EXPECT_OK(backend(i).CopyHostToDevice(pair[i], host.data(), host.size() * sizeof(float)));
      EXPECT_OK(backend(i).Synchronize());
    }
    return pair;
  }
  Pair Zeros(size_t count) { return Make(std::vector<float>(count, 0.f)); }
  Pair Random(size_t count, uint32_t seed, float lo = -1.f, float hi = 1.f) {
    return Make(RandomVector(count, seed, lo, hi));
  }

  // Labels (int32) on both backends.
  std::array<DeviceBuffer, 2> MakeLabels(const std::vector<int32_t>& labels) {
    std::array<DeviceBuffer, 2> out;
    for (int i : {kCpu, kCuda}) {
      absl::StatusOr<DeviceBuffer> buffer = backend(i).Allocate(labels.size() * sizeof(int32_t));
      EXPECT_OK(buffer);
      if (!buffer.ok()) continue;
      out[i] = *std::move(buffer);
      EXPECT_OK(backend(i).CopyHostToDevice(out[i].data(), labels.data(),
                                            labels.size() * sizeof(int32_t)));
      EXPECT_OK(backend(i).Synchronize());
    }
    return out;
  }

  std::vector<float> Read(int i, const Tensor& t) {
    std::vector<float> out(t.num_elements());
    EXPECT_OK(backend(i).CopyDeviceToHost(out.data(), t.data(), t.bytes()));
    EXPECT_OK(backend(i).Synchronize());
    return out;
  }

  void ExpectParity(const Pair& pair, const std::string& what, double tolerance = kTolerance,
                    bool allow_zero = false) {
    ExpectRelativelyClose(Read(kCuda, pair.t[kCuda]), Read(kCpu, pair.t[kCpu]), what, tolerance,
                          allow_zero);
  }
};

// --- Device discovery (runs everywhere) ---------------------------------------

TEST(CudaDeviceTest, AskingForCudaWithoutDeviceFailsCleanly) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present";
  DeviceSpec spec;
  spec.automatic = false;
  spec.type = DeviceType::kCuda;
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(spec);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition) << backend.status();
  // "auto" falls back to the CPU.
  absl::StatusOr<std::unique_ptr<Backend>> automatic = CreateBackend(DeviceSpec{});
  ASSERT_OK(automatic);
  EXPECT_EQ((*automatic)->type(), DeviceType::kCpu);
}

TEST(CudaDeviceTest, OrdinalBeyondDeviceCountIsRejected) {
  DeviceSpec spec;
  spec.automatic = false;
  spec.type = DeviceType::kCuda;
  spec.ordinal = CudaDeviceCount();  // One past the last device.
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(spec);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition) << backend.status();
}

// --- Identity, memory, copies, events --------------------------------------------

TEST_F(CudaParityTest, DescribesDevice) {
  EXPECT_EQ(cuda_->type(), DeviceType::kCuda);
  EXPECT_EQ(cuda_->DeviceName(), "cuda:0");
  EXPECT_THAT(cuda_->Describe(), StartsWith("cuda:0 ("));
  EXPECT_THAT(cuda_->Describe(), HasSubstr("cuDNN 9."));
  EXPECT_THAT(cuda_->Describe(), HasSubstr("sm_"));
}

TEST_F(CudaParityTest, CopiesRoundTripThroughPinnedAndDeviceMemory) {
  const std::vector<float> host = RandomVector(1 << 20, 1);
  const size_t bytes = host.size() * sizeof(float);
  absl::StatusOr<PinnedBuffer> pinned = cuda_->AllocatePinned(bytes);
  ASSERT_OK(pinned);
  std::memcpy(pinned->data(), host.data(), bytes);
  absl::StatusOr<Tensor> a = cuda_->AllocateTensor(Shape{static_cast<int64_t>(host.size())});
  absl::StatusOr<Tensor> b = cuda_->AllocateTensor(Shape{static_cast<int64_t>(host.size())});
  ASSERT_OK(a);
  ASSERT_OK(b);
  ASSERT_OK(cuda_->CopyHostToDevice(a->data(), pinned->data(), bytes));
  ASSERT_OK(cuda_->CopyDeviceToDevice(b->data(), a->data(), bytes));
  std::vector<float> back(host.size(), -7.f);
  ASSERT_OK(cuda_->CopyDeviceToHost(back.data(), b->data(), bytes));
  absl::StatusOr<std::unique_ptr<Event>> event = cuda_->RecordEvent();
  ASSERT_OK(event);
  ASSERT_OK((*event)->Wait());
  EXPECT_EQ(std::memcmp(back.data(), host.data(), bytes), 0);
}

TEST_F(CudaParityTest, RejectsBadArguments) {
  EXPECT_EQ(cuda_->Gemm(false, false, -1, 2, 3, 1.f, nullptr, nullptr, 0.f, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  Conv2dConfig conv;  // All zeros.
  EXPECT_EQ(cuda_->CreateConv2d(conv).status().code(), absl::StatusCode::kInvalidArgument);
  Pair x = Random(16, 2);
  EXPECT_EQ(cuda_->DropoutForward(x[kCuda], x[kCuda], x[kCuda], 16, 1.f, 3).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda_->Fill(x[kCuda], 0.f, -1).code(), absl::StatusCode::kInvalidArgument);
  AdamHyper adam;
  adam.step = 0;
  EXPECT_EQ(cuda_->AdamUpdate(x[kCuda], x[kCuda], x[kCuda], x[kCuda], 16, adam).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_OK(cuda_->Synchronize());  // Nothing asynchronous went wrong.
}

// --- GEMM -------------------------------------------------------------------

struct GemmShape {
  int64_t m, n, k;
};

TEST_F(CudaParityTest, GemmMatchesCpuForEveryTransposition) {
  // fmnist-cnn dense 3136 -> 1024 at batch 64 (forward, and the shapes of its
  // two backward products), plus odd sizes that are no multiple of any tile.
  const GemmShape shapes[] = {{64, 1024, 3136}, {3136, 1024, 64}, {64, 3136, 1024},
                              {37, 19, 53},     {1, 1, 1},        {5, 7, 1}};
  uint32_t seed = 10;
  for (const GemmShape& s : shapes) {
    for (bool trans_a : {false, true}) {
      for (bool trans_b : {false, true}) {
        const std::string what = absl::StrCat("Gemm m=", s.m, " n=", s.n, " k=", s.k,
                                              " trans_a=", trans_a, " trans_b=", trans_b);
        Pair a = Random(s.m * s.k, ++seed);
        Pair b = Random(s.k * s.n, ++seed);
        Pair c = Random(s.m * s.n, ++seed);
        for (int i : {kCpu, kCuda}) {
          ASSERT_OK(
              backend(i).Gemm(trans_a, trans_b, s.m, s.n, s.k, 0.75f, a[i], b[i], 0.5f, c[i]));
        }
        ExpectParity(c, what);
      }
    }
  }
}

TEST_F(CudaParityTest, GemmMatchesHostReference) {
  // A direct check of the row-major translation, independent of the CPU
  // backend: C = A * B^T with A [2,3], B [4,3].
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1};
  const std::vector<float> expected = {1, 2, 3, 6, 4, 5, 6, 15};
  Pair da = Make(a), db = Make(b), dc = Zeros(8);
  ASSERT_OK(cuda_->Gemm(false, true, 2, 4, 3, 1.f, da[kCuda], db[kCuda], 0.f, dc[kCuda]));
  EXPECT_EQ(Read(kCuda, dc.t[kCuda]), expected);
}

// --- Bias ---------------------------------------------------------------------

TEST_F(CudaParityTest, AddBiasAndBiasGradMatchCpu) {
  const std::array<int64_t, 3> shapes[] = {{64, 32, 784}, {64, 1024, 1}, {3, 5, 7}, {1, 1, 1}};
  uint32_t seed = 100;
  for (const auto& [outer, channels, inner] : shapes) {
    const std::string what = absl::StrCat("[", outer, ", ", channels, ", ", inner, "]");
    Pair y = Random(outer * channels * inner, ++seed);
    Pair bias = Random(channels, ++seed);
    Pair dbias = Random(channels, ++seed);  // Must be overwritten.
    for (int i : {kCpu, kCuda}) {
      ASSERT_OK(backend(i).AddBias(y[i], bias[i], outer, channels, inner));
      ASSERT_OK(backend(i).BiasGrad(y[i], dbias[i], outer, channels, inner));
    }
    ExpectParity(y, "AddBias " + what);
    ExpectParity(dbias, "BiasGrad " + what);
  }
}

// --- Convolution --------------------------------------------------------------

TEST_F(CudaParityTest, ConvolutionForwardAndBackwardMatchCpu) {
  Conv2dConfig odd = MakeConv(2, 3, 9, 7, 4, 3, 1, 1);
  odd.kernel_w = 2;
  odd.stride_h = 2;
  odd.pad_w = 0;
  const std::pair<const char*, Conv2dConfig> configs[] = {
      {"fmnist conv1 1->32 5x5 pad 2", MakeConv(64, 1, 28, 28, 32, 5, 1, 2)},
      {"fmnist conv2 32->64 5x5 pad 2", MakeConv(64, 32, 14, 14, 64, 5, 1, 2)},
      {"resnet 3x3 stride 2 pad 1", MakeConv(8, 16, 16, 16, 32, 3, 2, 1)},
      {"resnet 1x1 stride 2 shortcut", MakeConv(8, 16, 16, 16, 32, 1, 2, 0)},
      {"non-square kernel and stride", odd},
  };
  uint32_t seed = 1000;
  for (const auto& [name, cfg] : configs) {
    SCOPED_TRACE(name);
    const int64_t x_count = int64_t{cfg.n} * cfg.c * cfg.h * cfg.w;
    const int64_t w_count = int64_t{cfg.filters} * cfg.c * cfg.kernel_h * cfg.kernel_w;
    const int64_t y_count = int64_t{cfg.n} * cfg.filters * cfg.out_h() * cfg.out_w();
    const float w_scale = 1.f / std::sqrt(static_cast<float>(cfg.c * cfg.kernel_h * cfg.kernel_w));
    Pair x = Random(x_count, ++seed);
    Pair w = Random(w_count, ++seed, -w_scale, w_scale);
    Pair bias = Random(cfg.filters, ++seed);
    Pair dy = Random(y_count, ++seed);
    Pair y = Zeros(y_count), y_no_bias = Zeros(y_count);
    Pair dx = Random(x_count, ++seed), dw = Random(w_count, ++seed);
    Pair dbias = Random(cfg.filters, ++seed);
    Pair dw_only = Random(w_count, ++seed);
    // Both passes in one call (on CUDA, the backward-filter pass on the side
    // stream), each result copied on the main stream straight after it: the
    // copies see the finished results only if the main stream waits for the
    // side stream.
    Pair dx_both = Random(x_count, ++seed), dw_both = Random(w_count, ++seed);
    Pair dbias_both = Random(cfg.filters, ++seed);
    Pair dx_copy = Zeros(x_count), dw_copy = Zeros(w_count), dbias_copy = Zeros(cfg.filters);
    for (int i : {kCpu, kCuda}) {
      absl::StatusOr<std::unique_ptr<Conv2dPlan>> plan = backend(i).CreateConv2d(cfg);
      ASSERT_OK(plan);
      ASSERT_OK((*plan)->Forward(x[i], w[i], bias[i], y[i]));
      ASSERT_OK((*plan)->Forward(x[i], w[i], nullptr, y_no_bias[i]));
      ASSERT_OK((*plan)->BackwardData(dy[i], w[i], dx[i]));
      ASSERT_OK((*plan)->BackwardFilter(x[i], dy[i], dw[i], dbias[i]));
      ASSERT_OK((*plan)->BackwardFilter(x[i], dy[i], dw_only[i], nullptr));
      ASSERT_OK((*plan)->Backward(x[i], dy[i], w[i], dx_both[i], dw_both[i], dbias_both[i]));
      ASSERT_OK(backend(i).CopyDeviceToDevice(dw_copy[i], dw_both[i], w_count * sizeof(float)));
      ASSERT_OK(
          backend(i).CopyDeviceToDevice(dbias_copy[i], dbias_both[i], cfg.filters * sizeof(float)));
      ASSERT_OK(backend(i).CopyDeviceToDevice(dx_copy[i], dx_both[i], x_count * sizeof(float)));
      ASSERT_OK(backend(i).Synchronize());
    }
    ExpectParity(y, "conv forward");
    ExpectParity(y_no_bias, "conv forward without bias");
    ExpectParity(dx, "conv backward data");
    ExpectParity(dw, "conv backward filter");
    ExpectParity(dbias, "conv bias gradient");
    ExpectParity(dw_only, "conv backward filter without bias");
    ExpectParity(dx_copy, "conv backward data, both passes in one call");
    ExpectParity(dw_copy, "conv backward filter, both passes in one call");
    ExpectParity(dbias_copy, "conv bias gradient, both passes in one call");
  }
}

// --- Pooling ------------------------------------------------------------------

TEST_F(CudaParityTest, PoolingForwardAndBackwardMatchCpu) {
  auto make = [](PoolMode mode, int n, int c, int h, int w, int window, int stride, int pad) {
    Pool2dConfig config;
    config.mode = mode;
    config.n = n;
    config.c = c;
    config.h = h;
    config.w = w;
    config.window = window;
    config.stride = stride;
    config.pad = pad;
    return config;
  };
  const std::pair<const char*, Pool2dConfig> configs[] = {
      {"fmnist max 2x2 on 28x28", make(PoolMode::kMax, 64, 32, 28, 28, 2, 2, 0)},
      {"fmnist max 2x2 on 14x14", make(PoolMode::kMax, 64, 64, 14, 14, 2, 2, 0)},
      {"resnet max 3x3 stride 2 pad 1", make(PoolMode::kMax, 4, 8, 15, 15, 3, 2, 1)},
      {"average 3x3 stride 2 pad 1 (padding excluded)",
       make(PoolMode::kAverage, 4, 8, 15, 15, 3, 2, 1)},
      {"average 2x2", make(PoolMode::kAverage, 2, 3, 8, 6, 2, 2, 0)},
  };
  uint32_t seed = 2000;
  for (const auto& [name, cfg] : configs) {
    SCOPED_TRACE(name);
    const int64_t x_count = int64_t{cfg.n} * cfg.c * cfg.h * cfg.w;
    const int64_t y_count = int64_t{cfg.n} * cfg.c * cfg.out_h() * cfg.out_w();
    Pair x = Random(x_count, ++seed);
    Pair dy = Random(y_count, ++seed);
    Pair y = Zeros(y_count);
    Pair dx = Random(x_count, ++seed);
    for (int i : {kCpu, kCuda}) {
      absl::StatusOr<std::unique_ptr<Pool2dPlan>> plan = backend(i).CreatePool2d(cfg);
      ASSERT_OK(plan);
      ASSERT_OK((*plan)->Forward(x[i], y[i], /*training=*/true));
      ASSERT_OK((*plan)->Backward(x[i], y[i], dy[i], dx[i]));
    }
    ExpectParity(y, "pool forward");
    ExpectParity(dx, "pool backward");
  }
}

// --- Batch norm ---------------------------------------------------------------

TEST_F(CudaParityTest, BatchNormTrainingInferenceAndBackwardMatchCpu) {
  BatchNormConfig conv_bn;  // After a convolution: [16, 8, 7x7].
  conv_bn.n = 16;
  conv_bn.c = 8;
  conv_bn.spatial = 49;
  conv_bn.momentum = 0.1f;
  BatchNormConfig dense_bn;  // After a dense layer: [64, 128].
  dense_bn.n = 64;
  dense_bn.c = 128;
  dense_bn.spatial = 1;
  dense_bn.epsilon = 1e-3f;
  dense_bn.momentum = 0.25f;
  // A resnet-sized one, split over many thread blocks per channel, with a
  // channel length (n * spatial) that does not divide evenly.
  BatchNormConfig wide_bn;
  wide_bn.n = 33;
  wide_bn.c = 5;
  wide_bn.spatial = 4097;
  // Planes of a multiple of 4 values, read 4 at a time: a walk through a
  // channel steps over several samples at once (13 units of 4 per plane,
  // 256 threads), and slices that begin and end inside a sample's plane.
  BatchNormConfig short_planes;
  short_planes.n = 37;
  short_planes.c = 3;
  short_planes.spatial = 52;
  BatchNormConfig long_planes;
  long_planes.n = 129;
  long_planes.c = 4;
  long_planes.spatial = 4100;
  uint32_t seed = 3000;
  for (const BatchNormConfig& cfg : {conv_bn, dense_bn, wide_bn, short_planes, long_planes}) {
    SCOPED_TRACE(absl::StrCat("batch norm [", cfg.n, ", ", cfg.c, ", ", cfg.spatial, "]"));
    const int64_t count = int64_t{cfg.n} * cfg.c * cfg.spatial;
    Pair x = Random(count, ++seed, -1.f, 3.f);  // Mean away from zero.
    Pair dy = Random(count, ++seed);
    Pair gamma = Random(cfg.c, ++seed, 0.5f, 1.5f);
    Pair beta = Random(cfg.c, ++seed);
    Pair running_mean = Random(cfg.c, ++seed);
    Pair running_var = Random(cfg.c, ++seed, 0.5f, 1.5f);
    Pair save_mean = Zeros(cfg.c), save_inv_std = Zeros(cfg.c);
    Pair y = Zeros(count), y_inference = Zeros(count), dx = Zeros(count);
    Pair dgamma = Random(cfg.c, ++seed), dbeta = Random(cfg.c, ++seed);
    for (int i : {kCpu, kCuda}) {
      absl::StatusOr<std::unique_ptr<BatchNormPlan>> plan = backend(i).CreateBatchNorm(cfg);
      ASSERT_OK(plan);
      ASSERT_OK((*plan)->ForwardTraining(x[i], gamma[i], beta[i], y[i], running_mean[i],
                                         running_var[i], save_mean[i], save_inv_std[i]));
      ASSERT_OK((*plan)->Backward(x[i], dy[i], gamma[i], save_mean[i], save_inv_std[i], dx[i],
                                  dgamma[i], dbeta[i]));
      ASSERT_OK((*plan)->ForwardInference(x[i], gamma[i], beta[i], running_mean[i], running_var[i],
                                          y_inference[i]));
    }
    ExpectParity(y, "training output");
    ExpectParity(running_mean, "running mean");
    ExpectParity(running_var, "running variance (unbiased)");
    ExpectParity(save_mean, "saved mean");
    ExpectParity(save_inv_std, "saved 1/sqrt(var + eps)");
    ExpectParity(dx, "dx");
    ExpectParity(dgamma, "dgamma");
    ExpectParity(dbeta, "dbeta");
    ExpectParity(y_inference, "inference output");
  }
}

// Channels last ([N, spatial, C]), as bf16 and fp16 models hold their
// activations on CUDA: the CUDA plan's results, put back in NCHW order on
// the host, against the CPU's NCHW plan. Channel counts below and above one
// block's 64 lanes, with and without 4-channel accesses.
TEST_F(CudaParityTest, ChannelsLastBatchNormMatchesCpu) {
  const std::array<std::array<int, 3>, 4> shapes = {
      {{7, 5, 81}, {4, 100, 36}, {64, 16, 1024}, {3, 64, 4}}};
  uint32_t seed = 3500;
  for (const std::array<int, 3>& shape : shapes) {
    // Plain locals (the lambdas below capture them; clang refuses captured
    // structured bindings before C++20's P1091).
    const int n = shape[0], c = shape[1], spatial = shape[2];
    SCOPED_TRACE(absl::StrCat("batch norm NHWC [", n, ", ", spatial, ", ", c, "]"));
    BatchNormConfig cfg;
    cfg.n = n;
    cfg.c = c;
    cfg.spatial = spatial;
    const int64_t count = int64_t{n} * c * spatial;
    const std::vector<float> x = RandomVector(count, ++seed, -1.f, 3.f);
    const std::vector<float> dy = RandomVector(count, ++seed, -1.f, 1.f);
    auto to_nhwc = [&](const std::vector<float>& v) {
      std::vector<float> out(v.size());
      for (int b = 0; b < n; ++b)
        for (int ch = 0; ch < c; ++ch)
          for (int i = 0; i < spatial; ++i)
            out[(int64_t{b} * spatial + i) * c + ch] = v[(int64_t{b} * c + ch) * spatial + i];
      return out;
    };
    auto to_nchw = [&](const std::vector<float>& v) {
      std::vector<float> out(v.size());
      for (int b = 0; b < n; ++b)
        for (int ch = 0; ch < c; ++ch)
          for (int i = 0; i < spatial; ++i)
            out[(int64_t{b} * c + ch) * spatial + i] = v[(int64_t{b} * spatial + i) * c + ch];
      return out;
    };
    Pair px = Make(x), pdy = Make(dy);
    // The CUDA side reads the channels-last copies.
    ASSERT_OK(cuda_->CopyHostToDevice(px[kCuda], to_nhwc(x).data(), count * sizeof(float)));
    ASSERT_OK(cuda_->CopyHostToDevice(pdy[kCuda], to_nhwc(dy).data(), count * sizeof(float)));
    ASSERT_OK(cuda_->Synchronize());
    Pair gamma = Random(c, ++seed, 0.5f, 1.5f), beta = Random(c, ++seed);
    Pair running_mean = Random(c, ++seed), running_var = Random(c, ++seed, 0.5f, 1.5f);
    Pair save_mean = Zeros(c), save_inv_std = Zeros(c);
    Pair y = Zeros(count), y_inference = Zeros(count), dx = Zeros(count);
    Pair dgamma = Zeros(c), dbeta = Zeros(c);
    for (int i : {kCpu, kCuda}) {
      BatchNormConfig config = cfg;
      config.layout = i == kCuda ? TensorLayout::kNHWC : TensorLayout::kNCHW;
      absl::StatusOr<std::unique_ptr<BatchNormPlan>> plan = backend(i).CreateBatchNorm(config);
      ASSERT_OK(plan);
      ASSERT_OK((*plan)->ForwardTraining(px[i], gamma[i], beta[i], y[i], running_mean[i],
                                         running_var[i], save_mean[i], save_inv_std[i]));
      ASSERT_OK((*plan)->Backward(px[i], pdy[i], gamma[i], save_mean[i], save_inv_std[i], dx[i],
                                  dgamma[i], dbeta[i]));
      ASSERT_OK((*plan)->ForwardInference(px[i], gamma[i], beta[i], running_mean[i], running_var[i],
                                          y_inference[i]));
    }
    ExpectRelativelyClose(to_nchw(Read(kCuda, y.t[kCuda])), Read(kCpu, y.t[kCpu]),
                          "training output");
    ExpectRelativelyClose(to_nchw(Read(kCuda, dx.t[kCuda])), Read(kCpu, dx.t[kCpu]), "dx");
    ExpectRelativelyClose(to_nchw(Read(kCuda, y_inference.t[kCuda])),
                          Read(kCpu, y_inference.t[kCpu]), "inference output");
    ExpectParity(running_mean, "running mean");
    ExpectParity(running_var, "running variance (unbiased)");
    ExpectParity(save_mean, "saved mean");
    ExpectParity(save_inv_std, "saved 1/sqrt(var + eps)");
    ExpectParity(dgamma, "dgamma");
    ExpectParity(dbeta, "dbeta");
  }
}

TEST_F(CudaParityTest, TransposeMatchesCpu) {
  const std::array<std::array<int64_t, 3>, 4> shapes = {
      {{1, 1, 1}, {3, 49, 64}, {2, 33, 70}, {5, 1000, 3}}};
  uint32_t seed = 3600;
  for (const auto& [batch, rows, cols] : shapes) {
    SCOPED_TRACE(absl::StrCat("transpose [", batch, ", ", rows, ", ", cols, "]"));
    const int64_t count = batch * rows * cols;
    Pair x = Random(count, ++seed), y = Zeros(count);
    for (int i : {kCpu, kCuda}) {
      ASSERT_OK(backend(i).Transpose(DataType::kF32, x[i], y[i], batch, rows, cols));
    }
    const std::vector<float> out = Read(kCuda, y.t[kCuda]);
    EXPECT_EQ(out, Read(kCpu, y.t[kCpu]));
    const std::vector<float> in = Read(kCpu, x.t[kCpu]);
    // One element checked by hand: [b = batch - 1][c = cols - 1][r = rows - 1].
    EXPECT_EQ(out[(batch - 1) * rows * cols + (cols - 1) * rows + rows - 1],
              in[(batch - 1) * rows * cols + (rows - 1) * cols + cols - 1]);
  }
}

// --- Element-wise -------------------------------------------------------------

// The element-wise kernels take 4 elements per access where the count is a
// multiple of 4 and every pointer is aligned to 4 elements, 1 otherwise:
// each case runs on an odd count, a multiple of 4, and a multiple of 4 from
// pointers one element past the buffers' (aligned) starts.
struct ElementwiseWalk {
  const char* name;
  int64_t count;
  int64_t offset;  // Elements skipped at the start of every buffer.
};
constexpr ElementwiseWalk kWalks[] = {
    {"odd count", 64 * 1024 + 3, 0},
    {"multiple of 4, aligned", 64 * 1024, 0},
    {"multiple of 4, misaligned", 64 * 1024 - 4, 1},
};

TEST_F(CudaParityTest, ActivationsMatchCpu) {
  const std::pair<const char*, Activation> kinds[] = {{"relu", Activation::kRelu},
                                                      {"leaky relu", Activation::kLeakyRelu},
                                                      {"tanh", Activation::kTanh},
                                                      {"sigmoid", Activation::kSigmoid}};
  uint32_t seed = 4000;
  for (const ElementwiseWalk& walk : kWalks) {
    const int64_t size = walk.count + walk.offset, at = walk.offset, count = walk.count;
    for (const auto& [name, kind] : kinds) {
      SCOPED_TRACE(absl::StrCat(name, ", ", walk.name));
      Pair x = Random(size, ++seed, -4.f, 4.f);
      Pair dy = Random(size, ++seed);
      Pair y = Zeros(size), dx = Zeros(size);
      for (int i : {kCpu, kCuda}) {
        ASSERT_OK(backend(i).ActivationForward(kind, 0.1f, x[i] + at, y[i] + at, count));
        ASSERT_OK(backend(i).ActivationBackward(kind, 0.1f, x[i] + at, y[i] + at, dy[i] + at,
                                                dx[i] + at, count));
      }
      ExpectParity(y, "forward");
      ExpectParity(dx, "backward");
    }
  }
}

TEST_F(CudaParityTest, DropoutMasksMatchCpuBitForBit) {
  const int64_t count = 64 * 1024 + 17;
  for (float rate : {0.f, 0.25f, 0.5f}) {
    SCOPED_TRACE(absl::StrCat("rate ", rate));
    Pair x = Random(count, 5000);
    Pair y = Zeros(count), mask = Zeros(count), dx = Zeros(count);
    Pair dy = Random(count, 5001);
    for (int i : {kCpu, kCuda}) {
      ASSERT_OK(backend(i).DropoutForward(x[i], y[i], mask[i], count, rate, 0xC0FFEEull));
      ASSERT_OK(backend(i).Multiply(dy[i], mask[i], dx[i], count));  // Dropout backward.
    }
    const std::vector<float> cuda_mask = Read(kCuda, mask.t[kCuda]);
    const std::vector<float> cpu_mask = Read(kCpu, mask.t[kCpu]);
    ASSERT_EQ(cuda_mask.size(), cpu_mask.size());
    EXPECT_EQ(std::memcmp(cuda_mask.data(), cpu_mask.data(), cuda_mask.size() * sizeof(float)), 0);
    const int64_t kept =
        std::count_if(cuda_mask.begin(), cuda_mask.end(), [](float m) { return m != 0.f; });
    EXPECT_NEAR(static_cast<double>(kept) / count, 1.0 - rate, 0.01);
    ExpectParity(y, "dropout output");
    ExpectParity(dx, "dropout backward");
  }
}

TEST_F(CudaParityTest, MultiplyAddAxpyScaleFillMatchCpu) {
  uint32_t seed = 6000;
  for (const ElementwiseWalk& walk : kWalks) {
    SCOPED_TRACE(walk.name);
    const int64_t size = walk.count + walk.offset, at = walk.offset, count = walk.count;
    Pair a = Random(size, ++seed), b = Random(size, ++seed);
    Pair product = Zeros(size), sum = Zeros(size), axpy = Random(size, ++seed);
    Pair scaled = Random(size, ++seed), filled = Zeros(size);
    for (int i : {kCpu, kCuda}) {
      ASSERT_OK(backend(i).Multiply(a[i] + at, b[i] + at, product[i] + at, count));
      ASSERT_OK(backend(i).Add(a[i] + at, b[i] + at, sum[i] + at, count));
      ASSERT_OK(backend(i).Axpy(-0.3f, a[i] + at, axpy[i] + at, count));
      ASSERT_OK(backend(i).Scale(1.7f, scaled[i] + at, count));
      ASSERT_OK(backend(i).Fill(filled[i] + at, 2.5f, count));
    }
    ExpectParity(product, "Multiply");
    ExpectParity(sum, "Add");
    ExpectParity(axpy, "Axpy");
    ExpectParity(scaled, "Scale");
    ExpectParity(filled, "Fill");
    const std::vector<float> fill = Read(kCuda, filled.t[kCuda]);
    EXPECT_TRUE(std::all_of(fill.begin() + at, fill.end(), [](float v) { return v == 2.5f; }));
  }
}

// --- Loss ---------------------------------------------------------------------

TEST_F(CudaParityTest, SoftmaxCrossEntropyMatchesCpu) {
  const std::pair<int64_t, int64_t> shapes[] = {{64, 10}, {5, 1000}, {1, 1}, {3, 257}};
  uint32_t seed = 7000;
  for (const auto& [n, classes] : shapes) {
    SCOPED_TRACE(absl::StrCat("n=", n, " classes=", classes));
    std::mt19937 gen(++seed);
    std::vector<int32_t> labels(n);
    for (int32_t& label : labels) label = static_cast<int32_t>(gen() % classes);
    std::array<DeviceBuffer, 2> device_labels = MakeLabels(labels);
    Pair logits = Random(n * classes, ++seed, -5.f, 5.f);
    Pair loss = Zeros(1), dlogits = Zeros(n * classes), probs = Zeros(n * classes);
    Pair loss_only = Zeros(1);
    for (int i : {kCpu, kCuda}) {
      const auto* l = static_cast<const int32_t*>(device_labels[i].data());
      ASSERT_OK(
          backend(i).SoftmaxCrossEntropy(logits[i], l, n, classes, loss[i], dlogits[i], probs[i]));
      ASSERT_OK(
          backend(i).SoftmaxCrossEntropy(logits[i], l, n, classes, loss_only[i], nullptr, nullptr));
      ASSERT_OK(backend(i).Synchronize());
    }
    // With one class the loss and gradient are exactly zero.
    const bool trivial = classes == 1;
    ExpectParity(loss, "loss", kTolerance, trivial);
    ExpectParity(loss_only, "loss without gradients", kTolerance, trivial);
    ExpectParity(dlogits, "dlogits", kTolerance, trivial);
    ExpectParity(probs, "probs");
  }
}

TEST_F(CudaParityTest, OutOfRangeLabelIsReportedBySynchronize) {
  const std::vector<int32_t> bad = {0, 10, 3};
  std::array<DeviceBuffer, 2> labels = MakeLabels(bad);
  Pair logits = Random(3 * 10, 7100), loss = Zeros(1), dlogits = Zeros(30);
  const auto* device_labels = static_cast<const int32_t*>(labels[kCuda].data());
  absl::Status call = cuda_->SoftmaxCrossEntropy(logits[kCuda], device_labels, 3, 10, loss[kCuda],
                                                 dlogits[kCuda], nullptr);
  // The label lives on the device: the error surfaces at the latest on the
  // next Synchronize().
  absl::Status reported = call.ok() ? cuda_->Synchronize() : call;
  EXPECT_EQ(reported.code(), absl::StatusCode::kInvalidArgument) << reported;
  EXPECT_THAT(reported.message(), HasSubstr("label 10"));
  // Reported once; the backend stays usable.
  EXPECT_OK(cuda_->Synchronize());
  std::array<DeviceBuffer, 2> good = MakeLabels({0, 9, 3});
  EXPECT_OK(cuda_->SoftmaxCrossEntropy(logits[kCuda],
                                       static_cast<const int32_t*>(good[kCuda].data()), 3, 10,
                                       loss[kCuda], dlogits[kCuda], nullptr));
  EXPECT_OK(cuda_->Synchronize());
  EXPECT_TRUE(std::isfinite(Read(kCuda, loss.t[kCuda])[0]));
}

// --- Optimizer updates ------------------------------------------------------------

TEST_F(CudaParityTest, SgdUpdatesMatchCpuOverSeveralSteps) {
  const int64_t count = 100003;
  SgdHyper plain;
  plain.learning_rate = 0.05f;
  SgdHyper momentum = plain;
  momentum.momentum = 0.9f;
  momentum.weight_decay = 1e-4f;
  SgdHyper nesterov = momentum;
  nesterov.nesterov = true;
  const std::pair<const char*, SgdHyper> cases[] = {
      {"plain", plain}, {"momentum + L2", momentum}, {"nesterov + L2", nesterov}};
  uint32_t seed = 8000;
  for (const auto& [name, hyper] : cases) {
    SCOPED_TRACE(name);
    Pair param = Random(count, ++seed);
    Pair velocity = Zeros(count);
    for (int step = 0; step < 5; ++step) {
      Pair grad = Random(count, ++seed);
      for (int i : {kCpu, kCuda}) {
        float* v = hyper.momentum != 0.f ? velocity[i] : nullptr;
        ASSERT_OK(backend(i).SgdUpdate(param[i], grad[i], v, count, hyper));
      }
    }
    ExpectParity(param, "param");
    if (hyper.momentum != 0.f) ExpectParity(velocity, "velocity");
  }
}

TEST_F(CudaParityTest, AdamUpdatesMatchCpuOverSeveralSteps) {
  const int64_t count = 100003;
  AdamHyper adam;
  adam.learning_rate = 1e-2f;
  adam.weight_decay = 1e-2f;
  AdamHyper adamw = adam;
  adamw.decoupled_weight_decay = true;
  const std::pair<const char*, AdamHyper> cases[] = {{"adam + L2", adam}, {"adamw", adamw}};
  uint32_t seed = 9000;
  for (const auto& [name, base] : cases) {
    SCOPED_TRACE(name);
    Pair param = Random(count, ++seed);
    Pair m = Zeros(count), v = Zeros(count);
    for (int step = 1; step <= 5; ++step) {
      AdamHyper hyper = base;
      hyper.step = step;
      Pair grad = Random(count, ++seed);
      for (int i : {kCpu, kCuda}) {
        ASSERT_OK(backend(i).AdamUpdate(param[i], grad[i], m[i], v[i], count, hyper));
      }
    }
    ExpectParity(param, "param");
    ExpectParity(m, "first moment");
    ExpectParity(v, "second moment");
  }
}

}  // namespace
}  // namespace pstrain
