// Plans of the CUDA backend, one file each: convolution (conv_plan.cc, its
// algorithm choice in conv_algorithms.cc), pooling (pool_plan.cc), batch norm
// (batch_norm_plan.cc: own kernels, or cuDNN); helpers they share in
// cudnn_util.h. Internal to kernels/cuda/; the rest of pstrain reaches them
// through Backend::CreateConv2d / CreatePool2d / CreateBatchNorm. How they
// choose is the backend's CudaBackendOptions, carried in the context.
//
//   CudnnContext context{backend, stream, cudnn_handle, ordinal};
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Conv2dPlan> conv,
//                            CreateCudnnConv2dPlan(context, config));
//   PSTRAIN_RETURN_IF_ERROR(conv->Forward(x, w, bias, y));
//
// Threads: like the Backend, a plan is used from one thread at a time; the
// backend (and its stream and cuDNN handle) must outlive every plan.
#ifndef PSTRAIN_KERNELS_CUDA_CUDNN_PLANS_H_
#define PSTRAIN_KERNELS_CUDA_CUDNN_PLANS_H_

#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend_options.h"

namespace pstrain::cuda {

// What a plan borrows from its backend, and the backend's options (a copy).
// `backend` allocates the plan's workspace; `stream` is the one `cudnn` is
// bound to. `side_stream` and `side_cudnn` (bound to it), when not null, let
// Conv2dPlan::Backward run the backward-filter pass on the side stream while
// the backward-data pass runs on the main one (they read the same dy and
// write different buffers, and neither fills the GPU on resnet-sized
// layers); the backend makes them when options.concurrent_conv_backward, and
// the results are the same either way.
struct CudnnContext {
  Backend* backend = nullptr;
  cudaStream_t stream = nullptr;
  cudnnHandle_t cudnn = nullptr;
  int device_ordinal = 0;
  cudaStream_t side_stream = nullptr;
  cudnnHandle_t side_cudnn = nullptr;
  CudaBackendOptions options;
};

// Largest workspace a convolution algorithm may ask for; algorithms that need
// more are passed over in favour of leaner ones.
inline constexpr size_t kMaxConvWorkspaceBytes = size_t{256} << 20;

// Convolution (cross-correlation, as in backend.h) with FMA math only (no
// TF32) and no Winograd transforms unless options.winograd_transforms allows
// them (conv_algorithms.h), so that results match the CPU backend to fp32
// rounding.
// The forward, backward-data and backward-filter algorithms are chosen once,
// here, by timing each on this shape (cudnnFind*, as PyTorch's
// cudnn.benchmark does), the fastest winning unless a deterministic one is
// within 10% of it; the plan owns one workspace large enough for all three.
// bf16 and fp16 plans time each pass once more, against the same pass in
// fp32 between conversions and, where they apply, pstrain's own kernels
// (narrow_conv_kernels.cu), and keep the fastest route (or the one
// options.fp32_route / options.own_conv force; options.log_conv_routes
// prints the times).
absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateCudnnConv2dPlan(const CudnnContext& context,
                                                                  const Conv2dConfig& config);

// Max pooling, or average pooling that excludes padding from the divisor.
absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreateCudnnPool2dPlan(const CudnnContext& context,
                                                                  const Pool2dConfig& config);

// Spatial batch norm (statistics per channel over N and spatial); the running
// variance is the unbiased one, exponential factor = config.momentum. Runs
// pstrain's kernels (batch_norm_kernels.cu), or cuDNN's batch norm when
// options.cudnn_batch_norm (NCHW plans only).
absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateBatchNormPlan(const CudnnContext& context,
                                                                   const BatchNormConfig& config);

}  // namespace pstrain::cuda

#endif  // PSTRAIN_KERNELS_CUDA_CUDNN_PLANS_H_
