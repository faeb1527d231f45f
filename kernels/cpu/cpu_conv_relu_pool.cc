// ConvReluPoolPlan on oneDNN: the convolution writes its blocked output, a
// oneDNN max-pool reads it there (recording each window's winner in its
// workspace), and only the pooled quarter is converted to NCHW. Backward
// converts the pooled gradient in, routes it through the pool's workspace
// straight into the blocked gradient the convolution's backward passes read.
//
// The ReLU runs on the pooled values (max-pooling commutes with it), and
// backward masks the pooled gradient where the pooled output is not positive
// before the pool routes it: the same bits as ReLU then pool (as in
// worker/model.h's ReLU + pool fusion), provided the pool sends each window's
// gradient to its first maximum, as the CPU pool plan does; the model test
// compares the two bit for bit.
//
// Measured with bench/cpu_ops_bench (fmnist-cnn, batch 64): the
// conversions of the convolution outputs and their gradients took 1.7 ms of
// a 27 ms step.
//
// Where the windows tile the output exactly (stride = window, no padding)
// and the convolution writes channels in blocks of 8 or 16 (oneDNN's AVX2 and
// AVX-512 layouts), the plan pools with loops of its own instead
// (blocked_loops.h): forward reads the blocks and writes the ReLU-ed maxima
// straight into the caller's NCHW y, and in training records each window's
// winner as a byte; backward reads the caller's dy and routes it by those
// bytes. No float workspace, no pooled buffer, and no conversions of y and
// dy. The weight gradient of a convolution with one input channel comes
// from there too; in a first layer (no dx) it makes the pool's gradient one
// sample at a time in its scratch instead of reading it from memory.
// On a 2-core Zen 3 (AVX2), oneDNN 2.6's pooling took 6.4 ms and that weight
// gradient 4.4 ms of a 57 ms step (see docs/BENCHMARKS.md).
#include <omp.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/blocked_loops.h"
#include "kernels/cpu/cpu_plans.h"

namespace pstrain::cpu_internal {
namespace {

// Elements are handed out to threads only when there are this many.
constexpr int64_t kParallelElements = int64_t{1} << 14;

// A reorder between a buffer the plan owns and the caller's plain one, a
// copy when the layouts agree.
class UserReorder {
 public:
  static absl::StatusOr<UserReorder> Create(const DnnlContext& ctx, const dnnl_memory_desc_t& from,
                                            const dnnl_memory_desc_t& to, bool user_is_from,
                                            absl::string_view what) {
    UserReorder r;
    r.user_is_from_ = user_is_from;
    PSTRAIN_ASSIGN_OR_RETURN(r.user_,
                             CreateMemory(user_is_from ? from : to, ctx, /*allocate=*/false, what));
    dnnl_primitive_desc_t pd = nullptr;
    PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_reorder_primitive_desc_create(&pd, &from, ctx.engine.get(),
                                                                    &to, ctx.engine.get(), nullptr),
                                 what);
    PSTRAIN_ASSIGN_OR_RETURN(r.reorder_, DnnlPrimitive::Create(DnnlPrimitiveDesc(pd), what));
    return r;
  }

  absl::Status Run(const DnnlContext& ctx, const DnnlMemory& owned, const void* user,
                   absl::string_view what) {
    PSTRAIN_RETURN_IF_ERROR(Bind(user_, user, what));
    dnnl_memory_t from = user_is_from_ ? user_.get() : owned.get();
    dnnl_memory_t to = user_is_from_ ? owned.get() : user_.get();
    return reorder_.Execute(ctx, {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}}, what);
  }

 private:
  DnnlMemory user_;
  DnnlPrimitive reorder_;
  bool user_is_from_ = true;
};

// The gradient of the convolution's output as one backward primitive reads
// it: the plan's buffer itself, or (when the primitive picked another
// layout, e.g. 8-channel blocks for an AVX2 kernel) a converted copy.
class GradientView {
 public:
  static absl::StatusOr<GradientView> Create(const DnnlContext& ctx, const DnnlMemory& gradient,
                                             const dnnl_memory_desc_t& have,
                                             const dnnl_memory_desc_t& want) {
    GradientView view;
    view.gradient_ = gradient.get();
    if (dnnl_memory_desc_equal(&have, &want)) return view;
    PSTRAIN_ASSIGN_OR_RETURN(view.converted_, CreateMemory(want, ctx, true, "ConvReluPool"));
    dnnl_primitive_desc_t pd = nullptr;
    PSTRAIN_RETURN_IF_DNNL_ERROR(
        dnnl_reorder_primitive_desc_create(&pd, &have, ctx.engine.get(), &want, ctx.engine.get(),
                                           nullptr),
        "ConvReluPool");
    PSTRAIN_ASSIGN_OR_RETURN(view.reorder_,
                             DnnlPrimitive::Create(DnnlPrimitiveDesc(pd), "ConvReluPool"));
    return view;
  }

  absl::StatusOr<dnnl_memory_t> Get(const DnnlContext& ctx) {
    if (!reorder_) return gradient_;
    PSTRAIN_RETURN_IF_ERROR(reorder_.Execute(
        ctx, {{DNNL_ARG_FROM, gradient_}, {DNNL_ARG_TO, converted_.get()}}, "ConvReluPool"));
    return converted_.get();
  }

 private:
  dnnl_memory_t gradient_ = nullptr;  // Owned by the plan.
  DnnlMemory converted_;
  DnnlPrimitive reorder_;
};

absl::StatusOr<float*> DataOf(const DnnlMemory& memory) {
  void* data = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_memory_get_data_handle(memory.get(), &data),
                               "ConvReluPool: buffer");
  return static_cast<float*>(data);
}

// oneDNN's answer for shapes it has no primitive for (or whose arguments it
// rejects in this combination) becomes UNIMPLEMENTED, which tells the model
// to run the ops one by one. Running out of memory stays an error: the ops
// one by one would need the same buffers.
absl::Status AsUnimplemented(const absl::Status& status) {
  if (status.ok() || absl::IsResourceExhausted(status)) return status;
  return absl::UnimplementedError(absl::StrCat("ConvReluPool: ", status.message()));
}

class CpuConvReluPoolPlan final : public ConvReluPoolPlan {
 public:
  CpuConvReluPoolPlan(std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& conv, bool with_bias,
                      const Pool2dConfig& pool, CpuConvAlgorithm algorithm, CpuVectorWidth width,
                      int num_threads)
      : ctx_(std::move(ctx)),
        conv_(conv),
        with_bias_(with_bias),
        pool_(pool),
        algorithm_(algorithm),
        width_(width),
        num_threads_(num_threads) {}

  absl::Status Init() {
    const Conv2dConfig& c = conv_;
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_desc_t user_src,
                             PlainDesc({c.n, c.c, c.h, c.w}, dnnl_nchw));
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_desc_t user_weights,
                             PlainDesc({c.filters, c.c, c.kernel_h, c.kernel_w}, dnnl_oihw));
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_desc_t user_bias, PlainDesc({c.filters}, dnnl_a));
    PSTRAIN_ASSIGN_OR_RETURN(
        dnnl_memory_desc_t user_pooled,
        PlainDesc({pool_.n, pool_.c, pool_.out_h(), pool_.out_w()}, dnnl_nchw));
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_desc_t any_src,
                             PlainDesc({c.n, c.c, c.h, c.w}, dnnl_format_tag_any));
    PSTRAIN_ASSIGN_OR_RETURN(
        dnnl_memory_desc_t any_weights,
        PlainDesc({c.filters, c.c, c.kernel_h, c.kernel_w}, dnnl_format_tag_any));
    PSTRAIN_ASSIGN_OR_RETURN(
        dnnl_memory_desc_t any_dst,
        PlainDesc({c.n, c.filters, c.out_h(), c.out_w()}, dnnl_format_tag_any));
    PSTRAIN_ASSIGN_OR_RETURN(
        dnnl_memory_desc_t any_pooled,
        PlainDesc({pool_.n, pool_.c, pool_.out_h(), pool_.out_w()}, dnnl_format_tag_any));
    dnnl_dims_t strides = {c.stride_h, c.stride_w}, padding = {c.pad_h, c.pad_w};
    const dnnl_memory_desc_t* bias_md = with_bias_ ? &user_bias : nullptr;

    // Convolution forward, in whatever layout oneDNN prefers.
    dnnl_convolution_desc_t conv_fwd;
    PSTRAIN_RETURN_IF_DNNL_ERROR(
        dnnl_convolution_forward_desc_init(&conv_fwd, dnnl_forward_training,
                                           dnnl_convolution_direct, &any_src, &any_weights, bias_md,
                                           &any_dst, strides, padding, padding),
        "ConvReluPool.Forward");
    PSTRAIN_ASSIGN_OR_RETURN(
        DnnlPrimitiveDesc conv_fwd_pd,
        CreatePrimitiveDesc(&conv_fwd, *ctx_, nullptr, "ConvReluPool.Forward"));
    PSTRAIN_ASSIGN_OR_RETURN(conv_fwd_,
                             DnnlPrimitive::Create(std::move(conv_fwd_pd), "ConvReluPool.Forward"));
    // The backward passes take the forward with bias as their hint, as the
    // convolution plan's do, so that they pick the same kernels.
    DnnlPrimitiveDesc hint_with_bias;
    if (!with_bias_) {
      dnnl_convolution_desc_t with_bias;
      PSTRAIN_RETURN_IF_DNNL_ERROR(
          dnnl_convolution_forward_desc_init(&with_bias, dnnl_forward_training,
                                             dnnl_convolution_direct, &any_src, &any_weights,
                                             &user_bias, &any_dst, strides, padding, padding),
          "ConvReluPool.Forward");
      PSTRAIN_ASSIGN_OR_RETURN(
          hint_with_bias, CreatePrimitiveDesc(&with_bias, *ctx_, nullptr, "ConvReluPool.Forward"));
    }
    const_dnnl_primitive_desc_t conv_hint = with_bias_ ? conv_fwd_.desc() : hint_with_bias.get();
    const dnnl_memory_desc_t conv_dst_md = conv_fwd_.Md(dnnl_query_dst_md);
    PSTRAIN_ASSIGN_OR_RETURN(src_,
                             LayoutBridge::Create(*ctx_, user_src, conv_fwd_.Md(dnnl_query_src_md),
                                                  /*to_primitive=*/true, "ConvReluPool"));
    PSTRAIN_ASSIGN_OR_RETURN(
        weights_, LayoutBridge::Create(*ctx_, user_weights, conv_fwd_.Md(dnnl_query_weights_md),
                                       /*to_primitive=*/true, "ConvReluPool"));
    if (with_bias_) {
      PSTRAIN_ASSIGN_OR_RETURN(bias_, CreateMemory(conv_fwd_.Md(dnnl_query_weights_md, 1), *ctx_,
                                                   /*allocate=*/false, "ConvReluPool"));
    }
    PSTRAIN_ASSIGN_OR_RETURN(conv_dst_, CreateMemory(conv_dst_md, *ctx_, true, "ConvReluPool"));

    lanes_ = ChannelBlock(conv_dst_md);
    blocked_pool_ = {.lanes = lanes_,
                     .n = pool_.n,
                     .channels = pool_.c,
                     .h = pool_.h,
                     .w = pool_.w,
                     .k = pool_.window,
                     .num_threads = num_threads_};
    own_pool_ = lanes_ != 0 && pool_.stride == pool_.window && pool_.pad == 0 &&
                BlockedPoolShapeIsValid(blocked_pool_);
    if (own_pool_) pool_winners_.resize(static_cast<size_t>(BlockedPoolWinnersSize(blocked_pool_)));
    own_weight_grad_ = lanes_ != 0 && OneChannelConvWeightGradApplies(conv_);
    weight_grad_through_pool_ = own_pool_ && own_weight_grad_ &&
                                OneChannelConvWeightGradThroughPoolApplies(conv_, blocked_pool_);
    // Winograd's weight gradient where the convolution plan would use it,
    // from x as the forward read it and the gradient where it lies.
    winograd_wgrad_.Init(c, algorithm_, width_, conv_fwd_.Md(dnnl_query_src_md), conv_dst_md,
                         num_threads_);
    if (!own_pool_) {
      PSTRAIN_RETURN_IF_ERROR(InitDnnlPool(conv_dst_md, user_pooled, any_pooled));
    }
    PSTRAIN_ASSIGN_OR_RETURN(d_conv_dst_, CreateMemory(conv_dst_md, *ctx_, true, "ConvReluPool"));

    // Convolution backward passes reading that gradient where it lies (the
    // weight gradient of one input channel: blocked_loops.h).
    if (!own_weight_grad_ && !winograd_wgrad_.enabled()) {
      dnnl_convolution_desc_t conv_bwd_w;
      PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_convolution_backward_weights_desc_init(
                                       &conv_bwd_w, dnnl_convolution_direct, &any_src, &any_weights,
                                       bias_md, &any_dst, strides, padding, padding),
                                   "ConvReluPool.Backward");
      PSTRAIN_ASSIGN_OR_RETURN(
          DnnlPrimitiveDesc conv_bwd_w_pd,
          CreatePrimitiveDesc(&conv_bwd_w, *ctx_, conv_hint, "ConvReluPool.Backward"));
      PSTRAIN_ASSIGN_OR_RETURN(
          conv_bwd_w_, DnnlPrimitive::Create(std::move(conv_bwd_w_pd), "ConvReluPool.Backward"));
      PSTRAIN_ASSIGN_OR_RETURN(d_conv_for_w_,
                               GradientView::Create(*ctx_, d_conv_dst_, conv_dst_md,
                                                    conv_bwd_w_.Md(dnnl_query_diff_dst_md)));
      const dnnl_memory_desc_t& bwd_src_md = conv_bwd_w_.Md(dnnl_query_src_md);
      reuse_forward_src_ =
          dnnl_memory_desc_equal(&bwd_src_md, &conv_fwd_.Md(dnnl_query_src_md)) != 0;
      PSTRAIN_ASSIGN_OR_RETURN(bwd_src_,
                               LayoutBridge::Create(*ctx_, user_src, bwd_src_md,
                                                    /*to_primitive=*/true, "ConvReluPool"));
      PSTRAIN_ASSIGN_OR_RETURN(
          d_weights_,
          LayoutBridge::Create(*ctx_, user_weights, conv_bwd_w_.Md(dnnl_query_diff_weights_md),
                               /*to_primitive=*/false, "ConvReluPool"));
      if (with_bias_) {
        PSTRAIN_ASSIGN_OR_RETURN(
            d_bias_,
            LayoutBridge::Create(*ctx_, user_bias, conv_bwd_w_.Md(dnnl_query_diff_weights_md, 1),
                                 /*to_primitive=*/false, "ConvReluPool"));
      }
    }
    dnnl_convolution_desc_t conv_bwd_d;
    PSTRAIN_RETURN_IF_DNNL_ERROR(
        dnnl_convolution_backward_data_desc_init(&conv_bwd_d, dnnl_convolution_direct, &any_src,
                                                 &any_weights, &any_dst, strides, padding, padding),
        "ConvReluPool.Backward");
    PSTRAIN_ASSIGN_OR_RETURN(
        DnnlPrimitiveDesc conv_bwd_d_pd,
        CreatePrimitiveDesc(&conv_bwd_d, *ctx_, conv_hint, "ConvReluPool.Backward"));
    PSTRAIN_ASSIGN_OR_RETURN(
        conv_bwd_d_, DnnlPrimitive::Create(std::move(conv_bwd_d_pd), "ConvReluPool.Backward"));
    PSTRAIN_ASSIGN_OR_RETURN(d_conv_for_d_,
                             GradientView::Create(*ctx_, d_conv_dst_, conv_dst_md,
                                                  conv_bwd_d_.Md(dnnl_query_diff_dst_md)));
    PSTRAIN_ASSIGN_OR_RETURN(
        bwd_weights_,
        LayoutBridge::Create(*ctx_, user_weights, conv_bwd_d_.Md(dnnl_query_weights_md),
                             /*to_primitive=*/true, "ConvReluPool"));
    PSTRAIN_ASSIGN_OR_RETURN(
        d_src_, LayoutBridge::Create(*ctx_, user_src, conv_bwd_d_.Md(dnnl_query_diff_src_md),
                                     /*to_primitive=*/false, "ConvReluPool"));
    // Winograd where the convolution plan would use it (cpu_plans.h), on the
    // same layouts: the forward from x as the primitive reads it into the
    // plan's blocked output, backward data from that output's gradient.
    winograd_fwd_.Init(c, WinogradPass::Role::kForward, algorithm_, width_,
                       conv_fwd_.Md(dnnl_query_src_md), conv_dst_md, num_threads_);
    winograd_bwd_.Init(c, WinogradPass::Role::kBackwardData, algorithm_, width_, conv_dst_md,
                       conv_bwd_d_.Md(dnnl_query_diff_src_md), num_threads_);
    return absl::OkStatus();
  }

  absl::Status Forward(const float* x, const float* w, const float* bias, float* y,
                       bool training) override {
    if (x == nullptr || w == nullptr || y == nullptr || (bias != nullptr) != with_bias_) {
      return absl::InvalidArgumentError(
          "ConvReluPool.Forward: x, w and y must be non-null, and bias exactly when the plan "
          "has one");
    }
    omp_set_num_threads(num_threads_);
    trained_x_ = nullptr;
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t src, src_.In(*ctx_, x));
    if (winograd_fwd_.enabled()) {
      PSTRAIN_RETURN_IF_ERROR(
          winograd_fwd_.Run(w, bias, src, conv_dst_.get(), "ConvReluPool.Forward"));
    } else {
      PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t weights, weights_.In(*ctx_, w));
      std::vector<dnnl_exec_arg_t> args = {
          {DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, conv_dst_.get()}};
      if (with_bias_) {
        PSTRAIN_RETURN_IF_ERROR(Bind(bias_, bias, "ConvReluPool.Forward"));
        args.push_back({DNNL_ARG_BIAS, bias_.get()});
      }
      PSTRAIN_RETURN_IF_ERROR(conv_fwd_.Execute(*ctx_, args, "ConvReluPool.Forward"));
    }
    if (own_pool_) {
      PSTRAIN_ASSIGN_OR_RETURN(const float* conv, DataOf(conv_dst_));
      BlockedMaxPoolReluForward(blocked_pool_, conv, y, training ? pool_winners_.data() : nullptr);
    } else {
      PSTRAIN_RETURN_IF_ERROR(DnnlPoolReluForward(y));
    }
    if (training) {
      trained_x_ = x;
      forward_src_ = src;
    }
    return absl::OkStatus();
  }

  absl::Status Backward(const float* x, const float* w, const float* dy, float* dx, float* dw,
                        float* dbias) override {
    if (x == nullptr || w == nullptr || dy == nullptr || dw == nullptr ||
        (dbias != nullptr) != with_bias_) {
      return absl::InvalidArgumentError(
          "ConvReluPool.Backward: x, w, dy and dw must be non-null, and dbias exactly when the "
          "plan has a bias");
    }
    if (x != trained_x_) {
      return absl::FailedPreconditionError(
          "ConvReluPool.Backward needs a training Forward of the same x first");
    }
    omp_set_num_threads(num_threads_);
    if (weight_grad_through_pool_ && dx == nullptr) {
      // The first layer: its gradient feeds only the weight gradient, which
      // makes it sample by sample where it stays in the cache.
      OneChannelConvWeightGradThroughPool(conv_, blocked_pool_, num_threads_, x,
                                          pool_winners_.data(), dy, dw, dbias,
                                          &weight_grad_scratch_);
      return absl::OkStatus();
    }
    if (own_pool_) {
      PSTRAIN_ASSIGN_OR_RETURN(float* d_conv, DataOf(d_conv_dst_));
      BlockedMaxPoolReluBackward(blocked_pool_, pool_winners_.data(), dy, d_conv);
    } else {
      PSTRAIN_RETURN_IF_ERROR(DnnlPoolReluBackward(dy));
    }
    return ConvBackward(x, w, dx, dw, dbias);
  }

 private:
  // oneDNN's max-pool on the convolution's layout, with a workspace, and the
  // conversions of the pooled output and its gradient.
  absl::Status InitDnnlPool(const dnnl_memory_desc_t& conv_dst_md,
                            const dnnl_memory_desc_t& user_pooled,
                            const dnnl_memory_desc_t& any_pooled) {
    // Max-pool forward on that layout, recording winners in its workspace.
    dnnl_dims_t pool_strides = {pool_.stride, pool_.stride};
    dnnl_dims_t kernel = {pool_.window, pool_.window}, dilation = {0, 0};
    dnnl_dims_t pad_l = {pool_.pad, pool_.pad};
    // oneDNN wants the right padding that makes its output size come out
    // exactly (windows past the end are dropped, as the pool plans do).
    dnnl_dims_t pad_r = {(pool_.out_h() - 1) * pool_.stride + pool_.window - pool_.h - pool_.pad,
                         (pool_.out_w() - 1) * pool_.stride + pool_.window - pool_.w - pool_.pad};
    if (pad_r[0] < 0 || pad_r[1] < 0) {
      return absl::UnimplementedError("ConvReluPool: the pool drops input rows or columns");
    }
    dnnl_pooling_v2_desc_t pool_fwd;
    PSTRAIN_RETURN_IF_DNNL_ERROR(
        dnnl_pooling_v2_forward_desc_init(&pool_fwd, dnnl_forward_training, dnnl_pooling_max,
                                          &conv_dst_md, &any_pooled, pool_strides, kernel, dilation,
                                          pad_l, pad_r),
        "ConvReluPool.Forward");
    PSTRAIN_ASSIGN_OR_RETURN(
        DnnlPrimitiveDesc pool_fwd_pd,
        CreatePrimitiveDesc(&pool_fwd, *ctx_, nullptr, "ConvReluPool.Forward"));
    PSTRAIN_ASSIGN_OR_RETURN(pool_fwd_,
                             DnnlPrimitive::Create(std::move(pool_fwd_pd), "ConvReluPool.Forward"));
    const dnnl_memory_desc_t pooled_md = pool_fwd_.Md(dnnl_query_dst_md);
    PSTRAIN_ASSIGN_OR_RETURN(pooled_, CreateMemory(pooled_md, *ctx_, true, "ConvReluPool"));
    PSTRAIN_ASSIGN_OR_RETURN(workspace_, CreateMemory(pool_fwd_.Md(dnnl_query_workspace_md), *ctx_,
                                                      true, "ConvReluPool"));
    PSTRAIN_ASSIGN_OR_RETURN(y_out_, UserReorder::Create(*ctx_, pooled_md, user_pooled,
                                                         /*user_is_from=*/false, "ConvReluPool"));
    pooled_count_ = static_cast<int64_t>(dnnl_memory_desc_get_size(&pooled_md) / sizeof(float));

    // Max-pool backward: the pooled gradient in, the blocked gradient of the
    // convolution's output out, in exactly the forward's layouts.
    dnnl_pooling_v2_desc_t pool_bwd;
    PSTRAIN_RETURN_IF_DNNL_ERROR(
        dnnl_pooling_v2_backward_desc_init(&pool_bwd, dnnl_pooling_max, &conv_dst_md, &pooled_md,
                                           pool_strides, kernel, dilation, pad_l, pad_r),
        "ConvReluPool.Backward");
    PSTRAIN_ASSIGN_OR_RETURN(
        DnnlPrimitiveDesc pool_bwd_pd,
        CreatePrimitiveDesc(&pool_bwd, *ctx_, pool_fwd_.desc(), "ConvReluPool.Backward"));
    PSTRAIN_ASSIGN_OR_RETURN(
        pool_bwd_, DnnlPrimitive::Create(std::move(pool_bwd_pd), "ConvReluPool.Backward"));
    PSTRAIN_ASSIGN_OR_RETURN(d_pooled_, CreateMemory(pooled_md, *ctx_, true, "ConvReluPool"));
    PSTRAIN_ASSIGN_OR_RETURN(dy_in_, UserReorder::Create(*ctx_, user_pooled, pooled_md,
                                                         /*user_is_from=*/true, "ConvReluPool"));
    return absl::OkStatus();
  }

  absl::Status DnnlPoolReluForward(float* y) {
    PSTRAIN_RETURN_IF_ERROR(pool_fwd_.Execute(*ctx_,
                                              {{DNNL_ARG_SRC, conv_dst_.get()},
                                               {DNNL_ARG_DST, pooled_.get()},
                                               {DNNL_ARG_WORKSPACE, workspace_.get()}},
                                              "ConvReluPool.Forward"));
    PSTRAIN_ASSIGN_OR_RETURN(float* pooled, DataOf(pooled_));
    const int64_t n = pooled_count_;
#pragma omp parallel for simd schedule(static) num_threads(num_threads_) if (n >= kParallelElements)
    for (int64_t i = 0; i < n; ++i) pooled[i] = pooled[i] > 0.f ? pooled[i] : 0.f;
    return y_out_.Run(*ctx_, pooled_, y, "ConvReluPool.Forward");
  }

  // ReLU's and the pool's backward through oneDNN's workspace, into the
  // gradient of the convolution's output.
  absl::Status DnnlPoolReluBackward(const float* dy) {
    PSTRAIN_RETURN_IF_ERROR(dy_in_.Run(*ctx_, d_pooled_, dy, "ConvReluPool.Backward"));
    // The ReLU's backward on the pooled values: nothing flows where the
    // pooled output (already ReLU-ed) is not positive.
    PSTRAIN_ASSIGN_OR_RETURN(float* d_pooled, DataOf(d_pooled_));
    PSTRAIN_ASSIGN_OR_RETURN(const float* pooled, DataOf(pooled_));
    const int64_t n = pooled_count_;
#pragma omp parallel for simd schedule(static) num_threads(num_threads_) if (n >= kParallelElements)
    for (int64_t i = 0; i < n; ++i) d_pooled[i] = pooled[i] > 0.f ? d_pooled[i] : 0.f;
    PSTRAIN_RETURN_IF_ERROR(pool_bwd_.Execute(*ctx_,
                                              {{DNNL_ARG_DIFF_DST, d_pooled_.get()},
                                               {DNNL_ARG_WORKSPACE, workspace_.get()},
                                               {DNNL_ARG_DIFF_SRC, d_conv_dst_.get()}},
                                              "ConvReluPool.Backward"));
    return absl::OkStatus();
  }

  absl::Status ConvBackward(const float* x, const float* w, float* dx, float* dw, float* dbias) {
    if (own_weight_grad_) {
      PSTRAIN_ASSIGN_OR_RETURN(const float* d_conv, DataOf(d_conv_dst_));
      OneChannelConvWeightGrad(conv_, lanes_, num_threads_, x, d_conv, dw, dbias,
                               &weight_grad_scratch_);
    } else if (winograd_wgrad_.enabled()) {
      PSTRAIN_RETURN_IF_ERROR(
          winograd_wgrad_.Run(forward_src_, d_conv_dst_.get(), dw, dbias, "ConvReluPool.Backward"));
    } else {
      PSTRAIN_RETURN_IF_ERROR(DnnlWeightGrad(x, dw, dbias));
    }
    if (dx == nullptr) return absl::OkStatus();

    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t d_src, d_src_.OutTarget(dx));
    if (winograd_bwd_.enabled()) {
      PSTRAIN_RETURN_IF_ERROR(
          winograd_bwd_.Run(w, nullptr, d_conv_dst_.get(), d_src, "ConvReluPool.Backward"));
      return d_src_.OutFinish(*ctx_);
    }
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t weights, bwd_weights_.In(*ctx_, w));
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t d_conv_d, d_conv_for_d_.Get(*ctx_));
    PSTRAIN_RETURN_IF_ERROR(conv_bwd_d_.Execute(
        *ctx_,
        {{DNNL_ARG_DIFF_DST, d_conv_d}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DIFF_SRC, d_src}},
        "ConvReluPool.Backward"));
    return d_src_.OutFinish(*ctx_);
  }

  absl::Status DnnlWeightGrad(const float* x, float* dw, float* dbias) {
    dnnl_memory_t src = forward_src_;
    if (!reuse_forward_src_) {
      PSTRAIN_ASSIGN_OR_RETURN(src, bwd_src_.In(*ctx_, x));
    }
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t d_weights, d_weights_.OutTarget(dw));
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t d_conv_w, d_conv_for_w_.Get(*ctx_));
    std::vector<dnnl_exec_arg_t> args = {
        {DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, d_conv_w}, {DNNL_ARG_DIFF_WEIGHTS, d_weights}};
    if (with_bias_) {
      PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t d_bias, d_bias_.OutTarget(dbias));
      args.push_back({DNNL_ARG_DIFF_BIAS, d_bias});
    }
    PSTRAIN_RETURN_IF_ERROR(conv_bwd_w_.Execute(*ctx_, args, "ConvReluPool.Backward"));
    PSTRAIN_RETURN_IF_ERROR(d_weights_.OutFinish(*ctx_));
    if (with_bias_) PSTRAIN_RETURN_IF_ERROR(d_bias_.OutFinish(*ctx_));
    return absl::OkStatus();
  }

  // Constant after construction.
  const std::shared_ptr<DnnlContext> ctx_;
  const Conv2dConfig conv_;
  const bool with_bias_;
  const Pool2dConfig pool_;
  const CpuConvAlgorithm algorithm_;
  const CpuVectorWidth width_;
  const int num_threads_;

  // Built by Init().
  DnnlPrimitive conv_fwd_, pool_fwd_, pool_bwd_, conv_bwd_w_, conv_bwd_d_;
  LayoutBridge src_, weights_, bwd_src_, d_weights_, d_bias_, bwd_weights_, d_src_;
  DnnlMemory bias_, conv_dst_, pooled_, workspace_, d_pooled_, d_conv_dst_;
  UserReorder y_out_, dy_in_;
  GradientView d_conv_for_w_, d_conv_for_d_;
  WinogradPass winograd_fwd_, winograd_bwd_;  // Run instead of conv_fwd_ and conv_bwd_d_.
  WinogradWeightGradPass winograd_wgrad_;     // Runs instead of conv_bwd_w_.
  int64_t pooled_count_ = 0;  // Floats in the pooled buffers (with layout padding).
  int lanes_ = 0;             // Channels per block of the convolution's output; 0: not blocked.
  BlockedPoolShape blocked_pool_;
  bool own_pool_ = false;         // blocked_loops.h's pool, else oneDNN's.
  std::vector<uint8_t> pool_winners_;  // Its winners, from the last training Forward.
  bool own_weight_grad_ = false;  // blocked_loops.h's weight gradient, else oneDNN's.
  // Both, and the weight gradient can read the pool's gradient as it is made.
  bool weight_grad_through_pool_ = false;
  std::vector<float> weight_grad_scratch_;
  bool reuse_forward_src_ = false;

  // From the last training Forward: its x, and x as the convolution read it.
  const float* trained_x_ = nullptr;
  dnnl_memory_t forward_src_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> CreateCpuConvReluPoolPlan(
    std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& conv, bool with_bias,
    const Pool2dConfig& pool, CpuConvAlgorithm algorithm, CpuVectorWidth width, int num_threads) {
  PSTRAIN_RETURN_IF_ERROR(ValidateConv2dConfig(conv));
  PSTRAIN_RETURN_IF_ERROR(ValidatePool2dConfig(pool));
  if (pool.mode != PoolMode::kMax || pool.n != conv.n || pool.c != conv.filters ||
      pool.h != conv.out_h() || pool.w != conv.out_w()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ConvReluPool: the pool must be a max-pool over the convolution's output [",
                     conv.n, ", ", conv.filters, ", ", conv.out_h(), ", ", conv.out_w(), "]"));
  }
  if (pool.stride < pool.window) {
    // Overlapping windows add up gradients in oneDNN's order, not the pool
    // plan's: close, but not the same bits.
    return absl::UnimplementedError("ConvReluPool: overlapping pool windows");
  }
  auto plan = std::make_unique<CpuConvReluPoolPlan>(std::move(ctx), conv, with_bias, pool,
                                                    algorithm, width, num_threads);
  PSTRAIN_RETURN_IF_ERROR(AsUnimplemented(plan->Init()));
  return std::unique_ptr<ConvReluPoolPlan>(std::move(plan));
}

}  // namespace pstrain::cpu_internal
