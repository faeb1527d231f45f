// Helpers shared by the .cu files: grid sizing for grid-stride loops, block
// reductions, and the common argument checks of the launchers.
#ifndef PSTRAIN_KERNELS_CUDA_LAUNCH_UTIL_CUH_
#define PSTRAIN_KERNELS_CUDA_LAUNCH_UTIL_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pstrain::cuda {

inline constexpr int kThreadsPerBlock = 256;
// Grid-stride loops cover any count; more blocks than this only add overhead.
inline constexpr int64_t kMaxBlocks = 65536;

inline int BlocksFor(int64_t count) {
  return static_cast<int>(
      std::min<int64_t>((count + kThreadsPerBlock - 1) / kThreadsPerBlock, kMaxBlocks));
}

// The index of the calling thread in a 1-D grid, and the stride of a
// grid-stride loop, as 64-bit values so that counts beyond 2^31 work.
__device__ __forceinline__ int64_t GlobalThreadIndex() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ float WarpReduceSum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

__device__ __forceinline__ float WarpReduceMax(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// Reduces `value` over the block (blockDim.x a multiple of 32, at most 1024)
// and returns the result to every thread. `scratch` is __shared__ float[32].
// Contains __syncthreads(): every thread of the block must call it.
template <bool kMax>
__device__ __forceinline__ float BlockReduce(float value, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  value = kMax ? WarpReduceMax(value) : WarpReduceSum(value);
  __syncthreads();  // `scratch` may still be read by a previous call.
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float identity = kMax ? -INFINITY : 0.f;
  value = lane < warps ? scratch[lane] : identity;
  value = kMax ? WarpReduceMax(value) : WarpReduceSum(value);
  return value;
}

// Shared launcher checks: a negative count is an error, and a null pointer is
// an error when there is work to do.
inline absl::Status CheckCount(const char* op, int64_t count) {
  if (count < 0) return absl::InvalidArgumentError(absl::StrCat(op, ": negative count ", count));
  return absl::OkStatus();
}

inline absl::Status CheckPointers(const char* op, std::initializer_list<const void*> pointers) {
  int index = 0;
  for (const void* p : pointers) {
    if (p == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": pointer argument ", index, " is null"));
    }
    ++index;
  }
  return absl::OkStatus();
}

}  // namespace pstrain::cuda

#endif  // PSTRAIN_KERNELS_CUDA_LAUNCH_UTIL_CUH_
