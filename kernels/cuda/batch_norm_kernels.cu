// Spatial batch norm for the CUDA backend, NCHW viewed as [N, C, S].
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
//   training forward   partial sums -> partial squared deviations (each block
//                      first combines the means) -> per-channel finalisation
//                      (statistics, running averages, scale and shift) ->
//                      normalisation
//   backward           partial sums of dy and dy * xhat -> per-channel
//                      finalisation (dgamma, dbeta, coefficients) -> dx
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

// Sum of `count` floats in a fixed order (every caller gets the same value).
__device__ __forceinline__ float SumInOrder(const float* values, int count) {
  float sum = 0.f;
  for (int i = 0; i < count; ++i) sum += values[i];
  return sum;
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
__global__ void BnPartialSquaresKernel(const T* x, int64_t c, int64_t sv, int64_t mv, int64_t m,
                                       int blocks, const float* partial_sum, float* partial_sq) {
  __shared__ float scratch[32];
  const int64_t ch = blockIdx.y;
  const float mean = SumInOrder(partial_sum + ch * blocks, blocks) / static_cast<float>(m);
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

// One thread per channel: the statistics, running averages (unbiased
// variance), saved mean and 1/sqrt(var + eps), and scale/shift for y.
__global__ void BnFinalizeForwardKernel(int64_t c, int64_t m, int blocks, const float* partial_sum,
                                        const float* partial_sq, const float* gamma,
                                        const float* beta, float epsilon, float momentum,
                                        float* running_mean, float* running_var, float* save_mean,
                                        float* save_inv_std, float* scale_shift) {
  const int64_t ch = GlobalThreadIndex();
  if (ch >= c) return;
  const float mean = SumInOrder(partial_sum + ch * blocks, blocks) / static_cast<float>(m);
  const float var = SumInOrder(partial_sq + ch * blocks, blocks) / static_cast<float>(m);
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

// One thread per channel: dbeta, dgamma, and the coefficients of dx:
// coef = {gamma * inv_std, mean(dy), mean(dy * xhat)}.
__global__ void BnFinalizeBackwardKernel(int64_t c, int64_t m, int blocks, const float* partial,
                                         const float* gamma, const float* save_inv_std,
                                         float* dgamma, float* dbeta, float* coef) {
  const int64_t ch = GlobalThreadIndex();
  if (ch >= c) return;
  float sum_dy = 0.f, sum_dy_xhat = 0.f;
  for (int b = 0; b < blocks; ++b) {
    sum_dy += partial[2 * (ch * blocks + b)];
    sum_dy_xhat += partial[2 * (ch * blocks + b) + 1];
  }
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

int BatchNormBlocks(int64_t n, int64_t spatial) {
  const int64_t m = n * spatial;
  const int64_t per_block = int64_t{kBnThreads} * kValuesPerThread;
  return static_cast<int>(std::clamp<int64_t>((m + per_block - 1) / per_block, 1, kMaxBnBlocks));
}

size_t BatchNormScratchFloats(int64_t n, int64_t c, int64_t spatial) {
  // Partial sums and squares (or the backward's pairs), then 3 per channel.
  return static_cast<size_t>(c) * (2 * BatchNormBlocks(n, spatial) + 3);
}

absl::Status LaunchBatchNormForwardTraining(DataType dtype, const void* x, void* y,
                                            const float* gamma, const float* beta,
                                            float* running_mean, float* running_var,
                                            float* save_mean, float* save_inv_std, int64_t n,
                                            int64_t c, int64_t spatial, float epsilon,
                                            float momentum, float* scratch, cudaStream_t stream) {
  constexpr const char* kOp = "BatchNormForwardTraining";
  PSTRAIN_RETURN_IF_ERROR(CheckShape(kOp, n, c, spatial));
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(
      kOp, {x, y, gamma, beta, running_mean, running_var, save_mean, save_inv_std, scratch}));
  const int blocks = BatchNormBlocks(n, spatial);
  const int64_t m = n * spatial, total = m * c;
  float* partial_sum = scratch;
  float* partial_sq = scratch + c * blocks;
  float* scale_shift = scratch + 2 * c * blocks;
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
      BnPartialSquaresKernel<T, V>
          <<<grid, kBnThreads, 0, stream>>>(in, c, sv, mv, m, blocks, partial_sum, partial_sq);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      BnFinalizeForwardKernel<<<BlocksFor(c), kThreadsPerBlock, 0, stream>>>(
          c, m, blocks, partial_sum, partial_sq, gamma, beta, epsilon, momentum, running_mean,
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
                                             cudaStream_t stream) {
  constexpr const char* kOp = "BatchNormForwardInference";
  if (n <= 0 || c <= 0 || spatial <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": need positive sizes, got [", n, ", ", c, ", ", spatial, "]"));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y, gamma, beta, running_mean, running_var}));
  const int64_t total = n * c * spatial;
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
                                     cudaStream_t stream) {
  constexpr const char* kOp = "BatchNormBackward";
  PSTRAIN_RETURN_IF_ERROR(CheckShape(kOp, n, c, spatial));
  PSTRAIN_RETURN_IF_ERROR(
      CheckPointers(kOp, {x, dy, dx, gamma, save_mean, save_inv_std, dgamma, dbeta, scratch}));
  const int blocks = BatchNormBlocks(n, spatial);
  const int64_t m = n * spatial, total = m * c;
  float* partial = scratch;
  float* coef = scratch + 2 * c * blocks;
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
      BnFinalizeBackwardKernel<<<BlocksFor(c), kThreadsPerBlock, 0, stream>>>(
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
