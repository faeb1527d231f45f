// Every op of the CPU backend against a naive reference loop written here
// (double precision where it matters), on both convolution layouts.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/rng.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/testing/kernel_configs.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

std::vector<float> RandomVector(size_t count, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(count);
  for (float& v : out) v = dist(gen);
  return out;
}

// |actual - expected| <= rtol * max(|expected|, scale) element-wise, where
// scale is the largest |expected| (so sums that cancel to ~0 are judged
// against the magnitude of the whole output).
void ExpectAllClose(const std::vector<float>& actual, const std::vector<double>& expected,
                    double rtol = 1e-4, const char* what = "") {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double scale = 1e-6;
  for (double e : expected) scale = std::max(scale, std::abs(e));
  int reported = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double tol = rtol * std::max(std::abs(expected[i]), scale * 1e-1) + 1e-7;
    if (!(std::abs(actual[i] - expected[i]) <= tol)) {
      ADD_FAILURE() << what << " element " << i << ": got " << actual[i] << ", expected "
                    << expected[i];
      if (++reported > 5) return;
    }
  }
}


class CpuBackendTest : public ::testing::Test {
 protected:
  void SetUp() override { backend_ = CreateCpuBackend(); }

  Tensor Upload(const std::vector<float>& host) {
    absl::StatusOr<Tensor> t = backend_->AllocateTensor(Shape{static_cast<int64_t>(host.size())});
    EXPECT_OK(t);
    EXPECT_OK(backend_->CopyHostToDevice(t->data(), host.data(), host.size() * 4));
    return *std::move(t);
  }
  Tensor Zeros(size_t count) { return Upload(std::vector<float>(count, 0.f)); }
  std::vector<float> Download(const Tensor& t) {
    std::vector<float> host(t.num_elements());
    EXPECT_OK(backend_->CopyDeviceToHost(host.data(), t.data(), t.bytes()));
    EXPECT_OK(backend_->Synchronize());
    return host;
  }

  std::unique_ptr<Backend> backend_;
};

// --- Memory and device info ----------------------------------------------------

TEST_F(CpuBackendTest, DescribesItself) {
  EXPECT_EQ(backend_->type(), DeviceType::kCpu);
  EXPECT_EQ(backend_->DeviceName(), "cpu");
  EXPECT_THAT(backend_->Describe(), HasSubstr("cpu (oneDNN 2."));
  EXPECT_THAT(backend_->Describe(), HasSubstr("thread"));
}

TEST_F(CpuBackendTest, DescribeReportsRequestedThreads) {
  CpuBackendOptions options;
  options.num_threads = 1;
  std::unique_ptr<Backend> one = CreateCpuBackend(options);
  EXPECT_THAT(one->Describe(), HasSubstr(", 1 thread)"));
  options.num_threads = 3;
  EXPECT_THAT(CreateCpuBackend(options)->Describe(), HasSubstr(", 3 threads)"));
}

TEST_F(CpuBackendTest, AllocatesAlignedMemoryAndCopies) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4}, size_t{100}, size_t{1} << 20}) {
    absl::StatusOr<DeviceBuffer> buffer = backend_->Allocate(bytes);
    ASSERT_OK(buffer);
    EXPECT_NE(buffer->data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 64, 0u);
    EXPECT_EQ(buffer->bytes(), bytes);
  }
  absl::StatusOr<PinnedBuffer> pinned = backend_->AllocatePinned(4000);
  ASSERT_OK(pinned);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pinned->data()) % 64, 0u);

  std::vector<float> host = RandomVector(1000, 1);
  std::memcpy(pinned->data(), host.data(), 4000);
  Tensor a = Zeros(1000), b = Zeros(1000);
  ASSERT_OK(backend_->CopyHostToDevice(a.data(), pinned->data(), 4000));
  ASSERT_OK(backend_->CopyDeviceToDevice(b.data(), a.data(), 4000));
  std::vector<float> back(1000);
  ASSERT_OK(backend_->CopyDeviceToHost(back.data(), b.data(), 4000));
  ASSERT_OK(backend_->Synchronize());
  EXPECT_EQ(back, host);

  absl::StatusOr<std::unique_ptr<Event>> event = backend_->RecordEvent();
  ASSERT_OK(event);
  EXPECT_OK((*event)->Wait());
  EXPECT_EQ(backend_->CopyHostToDevice(nullptr, host.data(), 4).code(),
            absl::StatusCode::kInvalidArgument);
}

// --- GEMM ------------------------------------------------------------------------

struct GemmCase {
  bool trans_a, trans_b;
  CpuGemmChoice choice;
};

class GemmTest : public CpuBackendTest, public ::testing::WithParamInterface<GemmCase> {};

TEST_P(GemmTest, MatchesNaiveProduct) {
  const GemmCase p = GetParam();
  CpuBackendOptions options;
  options.gemm = p.choice;
  std::unique_ptr<Backend> backend = CreateCpuBackend(options);
  // Small shapes run on dnnl_sgemm, large ones as the choice says (cached
  // per shape); the large shape repeats with fresh buffers to exercise the
  // cache. Its first call has beta != 0: with kMeasured, the timed trials
  // must not accumulate into C.
  uint32_t seed = 2;
  for (auto [m, n, k, alpha, beta] :
       {std::tuple<int64_t, int64_t, int64_t, float, float>{3, 5, 7, 0.75f, -0.5f},
        {64, 1024, 300, 0.75f, -0.5f},
        {64, 1024, 300, 0.75f, -0.5f},
        {64, 1024, 300, 1.f, 0.f},
        {130, 70, 129, 1.f, 1.f},
        {33, 17, 129, 0.75f, -0.5f}}) {
    std::vector<float> a = RandomVector(m * k, seed++), b = RandomVector(k * n, seed++),
                       c0 = RandomVector(m * n, seed++);
    std::vector<double> expected(m * n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0;
        for (int64_t l = 0; l < k; ++l) {
          const double av = p.trans_a ? a[l * m + i] : a[i * k + l];
          const double bv = p.trans_b ? b[j * k + l] : b[l * n + j];
          sum += av * bv;
        }
        expected[i * n + j] = alpha * sum + beta * c0[i * n + j];
      }
    }
    Tensor ta = Upload(a), tb = Upload(b), tc = Upload(c0);
    ASSERT_OK(backend->Gemm(p.trans_a, p.trans_b, m, n, k, alpha, ta.data(), tb.data(), beta, tc.data()));
    ExpectAllClose(Download(tc), expected, 1e-4, "gemm");
  }
}

std::vector<GemmCase> AllGemmCases() {
  std::vector<GemmCase> cases;
  for (CpuGemmChoice choice :
       {CpuGemmChoice::kMeasured, CpuGemmChoice::kMatmul, CpuGemmChoice::kSgemm}) {
    for (bool trans_a : {false, true}) {
      for (bool trans_b : {false, true}) cases.push_back({trans_a, trans_b, choice});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllTransposesAndChoices, GemmTest, ::testing::ValuesIn(AllGemmCases()));

TEST_F(CpuBackendTest, GemmWithZeroBetaIgnoresGarbageInC) {
  for (int64_t size : {int64_t{5}, int64_t{128}}) {  // sgemm and measured paths.
    std::vector<float> a = RandomVector(size * size, 5), b = RandomVector(size * size, 6);
    Tensor ta = Upload(a), tb = Upload(b);
    Tensor tc =
        Upload(std::vector<float>(size * size, std::numeric_limits<float>::quiet_NaN()));
    ASSERT_OK(backend_->Gemm(false, true, size, size, size, 2.f, ta.data(), tb.data(), 0.f, tc.data()));
    for (float v : Download(tc)) ASSERT_TRUE(std::isfinite(v));
  }
}

// More distinct large shapes than the primitive cache holds (64), then the
// first shape again: results stay right across the cache starting over.
TEST_F(CpuBackendTest, GemmStaysCorrectAcrossManyShapes) {
  const int64_t n = 128, k = 128;
  std::vector<float> b = RandomVector(k * n, 7);
  Tensor tb = Upload(b);
  for (int64_t m : [] {
         std::vector<int64_t> ms;
         for (int64_t i = 64; i < 64 + 70; ++i) ms.push_back(i);
         ms.push_back(64);
         return ms;
       }()) {
    std::vector<float> a = RandomVector(m * k, static_cast<uint32_t>(m));
    std::vector<double> expected(m * n, 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t l = 0; l < k; ++l)
        for (int64_t j = 0; j < n; ++j) expected[i * n + j] += double{a[i * k + l]} * b[l * n + j];
    Tensor ta = Upload(a), tc = Zeros(m * n);
    ASSERT_OK(backend_->Gemm(false, false, m, n, k, 1.f, ta.data(), tb.data(), 0.f, tc.data()));
    ExpectAllClose(Download(tc), expected, 1e-4, "gemm after many shapes");
  }
}

// Backends with different team sizes, used alternately, agree.
TEST_F(CpuBackendTest, OneAndTwoThreadBackendsAgree) {
  CpuBackendOptions one_thread;
  one_thread.num_threads = 1;
  std::unique_ptr<Backend> one = CreateCpuBackend(one_thread);
  Conv2dConfig c;
  c.n = 4, c.c = 8, c.h = 12, c.w = 12, c.filters = 16, c.kernel_h = 3, c.kernel_w = 3;
  c.pad_h = 1, c.pad_w = 1;
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> plan_one = one->CreateConv2d(c);
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> plan_two = backend_->CreateConv2d(c);
  ASSERT_OK(plan_one);
  ASSERT_OK(plan_two);
  std::vector<float> x = RandomVector(4 * 8 * 144, 8), w = RandomVector(16 * 8 * 9, 9);
  std::vector<float> y1(4 * 16 * 144), y2(4 * 16 * 144);
  for (int round = 0; round < 2; ++round) {
    ASSERT_OK((*plan_one)->Forward(x.data(), w.data(), nullptr, y1.data()));
    ASSERT_OK((*plan_two)->Forward(x.data(), w.data(), nullptr, y2.data()));
    ExpectAllClose(y1, std::vector<double>(y2.begin(), y2.end()), 1e-5, "1 vs 2 threads");
  }
  EXPECT_THAT(one->Describe(), HasSubstr(", 1 thread)"));
}

TEST_F(CpuBackendTest, GemmRejectsBadArguments) {
  Tensor t = Zeros(16);
  absl::Status s = backend_->Gemm(false, false, 0, 2, 2, 1.f, t.data(), t.data(), 0.f, t.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("Gemm"));
  s = backend_->Gemm(false, false, 2, 2, 2, 1.f, nullptr, t.data(), 0.f, t.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

// --- Bias ------------------------------------------------------------------------

TEST_F(CpuBackendTest, AddBiasAndBiasGradMatchLoops) {
  for (auto [outer, channels, inner] :
       {std::tuple<int64_t, int64_t, int64_t>{2, 3, 5}, {64, 1024, 1}, {64, 32, 784}, {3, 7, 1}}) {
    std::vector<float> y = RandomVector(outer * channels * inner, 7);
    std::vector<float> bias = RandomVector(channels, 8);
    std::vector<double> expected(y.size());
    std::vector<double> expected_grad(channels, 0.0);
    for (int64_t o = 0; o < outer; ++o) {
      for (int64_t c = 0; c < channels; ++c) {
        for (int64_t i = 0; i < inner; ++i) {
          const int64_t idx = (o * channels + c) * inner + i;
          expected[idx] = double{y[idx]} + bias[c];
          expected_grad[c] += y[idx];
        }
      }
    }
    Tensor ty = Upload(y), tb = Upload(bias), tg = Zeros(channels);
    ASSERT_OK(backend_->BiasGrad(ty.data(), tg.data(), outer, channels, inner));
    ExpectAllClose(Download(tg), expected_grad, 1e-4, "bias grad");
    ASSERT_OK(backend_->AddBias(ty.data(), tb.data(), outer, channels, inner));
    ExpectAllClose(Download(ty), expected, 1e-5, "add bias");
  }
  Tensor t = Zeros(4);
  EXPECT_EQ(backend_->AddBias(t.data(), t.data(), 1, 0, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend_->BiasGrad(nullptr, t.data(), 1, 1, 1).message(), HasSubstr("BiasGrad"));
}

// --- Convolution -------------------------------------------------------------------

std::vector<double> ConvForwardRef(const Conv2dConfig& c, const std::vector<float>& x,
                                   const std::vector<float>& w, const std::vector<float>* bias) {
  const int p_out = c.out_h(), q_out = c.out_w();
  std::vector<double> y(static_cast<size_t>(c.n) * c.filters * p_out * q_out);
  for (int n = 0; n < c.n; ++n)
    for (int k = 0; k < c.filters; ++k)
      for (int p = 0; p < p_out; ++p)
        for (int q = 0; q < q_out; ++q) {
          double sum = bias ? (*bias)[k] : 0.0;
          for (int ch = 0; ch < c.c; ++ch)
            for (int r = 0; r < c.kernel_h; ++r)
              for (int s = 0; s < c.kernel_w; ++s) {
                const int hi = p * c.stride_h - c.pad_h + r, wi = q * c.stride_w - c.pad_w + s;
                if (hi < 0 || hi >= c.h || wi < 0 || wi >= c.w) continue;
                sum += double{w[((k * c.c + ch) * c.kernel_h + r) * c.kernel_w + s]} *
                       x[((n * c.c + ch) * c.h + hi) * c.w + wi];
              }
          y[((n * c.filters + k) * p_out + p) * q_out + q] = sum;
        }
  return y;
}

// dx and dw (and dbias) by scattering dy through the same index map.
void ConvBackwardRef(const Conv2dConfig& c, const std::vector<float>& x,
                     const std::vector<float>& w, const std::vector<float>& dy,
                     std::vector<double>* dx, std::vector<double>* dw, std::vector<double>* db) {
  const int p_out = c.out_h(), q_out = c.out_w();
  dx->assign(x.size(), 0.0);
  dw->assign(w.size(), 0.0);
  db->assign(c.filters, 0.0);
  for (int n = 0; n < c.n; ++n)
    for (int k = 0; k < c.filters; ++k)
      for (int p = 0; p < p_out; ++p)
        for (int q = 0; q < q_out; ++q) {
          const double g = dy[((n * c.filters + k) * p_out + p) * q_out + q];
          (*db)[k] += g;
          for (int ch = 0; ch < c.c; ++ch)
            for (int r = 0; r < c.kernel_h; ++r)
              for (int s = 0; s < c.kernel_w; ++s) {
                const int hi = p * c.stride_h - c.pad_h + r, wi = q * c.stride_w - c.pad_w + s;
                if (hi < 0 || hi >= c.h || wi < 0 || wi >= c.w) continue;
                const size_t xi = ((n * c.c + ch) * c.h + hi) * c.w + wi;
                const size_t wi_idx = ((k * c.c + ch) * c.kernel_h + r) * c.kernel_w + s;
                (*dx)[xi] += g * w[wi_idx];
                (*dw)[wi_idx] += g * x[xi];
              }
        }
}

struct ConvCase {
  Conv2dConfig config;
  CpuConvLayout layout;
  CpuConvAlgorithm algorithm = CpuConvAlgorithm::kAuto;
};

using ::pstrain::testing::MakeConv;

class ConvTest : public CpuBackendTest, public ::testing::WithParamInterface<ConvCase> {};

TEST_P(ConvTest, ForwardAndBothBackwardPassesMatchNaiveLoops) {
  const Conv2dConfig c = GetParam().config;
  CpuConvLayout layout = GetParam().layout;
  CpuBackendOptions options;
  options.conv_layout = layout;
  options.conv_algorithm = GetParam().algorithm;
  backend_ = CreateCpuBackend(options);
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> plan = backend_->CreateConv2d(c);
  ASSERT_OK(plan);

  const size_t x_count = static_cast<size_t>(c.n) * c.c * c.h * c.w;
  const size_t w_count = static_cast<size_t>(c.filters) * c.c * c.kernel_h * c.kernel_w;
  const size_t y_count = static_cast<size_t>(c.n) * c.filters * c.out_h() * c.out_w();
  std::vector<float> x = RandomVector(x_count, 10), w = RandomVector(w_count, 11),
                     bias = RandomVector(c.filters, 12), dy = RandomVector(y_count, 13);
  Tensor tx = Upload(x), tw = Upload(w), tb = Upload(bias), ty = Zeros(y_count),
         tdy = Upload(dy), tdx = Zeros(x_count), tdw = Zeros(w_count), tdb = Zeros(c.filters);

  ASSERT_OK((*plan)->Forward(tx.data(), tw.data(), tb.data(), ty.data()));
  ExpectAllClose(Download(ty), ConvForwardRef(c, x, w, &bias), 1e-4, "forward with bias");
  ASSERT_OK((*plan)->Forward(tx.data(), tw.data(), nullptr, ty.data()));
  ExpectAllClose(Download(ty), ConvForwardRef(c, x, w, nullptr), 1e-4, "forward without bias");

  std::vector<double> dx, dw, db;
  ConvBackwardRef(c, x, w, dy, &dx, &dw, &db);
  ASSERT_OK((*plan)->BackwardData(tdy.data(), tw.data(), tdx.data()));
  ExpectAllClose(Download(tdx), dx, 1e-4, "backward data");
  ASSERT_OK((*plan)->BackwardFilter(tx.data(), tdy.data(), tdw.data(), tdb.data()));
  ExpectAllClose(Download(tdw), dw, 1e-4, "backward filter");
  ExpectAllClose(Download(tdb), db, 1e-4, "backward bias");
  // Without dbias the weights gradient is the same.
  Tensor tdw2 = Zeros(w_count);
  ASSERT_OK((*plan)->BackwardFilter(tx.data(), tdy.data(), tdw2.data(), nullptr));
  ExpectAllClose(Download(tdw2), dw, 1e-4, "backward filter without bias");

  // The combined pass (dy converted once) gives the separate passes' bits,
  // on a fresh plan whose first call it is, and again with another dy.
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> fresh = backend_->CreateConv2d(c);
  ASSERT_OK(fresh);
  for (int round = 0; round < 2; ++round) {
    std::vector<float> dy_r = RandomVector(y_count, 30 + round);
    Tensor tdy_r = Upload(dy_r), sdx = Zeros(x_count), sdw = Zeros(w_count),
           sdb = Zeros(c.filters), cdx = Zeros(x_count), cdw = Zeros(w_count),
           cdb = Zeros(c.filters), cdw2 = Zeros(w_count);
    ASSERT_OK((*fresh)
                    ->Backward(tx.data(), tdy_r.data(), tw.data(), cdx.data(), cdw.data(),
                               cdb.data()));
    ASSERT_OK((*plan)->BackwardFilter(tx.data(), tdy_r.data(), sdw.data(), sdb.data()));
    ASSERT_OK((*plan)->BackwardData(tdy_r.data(), tw.data(), sdx.data()));
    EXPECT_EQ(Download(cdx), Download(sdx)) << "round " << round;
    EXPECT_EQ(Download(cdw), Download(sdw)) << "round " << round;
    EXPECT_EQ(Download(cdb), Download(sdb)) << "round " << round;
    // No dx (the first layer) and no bias.
    ASSERT_OK((*fresh)->Backward(tx.data(), tdy_r.data(), tw.data(), nullptr, cdw2.data(), nullptr));
    EXPECT_EQ(Download(cdw2), Download(sdw)) << "round " << round;
  }
}

std::vector<ConvCase> ConvCases() {
  std::vector<ConvCase> cases;
  for (CpuConvLayout layout : {CpuConvLayout::kPlain, CpuConvLayout::kBlocked, CpuConvLayout::kAuto}) {
    cases.push_back({MakeConv(2, 3, 7, 9, 4, 3, 5, 1, 2, 1, 2), layout});    // non-square
    cases.push_back({MakeConv(2, 1, 28, 28, 8, 5, 5, 1, 1, 2, 2), layout});  // fmnist conv1
    cases.push_back({MakeConv(3, 4, 8, 8, 5, 3, 3, 2, 2, 1, 1), layout});    // stride 2
    cases.push_back({MakeConv(2, 16, 14, 14, 32, 5, 5, 1, 1, 2, 2), layout});
    cases.push_back({MakeConv(1, 2, 5, 6, 3, 2, 4, 3, 2, 0, 1), layout});    // odd strides
    // Shapes the blocked plans run with Winograd (winograd.h's
    // WinogradApplies), and the same on the direct kernels.
    cases.push_back({MakeConv(8, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2), layout});  // fmnist conv2
    cases.push_back({MakeConv(16, 32, 13, 9, 64, 5, 5, 1, 1, 2, 2), layout});  // partial tiles
    cases.push_back(
        {MakeConv(8, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2), layout, CpuConvAlgorithm::kDirect});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(ShapesAndLayouts, ConvTest, ::testing::ValuesIn(ConvCases()));

// --- Convolution, ReLU and max-pool as one plan ----------------------------------

TEST_F(CpuBackendTest, ConvReluPoolPlanGivesTheBitsOfTheThreeOps) {
  struct Case {
    Conv2dConfig conv;
    bool bias;
    int window;
    int pad = 0;
  };
  // The first three pool with the plan's own loops where oneDNN blocks the
  // convolution's output; a padded pool runs on oneDNN's.
  const Case cases[] = {
      {MakeConv(4, 1, 28, 28, 32, 5, 5, 1, 1, 2, 2), true, 2},   // fmnist conv1 block
      {MakeConv(8, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2), true, 2},  // fmnist conv2 (Winograd)
      {MakeConv(2, 3, 9, 9, 5, 3, 3, 1, 1, 1, 1), false, 3},     // no bias, 3x3 windows
      {MakeConv(2, 3, 8, 8, 5, 3, 3, 1, 1, 1, 1), true, 2, 1},   // a padded pool
  };
  for (const Case& k : cases) {
    const Conv2dConfig& c = k.conv;
    Pool2dConfig p;
    p.mode = PoolMode::kMax;
    p.n = c.n;
    p.c = c.filters;
    p.h = c.out_h();
    p.w = c.out_w();
    p.window = p.stride = k.window;
    p.pad = k.pad;
    absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> fused =
        backend_->CreateConvReluPool(c, k.bias, p);
    ASSERT_OK(fused);
    absl::StatusOr<std::unique_ptr<Conv2dPlan>> conv = backend_->CreateConv2d(c);
    absl::StatusOr<std::unique_ptr<Pool2dPlan>> pool = backend_->CreatePool2d(p);
    ASSERT_OK(conv);
    ASSERT_OK(pool);

    const size_t x_count = static_cast<size_t>(c.n) * c.c * c.h * c.w;
    const size_t w_count = static_cast<size_t>(c.filters) * c.c * c.kernel_h * c.kernel_w;
    const size_t conv_count = static_cast<size_t>(c.n) * c.filters * c.out_h() * c.out_w();
    const size_t y_count = static_cast<size_t>(p.n) * p.c * p.out_h() * p.out_w();
    // Coarse values: ties in the windows and pooled outputs that are exactly 0.
    std::vector<float> x = RandomVector(x_count, 40), w = RandomVector(w_count, 41);
    for (float& v : x) v = std::round(v * 2.f) / 2.f;
    for (float& v : w) v = std::round(v * 4.f) / 4.f;
    std::vector<float> bias = RandomVector(c.filters, 42), dy = RandomVector(y_count, 43);
    Tensor tx = Upload(x), tw = Upload(w), tb = Upload(bias), tdy = Upload(dy);
    const float* b = k.bias ? tb.data() : nullptr;

    // The three ops, as the layers run them.
    Tensor conv_y = Zeros(conv_count), relu_y = Zeros(conv_count), y = Zeros(y_count);
    Tensor d_relu = Zeros(conv_count), d_conv = Zeros(conv_count), dx = Zeros(x_count),
           dw = Zeros(w_count), db = Zeros(c.filters);
    ASSERT_OK((*conv)->Forward(tx.data(), tw.data(), b, conv_y.data()));
    ASSERT_OK(backend_->ActivationForward(Activation::kRelu, 0, conv_y.data(), relu_y.data(),
                                          conv_count));
    ASSERT_OK((*pool)->Forward(relu_y.data(), y.data(), true));
    ASSERT_OK((*pool)->Backward(relu_y.data(), y.data(), tdy.data(), d_relu.data()));
    ASSERT_OK(backend_->ActivationBackward(Activation::kRelu, 0, conv_y.data(), relu_y.data(),
                                           d_relu.data(), d_conv.data(), conv_count));
    ASSERT_OK((*conv)->Backward(tx.data(), d_conv.data(), tw.data(), dx.data(), dw.data(),
                                k.bias ? db.data() : nullptr));

    Tensor fy = Zeros(y_count), fdx = Zeros(x_count), fdw = Zeros(w_count), fdb = Zeros(c.filters);
    ASSERT_OK((*fused)->Forward(tx.data(), tw.data(), b, fy.data(), /*training=*/true));
    ASSERT_OK((*fused)->Backward(tx.data(), tw.data(), tdy.data(), fdx.data(), fdw.data(),
                                 k.bias ? fdb.data() : nullptr));
    EXPECT_EQ(Download(fy), Download(y)) << "forward, " << c.c << " channels";
    EXPECT_EQ(Download(fdx), Download(dx)) << "dx, " << c.c << " channels";
    EXPECT_EQ(Download(fdw), Download(dw)) << "dw, " << c.c << " channels";
    EXPECT_EQ(Download(fdb), Download(db)) << "dbias, " << c.c << " channels";
    // Without dx (a first layer: a one-channel conv's weight gradient then
    // reads the pool's gradient as it is made), and a backward without its
    // training forward.
    Tensor gdw = Zeros(w_count), gdb = Zeros(c.filters);
    ASSERT_OK((*fused)->Backward(tx.data(), tw.data(), tdy.data(), nullptr, gdw.data(),
                                 k.bias ? gdb.data() : nullptr));
    EXPECT_EQ(Download(gdw), Download(dw)) << "dw without dx, " << c.c << " channels";
    if (k.bias) {
      EXPECT_EQ(Download(gdb), Download(db)) << "dbias without dx";
    }
    ASSERT_OK((*fused)->Forward(tx.data(), tw.data(), b, fy.data(), /*training=*/false));
    EXPECT_EQ((*fused)
                  ->Backward(tx.data(), tw.data(), tdy.data(), fdx.data(), fdw.data(),
                             k.bias ? fdb.data() : nullptr)
                  .code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

TEST_F(CpuBackendTest, ConvReluPoolPlanDeclinesWhatItDoesNotFuse) {
  const Conv2dConfig c = MakeConv(2, 3, 8, 8, 4, 3, 3, 1, 1, 1, 1);
  Pool2dConfig p;
  p.n = 2;
  p.c = 4;
  p.h = p.w = 8;
  p.window = 3;
  p.stride = 2;  // Overlapping windows.
  EXPECT_EQ(backend_->CreateConvReluPool(c, true, p).status().code(),
            absl::StatusCode::kUnimplemented);
  p.window = p.stride = 3;  // 8 is not a multiple of 3: a column is dropped.
  EXPECT_EQ(backend_->CreateConvReluPool(c, true, p).status().code(),
            absl::StatusCode::kUnimplemented);
  p.mode = PoolMode::kAverage;
  EXPECT_EQ(backend_->CreateConvReluPool(c, true, p).status().code(),
            absl::StatusCode::kInvalidArgument);
  p.mode = PoolMode::kMax;
  p.window = p.stride = 2;
  p.c = 5;  // Not the convolution's output.
  EXPECT_EQ(backend_->CreateConvReluPool(c, true, p).status().code(),
            absl::StatusCode::kInvalidArgument);
  CpuBackendOptions plain;
  plain.conv_layout = CpuConvLayout::kPlain;
  p.c = 4;
  EXPECT_EQ(CreateCpuBackend(plain)->CreateConvReluPool(c, true, p).status().code(),
            absl::StatusCode::kUnimplemented);
}

TEST_F(CpuBackendTest, Conv2dRejectsBadConfigsAndPointers) {
  Conv2dConfig bad = MakeConv(1, 1, 4, 4, 2, 3, 3, 1, 1, 0, 0);
  bad.stride_h = 0;
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> plan = backend_->CreateConv2d(bad);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("Conv2d"));
  EXPECT_FALSE(backend_->CreateConv2d(MakeConv(1, 1, 2, 2, 2, 5, 5, 1, 1, 0, 0)).ok());
  EXPECT_FALSE(backend_->CreateConv2d(MakeConv(0, 1, 4, 4, 2, 3, 3, 1, 1, 0, 0)).ok());

  plan = backend_->CreateConv2d(MakeConv(1, 1, 4, 4, 2, 3, 3, 1, 1, 0, 0));
  ASSERT_OK(plan);
  Tensor t = Zeros(64);
  EXPECT_EQ((*plan)->Forward(nullptr, t.data(), nullptr, t.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*plan)->BackwardData(t.data(), nullptr, t.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*plan)->BackwardFilter(t.data(), t.data(), nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, ConvPlanOutlivesItsBackend) {
  Conv2dConfig c = MakeConv(1, 2, 5, 5, 3, 3, 3, 1, 1, 1, 1);
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> plan = backend_->CreateConv2d(c);
  ASSERT_OK(plan);
  std::vector<float> x = RandomVector(50, 20), w = RandomVector(54, 21);
  std::vector<float> y(75);
  backend_.reset();
  ASSERT_OK((*plan)->Forward(x.data(), w.data(), nullptr, y.data()));
  ExpectAllClose(y, ConvForwardRef(c, x, w, nullptr), 1e-4, "forward after backend reset");
}

// --- Pooling -------------------------------------------------------------------------

struct PoolRef {
  std::vector<double> y;
  std::vector<double> dx;
};

PoolRef PoolReference(const Pool2dConfig& c, const std::vector<float>& x,
                      const std::vector<float>& dy) {
  const int ph = c.out_h(), pw = c.out_w();
  PoolRef ref;
  ref.y.assign(static_cast<size_t>(c.n) * c.c * ph * pw, 0.0);
  ref.dx.assign(x.size(), 0.0);
  for (int nc = 0; nc < c.n * c.c; ++nc)
    for (int p = 0; p < ph; ++p)
      for (int q = 0; q < pw; ++q) {
        const int h0 = p * c.stride - c.pad, w0 = q * c.stride - c.pad;
        const int h1 = std::min(h0 + c.window, c.h), w1 = std::min(w0 + c.window, c.w);
        const int hs = std::max(h0, 0), ws = std::max(w0, 0);
        const size_t out = (static_cast<size_t>(nc) * ph + p) * pw + q;
        if (c.mode == PoolMode::kMax) {
          size_t best = 0;
          double best_v = -std::numeric_limits<double>::infinity();
          for (int h = hs; h < h1; ++h)
            for (int w = ws; w < w1; ++w) {
              const size_t i = (static_cast<size_t>(nc) * c.h + h) * c.w + w;
              if (x[i] > best_v) {
                best_v = x[i];
                best = i;
              }
            }
          ref.y[out] = best_v;
          ref.dx[best] += dy[out];
        } else {
          const int count = (h1 - hs) * (w1 - ws);
          double sum = 0;
          for (int h = hs; h < h1; ++h)
            for (int w = ws; w < w1; ++w) sum += x[(static_cast<size_t>(nc) * c.h + h) * c.w + w];
          ref.y[out] = sum / count;
          for (int h = hs; h < h1; ++h)
            for (int w = ws; w < w1; ++w)
              ref.dx[(static_cast<size_t>(nc) * c.h + h) * c.w + w] += dy[out] / count;
        }
      }
  return ref;
}

class PoolTest : public CpuBackendTest, public ::testing::WithParamInterface<Pool2dConfig> {};

TEST_P(PoolTest, ForwardAndBackwardMatchNaiveLoops) {
  const Pool2dConfig c = GetParam();
  absl::StatusOr<std::unique_ptr<Pool2dPlan>> plan = backend_->CreatePool2d(c);
  ASSERT_OK(plan);
  const size_t x_count = static_cast<size_t>(c.n) * c.c * c.h * c.w;
  const size_t y_count = static_cast<size_t>(c.n) * c.c * c.out_h() * c.out_w();
  std::vector<float> x = RandomVector(x_count, 30), dy = RandomVector(y_count, 31);
  PoolRef ref = PoolReference(c, x, dy);
  Tensor tx = Upload(x), ty = Zeros(y_count), tdy = Upload(dy), tdx = Upload(RandomVector(x_count, 32));

  ASSERT_OK((*plan)->Forward(tx.data(), ty.data(), /*training=*/false));
  ExpectAllClose(Download(ty), ref.y, 1e-5, "inference forward");
  ASSERT_OK((*plan)->Forward(tx.data(), ty.data(), /*training=*/true));
  ExpectAllClose(Download(ty), ref.y, 1e-5, "training forward");
  ASSERT_OK((*plan)->Backward(tx.data(), ty.data(), tdy.data(), tdx.data()));
  ExpectAllClose(Download(tdx), ref.dx, 1e-5, "backward");
}

Pool2dConfig MakePool(PoolMode mode, int n, int c, int h, int w, int window, int stride, int pad) {
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
}

INSTANTIATE_TEST_SUITE_P(
    MaxAndAverage, PoolTest,
    ::testing::Values(MakePool(PoolMode::kMax, 4, 32, 28, 28, 2, 2, 0),
                      MakePool(PoolMode::kMax, 2, 3, 7, 9, 2, 2, 0),  // odd: last row dropped
                      MakePool(PoolMode::kMax, 2, 3, 7, 7, 2, 2, 1),
                      MakePool(PoolMode::kMax, 2, 3, 7, 9, 3, 2, 1),
                      MakePool(PoolMode::kMax, 1, 2, 5, 5, 3, 1, 1),
                      MakePool(PoolMode::kAverage, 2, 3, 8, 8, 2, 2, 0),
                      MakePool(PoolMode::kAverage, 2, 3, 7, 9, 3, 2, 1),
                      MakePool(PoolMode::kAverage, 1, 4, 6, 6, 3, 3, 1)));

TEST_F(CpuBackendTest, MaxPoolRoutesTiesToTheFirstMaximumAndPropagatesNan) {
  for (int window : {2, 3}) {  // The 2x2 fast path and the general loop.
    absl::StatusOr<std::unique_ptr<Pool2dPlan>> plan =
        backend_->CreatePool2d(MakePool(PoolMode::kMax, 1, 1, 4, 4, window, window, 0));
    ASSERT_OK(plan);
    std::vector<float> x(16, 1.f);  // Every window is a tie.
    x[5] = std::numeric_limits<float>::quiet_NaN();  // Row 1, column 1: in window (0, 0).
    Tensor tx = Upload(x), ty = Zeros(4), tdy = Upload({1.f, 2.f, 3.f, 4.f}), tdx = Zeros(16);
    ASSERT_OK((*plan)->Forward(tx.data(), ty.data(), /*training=*/true));
    std::vector<float> y = Download(ty);
    EXPECT_TRUE(std::isnan(y[0]));
    ASSERT_OK((*plan)->Backward(tx.data(), ty.data(), tdy.data(), tdx.data()));
    std::vector<float> dx = Download(tdx);
    EXPECT_EQ(dx[5], 1.f);  // The NaN took window (0, 0)'s gradient.
    if (window == 2) {
      EXPECT_EQ(y[1], 1.f);
      EXPECT_EQ(dx[2], 2.f);  // Window (0, 1): first of the tied elements.
      EXPECT_EQ(dx[3], 0.f);
      EXPECT_EQ(dx[8], 3.f);
      EXPECT_EQ(dx[10], 4.f);
      EXPECT_EQ(dx[0], 0.f);
    }
  }
}

TEST_F(CpuBackendTest, Pool2dRejectsBadConfigsAndPointers) {
  EXPECT_EQ(backend_->CreatePool2d(MakePool(PoolMode::kMax, 1, 1, 4, 4, 2, 0, 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend_->CreatePool2d(MakePool(PoolMode::kMax, 1, 1, 4, 4, 2, 2, 2)).status().message(),
              HasSubstr("Pool2d"));
  EXPECT_FALSE(backend_->CreatePool2d(MakePool(PoolMode::kAverage, 1, 1, 2, 2, 5, 1, 1)).ok());
  absl::StatusOr<std::unique_ptr<Pool2dPlan>> plan =
      backend_->CreatePool2d(MakePool(PoolMode::kMax, 1, 1, 4, 4, 2, 2, 0));
  ASSERT_OK(plan);
  Tensor t = Zeros(16);
  EXPECT_EQ((*plan)->Forward(nullptr, t.data(), true).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*plan)->Backward(t.data(), t.data(), nullptr, t.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// --- Batch norm -----------------------------------------------------------------------

TEST_F(CpuBackendTest, BatchNormMatchesDoublePrecisionReference) {
  BatchNormConfig config;
  config.n = 8;
  config.c = 5;
  config.spatial = 49;
  config.epsilon = 1e-5f;
  config.momentum = 0.1f;
  const int64_t count = config.n * config.c * config.spatial, m = config.n * config.spatial;
  std::vector<float> x = RandomVector(count, 40, -2.f, 3.f), dy = RandomVector(count, 41);
  std::vector<float> gamma = RandomVector(config.c, 42, 0.5f, 1.5f),
                     beta = RandomVector(config.c, 43);
  std::vector<float> rmean = RandomVector(config.c, 44), rvar = RandomVector(config.c, 45, 0.5f, 2.f);

  std::vector<double> mean(config.c, 0), var(config.c, 0), y(count), dx(count);
  std::vector<double> dgamma(config.c, 0), dbeta(config.c, 0), new_rmean(config.c),
      new_rvar(config.c), inv_std(config.c), y_inf(count);
  auto at = [&](int64_t i, int64_t c, int64_t s) { return (i * config.c + c) * config.spatial + s; };
  for (int64_t c = 0; c < config.c; ++c) {
    for (int64_t i = 0; i < config.n; ++i)
      for (int64_t s = 0; s < config.spatial; ++s) mean[c] += x[at(i, c, s)];
    mean[c] /= m;
    for (int64_t i = 0; i < config.n; ++i)
      for (int64_t s = 0; s < config.spatial; ++s) var[c] += std::pow(x[at(i, c, s)] - mean[c], 2);
    var[c] /= m;
    inv_std[c] = 1.0 / std::sqrt(var[c] + config.epsilon);
    new_rmean[c] = 0.9 * rmean[c] + 0.1 * mean[c];
    new_rvar[c] = 0.9 * rvar[c] + 0.1 * var[c] * m / (m - 1);
    for (int64_t i = 0; i < config.n; ++i)
      for (int64_t s = 0; s < config.spatial; ++s) {
        const double xhat = (x[at(i, c, s)] - mean[c]) * inv_std[c];
        y[at(i, c, s)] = gamma[c] * xhat + beta[c];
        dbeta[c] += dy[at(i, c, s)];
        dgamma[c] += dy[at(i, c, s)] * xhat;
      }
    for (int64_t i = 0; i < config.n; ++i)
      for (int64_t s = 0; s < config.spatial; ++s) {
        const double xhat = (x[at(i, c, s)] - mean[c]) * inv_std[c];
        dx[at(i, c, s)] = gamma[c] * inv_std[c] / m *
                          (m * dy[at(i, c, s)] - dbeta[c] - xhat * dgamma[c]);
        y_inf[at(i, c, s)] = gamma[c] * (x[at(i, c, s)] - new_rmean[c]) /
                                 std::sqrt(new_rvar[c] + config.epsilon) +
                             beta[c];
      }
  }

  absl::StatusOr<std::unique_ptr<BatchNormPlan>> plan = backend_->CreateBatchNorm(config);
  ASSERT_OK(plan);
  Tensor tx = Upload(x), tdy = Upload(dy), tg = Upload(gamma), tb = Upload(beta),
         trm = Upload(rmean), trv = Upload(rvar), ty = Zeros(count), tsm = Zeros(config.c),
         tsi = Zeros(config.c), tdx = Zeros(count), tdg = Zeros(config.c), tdb = Zeros(config.c);
  ASSERT_OK((*plan)
                  ->ForwardTraining(tx.data(), tg.data(), tb.data(), ty.data(), trm.data(),
                                    trv.data(), tsm.data(), tsi.data()));
  ExpectAllClose(Download(ty), y, 1e-4, "bn y");
  ExpectAllClose(Download(trm), new_rmean, 1e-5, "running mean");
  ExpectAllClose(Download(trv), new_rvar, 1e-5, "running var (unbiased)");
  ExpectAllClose(Download(tsm), mean, 1e-5, "save mean");
  ExpectAllClose(Download(tsi), inv_std, 1e-5, "save inv std");

  ASSERT_OK((*plan)
                  ->Backward(tx.data(), tdy.data(), tg.data(), tsm.data(), tsi.data(), tdx.data(),
                             tdg.data(), tdb.data()));
  ExpectAllClose(Download(tdx), dx, 1e-4, "bn dx");
  ExpectAllClose(Download(tdg), dgamma, 1e-4, "bn dgamma");
  ExpectAllClose(Download(tdb), dbeta, 1e-4, "bn dbeta");

  ASSERT_OK((*plan)
                  ->ForwardInference(tx.data(), tg.data(), tb.data(), trm.data(), trv.data(),
                                     ty.data()));
  ExpectAllClose(Download(ty), y_inf, 1e-4, "bn inference");

  EXPECT_EQ((*plan)->Backward(nullptr, tdy.data(), tg.data(), tsm.data(), tsi.data(), tdx.data(),
                              tdg.data(), tdb.data())
                .code(),
            absl::StatusCode::kInvalidArgument);
  BatchNormConfig bad = config;
  bad.c = 0;
  EXPECT_THAT(backend_->CreateBatchNorm(bad).status().message(), HasSubstr("BatchNorm"));
}

// --- Activations ------------------------------------------------------------------------

TEST_F(CpuBackendTest, ActivationsMatchFormulas) {
  for (int64_t count : {int64_t{37}, int64_t{100000}}) {
    std::vector<float> x = RandomVector(count, 50, -4.f, 4.f), dy = RandomVector(count, 51);
    Tensor tx = Upload(x), tdy = Upload(dy), ty = Zeros(count), tdx = Zeros(count);
    const float alpha = 0.1f;
    for (Activation kind :
         {Activation::kRelu, Activation::kLeakyRelu, Activation::kTanh, Activation::kSigmoid}) {
      std::vector<double> y(count), dx(count);
      for (int64_t i = 0; i < count; ++i) {
        const double v = x[i];
        switch (kind) {
          case Activation::kRelu:
            y[i] = v > 0 ? v : 0;
            dx[i] = v > 0 ? dy[i] : 0;
            break;
          case Activation::kLeakyRelu:
            y[i] = v > 0 ? v : alpha * v;
            dx[i] = v > 0 ? dy[i] : double{alpha} * dy[i];
            break;
          case Activation::kTanh:
            y[i] = std::tanh(v);
            dx[i] = dy[i] * (1 - y[i] * y[i]);
            break;
          case Activation::kSigmoid:
            y[i] = 1 / (1 + std::exp(-v));
            dx[i] = dy[i] * y[i] * (1 - y[i]);
            break;
        }
      }
      ASSERT_OK(backend_->ActivationForward(kind, alpha, tx.data(), ty.data(), count));
      ExpectAllClose(Download(ty), y, 1e-5, "activation forward");
      ASSERT_OK(backend_
                      ->ActivationBackward(kind, alpha, tx.data(), ty.data(), tdy.data(),
                                           tdx.data(), count));
      ExpectAllClose(Download(tdx), dx, 1e-4, "activation backward");
    }
  }
  Tensor t = Zeros(4);
  EXPECT_EQ(backend_->ActivationForward(Activation::kRelu, 0, t.data(), t.data(), 0).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(backend_
                  ->ActivationBackward(Activation::kRelu, 0, t.data(), nullptr, t.data(), t.data(),
                                       4)
                  .message(),
              HasSubstr("ActivationBackward"));
}

// --- Dropout ----------------------------------------------------------------------------

TEST_F(CpuBackendTest, DropoutMaskFollowsRngAndStatistics) {
  const int64_t count = 200000;
  const float rate = 0.3f;
  std::vector<float> x = RandomVector(count, 60);
  Tensor tx = Upload(x), ty = Zeros(count), tmask = Zeros(count), tmask2 = Zeros(count),
         ty2 = Zeros(count);
  ASSERT_OK(backend_->DropoutForward(tx.data(), ty.data(), tmask.data(), count, rate, 1234));
  std::vector<float> y = Download(ty), mask = Download(tmask);
  int64_t kept = 0;
  const float scale = 1.f / (1.f - rate);
  for (int64_t i = 0; i < count; ++i) {
    const bool keep = DropoutKeep(1234, i, rate);
    ASSERT_EQ(mask[i], keep ? scale : 0.f) << i;
    ASSERT_EQ(y[i], x[i] * mask[i]) << i;
    kept += keep;
  }
  // Binomial(200000, 0.7): sd ~ 205; allow 5 sd.
  EXPECT_NEAR(static_cast<double>(kept), 0.7 * count, 1025);

  // Same seed: same mask; another seed: a different one.
  ASSERT_OK(backend_->DropoutForward(tx.data(), ty2.data(), tmask2.data(), count, rate, 1234));
  EXPECT_EQ(Download(tmask2), mask);
  ASSERT_OK(backend_->DropoutForward(tx.data(), ty2.data(), tmask2.data(), count, rate, 99));
  std::vector<float> other = Download(tmask2);
  int64_t differ = 0;
  for (int64_t i = 0; i < count; ++i) differ += other[i] != mask[i];
  EXPECT_GT(differ, count / 5);

  // Rate 0 keeps everything at scale 1; rate 1 and negative rates are errors.
  ASSERT_OK(backend_->DropoutForward(tx.data(), ty2.data(), tmask2.data(), count, 0.f, 7));
  for (float v : Download(tmask2)) ASSERT_EQ(v, 1.f);
  EXPECT_EQ(backend_->DropoutForward(tx.data(), ty2.data(), tmask2.data(), count, 1.f, 7).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->DropoutForward(tx.data(), ty2.data(), tmask2.data(), count, -0.1f, 7).code(),
            absl::StatusCode::kInvalidArgument);
}

// --- Other element-wise ops ---------------------------------------------------------------

TEST_F(CpuBackendTest, ElementwiseOpsMatchLoops) {
  for (int64_t count : {int64_t{5}, int64_t{70000}}) {
    std::vector<float> a = RandomVector(count, 70), b = RandomVector(count, 71);
    Tensor ta = Upload(a), tb = Upload(b), ty = Zeros(count);
    std::vector<double> expected(count);

    ASSERT_OK(backend_->Multiply(ta.data(), tb.data(), ty.data(), count));
    for (int64_t i = 0; i < count; ++i) expected[i] = double{a[i]} * b[i];
    ExpectAllClose(Download(ty), expected, 1e-6, "multiply");

    ASSERT_OK(backend_->Add(ta.data(), tb.data(), ty.data(), count));
    for (int64_t i = 0; i < count; ++i) expected[i] = double{a[i]} + b[i];
    ExpectAllClose(Download(ty), expected, 1e-6, "add");

    ASSERT_OK(backend_->Axpy(-2.5f, ta.data(), tb.data(), count));
    for (int64_t i = 0; i < count; ++i) expected[i] = double{b[i]} - 2.5 * a[i];
    ExpectAllClose(Download(tb), expected, 1e-6, "axpy");

    ASSERT_OK(backend_->Scale(0.5f, ta.data(), count));
    for (int64_t i = 0; i < count; ++i) expected[i] = 0.5 * a[i];
    ExpectAllClose(Download(ta), expected, 1e-6, "scale");

    ASSERT_OK(backend_->Fill(ty.data(), 3.25f, count));
    for (float v : Download(ty)) ASSERT_EQ(v, 3.25f);
  }
  Tensor t = Zeros(4);
  EXPECT_THAT(backend_->Multiply(t.data(), nullptr, t.data(), 4).message(), HasSubstr("Multiply"));
  EXPECT_EQ(backend_->Add(t.data(), t.data(), t.data(), -1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->Axpy(1.f, nullptr, t.data(), 4).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->Scale(1.f, t.data(), 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->Fill(nullptr, 1.f, 4).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, TransposeSwapsTheTwoInnerAxesOfEverySample) {
  const int64_t batch = 3, rows = 5, cols = 7;
  std::vector<float> x = RandomVector(batch * rows * cols, 72);
  Tensor tx = Upload(x), ty = Zeros(batch * rows * cols), tz = Zeros(batch * rows * cols);
  ASSERT_OK(backend_->Transpose(DataType::kF32, tx.data(), ty.data(), batch, rows, cols));
  const std::vector<float> y = Download(ty);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        ASSERT_EQ(y[(b * cols + c) * rows + r], x[(b * rows + r) * cols + c]);
      }
    }
  }
  // And back.
  ASSERT_OK(backend_->Transpose(DataType::kF32, ty.data(), tz.data(), batch, cols, rows));
  EXPECT_EQ(Download(tz), x);
  EXPECT_EQ(backend_->Transpose(DataType::kF32, tx.data(), ty.data(), -1, rows, cols).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_->Transpose(DataType::kBF16, tx.data(), ty.data(), batch, rows, cols).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_FALSE(backend_->ChannelsLast(DataType::kF32));
}

TEST_F(CpuBackendTest, ChannelsLastPlansAreRefusedWithAClearMessage) {
  Conv2dConfig conv;
  conv.n = 2;
  conv.c = 3;
  conv.h = conv.w = 8;
  conv.filters = 4;
  conv.kernel_h = conv.kernel_w = 3;
  conv.layout = TensorLayout::kNHWC;
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> conv_plan = backend_->CreateConv2d(conv);
  ASSERT_FALSE(conv_plan.ok());
  EXPECT_EQ(conv_plan.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(conv_plan.status().message(), HasSubstr("NHWC"));
  Pool2dConfig pool;
  pool.n = 2;
  pool.c = 3;
  pool.h = pool.w = 8;
  pool.layout = TensorLayout::kNHWC;
  EXPECT_EQ(backend_->CreatePool2d(pool).status().code(), absl::StatusCode::kUnimplemented);
  BatchNormConfig bn;
  bn.n = 4;
  bn.c = 3;
  bn.spatial = 16;
  bn.layout = TensorLayout::kNHWC;
  EXPECT_EQ(backend_->CreateBatchNorm(bn).status().code(), absl::StatusCode::kUnimplemented);
  // With one position per channel the two layouts are the same bytes.
  bn.spatial = 1;
  EXPECT_OK(backend_->CreateBatchNorm(bn));
}

// --- Loss ----------------------------------------------------------------------------------

TEST_F(CpuBackendTest, SoftmaxCrossEntropyMatchesReference) {
  for (auto [n, classes] : {std::pair<int64_t, int64_t>{5, 3}, {64, 10}, {512, 100}}) {
    std::vector<float> logits = RandomVector(n * classes, 80, -6.f, 6.f);
    std::vector<int32_t> labels(n);
    for (int64_t i = 0; i < n; ++i) labels[i] = static_cast<int32_t>((i * 7 + 3) % classes);
    std::vector<double> probs(n * classes), dlogits(n * classes);
    double loss = 0;
    for (int64_t i = 0; i < n; ++i) {
      double max = -1e30, sum = 0;
      for (int64_t j = 0; j < classes; ++j) max = std::max(max, double{logits[i * classes + j]});
      for (int64_t j = 0; j < classes; ++j) sum += std::exp(logits[i * classes + j] - max);
      for (int64_t j = 0; j < classes; ++j) {
        probs[i * classes + j] = std::exp(logits[i * classes + j] - max) / sum;
        dlogits[i * classes + j] = (probs[i * classes + j] - (j == labels[i])) / n;
      }
      loss -= std::log(probs[i * classes + labels[i]]);
    }
    loss /= n;

    absl::StatusOr<DeviceBuffer> tlabels = backend_->Allocate(n * sizeof(int32_t));
    ASSERT_OK(tlabels);
    ASSERT_OK(backend_->CopyHostToDevice(tlabels->data(), labels.data(), n * 4));
    Tensor tl = Upload(logits), tloss = Zeros(1), tdl = Zeros(n * classes),
           tp = Zeros(n * classes);
    auto* label_ptr = static_cast<const int32_t*>(tlabels->data());
    ASSERT_OK(backend_
                    ->SoftmaxCrossEntropy(tl.data(), label_ptr, n, classes, tloss.data(),
                                          tdl.data(), tp.data()));
    ExpectAllClose(Download(tloss), {loss}, 1e-5, "loss");
    ExpectAllClose(Download(tdl), dlogits, 1e-4, "dlogits");
    ExpectAllClose(Download(tp), probs, 1e-4, "probs");
    // Loss only.
    Tensor tloss2 = Zeros(1);
    ASSERT_OK(backend_
                    ->SoftmaxCrossEntropy(tl.data(), label_ptr, n, classes, tloss2.data(), nullptr,
                                          nullptr));
    ExpectAllClose(Download(tloss2), {loss}, 1e-5, "loss only");
  }
}

TEST_F(CpuBackendTest, SoftmaxCrossEntropyRejectsOutOfRangeLabels) {
  Tensor logits = Zeros(6), loss = Zeros(1), dl = Zeros(6);
  for (int32_t bad : {3, -1}) {
    std::vector<int32_t> labels = {0, bad};
    absl::Status s = backend_->SoftmaxCrossEntropy(logits.data(), labels.data(), 2, 3, loss.data(),
                                                   dl.data(), nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("SoftmaxCrossEntropy"));
  }
  std::vector<int32_t> labels = {0, 1};
  EXPECT_EQ(backend_->SoftmaxCrossEntropy(logits.data(), labels.data(), 0, 3, loss.data(), nullptr,
                                          nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// --- Optimizers --------------------------------------------------------------------------------

struct SgdCase {
  float momentum;
  bool nesterov;
  float weight_decay;
};

class SgdTest : public CpuBackendTest, public ::testing::WithParamInterface<SgdCase> {};

TEST_P(SgdTest, ThreeStepsMatchPytorchFormulation) {
  const SgdCase p = GetParam();
  for (int64_t count : {int64_t{9}, int64_t{50000}}) {
    std::vector<float> param = RandomVector(count, 90);
    std::vector<double> ref_p(param.begin(), param.end()), ref_v(count, 0.0);
    Tensor tp = Upload(param), tv = Zeros(count);
    SgdHyper hyper;
    hyper.learning_rate = 0.05f;
    hyper.momentum = p.momentum;
    hyper.nesterov = p.nesterov;
    hyper.weight_decay = p.weight_decay;
    for (int step = 0; step < 3; ++step) {
      std::vector<float> grad = RandomVector(count, 91 + step);
      for (int64_t i = 0; i < count; ++i) {
        double g = grad[i] + double{p.weight_decay} * ref_p[i];
        if (p.momentum == 0.f) {
          ref_p[i] -= 0.05 * g;
          continue;
        }
        ref_v[i] = p.momentum * ref_v[i] + g;
        ref_p[i] -= 0.05 * (p.nesterov ? g + p.momentum * ref_v[i] : ref_v[i]);
      }
      Tensor tg = Upload(grad);
      ASSERT_TRUE(backend_
                      ->SgdUpdate(tp.data(), tg.data(), p.momentum == 0.f ? nullptr : tv.data(),
                                  count, hyper)
                      .ok());
    }
    ExpectAllClose(Download(tp), ref_p, 1e-5, "sgd param");
    if (p.momentum != 0.f) ExpectAllClose(Download(tv), ref_v, 1e-5, "sgd velocity");
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, SgdTest,
                         ::testing::Values(SgdCase{0.f, false, 0.f}, SgdCase{0.f, false, 0.01f},
                                           SgdCase{0.9f, false, 0.f},
                                           SgdCase{0.9f, false, 5e-4f},
                                           SgdCase{0.9f, true, 0.f}, SgdCase{0.8f, true, 1e-3f}));

TEST_F(CpuBackendTest, SgdMomentumWithoutVelocityIsAnError) {
  Tensor p = Zeros(4), g = Zeros(4);
  SgdHyper hyper;
  hyper.momentum = 0.9f;
  absl::Status s = backend_->SgdUpdate(p.data(), g.data(), nullptr, 4, hyper);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("SgdUpdate"));
}

// Step 1 from zero moments is lr * sign(g) (bias correction makes m_hat = g,
// v_hat = g^2), computed by hand below.
TEST_F(CpuBackendTest, AdamFirstStepMatchesHandComputation) {
  AdamHyper hyper;
  hyper.learning_rate = 0.1f;
  hyper.step = 1;
  Tensor p = Upload({1.f, 2.f}), g = Upload({0.5f, -0.25f}), m = Zeros(2), v = Zeros(2);
  ASSERT_OK(backend_->AdamUpdate(p.data(), g.data(), m.data(), v.data(), 2, hyper));
  ExpectAllClose(Download(p), {0.9, 2.1}, 1e-6, "adam p");
  ExpectAllClose(Download(m), {0.05, -0.025}, 1e-6, "adam m");
  ExpectAllClose(Download(v), {0.00025, 0.0000625}, 1e-5, "adam v");

  // L2: g = 0.5 + 0.1 * 1 = 0.6, still a step of lr in sign(g).
  hyper.weight_decay = 0.1f;
  p = Upload({1.f}), g = Upload({0.5f}), m = Zeros(1), v = Zeros(1);
  ASSERT_OK(backend_->AdamUpdate(p.data(), g.data(), m.data(), v.data(), 1, hyper));
  ExpectAllClose(Download(p), {0.9}, 1e-6, "adam l2 p");
  ExpectAllClose(Download(m), {0.06}, 1e-6, "adam l2 m");

  // AdamW: p = 1 * (1 - 0.1 * 0.1) - 0.1 = 0.89; moments see the raw g.
  hyper.decoupled_weight_decay = true;
  p = Upload({1.f}), g = Upload({0.5f}), m = Zeros(1), v = Zeros(1);
  ASSERT_OK(backend_->AdamUpdate(p.data(), g.data(), m.data(), v.data(), 1, hyper));
  ExpectAllClose(Download(p), {0.89}, 1e-6, "adamw p");
  ExpectAllClose(Download(m), {0.05}, 1e-6, "adamw m");

  hyper.step = 0;
  EXPECT_EQ(backend_->AdamUpdate(p.data(), g.data(), m.data(), v.data(), 1, hyper).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, AdamAndAdamWTrackReferenceOverSteps) {
  const int64_t count = 40000;
  for (bool decoupled : {false, true}) {
    AdamHyper hyper;
    hyper.learning_rate = 0.01f;
    hyper.beta1 = 0.8f;
    hyper.beta2 = 0.95f;
    hyper.epsilon = 1e-6f;
    hyper.weight_decay = 0.05f;
    hyper.decoupled_weight_decay = decoupled;
    std::vector<float> param = RandomVector(count, 100);
    std::vector<double> rp(param.begin(), param.end()), rm(count, 0), rv(count, 0);
    Tensor tp = Upload(param), tm = Zeros(count), tv = Zeros(count);
    for (int step = 1; step <= 4; ++step) {
      std::vector<float> grad = RandomVector(count, 100 + step);
      for (int64_t i = 0; i < count; ++i) {
        double g = grad[i];
        if (decoupled) {
          rp[i] *= 1 - 0.01 * 0.05;
        } else {
          g += 0.05 * rp[i];
        }
        rm[i] = 0.8 * rm[i] + 0.2 * g;
        rv[i] = 0.95 * rv[i] + 0.05 * g * g;
        const double mhat = rm[i] / (1 - std::pow(0.8, step));
        const double vhat = rv[i] / (1 - std::pow(0.95, step));
        rp[i] -= 0.01 * mhat / (std::sqrt(vhat) + 1e-6);
      }
      hyper.step = step;
      Tensor tg = Upload(grad);
      ASSERT_OK(backend_->AdamUpdate(tp.data(), tg.data(), tm.data(), tv.data(), count, hyper));
    }
    ExpectAllClose(Download(tp), rp, 1e-5, decoupled ? "adamw param" : "adam param");
    ExpectAllClose(Download(tm), rm, 1e-4, "adam m");
    ExpectAllClose(Download(tv), rv, 1e-4, "adam v");
  }
}

}  // namespace
}  // namespace pstrain
