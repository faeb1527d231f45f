// winograd.h's F(2x2, 5x5) in AVX2 intrinsics (kernels/ builds for
// x86-64-v3): 8 channels per register, a 16-channel block as two.
//
// A convolution runs over blocks of kTileBlock output tiles (2x2 outputs
// each), one block per thread at a time, in three steps that stay in the
// core's cache:
//  1. input transform: each tile's 6x6 input patch, 8 channels at a time,
//     becomes V[tile][p][in] = (B^T d B)[p] for the 36 points p;
//  2. 36 small matrix products M[.][p] = V[.][p] x U[p] ([tiles x in] x
//     [in x out]), in registers kTileRows tiles by 16 output channels
//     (M[tile][p][out]; a tile's values lie together for steps 1 and 3);
//  3. output transform: Y = A^T M A (plus the bias) for each tile and 8
//     output channels, written to the 2x2 outputs inside the image.
#include "kernels/cpu/winograd.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pstrain::cpu_internal {
namespace {

constexpr int kAlpha = 6;                  // Input tile side: 2 + 5 - 1.
constexpr int kPoints = kAlpha * kAlpha;   // Products per tile and channel pair.
constexpr int kTileRows = 6;               // Tiles per register block of step 2.
constexpr int kTileBlock = 2 * kTileRows;  // Tiles per block of the three steps.

// G (6x5) of F(2, 5) with points 0, 1, -1, 2, -2 and infinity, scaled so
// that B^T holds small integers. U = G g G^T is computed in double and
// rounded to float once per value.
constexpr double kG[kAlpha][5] = {
    {1.0 / 4, 0, 0, 0, 0},
    {1.0 / 6, 1.0 / 6, 1.0 / 6, 1.0 / 6, 1.0 / 6},
    {1.0 / 6, -1.0 / 6, 1.0 / 6, -1.0 / 6, 1.0 / 6},
    {1.0 / 24, 1.0 / 12, 1.0 / 6, 1.0 / 3, 2.0 / 3},
    {1.0 / 24, -1.0 / 12, 1.0 / 6, -1.0 / 3, 2.0 / 3},
    {0, 0, 0, 0, 1},
};

// t = B^T d for six vectors, B^T being
//   { 4,  0, -5,  0, 1, 0 }
//   { 0,  4,  4, -1, -1, 0 }
//   { 0, -4,  4,  1, -1, 0 }
//   { 0, -2, -1,  2, 1, 0 }
//   { 0,  2, -1, -2, 1, 0 }
//   { 0,  4,  0, -5, 0, 1 }
inline void InputTransform6(const __m256 d0, const __m256 d1, const __m256 d2, const __m256 d3,
                            const __m256 d4, const __m256 d5, __m256* t) {
  const __m256 two = _mm256_set1_ps(2.f), four = _mm256_set1_ps(4.f), five = _mm256_set1_ps(5.f);
  t[0] = _mm256_fmadd_ps(four, d0, _mm256_fnmadd_ps(five, d2, d4));
  t[1] = _mm256_fmsub_ps(four, _mm256_add_ps(d1, d2), _mm256_add_ps(d3, d4));
  t[2] = _mm256_fmadd_ps(four, _mm256_sub_ps(d2, d1), _mm256_sub_ps(d3, d4));
  const __m256 d42 = _mm256_sub_ps(d4, d2);
  t[3] = _mm256_fmadd_ps(two, _mm256_sub_ps(d3, d1), d42);
  t[4] = _mm256_fmadd_ps(two, _mm256_sub_ps(d1, d3), d42);
  t[5] = _mm256_fmadd_ps(four, d1, _mm256_fnmadd_ps(five, d3, d5));
}

// y = A^T m for six vectors, A^T being
//   { 1, 1,  1, 1,  1, 0 }
//   { 0, 1, -1, 2, -2, 1 }
inline void OutputTransform6(const __m256* m, __m256* y0, __m256* y1) {
  const __m256 two = _mm256_set1_ps(2.f);
  *y0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(m[0], m[1]), _mm256_add_ps(m[2], m[3])), m[4]);
  *y1 = _mm256_add_ps(_mm256_fmadd_ps(two, _mm256_sub_ps(m[3], m[4]), _mm256_sub_ps(m[1], m[2])),
                      m[5]);
}

struct Geometry {
  int tiles_h, tiles_w;
  int64_t tiles;  // n * tiles_h * tiles_w.
  int in_blocks, out_blocks;
};

Geometry GeometryOf(const WinogradShape& s) {
  Geometry g;
  g.tiles_h = (s.h + 1) / 2;
  g.tiles_w = (s.w + 1) / 2;
  g.tiles = s.n * g.tiles_h * g.tiles_w;
  g.in_blocks = (s.in_channels + s.in_lanes - 1) / s.in_lanes;
  g.out_blocks = (s.out_channels + s.out_lanes - 1) / s.out_lanes;
  return g;
}

// Step 1 for tiles [first, first + count) into v[kTileBlock][kPoints][in].
void TransformInputs(const WinogradShape& s, const Geometry& g, const float* in, int64_t first,
                     int count, float* v) {
  const int cin = s.in_channels;
  const int64_t point_stride = cin;
  const __m256 zero = _mm256_setzero_ps();
  for (int t = 0; t < kTileBlock; ++t) {
    float* vt = v + int64_t{t} * kPoints * cin;
    if (t >= count) {
      // Past the last tile: zeros, which step 2 multiplies and step 3 drops.
      std::memset(vt, 0, sizeof(float) * kPoints * cin);
      continue;
    }
    const int64_t tile = first + t;
    const int tx = static_cast<int>(tile % g.tiles_w);
    const int ty = static_cast<int>(tile / g.tiles_w % g.tiles_h);
    const int64_t image = tile / (int64_t{g.tiles_w} * g.tiles_h);
    const int y0 = 2 * ty - 2, x0 = 2 * tx - 2;
    for (int c = 0; c < cin; c += 8) {
      const float* plane =
          in + ((image * g.in_blocks + c / s.in_lanes) * s.h) * int64_t{s.w} * s.in_lanes +
          c % s.in_lanes;
      __m256 d[kAlpha][kAlpha];
      for (int i = 0; i < kAlpha; ++i) {
        const int y = y0 + i;
        for (int j = 0; j < kAlpha; ++j) {
          const int x = x0 + j;
          d[i][j] = (y >= 0 && y < s.h && x >= 0 && x < s.w)
                        ? _mm256_loadu_ps(plane + (int64_t{y} * s.w + x) * s.in_lanes)
                        : zero;
        }
      }
      __m256 cols[kAlpha][kAlpha];  // cols[i][j] = (B^T d)[i][j].
      for (int j = 0; j < kAlpha; ++j) {
        __m256 t6[kAlpha];
        InputTransform6(d[0][j], d[1][j], d[2][j], d[3][j], d[4][j], d[5][j], t6);
        for (int i = 0; i < kAlpha; ++i) cols[i][j] = t6[i];
      }
      for (int i = 0; i < kAlpha; ++i) {
        __m256 t6[kAlpha];
        InputTransform6(cols[i][0], cols[i][1], cols[i][2], cols[i][3], cols[i][4], cols[i][5], t6);
        for (int j = 0; j < kAlpha; ++j) {
          _mm256_storeu_ps(vt + (i * kAlpha + j) * point_stride + c, t6[j]);
        }
      }
    }
  }
}

// Step 2: m[t][p][out] = sum_in v[t][p][in] * u[p][in][out], kTileRows tiles
// by 16 output channels in registers, `in` summed in order.
void MultiplyPoints(const WinogradShape& s, const float* v, const float* u, float* m) {
  const int cin = s.in_channels, cout = s.out_channels;
  for (int p = 0; p < kPoints; ++p) {
    const float* vp = v + int64_t{p} * cin;
    const float* up = u + int64_t{p} * cin * cout;
    float* mp = m + int64_t{p} * cout;
    const int64_t v_tile = int64_t{kPoints} * cin, m_tile = int64_t{kPoints} * cout;
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

// Step 3 for tiles [first, first + count).
void TransformOutputs(const WinogradShape& s, const Geometry& g, const float* m, const float* bias,
                      int64_t first, int count, float* out) {
  const int cout = s.out_channels;
  const int64_t point_stride = cout;
  for (int t = 0; t < count; ++t) {
    const int64_t tile = first + t;
    const int tx = static_cast<int>(tile % g.tiles_w);
    const int ty = static_cast<int>(tile / g.tiles_w % g.tiles_h);
    const int64_t image = tile / (int64_t{g.tiles_w} * g.tiles_h);
    const bool full_h = 2 * ty + 1 < s.h, full_w = 2 * tx + 1 < s.w;
    const float* mt = m + int64_t{t} * kPoints * cout;
    for (int o = 0; o < cout; o += 8) {
      __m256 rows[2][kAlpha];  // rows[a][j] = (A^T M)[a][j].
      for (int j = 0; j < kAlpha; ++j) {
        __m256 col[kAlpha];
        for (int i = 0; i < kAlpha; ++i) {
          col[i] = _mm256_loadu_ps(mt + (i * kAlpha + j) * point_stride + o);
        }
        OutputTransform6(col, &rows[0][j], &rows[1][j]);
      }
      const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + o) : _mm256_setzero_ps();
      float* plane = out +
                     ((image * g.out_blocks + o / s.out_lanes) * s.h) * int64_t{s.w} * s.out_lanes +
                     o % s.out_lanes;
      for (int a = 0; a < 2; ++a) {
        if (a == 1 && !full_h) break;
        __m256 y0, y1;
        OutputTransform6(rows[a], &y0, &y1);
        float* row = plane + (int64_t{2 * ty + a} * s.w + 2 * tx) * s.out_lanes;
        _mm256_storeu_ps(row, bias != nullptr ? _mm256_add_ps(y0, b) : y0);
        if (full_w) {
          _mm256_storeu_ps(row + s.out_lanes, bias != nullptr ? _mm256_add_ps(y1, b) : y1);
        }
      }
    }
  }
}

}  // namespace

bool WinogradApplies(const Conv2dConfig& c) {
  return c.dtype == DataType::kF32 && c.kernel_h == 5 && c.kernel_w == 5 && c.stride_h == 1 &&
         c.stride_w == 1 && c.pad_h == 2 && c.pad_w == 2 && c.c > 0 && c.c % 16 == 0 &&
         c.filters > 0 && c.filters % 16 == 0 && c.h > 0 && c.w > 0 && c.n > 0;
}

void WinogradFilters(const Conv2dConfig& c, const float* w, bool for_backward_data,
                     std::vector<float>* u) {
  const int cin = for_backward_data ? c.filters : c.c;
  const int cout = for_backward_data ? c.c : c.filters;
  u->resize(static_cast<size_t>(kPoints) * cin * cout);
  // kLanes output channels at a time, in double (one rounding per value),
  // lanes innermost so that the loops vectorise.
  constexpr int kLanes = 8;  // cout is a multiple of 16.
  for (int i = 0; i < cin; ++i) {
    for (int o0 = 0; o0 < cout; o0 += kLanes) {
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
          float* dst = u->data() + (static_cast<size_t>(a * kAlpha + b) * cin + i) * cout + o0;
          for (int l = 0; l < kLanes; ++l) dst[l] = static_cast<float>(sum[l]);
        }
      }
    }
  }
}

void WinogradConv5x5(const WinogradShape& s, const float* in, const std::vector<float>& u,
                     const float* bias, float* out) {
  const Geometry g = GeometryOf(s);
  const int64_t blocks = (g.tiles + kTileBlock - 1) / kTileBlock;
  const float* up = u.data();
#pragma omp parallel num_threads(s.num_threads)
  {
    thread_local std::vector<float> v, m;
    v.resize(static_cast<size_t>(kPoints) * kTileBlock * s.in_channels);
    m.resize(static_cast<size_t>(kPoints) * kTileBlock * s.out_channels);
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t first = block * kTileBlock;
      const int count = static_cast<int>(std::min<int64_t>(kTileBlock, g.tiles - first));
      TransformInputs(s, g, in, first, count, v.data());
      MultiplyPoints(s, v.data(), up, m.data());
      TransformOutputs(s, g, m.data(), bias, first, count, out);
    }
  }
}

}  // namespace pstrain::cpu_internal
