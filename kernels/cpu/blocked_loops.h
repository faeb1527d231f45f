// Internal to kernels/cpu/: loops of our own on oneDNN's channel-blocked
// activation layout (nChw8c on AVX2, nChw16c on AVX-512: blocks of `lanes`
// channels, each pixel's block contiguous, the last block padded with
// zeros), for the two places where oneDNN 2.6 is slow on the fmnist-cnn
// shapes. Measured with bench/cpu_ops_bench on a 2-core Zen 3 (AVX2), batch
// 64 (docs/BENCHMARKS.md):
//  * max-pool with a workspace: 2.4 ms forward and 1.7 ms backward for
//    conv1's 64x32x28x28 output, plus the conversions of the pooled output
//    and its gradient;
//  * the weight gradient of a convolution with one input channel, which
//    oneDNN's AVX2 kernel pads to 8 channels: 4.4 ms for conv1's 80 MFLOP.
//
// Every loop runs on `num_threads` OpenMP threads; each output element is
// computed in one fixed order for a given thread count, so results repeat
// bit for bit.
#ifndef PSTRAIN_KERNELS_CPU_BLOCKED_LOOPS_H_
#define PSTRAIN_KERNELS_CPU_BLOCKED_LOOPS_H_

#include <cstdint>
#include <vector>

#include "kernels/backend.h"

namespace pstrain::cpu_internal {

// A max-pool over a channel-blocked input whose k x k windows, at stride k
// and without padding, tile the h x w input exactly.
struct BlockedPoolShape {
  int lanes = 8;  // 8 or 16.
  int64_t n = 0;
  int channels = 0, h = 0, w = 0, k = 0;
  int num_threads = 1;

  int blocks() const { return (channels + lanes - 1) / lanes; }
  int out_h() const { return h / k; }
  int out_w() const { return w / k; }
};

// The widest pool window the loops handle: a window's winner is one byte.
inline constexpr int kMaxBlockedPoolWindow = 15;
// A pooled output's winner where no gradient flows back to its window.
inline constexpr uint8_t kNoPoolWinner = 255;

// Whether the loops below handle a pool of this shape: lanes 8 or 16,
// 1 <= k <= kMaxBlockedPoolWindow dividing h and w.
bool BlockedPoolShapeIsValid(const BlockedPoolShape& s);

// Bytes of the winners BlockedMaxPoolReluForward records: one per pooled
// output and lane, padded lanes included, in the blocked order
// [n][blocks][out_h][out_w][lanes].
int64_t BlockedPoolWinnersSize(const BlockedPoolShape& s);

// y (NCHW, [n, channels, out_h, out_w]) = ReLU(max-pool(conv)), conv in the
// blocked layout. A window that holds a NaN gives 0, as ReLU after a
// NaN-propagating max-pool does. Unless `winners` is nullptr, records where
// the gradient of each output goes back: the first element of its window
// (row by row, i * k + j) equal to the window's maximum, or kNoPoolWinner
// where the output was not positive (NaN included).
void BlockedMaxPoolReluForward(const BlockedPoolShape& s, const float* conv, float* y,
                               uint8_t* winners);

// The gradient of conv, in its blocked layout, from the winners a forward of
// the same shape recorded: dy (NCHW) goes to each output's winner, and every
// other element, padded channels included, gets +0. The gradient's bits pass
// unchanged.
void BlockedMaxPoolReluBackward(const BlockedPoolShape& s, const uint8_t* winners, const float* dy,
                                float* d_conv);

// Whether OneChannelConvWeightGrad handles `c`: fp32 NCHW, one input
// channel, kernels at most 8 wide.
bool OneChannelConvWeightGradApplies(const Conv2dConfig& c);

// dw ([filters, 1, kernel_h, kernel_w]) and, unless nullptr, dbias
// ([filters]) of the convolution `c`, from x (NCHW, one channel) and dy in
// the blocked layout with `lanes` (8 or 16) channels per block. Overwrites
// both. `scratch` is reused between calls.
void OneChannelConvWeightGrad(const Conv2dConfig& c, int lanes, int num_threads, const float* x,
                              const float* dy, float* dw, float* dbias,
                              std::vector<float>* scratch);

// Whether OneChannelConvWeightGradThroughPool handles `c` followed by
// `pool`: as OneChannelConvWeightGrad, and the pool is valid and reads
// exactly the convolution's output.
bool OneChannelConvWeightGradThroughPoolApplies(const Conv2dConfig& c,
                                                const BlockedPoolShape& pool);

// OneChannelConvWeightGrad of the gradient BlockedMaxPoolReluBackward makes
// from `winners` and `pooled_dy`, without writing that gradient out: each
// thread makes one sample's block of it at a time in its scratch, uses it
// and drops it. The same bits as the two calls. pool.lanes is the block
// width; pool.num_threads is not used.
void OneChannelConvWeightGradThroughPool(const Conv2dConfig& c, const BlockedPoolShape& pool,
                                         int num_threads, const float* x, const uint8_t* winners,
                                         const float* pooled_dy, float* dw, float* dbias,
                                         std::vector<float>* scratch);

}  // namespace pstrain::cpu_internal

#endif  // PSTRAIN_KERNELS_CPU_BLOCKED_LOOPS_H_
