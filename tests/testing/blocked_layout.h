// NCHW <-> oneDNN's channel-blocked activation layout ([n][c / lanes][h][w]
// [lanes], the last block padded with zeros), for the tests of the loops
// that run on it (kernels/cpu/blocked_loops.h, kernels/cpu/winograd.h).
#ifndef PSTRAIN_TESTS_TESTING_BLOCKED_LAYOUT_H_
#define PSTRAIN_TESTS_TESTING_BLOCKED_LAYOUT_H_

#include <cstdint>
#include <vector>

namespace pstrain::testing {

inline std::vector<float> ToBlocked(const std::vector<float>& nchw, int64_t n, int c, int h, int w,
                                    int lanes) {
  const int blocks = (c + lanes - 1) / lanes;
  std::vector<float> out(static_cast<size_t>(n * blocks * h * w * lanes), 0.f);
  for (int64_t s = 0; s < n; ++s) {
    for (int ch = 0; ch < c; ++ch) {
      for (int i = 0; i < h * w; ++i) {
        out[static_cast<size_t>(((s * blocks + ch / lanes) * h * w + i) * lanes + ch % lanes)] =
            nchw[static_cast<size_t>((s * c + ch) * h * w + i)];
      }
    }
  }
  return out;
}

inline std::vector<float> FromBlocked(const std::vector<float>& blocked, int64_t n, int c, int h,
                                      int w, int lanes) {
  const int blocks = (c + lanes - 1) / lanes;
  std::vector<float> out(static_cast<size_t>(n * c * h * w));
  for (int64_t s = 0; s < n; ++s) {
    for (int ch = 0; ch < c; ++ch) {
      for (int i = 0; i < h * w; ++i) {
        out[static_cast<size_t>((s * c + ch) * h * w + i)] = blocked[static_cast<size_t>(
            ((s * blocks + ch / lanes) * h * w + i) * lanes + ch % lanes)];
      }
    }
  }
  return out;
}

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TESTING_BLOCKED_LAYOUT_H_
