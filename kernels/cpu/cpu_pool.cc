// Pool2dPlan on oneDNN pooling primitives over plain NCHW. Max pooling keeps
// oneDNN's workspace (the argmax) from the last training forward for Backward.
#include <omp.h>

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_plans.h"

namespace pstrain::cpu_internal {
namespace {

absl::Status ValidatePool2dConfig(const Pool2dConfig& c) {
  if (c.n <= 0 || c.c <= 0 || c.h <= 0 || c.w <= 0 || c.window <= 0 || c.stride <= 0 ||
      c.pad < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Pool2d: sizes, window and stride must be positive and padding non-negative (n=", c.n,
        " c=", c.c, " h=", c.h, " w=", c.w, " window=", c.window, " stride=", c.stride,
        " pad=", c.pad, ")"));
  }
  if (c.pad >= c.window) {
    return absl::InvalidArgumentError(
        absl::StrCat("Pool2d: pad ", c.pad, " must be smaller than the window ", c.window));
  }
  if (c.h + 2 * c.pad < c.window || c.w + 2 * c.pad < c.window) {
    return absl::InvalidArgumentError(absl::StrCat("Pool2d: window ", c.window,
                                                   " larger than the padded input ",
                                                   c.h + 2 * c.pad, "x", c.w + 2 * c.pad));
  }
  return absl::OkStatus();
}

class CpuPool2dPlan final : public Pool2dPlan {
 public:
  CpuPool2dPlan(std::shared_ptr<DnnlContext> ctx, const Pool2dConfig& config, int num_threads)
      : ctx_(std::move(ctx)), config_(config), num_threads_(num_threads) {}

  absl::Status Init() {
    const Pool2dConfig& c = config_;
    PSTRAIN_ASSIGN_OR_RETURN(src_md_, PlainDesc({c.n, c.c, c.h, c.w}, dnnl_nchw));
    PSTRAIN_ASSIGN_OR_RETURN(dst_md_, PlainDesc({c.n, c.c, c.out_h(), c.out_w()}, dnnl_nchw));
    algorithm_ = c.mode == PoolMode::kMax ? dnnl_pooling_max : dnnl_pooling_avg_exclude_padding;
    PSTRAIN_ASSIGN_OR_RETURN(training_, BuildForward(dnnl_forward_training));
    PSTRAIN_ASSIGN_OR_RETURN(src_, CreateMemory(src_md_, *ctx_, false, "Pool2d"));
    PSTRAIN_ASSIGN_OR_RETURN(dst_, CreateMemory(dst_md_, *ctx_, false, "Pool2d"));
    const dnnl_memory_desc_t& ws_md = training_.Md(dnnl_query_workspace_md);
    if (dnnl_memory_desc_get_size(&ws_md) > 0) {
      PSTRAIN_ASSIGN_OR_RETURN(workspace_, CreateMemory(ws_md, *ctx_, true, "Pool2d"));
    }

    dnnl_dims_t strides, kernel, padding;
    Geometry(strides, kernel, padding);
    dnnl_pooling_desc_t desc;
    PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_pooling_backward_desc_init(&desc, algorithm_, &src_md_,
                                                                 &dst_md_, strides, kernel,
                                                                 padding, padding),
                                 "Pool2d.Backward");
    PSTRAIN_ASSIGN_OR_RETURN(
        DnnlPrimitiveDesc pd,
        CreatePrimitiveDesc(&desc, *ctx_, training_.desc(), "Pool2d.Backward"));
    PSTRAIN_ASSIGN_OR_RETURN(backward_, DnnlPrimitive::Create(std::move(pd), "Pool2d.Backward"));
    return absl::OkStatus();
  }

  absl::Status Forward(const float* x, float* y, bool training) override {
    if (x == nullptr || y == nullptr) {
      return absl::InvalidArgumentError("Pool2d.Forward: x and y must be non-null");
    }
    omp_set_num_threads(num_threads_);
    PSTRAIN_RETURN_IF_ERROR(Bind(src_, x, "Pool2d.Forward"));
    PSTRAIN_RETURN_IF_ERROR(Bind(dst_, y, "Pool2d.Forward"));
    std::vector<dnnl_exec_arg_t> args = {{DNNL_ARG_SRC, src_.get()}, {DNNL_ARG_DST, dst_.get()}};
    if (!training) {
      if (!inference_) {
        PSTRAIN_ASSIGN_OR_RETURN(inference_, BuildForward(dnnl_forward_inference));
      }
      return inference_.Execute(*ctx_, args, "Pool2d.Forward");
    }
    if (workspace_) args.push_back({DNNL_ARG_WORKSPACE, workspace_.get()});
    PSTRAIN_RETURN_IF_ERROR(training_.Execute(*ctx_, args, "Pool2d.Forward"));
    has_training_forward_ = true;
    return absl::OkStatus();
  }

  absl::Status Backward(const float* x, const float* y, const float* dy, float* dx) override {
    if (dy == nullptr || dx == nullptr) {
      return absl::InvalidArgumentError("Pool2d.Backward: dy and dx must be non-null");
    }
    if (workspace_ && !has_training_forward_) {
      return absl::FailedPreconditionError(
          "Pool2d.Backward: max pooling needs a Forward(training=true) on this plan first");
    }
    omp_set_num_threads(num_threads_);
    PSTRAIN_RETURN_IF_ERROR(Bind(dst_, dy, "Pool2d.Backward"));
    PSTRAIN_RETURN_IF_ERROR(Bind(src_, dx, "Pool2d.Backward"));
    std::vector<dnnl_exec_arg_t> args = {{DNNL_ARG_DIFF_DST, dst_.get()},
                                         {DNNL_ARG_DIFF_SRC, src_.get()}};
    if (workspace_) args.push_back({DNNL_ARG_WORKSPACE, workspace_.get()});
    return backward_.Execute(*ctx_, args, "Pool2d.Backward");
  }

 private:
  void Geometry(dnnl_dims_t strides, dnnl_dims_t kernel, dnnl_dims_t padding) const {
    strides[0] = strides[1] = config_.stride;
    kernel[0] = kernel[1] = config_.window;
    padding[0] = padding[1] = config_.pad;
  }

  absl::StatusOr<DnnlPrimitive> BuildForward(dnnl_prop_kind_t prop) {
    dnnl_dims_t strides, kernel, padding;
    Geometry(strides, kernel, padding);
    dnnl_pooling_desc_t desc;
    PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_pooling_forward_desc_init(&desc, prop, algorithm_, &src_md_,
                                                                &dst_md_, strides, kernel,
                                                                padding, padding),
                                 "Pool2d.Forward");
    PSTRAIN_ASSIGN_OR_RETURN(DnnlPrimitiveDesc pd,
                             CreatePrimitiveDesc(&desc, *ctx_, nullptr, "Pool2d.Forward"));
    return DnnlPrimitive::Create(std::move(pd), "Pool2d.Forward");
  }

  // Constant after construction.
  const std::shared_ptr<DnnlContext> ctx_;
  const Pool2dConfig config_;
  const int num_threads_;
  dnnl_memory_desc_t src_md_, dst_md_;
  dnnl_alg_kind_t algorithm_ = dnnl_pooling_max;

  DnnlPrimitive training_, inference_, backward_;
  DnnlMemory src_, dst_;  // Bound to the caller's pointers per call.
  DnnlMemory workspace_;  // Max pooling only.
  bool has_training_forward_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreateCpuPool2dPlan(std::shared_ptr<DnnlContext> ctx,
                                                                const Pool2dConfig& config,
                                                                int num_threads) {
  PSTRAIN_RETURN_IF_ERROR(ValidatePool2dConfig(config));
  auto plan = std::make_unique<CpuPool2dPlan>(std::move(ctx), config, num_threads);
  PSTRAIN_RETURN_IF_ERROR(plan->Init());
  return std::unique_ptr<Pool2dPlan>(std::move(plan));
}

}  // namespace pstrain::cpu_internal
