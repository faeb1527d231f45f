// The CUDA backend: cuDNN for convolution, pooling, batch norm and
// activations; cuBLAS for GEMM; own kernels (kernels/cuda/*.cu) for bias,
// dropout, loss and fused optimizer updates. Everything runs on one
// non-blocking stream owned by the backend.
//
//   if (CudaDeviceCount() > 0) {
//     PSTRAIN_ASSIGN_OR_RETURN(auto backend, CreateCudaBackend(0));
//   }
#ifndef PSTRAIN_KERNELS_CUDA_CUDA_BACKEND_H_
#define PSTRAIN_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace pstrain {

// Number of visible CUDA devices; 0 when there is no driver or no GPU (never
// an error, so that CPU-only machines run the same binary).
int CudaDeviceCount();

// Creates a backend on device `ordinal`. Fails with a Status (never aborts)
// when the device, cuBLAS or cuDNN cannot be initialised.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int ordinal);

}  // namespace pstrain

#endif  // PSTRAIN_KERNELS_CUDA_CUDA_BACKEND_H_
