// Internal to winograd.cc and winograd_avx512.cc: winograd.h's transforms
// (the tiles' B^T d B and A dy A^T into the 64 points, and A^T M A back to
// the outputs), written once over a register type:
//
//   TransformInputs<V256>(s, g, in, first, count, v);   // winograd.cc
//   TransformInputs<V512>(s, g, in, first, count, v);   // winograd_avx512.cc
//
// V256 holds 8 channels, V512 16: the 512-bit transforms read and write a
// whole 16-channel block of oneDNN's nChw16c layout at once, and need it
// (in_lanes or out_lanes 16 where they read or write activations). Each lane
// goes through the same operations in the same order in either width, so
// both give the same bits (WinogradTest checks it).
//
// Everything here is in an unnamed namespace: each of the two files compiles
// its own copy for its own -march (x86-64-v3 and x86-64-v4), and neither copy
// can be picked by the linker for the other's callers (see
// tests/kernels/avx512_symbols_test.sh). Include it nowhere else.
#ifndef PSTRAIN_KERNELS_CPU_WINOGRAD_TRANSFORMS_H_
#define PSTRAIN_KERNELS_CPU_WINOGRAD_TRANSFORMS_H_

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/cpu/winograd_kernels.h"

namespace pstrain::cpu_internal::winograd {
namespace {  // NOLINT(build/namespaces_headers): see above.

#define PSTRAIN_WINOGRAD_INLINE inline __attribute__((always_inline))

// 8 channels a register (AVX2).
struct V256 {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  static PSTRAIN_WINOGRAD_INLINE Reg Zero() { return _mm256_setzero_ps(); }
  static PSTRAIN_WINOGRAD_INLINE Reg Set1(float c) { return _mm256_set1_ps(c); }
  static PSTRAIN_WINOGRAD_INLINE Reg Load(const float* p) { return _mm256_loadu_ps(p); }
  static PSTRAIN_WINOGRAD_INLINE void Store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static PSTRAIN_WINOGRAD_INLINE Reg Add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static PSTRAIN_WINOGRAD_INLINE Reg Sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static PSTRAIN_WINOGRAD_INLINE Reg Mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static PSTRAIN_WINOGRAD_INLINE Reg Fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
};

#ifdef __AVX512F__
// 16 channels a register (AVX-512; winograd_avx512.cc only).
struct V512 {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  static PSTRAIN_WINOGRAD_INLINE Reg Zero() { return _mm512_setzero_ps(); }
  static PSTRAIN_WINOGRAD_INLINE Reg Set1(float c) { return _mm512_set1_ps(c); }
  static PSTRAIN_WINOGRAD_INLINE Reg Load(const float* p) { return _mm512_loadu_ps(p); }
  static PSTRAIN_WINOGRAD_INLINE void Store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static PSTRAIN_WINOGRAD_INLINE Reg Add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static PSTRAIN_WINOGRAD_INLINE Reg Sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static PSTRAIN_WINOGRAD_INLINE Reg Mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static PSTRAIN_WINOGRAD_INLINE Reg Fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

// Floats between a tile and the next in a block of transformed tiles
// (winograd_kernels.h).
constexpr int64_t TileStride(int channels) { return int64_t{kPoints} * channels + kTilePad; }

// F(4, 5) with the points 0, 1, -1, 2, -2, 1/2, -1/2 and infinity (those
// of the F(6x6, 3x3) that NNPACK runs in fp32), derived as the transpose of
// polynomial multiplication evaluated there: A^T the Vandermonde matrix of
// the output, G (winograd.cc) that of the filter, B^T the inverse of the
// tile's, each row of B^T scaled to integers and G by the inverse.
constexpr float kBT[kAlpha][kAlpha] = {
    {4.0, 0.0, -21.0, 0.0, 21.0, 0.0, -4.0, 0.0},
    {0.0, -4.0, -4.0, 17.0, 17.0, -4.0, -4.0, 0.0},
    {0.0, 4.0, -4.0, -17.0, 17.0, 4.0, -4.0, 0.0},
    {0.0, 2.0, 1.0, -10.0, -5.0, 8.0, 4.0, 0.0},
    {0.0, -2.0, 1.0, 10.0, -5.0, -8.0, 4.0, 0.0},
    {0.0, 64.0, 128.0, -80.0, -160.0, 16.0, 32.0, 0.0},
    {0.0, -64.0, 128.0, 80.0, -160.0, -16.0, 32.0, 0.0},
    {0.0, -4.0, 0.0, 21.0, 0.0, -21.0, 0.0, 4.0},
};
constexpr float kAT[kM][kAlpha] = {
    {1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0},
    {0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 0.0},
    {0.0, 1.0, 1.0, 4.0, 4.0, 0.25, 0.25, 0.0},
    {0.0, 1.0, -1.0, 8.0, -8.0, 0.125, -0.125, 1.0},
};
// kA[i][a] = kAT[a][i]: A, 8 x 4.
constexpr float kA[kAlpha][kM] = {
    {1.0, 0.0, 0.0, 0.0},      {1.0, 1.0, 1.0, 1.0},   {1.0, -1.0, 1.0, -1.0},
    {1.0, 2.0, 4.0, 8.0},      {1.0, -2.0, 4.0, -8.0}, {1.0, 0.5, 0.25, 0.125},
    {1.0, -0.5, 0.25, -0.125}, {0.0, 0.0, 0.0, 1.0},
};

// y = m x for vectors, m a compile-time table: once the loops are unrolled,
// zero coefficients cost nothing and ones are additions.
template <typename V, int R, int C>
PSTRAIN_WINOGRAD_INLINE void Apply(const float (&m)[R][C], const typename V::Reg* x,
                                   typename V::Reg* y) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    typename V::Reg acc = V::Zero();
    bool first = true;
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) {
      const float c = m[i][k];
      if (c == 0.f) continue;
      if (first) {
        acc = c == 1.f ? x[k] : V::Mul(V::Set1(c), x[k]);
        first = false;
      } else if (c == 1.f) {
        acc = V::Add(acc, x[k]);
      } else if (c == -1.f) {
        acc = V::Sub(acc, x[k]);
      } else {
        acc = V::Fmadd(V::Set1(c), x[k], acc);
      }
    }
    y[i] = acc;
  }
}

struct Geometry {
  int tiles_h, tiles_w;
  int64_t tiles;  // n * tiles_h * tiles_w.
  int in_blocks, out_blocks;
};

PSTRAIN_WINOGRAD_INLINE Geometry GeometryOf(const WinogradShape& s) {
  Geometry g;
  g.tiles_h = (s.h + kM - 1) / kM;
  g.tiles_w = (s.w + kM - 1) / kM;
  g.tiles = s.n * g.tiles_h * g.tiles_w;
  g.in_blocks = (s.in_channels + s.in_lanes - 1) / s.in_lanes;
  g.out_blocks = (s.out_channels + s.out_lanes - 1) / s.out_lanes;
  return g;
}

// Tile `tile`: its image and the first of its 4x4 outputs (y, x).
struct TileAt {
  int64_t image;
  int y, x;
};

PSTRAIN_WINOGRAD_INLINE TileAt TileAtOf(const Geometry& g, int64_t tile) {
  return {tile / (int64_t{g.tiles_w} * g.tiles_h),
          kM * static_cast<int>(tile / g.tiles_w % g.tiles_h),
          kM * static_cast<int>(tile % g.tiles_w)};
}

// Channel c of image `image` in a blocked layout of `blocks` blocks of
// `lanes` channels: pixel (y, x) at plane + (y * w + x) * lanes, and the
// channels after c in the same block next to it.
template <typename Float>  // float or const float
PSTRAIN_WINOGRAD_INLINE Float* ChannelsOf(Float* base, int64_t image, int blocks, int lanes, int h,
                                          int w, int c) {
  return base + ((image * blocks + c / lanes) * h) * int64_t{w} * lanes + c % lanes;
}

// B^T d B for the 8x8 patch whose first pixel is (y0, x0) (zeros outside
// the image), V::kLanes channels at `plane` (s.in_lanes apart): point (i, j)
// to dst + (i * kAlpha + j) * point_stride.
template <typename V>
PSTRAIN_WINOGRAD_INLINE void TransformInputPatch(const WinogradShape& s, const float* plane, int y0,
                                                 int x0, float* dst, int64_t point_stride) {
  using Reg = typename V::Reg;
  Reg d[kAlpha][kAlpha];
  for (int i = 0; i < kAlpha; ++i) {
    const int y = y0 + i;
    for (int j = 0; j < kAlpha; ++j) {
      const int x = x0 + j;
      d[i][j] = (y >= 0 && y < s.h && x >= 0 && x < s.w)
                    ? V::Load(plane + (int64_t{y} * s.w + x) * s.in_lanes)
                    : V::Zero();
    }
  }
  Reg cols[kAlpha][kAlpha];  // cols[j][i] = (B^T d)[i][j].
  for (int j = 0; j < kAlpha; ++j) {
    Reg col[kAlpha];
    for (int i = 0; i < kAlpha; ++i) col[i] = d[i][j];
    Apply<V>(kBT, col, cols[j]);
  }
  for (int i = 0; i < kAlpha; ++i) {
    Reg row[kAlpha], v[kAlpha];
    for (int j = 0; j < kAlpha; ++j) row[j] = cols[j][i];
    Apply<V>(kBT, row, v);
    for (int j = 0; j < kAlpha; ++j) V::Store(dst + (i * kAlpha + j) * point_stride, v[j]);
  }
}

// A convolution's step 1 for tiles [first, first + count) into
// v[kTileBlock][kPoints][in] (tiles TileStride(in) apart).
template <typename V>
void TransformInputs(const WinogradShape& s, const Geometry& g, const float* in, int64_t first,
                     int count, float* v) {
  const int cin = s.in_channels;
  for (int t = 0; t < kTileBlock; ++t) {
    float* vt = v + t * TileStride(cin);
    if (t >= count) {
      // Past the last tile: zeros, which step 2 multiplies and step 3 drops.
      std::memset(vt, 0, sizeof(float) * TileStride(cin));
      continue;
    }
    const TileAt at = TileAtOf(g, first + t);
    for (int c = 0; c < cin; c += V::kLanes) {
      const float* plane = ChannelsOf(in, at.image, g.in_blocks, s.in_lanes, s.h, s.w, c);
      TransformInputPatch<V>(s, plane, at.y - 2, at.x - 2, vt + c, cin);
    }
  }
}

// A convolution's step 3, Y = A^T M A (plus the bias unless nullptr), for
// tiles [first, first + count) of m[t][p][out], written to the outputs
// inside the image.
template <typename V>
void TransformOutputs(const WinogradShape& s, const Geometry& g, const float* m, const float* bias,
                      int64_t first, int count, float* out) {
  using Reg = typename V::Reg;
  const int cout = s.out_channels;
  const int64_t point_stride = cout;
  for (int t = 0; t < count; ++t) {
    const TileAt at = TileAtOf(g, first + t);
    const float* mt = m + t * TileStride(cout);
    for (int o = 0; o < cout; o += V::kLanes) {
      Reg rows[kM][kAlpha];  // rows[a][j] = (A^T M)[a][j].
      for (int j = 0; j < kAlpha; ++j) {
        Reg col[kAlpha], r4[kM];
        for (int i = 0; i < kAlpha; ++i) col[i] = V::Load(mt + (i * kAlpha + j) * point_stride + o);
        Apply<V>(kAT, col, r4);
        for (int a = 0; a < kM; ++a) rows[a][j] = r4[a];
      }
      const Reg b = bias != nullptr ? V::Load(bias + o) : V::Zero();
      float* plane = ChannelsOf(out, at.image, g.out_blocks, s.out_lanes, s.h, s.w, o);
      for (int a = 0; a < kM; ++a) {
        const int y = at.y + a;
        if (y >= s.h) break;
        Reg yv[kM];
        Apply<V>(kAT, rows[a], yv);
        float* row = plane + (int64_t{y} * s.w + at.x) * s.out_lanes;
        for (int q = 0; q < kM && at.x + q < s.w; ++q) {
          V::Store(row + q * s.out_lanes, bias != nullptr ? V::Add(yv[q], b) : yv[q]);
        }
      }
    }
  }
}

// The weight gradient's transforms of tiles [first, first + count), tile
// first + t into slot t of vx and vdy: B^T d B of x (blocked, s.in_lanes)
// into vx[t][p][c], and A dy A^T of dy (blocked, s.out_lanes) into
// vdy[t][p][k], outputs outside the image counting as zeros.
template <typename V>
void TransformInputTiles(const WinogradShape& s, const Geometry& g, const float* x, int64_t first,
                         int count, float* vx) {
  const int cin = s.in_channels;
  for (int t = 0; t < count; ++t) {
    const TileAt at = TileAtOf(g, first + t);
    for (int c = 0; c < cin; c += V::kLanes) {
      const float* plane = ChannelsOf(x, at.image, g.in_blocks, s.in_lanes, s.h, s.w, c);
      TransformInputPatch<V>(s, plane, at.y - 2, at.x - 2, vx + t * TileStride(cin) + c, cin);
    }
  }
}

// A dy A^T of one tile into slot t (TransformGradientTiles).
template <typename V>
void TransformGradientTile(const WinogradShape& s, const Geometry& g, const float* dy, int64_t tile,
                           int t, float* vdy) {
  using Reg = typename V::Reg;
  const int cout = s.out_channels;
  const TileAt at = TileAtOf(g, tile);
  for (int o = 0; o < cout; o += V::kLanes) {
    const float* plane = ChannelsOf(dy, at.image, g.out_blocks, s.out_lanes, s.h, s.w, o);
    Reg cols[kM][kAlpha];  // cols[b][i] = (A dy)[i][b].
    for (int b = 0; b < kM; ++b) {
      const int xx = at.x + b;
      Reg col[kM];
      for (int a = 0; a < kM; ++a) {
        const int yy = at.y + a;
        col[a] = (yy < s.h && xx < s.w) ? V::Load(plane + (int64_t{yy} * s.w + xx) * s.out_lanes)
                                        : V::Zero();
      }
      Apply<V>(kA, col, cols[b]);
    }
    for (int i = 0; i < kAlpha; ++i) {
      Reg row[kM], v[kAlpha];
      for (int b = 0; b < kM; ++b) row[b] = cols[b][i];
      Apply<V>(kA, row, v);
      for (int j = 0; j < kAlpha; ++j) {
        V::Store(vdy + t * TileStride(cout) + (i * kAlpha + j) * cout + o, v[j]);
      }
    }
  }
}

template <typename V>
void TransformGradientTiles(const WinogradShape& s, const Geometry& g, const float* dy,
                            int64_t first, int count, float* vdy) {
  for (int t = 0; t < count; ++t) TransformGradientTile<V>(s, g, dy, first + t, t, vdy);
}

#undef PSTRAIN_WINOGRAD_INLINE

}  // namespace
}  // namespace pstrain::cpu_internal::winograd

#endif  // PSTRAIN_KERNELS_CPU_WINOGRAD_TRANSFORMS_H_
