// The counter-based RNG of common/rng.h: its integer dropout test must be
// the float one, exactly, since masks must match across backends and builds.
#include "common/rng.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

TEST(RngTest, DropoutKeepBitsIsDropoutKeepForEveryRate) {
  std::vector<float> rates = {0.f,    std::numeric_limits<float>::denorm_min(),
                              1e-30f, 1e-7f,
                              0.1f,   0.25f,
                              0.3f,   0.4f,
                              0.5f,   0.9f,
                              0.999f};
  // Rates on the 2^-24 grid the uniforms live on, and the floats either side.
  for (uint32_t k : {1u, 2u, 3u, 4096u, 8388608u, 16777215u}) {
    const float on_grid = static_cast<float>(k) / 16777216.f;
    rates.push_back(on_grid);
    rates.push_back(std::nextafter(on_grid, 0.f));
    if (std::nextafter(on_grid, 1.f) < 1.f) rates.push_back(std::nextafter(on_grid, 1.f));
  }
  rates.push_back(std::nextafter(1.f, 0.f));
  int kept = 0, dropped = 0;
  for (float rate : rates) {
    ASSERT_LT(rate, 1.f);
    const uint32_t threshold = DropoutKeepThreshold(rate);
    // The boundary itself: h = threshold is the smallest 24-bit value whose
    // uniform passes (random indices rarely land on it).
    EXPECT_GE(static_cast<float>(threshold) * (1.0f / 16777216.0f), rate) << rate;
    if (threshold > 0) {
      EXPECT_LT(static_cast<float>(threshold - 1) * (1.0f / 16777216.0f), rate) << rate;
    }
    for (uint64_t seed : {uint64_t{0}, uint64_t{7}, uint64_t{0x9E3779B97F4A7C15ull}}) {
      for (uint64_t i = 0; i < 20000; ++i) {
        const bool keep = DropoutKeep(seed, i, rate);
        ASSERT_EQ(DropoutKeepBits(seed, i, threshold), keep)
            << "rate " << rate << " seed " << seed << " index " << i;
        (keep ? kept : dropped)++;
      }
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(dropped, 0);
}

TEST(RngTest, DropoutKeepThresholdOnTheGrid) {
  EXPECT_EQ(DropoutKeepThreshold(0.f), 0u);
  EXPECT_EQ(DropoutKeepThreshold(0.5f), 8388608u);
  EXPECT_EQ(DropoutKeepThreshold(std::numeric_limits<float>::denorm_min()), 1u);
  EXPECT_EQ(DropoutKeepThreshold(std::nextafter(1.f, 0.f)), 16777215u);
}

}  // namespace
}  // namespace pstrain
