// Internal to kernels/cpu/: the shape and sizes winograd.cc and
// winograd_avx512.cc share, and the 512-bit versions of the products and
// transforms (winograd_avx512.cc, built for x86-64-v4; call them only where
// WinogradAvx512Available() is true).
//
// A plain struct and constants only, and no header that has more: an inline
// function included in winograd_avx512.cc would be compiled there for
// x86-64-v4, and the linker may keep that copy for every caller, on CPUs
// without AVX-512 too (tests/kernels/avx512_symbols_test.sh).
#ifndef PSTRAIN_KERNELS_CPU_WINOGRAD_KERNELS_H_
#define PSTRAIN_KERNELS_CPU_WINOGRAD_KERNELS_H_

#include <cstdint>

namespace pstrain::cpu_internal {

// One convolution in the Winograd domain.
struct WinogradShape {
  int64_t n = 0;
  int in_channels = 0, out_channels = 0;  // As WinogradFilters made U for.
  int h = 0, w = 0;                       // Input and output spatial size.
  int in_lanes = 16, out_lanes = 16;      // Channels per block: 8 or 16.
  int num_threads = 1;
  // The products and transforms in 512-bit registers (winograd_avx512.cc),
  // where WinogradAvx512Available() (elsewhere 256 bits whatever this says;
  // the transforms where the blocks they read or write hold 16 channels):
  // the same bits as in 256.
  bool avx512 = false;
};

namespace winograd {

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
// vdy point at tile 0's point p, tiles kPoints x channels + kTilePad floats
// apart. cin and cout are multiples of 16.
void AccumulatePointAvx512(int cin, int cout, int count, const float* vx, const float* vdy,
                           bool fresh, float* m);

// winograd_transforms.h's transforms in 512 bits, for tiles [first, first +
// count) of the shape's tiles (numbered image by image, row by row). Those
// that read or write activations need whole 16-channel blocks there.
// A convolution's step 1 into v[kTileBlock][kPoints][in] (s.in_lanes 16)
// and its step 3 from m[t][p][out] (s.out_lanes 16).
void TransformInputsAvx512(const WinogradShape& s, const float* in, int64_t first, int count,
                           float* v);
void TransformOutputsAvx512(const WinogradShape& s, const float* m, const float* bias,
                            int64_t first, int count, float* out);
// The weight gradient's: tile first + t of x into vx[t][p][c] (s.in_lanes
// 16), and of dy into vdy[t][p][k] (s.out_lanes 16).
void TransformInputTilesAvx512(const WinogradShape& s, const float* x, int64_t first, int count,
                               float* vx);
void TransformGradientTilesAvx512(const WinogradShape& s, const float* dy, int64_t first, int count,
                                  float* vdy);

}  // namespace winograd
}  // namespace pstrain::cpu_internal

#endif  // PSTRAIN_KERNELS_CPU_WINOGRAD_KERNELS_H_
