// CUDA, cuBLAS and cuDNN error codes as absl::Status, with the failing call,
// file and line, so that no device error ever aborts the process.
//
//   absl::Status Copy(void* dst, const void* src, size_t bytes, cudaStream_t s) {
//     PSTRAIN_RETURN_IF_CUDA_ERROR(
//         cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
//     return absl::OkStatus();
//   }
//
// Codes: allocation failures are RESOURCE_EXHAUSTED, bad arguments
// INVALID_ARGUMENT, a missing driver or device FAILED_PRECONDITION, anything
// else (launch failures, illegal addresses, library internals) INTERNAL.
//
// Threads: every function here is thread-safe.
#ifndef PSTRAIN_KERNELS_CUDA_CUDA_STATUS_H_
#define PSTRAIN_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include "absl/status/status.h"

namespace pstrain::cuda {

// OK for cudaSuccess; otherwise a Status reading
// "<call> failed: <name> (<description>) at <file>:<line>".
absl::Status CudaErrorToStatus(cudaError_t error, const char* call, const char* file, int line);
absl::Status CublasErrorToStatus(cublasStatus_t status, const char* call, const char* file,
                                 int line);
absl::Status CudnnErrorToStatus(cudnnStatus_t status, const char* call, const char* file, int line);

// The status of the most recent kernel launch on this thread (it reads and
// clears cudaGetLastError), named after `op`. Every launcher calls it right
// after its <<<...>>>.
absl::Status CheckLaunch(const char* op, const char* file, int line);

}  // namespace pstrain::cuda

#define PSTRAIN_CUDA_STATUS_CHECK_(converter, expr)                                     \
  do {                                                                                  \
    ::absl::Status _pstrain_cuda_status = converter((expr), #expr, __FILE__, __LINE__); \
    if (!_pstrain_cuda_status.ok()) return _pstrain_cuda_status;                        \
  } while (0)

// Each evaluates `expr` once and returns a non-OK absl::Status from the
// enclosing function when it failed.
#define PSTRAIN_RETURN_IF_CUDA_ERROR(expr) \
  PSTRAIN_CUDA_STATUS_CHECK_(::pstrain::cuda::CudaErrorToStatus, expr)
#define PSTRAIN_RETURN_IF_CUBLAS_ERROR(expr) \
  PSTRAIN_CUDA_STATUS_CHECK_(::pstrain::cuda::CublasErrorToStatus, expr)
#define PSTRAIN_RETURN_IF_CUDNN_ERROR(expr) \
  PSTRAIN_CUDA_STATUS_CHECK_(::pstrain::cuda::CudnnErrorToStatus, expr)

// Returns from the enclosing function when the launch just made failed.
#define PSTRAIN_RETURN_IF_LAUNCH_FAILED(op)                                                       \
  do {                                                                                            \
    ::absl::Status _pstrain_launch_status = ::pstrain::cuda::CheckLaunch(op, __FILE__, __LINE__); \
    if (!_pstrain_launch_status.ok()) return _pstrain_launch_status;                              \
  } while (0)

#endif  // PSTRAIN_KERNELS_CUDA_CUDA_STATUS_H_
