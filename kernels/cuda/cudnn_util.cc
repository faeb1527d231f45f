#include "kernels/cuda/cudnn_util.h"

#include "common/status_macros.h"
#include "kernels/cuda/cuda_status.h"

namespace pstrain::cuda {

cudnnDataType_t CudnnType(DataType dtype) {
  switch (dtype) {
    case DataType::kBF16:
      return CUDNN_DATA_BFLOAT16;
    case DataType::kF16:
      return CUDNN_DATA_HALF;
    case DataType::kF32:
    default:
      return CUDNN_DATA_FLOAT;
  }
}

cudnnTensorFormat_t CudnnFormat(TensorLayout layout) {
  return layout == TensorLayout::kNHWC ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
}

absl::StatusOr<TensorDescriptor> NewTensor4d(int n, int c, int h, int w, DataType dtype,
                                             TensorLayout layout) {
  PSTRAIN_ASSIGN_OR_RETURN(TensorDescriptor desc, TensorDescriptor::Create());
  PSTRAIN_RETURN_IF_CUDNN_ERROR(
      cudnnSetTensor4dDescriptor(desc.get(), CudnnFormat(layout), CudnnType(dtype), n, c, h, w));
  return desc;
}

}  // namespace pstrain::cuda
