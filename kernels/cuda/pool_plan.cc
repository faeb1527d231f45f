#include "kernels/cuda/cudnn_plans.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/cudnn_util.h"

namespace pstrain::cuda {
namespace {

// Pooling in cuDNN: max, or average that excludes padding from the divisor.
// The backward pass recomputes the argmax from x and y, so a plan keeps no
// state between the passes.
class CudnnPool2dPlan final : public Pool2dPlan {
 public:
  static absl::StatusOr<std::unique_ptr<Pool2dPlan>> Create(const CudnnContext& context,
                                                            const Pool2dConfig& config) {
    const Pool2dConfig& c = config;
    if (c.n <= 0 || c.c <= 0 || c.h <= 0 || c.w <= 0 || c.window <= 0 || c.stride <= 0 ||
        c.pad < 0 || c.pad >= c.window || c.h + 2 * c.pad < c.window ||
        c.w + 2 * c.pad < c.window) {
      return absl::InvalidArgumentError(absl::StrCat(
          "CreatePool2d: need positive sizes, window and stride, 0 <= pad < window and a window "
          "that fits the padded input; got input [",
          c.n, ", ", c.c, ", ", c.h, ", ", c.w, "] window ", c.window, " stride ", c.stride,
          " pad ", c.pad));
    }
    auto plan = std::unique_ptr<CudnnPool2dPlan>(new CudnnPool2dPlan(context, config));
    PSTRAIN_RETURN_IF_ERROR(plan->Init());
    return std::unique_ptr<Pool2dPlan>(std::move(plan));
  }

  absl::Status Forward(const void* x, void* y, bool training) override {
    // cuDNN's backward recomputes the argmax from x and y, so `training`
    // needs no extra state here.
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(context_.device_ordinal));
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnPoolingForward(context_.cudnn, pool_desc_.get(), &kOne,
                                                      x_desc_.get(), x, &kZero, y_desc_.get(), y));
    return absl::OkStatus();
  }

  absl::Status Backward(const void* x, const void* y, const void* dy, void* dx) override {
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(context_.device_ordinal));
    PSTRAIN_RETURN_IF_CUDNN_ERROR(
        cudnnPoolingBackward(context_.cudnn, pool_desc_.get(), &kOne, y_desc_.get(), y,
                             y_desc_.get(), dy, x_desc_.get(), x, &kZero, x_desc_.get(), dx));
    return absl::OkStatus();
  }

 private:
  CudnnPool2dPlan(const CudnnContext& context, const Pool2dConfig& config)
      : context_(context), config_(config) {}

  absl::Status Init() {
    const Pool2dConfig& c = config_;
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(context_.device_ordinal));
    PSTRAIN_ASSIGN_OR_RETURN(x_desc_, NewTensor4d(c.n, c.c, c.h, c.w, c.dtype, c.layout));
    PSTRAIN_ASSIGN_OR_RETURN(pool_desc_, PoolingDescriptor::Create());
    const cudnnPoolingMode_t mode =
        c.mode == PoolMode::kMax ? CUDNN_POOLING_MAX : CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING;
    PSTRAIN_RETURN_IF_CUDNN_ERROR(
        cudnnSetPooling2dDescriptor(pool_desc_.get(), mode, CUDNN_PROPAGATE_NAN, c.window, c.window,
                                    c.pad, c.pad, c.stride, c.stride));
    int n = 0, ch = 0, p = 0, q = 0;
    PSTRAIN_RETURN_IF_CUDNN_ERROR(
        cudnnGetPooling2dForwardOutputDim(pool_desc_.get(), x_desc_.get(), &n, &ch, &p, &q));
    if (n != c.n || ch != c.c || p != c.out_h() || q != c.out_w()) {
      return absl::InternalError(absl::StrCat("CreatePool2d: cuDNN output [", n, ", ", ch, ", ", p,
                                              ", ", q, "] differs from the expected [", c.n, ", ",
                                              c.c, ", ", c.out_h(), ", ", c.out_w(), "]"));
    }
    PSTRAIN_ASSIGN_OR_RETURN(y_desc_,
                             NewTensor4d(c.n, c.c, c.out_h(), c.out_w(), c.dtype, c.layout));
    return absl::OkStatus();
  }

  // Constant after construction.
  const CudnnContext context_;
  const Pool2dConfig config_;
  TensorDescriptor x_desc_;
  TensorDescriptor y_desc_;
  PoolingDescriptor pool_desc_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreateCudnnPool2dPlan(const CudnnContext& context,
                                                                  const Pool2dConfig& config) {
  return CudnnPool2dPlan::Create(context, config);
}

}  // namespace pstrain::cuda
