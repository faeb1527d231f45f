// Plans of the CUDA backend: convolution and pooling (cuDNN), batch norm
// (own kernels, or cuDNN). Internal to kernels/cuda/; the rest of pstrain
// reaches them through Backend::CreateConv2d / CreatePool2d /
// CreateBatchNorm.
//
//   CudnnContext context{backend, stream, cudnn_handle};
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

namespace pstrain::cuda {

// What a plan borrows from its backend. `backend` allocates the plan's
// workspace; `stream` is the one `cudnn` is bound to. `side_stream` and
// `side_cudnn` (bound to it), when not null, let a convolution's two backward
// passes run at once (ConcurrentConvBackward).
struct CudnnContext {
  Backend* backend = nullptr;
  cudaStream_t stream = nullptr;
  cudnnHandle_t cudnn = nullptr;
  int device_ordinal = 0;
  cudaStream_t side_stream = nullptr;
  cudnnHandle_t side_cudnn = nullptr;
};

// Whether Conv2dPlan::Backward runs the backward-filter pass on the side
// stream while the backward-data pass runs on the main one (they read the
// same dy and write different buffers, and neither fills the GPU on
// resnet-sized layers). On unless PSTRAIN_CUDNN_CONCURRENT_BACKWARD=0; the
// results are the same either way.
bool ConcurrentConvBackward();

// Largest workspace a convolution algorithm may ask for; algorithms that need
// more are passed over in favour of leaner ones.
inline constexpr size_t kMaxConvWorkspaceBytes = size_t{256} << 20;

// Convolution (cross-correlation, as in backend.h) with FMA math only (no
// TF32) and no Winograd transforms unless PSTRAIN_CUDNN_TRANSFORMS allows them
// (cudnn_plans.cc), so that results match the CPU backend to fp32 rounding.
// The forward, backward-data and backward-filter algorithms are chosen once,
// here, by timing each on this shape (cudnnFind*, as PyTorch's
// cudnn.benchmark does), the fastest winning unless a deterministic one is
// within 10% of it; the plan owns one workspace large enough for all three.
// bf16 and fp16 plans time each pass once more, against the same pass in
// fp32 between conversions and, where they apply, pstrain's own kernels
// (narrow_conv_kernels.cu), and keep the fastest route.
absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateCudnnConv2dPlan(const CudnnContext& context,
                                                                  const Conv2dConfig& config);

// Max pooling, or average pooling that excludes padding from the divisor.
absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreateCudnnPool2dPlan(const CudnnContext& context,
                                                                  const Pool2dConfig& config);

// Spatial batch norm (statistics per channel over N and spatial); the running
// variance is the unbiased one, exponential factor = config.momentum. Runs
// pstrain's kernels (batch_norm_kernels.cu), or cuDNN's batch norm when
// PSTRAIN_CUDNN_BATCHNORM=1 (NCHW plans only).
absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateBatchNormPlan(const CudnnContext& context,
                                                                   const BatchNormConfig& config);

}  // namespace pstrain::cuda

#endif  // PSTRAIN_KERNELS_CUDA_CUDNN_PLANS_H_
