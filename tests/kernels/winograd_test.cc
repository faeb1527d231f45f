// Winograd's F(4x4, 5x5) (kernels/cpu/winograd.h) against the convolution
// summed in double, forward, backward data and the weight gradient, for both
// block widths and mixtures of them, image sides that leave partial tiles,
// and thread counts; the 512-bit products against the 256-bit ones, and the
// plans' choice between the two (cpu_plans.h's VectorWidthChoice).
#include "kernels/cpu/winograd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_plans.h"
#include "tests/testing/blocked_layout.h"
#include "tests/testing/kernel_configs.h"

namespace pstrain::cpu_internal {
namespace {

using ::pstrain::testing::FromBlocked;
using ::pstrain::testing::MakeConv;
using ::pstrain::testing::ToBlocked;

std::vector<float> Random(size_t count, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(count);
  for (float& x : v) x = dist(gen);
  return v;
}

// The pass in double: out[n, o, y, x] = sum_{i, r, s} in[n, i, y + r - 2, x + s - 2] * f(o, i, r,
// s) with f the forward filter w[o, i, r, s] or, for backward data, w[i, o, 4 - r, 4 - s]; also the
// sum of the terms' magnitudes, which bounds the rounding of any order of summation.
void Reference(const Conv2dConfig& c, bool backward_data, const std::vector<float>& in,
               const std::vector<float>& w, const float* bias, std::vector<double>* out,
               std::vector<double>* magnitude) {
  const int cin = backward_data ? c.filters : c.c, cout = backward_data ? c.c : c.filters;
  out->assign(static_cast<size_t>(c.n) * cout * c.h * c.w, 0.0);
  magnitude->assign(out->size(), 0.0);
  for (int n = 0; n < c.n; ++n) {
    for (int o = 0; o < cout; ++o) {
      for (int y = 0; y < c.h; ++y) {
        for (int x = 0; x < c.w; ++x) {
          double sum = bias != nullptr ? bias[o] : 0.0;
          double mag = std::fabs(sum);
          for (int i = 0; i < cin; ++i) {
            for (int r = 0; r < 5; ++r) {
              for (int s = 0; s < 5; ++s) {
                const int yy = y + r - 2, xx = x + s - 2;
                if (yy < 0 || yy >= c.h || xx < 0 || xx >= c.w) continue;
                const double f = backward_data
                                     ? w[((size_t{1} * i * c.c + o) * 5 + 4 - r) * 5 + 4 - s]
                                     : w[((size_t{1} * o * c.c + i) * 5 + r) * 5 + s];
                const double term = in[((size_t{1} * n * cin + i) * c.h + yy) * c.w + xx] * f;
                sum += term;
                mag += std::fabs(term);
              }
            }
          }
          const size_t at = ((size_t{1} * n * cout + o) * c.h + y) * c.w + x;
          (*out)[at] = sum;
          (*magnitude)[at] = mag;
        }
      }
    }
  }
}

// Runs one pass through the blocked layouts and returns it in NCHW.
std::vector<float> RunPass(const Conv2dConfig& c, bool backward_data, const std::vector<float>& in,
                           const std::vector<float>& w, const float* bias, int in_lanes,
                           int out_lanes, int threads, bool avx512 = false) {
  const int cin = backward_data ? c.filters : c.c, cout = backward_data ? c.c : c.filters;
  std::vector<float> u;
  WinogradFilters(c, w.data(), backward_data, threads, &u);
  const std::vector<float> blocked_in = ToBlocked(in, c.n, cin, c.h, c.w, in_lanes);
  std::vector<float> blocked_out(
      static_cast<size_t>(c.n) * ((cout + out_lanes - 1) / out_lanes) * out_lanes * c.h * c.w,
      std::numeric_limits<float>::quiet_NaN());
  const WinogradShape shape{.n = c.n,
                            .in_channels = cin,
                            .out_channels = cout,
                            .h = c.h,
                            .w = c.w,
                            .in_lanes = in_lanes,
                            .out_lanes = out_lanes,
                            .num_threads = threads,
                            .avx512 = avx512};
  WinogradConv5x5(shape, blocked_in.data(), u, bias, blocked_out.data());
  return FromBlocked(blocked_out, c.n, cout, c.h, c.w, out_lanes);
}

struct Case {
  Conv2dConfig conv;
  int in_lanes, out_lanes;
};

TEST(WinogradTest, BothPassesMatchTheConvolutionInDouble) {
  const Case cases[] = {
      {MakeConv(2, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2), 16, 16},  // fmnist conv2, AVX-512 blocks
      {MakeConv(2, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2), 8, 8},    // the same, AVX2 blocks
      {MakeConv(1, 16, 13, 9, 32, 5, 5, 1, 1, 2, 2), 8, 16},    // partial tiles
      {MakeConv(3, 48, 7, 6, 16, 5, 5, 1, 1, 2, 2), 16, 8},     // partial tiles
      {MakeConv(2, 16, 1, 3, 16, 5, 5, 1, 1, 2, 2), 16, 16},    // smaller than a tile
      {MakeConv(1, 16, 28, 28, 16, 5, 5, 1, 1, 2, 2), 16, 16},  // tiles fill the image
  };
  for (const Case& k : cases) {
    const Conv2dConfig& c = k.conv;
    ASSERT_TRUE(WinogradSupports(c));
    const std::vector<float> w = Random(static_cast<size_t>(c.filters) * c.c * 25, 1, 0.1f);
    const std::vector<float> bias = Random(static_cast<size_t>(c.filters), 2, 1.f);
    for (const bool backward_data : {false, true}) {
      SCOPED_TRACE(absl::StrCat(c.n, "x", c.c, "x", c.h, "x", c.w, " -> ", c.filters, ", lanes ",
                                k.in_lanes, "/", k.out_lanes,
                                backward_data ? ", backward data" : ", forward"));
      const int cin = backward_data ? c.filters : c.c;
      const std::vector<float> in = Random(static_cast<size_t>(c.n) * cin * c.h * c.w, 3, 1.f);
      const float* b = backward_data ? nullptr : bias.data();
      // The backward pass reads in with the in/out roles swapped: its input
      // is dy's blocks, its output dx's.
      const std::vector<float> got = RunPass(c, backward_data, in, w, b, k.in_lanes, k.out_lanes,
                                             /*threads=*/2);
      std::vector<double> want, magnitude;
      Reference(c, backward_data, in, w, b, &want, &magnitude);
      ASSERT_EQ(got.size(), want.size());
      // fp32 rounding of the transforms and products: under 1e-5 of the
      // terms' magnitude (3e-6 at worst here; a direct fp32 sum of the
      // 25 x channels terms may lose that much too), far below what a wrong
      // coefficient gives (an error of the order of the terms themselves).
      double worst = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << "output " << i;
        const double bound = 1e-5 * magnitude[i] + 1e-6;
        ASSERT_LE(std::fabs(got[i] - want[i]), bound)
            << "output " << i << ": " << got[i] << " against " << want[i];
        worst = std::max(worst, std::fabs(got[i] - want[i]) / (magnitude[i] + 1e-30));
      }
      RecordProperty(
          absl::StrCat("worst_relative_", c.h, "x", c.w, backward_data ? "_bwd" : "_fwd"),
          absl::StrCat(worst));
    }
  }
}

TEST(WinogradTest, RepeatsBitForBitAcrossThreadCountsAndBlockWidths) {
  const Conv2dConfig c = MakeConv(3, 32, 11, 14, 32, 5, 5, 1, 1, 2, 2);
  const std::vector<float> w = Random(static_cast<size_t>(c.filters) * c.c * 25, 4, 0.1f);
  const std::vector<float> bias = Random(static_cast<size_t>(c.filters), 5, 1.f);
  const std::vector<float> x = Random(static_cast<size_t>(c.n) * c.c * c.h * c.w, 6, 1.f);
  for (const bool backward_data : {false, true}) {
    const float* b = backward_data ? nullptr : bias.data();
    const std::vector<float> first = RunPass(c, backward_data, x, w, b, 16, 16, 1);
    for (const int threads : {2, 3, 7}) {
      for (const int lanes : {8, 16}) {
        EXPECT_EQ(RunPass(c, backward_data, x, w, b, lanes, 24 - lanes, threads), first)
            << threads << " threads, lanes " << lanes << (backward_data ? ", backward" : "");
      }
    }
  }
}

TEST(WinogradTest, ANonFiniteInputReachesTheOutputsOfItsTiles) {
  // One infinity: every output whose window holds it becomes non-finite (as
  // the direct convolution's would), so a step that met it is dropped the
  // same way; outputs of other tiles stay finite.
  const Conv2dConfig c = MakeConv(1, 16, 12, 12, 16, 5, 5, 1, 1, 2, 2);
  std::vector<float> x(static_cast<size_t>(c.c) * c.h * c.w, 0.5f);
  x[(3 * c.h + 6) * c.w + 6] = std::numeric_limits<float>::infinity();  // channel 3, (6, 6)
  const std::vector<float> w = Random(static_cast<size_t>(c.filters) * c.c * 25, 7, 0.1f);
  const std::vector<float> y = RunPass(c, false, x, w, nullptr, 16, 16, 2);
  for (int o = 0; o < c.filters; ++o) {
    for (int i = 0; i < c.h; ++i) {
      for (int j = 0; j < c.w; ++j) {
        const float v = y[(static_cast<size_t>(o) * c.h + i) * c.w + j];
        const bool window_holds_it = std::abs(i - 6) <= 2 && std::abs(j - 6) <= 2;
        // Tiles are 4x4 outputs from multiples of 4; their patches reach
        // two beyond them on each side.
        const int ti = i / 4 * 4, tj = j / 4 * 4;
        const bool patch_holds_it = 6 >= ti - 2 && 6 <= ti + 5 && 6 >= tj - 2 && 6 <= tj + 5;
        if (window_holds_it) {
          EXPECT_FALSE(std::isfinite(v)) << o << " " << i << " " << j;
        }
        if (!patch_holds_it) {
          EXPECT_TRUE(std::isfinite(v)) << o << " " << i << " " << j;
        }
      }
    }
  }
}

// The weight gradient in double: dw[o, i, r, s] = sum_{n, y, x} dy[n, o, y, x] *
// x[n, i, y + r - 2, x + s - 2], with the sum of the terms' magnitudes.
void ReferenceWeightGrad(const Conv2dConfig& c, const std::vector<float>& x,
                         const std::vector<float>& dy, std::vector<double>* dw,
                         std::vector<double>* magnitude) {
  dw->assign(static_cast<size_t>(c.filters) * c.c * 25, 0.0);
  magnitude->assign(dw->size(), 0.0);
  for (int o = 0; o < c.filters; ++o) {
    for (int i = 0; i < c.c; ++i) {
      for (int r = 0; r < 5; ++r) {
        for (int q = 0; q < 5; ++q) {
          double sum = 0, mag = 0;
          for (int n = 0; n < c.n; ++n) {
            for (int y = 0; y < c.h; ++y) {
              for (int xx = 0; xx < c.w; ++xx) {
                const int yy = y + r - 2, xs = xx + q - 2;
                if (yy < 0 || yy >= c.h || xs < 0 || xs >= c.w) continue;
                const double term =
                    double{dy[((size_t{1} * n * c.filters + o) * c.h + y) * c.w + xx]} *
                    x[((size_t{1} * n * c.c + i) * c.h + yy) * c.w + xs];
                sum += term;
                mag += std::fabs(term);
              }
            }
          }
          const size_t at = ((size_t{1} * o * c.c + i) * 5 + r) * 5 + q;
          (*dw)[at] = sum;
          (*magnitude)[at] = mag;
        }
      }
    }
  }
}

// The weight gradient through the blocked layouts; dbias into *dbias when
// not null.
std::vector<float> RunWeightGrad(const Conv2dConfig& c, const std::vector<float>& x,
                                 const std::vector<float>& dy, int x_lanes, int dy_lanes,
                                 int threads, std::vector<float>* dbias = nullptr,
                                 bool avx512 = false) {
  const std::vector<float> blocked_x = ToBlocked(x, c.n, c.c, c.h, c.w, x_lanes);
  const std::vector<float> blocked_dy = ToBlocked(dy, c.n, c.filters, c.h, c.w, dy_lanes);
  std::vector<float> dw(static_cast<size_t>(c.filters) * c.c * 25,
                        std::numeric_limits<float>::quiet_NaN());
  if (dbias != nullptr) dbias->assign(c.filters, std::numeric_limits<float>::quiet_NaN());
  const WinogradShape shape{.n = c.n,
                            .in_channels = c.c,
                            .out_channels = c.filters,
                            .h = c.h,
                            .w = c.w,
                            .in_lanes = x_lanes,
                            .out_lanes = dy_lanes,
                            .num_threads = threads,
                            .avx512 = avx512};
  // Scratch left from another shape, as a plan's would be: never read.
  std::vector<float> scratch(1000, std::numeric_limits<float>::quiet_NaN());
  WinogradWeightGrad5x5(shape, blocked_x.data(), blocked_dy.data(), dw.data(),
                        dbias != nullptr ? dbias->data() : nullptr, &scratch);
  return dw;
}

TEST(WinogradTest, TheWeightGradientMatchesTheSumInDouble) {
  const Case cases[] = {
      {MakeConv(2, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2), 16, 16},  // fmnist conv2, AVX-512 blocks
      {MakeConv(3, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2), 8, 8},    // the same, AVX2 blocks
      {MakeConv(1, 16, 13, 9, 32, 5, 5, 1, 1, 2, 2), 8, 16},    // partial tiles
      {MakeConv(3, 48, 7, 6, 16, 5, 5, 1, 1, 2, 2), 16, 8},     // partial tiles
      {MakeConv(2, 16, 1, 3, 16, 5, 5, 1, 1, 2, 2), 16, 16},    // smaller than a tile
      {MakeConv(1, 16, 28, 28, 16, 5, 5, 1, 1, 2, 2), 16, 16},  // tiles fill the image
      {MakeConv(17, 16, 5, 5, 16, 5, 5, 1, 1, 2, 2), 8, 8},     // a partial tile block
      {MakeConv(24, 16, 12, 12, 32, 5, 5, 1, 1, 2, 2), 16, 8},  // 216 tiles: three segments
  };
  for (const Case& k : cases) {
    const Conv2dConfig& c = k.conv;
    SCOPED_TRACE(absl::StrCat(c.n, "x", c.c, "x", c.h, "x", c.w, " -> ", c.filters, ", lanes ",
                              k.in_lanes, "/", k.out_lanes));
    const std::vector<float> x = Random(static_cast<size_t>(c.n) * c.c * c.h * c.w, 8, 1.f);
    const std::vector<float> dy = Random(static_cast<size_t>(c.n) * c.filters * c.h * c.w, 9, 0.1f);
    std::vector<float> dbias;
    const std::vector<float> got = RunWeightGrad(c, x, dy, k.in_lanes, k.out_lanes, 2, &dbias);
    std::vector<double> want, magnitude;
    ReferenceWeightGrad(c, x, dy, &want, &magnitude);
    ASSERT_EQ(got.size(), want.size());
    // As for the other passes: under 1e-5 of the terms' magnitude, here
    // that of the filter's 25 weights together, which the transforms mix (a
    // weight whose window never meets the image, 0 in double, comes out at
    // 1e-6 of its neighbours').
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << "weight " << i;
      const size_t filter = i / 25 * 25;
      const double scale =
          *std::max_element(magnitude.begin() + filter, magnitude.begin() + filter + 25);
      ASSERT_LE(std::fabs(got[i] - want[i]), 1e-5 * scale + 1e-6)
          << "weight " << i << ": " << got[i] << " against " << want[i];
      worst = std::max(worst, std::fabs(got[i] - want[i]) / (scale + 1e-30));
    }
    RecordProperty(absl::StrCat("worst_relative_", c.h, "x", c.w, "_weights"), absl::StrCat(worst));
    for (int o = 0; o < c.filters; ++o) {
      double sum = 0, mag = 0;
      for (int n = 0; n < c.n; ++n) {
        for (int p = 0; p < c.h * c.w; ++p) {
          const double v = dy[(static_cast<size_t>(n) * c.filters + o) * c.h * c.w + p];
          sum += v;
          mag += std::fabs(v);
        }
      }
      EXPECT_NEAR(dbias[o], sum, 1e-6 * mag + 1e-7) << "filter " << o;
    }
  }
}

TEST(WinogradTest, TheWeightGradientRepeatsBitForBitAcrossThreadCountsAndBlockWidths) {
  // One segment of tiles (60 tiles), three (208) and the most, eight (640).
  for (const Conv2dConfig& c : {MakeConv(5, 32, 11, 14, 32, 5, 5, 1, 1, 2, 2),
                                MakeConv(13, 16, 14, 14, 32, 5, 5, 1, 1, 2, 2),
                                MakeConv(40, 16, 14, 14, 16, 5, 5, 1, 1, 2, 2)}) {
    SCOPED_TRACE(absl::StrCat(c.n, " images"));
    const std::vector<float> x = Random(static_cast<size_t>(c.n) * c.c * c.h * c.w, 10, 1.f);
    const std::vector<float> dy = Random(static_cast<size_t>(c.n) * c.filters * c.h * c.w, 11, 1.f);
    std::vector<float> first_bias;
    const std::vector<float> first = RunWeightGrad(c, x, dy, 16, 16, 1, &first_bias);
    for (const int threads : {2, 3, 7, 9}) {
      for (const int lanes : {8, 16}) {
        std::vector<float> bias;
        EXPECT_EQ(RunWeightGrad(c, x, dy, lanes, 24 - lanes, threads, &bias), first)
            << threads << " threads, lanes " << lanes;
        EXPECT_EQ(bias, first_bias) << threads << " threads, lanes " << lanes;
      }
    }
  }
}

// The 512-bit products sum every value in the order of the 256-bit ones:
// the same bits, for shapes that reach each register block of both (output
// channels in 32s and a last 16; weight gradient filters in 12s with a last
// 4 or 8, channels in 32s and a last 16). The transforms run in 512 bits
// on the side whose blocks hold 16 channels and in 256 on one of 8, so the
// mixed layouts pair each of them with the other's products.
TEST(WinogradTest, The512BitPassesGiveTheBitsOfThe256BitOnes) {
  if (!WinogradAvx512Available()) GTEST_SKIP() << "this CPU has no AVX-512";
  for (const Conv2dConfig& c :
       {MakeConv(4, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2),  // fmnist conv2
        MakeConv(3, 32, 11, 14, 32, 5, 5, 1, 1, 2, 2), MakeConv(2, 16, 13, 9, 48, 5, 5, 1, 1, 2, 2),
        MakeConv(5, 48, 7, 6, 16, 5, 5, 1, 1, 2, 2),
        MakeConv(13, 16, 14, 14, 32, 5, 5, 1, 1, 2, 2)}) {  // 3 segments
    SCOPED_TRACE(absl::StrCat(c.n, "x", c.c, "x", c.h, "x", c.w, " -> ", c.filters));
    const std::vector<float> w = Random(static_cast<size_t>(c.filters) * c.c * 25, 12, 0.1f);
    const std::vector<float> bias = Random(static_cast<size_t>(c.filters), 13, 1.f);
    const std::vector<float> x = Random(static_cast<size_t>(c.n) * c.c * c.h * c.w, 14, 1.f);
    const std::vector<float> dy = Random(static_cast<size_t>(c.n) * c.filters * c.h * c.w, 15, 1.f);
    for (const auto& [in_lanes, out_lanes] : {std::pair{8, 8}, {16, 16}, {8, 16}, {16, 8}}) {
      const std::string lanes = absl::StrCat("lanes ", in_lanes, "/", out_lanes);
      EXPECT_EQ(RunPass(c, false, x, w, bias.data(), in_lanes, out_lanes, 2, /*avx512=*/true),
                RunPass(c, false, x, w, bias.data(), in_lanes, out_lanes, 2))
          << "forward, " << lanes;
      EXPECT_EQ(RunPass(c, true, dy, w, nullptr, out_lanes, in_lanes, 2, /*avx512=*/true),
                RunPass(c, true, dy, w, nullptr, out_lanes, in_lanes, 2))
          << "backward data, " << lanes;
      std::vector<float> bias_512, bias_256;
      EXPECT_EQ(RunWeightGrad(c, x, dy, in_lanes, out_lanes, 2, &bias_512, /*avx512=*/true),
                RunWeightGrad(c, x, dy, in_lanes, out_lanes, 2, &bias_256))
          << "weight gradient, " << lanes;
      EXPECT_EQ(bias_512, bias_256) << "bias gradient, " << lanes;
    }
  }
}

// VectorWidthChoice with the calls' times given.
struct TimedCalls {
  VectorWidthChoice choice;
  // Makes `calls` calls that take ms_256 or ms_512 by the width asked for;
  // returns the widths, 1 for 512 bits.
  std::vector<int> Run(int calls, double ms_256, double ms_512) {
    std::vector<int> widths;
    for (int i = 0; i < calls; ++i) {
      const bool wide = choice.NextIs512();
      widths.push_back(wide ? 1 : 0);
      choice.Record(absl::Milliseconds(wide ? ms_512 : ms_256));
    }
    return widths;
  }
};

TEST(VectorWidthChoiceTest, AlternatesThenKeepsTheFasterWidth) {
  constexpr int kTrialCalls = 2 * VectorWidthChoice::kTrials;
  TimedCalls faster_512;
  faster_512.choice.Init(CpuVectorWidth::kMeasured, /*avx512_available=*/true);
  EXPECT_FALSE(faster_512.choice.decided());
  const std::vector<int> widths = faster_512.Run(kTrialCalls + 3, 2.0, 1.2);
  EXPECT_EQ(std::vector<int>(widths.begin(), widths.begin() + 4), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(std::vector<int>(widths.begin() + kTrialCalls, widths.end()),
            (std::vector<int>{1, 1, 1}));
  EXPECT_TRUE(faster_512.choice.decided());

  TimedCalls faster_256;
  faster_256.choice.Init(CpuVectorWidth::kMeasured, /*avx512_available=*/true);
  const std::vector<int> narrow = faster_256.Run(kTrialCalls + 3, 1.2, 2.0);
  EXPECT_EQ(std::vector<int>(narrow.begin() + kTrialCalls, narrow.end()),
            (std::vector<int>{0, 0, 0}));
}

TEST(VectorWidthChoiceTest, ANearTieOrOneSlowCallKeeps256Bits) {
  constexpr int kTrialCalls = 2 * VectorWidthChoice::kTrials;
  TimedCalls tie;
  tie.choice.Init(CpuVectorWidth::kMeasured, /*avx512_available=*/true);
  EXPECT_EQ(tie.Run(kTrialCalls + 1, 2.0, 1.99).back(), 0) << "1 % faster is a tie";

  // The first 256-bit call pays for warming up (10x): its median still
  // says 256 bits are faster.
  VectorWidthChoice warm_up;
  warm_up.Init(CpuVectorWidth::kMeasured, /*avx512_available=*/true);
  for (int i = 0; i < kTrialCalls; ++i) {
    const bool wide = warm_up.NextIs512();
    warm_up.Record(absl::Milliseconds(wide ? 2.0 : (i == 0 ? 15.0 : 1.5)));
  }
  EXPECT_TRUE(warm_up.decided());
  EXPECT_FALSE(warm_up.NextIs512());
}

TEST(VectorWidthChoiceTest, FixedWidthsAndCpusWithoutAvx512NeverTime) {
  TimedCalls no_avx512;
  no_avx512.choice.Init(CpuVectorWidth::kMeasured, /*avx512_available=*/false);
  EXPECT_TRUE(no_avx512.choice.decided());
  EXPECT_EQ(no_avx512.Run(4, 2.0, 1.0), (std::vector<int>{0, 0, 0, 0}));

  TimedCalls forced_512;
  forced_512.choice.Init(CpuVectorWidth::k512, /*avx512_available=*/true);
  EXPECT_EQ(forced_512.Run(3, 1.0, 2.0), (std::vector<int>{1, 1, 1}));

  TimedCalls forced_512_without;
  forced_512_without.choice.Init(CpuVectorWidth::k512, /*avx512_available=*/false);
  EXPECT_EQ(forced_512_without.Run(3, 2.0, 1.0), (std::vector<int>{0, 0, 0}));

  TimedCalls forced_256;
  forced_256.choice.Init(CpuVectorWidth::k256, /*avx512_available=*/true);
  EXPECT_EQ(forced_256.Run(3, 2.0, 1.0), (std::vector<int>{0, 0, 0}));
}

TEST(WinogradTest, ANonFiniteGradientReachesItsFiltersWeightsOnly) {
  // One infinity in dy: every weight of its filter becomes non-finite (the
  // direct sum would be infinite there too), so a step that met it is
  // dropped the same way; the other filters stay finite.
  const Conv2dConfig c = MakeConv(2, 16, 12, 12, 32, 5, 5, 1, 1, 2, 2);
  const std::vector<float> x(static_cast<size_t>(c.n) * c.c * c.h * c.w, 0.5f);
  std::vector<float> dy = Random(static_cast<size_t>(c.n) * c.filters * c.h * c.w, 14, 1.f);
  dy[(static_cast<size_t>(1) * c.filters + 3) * c.h * c.w + 6 * c.w + 6] =
      std::numeric_limits<float>::infinity();  // image 1, filter 3, (6, 6)
  std::vector<float> dbias;
  const std::vector<float> dw = RunWeightGrad(c, x, dy, 16, 16, 2, &dbias);
  for (int k = 0; k < c.filters; ++k) {
    for (int i = 0; i < c.c * 25; ++i) {
      const float v = dw[static_cast<size_t>(k) * c.c * 25 + i];
      EXPECT_EQ(std::isfinite(v), k != 3) << "filter " << k << ", weight " << i;
    }
    EXPECT_EQ(std::isfinite(dbias[k]), k != 3) << "filter " << k;
  }
}

TEST(WinogradTest, AWrongWeightGradientCoefficientIsCaught) {
  // The bound above is far below what a wrong term gives: dropping one
  // image's contribution moves the gradient by the order of the terms.
  const Conv2dConfig c = MakeConv(2, 16, 8, 8, 16, 5, 5, 1, 1, 2, 2);
  const std::vector<float> x = Random(static_cast<size_t>(c.n) * c.c * c.h * c.w, 12, 1.f);
  std::vector<float> dy = Random(static_cast<size_t>(c.n) * c.filters * c.h * c.w, 13, 1.f);
  std::vector<double> want, magnitude;
  ReferenceWeightGrad(c, x, dy, &want, &magnitude);
  std::fill(dy.begin() + dy.size() / 2, dy.end(), 0.f);  // Image 1 zeroed.
  const std::vector<float> got = RunWeightGrad(c, x, dy, 16, 16, 2);
  int beyond = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    beyond += std::fabs(got[i] - want[i]) > 1e-5 * magnitude[i] + 1e-6;
  }
  EXPECT_GT(beyond, static_cast<int>(got.size()) / 2);
}

TEST(WinogradTest, SupportsOnlyFiveByFiveSameConvolutionsOfBlockedChannels) {
  EXPECT_TRUE(WinogradSupports(MakeConv(64, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2)));
  EXPECT_TRUE(WinogradSupports(MakeConv(1, 16, 1, 1, 16, 5, 5, 1, 1, 2, 2)));
  EXPECT_FALSE(WinogradSupports(MakeConv(64, 1, 28, 28, 32, 5, 5, 1, 1, 2, 2)));  // 1 channel
  EXPECT_FALSE(WinogradSupports(MakeConv(4, 24, 14, 14, 32, 5, 5, 1, 1, 2, 2)));  // 24 in
  EXPECT_FALSE(WinogradSupports(MakeConv(4, 32, 14, 14, 40, 5, 5, 1, 1, 2, 2)));  // 40 out
  EXPECT_FALSE(WinogradSupports(MakeConv(4, 32, 14, 14, 64, 3, 3, 1, 1, 1, 1)));  // 3x3
  EXPECT_FALSE(WinogradSupports(MakeConv(4, 32, 14, 14, 64, 5, 5, 2, 2, 2, 2)));  // stride 2
  EXPECT_FALSE(WinogradSupports(MakeConv(4, 32, 14, 14, 64, 5, 5, 1, 1, 0, 0)));  // valid
  Conv2dConfig half = MakeConv(64, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2);
  half.dtype = DataType::kF16;
  EXPECT_FALSE(WinogradSupports(half));
}

TEST(WinogradTest, ThePlansUseItWhereItWasMeasuredFaster) {
  EXPECT_TRUE(WinogradApplies(MakeConv(64, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2)));  // fmnist conv2
  EXPECT_TRUE(WinogradApplies(MakeConv(8, 64, 14, 14, 64, 5, 5, 1, 1, 2, 2)));   // 128 M
  EXPECT_TRUE(WinogradApplies(MakeConv(4, 256, 8, 8, 256, 5, 5, 1, 1, 2, 2)));   // U 16 MiB
  EXPECT_FALSE(WinogradApplies(MakeConv(2, 64, 14, 14, 64, 5, 5, 1, 1, 2, 2)));  // 40 M: small
  EXPECT_FALSE(WinogradApplies(MakeConv(4, 512, 8, 8, 256, 5, 5, 1, 1, 2, 2)));  // U 32 MiB
  EXPECT_FALSE(WinogradApplies(MakeConv(64, 1, 28, 28, 32, 5, 5, 1, 1, 2, 2)));  // unsupported
  // The weight gradient: up to 64 x 64 channels.
  EXPECT_TRUE(WinogradWeightGradApplies(MakeConv(64, 32, 14, 14, 64, 5, 5, 1, 1, 2, 2)));
  EXPECT_TRUE(WinogradWeightGradApplies(MakeConv(32, 64, 32, 32, 64, 5, 5, 1, 1, 2, 2)));
  EXPECT_FALSE(WinogradWeightGradApplies(MakeConv(16, 64, 14, 14, 128, 5, 5, 1, 1, 2, 2)));
  EXPECT_FALSE(WinogradWeightGradApplies(MakeConv(2, 64, 14, 14, 64, 5, 5, 1, 1, 2, 2)));  // small
}

}  // namespace
}  // namespace pstrain::cpu_internal
