// Helpers shared by the .cu files: grid sizing for grid-stride loops, block
// reductions, and the common argument checks of the launchers.
#ifndef PSTRAIN_KERNELS_CUDA_LAUNCH_UTIL_CUH_
#define PSTRAIN_KERNELS_CUDA_LAUNCH_UTIL_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"

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

// Element access for the DataTypes: kernels read any of them as fp32 and
// round once, to nearest even, when they store.
__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T FromFloat(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    static_assert(std::is_same_v<T, __half>);
    return __float2half_rn(v);
  }
}

// Four consecutive elements, loaded and stored as one 16-byte (fp32) or
// 8-byte (bf16, fp16) access: `p` must be aligned to 4 elements
// (IsAligned4). Values are read as fp32 and rounded once when stored.
template <typename T>
struct alignas(4 * sizeof(T)) Pack4 {
  T v[4];
};
template <typename T>
__device__ __forceinline__ void Load4(const T* p, float out[4]) {
  const Pack4<T> pack = *reinterpret_cast<const Pack4<T>*>(p);
#pragma unroll
  for (int k = 0; k < 4; ++k) out[k] = ToFloat(pack.v[k]);
}
template <typename T>
__device__ __forceinline__ void Store4(T* p, const float in[4]) {
  Pack4<T> pack;
#pragma unroll
  for (int k = 0; k < 4; ++k) pack.v[k] = FromFloat<T>(in[k]);
  *reinterpret_cast<Pack4<T>*>(p) = pack;
}
template <typename T>
inline bool IsAligned4(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T)) == 0;
}

// Counts below this are indexed with 32-bit arithmetic (a 64-bit division
// costs several times a 32-bit one); a grid-stride step stays far below it,
// so index + step cannot wrap.
inline constexpr int64_t kMax32BitCount = int64_t{1} << 31;

// V = 1 or 4 consecutive elements as fp32 (Load4/Store4 when V is 4).
template <typename T, int V>
__device__ __forceinline__ void LoadVec(const T* p, float out[V]) {
  if constexpr (V == 4) {
    Load4(p, out);
  } else {
    static_assert(V == 1);
    out[0] = ToFloat(*p);
  }
}
template <typename T, int V>
__device__ __forceinline__ void StoreVec(T* p, const float in[V]) {
  if constexpr (V == 4) {
    Store4(p, in);
  } else {
    static_assert(V == 1);
    *p = FromFloat<T>(in[0]);
  }
}

// Chooses how an element-wise kernel walks `count` elements and calls
// fn(std::integral_constant<int, V>{}, Index{}): 4 elements per access with
// 32-bit indices when `vectorizable` (every pointer IsAligned4 and the
// count, or the innermost extent the kernel divides by, a multiple of 4),
// else 1; 64-bit indices from kMax32BitCount elements on.
//   return DispatchWalk(count, vectorizable, [&](auto width, auto index) {
//     constexpr int V = decltype(width)::value;
//     using Index = decltype(index);
//     ...
//   });
template <typename Fn>
absl::Status DispatchWalk(int64_t count, bool vectorizable, Fn&& fn) {
  if (count < kMax32BitCount) {
    if (vectorizable) return fn(std::integral_constant<int, 4>{}, uint32_t{});
    return fn(std::integral_constant<int, 1>{}, uint32_t{});
  }
  return fn(std::integral_constant<int, 1>{}, int64_t{});
}

// The first index and the stride of a grid-stride loop in Index arithmetic.
template <typename Index>
__device__ __forceinline__ Index FirstIndex() {
  return static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
}
template <typename Index>
__device__ __forceinline__ Index StrideOf() {
  return static_cast<Index>(gridDim.x) * blockDim.x;
}

// Calls fn(static_cast<T*>(nullptr)) with T the element type of `dtype`
// (float, __nv_bfloat16 or __half), so that a generic lambda can launch the
// kernel template for it:
//   return DispatchDataType(kOp, dtype, [&](auto* tag) {
//     using T = std::remove_pointer_t<decltype(tag)>;
//     ...
//   });
template <typename Fn>
absl::Status DispatchDataType(const char* op, DataType dtype, Fn&& fn) {
  switch (dtype) {
    case DataType::kF32:
      return fn(static_cast<float*>(nullptr));
    case DataType::kBF16:
      return fn(static_cast<__nv_bfloat16*>(nullptr));
    case DataType::kF16:
      return fn(static_cast<__half*>(nullptr));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": unknown data type ", static_cast<int>(dtype)));
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
