// Internal to kernels/cpu/: 5x5 "same" convolutions (stride 1, padding 2)
// by Winograd's minimal filtering F(4x4, 5x5) on oneDNN's channel-blocked
// activation layout (nChw8c or nChw16c: blocks of `lanes` channels, each
// pixel's block contiguous).
//
// Why: the direct convolutions of such a layer already run at the CPU's FMA
// peak (docs/BENCHMARKS.md), so what is left is fewer multiplications.
// Every 4x4 block of outputs is read from an 8x8 tile of the input as 64
// products per channel pair instead of 400: 6.25x fewer multiply-adds
// (4.8x on a 14x14 image, whose tiles cover 16x16), plus the transforms of
// the inputs and outputs. The interpolation points are 0, +-1, +-2, +-1/2
// and infinity, those of the F(6x6, 3x3) that NNPACK runs in fp32; the
// rounding stays within 1e-5 of the sum of the terms' magnitudes (3e-6 at
// worst in WinogradTest, which bounds it). F(2x2, 5x5), whose six points are
// those of the F(4x4, 3x3) that cuDNN and oneDNN use, was measured first:
// 3.3 ms a pass of fmnist-cnn's conv2 on a Zen 4 against 2.3 for this and
// 5.1 for oneDNN's direct kernel, with errors of the same order.
//
// The same routine runs the backward-data pass, which is a convolution of
// dy with the filters turned 180 degrees and their input and output
// channels swapped (WinogradFilters' `for_backward_data`). The weight
// gradient runs the transpose of the same algorithm (WinogradWeightGrad5x5):
// the 64 points' products of the transformed inputs and output gradients,
// summed over the tiles, then transformed back to 5x5 (1.1-2.0x oneDNN's
// direct kernel on the shapes measured up to 64 x 64 channels; slower
// beyond: docs/BENCHMARKS.md).
//
// Each output element is computed in one fixed order, for any thread count,
// either lane width and either register width (256 or 512 bits, the
// products and transforms of winograd_avx512.cc): results repeat bit for
// bit, and two plans that hold the same values in different block widths
// agree.
#ifndef PSTRAIN_KERNELS_CPU_WINOGRAD_H_
#define PSTRAIN_KERNELS_CPU_WINOGRAD_H_

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/winograd_kernels.h"

namespace pstrain::cpu_internal {

// Whether the routines below handle `c`: fp32, 5x5 filters, stride 1,
// padding 2 on both axes, input channels and filters multiples of 16 (a
// pass reads its input 8 channels at a time and writes its output 16 at a
// time, and backward data swaps the two roles; no block is padded).
bool WinogradSupports(const Conv2dConfig& c);

// Whether the CPU plans use them for `c`: WinogradSupports, and where they
// are faster than the direct kernels: channels whose product is at most
// 256 x 256 (beyond, the transformed filters no longer stay in cache), and
// at least 2^26 multiply-adds of the direct convolution (below, the fixed
// costs outweigh the savings). Measured: docs/BENCHMARKS.md.
bool WinogradApplies(const Conv2dConfig& c);

// Whether the plans use WinogradWeightGrad5x5 for `c`: WinogradApplies, and
// channels whose product is at most kMaxWeightGradChannelProduct (its sums
// take 64 x c x filters floats in each of up to 8 segments of the tiles,
// and beyond that they outgrow the caches). Measured: docs/BENCHMARKS.md.
bool WinogradWeightGradApplies(const Conv2dConfig& c);

// Whether this CPU can run the products and transforms in 512-bit
// registers: where oneDNN runs its AVX-512 kernels (ONEDNN_MAX_CPU_ISA=AVX2
// turns both off).
bool WinogradAvx512Available();

// The filters in the Winograd domain: U[64][in][out], `out` contiguous.
// Forward: in = c.c, out = c.filters, from w [filters, c, 5, 5].
// Backward data: in = c.filters, out = c.c, from the same w, each filter
// turned 180 degrees. On `num_threads` threads; the bits do not depend on
// how many.
void WinogradFilters(const Conv2dConfig& c, const float* w, bool for_backward_data, int num_threads,
                     std::vector<float>* u);

// One convolution in the Winograd domain: WinogradShape (winograd_kernels.h).

// out[n, o, y, x] = sum_{i, r, s} in[n, i, y + r - 2, x + s - 2] * filter[o, i, r, s]
// (+ bias[o] unless nullptr), in and out in their blocked layouts (inputs
// outside the image count as zeros).
void WinogradConv5x5(const WinogradShape& s, const float* in, const std::vector<float>& u,
                     const float* bias, float* out);

// The weight gradient of the same convolution, by the transpose of its
// algorithm: dw[o, i, r, s] = sum_{n, y, x} dy[n, o, y, x] *
// x[n, i, y + r - 2, x + s - 2] (dw in [filters, c, 5, 5]); x and dy in
// their blocked layouts (s.in_lanes, s.out_lanes; in_channels = c,
// out_channels = filters). dbias (unless nullptr) gets the sum of dy per
// filter. Each value is summed in one order whatever the thread count.
// `scratch` holds the sums between calls (it grows to at most 8 x 64 x c x
// filters floats and is not cleared).
void WinogradWeightGrad5x5(const WinogradShape& s, const float* x, const float* dy, float* dw,
                           float* dbias, std::vector<float>* scratch);

}  // namespace pstrain::cpu_internal

#endif  // PSTRAIN_KERNELS_CPU_WINOGRAD_H_
