// Helpers the cuDNN plans of the CUDA backend share (conv_plan.cc,
// pool_plan.cc, batch_norm_plan.cc): pstrain's types and layouts in cuDNN's
// terms, a 4-d tensor descriptor, and the scaling factors cuDNN's calls take.
// Internal to kernels/cuda/.
//
//   PSTRAIN_ASSIGN_OR_RETURN(TensorDescriptor x, NewTensor4d(n, c, h, w, dtype, layout));
//   cudnnPoolingForward(cudnn, pool, &kOne, x.get(), x_data, &kZero, y.get(), y_data);
//
// Threads: plain functions; a descriptor is used by one thread at a time.
#ifndef PSTRAIN_KERNELS_CUDA_CUDNN_UTIL_H_
#define PSTRAIN_KERNELS_CUDA_CUDNN_UTIL_H_

#include <cudnn.h>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_handles.h"

namespace pstrain::cuda {

// alpha and beta of cuDNN's calls: y = 1 * op(x) + 0 * y.
inline constexpr float kOne = 1.f;
inline constexpr float kZero = 0.f;

cudnnDataType_t CudnnType(DataType dtype);
cudnnTensorFormat_t CudnnFormat(TensorLayout layout);

// A descriptor of an [n, c, h, w] tensor of `dtype`, stored in `layout`.
absl::StatusOr<TensorDescriptor> NewTensor4d(int n, int c, int h, int w,
                                             DataType dtype = DataType::kF32,
                                             TensorLayout layout = TensorLayout::kNCHW);

}  // namespace pstrain::cuda

#endif  // PSTRAIN_KERNELS_CUDA_CUDNN_UTIL_H_
