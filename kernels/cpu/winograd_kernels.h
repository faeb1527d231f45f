// Internal to winograd.cc and winograd_avx512.cc: the sizes both share and
// the 512-bit versions of its products (winograd_avx512.cc, built for
// x86-64-v4; call them only where WinogradAvx512Available() is true).
//
// Constants only, no inline functions: winograd_avx512.cc would compile
// its own copy of one for x86-64-v4, and the linker may keep that copy for
// every caller, on CPUs without AVX-512 too.
#ifndef PSTRAIN_KERNELS_CPU_WINOGRAD_KERNELS_H_
#define PSTRAIN_KERNELS_CPU_WINOGRAD_KERNELS_H_

#include <cstdint>

namespace pstrain::cpu_internal::winograd {

constexpr int kM = 4;                     // Output tile side.
constexpr int kAlpha = kM + 4;            // Input tile side: m + 5 - 1.
constexpr int kPoints = kAlpha * kAlpha;  // Products per tile and channel pair.
constexpr int kTileBlock = 12;            // Tiles per block of a convolution's three steps.
// Tiles transformed per step of the weight gradient: 12 ran faster than 24
// or 32 (the transforms and the sums they add to share the core's L2;
// fmnist-cnn's conv2, Zen 4); with the layout below, 12 and 32 measured the
// same.
constexpr int kGradChunk = 12;

// Every block of transformed tiles (a convolution's v[t][p][in] and
// m[t][p][out], the weight gradient's vx[t][p][c] and vdy[t][p][k]) keeps a
// tile's 64 points together, so that its transform writes them in one run,
// and its tiles kPoints x channels + kTilePad floats apart. 64 x channels
// floats is a multiple of 4 KiB: without the cache line of padding, the
// products, which read one point of 12 tiles at a time, would find all 12
// in the same set of the L1 cache (8 ways on the Zen 4).
constexpr int kTilePad = 16;

// A convolution's step 2: m[t][p][out] = sum_in v[t][p][in] * u[p][in][out]
// for the kTileBlock tiles of v, `in` summed in order. cout is a multiple of
// 16.
void MultiplyPointsAvx512(int cin, int cout, const float* v, const float* u, float* m);

// The weight gradient's sums at one point p: m[k][c] += sum_{t < count}
// vdy[t][p][k] * vx[t][p][c], in t order (m = that sum when `fresh`); vx and
// vdy point at tile 0's point p, tiles x_stride and dy_stride floats apart.
// cin and cout are multiples of 16.
void AccumulatePointAvx512(int cin, int cout, int count, const float* vx, int64_t x_stride,
                           const float* vdy, int64_t dy_stride, bool fresh, float* m);

}  // namespace pstrain::cpu_internal::winograd

#endif  // PSTRAIN_KERNELS_CPU_WINOGRAD_KERNELS_H_
