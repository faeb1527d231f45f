// The CUDA backend's bf16 and fp16 ops (mixed precision) against the CPU
// backend's fp32 ops on the same inputs.
//
// Every input is first rounded to the reduced type on the host, and the CPU
// computes in fp32 from exactly those values. What is left between the two
// results is what the reduced type costs an op by construction: each element
// stored in it is rounded once, to nearest even, so it is off by at most u
// relative (the unit roundoff: 2^-8 for bf16, 2^-11 for fp16). Products of
// reduced-precision values are exact in fp32 and both sides accumulate in
// fp32, so the accumulation adds only fp32's own differences, which the fp32
// parity test bounds by 1e-4 (cuda_parity_test.cc). The tolerance of an op
// whose result is rounded r times on the way is therefore
//     max|cuda - cpu| / max|cpu| <= r * u + 1e-4,
// with r = 1 for single ops and r = 2 where an intermediate is stored in the
// reduced type too (a convolution's output before its bias is added).
//
// The convolution's backward passes round more often: cuDNN's tensor-core
// algorithms split their long sums (N*P*Q terms for backward-filter, 50,176
// for fmnist's conv1 at batch 64; K*R*S for backward-data) into blocks and
// store block results in the data type before combining them, a rounding
// per level. On an H200 with cuDNN 9.19 that measured, relative to the
// largest element: backward-filter 5.0 u (bf16) and 2.7 u (fp16),
// backward-data 2.1 u. The bounds are r = 8 and r = 4 for those passes:
// what cuDNN does, with room for another algorithm's choice of blocks, and
// still far below what a wrong layout, scale or missed bias would give.
//
// The GPU tests skip themselves without a CUDA device; the CPU backend's
// refusal runs everywhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend_options.h"
#include "tests/testing/kernel_configs.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::MakeConv;

using ::testing::HasSubstr;

// --- Host conversions (round to nearest even), the reference -----------------

uint16_t ToBf16Bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  if (std::isnan(f)) return 0x7fc0;
  x += 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

float FromBf16Bits(uint16_t b) {
  const uint32_t x = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

uint16_t ToF16Bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000;
  const uint32_t exp = (x >> 23) & 0xff;
  uint32_t mant = x & 0x7fffff;
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00 | (mant != 0 ? 0x200 : 0));
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  if (e <= 0) {  // Subnormal half, or zero.
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const int shift = 14 - e;
    uint32_t half = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // A carry may reach infinity.
  return static_cast<uint16_t>(sign | half);
}

float FromF16Bits(uint16_t h) {
  const int exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -24);
  } else if (exp == 31) {
    v = mant != 0 ? std::numeric_limits<float>::quiet_NaN()
                  : std::numeric_limits<float>::infinity();
  } else {
    v = std::ldexp(static_cast<float>(mant | 0x400), exp - 25);
  }
  return (h & 0x8000) != 0 ? -v : v;
}

uint16_t ToBits(DataType dtype, float f) {
  return dtype == DataType::kBF16 ? ToBf16Bits(f) : ToF16Bits(f);
}
float FromBits(DataType dtype, uint16_t b) {
  return dtype == DataType::kBF16 ? FromBf16Bits(b) : FromF16Bits(b);
}
float RoundTo(DataType dtype, float f) {
  return dtype == DataType::kF32 ? f : FromBits(dtype, ToBits(dtype, f));
}

double UnitRoundoff(DataType dtype) {
  return dtype == DataType::kBF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
}

// The bound of the file comment for r roundings.
double Bound(DataType dtype, int roundings) { return roundings * UnitRoundoff(dtype) + 1e-4; }

// [n, c, s] as [n, s, c] (channels last), and back, on the host.
std::vector<float> ToNhwc(const std::vector<float>& v, int64_t n, int64_t c, int64_t s) {
  std::vector<float> out(v.size());
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t ch = 0; ch < c; ++ch) {
      for (int64_t i = 0; i < s; ++i) out[(b * s + i) * c + ch] = v[(b * c + ch) * s + i];
    }
  }
  return out;
}
std::vector<float> ToNchw(const std::vector<float>& v, int64_t n, int64_t c, int64_t s) {
  std::vector<float> out(v.size());
  for (int64_t b = 0; b < n; ++b) {
    for (int64_t ch = 0; ch < c; ++ch) {
      for (int64_t i = 0; i < s; ++i) out[(b * c + ch) * s + i] = v[(b * s + i) * c + ch];
    }
  }
  return out;
}

constexpr TensorLayout kLayouts[] = {TensorLayout::kNCHW, TensorLayout::kNHWC};

std::vector<float> RandomRounded(DataType dtype, size_t count, uint32_t seed, float lo = -1.f,
                                 float hi = 1.f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(count);
  for (float& v : out) v = RoundTo(dtype, dist(gen));
  return out;
}

void ExpectClose(const std::vector<float>& actual, const std::vector<float>& expected,
                 const std::string& what, double tolerance) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double max_diff = 0, max_ref = 0;
  size_t worst = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_TRUE(std::isfinite(actual[i])) << what << ": element " << i << " is " << actual[i];
    const double diff = std::abs(static_cast<double>(actual[i]) - expected[i]);
    if (diff > max_diff) {
      max_diff = diff;
      worst = i;
    }
    max_ref = std::max(max_ref, std::abs(static_cast<double>(expected[i])));
  }
  ASSERT_GT(max_ref, 0.0) << what << ": the fp32 reference is all zeros";
  EXPECT_LE(max_diff / max_ref, tolerance)
      << what << ": worst element " << worst << " reduced=" << actual[worst]
      << " fp32=" << expected[worst] << " (max |fp32| = " << max_ref << ")";
}

class MixedPrecisionParityTest : public ::pstrain::testing::CudaAndCpuBackendsTest,
                                 public ::testing::WithParamInterface<DataType> {
 protected:
  void SetUp() override {
    CudaAndCpuBackendsTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(cuda_->SupportsDataType(dtype()));
  }

  DataType dtype() const { return GetParam(); }

  // `values` (already representable) on the GPU in dtype().
  Tensor Half(const std::vector<float>& values) {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = ToBits(dtype(), values[i]);
    absl::StatusOr<Tensor> t =
        cuda_->AllocateTensor(Shape{static_cast<int64_t>(values.size())}, dtype());
    EXPECT_OK(t);
    EXPECT_OK(cuda_->CopyHostToDevice(t->raw(), bits.data(), t->bytes()));
    EXPECT_OK(cuda_->Synchronize());
    return *std::move(t);
  }
  Tensor HalfZeros(size_t count) { return Half(std::vector<float>(count, 0.f)); }

  // `values` in fp32 on `backend`.
  Tensor F32(Backend& backend, const std::vector<float>& values) {
    absl::StatusOr<Tensor> t = backend.AllocateTensor(Shape{static_cast<int64_t>(values.size())});
    EXPECT_OK(t);
    EXPECT_OK(backend.CopyHostToDevice(t->raw(), values.data(), t->bytes()));
    EXPECT_OK(backend.Synchronize());
    return *std::move(t);
  }

  std::vector<float> Read(Backend& backend, const Tensor& t) {
    std::vector<float> out(t.num_elements());
    if (t.dtype() == DataType::kF32) {
      EXPECT_OK(backend.CopyDeviceToHost(out.data(), t.raw(), t.bytes()));
      EXPECT_OK(backend.Synchronize());
      return out;
    }
    std::vector<uint16_t> bits(t.num_elements());
    EXPECT_OK(backend.CopyDeviceToHost(bits.data(), t.raw(), t.bytes()));
    EXPECT_OK(backend.Synchronize());
    for (size_t i = 0; i < bits.size(); ++i) out[i] = FromBits(t.dtype(), bits[i]);
    return out;
  }

  // Activations (forward, and backward from the rounded forward output),
  // add and axpy on `count` elements, against the CPU's fp32 on the same
  // (representable) inputs: one rounding each.
  void CheckActivationsAddAxpy(int64_t count, uint32_t seed) {
    SCOPED_TRACE(absl::StrCat(count, " elements"));
    const std::vector<float> x = RandomRounded(dtype(), count, ++seed, -3.f, 3.f);
    const std::vector<float> b = RandomRounded(dtype(), count, ++seed);
    const std::vector<float> dy = RandomRounded(dtype(), count, ++seed);
    Tensor cx = F32(*cpu_, x), cb = F32(*cpu_, b), cdy = F32(*cpu_, dy);
    Tensor gx = Half(x), gb = Half(b), gdy = Half(dy);
    const std::pair<const char*, Activation> kinds[] = {{"relu", Activation::kRelu},
                                                        {"leaky relu", Activation::kLeakyRelu},
                                                        {"tanh", Activation::kTanh},
                                                        {"sigmoid", Activation::kSigmoid}};
    for (const auto& [name, kind] : kinds) {
      SCOPED_TRACE(name);
      Tensor cy = F32(*cpu_, std::vector<float>(count));
      Tensor cdx = F32(*cpu_, std::vector<float>(count));
      Tensor gy = HalfZeros(count), gdx = HalfZeros(count);
      ASSERT_OK(cpu_->ActivationForward(kind, 0.1f, cx.data(), cy.data(), count));
      ASSERT_OK(cuda_->ActivationForward(dtype(), kind, 0.1f, gx.raw(), gy.raw(), count));
      ExpectClose(Read(*cuda_, gy), Read(*cpu_, cy), "forward", Bound(dtype(), 1));
      // Backward reads the forward output, which the reduced type rounded
      // (tanh, sigmoid): the CPU gets that same output.
      Tensor cy_rounded = F32(*cpu_, Read(*cuda_, gy));
      ASSERT_OK(cpu_->ActivationBackward(kind, 0.1f, cx.data(), cy_rounded.data(), cdy.data(),
                                         cdx.data(), count));
      ASSERT_OK(cuda_->ActivationBackward(dtype(), kind, 0.1f, gx.raw(), gy.raw(), gdy.raw(),
                                          gdx.raw(), count));
      ExpectClose(Read(*cuda_, gdx), Read(*cpu_, cdx), "backward", Bound(dtype(), 1));
    }
    Tensor cy = F32(*cpu_, std::vector<float>(count)), gy = HalfZeros(count);
    ASSERT_OK(cpu_->Add(cx.data(), cb.data(), cy.data(), count));
    ASSERT_OK(cuda_->Add(dtype(), gx.raw(), gb.raw(), gy.raw(), count));
    ExpectClose(Read(*cuda_, gy), Read(*cpu_, cy), "add", Bound(dtype(), 1));
    Tensor cz = F32(*cpu_, b), gz = Half(b);
    ASSERT_OK(cpu_->Axpy(0.5f, cx.data(), cz.data(), count));
    ASSERT_OK(cuda_->Axpy(dtype(), 0.5f, gx.raw(), gz.raw(), count));
    ExpectClose(Read(*cuda_, gz), Read(*cpu_, cz), "axpy", Bound(dtype(), 1));
  }

  // A convolution's forward pass (with bias) and both backward passes in
  // dtype(), in each of `layouts`, against the CPU's fp32 on the same
  // (representable) inputs.
  void CheckConvolution(const Conv2dConfig& base, uint32_t* seed,
                        std::initializer_list<TensorLayout> layouts) {
    Conv2dConfig cfg = base;
    const int64_t x_count = int64_t{cfg.n} * cfg.c * cfg.h * cfg.w;
    const int64_t w_count = int64_t{cfg.filters} * cfg.c * cfg.kernel_h * cfg.kernel_w;
    const int64_t y_count = int64_t{cfg.n} * cfg.filters * cfg.out_h() * cfg.out_w();
    const float w_scale = 1.f / std::sqrt(static_cast<float>(cfg.c * cfg.kernel_h * cfg.kernel_w));
    const std::vector<float> x = RandomRounded(dtype(), x_count, ++*seed);
    const std::vector<float> w = RandomRounded(dtype(), w_count, ++*seed, -w_scale, w_scale);
    const std::vector<float> bias = RandomRounded(dtype(), cfg.filters, ++*seed);
    const std::vector<float> dy = RandomRounded(dtype(), y_count, ++*seed);

    cfg.dtype = DataType::kF32;
    absl::StatusOr<std::unique_ptr<Conv2dPlan>> cpu_plan = cpu_->CreateConv2d(cfg);
    ASSERT_OK(cpu_plan);
    Tensor cx = F32(*cpu_, x), cw = F32(*cpu_, w), cb = F32(*cpu_, bias), cdy = F32(*cpu_, dy);
    Tensor cy = F32(*cpu_, std::vector<float>(y_count)),
           cdx = F32(*cpu_, std::vector<float>(x_count));
    Tensor cdw = F32(*cpu_, std::vector<float>(w_count)),
           cdb = F32(*cpu_, std::vector<float>(cfg.filters));
    ASSERT_OK((*cpu_plan)->Forward(cx.raw(), cw.raw(), cb.raw(), cy.raw()));
    ASSERT_OK(
        (*cpu_plan)->Backward(cx.raw(), cdy.raw(), cw.raw(), cdx.raw(), cdw.raw(), cdb.raw()));

    // Channels last: x, y and their gradients as [N, H, W, C]; w, dw and
    // the bias as in NCHW.
    const int64_t in_hw = int64_t{cfg.h} * cfg.w, out_hw = int64_t{cfg.out_h()} * cfg.out_w();
    for (TensorLayout layout : layouts) {
      SCOPED_TRACE(TensorLayoutName(layout));
      const bool nhwc = layout == TensorLayout::kNHWC;
      cfg.dtype = dtype();
      cfg.layout = layout;
      absl::StatusOr<std::unique_ptr<Conv2dPlan>> gpu_plan = cuda_->CreateConv2d(cfg);
      ASSERT_OK(gpu_plan);
      Tensor gx = Half(nhwc ? ToNhwc(x, cfg.n, cfg.c, in_hw) : x), gw = Half(w), gb = Half(bias);
      Tensor gdy = Half(nhwc ? ToNhwc(dy, cfg.n, cfg.filters, out_hw) : dy);
      Tensor gy = HalfZeros(y_count), gdx = HalfZeros(x_count), gdw = HalfZeros(w_count);
      Tensor gdb = HalfZeros(cfg.filters);
      ASSERT_OK((*gpu_plan)->Forward(gx.raw(), gw.raw(), gb.raw(), gy.raw()));
      ASSERT_OK(
          (*gpu_plan)->Backward(gx.raw(), gdy.raw(), gw.raw(), gdx.raw(), gdw.raw(), gdb.raw()));
      ASSERT_OK(cuda_->Synchronize());
      std::vector<float> y_out = Read(*cuda_, gy), dx_out = Read(*cuda_, gdx);
      if (nhwc) {
        y_out = ToNchw(y_out, cfg.n, cfg.filters, out_hw);
        dx_out = ToNchw(dx_out, cfg.n, cfg.c, in_hw);
      }
      ExpectClose(y_out, Read(*cpu_, cy), "forward (+ bias)", Bound(dtype(), 2));
      ExpectClose(dx_out, Read(*cpu_, cdx), "backward data", Bound(dtype(), 4));
      ExpectClose(Read(*cuda_, gdw), Read(*cpu_, cdw), "backward filter", Bound(dtype(), 8));
      ExpectClose(Read(*cuda_, gdb), Read(*cpu_, cdb), "bias gradient", Bound(dtype(), 1));
    }
  }

  // Convolutions of the example models in both layouts.
  void CheckModelConvolutions() {
    const std::pair<const char*, Conv2dConfig> configs[] = {
        {"fmnist conv1 1->32 5x5 pad 2", MakeConv(64, 1, 28, 28, 32, 5, 1, 2)},
        {"fmnist conv2 32->64 5x5 pad 2", MakeConv(64, 32, 14, 14, 64, 5, 1, 2)},
        {"resnet 3x3 pad 1", MakeConv(16, 64, 32, 32, 64, 3, 1, 1)},
        {"resnet 3x3 stride 2 pad 1", MakeConv(8, 16, 16, 16, 32, 3, 2, 1)},
        {"resnet 1x1 stride 2 shortcut", MakeConv(8, 16, 16, 16, 32, 1, 2, 0)},
    };
    uint32_t seed = 1000;
    for (const auto& [name, config] : configs) {
      SCOPED_TRACE(name);
      CheckConvolution(config, &seed, {TensorLayout::kNCHW, TensorLayout::kNHWC});
    }
  }

  // Channels-last shapes that pstrain's own narrow-convolution kernels take
  // (narrow_conv_kernels.cu: channels and filters multiples of 16), where
  // they are measured fastest, or always in OwnConvParityTest: rows of
  // output positions that are not a multiple of 16, strides, padding on
  // every side, 1x1 and 5x5 kernels, and a weight gradient too large for
  // them (5x5 to 48 filters: 75 tiles) whose forward pass they still run.
  void CheckNarrowChannelsLastConvolutions() {
    const std::pair<const char*, Conv2dConfig> configs[] = {
        {"resnet block1 16->16 3x3 pad 1, 64x64", MakeConv(4, 16, 64, 64, 16, 3, 1, 1)},
        {"16->16 3x3 pad 1, rows of 20", MakeConv(4, 16, 20, 20, 16, 3, 1, 1)},
        {"16->32 3x3 stride 2 pad 1, rows of 17", MakeConv(4, 16, 33, 33, 32, 3, 2, 1)},
        {"16->16 3x3 stride 2 pad 1, 9x23", MakeConv(3, 16, 9, 23, 16, 3, 2, 1)},
        {"32->64 1x1 stride 2, rows of 8", MakeConv(4, 32, 15, 15, 64, 1, 2, 0)},
        {"32->32 3x3 pad 1, 32x32", MakeConv(2, 32, 32, 32, 32, 3, 1, 1)},
        {"16->48 5x5 pad 2", MakeConv(2, 16, 12, 12, 48, 5, 1, 2)},
    };
    uint32_t seed = 3000;
    for (const auto& [name, config] : configs) {
      SCOPED_TRACE(name);
      CheckConvolution(config, &seed, {TensorLayout::kNHWC});
    }
  }
};

TEST_P(MixedPrecisionParityTest, ConvertRoundsToNearestEvenAndFlagsNonFiniteResults) {
  std::vector<float> values = {0.f,      -0.f,  1.f,   -1.f,   1.f / 3.f,   3.14159265f,  1e-3f,
                               -65504.f, 1e-6f, 1e-8f, 255.5f, 1.00390625f, 1.001953125f, 60000.f};
  for (float v : RandomRounded(DataType::kF32, 1000, 7, -100.f, 100.f)) values.push_back(v);
  const int64_t n = static_cast<int64_t>(values.size());
  Tensor in = F32(*cuda_, values);
  Tensor half = HalfZeros(values.size());
  absl::StatusOr<Tensor> back = cuda_->AllocateTensor(Shape{n});
  ASSERT_OK(back);
  absl::StatusOr<DeviceBuffer> flag = cuda_->Allocate(sizeof(int32_t));
  ASSERT_OK(flag);
  const int32_t zero = 0;
  ASSERT_OK(cuda_->CopyHostToDevice(flag->data(), &zero, sizeof(zero)));
  int32_t* flag_ptr = static_cast<int32_t*>(flag->data());

  ASSERT_OK(cuda_->Convert(DataType::kF32, in.raw(), dtype(), half.raw(), n, 1.f, flag_ptr));
  ASSERT_OK(cuda_->Convert(dtype(), half.raw(), DataType::kF32, back->raw(), n, 0.5f, flag_ptr));
  std::vector<float> rounded = Read(*cuda_, half);
  std::vector<float> halved = Read(*cuda_, *back);
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(ToBits(dtype(), rounded[i]), ToBits(dtype(), values[i]))
        << "value " << values[i] << " rounded to " << rounded[i] << ", expected "
        << RoundTo(dtype(), values[i]);
    ASSERT_EQ(halved[i], 0.5f * RoundTo(dtype(), values[i])) << "value " << values[i];
  }
  int32_t seen = -1;
  ASSERT_OK(cuda_->CopyDeviceToHost(&seen, flag->data(), sizeof(seen)));
  ASSERT_OK(cuda_->Synchronize());
  EXPECT_EQ(seen, 0) << "finite results raised the flag";

  // Overflow of the target type (fp16 above 65504; bf16 only beyond fp32's
  // range), and NaN, raise it.
  Tensor big = F32(*cuda_, {1.f, 3e38f, 2.f});
  ASSERT_OK(cuda_->Convert(DataType::kF32, big.raw(), dtype(), half.raw(), 3, 10.f, flag_ptr));
  ASSERT_OK(cuda_->CopyDeviceToHost(&seen, flag->data(), sizeof(seen)));
  ASSERT_OK(cuda_->Synchronize());
  EXPECT_EQ(seen, 1);
  EXPECT_TRUE(std::isinf(Read(*cuda_, half)[1]));
}

TEST_P(MixedPrecisionParityTest, GemmMatchesFp32ForEveryTransposition) {
  // fmnist-cnn's dense layers (batch 64), and an odd shape.
  struct Shape3 {
    int64_t m, n, k;
  };
  uint32_t seed = 100;
  for (const Shape3 s : {Shape3{64, 128, 3136}, Shape3{64, 10, 128}, Shape3{33, 17, 65}}) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = (t & 1) != 0, tb = (t & 2) != 0;
      SCOPED_TRACE(absl::StrCat(s.m, "x", s.n, "x", s.k, " trans_a=", ta, " trans_b=", tb));
      const float scale = 1.f / std::sqrt(static_cast<float>(s.k));
      std::vector<float> a = RandomRounded(dtype(), s.m * s.k, ++seed);
      std::vector<float> b = RandomRounded(dtype(), s.k * s.n, ++seed, -scale, scale);
      Tensor a_cpu = F32(*cpu_, a), b_cpu = F32(*cpu_, b),
             c_cpu = F32(*cpu_, std::vector<float>(s.m * s.n));
      ASSERT_OK(
          cpu_->Gemm(ta, tb, s.m, s.n, s.k, 1.f, a_cpu.data(), b_cpu.data(), 0.f, c_cpu.data()));
      Tensor a_gpu = Half(a), b_gpu = Half(b), c_gpu = HalfZeros(s.m * s.n);
      ASSERT_OK(cuda_->Gemm(dtype(), ta, tb, s.m, s.n, s.k, 1.f, a_gpu.raw(), b_gpu.raw(), 0.f,
                            c_gpu.raw()));
      ExpectClose(Read(*cuda_, c_gpu), Read(*cpu_, c_cpu), "gemm", Bound(dtype(), 1));
    }
  }
}

TEST_P(MixedPrecisionParityTest, ConvolutionForwardAndBackwardMatchFp32) {
  CheckModelConvolutions();
}

TEST_P(MixedPrecisionParityTest, NarrowChannelsLastConvolutionsMatchFp32) {
  CheckNarrowChannelsLastConvolutions();
}

// The same convolutions with pstrain's own narrow-convolution kernels
// (kernels/cuda/narrow_conv_kernels.cu) forced wherever they apply instead of
// measured against cuDNN's (CudaBackendOptions::own_conv).
class OwnConvParityTest : public MixedPrecisionParityTest {
 protected:
  CudaBackendOptions CudaOptions() const override {
    CudaBackendOptions options = MixedPrecisionParityTest::CudaOptions();
    options.own_conv = CudaRoutePolicy::kAlways;
    return options;
  }
};

TEST_P(OwnConvParityTest, ConvolutionForwardAndBackwardMatchFp32) { CheckModelConvolutions(); }

TEST_P(OwnConvParityTest, NarrowChannelsLastConvolutionsMatchFp32) {
  CheckNarrowChannelsLastConvolutions();
}

TEST_P(MixedPrecisionParityTest, PoolingAndBatchNormMatchFp32) {
  uint32_t seed = 2000;
  for (PoolMode mode : {PoolMode::kMax, PoolMode::kAverage}) {
    SCOPED_TRACE(mode == PoolMode::kMax ? "max pool" : "average pool");
    Pool2dConfig cfg;
    cfg.mode = mode;
    cfg.n = 16;
    cfg.c = 32;
    cfg.h = cfg.w = 14;
    cfg.window = 2;
    cfg.stride = 2;
    const int64_t x_count = int64_t{cfg.n} * cfg.c * cfg.h * cfg.w;
    const int64_t y_count = int64_t{cfg.n} * cfg.c * cfg.out_h() * cfg.out_w();
    const std::vector<float> x = RandomRounded(dtype(), x_count, ++seed);
    const std::vector<float> dy = RandomRounded(dtype(), y_count, ++seed);
    absl::StatusOr<std::unique_ptr<Pool2dPlan>> cpu_plan = cpu_->CreatePool2d(cfg);
    ASSERT_OK(cpu_plan);
    Tensor cx = F32(*cpu_, x), cdy = F32(*cpu_, dy), cy = F32(*cpu_, std::vector<float>(y_count));
    Tensor cdx = F32(*cpu_, std::vector<float>(x_count));
    ASSERT_OK((*cpu_plan)->Forward(cx.raw(), cy.raw(), true));
    ASSERT_OK((*cpu_plan)->Backward(cx.raw(), cy.raw(), cdy.raw(), cdx.raw()));
    const int64_t in_hw = int64_t{cfg.h} * cfg.w, out_hw = int64_t{cfg.out_h()} * cfg.out_w();
    for (TensorLayout layout : kLayouts) {
      SCOPED_TRACE(TensorLayoutName(layout));
      const bool nhwc = layout == TensorLayout::kNHWC;
      cfg.dtype = dtype();
      cfg.layout = layout;
      absl::StatusOr<std::unique_ptr<Pool2dPlan>> gpu_plan = cuda_->CreatePool2d(cfg);
      ASSERT_OK(gpu_plan);
      Tensor gx = Half(nhwc ? ToNhwc(x, cfg.n, cfg.c, in_hw) : x);
      Tensor gdy = Half(nhwc ? ToNhwc(dy, cfg.n, cfg.c, out_hw) : dy);
      Tensor gy = HalfZeros(y_count), gdx = HalfZeros(x_count);
      ASSERT_OK((*gpu_plan)->Forward(gx.raw(), gy.raw(), true));
      ASSERT_OK((*gpu_plan)->Backward(gx.raw(), gy.raw(), gdy.raw(), gdx.raw()));
      std::vector<float> y_out = Read(*cuda_, gy), dx_out = Read(*cuda_, gdx);
      if (nhwc) {
        y_out = ToNchw(y_out, cfg.n, cfg.c, out_hw);
        dx_out = ToNchw(dx_out, cfg.n, cfg.c, in_hw);
      }
      ExpectClose(y_out, Read(*cpu_, cy), "forward", Bound(dtype(), 1));
      ExpectClose(dx_out, Read(*cpu_, cdx), "backward", Bound(dtype(), 1));
    }
  }

  BatchNormConfig cfg;  // After a resnet convolution: [32, 16, 8x8].
  cfg.n = 32;
  cfg.c = 16;
  cfg.spatial = 64;
  const int64_t count = int64_t{cfg.n} * cfg.c * cfg.spatial;
  const std::vector<float> x = RandomRounded(dtype(), count, ++seed, -1.f, 3.f);
  const std::vector<float> dy = RandomRounded(dtype(), count, ++seed);
  const std::vector<float> gamma = RandomRounded(DataType::kF32, cfg.c, ++seed, 0.5f, 1.5f);
  const std::vector<float> beta = RandomRounded(DataType::kF32, cfg.c, ++seed);
  const std::vector<float> ones(cfg.c, 1.f), zeros(cfg.c, 0.f);
  // Per backend: running mean, running var, save mean, save inv std, dgamma, dbeta.
  std::vector<Tensor> c_stats, g_stats;
  for (int i = 0; i < 6; ++i) {
    c_stats.push_back(F32(*cpu_, i == 1 ? ones : zeros));
    g_stats.push_back(F32(*cuda_, i == 1 ? ones : zeros));
  }
  Tensor cg = F32(*cpu_, gamma), cbeta = F32(*cpu_, beta), gg = F32(*cuda_, gamma);
  Tensor gbeta = F32(*cuda_, beta);
  absl::StatusOr<std::unique_ptr<BatchNormPlan>> cpu_plan = cpu_->CreateBatchNorm(cfg);
  ASSERT_OK(cpu_plan);
  Tensor cx = F32(*cpu_, x), cdy = F32(*cpu_, dy), cy = F32(*cpu_, std::vector<float>(count));
  Tensor cdx = F32(*cpu_, std::vector<float>(count)), cyi = F32(*cpu_, std::vector<float>(count));
  ASSERT_OK((*cpu_plan)->ForwardTraining(cx.raw(), cg.data(), cbeta.data(), cy.raw(),
                                         c_stats[0].data(), c_stats[1].data(), c_stats[2].data(),
                                         c_stats[3].data()));
  ASSERT_OK((*cpu_plan)->Backward(cx.raw(), cdy.raw(), cg.data(), c_stats[2].data(),
                                  c_stats[3].data(), cdx.raw(), c_stats[4].data(),
                                  c_stats[5].data()));
  ASSERT_OK((*cpu_plan)->ForwardInference(cx.raw(), cg.data(), cbeta.data(), c_stats[0].data(),
                                          c_stats[1].data(), cyi.raw()));
  for (TensorLayout layout : kLayouts) {
    SCOPED_TRACE(TensorLayoutName(layout));
    const bool nhwc = layout == TensorLayout::kNHWC;
    for (int i = 0; i < 6; ++i) g_stats[i] = F32(*cuda_, i == 1 ? ones : zeros);
    cfg.dtype = dtype();
    cfg.layout = layout;
    absl::StatusOr<std::unique_ptr<BatchNormPlan>> gpu_plan = cuda_->CreateBatchNorm(cfg);
    ASSERT_OK(gpu_plan);
    Tensor gx = Half(nhwc ? ToNhwc(x, cfg.n, cfg.c, cfg.spatial) : x);
    Tensor gdy = Half(nhwc ? ToNhwc(dy, cfg.n, cfg.c, cfg.spatial) : dy);
    Tensor gy = HalfZeros(count), gdx = HalfZeros(count), gyi = HalfZeros(count);
    ASSERT_OK((*gpu_plan)->ForwardTraining(gx.raw(), gg.data(), gbeta.data(), gy.raw(),
                                           g_stats[0].data(), g_stats[1].data(), g_stats[2].data(),
                                           g_stats[3].data()));
    ASSERT_OK((*gpu_plan)->Backward(gx.raw(), gdy.raw(), gg.data(), g_stats[2].data(),
                                    g_stats[3].data(), gdx.raw(), g_stats[4].data(),
                                    g_stats[5].data()));
    ASSERT_OK((*gpu_plan)->ForwardInference(gx.raw(), gg.data(), gbeta.data(), g_stats[0].data(),
                                            g_stats[1].data(), gyi.raw()));
    std::vector<float> y_out = Read(*cuda_, gy), dx_out = Read(*cuda_, gdx);
    std::vector<float> yi_out = Read(*cuda_, gyi);
    if (nhwc) {
      y_out = ToNchw(y_out, cfg.n, cfg.c, cfg.spatial);
      dx_out = ToNchw(dx_out, cfg.n, cfg.c, cfg.spatial);
      yi_out = ToNchw(yi_out, cfg.n, cfg.c, cfg.spatial);
    }
    ExpectClose(y_out, Read(*cpu_, cy), "batch norm training output", Bound(dtype(), 1));
    ExpectClose(dx_out, Read(*cpu_, cdx), "batch norm dx", Bound(dtype(), 1));
    ExpectClose(yi_out, Read(*cpu_, cyi), "batch norm inference output", Bound(dtype(), 1));
    const char* stat_names[] = {"running mean", "running var", "saved mean",
                                "saved 1/std",  "dgamma",      "dbeta"};
    for (int i = 0; i < 6; ++i) {
      // fp32 outputs from the same (rounded) inputs: fp32's bound.
      ExpectClose(Read(*cuda_, g_stats[i]), Read(*cpu_, c_stats[i]), stat_names[i], 1e-4);
    }
  }
}

// The element-wise kernels walk 1 element at a time on an odd count and 4
// at a time (8-byte accesses in bf16 and fp16) on a multiple of 4 from
// aligned buffers; both walks, with the same bounds.
TEST_P(MixedPrecisionParityTest, ActivationsAddAndAxpyMatchFp32OnBothWalks) {
  CheckActivationsAddAxpy(64 * 1024 + 3, 3000);
  CheckActivationsAddAxpy(64 * 1024, 3500);
}

// Multiply, dropout, bias and the loss (activations, add and axpy:
// ActivationsAddAndAxpyMatchFp32OnBothWalks).
TEST_P(MixedPrecisionParityTest, ElementwiseOpsAndLossMatchFp32) {
  const int64_t count = 64 * 1024 + 3;
  uint32_t seed = 3000;
  const std::vector<float> x = RandomRounded(dtype(), count, ++seed, -3.f, 3.f);
  const std::vector<float> b = RandomRounded(dtype(), count, ++seed);
  Tensor cx = F32(*cpu_, x), cb = F32(*cpu_, b);
  Tensor gx = Half(x), gb = Half(b);
  Tensor cy = F32(*cpu_, std::vector<float>(count)), gy = HalfZeros(count);
  ASSERT_OK(cpu_->Multiply(cx.data(), cb.data(), cy.data(), count));
  ASSERT_OK(cuda_->Multiply(dtype(), gx.raw(), gb.raw(), gy.raw(), count));
  ExpectClose(Read(*cuda_, gy), Read(*cpu_, cy), "multiply", Bound(dtype(), 1));

  // Dropout: the same keep decisions; y = x * 1/(1 - rate), rounded.
  Tensor cmask = F32(*cpu_, std::vector<float>(count)), gmask = HalfZeros(count);
  ASSERT_OK(cpu_->DropoutForward(cx.data(), cy.data(), cmask.data(), count, 0.3f, 77));
  ASSERT_OK(cuda_->DropoutForward(dtype(), gx.raw(), gy.raw(), gmask.raw(), count, 0.3f, 77));
  ExpectClose(Read(*cuda_, gy), Read(*cpu_, cy), "dropout output", Bound(dtype(), 2));
  ExpectClose(Read(*cuda_, gmask), Read(*cpu_, cmask), "dropout mask", Bound(dtype(), 1));

  // Bias (dense: inner 1; convolution: inner 49).
  for (int64_t inner : {int64_t{1}, int64_t{49}}) {
    SCOPED_TRACE(absl::StrCat("bias inner ", inner));
    const int64_t outer = 16, channels = 32, n = outer * channels * inner;
    const std::vector<float> y0 = RandomRounded(dtype(), n, ++seed);
    const std::vector<float> bias = RandomRounded(dtype(), channels, ++seed);
    Tensor cyb = F32(*cpu_, y0), cbias = F32(*cpu_, bias), gyb = Half(y0), gbias = Half(bias);
    ASSERT_OK(cpu_->AddBias(cyb.data(), cbias.data(), outer, channels, inner));
    ASSERT_OK(cuda_->AddBias(dtype(), gyb.raw(), gbias.raw(), outer, channels, inner));
    ExpectClose(Read(*cuda_, gyb), Read(*cpu_, cyb), "add bias", Bound(dtype(), 1));
    // The gradient of what the GPU stored, on both sides.
    Tensor cdb = F32(*cpu_, std::vector<float>(channels)), gdb = HalfZeros(channels);
    Tensor gyr = Half(Read(*cuda_, gyb));
    Tensor cyr = F32(*cpu_, Read(*cuda_, gyb));
    ASSERT_OK(cpu_->BiasGrad(cyr.data(), cdb.data(), outer, channels, inner));
    ASSERT_OK(cuda_->BiasGrad(dtype(), gyr.raw(), gdb.raw(), outer, channels, inner));
    ExpectClose(Read(*cuda_, gdb), Read(*cpu_, cdb), "bias gradient", Bound(dtype(), 1));
  }

  // Softmax cross-entropy: fp32 loss; dlogits scaled by a loss scale and rounded.
  const int64_t n = 64, classes = 10;
  const std::vector<float> logits = RandomRounded(dtype(), n * classes, ++seed, -4.f, 4.f);
  std::vector<int32_t> labels(n);
  for (int64_t i = 0; i < n; ++i) labels[i] = static_cast<int32_t>((i * 7) % classes);
  absl::StatusOr<DeviceBuffer> clabels = cpu_->Allocate(n * sizeof(int32_t));
  absl::StatusOr<DeviceBuffer> glabels = cuda_->Allocate(n * sizeof(int32_t));
  ASSERT_OK(clabels);
  ASSERT_OK(glabels);
  ASSERT_OK(cpu_->CopyHostToDevice(clabels->data(), labels.data(), n * sizeof(int32_t)));
  ASSERT_OK(cuda_->CopyHostToDevice(glabels->data(), labels.data(), n * sizeof(int32_t)));
  Tensor clogits = F32(*cpu_, logits), glogits = Half(logits);
  Tensor closs = F32(*cpu_, {0.f}), gloss = F32(*cuda_, {0.f});
  Tensor cd = F32(*cpu_, std::vector<float>(n * classes)), gd = HalfZeros(n * classes);
  const float scale = 1024.f;
  ASSERT_OK(cpu_->SoftmaxCrossEntropy(clogits.data(), static_cast<const int32_t*>(clabels->data()),
                                      n, classes, closs.data(), cd.data(), nullptr));
  ASSERT_OK(cpu_->Scale(scale, cd.data(), n * classes));
  ASSERT_OK(cuda_->SoftmaxCrossEntropy(dtype(), glogits.raw(),
                                       static_cast<const int32_t*>(glabels->data()), n, classes,
                                       gloss.data(), gd.raw(), scale));
  ExpectClose(Read(*cuda_, gloss), Read(*cpu_, closs), "loss", 1e-4);
  ExpectClose(Read(*cuda_, gd), Read(*cpu_, cd), "scaled dlogits", Bound(dtype(), 1));
}

INSTANTIATE_TEST_SUITE_P(ReducedTypes, MixedPrecisionParityTest,
                         ::testing::Values(DataType::kBF16, DataType::kF16),
                         [](const ::testing::TestParamInfo<DataType>& info) {
                           return std::string(DataTypeName(info.param));
                         });
INSTANTIATE_TEST_SUITE_P(ReducedTypes, OwnConvParityTest,
                         ::testing::Values(DataType::kBF16, DataType::kF16),
                         [](const ::testing::TestParamInfo<DataType>& info) {
                           return std::string(DataTypeName(info.param));
                         });

// --- Runs everywhere -------------------------------------------------------------

TEST(CpuBackendPrecisionTest, RefusesReducedPrecisionWithAClearMessage) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  EXPECT_TRUE(cpu->SupportsDataType(DataType::kF32));
  for (DataType dtype : {DataType::kBF16, DataType::kF16}) {
    SCOPED_TRACE(DataTypeName(dtype));
    EXPECT_FALSE(cpu->SupportsDataType(dtype));
    Conv2dConfig conv = MakeConv(2, 3, 8, 8, 4, 3, 1, 1);
    conv.dtype = dtype;
    absl::StatusOr<std::unique_ptr<Conv2dPlan>> plan = cpu->CreateConv2d(conv);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_THAT(plan.status().message(), HasSubstr("CUDA"));
    float a[4] = {1, 2, 3, 4}, c[4] = {};
    absl::Status gemm = cpu->Gemm(dtype, false, false, 2, 2, 1, 1.f, a, a, 0.f, c);
    EXPECT_EQ(gemm.code(), absl::StatusCode::kUnimplemented) << gemm;
    EXPECT_THAT(gemm.message(), HasSubstr(DataTypeName(dtype)));
  }
  // fp32 through the typed entry points is the fp32 op.
  absl::StatusOr<Tensor> a = cpu->AllocateTensor(Shape{4});
  absl::StatusOr<Tensor> c = cpu->AllocateTensor(Shape{4});
  ASSERT_OK(a);
  ASSERT_OK(c);
  const float values[4] = {1, 2, 3, 4};
  ASSERT_OK(cpu->CopyHostToDevice(a->raw(), values, sizeof(values)));
  ASSERT_OK(
      cpu->Gemm(DataType::kF32, false, false, 2, 2, 2, 1.f, a->raw(), a->raw(), 0.f, c->raw()));
  ASSERT_OK(cpu->Convert(DataType::kF32, c->raw(), DataType::kF32, c->raw(), 4, 0.5f, nullptr));
  float out[4];
  ASSERT_OK(cpu->CopyDeviceToHost(out, c->raw(), sizeof(out)));
  ASSERT_OK(cpu->Synchronize());
  EXPECT_EQ(out[0], 0.5f * 7.f);
  EXPECT_EQ(out[3], 0.5f * 22.f);
}

TEST(HostRoundingTest, ReferenceConversionsAreRoundToNearestEven) {
  // The test's own reference, on values whose rounding is known.
  EXPECT_EQ(ToBf16Bits(1.f), 0x3f80);
  EXPECT_EQ(FromBf16Bits(ToBf16Bits(1.00390625f)), 1.f);        // Tie, to even.
  EXPECT_EQ(FromBf16Bits(ToBf16Bits(1.01171875f)), 1.015625f);  // Tie, to even (up).
  EXPECT_EQ(ToF16Bits(1.f), 0x3c00);
  EXPECT_EQ(ToF16Bits(65504.f), 0x7bff);
  EXPECT_EQ(ToF16Bits(65520.f), 0x7c00);                               // Rounds to infinity.
  EXPECT_EQ(FromF16Bits(ToF16Bits(1.f + std::ldexp(1.f, -11))), 1.f);  // Tie, to even.
  EXPECT_EQ(FromF16Bits(ToF16Bits(std::ldexp(1.f, -24))), std::ldexp(1.f, -24));  // Subnormal.
  EXPECT_EQ(FromF16Bits(ToF16Bits(-2.5f)), -2.5f);
}

}  // namespace
}  // namespace pstrain
