// Spatial batch norm for the CUDA backend, NCHW viewed as [N, C, S], or
// channels last ([N * S, C], bf16 and fp16 models; see the NHWC kernels).
//
// cuDNN's NCHW batch norm spreads each channel's reduction thinly: on an
// H200 its training forward and backward of a [128, 16, 64x64] fp32 tensor
// took 0.26 and 0.71 ms, 13 and 35 times a copy of the tensor (0.02 ms), and
// were half of resnet-small's step (bench/gpu_layers_bench). Here each
// channel's N*S values are split into `blocks` slices; one thread block
// reduces one slice of one channel, so C * blocks blocks share the device,
// and a per-channel pass combines the slices in a fixed order (results are
// deterministic, unlike atomics). The arithmetic is the CPU backend's
// (kernels/cpu/cpu_batch_norm.cc): two passes for the statistics (mean,
// then squared deviations), y = x * scale + shift, and the same backward
// formula; sums run in fp32 (the CPU's in double).
//
//   training forward   partial sums -> per-channel means -> partial squared
//                      deviations -> per-channel finalisation (statistics,
//                      running averages, scale and shift) -> normalisation
//   backward           partial sums of dy and dy * xhat -> per-channel
//                      finalisation (dgamma, dbeta, coefficients) -> dx
//
// The per-channel passes run a warp per channel (WarpSumInOrder).
//   inference          one element-wise pass
//
// Memory bound, so the walks avoid per-element integer division: the
// reductions divide once per thread and then step (ChannelWalk), and the
// element-wise passes use 32-bit indices below 2^31 elements. Where planes
// hold a multiple of 4 values and the buffers are aligned, every access
// moves 4 values at once (16 bytes in fp32), the summation order still fixed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.cuh"

namespace pstrain::cuda {
namespace {

constexpr int kBnThreads = 256;
// Each slice has at least this many values per thread before another slice
// is added, and a channel has at most kMaxBnBlocks slices.
constexpr int64_t kValuesPerThread = 16;
constexpr int kMaxBnBlocks = 128;

// Walks one channel's values of [N, C, S] in units of V values (sv = S / V
// units per sample): unit j (0 <= j < n * sv) is unit j % sv of sample
// j / sv. It divides once, when it starts; each step of `step` units then
// costs two additions and a compare.
struct ChannelWalk {
  __device__ ChannelWalk(int64_t j, int64_t step, int64_t sv) : sv(sv) {
    sample = j / sv;
    offset = j - sample * sv;
    step_samples = step / sv;
    step_offset = step - step_samples * sv;
  }
  // The unit's index in the whole tensor, in units of V values.
  __device__ int64_t Unit(int64_t ch, int64_t c) const { return (sample * c + ch) * sv + offset; }
  __device__ void Advance() {
    sample += step_samples;
    offset += step_offset;
    if (offset >= sv) {
      offset -= sv;
      ++sample;
    }
  }
  int64_t sv, sample, offset, step_samples, step_offset;
};

// Units [begin, end) of the channel's mv are slice `slice`'s.
__device__ __forceinline__ void SliceBounds(int64_t mv, int blocks, int slice, int64_t* begin,
                                            int64_t* end) {
  const int64_t per = (mv + blocks - 1) / blocks;
  *begin = min(mv, per * slice);
  *end = min(mv, *begin + per);
}

// Sum of values[i * stride], i < count, by the calling warp (all 32 lanes
// call it): lane l adds entries l, l + 32, ... in order, then the lanes
// combine in a fixed butterfly, so every run and every lane gets the same
// value. One warp per channel keeps the per-channel passes short: a thread
// summing 512 partials one after another waits on 512 loads in a row.
__device__ __forceinline__ float WarpSumInOrder(const float* values, int count, int stride = 1) {
  const int lane = threadIdx.x % 32;
  float sum = 0.f;
  for (int i = lane; i < count; i += 32) sum += values[int64_t{i} * stride];
  return WarpReduceSum(sum);
}

// The channel of the calling warp in a per-channel pass of kChannelWarps
// warps per block (blockDim.x = 32 * kChannelWarps).
constexpr int kChannelWarps = 8;
__device__ __forceinline__ int64_t WarpChannel() {
  return int64_t{blockIdx.x} * kChannelWarps + threadIdx.x / 32;
}
inline int ChannelWarpBlocks(int64_t c) {
  return static_cast<int>((c + kChannelWarps - 1) / kChannelWarps);
}

// One warp per channel: mean[ch] from the partial sums (m values each).
__global__ void BnMeanKernel(int64_t c, int64_t m, int blocks, const float* partial_sum,
                             float* mean) {
  const int64_t ch = WarpChannel();
  if (ch >= c) return;
  const float sum = WarpSumInOrder(partial_sum + ch * blocks, blocks);
  if (threadIdx.x % 32 == 0) mean[ch] = sum / static_cast<float>(m);
}

// grid (blocks, C): partial[ch * blocks + slice] = sum of the slice's x.
// mv = n * sv units of V values per channel.
template <typename T, int V>
__global__ void BnPartialSumKernel(const T* x, int64_t c, int64_t sv, int64_t mv, int blocks,
                                   float* partial) {
  __shared__ float scratch[32];
  const int64_t ch = blockIdx.y;
  int64_t begin, end;
  SliceBounds(mv, blocks, blockIdx.x, &begin, &end);
  float sum = 0.f;
  int64_t j = begin + threadIdx.x;
  if (j < end) {
    for (ChannelWalk walk(j, blockDim.x, sv); j < end; j += blockDim.x, walk.Advance()) {
      float v[V];
      LoadVec<T, V>(x + walk.Unit(ch, c) * V, v);
#pragma unroll
      for (int k = 0; k < V; ++k) sum += v[k];
    }
  }
  sum = BlockReduce<false>(sum, scratch);
  if (threadIdx.x == 0) partial[ch * blocks + blockIdx.x] = sum;
}

// grid (blocks, C): partial_sq[...] = sum over the slice of (x - mean)^2,
// with mean from the partial sums (m values per channel).
template <typename T, int V>
__global__ void BnPartialSquaresKernel(const T* x, int64_t c, int64_t sv, int64_t mv, int blocks,
                                       const float* means, float* partial_sq) {
  __shared__ float scratch[32];
  const int64_t ch = blockIdx.y;
  const float mean = means[ch];
  int64_t begin, end;
  SliceBounds(mv, blocks, blockIdx.x, &begin, &end);
  float sq = 0.f;
  int64_t j = begin + threadIdx.x;
  if (j < end) {
    for (ChannelWalk walk(j, blockDim.x, sv); j < end; j += blockDim.x, walk.Advance()) {
      float v[V];
      LoadVec<T, V>(x + walk.Unit(ch, c) * V, v);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = v[k] - mean;
        sq += d * d;
      }
    }
  }
  sq = BlockReduce<false>(sq, scratch);
  if (threadIdx.x == 0) partial_sq[ch * blocks + blockIdx.x] = sq;
}

// One warp per channel: the statistics, running averages (unbiased
// variance), saved mean and 1/sqrt(var + eps), and scale/shift for y.
__global__ void BnFinalizeForwardKernel(int64_t c, int64_t m, int blocks, const float* means,
                                        const float* partial_sq, const float* gamma,
                                        const float* beta, float epsilon, float momentum,
                                        float* running_mean, float* running_var, float* save_mean,
                                        float* save_inv_std, float* scale_shift) {
  const int64_t ch = WarpChannel();
  if (ch >= c) return;
  const float var = WarpSumInOrder(partial_sq + ch * blocks, blocks) / static_cast<float>(m);
  if (threadIdx.x % 32 != 0) return;
  const float mean = means[ch];
  const float inv_std = rsqrtf(var + epsilon);
  const float unbias = m > 1 ? static_cast<float>(m) / static_cast<float>(m - 1) : 1.f;
  const float scale = gamma[ch] * inv_std;
  scale_shift[ch] = scale;
  scale_shift[c + ch] = beta[ch] - mean * scale;
  save_mean[ch] = mean;
  save_inv_std[ch] = inv_std;
  running_mean[ch] = (1.f - momentum) * running_mean[ch] + momentum * mean;
  running_var[ch] = (1.f - momentum) * running_var[ch] + momentum * var * unbias;
}

// The element-wise passes walk the whole tensor in units of V values
// (total_v of them, sv per [sample, channel] plane): the unit's channel is
// (i / sv) % c.

// y = x * scale[ch] + shift[ch] over every element.
template <typename T, int V, typename Index>
__global__ void BnScaleShiftKernel(const T* x, T* y, Index total_v, Index c, Index sv,
                                   const float* scale_shift) {
  for (Index i = FirstIndex<Index>(); i < total_v; i += StrideOf<Index>()) {
    const Index ch = (i / sv) % c;
    const float scale = scale_shift[ch], shift = scale_shift[c + ch];
    float v[V];
    LoadVec<T, V>(x + static_cast<int64_t>(i) * V, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = v[k] * scale + shift;
    StoreVec<T, V>(y + static_cast<int64_t>(i) * V, v);
  }
}

template <typename T, int V, typename Index>
__global__ void BnInferenceKernel(const T* x, T* y, Index total_v, Index c, Index sv,
                                  const float* gamma, const float* beta, const float* running_mean,
                                  const float* running_var, float epsilon) {
  for (Index i = FirstIndex<Index>(); i < total_v; i += StrideOf<Index>()) {
    const Index ch = (i / sv) % c;
    const float scale = gamma[ch] / sqrtf(running_var[ch] + epsilon);
    const float shift = beta[ch] - running_mean[ch] * scale;
    float v[V];
    LoadVec<T, V>(x + static_cast<int64_t>(i) * V, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = v[k] * scale + shift;
    StoreVec<T, V>(y + static_cast<int64_t>(i) * V, v);
  }
}

// grid (blocks, C): partial[2 * (ch * blocks + slice)] = {sum dy, sum dy * xhat}.
template <typename T, int V>
__global__ void BnBackwardPartialKernel(const T* x, const T* dy, int64_t c, int64_t sv, int64_t mv,
                                        int blocks, const float* save_mean,
                                        const float* save_inv_std, float* partial) {
  __shared__ float scratch[32];
  const int64_t ch = blockIdx.y;
  const float mean = save_mean[ch], inv_std = save_inv_std[ch];
  int64_t begin, end;
  SliceBounds(mv, blocks, blockIdx.x, &begin, &end);
  float sum_dy = 0.f, sum_dy_xhat = 0.f;
  int64_t j = begin + threadIdx.x;
  if (j < end) {
    for (ChannelWalk walk(j, blockDim.x, sv); j < end; j += blockDim.x, walk.Advance()) {
      const int64_t i = walk.Unit(ch, c) * V;
      float xv[V], g[V];
      LoadVec<T, V>(x + i, xv);
      LoadVec<T, V>(dy + i, g);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        sum_dy += g[k];
        sum_dy_xhat += g[k] * ((xv[k] - mean) * inv_std);
      }
    }
  }
  sum_dy = BlockReduce<false>(sum_dy, scratch);
  sum_dy_xhat = BlockReduce<false>(sum_dy_xhat, scratch);
  if (threadIdx.x == 0) {
    partial[2 * (ch * blocks + blockIdx.x)] = sum_dy;
    partial[2 * (ch * blocks + blockIdx.x) + 1] = sum_dy_xhat;
  }
}

// One warp per channel: dbeta, dgamma, and the coefficients of dx:
// coef = {gamma * inv_std, mean(dy), mean(dy * xhat)}.
__global__ void BnFinalizeBackwardKernel(int64_t c, int64_t m, int blocks, const float* partial,
                                         const float* gamma, const float* save_inv_std,
                                         float* dgamma, float* dbeta, float* coef) {
  const int64_t ch = WarpChannel();
  if (ch >= c) return;
  const float sum_dy = WarpSumInOrder(partial + 2 * ch * blocks, blocks, 2);
  const float sum_dy_xhat = WarpSumInOrder(partial + 2 * ch * blocks + 1, blocks, 2);
  if (threadIdx.x % 32 != 0) return;
  dbeta[ch] = sum_dy;
  dgamma[ch] = sum_dy_xhat;
  coef[ch] = gamma[ch] * save_inv_std[ch];
  coef[c + ch] = sum_dy / static_cast<float>(m);
  coef[2 * c + ch] = sum_dy_xhat / static_cast<float>(m);
}

// dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat)).
template <typename T, int V, typename Index>
__global__ void BnBackwardDxKernel(const T* x, const T* dy, T* dx, Index total_v, Index c, Index sv,
                                   const float* save_mean, const float* save_inv_std,
                                   const float* coef) {
  for (Index i = FirstIndex<Index>(); i < total_v; i += StrideOf<Index>()) {
    const Index ch = (i / sv) % c;
    const float mean = save_mean[ch], inv_std = save_inv_std[ch];
    const float scale = coef[ch], mean_dy = coef[c + ch], mean_dy_xhat = coef[2 * c + ch];
    const int64_t at = static_cast<int64_t>(i) * V;
    float xv[V], g[V];
    LoadVec<T, V>(x + at, xv);
    LoadVec<T, V>(dy + at, g);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = (xv[k] - mean) * inv_std;
      g[k] = scale * (g[k] - mean_dy - xhat * mean_dy_xhat);
    }
    StoreVec<T, V>(dx + at, g);
  }
}

// Whether every pointer can be read 4 elements at a time and a plane of
// `spatial` values is a whole number of such units.
template <typename T>
bool Vectorizable(int64_t spatial, std::initializer_list<const void*> pointers) {
  if (spatial % 4 != 0) return false;
  for (const void* p : pointers) {
    if (!IsAligned4<T>(p)) return false;
  }
  return true;
}

// --- Channels last: x is [m = n * spatial rows, c channels] -------------------
//
// A block is lanes_c x lanes_r threads (BnNhwcLanes): neighbouring threads
// read neighbouring channels of a row, so a warp reads whole rows, and the
// block's lanes_r rows advance together through its slice of the rows. The
// partial sums land where the NCHW kernels put theirs
// (partial[ch * blocks + slice]), so the finalisation kernels are shared.

constexpr int kMaxBnNhwcBlocks = 512;

struct NhwcLanes {
  int c, r, channel_blocks;
};
NhwcLanes BnNhwcLanes(int64_t c) {
  if (c <= 64) {
    const int lanes_c = static_cast<int>(c);
    return {lanes_c, std::max(1, kBnThreads / lanes_c), 1};
  }
  return {64, kBnThreads / 64, static_cast<int>((c + 63) / 64)};
}

enum class NhwcSum { kValues, kSquares, kBackward };

// grid (blocks, channel blocks), block (lanes_c, lanes_r), lanes_c *
// lanes_r floats of dynamic shared memory (2x for kBackward).
template <typename T, NhwcSum kSum>
__global__ void BnNhwcPartialKernel(const T* x, const T* dy, int64_t m, int64_t c, int blocks,
                                    const float* means, const float* save_mean,
                                    const float* save_inv_std, float* partial) {
  extern __shared__ float sums[];
  __shared__ float channel_mean[64], channel_inv_std[64];
  const int lanes_c = blockDim.x, lanes_r = blockDim.y;
  const int64_t ch = int64_t{blockIdx.y} * lanes_c + threadIdx.x;
  if (threadIdx.y == 0 && ch < c) {
    if constexpr (kSum == NhwcSum::kSquares) {
      channel_mean[threadIdx.x] = means[ch];
    } else if constexpr (kSum == NhwcSum::kBackward) {
      channel_mean[threadIdx.x] = save_mean[ch];
      channel_inv_std[threadIdx.x] = save_inv_std[ch];
    }
  }
  __syncthreads();
  const int64_t per = (m + blocks - 1) / blocks;
  const int64_t begin = min(m, per * blockIdx.x), end = min(m, begin + per);
  float a = 0.f, b = 0.f;
  if (ch < c) {
    const float mean = kSum == NhwcSum::kValues ? 0.f : channel_mean[threadIdx.x];
    const float inv_std = kSum == NhwcSum::kBackward ? channel_inv_std[threadIdx.x] : 0.f;
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += lanes_r) {
      const float v = ToFloat(x[r * c + ch]);
      if constexpr (kSum == NhwcSum::kValues) {
        a += v;
      } else if constexpr (kSum == NhwcSum::kSquares) {
        const float d = v - mean;
        a += d * d;
      } else {
        const float g = ToFloat(dy[r * c + ch]);
        a += g;
        b += g * ((v - mean) * inv_std);
      }
    }
  }
  const int lane = threadIdx.y * lanes_c + threadIdx.x;
  const int threads = lanes_c * lanes_r;
  sums[lane] = a;
  if constexpr (kSum == NhwcSum::kBackward) sums[threads + lane] = b;
  __syncthreads();
  if (threadIdx.y == 0 && ch < c) {
    float total_a = 0.f, total_b = 0.f;
    for (int i = 0; i < lanes_r; ++i) {
      total_a += sums[i * lanes_c + threadIdx.x];
      if constexpr (kSum == NhwcSum::kBackward)
        total_b += sums[threads + i * lanes_c + threadIdx.x];
    }
    if constexpr (kSum == NhwcSum::kBackward) {
      partial[2 * (ch * blocks + blockIdx.x)] = total_a;
      partial[2 * (ch * blocks + blockIdx.x) + 1] = total_b;
    } else {
      partial[ch * blocks + blockIdx.x] = total_a;
    }
  }
}

// The element-wise passes: unit i (V values) starts at channel (i * V) % c;
// with V = 4, c is a multiple of 4, so the unit's channels are consecutive.
template <typename T, int V, typename Index>
__global__ void BnNhwcScaleShiftKernel(const T* x, T* y, Index total_v, Index c,
                                       const float* scale_shift) {
  for (Index i = FirstIndex<Index>(); i < total_v; i += StrideOf<Index>()) {
    const Index ch = (i * V) % c;
    float v[V];
    LoadVec<T, V>(x + static_cast<int64_t>(i) * V, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = v[k] * scale_shift[ch + k] + scale_shift[c + ch + k];
    StoreVec<T, V>(y + static_cast<int64_t>(i) * V, v);
  }
}

template <typename T, int V, typename Index>
__global__ void BnNhwcInferenceKernel(const T* x, T* y, Index total_v, Index c, const float* gamma,
                                      const float* beta, const float* running_mean,
                                      const float* running_var, float epsilon) {
  for (Index i = FirstIndex<Index>(); i < total_v; i += StrideOf<Index>()) {
    const Index ch = (i * V) % c;
    float v[V];
    LoadVec<T, V>(x + static_cast<int64_t>(i) * V, v);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float scale = gamma[ch + k] / sqrtf(running_var[ch + k] + epsilon);
      v[k] = v[k] * scale + (beta[ch + k] - running_mean[ch + k] * scale);
    }
    StoreVec<T, V>(y + static_cast<int64_t>(i) * V, v);
  }
}

template <typename T, int V, typename Index>
__global__ void BnNhwcBackwardDxKernel(const T* x, const T* dy, T* dx, Index total_v, Index c,
                                       const float* save_mean, const float* save_inv_std,
                                       const float* coef) {
  for (Index i = FirstIndex<Index>(); i < total_v; i += StrideOf<Index>()) {
    const Index ch = (i * V) % c;
    const int64_t at = static_cast<int64_t>(i) * V;
    float xv[V], g[V];
    LoadVec<T, V>(x + at, xv);
    LoadVec<T, V>(dy + at, g);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = (xv[k] - save_mean[ch + k]) * save_inv_std[ch + k];
      g[k] = coef[ch + k] * (g[k] - coef[c + ch + k] - xhat * coef[2 * c + ch + k]);
    }
    StoreVec<T, V>(dx + at, g);
  }
}

absl::Status CheckShape(const char* op, int64_t n, int64_t c, int64_t s) {
  if (n <= 0 || c <= 0 || s <= 0 || n * s < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": need positive sizes and n * spatial >= 2, got [", n, ", ", c, ", ", s, "]"));
  }
  if (c > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": at most 65535 channels, got ", c));
  }
  return absl::OkStatus();
}

}  // namespace

static bool ChannelsLastBatchNorm(int64_t spatial, TensorLayout layout) {
  return layout == TensorLayout::kNHWC && spatial > 1;
}

int BatchNormBlocks(int64_t n, int64_t c, int64_t spatial, TensorLayout layout) {
  const int64_t m = n * spatial;
  if (ChannelsLastBatchNorm(spatial, layout)) {
    // At least 32 rows for each of a block's row lanes.
    const int64_t per_block = int64_t{BnNhwcLanes(c).r} * 32;
    return static_cast<int>(
        std::clamp<int64_t>((m + per_block - 1) / per_block, 1, kMaxBnNhwcBlocks));
  }
  const int64_t per_block = int64_t{kBnThreads} * kValuesPerThread;
  return static_cast<int>(std::clamp<int64_t>((m + per_block - 1) / per_block, 1, kMaxBnBlocks));
}

size_t BatchNormScratchFloats(int64_t n, int64_t c, int64_t spatial, TensorLayout layout) {
  // Partial sums and squares (or the backward's pairs), then 3 per channel.
  return static_cast<size_t>(c) * (2 * BatchNormBlocks(n, c, spatial, layout) + 3);
}

absl::Status LaunchBatchNormForwardTraining(DataType dtype, const void* x, void* y,
                                            const float* gamma, const float* beta,
                                            float* running_mean, float* running_var,
                                            float* save_mean, float* save_inv_std, int64_t n,
                                            int64_t c, int64_t spatial, float epsilon,
                                            float momentum, float* scratch, TensorLayout layout,
                                            cudaStream_t stream) {
  constexpr const char* kOp = "BatchNormForwardTraining";
  PSTRAIN_RETURN_IF_ERROR(CheckShape(kOp, n, c, spatial));
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(
      kOp, {x, y, gamma, beta, running_mean, running_var, save_mean, save_inv_std, scratch}));
  const int blocks = BatchNormBlocks(n, c, spatial, layout);
  const int64_t m = n * spatial, total = m * c;
  float* partial_sum = scratch;
  float* partial_sq = scratch + c * blocks;
  float* scale_shift = scratch + 2 * c * blocks;
  float* means = scratch + 2 * c * blocks + 2 * c;
  if (ChannelsLastBatchNorm(spatial, layout)) {
    const NhwcLanes lanes = BnNhwcLanes(c);
    const dim3 grid(blocks, lanes.channel_blocks), block(lanes.c, lanes.r);
    const size_t shared = sizeof(float) * lanes.c * lanes.r;
    return DispatchDataType(kOp, dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      const T* in = static_cast<const T*>(x);
      BnNhwcPartialKernel<T, NhwcSum::kValues><<<grid, block, shared, stream>>>(
          in, nullptr, m, c, blocks, nullptr, nullptr, nullptr, partial_sum);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnMeanKernel<<<ChannelWarpBlocks(c), 32 * kChannelWarps, 0, stream>>>(c, m, blocks,
                                                                            partial_sum, means);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnNhwcPartialKernel<T, NhwcSum::kSquares><<<grid, block, shared, stream>>>(
          in, nullptr, m, c, blocks, means, nullptr, nullptr, partial_sq);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnFinalizeForwardKernel<<<ChannelWarpBlocks(c), 32 * kChannelWarps, 0, stream>>>(
          c, m, blocks, means, partial_sq, gamma, beta, epsilon, momentum, running_mean,
          running_var, save_mean, save_inv_std, scale_shift);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return DispatchWalk(total, c % 4 == 0 && Vectorizable<T>(4, {x, y}),
                          [&](auto width, auto index) {
                            constexpr int V = decltype(width)::value;
                            using Index = decltype(index);
                            BnNhwcScaleShiftKernel<T, V, Index>
                                <<<BlocksFor(total / V), kThreadsPerBlock, 0, stream>>>(
                                    in, static_cast<T*>(y), static_cast<Index>(total / V),
                                    static_cast<Index>(c), scale_shift);
                            PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
                            return absl::OkStatus();
                          });
    });
  }
  const dim3 grid(blocks, static_cast<unsigned>(c));
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    return DispatchWalk(total, Vectorizable<T>(spatial, {x, y}), [&](auto width, auto index) {
      constexpr int V = decltype(width)::value;
      using Index = decltype(index);
      const int64_t sv = spatial / V, mv = n * sv;
      BnPartialSumKernel<T, V><<<grid, kBnThreads, 0, stream>>>(in, c, sv, mv, blocks, partial_sum);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnMeanKernel<<<ChannelWarpBlocks(c), 32 * kChannelWarps, 0, stream>>>(c, m, blocks,
                                                                            partial_sum, means);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnPartialSquaresKernel<T, V>
          <<<grid, kBnThreads, 0, stream>>>(in, c, sv, mv, blocks, means, partial_sq);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnFinalizeForwardKernel<<<ChannelWarpBlocks(c), 32 * kChannelWarps, 0, stream>>>(
          c, m, blocks, means, partial_sq, gamma, beta, epsilon, momentum, running_mean,
          running_var, save_mean, save_inv_std, scale_shift);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnScaleShiftKernel<T, V, Index><<<BlocksFor(total / V), kThreadsPerBlock, 0, stream>>>(
          in, out, static_cast<Index>(total / V), static_cast<Index>(c), static_cast<Index>(sv),
          scale_shift);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

absl::Status LaunchBatchNormForwardInference(DataType dtype, const void* x, void* y,
                                             const float* gamma, const float* beta,
                                             const float* running_mean, const float* running_var,
                                             int64_t n, int64_t c, int64_t spatial, float epsilon,
                                             TensorLayout layout, cudaStream_t stream) {
  constexpr const char* kOp = "BatchNormForwardInference";
  if (n <= 0 || c <= 0 || spatial <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": need positive sizes, got [", n, ", ", c, ", ", spatial, "]"));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y, gamma, beta, running_mean, running_var}));
  const int64_t total = n * c * spatial;
  if (ChannelsLastBatchNorm(spatial, layout)) {
    return DispatchDataType(kOp, dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return DispatchWalk(
          total, c % 4 == 0 && Vectorizable<T>(4, {x, y}), [&](auto width, auto index) {
            constexpr int V = decltype(width)::value;
            using Index = decltype(index);
            BnNhwcInferenceKernel<T, V, Index>
                <<<BlocksFor(total / V), kThreadsPerBlock, 0, stream>>>(
                    static_cast<const T*>(x), static_cast<T*>(y), static_cast<Index>(total / V),
                    static_cast<Index>(c), gamma, beta, running_mean, running_var, epsilon);
            PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
            return absl::OkStatus();
          });
    });
  }
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return DispatchWalk(total, Vectorizable<T>(spatial, {x, y}), [&](auto width, auto index) {
      constexpr int V = decltype(width)::value;
      using Index = decltype(index);
      BnInferenceKernel<T, V, Index><<<BlocksFor(total / V), kThreadsPerBlock, 0, stream>>>(
          static_cast<const T*>(x), static_cast<T*>(y), static_cast<Index>(total / V),
          static_cast<Index>(c), static_cast<Index>(spatial / V), gamma, beta, running_mean,
          running_var, epsilon);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

absl::Status LaunchBatchNormBackward(DataType dtype, const void* x, const void* dy, void* dx,
                                     const float* gamma, const float* save_mean,
                                     const float* save_inv_std, float* dgamma, float* dbeta,
                                     int64_t n, int64_t c, int64_t spatial, float* scratch,
                                     TensorLayout layout, cudaStream_t stream) {
  constexpr const char* kOp = "BatchNormBackward";
  PSTRAIN_RETURN_IF_ERROR(CheckShape(kOp, n, c, spatial));
  PSTRAIN_RETURN_IF_ERROR(
      CheckPointers(kOp, {x, dy, dx, gamma, save_mean, save_inv_std, dgamma, dbeta, scratch}));
  const int blocks = BatchNormBlocks(n, c, spatial, layout);
  const int64_t m = n * spatial, total = m * c;
  float* partial = scratch;
  float* coef = scratch + 2 * c * blocks;
  if (ChannelsLastBatchNorm(spatial, layout)) {
    const NhwcLanes lanes = BnNhwcLanes(c);
    const dim3 grid(blocks, lanes.channel_blocks), block(lanes.c, lanes.r);
    const size_t shared = 2 * sizeof(float) * lanes.c * lanes.r;
    return DispatchDataType(kOp, dtype, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      const T* in = static_cast<const T*>(x);
      const T* grad = static_cast<const T*>(dy);
      BnNhwcPartialKernel<T, NhwcSum::kBackward><<<grid, block, shared, stream>>>(
          in, grad, m, c, blocks, nullptr, save_mean, save_inv_std, partial);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnFinalizeBackwardKernel<<<ChannelWarpBlocks(c), 32 * kChannelWarps, 0, stream>>>(
          c, m, blocks, partial, gamma, save_inv_std, dgamma, dbeta, coef);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return DispatchWalk(total, c % 4 == 0 && Vectorizable<T>(4, {x, dy, dx}),
                          [&](auto width, auto index) {
                            constexpr int V = decltype(width)::value;
                            using Index = decltype(index);
                            BnNhwcBackwardDxKernel<T, V, Index>
                                <<<BlocksFor(total / V), kThreadsPerBlock, 0, stream>>>(
                                    in, grad, static_cast<T*>(dx), static_cast<Index>(total / V),
                                    static_cast<Index>(c), save_mean, save_inv_std, coef);
                            PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
                            return absl::OkStatus();
                          });
    });
  }
  const dim3 grid(blocks, static_cast<unsigned>(c));
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* in = static_cast<const T*>(x);
    const T* grad = static_cast<const T*>(dy);
    return DispatchWalk(total, Vectorizable<T>(spatial, {x, dy, dx}), [&](auto width, auto index) {
      constexpr int V = decltype(width)::value;
      using Index = decltype(index);
      const int64_t sv = spatial / V, mv = n * sv;
      BnBackwardPartialKernel<T, V><<<grid, kBnThreads, 0, stream>>>(
          in, grad, c, sv, mv, blocks, save_mean, save_inv_std, partial);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnFinalizeBackwardKernel<<<ChannelWarpBlocks(c), 32 * kChannelWarps, 0, stream>>>(
          c, m, blocks, partial, gamma, save_inv_std, dgamma, dbeta, coef);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnBackwardDxKernel<T, V, Index><<<BlocksFor(total / V), kThreadsPerBlock, 0, stream>>>(
          in, grad, static_cast<T*>(dx), static_cast<Index>(total / V), static_cast<Index>(c),
          static_cast<Index>(sv), save_mean, save_inv_std, coef);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

}  // namespace pstrain::cuda
