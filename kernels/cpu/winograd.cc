// winograd.h's F(4x4, 5x5) in AVX2 intrinsics (kernels/ builds for
// x86-64-v3): 8 channels per register, a 16-channel block as two; where the
// shape asks for 512 bits and the CPU has them, the same steps of
// winograd_avx512.cc instead.
//
// A convolution runs over blocks of kTileBlock output tiles (4x4 outputs
// each), one block per thread at a time, in three steps that stay in the
// core's cache:
//  1. input transform (winograd_transforms.h): each tile's 8x8 input patch,
//     a register of channels at a time, becomes V[tile][p][in] =
//     (B^T d B)[p] for the 64 points p;
//  2. 64 small matrix products M[.][p] = V[.][p] x U[p] ([tiles x in] x
//     [in x out]), in registers kTileRows tiles by 16 output channels
//     (M[tile][p][out]; a tile's values lie together for steps 1 and 3);
//  3. output transform (winograd_transforms.h): Y = A^T M A (plus the bias)
//     for each tile and a register of output channels, written to the
//     outputs inside the image.
#include "kernels/cpu/winograd.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cpu/winograd_kernels.h"
#include "kernels/cpu/winograd_transforms.h"
#include "oneapi/dnnl/dnnl.h"

namespace pstrain::cpu_internal {
namespace {

using winograd::Geometry;
using winograd::GeometryOf;
using winograd::kAlpha;
using winograd::kGradChunk;
using winograd::kM;
using winograd::kPoints;
using winograd::kTileBlock;
using winograd::TileStride;
using winograd::V256;
constexpr int kTileRows = 6;  // Tiles per register block of step 2 in 256 bits.
static_assert(kTileBlock == 2 * kTileRows);

// Every block reads all of U (64 x in x out floats): 6 flops a byte, fine
// while U stays in the caches. Measured (docs/BENCHMARKS.md): 1.5-3x the
// direct kernels up to 256 -> 256 channels (U 16 MiB), 0.45-0.5x at
// 512 -> 512 (64 MiB), which keeps oneDNN's.
constexpr int64_t kMaxChannelProduct = 256 * 256;
// Below about this many multiply-adds of the direct convolution (some 0.5 ms
// of it on two cores), the filter transform and the thread team cost more
// than Winograd saves: measured 0.45-0.8x up to 40 M, 1.1-2.3x from 80 M.
constexpr double kMinDirectMultiplyAdds = double{int64_t{1} << 26};
// The weight gradient's sums: 64 x c x filters floats in each of its
// kMaxGradSegments parts at most (8 MiB in all at 64 x 64 channels).
constexpr int64_t kMaxWeightGradChannelProduct = 64 * 64;

// G of F(4, 5), the Vandermonde matrix of the filter at the points of
// winograd_transforms.h's A^T and B^T, scaled by the inverse of B^T's row
// scales. U = G g G^T is computed in double and rounded to float once per
// value.
constexpr double kG[kAlpha][5] = {
    {0.25, 0.0, 0.0, 0.0, 0.0},
    {1.0 / 18.0, 1.0 / 18.0, 1.0 / 18.0, 1.0 / 18.0, 1.0 / 18.0},
    {1.0 / 18.0, -1.0 / 18.0, 1.0 / 18.0, -1.0 / 18.0, 1.0 / 18.0},
    {1.0 / 360.0, 1.0 / 180.0, 1.0 / 90.0, 1.0 / 45.0, 2.0 / 45.0},
    {1.0 / 360.0, -1.0 / 180.0, 1.0 / 90.0, -1.0 / 45.0, 2.0 / 45.0},
    {1.0 / 45.0, 1.0 / 90.0, 1.0 / 180.0, 1.0 / 360.0, 1.0 / 720.0},
    {1.0 / 45.0, -1.0 / 90.0, 1.0 / 180.0, -1.0 / 360.0, 1.0 / 720.0},
    {0.0, 0.0, 0.0, 0.0, 0.25},
};

// Step 2: m[t][p][out] = sum_in v[t][p][in] * u[p][in][out], kTileRows tiles
// by 16 output channels in registers, `in` summed in order.
void MultiplyPoints(const WinogradShape& s, const float* v, const float* u, float* m) {
  const int cin = s.in_channels, cout = s.out_channels;
  for (int p = 0; p < kPoints; ++p) {
    const float* vp = v + int64_t{p} * cin;
    const float* up = u + int64_t{p} * cin * cout;
    float* mp = m + int64_t{p} * cout;
    const int64_t v_tile = TileStride(cin), m_tile = TileStride(cout);
    for (int o = 0; o < cout; o += 16) {
      for (int t0 = 0; t0 < kTileBlock; t0 += kTileRows) {
        __m256 acc[kTileRows][2];
#pragma GCC unroll 6
        for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float* vrow = vp + t0 * v_tile;
#pragma GCC unroll 4
        for (int i = 0; i < cin; ++i) {
          const __m256 u0 = _mm256_loadu_ps(up + int64_t{i} * cout + o);
          const __m256 u1 = _mm256_loadu_ps(up + int64_t{i} * cout + o + 8);
#pragma GCC unroll 6
          for (int r = 0; r < kTileRows; ++r) {
            const __m256 b = _mm256_broadcast_ss(vrow + r * v_tile + i);
            acc[r][0] = _mm256_fmadd_ps(b, u0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, u1, acc[r][1]);
          }
        }
#pragma GCC unroll 6
        for (int r = 0; r < kTileRows; ++r) {
          float* out = mp + (t0 + r) * m_tile + o;
          _mm256_storeu_ps(out, acc[r][0]);
          _mm256_storeu_ps(out + 8, acc[r][1]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Weight gradient: dW = G^T [sum over tiles (A dy A^T) . (B^T d B)] G, the
// transpose of the forward's bilinear algorithm (the gradient of
// sum(dy * A^T [(G g) . (B^T d B)] A) with respect to g). The tiles are cut
// into segments (as many as the shape says), each summed by one thread into
// sums of its own, kGradChunk tiles at a time: transformed to the 64 points,
// then their products added point by point. The segments' sums are then
// added in segment order: one order per value whatever the thread count,
// and no barrier between the threads until the end.
// ---------------------------------------------------------------------------

// Segments: up to kMaxGradSegments, each of at least kMinGradSegmentTiles
// tiles, so that a segment's products outweigh writing and adding its sums.
// Their number depends on the shape only, never on the thread count.
constexpr int kMaxGradSegments = 8;
constexpr int64_t kMinGradSegmentTiles = 64;

// m[k][c] += sum_{t < count} vdy[t][p][k] * vx[t][p][c] for filters [k0,
// k0 + Rows), all channels, in t order (m = that sum when `fresh`), vx and
// vdy pointing at tile 0's point p: Rows filters by 16 channels in
// registers.
template <int Rows>
inline __attribute__((always_inline)) void AccumulateRows(int cin, int cout, int k0, int count,
                                                          const float* vx, const float* vdy,
                                                          bool fresh, float* m) {
  for (int c = 0; c < cin; c += 16) {
    __m256 acc[Rows][2];
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      acc[r][0] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(m + int64_t{k0 + r} * cin + c);
      acc[r][1] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(m + int64_t{k0 + r} * cin + c + 8);
    }
    for (int t = 0; t < count; ++t) {
      const __m256 x0 = _mm256_loadu_ps(vx + t * TileStride(cin) + c);
      const __m256 x1 = _mm256_loadu_ps(vx + t * TileStride(cin) + c + 8);
#pragma GCC unroll 6
      for (int r = 0; r < Rows; ++r) {
        const __m256 d = _mm256_broadcast_ss(vdy + t * TileStride(cout) + k0 + r);
        acc[r][0] = _mm256_fmadd_ps(d, x0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(d, x1, acc[r][1]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < Rows; ++r) {
      _mm256_storeu_ps(m + int64_t{k0 + r} * cin + c, acc[r][0]);
      _mm256_storeu_ps(m + int64_t{k0 + r} * cin + c + 8, acc[r][1]);
    }
  }
}

// The same for one point and every filter (cout is even): six filters at a
// time, then the last two or four.
void AccumulatePoint(int cin, int cout, int count, const float* vx, const float* vdy, bool fresh,
                     float* m) {
  int k = 0;
  for (; k + 6 <= cout; k += 6) AccumulateRows<6>(cin, cout, k, count, vx, vdy, fresh, m);
  if (cout - k == 4) AccumulateRows<4>(cin, cout, k, count, vx, vdy, fresh, m);
  if (cout - k == 2) AccumulateRows<2>(cin, cout, k, count, vx, vdy, fresh, m);
}

}  // namespace

bool WinogradAvx512Available() {
  // oneDNN's view of the CPU: AVX-512 F, CD, BW, DQ and VL, with the OS
  // saving the 512-bit registers.
  static const bool available = [] {
    const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    const unsigned avx512 = static_cast<unsigned>(dnnl_cpu_isa_avx512_core);
    return (isa & avx512) == avx512;
  }();
  return available;
}

bool WinogradSupports(const Conv2dConfig& c) {
  return c.dtype == DataType::kF32 && c.kernel_h == 5 && c.kernel_w == 5 && c.stride_h == 1 &&
         c.stride_w == 1 && c.pad_h == 2 && c.pad_w == 2 && c.c > 0 && c.c % 16 == 0 &&
         c.filters > 0 && c.filters % 16 == 0 && c.h > 0 && c.w > 0 && c.n > 0;
}

bool WinogradApplies(const Conv2dConfig& c) {
  return WinogradSupports(c) && int64_t{c.c} * c.filters <= kMaxChannelProduct &&
         25.0 * c.n * c.h * c.w * c.c * c.filters >= kMinDirectMultiplyAdds;
}

bool WinogradWeightGradApplies(const Conv2dConfig& c) {
  return WinogradApplies(c) && int64_t{c.c} * c.filters <= kMaxWeightGradChannelProduct;
}

void WinogradFilters(const Conv2dConfig& c, const float* w, bool for_backward_data, int num_threads,
                     std::vector<float>* u) {
  const int cin = for_backward_data ? c.filters : c.c;
  const int cout = for_backward_data ? c.c : c.filters;
  u->resize(static_cast<size_t>(kPoints) * cin * cout);
  float* const dst_base = u->data();
  // kLanes output channels at a time, in double (one rounding per value),
  // lanes innermost so that the loops vectorise. Every value is computed
  // alone, so the thread count does not change a bit.
  constexpr int kLanes = 8;  // cout is a multiple of 16.
  const int64_t groups = int64_t{cin} * (cout / kLanes);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (groups >= 16)
  for (int64_t group = 0; group < groups; ++group) {
    const int i = static_cast<int>(group / (cout / kLanes));
    const int o0 = static_cast<int>(group % (cout / kLanes)) * kLanes;
    double g[5][5][kLanes];  // g[r][q][l]: filter (o0 + l, i) of the convolution U runs.
    for (int l = 0; l < kLanes; ++l) {
      const int o = o0 + l;
      for (int r = 0; r < 5; ++r) {
        for (int q = 0; q < 5; ++q) {
          g[r][q][l] = for_backward_data ? w[((int64_t{i} * c.c + o) * 5 + (4 - r)) * 5 + (4 - q)]
                                         : w[((int64_t{o} * c.c + i) * 5 + r) * 5 + q];
        }
      }
    }
    double gg[kAlpha][5][kLanes];  // G g
    for (int a = 0; a < kAlpha; ++a) {
      for (int q = 0; q < 5; ++q) {
        for (int l = 0; l < kLanes; ++l) gg[a][q][l] = 0;
        for (int r = 0; r < 5; ++r) {
          for (int l = 0; l < kLanes; ++l) gg[a][q][l] += kG[a][r] * g[r][q][l];
        }
      }
    }
    for (int a = 0; a < kAlpha; ++a) {
      for (int b = 0; b < kAlpha; ++b) {
        double sum[kLanes] = {};
        for (int q = 0; q < 5; ++q) {
          for (int l = 0; l < kLanes; ++l) sum[l] += gg[a][q][l] * kG[b][q];
        }
        float* dst = dst_base + (static_cast<size_t>(a * kAlpha + b) * cin + i) * cout + o0;
        for (int l = 0; l < kLanes; ++l) dst[l] = static_cast<float>(sum[l]);
      }
    }
  }
}

void WinogradConv5x5(const WinogradShape& s, const float* in, const std::vector<float>& u,
                     const float* bias, float* out) {
  const Geometry g = GeometryOf(s);
  const int64_t blocks = (g.tiles + kTileBlock - 1) / kTileBlock;
  const float* up = u.data();
  // Never 512 bits on a CPU without them, whatever the caller asked.
  const bool wide = s.avx512 && WinogradAvx512Available();
  // The transforms in 512 bits read and write whole 16-channel blocks.
  const bool wide_in = wide && s.in_lanes == 16, wide_out = wide && s.out_lanes == 16;
#pragma omp parallel num_threads(s.num_threads)
  {
    thread_local std::vector<float> v, m;
    v.resize(static_cast<size_t>(kTileBlock * TileStride(s.in_channels)));
    m.resize(static_cast<size_t>(kTileBlock * TileStride(s.out_channels)));
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t first = block * kTileBlock;
      const int count = static_cast<int>(std::min<int64_t>(kTileBlock, g.tiles - first));
      if (wide_in) {
        winograd::TransformInputsAvx512(s, in, first, count, v.data());
      } else {
        winograd::TransformInputs<V256>(s, g, in, first, count, v.data());
      }
      if (wide) {
        winograd::MultiplyPointsAvx512(s.in_channels, s.out_channels, v.data(), up, m.data());
      } else {
        MultiplyPoints(s, v.data(), up, m.data());
      }
      if (wide_out) {
        winograd::TransformOutputsAvx512(s, m.data(), bias, first, count, out);
      } else {
        winograd::TransformOutputs<V256>(s, g, m.data(), bias, first, count, out);
      }
    }
  }
}

void WinogradWeightGrad5x5(const WinogradShape& s, const float* x, const float* dy, float* dw,
                           float* dbias, std::vector<float>* scratch) {
  const Geometry g = GeometryOf(s);
  const int cin = s.in_channels, cout = s.out_channels;
  // The tiles in a fixed number of segments, each summed by one thread
  // into its own m[p][k][c] in tile order, chunk by chunk; then the segments'
  // sums in segment order, into the first. So every value is summed in one
  // order whatever the thread count, and the threads meet only at the end.
  const int num_segments =
      static_cast<int>(std::clamp<int64_t>(g.tiles / kMinGradSegmentTiles, 1, kMaxGradSegments));
  const int64_t per_segment = (g.tiles + num_segments - 1) / num_segments;
  const size_t m_size = static_cast<size_t>(kPoints) * cin * cout;
  if (scratch->size() < m_size * num_segments) scratch->resize(m_size * num_segments);
  float* const segments = scratch->data();
  const float* const m = segments;  // The sum of the segments, once added.
  // As in WinogradConv5x5.
  const bool wide = s.avx512 && WinogradAvx512Available();
  const bool wide_x = wide && s.in_lanes == 16, wide_dy = wide && s.out_lanes == 16;
#pragma omp parallel num_threads(s.num_threads)
  {
    thread_local std::vector<float> vx, vdy;
    vx.resize(static_cast<size_t>(kGradChunk * TileStride(cin)));
    vdy.resize(static_cast<size_t>(kGradChunk * TileStride(cout)));
#pragma omp for schedule(static)
    for (int segment = 0; segment < num_segments; ++segment) {
      float* ms = segments + m_size * segment;
      const int64_t begin = std::min<int64_t>(g.tiles, segment * per_segment);
      const int64_t end = std::min<int64_t>(g.tiles, (segment + 1) * per_segment);
      if (begin == end) std::memset(ms, 0, sizeof(float) * m_size);  // No tile: zeros.
      for (int64_t first = begin; first < end; first += kGradChunk) {
        const int count = static_cast<int>(std::min<int64_t>(kGradChunk, end - first));
        if (wide_x) {
          winograd::TransformInputTilesAvx512(s, x, first, count, vx.data());
        } else {
          winograd::TransformInputTiles<V256>(s, g, x, first, count, vx.data());
        }
        if (wide_dy) {
          winograd::TransformGradientTilesAvx512(s, dy, first, count, vdy.data());
        } else {
          winograd::TransformGradientTiles<V256>(s, g, dy, first, count, vdy.data());
        }
        for (int p = 0; p < kPoints; ++p) {
          const float* vxp = vx.data() + static_cast<size_t>(p) * cin;
          const float* vdyp = vdy.data() + static_cast<size_t>(p) * cout;
          float* mp = ms + static_cast<size_t>(p) * cout * cin;
          if (wide) {
            winograd::AccumulatePointAvx512(cin, cout, count, vxp, vdyp, /*fresh=*/first == begin,
                                            mp);
          } else {
            AccumulatePoint(cin, cout, count, vxp, vdyp, /*fresh=*/first == begin, mp);
          }
        }
      }
    }
#pragma omp for schedule(static)
    for (int p = 0; p < kPoints; ++p) {
      const size_t at = static_cast<size_t>(p) * cout * cin, size = static_cast<size_t>(cout) * cin;
      float* out = segments + at;
      for (int segment = 1; segment < num_segments; ++segment) {
        const float* add = segments + m_size * segment + at;
        for (size_t i = 0; i < size; ++i) out[i] += add[i];
      }
    }
    // dW[k][c] = G^T M G, in double (one rounding per value), channels
    // innermost so that the loops vectorise.
    std::vector<double> mg(static_cast<size_t>(kAlpha) * 5 * cin);  // (M G)[i][q][c]
    std::vector<double> out(static_cast<size_t>(25) * cin);         // dW[k][r][q][c]
#pragma omp for schedule(static)
    for (int k = 0; k < cout; ++k) {
      std::fill(mg.begin(), mg.end(), 0.0);
      for (int i = 0; i < kAlpha; ++i) {
        for (int j = 0; j < kAlpha; ++j) {
          const float* mk = m + ((static_cast<size_t>(i) * kAlpha + j) * cout + k) * cin;
          for (int q = 0; q < 5; ++q) {
            const double gjq = kG[j][q];
            if (gjq == 0) continue;
            double* row = mg.data() + (static_cast<size_t>(i) * 5 + q) * cin;
            for (int c = 0; c < cin; ++c) row[c] += double{mk[c]} * gjq;
          }
        }
      }
      std::fill(out.begin(), out.end(), 0.0);
      for (int r = 0; r < 5; ++r) {
        for (int i = 0; i < kAlpha; ++i) {
          const double gir = kG[i][r];
          if (gir == 0) continue;
          for (int q = 0; q < 5; ++q) {
            const double* row = mg.data() + (static_cast<size_t>(i) * 5 + q) * cin;
            double* o = out.data() + (static_cast<size_t>(r) * 5 + q) * cin;
            for (int c = 0; c < cin; ++c) o[c] += gir * row[c];
          }
        }
      }
      float* dst = dw + static_cast<size_t>(k) * cin * 25;
      for (int c = 0; c < cin; ++c) {
        for (int rq = 0; rq < 25; ++rq) dst[c * 25 + rq] = static_cast<float>(out[rq * cin + c]);
      }
    }
    if (dbias != nullptr) {
      // Each filter's gradient over images, then pixels, in four partial
      // sums (pixel index mod 4) added at the end: one fixed order.
      const int64_t pixels = int64_t{s.h} * s.w;
#pragma omp for schedule(static)
      for (int k = 0; k < cout; k += 8) {
        __m256 partial[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                             _mm256_setzero_ps()};
        for (int64_t n = 0; n < s.n; ++n) {
          const float* plane = winograd::ChannelsOf(dy, n, g.out_blocks, s.out_lanes, s.h, s.w, k);
          int64_t p = 0;
          for (; p + 4 <= pixels; p += 4) {
#pragma GCC unroll 4
            for (int u = 0; u < 4; ++u) {
              partial[u] =
                  _mm256_add_ps(partial[u], _mm256_loadu_ps(plane + (p + u) * s.out_lanes));
            }
          }
          for (; p < pixels; ++p) {
            partial[p % 4] =
                _mm256_add_ps(partial[p % 4], _mm256_loadu_ps(plane + p * s.out_lanes));
          }
        }
        const __m256 sum = _mm256_add_ps(_mm256_add_ps(partial[0], partial[1]),
                                         _mm256_add_ps(partial[2], partial[3]));
        _mm256_storeu_ps(dbias + k, sum);
      }
    }
  }
}

}  // namespace pstrain::cpu_internal
