// Pool2dPlan with OpenMP loops over the (sample, channel) planes of NCHW.
//
// Own loops rather than oneDNN: oneDNN 2.6 pools plain NCHW by transposing to
// a blocked layout and back, which on the fmnist-cnn shapes took ~3x longer
// than these plane loops (see bench/cpu_ops_bench). Max-pool backward finds
// each window's winner again from x and y (the first element equal to the
// maximum, as PyTorch and oneDNN choose), so no argmax workspace is kept.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_plans.h"

namespace pstrain::cpu_internal {

absl::Status ValidatePool2dConfig(const Pool2dConfig& c) {
  if (c.n <= 0 || c.c <= 0 || c.h <= 0 || c.w <= 0 || c.window <= 0 || c.stride <= 0 ||
      c.pad < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Pool2d: sizes, window and stride must be positive and padding non-negative (n=", c.n,
        " c=", c.c, " h=", c.h, " w=", c.w, " window=", c.window, " stride=", c.stride,
        " pad=", c.pad, ")"));
  }
  if (c.pad >= c.window) {
    return absl::InvalidArgumentError(
        absl::StrCat("Pool2d: pad ", c.pad, " must be smaller than the window ", c.window));
  }
  if (c.h + 2 * c.pad < c.window || c.w + 2 * c.pad < c.window) {
    return absl::InvalidArgumentError(absl::StrCat("Pool2d: window ", c.window,
                                                   " larger than the padded input ",
                                                   c.h + 2 * c.pad, "x", c.w + 2 * c.pad));
  }
  return absl::OkStatus();
}

namespace {

// Planes are handed out to threads only when there is this much work.
constexpr int64_t kParallelElements = int64_t{1} << 14;

class CpuPool2dPlan final : public Pool2dPlan {
 public:
  CpuPool2dPlan(const Pool2dConfig& config, int num_threads)
      : c_(config),
        out_h_(config.out_h()),
        out_w_(config.out_w()),
        planes_(int64_t{config.n} * config.c),
        num_threads_(num_threads) {}

  absl::Status Forward(const void* x, void* y, bool training) override {
    return ForwardF32(AsF32(x), AsF32(y));
  }
  absl::Status Backward(const void* x, const void* y, const void* dy, void* dx) override {
    return BackwardF32(AsF32(x), AsF32(y), AsF32(dy), AsF32(dx));
  }

 private:
  absl::Status ForwardF32(const float* x, float* y) {
    if (x == nullptr || y == nullptr) {
      return absl::InvalidArgumentError("Pool2d.Forward: x and y must be non-null");
    }
    const int64_t in_plane = int64_t{c_.h} * c_.w, out_plane = int64_t{out_h_} * out_w_;
    const bool fast = IsMax2x2();
#pragma omp parallel for schedule(static) num_threads(num_threads_) if (planes_ * in_plane >= kParallelElements)
    for (int64_t plane = 0; plane < planes_; ++plane) {
      const float* in = x + plane * in_plane;
      float* out = y + plane * out_plane;
      if (fast) {
        MaxPool2x2(in, out);
      } else {
        PoolPlane(in, out);
      }
    }
    return absl::OkStatus();
  }

  absl::Status BackwardF32(const float* x, const float* y, const float* dy, float* dx) {
    if (x == nullptr || y == nullptr || dy == nullptr || dx == nullptr) {
      return absl::InvalidArgumentError("Pool2d.Backward: x, y, dy and dx must be non-null");
    }
    const int64_t in_plane = int64_t{c_.h} * c_.w, out_plane = int64_t{out_h_} * out_w_;
    const bool fast = IsMax2x2();
#pragma omp parallel for schedule(static) num_threads(num_threads_) if (planes_ * in_plane >= kParallelElements)
    for (int64_t plane = 0; plane < planes_; ++plane) {
      float* dx_plane = dx + plane * in_plane;
      if (fast) {
        MaxPool2x2Backward(x + plane * in_plane, y + plane * out_plane, dy + plane * out_plane,
                           dx_plane);
      } else {
        std::memset(dx_plane, 0, sizeof(float) * in_plane);
        BackwardPlane(x + plane * in_plane, y + plane * out_plane, dy + plane * out_plane,
                      dx_plane);
      }
    }
    return absl::OkStatus();
  }

  // The fmnist-cnn case: 2x2 windows, stride 2, no padding. Written without
  // branches (maxss-style selects, NaN checks OR-ed as integers): rows are
  // short (7 or 14 outputs), so much of the work is in scalar tails where a
  // data-dependent branch mispredicts half the time.
  void MaxPool2x2(const float* x, float* y) const {
    for (int p = 0; p < out_h_; ++p) {
      const float* __restrict x0 = x + int64_t{2 * p} * c_.w;
      const float* __restrict x1 = x0 + c_.w;
      float* __restrict o = y + int64_t{p} * out_w_;
      for (int q = 0; q < out_w_; ++q) {
        const float a = x0[2 * q], b = x0[2 * q + 1], c = x1[2 * q], d = x1[2 * q + 1];
        const float ab = b > a ? b : a, cd = d > c ? d : c;
        const float best = cd > ab ? cd : ab;
        // NaN propagates, as in the general loop.
        const int nan = int{a != a} | int{b != b} | int{c != c} | int{d != d};
        o[q] = nan ? std::numeric_limits<float>::quiet_NaN() : best;
      }
    }
  }

  bool IsMax2x2() const {
    return c_.mode == PoolMode::kMax && c_.window == 2 && c_.stride == 2 && c_.pad == 0;
  }

  // Windows tile the plane, so every dx element is written once (the odd
  // last row or column, outside every window, gets zero): no memset, and the
  // inner loop is branch-free selects.
  void MaxPool2x2Backward(const float* x, const float* y, const float* dy, float* dx) const {
    for (int p = 0; p < out_h_; ++p) {
      const float* __restrict x0 = x + int64_t{2 * p} * c_.w;
      const float* __restrict x1 = x0 + c_.w;
      float* __restrict d0 = dx + int64_t{2 * p} * c_.w;
      float* __restrict d1 = d0 + c_.w;
      const float* __restrict yr = y + int64_t{p} * out_w_;
      const float* __restrict gr = dy + int64_t{p} * out_w_;
      for (int q = 0; q < out_w_; ++q) {
        const float best = yr[q], g = gr[q];
        const float a = x0[2 * q], b = x0[2 * q + 1], c = x1[2 * q];
        // The first element equal to the maximum (or NaN) wins.
        const int wins_a = int{a == best} | int{a != a};
        const int wins_b = (int{b == best} | int{b != b}) & ~wins_a & 1;
        const int wins_c = (int{c == best} | int{c != c}) & ~(wins_a | wins_b) & 1;
        const int wins_d = ~(wins_a | wins_b | wins_c) & 1;
        // g or +0.f by masking bits: a select here compiles to a branch.
        const uint32_t bits = std::bit_cast<uint32_t>(g);
        d0[2 * q] = std::bit_cast<float>(bits & (0u - static_cast<uint32_t>(wins_a)));
        d0[2 * q + 1] = std::bit_cast<float>(bits & (0u - static_cast<uint32_t>(wins_b)));
        d1[2 * q] = std::bit_cast<float>(bits & (0u - static_cast<uint32_t>(wins_c)));
        d1[2 * q + 1] = std::bit_cast<float>(bits & (0u - static_cast<uint32_t>(wins_d)));
      }
      if (c_.w % 2 != 0) {
        d0[c_.w - 1] = 0.f;
        d1[c_.w - 1] = 0.f;
      }
    }
    if (c_.h % 2 != 0) std::memset(dx + int64_t{c_.h - 1} * c_.w, 0, sizeof(float) * c_.w);
  }

  // Window [h0, h1) x [w0, w1) of output (p, q), clipped to the input.
  void Window(int p, int q, int* h0, int* h1, int* w0, int* w1) const {
    const int hs = p * c_.stride - c_.pad, ws = q * c_.stride - c_.pad;
    *h0 = std::max(hs, 0);
    *w0 = std::max(ws, 0);
    *h1 = std::min(hs + c_.window, c_.h);
    *w1 = std::min(ws + c_.window, c_.w);
  }

  void PoolPlane(const float* in, float* out) const {
    for (int p = 0; p < out_h_; ++p) {
      for (int q = 0; q < out_w_; ++q) {
        int h0, h1, w0, w1;
        Window(p, q, &h0, &h1, &w0, &w1);
        float result;
        if (c_.mode == PoolMode::kMax) {
          result = -std::numeric_limits<float>::infinity();
          for (int h = h0; h < h1; ++h) {
            for (int w = w0; w < w1; ++w) {
              const float v = in[int64_t{h} * c_.w + w];
              if (v > result || std::isnan(v)) result = v;
              if (std::isnan(result)) break;
            }
          }
        } else {
          float sum = 0.f;
          for (int h = h0; h < h1; ++h) {
            for (int w = w0; w < w1; ++w) sum += in[int64_t{h} * c_.w + w];
          }
          result = sum / static_cast<float>((h1 - h0) * (w1 - w0));
        }
        out[int64_t{p} * out_w_ + q] = result;
      }
    }
  }

  void BackwardPlane(const float* x, const float* y, const float* dy, float* dx) const {
    for (int p = 0; p < out_h_; ++p) {
      for (int q = 0; q < out_w_; ++q) {
        int h0, h1, w0, w1;
        Window(p, q, &h0, &h1, &w0, &w1);
        const int64_t out_index = int64_t{p} * out_w_ + q;
        const float g = dy[out_index];
        if (c_.mode == PoolMode::kMax) {
          // The first element equal to the forward maximum (or a NaN, which
          // the forward propagated) takes the whole gradient.
          const float best = y[out_index];
          bool done = false;
          for (int h = h0; h < h1 && !done; ++h) {
            for (int w = w0; w < w1; ++w) {
              const int64_t i = int64_t{h} * c_.w + w;
              if (x[i] == best || std::isnan(x[i])) {
                dx[i] += g;
                done = true;
                break;
              }
            }
          }
        } else {
          const float share = g / static_cast<float>((h1 - h0) * (w1 - w0));
          for (int h = h0; h < h1; ++h) {
            for (int w = w0; w < w1; ++w) dx[int64_t{h} * c_.w + w] += share;
          }
        }
      }
    }
  }

  // Constant after construction.
  const Pool2dConfig c_;
  const int out_h_, out_w_;
  const int64_t planes_;
  const int num_threads_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreateCpuPool2dPlan(const Pool2dConfig& config,
                                                                int num_threads) {
  PSTRAIN_RETURN_IF_ERROR(ValidatePool2dConfig(config));
  return std::unique_ptr<Pool2dPlan>(std::make_unique<CpuPool2dPlan>(config, num_threads));
}

}  // namespace pstrain::cpu_internal
