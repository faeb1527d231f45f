// The CUDA backend: cuDNN for convolution and pooling; cuBLAS for GEMM; own
// kernels (kernels/cuda/*.cu) for batch norm, bias, activations (one launch, and
// leaky ReLU, which cuDNN lacks), dropout, loss and fused optimizer updates.
// Everything runs on one non-blocking stream owned by the backend.
//
// Beyond the contract in kernels/backend.h:
//  * fp32 math is plain fp32 (no TF32 in cuBLAS or cuDNN), so results match
//    the CPU backend to rounding (the parity tests ask for 1e-4 relative).
//  * bf16 and fp16 (SupportsDataType: both) run convolutions and GEMMs on
//    tensor cores with fp32 accumulation, and own kernels in fp32 with one
//    rounding per stored element; batch norm keeps fp32 scales and
//    statistics.
//  * Device memory comes from the stream-ordered pool (cudaMallocAsync) where
//    the device supports it; Free() is ordered on the stream.
//  * An out-of-range label in SoftmaxCrossEntropy cannot be seen on the host
//    when the op is enqueued: the op returns OK, that row's loss is NaN, and
//    the next Synchronize() returns INVALID_ARGUMENT naming the row and label
//    (once). Event::Wait() does not report it.
//
// This code is built into the module libpstrain_cuda.so (cuda_module.cc is
// its entry point) and reached by the rest of pstrain only through
// kernels/backend_loader.h, so that no other binary links CUDA:
//
//   std::string why;
//   if (CudaRuntimeDeviceCount(&why) > 0) {
//     PSTRAIN_ASSIGN_OR_RETURN(auto backend, CreateCudaBackend(0, CudaBackendOptions{}));
//   }
#ifndef PSTRAIN_KERNELS_CUDA_CUDA_BACKEND_H_
#define PSTRAIN_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend_options.h"

namespace pstrain {

// Number of visible CUDA devices; 0 when there is no driver or no GPU (never
// an error, so that CPU-only machines run the same binary), with the reason
// in *why unless why is null.
int CudaRuntimeDeviceCount(std::string* why);

// Creates a backend on device `ordinal` with `options`, which it and its
// plans keep for their lifetime. Fails with a Status (never aborts) when the
// device, cuBLAS or cuDNN cannot be initialised.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int ordinal,
                                                           const CudaBackendOptions& options);

}  // namespace pstrain

#endif  // PSTRAIN_KERNELS_CUDA_CUDA_BACKEND_H_
