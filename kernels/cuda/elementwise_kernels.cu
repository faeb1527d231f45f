// Element-wise kernels of the CUDA backend: bias add and its gradient,
// activations, dropout, and the small BLAS-1 style ops. Each kernel is
// followed by its launcher (see cuda_kernels.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.cuh"
#include "common/rng.h"

namespace pstrain::cuda {
namespace {

absl::Status CheckBiasShape(const char* op, int64_t outer, int64_t channels, int64_t inner) {
  if (outer < 0 || channels < 0 || inner < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": negative shape [", outer, ", ", channels, ", ", inner, "]"));
  }
  return absl::OkStatus();
}

}  // namespace

// --- AddBias -----------------------------------------------------------------

__global__ void AddBiasKernel(float* y, const float* bias, int64_t total, int64_t channels,
                              int64_t inner) {
  for (int64_t i = GlobalThreadIndex(); i < total; i += GridStride()) {
    y[i] += bias[(i / inner) % channels];
  }
}

absl::Status LaunchAddBias(float* y, const float* bias, int64_t outer, int64_t channels,
                           int64_t inner, cudaStream_t stream) {
  constexpr const char* kOp = "AddBias";
  PSTRAIN_RETURN_IF_ERROR(CheckBiasShape(kOp, outer, channels, inner));
  const int64_t total = outer * channels * inner;
  if (total == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {y, bias}));
  AddBiasKernel<<<BlocksFor(total), kThreadsPerBlock, 0, stream>>>(y, bias, total, channels, inner);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

// --- BiasGrad ----------------------------------------------------------------

// inner == 1 (dense layers): one thread per channel walks down the batch, so
// that neighbouring threads read neighbouring addresses.
__global__ void BiasGradColumnsKernel(const float* dy, float* dbias, int64_t outer,
                                      int64_t channels) {
  for (int64_t ch = GlobalThreadIndex(); ch < channels; ch += GridStride()) {
    float sum = 0.f;
    for (int64_t o = 0; o < outer; ++o) sum += dy[o * channels + ch];
    dbias[ch] = sum;
  }
}

// inner > 1 (convolutions): one block per channel reduces outer * inner
// values; the order of the additions is fixed, so results are deterministic.
__global__ void BiasGradBlocksKernel(const float* dy, float* dbias, int64_t outer, int64_t channels,
                                     int64_t inner) {
  __shared__ float scratch[32];
  const int64_t ch = blockIdx.x;
  float sum = 0.f;
  for (int64_t o = 0; o < outer; ++o) {
    const float* plane = dy + (o * channels + ch) * inner;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) sum += plane[i];
  }
  sum = BlockReduce<false>(sum, scratch);
  if (threadIdx.x == 0) dbias[ch] = sum;
}

absl::Status LaunchBiasGrad(const float* dy, float* dbias, int64_t outer, int64_t channels,
                            int64_t inner, cudaStream_t stream) {
  constexpr const char* kOp = "BiasGrad";
  PSTRAIN_RETURN_IF_ERROR(CheckBiasShape(kOp, outer, channels, inner));
  if (channels == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {dbias}));
  if (outer * inner == 0) {
    // Nothing to sum: the gradient is zero (outputs are overwritten).
    return LaunchFill(dbias, 0.f, channels, stream);
  }
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {dy}));
  if (inner == 1) {
    BiasGradColumnsKernel<<<BlocksFor(channels), kThreadsPerBlock, 0, stream>>>(dy, dbias, outer,
                                                                                channels);
  } else {
    if (channels > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": too many channels ", channels));
    }
    BiasGradBlocksKernel<<<static_cast<unsigned>(channels), kThreadsPerBlock, 0, stream>>>(
        dy, dbias, outer, channels, inner);
  }
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

// --- Activations -----------------------------------------------------------

__global__ void ActivationForwardKernel(Activation kind, float alpha, const float* x, float* y,
                                        int64_t count) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) {
    const float v = x[i];
    float out;
    switch (kind) {
      case Activation::kRelu:
        out = v > 0.f ? v : 0.f;
        break;
      case Activation::kLeakyRelu:
        out = v > 0.f ? v : alpha * v;
        break;
      case Activation::kTanh:
        out = tanhf(v);
        break;
      case Activation::kSigmoid:
      default:
        out = 1.f / (1.f + expf(-v));
        break;
    }
    y[i] = out;
  }
}

__global__ void ActivationBackwardKernel(Activation kind, float alpha, const float* x,
                                         const float* y, const float* dy, float* dx,
                                         int64_t count) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) {
    const float g = dy[i];
    float out;
    switch (kind) {
      case Activation::kRelu:
        out = x[i] > 0.f ? g : 0.f;
        break;
      case Activation::kLeakyRelu:
        out = x[i] > 0.f ? g : alpha * g;
        break;
      case Activation::kTanh:
        out = g * (1.f - y[i] * y[i]);
        break;
      case Activation::kSigmoid:
      default:
        out = g * y[i] * (1.f - y[i]);
        break;
    }
    dx[i] = out;
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

absl::Status LaunchActivationForward(Activation kind, float alpha, const float* x, float* y,
                                     int64_t count, cudaStream_t stream) {
  constexpr const char* kOp = "ActivationForward";
  PSTRAIN_RETURN_IF_ERROR(CheckActivation(kOp, kind));
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y}));
  ActivationForwardKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(kind, alpha, x, y,
                                                                             count);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

absl::Status LaunchActivationBackward(Activation kind, float alpha, const float* x, const float* y,
                                      const float* dy, float* dx, int64_t count,
                                      cudaStream_t stream) {
  constexpr const char* kOp = "ActivationBackward";
  PSTRAIN_RETURN_IF_ERROR(CheckActivation(kOp, kind));
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  // Each kind reads only x (relu, leaky relu) or only y (tanh, sigmoid).
  const bool uses_x = kind == Activation::kRelu || kind == Activation::kLeakyRelu;
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {uses_x ? static_cast<const void*>(x) : y, dy, dx}));
  ActivationBackwardKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(kind, alpha, x, y, dy,
                                                                              dx, count);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

// --- Dropout -----------------------------------------------------------------

__global__ void DropoutForwardKernel(const float* x, float* y, float* mask, int64_t count,
                                     float rate, float keep_scale, uint64_t seed) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) {
    const float m = DropoutKeep(seed, static_cast<uint64_t>(i), rate) ? keep_scale : 0.f;
    mask[i] = m;
    y[i] = x[i] * m;
  }
}

absl::Status LaunchDropoutForward(const float* x, float* y, float* mask, int64_t count, float rate,
                                  uint64_t seed, cudaStream_t stream) {
  constexpr const char* kOp = "DropoutForward";
  if (!(rate >= 0.f && rate < 1.f)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": rate must be in [0, 1), got ", rate));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y, mask}));
  const float keep_scale = 1.f / (1.f - rate);
  DropoutForwardKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(x, y, mask, count, rate,
                                                                          keep_scale, seed);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

// --- Multiply, Add, Axpy, Scale, Fill ------------------------------------------

__global__ void MultiplyKernel(const float* a, const float* b, float* y, int64_t count) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) y[i] = a[i] * b[i];
}

absl::Status LaunchMultiply(const float* a, const float* b, float* y, int64_t count,
                            cudaStream_t stream) {
  constexpr const char* kOp = "Multiply";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {a, b, y}));
  MultiplyKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(a, b, y, count);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

__global__ void AddKernel(const float* a, const float* b, float* y, int64_t count) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) y[i] = a[i] + b[i];
}

absl::Status LaunchAdd(const float* a, const float* b, float* y, int64_t count,
                       cudaStream_t stream) {
  constexpr const char* kOp = "Add";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {a, b, y}));
  AddKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(a, b, y, count);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

__global__ void AxpyKernel(float alpha, const float* x, float* y, int64_t count) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) y[i] += alpha * x[i];
}

absl::Status LaunchAxpy(float alpha, const float* x, float* y, int64_t count, cudaStream_t stream) {
  constexpr const char* kOp = "Axpy";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x, y}));
  AxpyKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(alpha, x, y, count);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
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

__global__ void FillKernel(float* x, float value, int64_t count) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) x[i] = value;
}

absl::Status LaunchFill(float* x, float value, int64_t count, cudaStream_t stream) {
  constexpr const char* kOp = "Fill";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {x}));
  FillKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(x, value, count);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

}  // namespace pstrain::cuda
