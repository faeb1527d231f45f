// Winograd's products (step 2 of winograd.cc's convolutions and the sums of
// its weight gradient) and its transforms (winograd_transforms.h) in 512-bit
// registers: built for x86-64-v4 (kernels/CMakeLists.txt), called only where
// WinogradAvx512Available().
//
// Each value is summed in the order of the 256-bit loops, one fused
// multiply-add per term, and each lane of a transform goes through the same
// operations, so both widths give the same bits: only the number of values a
// register holds changes. What that buys depends on the core. One with two
// 512-bit FMA units (Intel's server cores) does twice the multiply-adds a
// cycle. One that runs a 512-bit operation as two 256-bit halves (AMD's Zen
// 4) does not: measured there with the products alone in 512 bits, the
// forward pass ran 2-3 % faster and the weight gradient 5-8 % slower; with
// the transforms too, conv2's backward ran about 4 % faster (docs/
// BENCHMARKS.md). So the plans time both on their first calls (cpu_plans.h's
// VectorWidthChoice).
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/winograd_kernels.h"
#include "kernels/cpu/winograd_transforms.h"

namespace pstrain::cpu_internal::winograd {
namespace {

// kTileBlock tiles by 16 x W outputs, `in` summed in order.
template <int W>
inline __attribute__((always_inline)) void MultiplyBlock(int cin, int cout, int o, const float* vp,
                                                         const float* up, float* mp) {
  const int64_t v_tile = TileStride(cin), m_tile = TileStride(cout);
  __m512 acc[kTileBlock][W];
#pragma GCC unroll 12
  for (int r = 0; r < kTileBlock; ++r) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_setzero_ps();
  }
#pragma GCC unroll 2
  for (int i = 0; i < cin; ++i) {
    __m512 u[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) u[w] = _mm512_loadu_ps(up + int64_t{i} * cout + o + 16 * w);
#pragma GCC unroll 12
    for (int r = 0; r < kTileBlock; ++r) {
      const __m512 b = _mm512_set1_ps(vp[r * v_tile + i]);
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(b, u[w], acc[r][w]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < kTileBlock; ++r) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(mp + r * m_tile + o + 16 * w, acc[r][w]);
  }
}

// Rows filters by 16 x W channels of m, summed over the tiles in order.
template <int Rows, int W>
inline __attribute__((always_inline)) void AccumulateBlock(int cin, int cout, int k0, int c,
                                                           int count, const float* vx,
                                                           const float* vdy, bool fresh, float* m) {
  __m512 acc[Rows][W];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) {
      acc[r][w] =
          fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(m + int64_t{k0 + r} * cin + c + 16 * w);
    }
  }
  for (int t = 0; t < count; ++t) {
    __m512 x[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) x[w] = _mm512_loadu_ps(vx + t * TileStride(cin) + c + 16 * w);
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512 d = _mm512_set1_ps(vdy[t * TileStride(cout) + k0 + r]);
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(d, x[w], acc[r][w]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(m + int64_t{k0 + r} * cin + c + 16 * w, acc[r][w]);
  }
}

}  // namespace

void MultiplyPointsAvx512(int cin, int cout, const float* v, const float* u, float* m) {
  for (int p = 0; p < kPoints; ++p) {
    const float* vp = v + int64_t{p} * cin;
    const float* up = u + int64_t{p} * cin * cout;
    float* mp = m + int64_t{p} * cout;
    int o = 0;
    for (; o + 32 <= cout; o += 32) MultiplyBlock<2>(cin, cout, o, vp, up, mp);
    if (o < cout) MultiplyBlock<1>(cin, cout, o, vp, up, mp);
  }
}

void AccumulatePointAvx512(int cin, int cout, int count, const float* vx, const float* vdy,
                           bool fresh, float* m) {
  int c = 0;
  for (; c + 32 <= cin; c += 32) {
    // Twelve filters by 32 channels (24 registers of sums), then the last
    // four or eight filters (cout is a multiple of 16).
    int k = 0;
    for (; k + 12 <= cout; k += 12)
      AccumulateBlock<12, 2>(cin, cout, k, c, count, vx, vdy, fresh, m);
    if (cout - k == 8) AccumulateBlock<8, 2>(cin, cout, k, c, count, vx, vdy, fresh, m);
    if (cout - k == 4) AccumulateBlock<4, 2>(cin, cout, k, c, count, vx, vdy, fresh, m);
  }
  if (c < cin) {
    for (int k = 0; k < cout; k += 16)
      AccumulateBlock<16, 1>(cin, cout, k, c, count, vx, vdy, fresh, m);
  }
}

void TransformInputsAvx512(const WinogradShape& s, const float* in, int64_t first, int count,
                           float* v) {
  TransformInputs<V512>(s, GeometryOf(s), in, first, count, v);
}

void TransformOutputsAvx512(const WinogradShape& s, const float* m, const float* bias,
                            int64_t first, int count, float* out) {
  TransformOutputs<V512>(s, GeometryOf(s), m, bias, first, count, out);
}

void TransformInputTilesAvx512(const WinogradShape& s, const float* x, int64_t first, int count,
                               float* vx) {
  TransformInputTiles<V512>(s, GeometryOf(s), x, first, count, vx);
}

void TransformGradientTilesAvx512(const WinogradShape& s, const float* dy, int64_t first, int count,
                                  float* vdy) {
  TransformGradientTiles<V512>(s, GeometryOf(s), dy, first, count, vdy);
}

}  // namespace pstrain::cpu_internal::winograd
