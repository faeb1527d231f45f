// Winograd's F(4x4, 5x5) (kernels/cpu/winograd.h) against the convolution
// summed in double, forward and backward data, for both block widths and
// mixtures of them, image sides that leave partial tiles, and thread counts.
#include "kernels/cpu/winograd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
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
                           int out_lanes, int threads) {
  const int cin = backward_data ? c.filters : c.c, cout = backward_data ? c.c : c.filters;
  std::vector<float> u;
  WinogradFilters(c, w.data(), backward_data, &u);
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
                            .num_threads = threads};
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
}

}  // namespace
}  // namespace pstrain::cpu_internal
