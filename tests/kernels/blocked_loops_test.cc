// The loops on oneDNN's channel-blocked layout (kernels/cpu/blocked_loops.h)
// against plain NCHW loops, for both block sizes (this machine's oneDNN picks
// only one of them), padded channel blocks, ties, NaNs, strides and padding.
#include "kernels/cpu/blocked_loops.h"

#include <bit>
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

using ::pstrain::testing::ToBlocked;

std::vector<float> Coarse(size_t count, uint32_t seed) {
  // Halves in [-3, 3]: many ties within a window, and windows whose maximum
  // is exactly 0 or negative.
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> pick(-6, 6);
  std::vector<float> v(count);
  for (float& x : v) x = static_cast<float>(pick(rng)) / 2.f;
  return v;
}

std::vector<float> Uniform(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> pick(-1.f, 1.f);
  std::vector<float> v(count);
  for (float& x : v) x = pick(rng);
  return v;
}

std::vector<uint32_t> Bits(const std::vector<float>& v) {
  std::vector<uint32_t> bits;
  bits.reserve(v.size());
  for (float x : v) bits.push_back(std::bit_cast<uint32_t>(x));
  return bits;
}

struct PoolCase {
  int lanes, channels, h, w, k, threads;
};

TEST(BlockedLoopsTest, MaxPoolReluMatchesPlainLoopsBitForBit) {
  const PoolCase cases[] = {
      {8, 20, 8, 6, 2, 1},
      {8, 20, 8, 6, 2, 2},
      {16, 20, 8, 6, 2, 2},
      {8, 8, 9, 6, 3, 2},
      {16, 40, 6, 9, 3, 1},
      {16, 3, 4, 4, 1, 2},
      {8, 32, 28, 28, 2, 2},   // fmnist conv1's output,
                               // several samples
      {16, 5, 15, 15, 15, 2},  // the widest window: winners up to 224
  };
  for (const PoolCase& pc : cases) {
    SCOPED_TRACE(absl::StrCat("lanes ", pc.lanes, " channels ", pc.channels, " ", pc.h, "x", pc.w,
                              " window ", pc.k, " threads ", pc.threads));
    const int64_t n = 3;
    const int oh = pc.h / pc.k, ow = pc.w / pc.k;
    std::vector<float> conv = Coarse(static_cast<size_t>(n * pc.channels * pc.h * pc.w), 7);
    // A NaN in one window of the first channel, and a window of -0.f and 0.f.
    conv[1] = std::numeric_limits<float>::quiet_NaN();
    conv[static_cast<size_t>(pc.w) * pc.k] = -0.f;
    const std::vector<float> dy = Uniform(static_cast<size_t>(n * pc.channels * oh * ow), 8);

    // Reference: per plane, the window's maximum (NaN propagates), ReLU;
    // backward routes dy to the first element equal to the maximum when the
    // ReLU-ed output is positive.
    std::vector<float> want_y(dy.size()), want_dconv(conv.size(), 0.f);
    for (int64_t plane = 0; plane < n * pc.channels; ++plane) {
      const float* in = conv.data() + plane * pc.h * pc.w;
      for (int p = 0; p < oh; ++p) {
        for (int q = 0; q < ow; ++q) {
          float best = in[p * pc.k * pc.w + q * pc.k];
          bool nan = false;
          for (int i = 0; i < pc.k; ++i) {
            for (int j = 0; j < pc.k; ++j) {
              const float v = in[(p * pc.k + i) * pc.w + q * pc.k + j];
              nan |= std::isnan(v);
              if (v > best) best = v;
            }
          }
          const int64_t out = plane * oh * ow + p * ow + q;
          want_y[static_cast<size_t>(out)] = nan ? 0.f : (best > 0.f ? best : 0.f);
          if (nan || !(best > 0.f)) continue;
          for (int i = 0, done = 0; i < pc.k && !done; ++i) {
            for (int j = 0; j < pc.k; ++j) {
              const int64_t at = plane * pc.h * pc.w + (p * pc.k + i) * pc.w + q * pc.k + j;
              if (conv[static_cast<size_t>(at)] == best) {
                want_dconv[static_cast<size_t>(at)] = dy[static_cast<size_t>(out)];
                done = 1;
                break;
              }
            }
          }
        }
      }
    }

    const BlockedPoolShape shape{.lanes = pc.lanes,
                                 .n = n,
                                 .channels = pc.channels,
                                 .h = pc.h,
                                 .w = pc.w,
                                 .k = pc.k,
                                 .num_threads = pc.threads};
    ASSERT_TRUE(BlockedPoolShapeIsValid(shape));
    const std::vector<float> blocked = ToBlocked(conv, n, pc.channels, pc.h, pc.w, pc.lanes);
    std::vector<float> y(dy.size(), -7.f);
    std::vector<uint8_t> winners(static_cast<size_t>(BlockedPoolWinnersSize(shape)), 77);
    BlockedMaxPoolReluForward(shape, blocked.data(), y.data(), winners.data());
    EXPECT_EQ(Bits(y), Bits(want_y));
    // Without winners (inference) the outputs are the same.
    std::vector<float> y_alone(dy.size(), -7.f);
    BlockedMaxPoolReluForward(shape, blocked.data(), y_alone.data(), nullptr);
    EXPECT_EQ(Bits(y_alone), Bits(want_y));
    std::vector<float> d_conv(blocked.size(), -7.f);
    BlockedMaxPoolReluBackward(shape, winners.data(), dy.data(), d_conv.data());
    EXPECT_EQ(Bits(d_conv), Bits(ToBlocked(want_dconv, n, pc.channels, pc.h, pc.w, pc.lanes)));
  }
}

TEST(BlockedLoopsTest, PoolShapesTheLoopsDoNotHandleAreInvalid) {
  BlockedPoolShape s{.lanes = 8, .n = 1, .channels = 4, .h = 8, .w = 8, .k = 2, .num_threads = 1};
  EXPECT_TRUE(BlockedPoolShapeIsValid(s));
  s.lanes = 4;
  EXPECT_FALSE(BlockedPoolShapeIsValid(s));
  s.lanes = 16;
  s.k = 3;  // 8 is not a multiple of 3.
  EXPECT_FALSE(BlockedPoolShapeIsValid(s));
  s.k = 0;
  EXPECT_FALSE(BlockedPoolShapeIsValid(s));
  // A window's winner is one byte: up to 15 x 15.
  s.h = s.w = 30;
  s.k = 15;
  EXPECT_TRUE(BlockedPoolShapeIsValid(s));
  s.h = s.w = 32;
  s.k = 16;
  EXPECT_FALSE(BlockedPoolShapeIsValid(s));
}

// A convolution of one input channel (tests/testing/kernel_configs.h).
Conv2dConfig OneChannelConv(int n, int h, int w, int filters, int kh, int kw, int sh, int sw,
                            int ph, int pw) {
  return pstrain::testing::MakeConv(n, 1, h, w, filters, kh, kw, sh, sw, ph, pw);
}

TEST(BlockedLoopsTest, OneChannelWeightGradMatchesADoublePrecisionSum) {
  const Conv2dConfig configs[] = {
      OneChannelConv(4, 28, 28, 32, 5, 5, 1, 1, 2, 2),  // fmnist conv1
      OneChannelConv(3, 9, 7, 20, 3, 3, 2, 1, 1, 0),    // strides, padded filter block
      OneChannelConv(2, 6, 12, 5, 2, 8, 1, 2, 0, 3),    // the widest kernel
      OneChannelConv(1, 5, 5, 17, 1, 1, 1, 1, 0, 0),
  };
  for (const Conv2dConfig& c : configs) {
    for (int lanes : {8, 16}) {
      for (int threads : {1, 2}) {
        SCOPED_TRACE(absl::StrCat("filters ", c.filters, " kernel ", c.kernel_h, "x", c.kernel_w,
                                  " lanes ", lanes, " threads ", threads));
        ASSERT_TRUE(OneChannelConvWeightGradApplies(c));
        const int oh = c.out_h(), ow = c.out_w();
        const std::vector<float> x = Uniform(static_cast<size_t>(c.n) * c.h * c.w, 11);
        const std::vector<float> dy = Uniform(static_cast<size_t>(c.n) * c.filters * oh * ow, 12);
        std::vector<double> want_w(static_cast<size_t>(c.filters) * c.kernel_h * c.kernel_w, 0.0);
        std::vector<double> want_b(static_cast<size_t>(c.filters), 0.0);
        double scale = 0.0;  // Sum of |dy * x| per output: the rounding's yardstick.
        for (int s = 0; s < c.n; ++s) {
          for (int k = 0; k < c.filters; ++k) {
            for (int p = 0; p < oh; ++p) {
              for (int q = 0; q < ow; ++q) {
                const double g = dy[static_cast<size_t>(((s * c.filters + k) * oh + p) * ow + q)];
                want_b[static_cast<size_t>(k)] += g;
                for (int r = 0; r < c.kernel_h; ++r) {
                  for (int t = 0; t < c.kernel_w; ++t) {
                    const int i = p * c.stride_h - c.pad_h + r, j = q * c.stride_w - c.pad_w + t;
                    if (i < 0 || i >= c.h || j < 0 || j >= c.w) continue;
                    const double v = x[static_cast<size_t>((s * c.h + i) * c.w + j)];
                    want_w[static_cast<size_t>((k * c.kernel_h + r) * c.kernel_w + t)] += g * v;
                    scale += std::abs(g * v);
                  }
                }
              }
            }
          }
        }
        const double tolerance = 1e-6 * scale / static_cast<double>(want_w.size()) + 1e-6;

        const std::vector<float> blocked_dy = ToBlocked(dy, c.n, c.filters, oh, ow, lanes);
        std::vector<float> dw(want_w.size(), -7.f), db(want_b.size(), -7.f), scratch;
        OneChannelConvWeightGrad(c, lanes, threads, x.data(), blocked_dy.data(), dw.data(),
                                 db.data(), &scratch);
        for (size_t i = 0; i < dw.size(); ++i) {
          ASSERT_NEAR(dw[i], want_w[i], tolerance) << "dw[" << i << "]";
        }
        for (size_t i = 0; i < db.size(); ++i) {
          ASSERT_NEAR(db[i], want_b[i], 1e-4) << "db[" << i << "]";
        }
        // Again, into the same scratch, and without a bias: the same bits.
        std::vector<float> again(dw.size(), 3.f);
        OneChannelConvWeightGrad(c, lanes, threads, x.data(), blocked_dy.data(), again.data(),
                                 nullptr, &scratch);
        EXPECT_EQ(Bits(again), Bits(dw));
      }
    }
  }
}

TEST(BlockedLoopsTest, WeightGradIsOnlyForOneFp32InputChannelAndKernelsUpToEightWide) {
  Conv2dConfig c = OneChannelConv(1, 8, 8, 4, 3, 3, 1, 1, 1, 1);
  EXPECT_TRUE(OneChannelConvWeightGradApplies(c));
  c.c = 2;
  EXPECT_FALSE(OneChannelConvWeightGradApplies(c));
  c.c = 1;
  c.kernel_w = 9;
  EXPECT_FALSE(OneChannelConvWeightGradApplies(c));
  c.kernel_w = 3;
  c.dtype = DataType::kBF16;
  EXPECT_FALSE(OneChannelConvWeightGradApplies(c));
  c.dtype = DataType::kF32;
  c.layout = TensorLayout::kNHWC;
  EXPECT_FALSE(OneChannelConvWeightGradApplies(c));
}

TEST(BlockedLoopsTest, WeightGradThroughThePoolGivesTheBitsOfThePoolThenTheWeightGrad) {
  struct FusedCase {
    Conv2dConfig conv;
    int k;  // The pool's window (and stride).
  };
  const FusedCase cases[] = {
      {OneChannelConv(5, 28, 28, 32, 5, 5, 1, 1, 2, 2), 2},  // fmnist conv1, pool1
      {OneChannelConv(3, 9, 12, 20, 3, 3, 1, 1, 1, 1), 3},   // padded filter block, wider window
      {OneChannelConv(2, 11, 9, 8, 4, 2, 2, 1, 2, 1), 2},    // strides and padding: out 6 x 10
  };
  for (const FusedCase& fc : cases) {
    const Conv2dConfig& c = fc.conv;
    const int oh = c.out_h(), ow = c.out_w();
    for (int lanes : {8, 16}) {
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(absl::StrCat("filters ", c.filters, " out ", oh, "x", ow, " window ", fc.k,
                                  " lanes ", lanes, " threads ", threads));
        const BlockedPoolShape pool{.lanes = lanes,
                                    .n = c.n,
                                    .channels = c.filters,
                                    .h = oh,
                                    .w = ow,
                                    .k = fc.k,
                                    .num_threads = threads};
        ASSERT_TRUE(OneChannelConvWeightGradThroughPoolApplies(c, pool));
        const std::vector<float> x = Uniform(static_cast<size_t>(c.n) * c.h * c.w, 21);
        const std::vector<float> conv =
            ToBlocked(Coarse(static_cast<size_t>(c.n) * c.filters * oh * ow, 22), c.n, c.filters,
                      oh, ow, lanes);
        const std::vector<float> pooled_dy =
            Uniform(static_cast<size_t>(c.n) * c.filters * (oh / fc.k) * (ow / fc.k), 23);
        std::vector<float> y(pooled_dy.size());
        std::vector<uint8_t> winners(static_cast<size_t>(BlockedPoolWinnersSize(pool)));
        BlockedMaxPoolReluForward(pool, conv.data(), y.data(), winners.data());

        std::vector<float> d_conv(conv.size(), -7.f), scratch;
        BlockedMaxPoolReluBackward(pool, winners.data(), pooled_dy.data(), d_conv.data());
        const size_t weights = static_cast<size_t>(c.filters) * c.kernel_h * c.kernel_w;
        std::vector<float> want_w(weights), want_b(static_cast<size_t>(c.filters));
        OneChannelConvWeightGrad(c, lanes, threads, x.data(), d_conv.data(), want_w.data(),
                                 want_b.data(), &scratch);

        std::vector<float> dw(weights, -7.f), db(want_b.size(), -7.f);
        OneChannelConvWeightGradThroughPool(c, pool, threads, x.data(), winners.data(),
                                            pooled_dy.data(), dw.data(), db.data(), &scratch);
        EXPECT_EQ(Bits(dw), Bits(want_w));
        EXPECT_EQ(Bits(db), Bits(want_b));
        // No bias, and a fresh scratch: the same weights.
        std::vector<float> again(weights, 3.f), fresh;
        OneChannelConvWeightGradThroughPool(c, pool, threads, x.data(), winners.data(),
                                            pooled_dy.data(), again.data(), nullptr, &fresh);
        EXPECT_EQ(Bits(again), Bits(want_w));
      }
    }
  }
  // A pool of another shape than the convolution's output does not apply.
  const Conv2dConfig c = OneChannelConv(2, 8, 8, 16, 3, 3, 1, 1, 1, 1);
  BlockedPoolShape pool{
      .lanes = 16, .n = 2, .channels = 16, .h = 8, .w = 8, .k = 2, .num_threads = 1};
  EXPECT_TRUE(OneChannelConvWeightGradThroughPoolApplies(c, pool));
  pool.channels = 8;
  EXPECT_FALSE(OneChannelConvWeightGradThroughPoolApplies(c, pool));
  pool.channels = 16;
  pool.n = 3;
  EXPECT_FALSE(OneChannelConvWeightGradThroughPoolApplies(c, pool));
  pool.n = 2;
  pool.h = pool.w = 6;  // Reads only part of the output.
  pool.k = 3;
  EXPECT_FALSE(OneChannelConvWeightGradThroughPoolApplies(c, pool));
}

}  // namespace
}  // namespace pstrain::cpu_internal
