// Element-wise kernels of the CUDA backend: bias add and its gradient,
// activations, dropout, the small BLAS-1 style ops, and type conversion. Each
// kernel is followed by its launcher (see cuda_kernels.h). Kernels that take
// a DataType are templates over the element type T (float, __nv_bfloat16,
// __half): they compute in fp32 and round once when they store.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/rng.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.cuh"

namespace pstrain::cuda {
namespace {

absl::Status CheckBiasShape(const char* op, int64_t outer, int64_t channels, int64_t inner) {
  if (outer < 0 || channels < 0 || inner < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": negative shape [", outer, ", ", channels, ", ", inner, "]"));
  }
  return absl::OkStatus();
}

// Whether every pointer can be read 4 elements at a time over `count`
// elements (see DispatchWalk).
template <typename T>
bool Vectorizable(int64_t count, std::initializer_list<const void*> pointers) {
  if (count % 4 != 0) return false;
  for (const void* p : pointers) {
    if (!IsAligned4<T>(p)) return false;
  }
  return true;
}

}  // namespace

// --- AddBias -----------------------------------------------------------------

template <typename T>
__global__ void AddBiasKernel(T* y, const T* bias, int64_t total, int64_t channels, int64_t inner) {
  for (int64_t i = GlobalThreadIndex(); i < total; i += GridStride()) {
    y[i] = FromFloat<T>(ToFloat(y[i]) + ToFloat(bias[(i / inner) % channels]));
  }
}

absl::Status LaunchAddBias(DataType dtype, void* y, const void* bias, int64_t outer,
                           int64_t channels, int64_t inner, cudaStream_t stream) {
  constexpr const char* kOp = "AddBias";
  PSTRAIN_RETURN_IF_ERROR(CheckBiasShape(kOp, outer, channels, inner));
  const int64_t total = outer * channels * inner;
  if (total == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {y, bias}));
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    AddBiasKernel<T><<<BlocksFor(total), kThreadsPerBlock, 0, stream>>>(
        static_cast<T*>(y), static_cast<const T*>(bias), total, channels, inner);
    PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
    return absl::OkStatus();
  });
}

// --- BiasGrad ----------------------------------------------------------------

// inner == 1 (dense layers): one thread per channel walks down the batch, so
// that neighbouring threads read neighbouring addresses.
template <typename T>
__global__ void BiasGradColumnsKernel(const T* dy, T* dbias, int64_t outer, int64_t channels) {
  for (int64_t ch = GlobalThreadIndex(); ch < channels; ch += GridStride()) {
    float sum = 0.f;
    for (int64_t o = 0; o < outer; ++o) sum += ToFloat(dy[o * channels + ch]);
    dbias[ch] = FromFloat<T>(sum);
  }
}

// inner > 1 (convolutions): one block per channel reduces outer * inner
// values; the order of the additions is fixed, so results are deterministic.
template <typename T>
__global__ void BiasGradBlocksKernel(const T* dy, T* dbias, int64_t outer, int64_t channels,
                                     int64_t inner) {
  __shared__ float scratch[32];
  const int64_t ch = blockIdx.x;
  float sum = 0.f;
  for (int64_t o = 0; o < outer; ++o) {
    const T* plane = dy + (o * channels + ch) * inner;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) sum += ToFloat(plane[i]);
  }
  sum = BlockReduce<false>(sum, scratch);
  if (threadIdx.x == 0) dbias[ch] = FromFloat<T>(sum);
}

template <typename T>
__global__ void FillTypedKernel(T* x, float value, int64_t count) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) x[i] = FromFloat<T>(value);
}

absl::Status LaunchBiasGrad(DataType dtype, const void* dy, void* dbias, int64_t outer,
                            int64_t channels, int64_t inner, cudaStream_t stream) {
  constexpr const char* kOp = "BiasGrad";
  PSTRAIN_RETURN_IF_ERROR(CheckBiasShape(kOp, outer, channels, inner));
  if (channels == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {dbias}));
  if (outer * inner > 0) PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {dy}));
  if (inner > 1 && channels > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": too many channels ", channels));
  }
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* out = static_cast<T*>(dbias);
    const T* in = static_cast<const T*>(dy);
    if (outer * inner == 0) {
      // Nothing to sum: the gradient is zero (outputs are overwritten).
      FillTypedKernel<T><<<BlocksFor(channels), kThreadsPerBlock, 0, stream>>>(out, 0.f, channels);
    } else if (inner == 1) {
      BiasGradColumnsKernel<T>
          <<<BlocksFor(channels), kThreadsPerBlock, 0, stream>>>(in, out, outer, channels);
    } else {
      BiasGradBlocksKernel<T><<<static_cast<unsigned>(channels), kThreadsPerBlock, 0, stream>>>(
          in, out, outer, channels, inner);
    }
    PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
    return absl::OkStatus();
  });
}

// --- Activations -----------------------------------------------------------

__device__ __forceinline__ float ActivationOf(Activation kind, float alpha, float v) {
  switch (kind) {
    case Activation::kRelu:
      return v > 0.f ? v : 0.f;
    case Activation::kLeakyRelu:
      return v > 0.f ? v : alpha * v;
    case Activation::kTanh:
      return tanhf(v);
    case Activation::kSigmoid:
    default:
      return 1.f / (1.f + expf(-v));
  }
}

// The gradient through the activation from its input x or output y (each
// kind reads only one of them).
__device__ __forceinline__ float ActivationGradOf(Activation kind, float alpha, float x, float y,
                                                  float g) {
  switch (kind) {
    case Activation::kRelu:
      return x > 0.f ? g : 0.f;
    case Activation::kLeakyRelu:
      return x > 0.f ? g : alpha * g;
    case Activation::kTanh:
      return g * (1.f - y * y);
    case Activation::kSigmoid:
    default:
      return g * y * (1.f - y);
  }
}

// The element-wise kernels below walk `count` elements in units of V
// (count_v = count / V units; see DispatchWalk).
template <typename T, int V, typename Index>
__global__ void ActivationForwardKernel(Activation kind, float alpha, const T* x, T* y,
                                        Index count_v) {
  for (Index i = FirstIndex<Index>(); i < count_v; i += StrideOf<Index>()) {
    const int64_t at = static_cast<int64_t>(i) * V;
    float v[V];
    LoadVec<T, V>(x + at, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = ActivationOf(kind, alpha, v[k]);
    StoreVec<T, V>(y + at, v);
  }
}

template <typename T, int V, typename Index>
__global__ void ActivationBackwardKernel(Activation kind, float alpha, const T* x, const T* y,
                                         const T* dy, T* dx, Index count_v) {
  const bool uses_x = kind == Activation::kRelu || kind == Activation::kLeakyRelu;
  for (Index i = FirstIndex<Index>(); i < count_v; i += StrideOf<Index>()) {
    const int64_t at = static_cast<int64_t>(i) * V;
    float in[V], g[V];
    LoadVec<T, V>((uses_x ? x : y) + at, in);
    LoadVec<T, V>(dy + at, g);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      g[k] = uses_x ? ActivationGradOf(kind, alpha, in[k], 0.f, g[k])
                    : ActivationGradOf(kind, alpha, 0.f, in[k], g[k]);
    }
    StoreVec<T, V>(dx + at, g);
  }
}

namespace {

absl::Status CheckActivation(const char* op, Activation kind) {
  switch (kind) {
    case Activation::kRelu:
    case Activation::kLeakyRelu:
    case Activation::kTanh:
    case Activation::kSigmoid:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": unknown activation ", static_cast<int>(kind)));
}

}  // namespace

absl::Status LaunchActivationForward(DataType dtype, Activation kind, float alpha, const void* x,
                                     void* y, int64_t count, cudaStream_t stream) {
  constexpr const char* kOp = "ActivationForward";
  PSTRAIN_RETURN_IF_ERROR(CheckActivation(kOp, kind));
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y}));
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return DispatchWalk(count, Vectorizable<T>(count, {x, y}), [&](auto width, auto index) {
      constexpr int V = decltype(width)::value;
      using Index = decltype(index);
      ActivationForwardKernel<T, V, Index><<<BlocksFor(count / V), kThreadsPerBlock, 0, stream>>>(
          kind, alpha, static_cast<const T*>(x), static_cast<T*>(y), static_cast<Index>(count / V));
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

absl::Status LaunchActivationBackward(DataType dtype, Activation kind, float alpha, const void* x,
                                      const void* y, const void* dy, void* dx, int64_t count,
                                      cudaStream_t stream) {
  constexpr const char* kOp = "ActivationBackward";
  PSTRAIN_RETURN_IF_ERROR(CheckActivation(kOp, kind));
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  // Each kind reads only x (relu, leaky relu) or only y (tanh, sigmoid).
  const bool uses_x = kind == Activation::kRelu || kind == Activation::kLeakyRelu;
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {uses_x ? x : y, dy, dx}));
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool vectorizable = Vectorizable<T>(count, {uses_x ? x : y, dy, dx});
    return DispatchWalk(count, vectorizable, [&](auto width, auto index) {
      constexpr int V = decltype(width)::value;
      using Index = decltype(index);
      ActivationBackwardKernel<T, V, Index><<<BlocksFor(count / V), kThreadsPerBlock, 0, stream>>>(
          kind, alpha, static_cast<const T*>(x), static_cast<const T*>(y),
          static_cast<const T*>(dy), static_cast<T*>(dx), static_cast<Index>(count / V));
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

// --- Dropout -----------------------------------------------------------------

template <typename T>
__global__ void DropoutForwardKernel(const T* x, T* y, T* mask, int64_t count, float rate,
                                     float keep_scale, uint64_t seed) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) {
    const float m = DropoutKeep(seed, static_cast<uint64_t>(i), rate) ? keep_scale : 0.f;
    mask[i] = FromFloat<T>(m);
    y[i] = FromFloat<T>(ToFloat(x[i]) * m);
  }
}

absl::Status LaunchDropoutForward(DataType dtype, const void* x, void* y, void* mask, int64_t count,
                                  float rate, uint64_t seed, cudaStream_t stream) {
  constexpr const char* kOp = "DropoutForward";
  if (!(rate >= 0.f && rate < 1.f)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": rate must be in [0, 1), got ", rate));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y, mask}));
  const float keep_scale = 1.f / (1.f - rate);
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    DropoutForwardKernel<T><<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), static_cast<T*>(mask), count, rate,
        keep_scale, seed);
    PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
    return absl::OkStatus();
  });
}

// --- Multiply, Add, Axpy, Scale, Fill ------------------------------------------

template <typename T, int V, typename Index>
__global__ void MultiplyKernel(const T* a, const T* b, T* y, Index count_v) {
  for (Index i = FirstIndex<Index>(); i < count_v; i += StrideOf<Index>()) {
    const int64_t at = static_cast<int64_t>(i) * V;
    float va[V], vb[V];
    LoadVec<T, V>(a + at, va);
    LoadVec<T, V>(b + at, vb);
#pragma unroll
    for (int k = 0; k < V; ++k) va[k] *= vb[k];
    StoreVec<T, V>(y + at, va);
  }
}

absl::Status LaunchMultiply(DataType dtype, const void* a, const void* b, void* y, int64_t count,
                            cudaStream_t stream) {
  constexpr const char* kOp = "Multiply";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {a, b, y}));
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return DispatchWalk(count, Vectorizable<T>(count, {a, b, y}), [&](auto width, auto index) {
      constexpr int V = decltype(width)::value;
      using Index = decltype(index);
      MultiplyKernel<T, V, Index><<<BlocksFor(count / V), kThreadsPerBlock, 0, stream>>>(
          static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(y),
          static_cast<Index>(count / V));
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

template <typename T, int V, typename Index>
__global__ void AddKernel(const T* a, const T* b, T* y, Index count_v) {
  for (Index i = FirstIndex<Index>(); i < count_v; i += StrideOf<Index>()) {
    const int64_t at = static_cast<int64_t>(i) * V;
    float va[V], vb[V];
    LoadVec<T, V>(a + at, va);
    LoadVec<T, V>(b + at, vb);
#pragma unroll
    for (int k = 0; k < V; ++k) va[k] += vb[k];
    StoreVec<T, V>(y + at, va);
  }
}

absl::Status LaunchAdd(DataType dtype, const void* a, const void* b, void* y, int64_t count,
                       cudaStream_t stream) {
  constexpr const char* kOp = "Add";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {a, b, y}));
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return DispatchWalk(count, Vectorizable<T>(count, {a, b, y}), [&](auto width, auto index) {
      constexpr int V = decltype(width)::value;
      using Index = decltype(index);
      AddKernel<T, V, Index><<<BlocksFor(count / V), kThreadsPerBlock, 0, stream>>>(
          static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(y),
          static_cast<Index>(count / V));
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

template <typename T, int V, typename Index>
__global__ void AxpyKernel(float alpha, const T* x, T* y, Index count_v) {
  for (Index i = FirstIndex<Index>(); i < count_v; i += StrideOf<Index>()) {
    const int64_t at = static_cast<int64_t>(i) * V;
    float vx[V], vy[V];
    LoadVec<T, V>(x + at, vx);
    LoadVec<T, V>(y + at, vy);
#pragma unroll
    for (int k = 0; k < V; ++k) vy[k] += alpha * vx[k];
    StoreVec<T, V>(y + at, vy);
  }
}

absl::Status LaunchAxpy(DataType dtype, float alpha, const void* x, void* y, int64_t count,
                        cudaStream_t stream) {
  constexpr const char* kOp = "Axpy";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y}));
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    return DispatchWalk(count, Vectorizable<T>(count, {x, y}), [&](auto width, auto index) {
      constexpr int V = decltype(width)::value;
      using Index = decltype(index);
      AxpyKernel<T, V, Index><<<BlocksFor(count / V), kThreadsPerBlock, 0, stream>>>(
          alpha, static_cast<const T*>(x), static_cast<T*>(y), static_cast<Index>(count / V));
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

__global__ void ScaleKernel(float alpha, float* x, int64_t count) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) x[i] *= alpha;
}

absl::Status LaunchScale(float alpha, float* x, int64_t count, cudaStream_t stream) {
  constexpr const char* kOp = "Scale";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x}));
  ScaleKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(alpha, x, count);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

absl::Status LaunchFill(float* x, float value, int64_t count, cudaStream_t stream) {
  constexpr const char* kOp = "Fill";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x}));
  FillTypedKernel<float><<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(x, value, count);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

// --- Convert -------------------------------------------------------------------

// In place when x == y and From == To: each element is read before it is
// written, by the same thread.
template <typename From, typename To>
__global__ void ConvertKernel(const From* x, To* y, int64_t count, float scale,
                              int32_t* nonfinite) {
  bool bad = false;
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) {
    const To out = FromFloat<To>(scale * ToFloat(x[i]));
    y[i] = out;
    bad |= !isfinite(ToFloat(out));
  }
  // Every writer stores the same value: no atomic is needed.
  if (nonfinite != nullptr && bad) *nonfinite = 1;
}

absl::Status LaunchConvert(DataType from, const void* x, DataType to, void* y, int64_t count,
                           float scale, int32_t* nonfinite, cudaStream_t stream) {
  constexpr const char* kOp = "Convert";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y}));
  if (x == y && from != to) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": in place from ", DataTypeName(from),
                                                   " to ", DataTypeName(to), " is not allowed"));
  }
  return DispatchDataType(kOp, from, [&](auto* from_tag) {
    using FromT = std::remove_pointer_t<decltype(from_tag)>;
    return DispatchDataType(kOp, to, [&](auto* to_tag) {
      using ToT = std::remove_pointer_t<decltype(to_tag)>;
      ConvertKernel<FromT, ToT><<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(
          static_cast<const FromT*>(x), static_cast<ToT*>(y), count, scale, nonfinite);
      PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
      return absl::OkStatus();
    });
  });
}

// --- Transpose --------------------------------------------------------------------

// y[b][c][r] = x[b][r][c]: 32x32 tiles through shared memory (a column of
// padding keeps the column reads free of bank conflicts), 32x8 threads per
// tile, grid (column tiles, row tiles, samples).
template <typename T>
__global__ void TransposeKernel(const T* x, T* y, int64_t batch, int rows, int cols) {
  __shared__ float tile[32][33];
  const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 32;
  const int64_t plane = int64_t{rows} * cols;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const T* src = x + b * plane;
    T* dst = y + b * plane;
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
      const int r = r0 + i, c = c0 + threadIdx.x;
      if (r < rows && c < cols) tile[i][threadIdx.x] = ToFloat(src[int64_t{r} * cols + c]);
    }
    __syncthreads();
    for (int i = threadIdx.y; i < 32; i += blockDim.y) {
      const int c = c0 + i, r = r0 + threadIdx.x;
      if (c < cols && r < rows) dst[int64_t{c} * rows + r] = FromFloat<T>(tile[threadIdx.x][i]);
    }
    __syncthreads();  // The tile is refilled for the next sample.
  }
}

absl::Status LaunchTranspose(DataType dtype, const void* x, void* y, int64_t batch, int64_t rows,
                             int64_t cols, cudaStream_t stream) {
  constexpr const char* kOp = "Transpose";
  if (batch < 0 || rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": negative shape [", batch, ", ", rows, ", ", cols, "]"));
  }
  if (batch * rows * cols == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y}));
  const int64_t tiles_r = (rows + 31) / 32, tiles_c = (cols + 31) / 32;
  if (tiles_r > 65535 || tiles_c > INT32_MAX || rows > INT32_MAX || cols > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": [", rows, ", ", cols, "] per sample is too large"));
  }
  const dim3 grid(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r),
                  static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
  const dim3 block(32, 8);
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    TransposeKernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y),
                                                   batch, static_cast<int>(rows),
                                                   static_cast<int>(cols));
    PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
    return absl::OkStatus();
  });
}

// --- Column sums -------------------------------------------------------------------

namespace {

constexpr int kColumnLanes = 32;    // Columns per block (one warp across).
constexpr int kColumnRowLanes = 8;  // Rows read at once per block.
constexpr int kMaxColumnSlices = 256;

int ColumnSlices(int64_t rows) {
  // At least 64 rows per slice, at most kMaxColumnSlices slices.
  return static_cast<int>(std::clamp<int64_t>((rows + 63) / 64, 1, kMaxColumnSlices));
}

}  // namespace

size_t ColumnSumScratchFloats(int64_t rows, int64_t cols) {
  return static_cast<size_t>(ColumnSlices(rows)) * static_cast<size_t>(cols);
}

// grid (slices, column blocks), block (32, 8): partial[slice * cols + c] =
// the sum of column c over the slice's rows, in a fixed order.
template <typename T>
__global__ void ColumnPartialSumKernel(const T* x, int64_t rows, int64_t cols, int slices,
                                       float* partial) {
  __shared__ float sums[kColumnRowLanes][kColumnLanes];
  const int64_t c = int64_t{blockIdx.y} * kColumnLanes + threadIdx.x;
  const int64_t per = (rows + slices - 1) / slices;
  const int64_t begin = min(rows, per * blockIdx.x), end = min(rows, begin + per);
  float sum = 0.f;
  if (c < cols) {
    for (int64_t r = begin + threadIdx.y; r < end; r += kColumnRowLanes) {
      sum += ToFloat(x[r * cols + c]);
    }
  }
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.f;
    for (int i = 0; i < kColumnRowLanes; ++i) total += sums[i][threadIdx.x];
    partial[int64_t{blockIdx.x} * cols + c] = total;
  }
}

template <typename T>
__global__ void ColumnFinalSumKernel(const float* partial, int64_t cols, int slices, T* sums) {
  for (int64_t c = GlobalThreadIndex(); c < cols; c += GridStride()) {
    float total = 0.f;
    for (int s = 0; s < slices; ++s) total += partial[s * cols + c];
    sums[c] = FromFloat<T>(total);
  }
}

absl::Status LaunchColumnSums(DataType dtype, const void* x, void* sums, int64_t rows, int64_t cols,
                              float* scratch, cudaStream_t stream) {
  constexpr const char* kOp = "ColumnSums";
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": negative shape [", rows, ", ", cols, "]"));
  }
  if (cols == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {sums, scratch}));
  if (rows > 0) PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x}));
  const int64_t column_blocks = (cols + kColumnLanes - 1) / kColumnLanes;
  if (column_blocks > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": too many columns ", cols));
  }
  const int slices = ColumnSlices(rows);
  return DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    ColumnPartialSumKernel<T>
        <<<dim3(slices, static_cast<unsigned>(column_blocks)), dim3(kColumnLanes, kColumnRowLanes),
           0, stream>>>(static_cast<const T*>(x), rows, cols, slices, scratch);
    PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
    ColumnFinalSumKernel<T><<<BlocksFor(cols), kThreadsPerBlock, 0, stream>>>(
        scratch, cols, slices, static_cast<T*>(sums));
    PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
    return absl::OkStatus();
  });
}

}  // namespace pstrain::cuda
