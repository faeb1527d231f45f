#include "kernels/cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace pstrain::cuda {
namespace {

absl::StatusCode CudaCode(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidConfiguration:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::StatusCode CublasCode(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::StatusCode::kResourceExhausted;
    case CUBLAS_STATUS_INVALID_VALUE:
      return absl::StatusCode::kInvalidArgument;
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::StatusCode CudnnCode(cudnnStatus_t status) {
  if (status == CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED ||
      status == CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED) {
    return absl::StatusCode::kResourceExhausted;
  }
  switch (CUDNN_STATUS_CATEGORY(static_cast<int>(status))) {
    case CUDNN_STATUS_BAD_PARAM:
      return absl::StatusCode::kInvalidArgument;
    case CUDNN_STATUS_NOT_SUPPORTED:
    case CUDNN_STATUS_NOT_INITIALIZED:
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::Status CudaErrorToStatus(cudaError_t error, const char* call, const char* file, int line) {
  if (error == cudaSuccess) return absl::OkStatus();
  // Reset the thread's last-error slot, so that a later CheckLaunch does not
  // report this (already reported) error again. Sticky errors survive this.
  (void)cudaGetLastError();
  return absl::Status(CudaCode(error),
                      absl::StrCat(call, " failed: ", cudaGetErrorName(error), " (",
                                   cudaGetErrorString(error), ") at ", file, ":", line));
}

absl::Status CublasErrorToStatus(cublasStatus_t status, const char* call, const char* file,
                                 int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::Status(CublasCode(status),
                      absl::StrCat(call, " failed: ", cublasGetStatusName(status), " (",
                                   cublasGetStatusString(status), ") at ", file, ":", line));
}

absl::Status CudnnErrorToStatus(cudnnStatus_t status, const char* call, const char* file,
                                int line) {
  if (status == CUDNN_STATUS_SUCCESS) return absl::OkStatus();
  char detail[256] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  return absl::Status(CudnnCode(status),
                      absl::StrCat(call, " failed: ", cudnnGetErrorString(status),
                                   detail[0] != '\0' ? absl::StrCat(" (", detail, ")") : "", " at ",
                                   file, ":", line));
}

absl::Status CheckLaunch(const char* op, const char* file, int line) {
  cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::Status(CudaCode(error),
                      absl::StrCat(op, ": kernel launch failed: ", cudaGetErrorName(error), " (",
                                   cudaGetErrorString(error), ") at ", file, ":", line));
}

}  // namespace pstrain::cuda
