// Softmax cross-entropy for the CUDA backend: one block per row computes the
// softmax, the row's loss and its gradient; a second single-block kernel
// averages the row losses in a fixed order (deterministic, no atomics).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.cuh"

namespace pstrain::cuda {

constexpr int kLossThreads = 128;

template <typename T>
__global__ void SoftmaxCrossEntropyRowsKernel(const T* logits, const int32_t* labels,
                                              int64_t classes, float grad_scale, T* dlogits,
                                              float* probs, float* row_loss, int32_t* label_error) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * classes;
  float row_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < classes; j += blockDim.x) {
    row_max = fmaxf(row_max, ToFloat(x[j]));
  }
  row_max = BlockReduce<true>(row_max, scratch);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < classes; j += blockDim.x) sum += expf(ToFloat(x[j]) - row_max);
  sum = BlockReduce<false>(sum, scratch);
  const float inv_sum = 1.f / sum;
  const int32_t label = labels[row];
  const bool label_ok = label >= 0 && label < classes;
  for (int64_t j = threadIdx.x; j < classes; j += blockDim.x) {
    const float p = expf(ToFloat(x[j]) - row_max) * inv_sum;
    if (probs != nullptr) probs[row * classes + j] = p;
    if (dlogits != nullptr) {
      dlogits[row * classes + j] =
          FromFloat<T>((p - (label_ok && j == label ? 1.f : 0.f)) * grad_scale);
    }
  }
  if (threadIdx.x == 0) {
    if (label_ok) {
      // -log softmax[label] = log(sum) + max - x[label].
      row_loss[row] = logf(sum) + row_max - ToFloat(x[label]);
    } else {
      row_loss[row] = NAN;
      if (atomicCAS(&label_error[0], 0, static_cast<int32_t>(row + 1)) == 0) {
        label_error[1] = label;
      }
    }
  }
}

__global__ void MeanKernel(const float* values, int64_t n, float* mean) {
  __shared__ float scratch[32];
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += values[i];
  sum = BlockReduce<false>(sum, scratch);
  if (threadIdx.x == 0) *mean = sum / static_cast<float>(n);
}

absl::Status LaunchSoftmaxCrossEntropy(DataType dtype, const void* logits, const int32_t* labels,
                                       int64_t n, int64_t classes, float* loss, void* dlogits,
                                       float* probs, float dlogits_scale, float* row_loss,
                                       int32_t* label_error, cudaStream_t stream) {
  constexpr const char* kOp = "SoftmaxCrossEntropy";
  if (n <= 0 || classes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": need n > 0 and classes > 0, got n=", n, " classes=", classes));
  }
  if (n > INT32_MAX || classes > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": n=", n, " or classes=", classes, " exceeds 2^31-1"));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {logits, labels, loss, row_loss, label_error}));
  const float grad_scale = dlogits_scale / static_cast<float>(n);
  PSTRAIN_RETURN_IF_ERROR(DispatchDataType(kOp, dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    SoftmaxCrossEntropyRowsKernel<T><<<static_cast<unsigned>(n), kLossThreads, 0, stream>>>(
        static_cast<const T*>(logits), labels, classes, grad_scale, static_cast<T*>(dlogits), probs,
        row_loss, label_error);
    PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
    return absl::OkStatus();
  }));
  MeanKernel<<<1, 1024, 0, stream>>>(row_loss, n, loss);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

}  // namespace pstrain::cuda
