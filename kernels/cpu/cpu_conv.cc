// Conv2dPlan on oneDNN: forward (optionally with bias), backward data and
// backward weights (+ bias) primitives, each either on the plain layouts the
// caller passes or on oneDNN's blocked layouts behind LayoutBridge reorders.
#include <omp.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/cpu/blocked_loops.h"
#include "kernels/cpu/cpu_plans.h"

namespace pstrain::cpu_internal {

absl::Status ValidateConv2dConfig(const Conv2dConfig& c) {
  if (c.n <= 0 || c.c <= 0 || c.h <= 0 || c.w <= 0 || c.filters <= 0 || c.kernel_h <= 0 ||
      c.kernel_w <= 0 || c.stride_h <= 0 || c.stride_w <= 0 || c.pad_h < 0 || c.pad_w < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Conv2d: sizes, kernel and stride must be positive and padding non-negative (n=", c.n,
        " c=", c.c, " h=", c.h, " w=", c.w, " filters=", c.filters, " kernel=", c.kernel_h, "x",
        c.kernel_w, " stride=", c.stride_h, "x", c.stride_w, " pad=", c.pad_h, "x", c.pad_w, ")"));
  }
  if (c.h + 2 * c.pad_h < c.kernel_h || c.w + 2 * c.pad_w < c.kernel_w) {
    return absl::InvalidArgumentError(absl::StrCat("Conv2d: kernel ", c.kernel_h, "x", c.kernel_w,
                                                   " larger than the padded input ",
                                                   c.h + 2 * c.pad_h, "x", c.w + 2 * c.pad_w));
  }
  return absl::OkStatus();
}

void VectorWidthChoice::Init(CpuVectorWidth width, bool avx512_available) {
  calls_ = 0;
  took_[0].clear();
  took_[1].clear();
  use_512_ = avx512_available && width == CpuVectorWidth::k512;
  trials_left_ = avx512_available && width == CpuVectorWidth::kMeasured ? 2 * kTrials : 0;
}

void VectorWidthChoice::Record(absl::Duration took) {
  if (trials_left_ == 0) return;
  took_[calls_ % 2].push_back(took);
  ++calls_;
  if (--trials_left_ > 0) return;
  for (std::vector<absl::Duration>& times : took_) {
    std::sort(times.begin(), times.end());
  }
  const absl::Duration median_256 = took_[0][kTrials / 2], median_512 = took_[1][kTrials / 2];
  use_512_ = median_512 < kMargin * median_256;
}

void WinogradPass::Init(const Conv2dConfig& c, Role role, CpuConvAlgorithm algorithm,
                        CpuVectorWidth width, const dnnl_memory_desc_t& first_md,
                        const dnnl_memory_desc_t& second_md, int num_threads) {
  config_ = c;
  role_ = role;
  const int first_lanes = ChannelBlock(first_md), second_lanes = ChannelBlock(second_md);
  enabled_ = algorithm == CpuConvAlgorithm::kAuto && WinogradApplies(c) && first_lanes != 0 &&
             second_lanes != 0;
  // In WinogradShape's terms: in -> out is x -> y forward, dy -> dx for
  // backward data.
  const bool backward_data = role == Role::kBackwardData;
  shape_ = {.n = c.n,
            .in_channels = backward_data ? c.filters : c.c,
            .out_channels = backward_data ? c.c : c.filters,
            .h = c.h,
            .w = c.w,
            .in_lanes = first_lanes,
            .out_lanes = second_lanes,
            .num_threads = num_threads};
  width_.Init(width);
}

absl::Status WinogradPass::Run(const float* w, const float* bias, dnnl_memory_t in,
                               dnnl_memory_t out, absl::string_view what) {
  void* in_data = nullptr;
  void* out_data = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_memory_get_data_handle(in, &in_data), what);
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_memory_get_data_handle(out, &out_data), what);
  WinogradFilters(config_, w, role_ == Role::kBackwardData, shape_.num_threads, &filters_);
  shape_.avx512 = width_.NextIs512();
  const absl::Time start = absl::Now();
  WinogradConv5x5(shape_, static_cast<const float*>(in_data), filters_, bias,
                  static_cast<float*>(out_data));
  width_.Record(absl::Now() - start);
  return absl::OkStatus();
}

void WinogradWeightGradPass::Init(const Conv2dConfig& c, CpuConvAlgorithm algorithm,
                                  CpuVectorWidth width, const dnnl_memory_desc_t& x_md,
                                  const dnnl_memory_desc_t& dy_md, int num_threads) {
  const int x_lanes = ChannelBlock(x_md), dy_lanes = ChannelBlock(dy_md);
  enabled_ = algorithm == CpuConvAlgorithm::kAuto && WinogradWeightGradApplies(c) && x_lanes != 0 &&
             dy_lanes != 0;
  shape_ = {.n = c.n,
            .in_channels = c.c,
            .out_channels = c.filters,
            .h = c.h,
            .w = c.w,
            .in_lanes = x_lanes,
            .out_lanes = dy_lanes,
            .num_threads = num_threads};
  width_.Init(width);
}

absl::Status WinogradWeightGradPass::Run(dnnl_memory_t x, dnnl_memory_t dy, float* dw, float* dbias,
                                         absl::string_view what) {
  void* x_data = nullptr;
  void* dy_data = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_memory_get_data_handle(x, &x_data), what);
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_memory_get_data_handle(dy, &dy_data), what);
  shape_.avx512 = width_.NextIs512();
  const absl::Time start = absl::Now();
  WinogradWeightGrad5x5(shape_, static_cast<const float*>(x_data),
                        static_cast<const float*>(dy_data), dw, dbias, &scratch_);
  width_.Record(absl::Now() - start);
  return absl::OkStatus();
}

namespace {

// kAuto runs every primitive blocked. Measured with bench/cpu_ops_bench on
// the 2-core AVX-512 machine (quiet, 2 threads, fmnist-cnn, batch 64), the
// blocked direct kernels, reorders included, against plain im2col + GEMM:
// conv2 forward 2.50 vs 4.92 ms, backward data 2.47 vs 5.29, backward filter
// 2.69 vs 4.99; conv1 forward 0.52 vs 0.50, backward filter 0.42 vs 1.42.
// Under CPU contention plain fell much further behind (conv1 backward filter
// >200 ms), so no shape is routed to it.
bool UseBlocked(CpuConvLayout layout) { return layout != CpuConvLayout::kPlain; }

class CpuConv2dPlan final : public Conv2dPlan {
 public:
  CpuConv2dPlan(std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& config, bool blocked,
                CpuConvAlgorithm algorithm, CpuVectorWidth width, int num_threads)
      : ctx_(std::move(ctx)),
        config_(config),
        blocked_(blocked),
        algorithm_(algorithm),
        width_(width),
        num_threads_(num_threads) {}

  absl::Status Init() {
    const Conv2dConfig& c = config_;
    PSTRAIN_ASSIGN_OR_RETURN(user_src_, PlainDesc({c.n, c.c, c.h, c.w}, dnnl_nchw));
    PSTRAIN_ASSIGN_OR_RETURN(user_weights_,
                             PlainDesc({c.filters, c.c, c.kernel_h, c.kernel_w}, dnnl_oihw));
    PSTRAIN_ASSIGN_OR_RETURN(user_dst_, PlainDesc({c.n, c.filters, c.out_h(), c.out_w()}, dnnl_nchw));
    PSTRAIN_ASSIGN_OR_RETURN(user_bias_, PlainDesc({c.filters}, dnnl_a));
    dnnl_format_tag_t act_tag = blocked_ ? dnnl_format_tag_any : dnnl_nchw;
    dnnl_format_tag_t w_tag = blocked_ ? dnnl_format_tag_any : dnnl_oihw;
    PSTRAIN_ASSIGN_OR_RETURN(any_src_, PlainDesc({c.n, c.c, c.h, c.w}, act_tag));
    PSTRAIN_ASSIGN_OR_RETURN(any_weights_,
                             PlainDesc({c.filters, c.c, c.kernel_h, c.kernel_w}, w_tag));
    PSTRAIN_ASSIGN_OR_RETURN(any_dst_, PlainDesc({c.n, c.filters, c.out_h(), c.out_w()}, act_tag));
    // The forward primitive with bias is also the hint for both backward ones.
    PSTRAIN_RETURN_IF_ERROR(BuildForward(/*with_bias=*/true));
    return absl::OkStatus();
  }

  absl::Status Forward(const void* x, const void* w, const void* bias, void* y) override {
    return ForwardF32(AsF32(x), AsF32(w), AsF32(bias), AsF32(y));
  }
  absl::Status BackwardData(const void* dy, const void* w, void* dx) override {
    return RunBackwardData(AsF32(dy), AsF32(w), AsF32(dx), /*converted_dy=*/nullptr);
  }
  absl::Status BackwardFilter(const void* x, const void* dy, void* dw, void* dbias) override {
    return RunBackwardFilter(AsF32(x), AsF32(dy), AsF32(dw), AsF32(dbias),
                             /*converted_dy=*/nullptr);
  }
  absl::Status Backward(const void* x, const void* dy, const void* w, void* dx, void* dw,
                        void* dbias) override {
    return BackwardF32(AsF32(x), AsF32(dy), AsF32(w), AsF32(dx), AsF32(dw), AsF32(dbias));
  }

 private:
  absl::Status ForwardF32(const float* x, const float* w, const float* bias, float* y) {
    if (x == nullptr || w == nullptr || y == nullptr) {
      return absl::InvalidArgumentError("Conv2d.Forward: x, w and y must be non-null");
    }
    SetThreads();
    const bool with_bias = bias != nullptr;
    if (!forward_[with_bias].primitive) PSTRAIN_RETURN_IF_ERROR(BuildForward(with_bias));
    ForwardStep& f = forward_[with_bias];
    std::vector<dnnl_exec_arg_t> args;
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t src, f.src.In(*ctx_, x));
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t dst, f.dst.OutTarget(y));
    if (f.winograd.enabled()) {
      PSTRAIN_RETURN_IF_ERROR(f.winograd.Run(w, bias, src, dst, "Conv2d.Forward"));
      return f.dst.OutFinish(*ctx_);
    }
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t weights, f.weights.In(*ctx_, w));
    args = {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}};
    if (with_bias) {
      PSTRAIN_RETURN_IF_ERROR(Bind(f.bias, bias, "Conv2d.Forward"));
      args.push_back({DNNL_ARG_BIAS, f.bias.get()});
    }
    PSTRAIN_RETURN_IF_ERROR(f.primitive.Execute(*ctx_, args, "Conv2d.Forward"));
    return f.dst.OutFinish(*ctx_);
  }

  // dy goes through one reorder into the blocked layout, not two, when both
  // primitives read it in the same layout (they do: both follow the forward
  // hint). Measured with bench/cpu_ops_bench: 0.35 ms of a 27 ms step.
  absl::Status BackwardF32(const float* x, const float* dy, const float* w, float* dx, float* dw,
                           float* dbias) {
    dnnl_memory_t converted_dy = nullptr;
    PSTRAIN_RETURN_IF_ERROR(RunBackwardFilter(x, dy, dw, dbias, &converted_dy));
    if (dx == nullptr) return absl::OkStatus();
    if (!backward_data_.primitive) PSTRAIN_RETURN_IF_ERROR(BuildBackwardData());
    const bool same_layout =
        dnnl_memory_desc_equal(&backward_data_.primitive.Md(dnnl_query_diff_dst_md),
                               &backward_weights_[dbias != nullptr].primitive.Md(
                                   dnnl_query_diff_dst_md)) != 0;
    return RunBackwardData(dy, w, dx, same_layout ? converted_dy : nullptr);
  }

  // `converted_dy`: dy already in the primitive's layout (from the filter
  // pass), or nullptr to convert it here.
  absl::Status RunBackwardData(const float* dy, const float* w, float* dx,
                               dnnl_memory_t converted_dy) {
    if (dy == nullptr || w == nullptr || dx == nullptr) {
      return absl::InvalidArgumentError("Conv2d.BackwardData: dy, w and dx must be non-null");
    }
    SetThreads();
    if (!backward_data_.primitive) PSTRAIN_RETURN_IF_ERROR(BuildBackwardData());
    BackwardDataStep& b = backward_data_;
    dnnl_memory_t diff_dst = converted_dy;
    if (diff_dst == nullptr) {
      PSTRAIN_ASSIGN_OR_RETURN(diff_dst, b.diff_dst.In(*ctx_, dy));
    }
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t diff_src, b.diff_src.OutTarget(dx));
    if (b.winograd.enabled()) {
      PSTRAIN_RETURN_IF_ERROR(
          b.winograd.Run(w, nullptr, diff_dst, diff_src, "Conv2d.BackwardData"));
      return b.diff_src.OutFinish(*ctx_);
    }
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t weights, b.weights.In(*ctx_, w));
    PSTRAIN_RETURN_IF_ERROR(b.primitive.Execute(
        *ctx_,
        {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DIFF_SRC, diff_src}},
        "Conv2d.BackwardData"));
    return b.diff_src.OutFinish(*ctx_);
  }

  // Stores in *converted_dy (unless nullptr) the dy memory the primitive
  // read, valid until the next call on this plan.
  absl::Status RunBackwardFilter(const float* x, const float* dy, float* dw, float* dbias,
                                 dnnl_memory_t* converted_dy) {
    if (x == nullptr || dy == nullptr || dw == nullptr) {
      return absl::InvalidArgumentError("Conv2d.BackwardFilter: x, dy and dw must be non-null");
    }
    SetThreads();
    const bool with_bias = dbias != nullptr;
    if (!backward_weights_[with_bias].primitive) {
      PSTRAIN_RETURN_IF_ERROR(BuildBackwardWeights(with_bias));
    }
    BackwardWeightsStep& b = backward_weights_[with_bias];
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t diff_dst, b.diff_dst.In(*ctx_, dy));
    if (converted_dy != nullptr) *converted_dy = diff_dst;
    if (b.own_lanes != 0) {
      void* blocked_dy = nullptr;
      PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_memory_get_data_handle(diff_dst, &blocked_dy),
                                   "Conv2d.BackwardFilter");
      OneChannelConvWeightGrad(config_, b.own_lanes, num_threads_, x,
                               static_cast<const float*>(blocked_dy), dw, dbias, &b.scratch);
      return absl::OkStatus();
    }
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t src, b.src.In(*ctx_, x));
    if (b.winograd.enabled()) {
      return b.winograd.Run(src, diff_dst, dw, dbias, "Conv2d.BackwardFilter");
    }
    PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t diff_weights, b.diff_weights.OutTarget(dw));
    std::vector<dnnl_exec_arg_t> args = {
        {DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_DIFF_WEIGHTS, diff_weights}};
    if (with_bias) {
      PSTRAIN_ASSIGN_OR_RETURN(dnnl_memory_t diff_bias, b.diff_bias.OutTarget(dbias));
      args.push_back({DNNL_ARG_DIFF_BIAS, diff_bias});
    }
    PSTRAIN_RETURN_IF_ERROR(b.primitive.Execute(*ctx_, args, "Conv2d.BackwardFilter"));
    PSTRAIN_RETURN_IF_ERROR(b.diff_weights.OutFinish(*ctx_));
    if (with_bias) PSTRAIN_RETURN_IF_ERROR(b.diff_bias.OutFinish(*ctx_));
    return absl::OkStatus();
  }

  struct ForwardStep {
    DnnlPrimitive primitive;
    LayoutBridge src, weights, dst;
    WinogradPass winograd;  // Runs instead of the primitive when enabled.
    DnnlMemory bias;
  };
  struct BackwardDataStep {
    DnnlPrimitive primitive;
    LayoutBridge diff_dst, weights, diff_src;
    WinogradPass winograd;  // Runs instead of the primitive when enabled.
  };
  struct BackwardWeightsStep {
    DnnlPrimitive primitive;
    LayoutBridge src, diff_dst, diff_weights, diff_bias;
    WinogradWeightGradPass winograd;  // Runs instead of the primitive when enabled.
    // Where blocked_loops.h computes the gradient instead of the primitive
    // (one input channel, dy blocked): the channels per block of dy, else 0.
    int own_lanes = 0;
    std::vector<float> scratch;
  };

  void SetThreads() const { omp_set_num_threads(num_threads_); }

  void Geometry(dnnl_dims_t strides, dnnl_dims_t padding) const {
    strides[0] = config_.stride_h;
    strides[1] = config_.stride_w;
    padding[0] = config_.pad_h;
    padding[1] = config_.pad_w;
  }

  absl::Status BuildForward(bool with_bias) {
    dnnl_dims_t strides, padding;
    Geometry(strides, padding);
    dnnl_convolution_desc_t desc;
    PSTRAIN_RETURN_IF_DNNL_ERROR(
        dnnl_convolution_forward_desc_init(&desc, dnnl_forward_training, dnnl_convolution_direct,
                                           &any_src_, &any_weights_,
                                           with_bias ? &user_bias_ : nullptr, &any_dst_, strides,
                                           padding, padding),
        "Conv2d.Forward");
    PSTRAIN_ASSIGN_OR_RETURN(DnnlPrimitiveDesc pd,
                             CreatePrimitiveDesc(&desc, *ctx_, nullptr, "Conv2d.Forward"));
    ForwardStep& f = forward_[with_bias];
    PSTRAIN_ASSIGN_OR_RETURN(f.primitive, DnnlPrimitive::Create(std::move(pd), "Conv2d.Forward"));
    PSTRAIN_ASSIGN_OR_RETURN(f.src, LayoutBridge::Create(*ctx_, user_src_,
                                                         f.primitive.Md(dnnl_query_src_md),
                                                         /*to_primitive=*/true, "Conv2d.Forward"));
    PSTRAIN_ASSIGN_OR_RETURN(
        f.weights, LayoutBridge::Create(*ctx_, user_weights_, f.primitive.Md(dnnl_query_weights_md),
                                        /*to_primitive=*/true, "Conv2d.Forward"));
    PSTRAIN_ASSIGN_OR_RETURN(f.dst, LayoutBridge::Create(*ctx_, user_dst_,
                                                         f.primitive.Md(dnnl_query_dst_md),
                                                         /*to_primitive=*/false, "Conv2d.Forward"));
    if (with_bias) {
      PSTRAIN_ASSIGN_OR_RETURN(
          f.bias, CreateMemory(f.primitive.Md(dnnl_query_weights_md, 1), *ctx_, false,
                               "Conv2d.Forward"));
    }
    f.winograd.Init(config_, WinogradPass::Role::kForward, algorithm_, width_,
                    f.primitive.Md(dnnl_query_src_md), f.primitive.Md(dnnl_query_dst_md),
                    num_threads_);
    return absl::OkStatus();
  }

  absl::Status BuildBackwardData() {
    dnnl_dims_t strides, padding;
    Geometry(strides, padding);
    dnnl_convolution_desc_t desc;
    PSTRAIN_RETURN_IF_DNNL_ERROR(
        dnnl_convolution_backward_data_desc_init(&desc, dnnl_convolution_direct, &any_src_,
                                                 &any_weights_, &any_dst_, strides, padding,
                                                 padding),
        "Conv2d.BackwardData");
    PSTRAIN_ASSIGN_OR_RETURN(
        DnnlPrimitiveDesc pd,
        CreatePrimitiveDesc(&desc, *ctx_, forward_[1].primitive.desc(), "Conv2d.BackwardData"));
    BackwardDataStep& b = backward_data_;
    PSTRAIN_ASSIGN_OR_RETURN(b.primitive,
                             DnnlPrimitive::Create(std::move(pd), "Conv2d.BackwardData"));
    PSTRAIN_ASSIGN_OR_RETURN(
        b.diff_dst, LayoutBridge::Create(*ctx_, user_dst_, b.primitive.Md(dnnl_query_diff_dst_md),
                                         /*to_primitive=*/true, "Conv2d.BackwardData"));
    PSTRAIN_ASSIGN_OR_RETURN(
        b.weights, LayoutBridge::Create(*ctx_, user_weights_, b.primitive.Md(dnnl_query_weights_md),
                                        /*to_primitive=*/true, "Conv2d.BackwardData"));
    PSTRAIN_ASSIGN_OR_RETURN(
        b.diff_src, LayoutBridge::Create(*ctx_, user_src_, b.primitive.Md(dnnl_query_diff_src_md),
                                         /*to_primitive=*/false, "Conv2d.BackwardData"));
    b.winograd.Init(config_, WinogradPass::Role::kBackwardData, algorithm_, width_,
                    b.primitive.Md(dnnl_query_diff_dst_md), b.primitive.Md(dnnl_query_diff_src_md),
                    num_threads_);
    return absl::OkStatus();
  }

  absl::Status BuildBackwardWeights(bool with_bias) {
    dnnl_dims_t strides, padding;
    Geometry(strides, padding);
    dnnl_convolution_desc_t desc;
    PSTRAIN_RETURN_IF_DNNL_ERROR(
        dnnl_convolution_backward_weights_desc_init(&desc, dnnl_convolution_direct, &any_src_,
                                                    &any_weights_,
                                                    with_bias ? &user_bias_ : nullptr, &any_dst_,
                                                    strides, padding, padding),
        "Conv2d.BackwardFilter");
    PSTRAIN_ASSIGN_OR_RETURN(
        DnnlPrimitiveDesc pd,
        CreatePrimitiveDesc(&desc, *ctx_, forward_[1].primitive.desc(), "Conv2d.BackwardFilter"));
    BackwardWeightsStep& b = backward_weights_[with_bias];
    PSTRAIN_ASSIGN_OR_RETURN(b.primitive,
                             DnnlPrimitive::Create(std::move(pd), "Conv2d.BackwardFilter"));
    PSTRAIN_ASSIGN_OR_RETURN(
        b.diff_dst, LayoutBridge::Create(*ctx_, user_dst_, b.primitive.Md(dnnl_query_diff_dst_md),
                                         /*to_primitive=*/true, "Conv2d.BackwardFilter"));
    // oneDNN's AVX2 kernel pads one input channel to eight (see
    // blocked_loops.h); the fused plan makes the same choice, so that both
    // give the same bits.
    if (OneChannelConvWeightGradApplies(config_)) {
      b.own_lanes = ChannelBlock(b.primitive.Md(dnnl_query_diff_dst_md));
      if (b.own_lanes != 0) return absl::OkStatus();
    }
    PSTRAIN_ASSIGN_OR_RETURN(
        b.src, LayoutBridge::Create(*ctx_, user_src_, b.primitive.Md(dnnl_query_src_md),
                                    /*to_primitive=*/true, "Conv2d.BackwardFilter"));
    b.winograd.Init(config_, algorithm_, width_, b.primitive.Md(dnnl_query_src_md),
                    b.primitive.Md(dnnl_query_diff_dst_md), num_threads_);
    PSTRAIN_ASSIGN_OR_RETURN(
        b.diff_weights,
        LayoutBridge::Create(*ctx_, user_weights_, b.primitive.Md(dnnl_query_diff_weights_md),
                             /*to_primitive=*/false, "Conv2d.BackwardFilter"));
    if (with_bias) {
      PSTRAIN_ASSIGN_OR_RETURN(
          b.diff_bias,
          LayoutBridge::Create(*ctx_, user_bias_, b.primitive.Md(dnnl_query_diff_weights_md, 1),
                               /*to_primitive=*/false, "Conv2d.BackwardFilter"));
    }
    return absl::OkStatus();
  }

  // Constant after construction.
  const std::shared_ptr<DnnlContext> ctx_;
  const Conv2dConfig config_;
  const bool blocked_;
  const CpuConvAlgorithm algorithm_;
  const CpuVectorWidth width_;
  const int num_threads_;
  dnnl_memory_desc_t user_src_, user_weights_, user_dst_, user_bias_;
  dnnl_memory_desc_t any_src_, any_weights_, any_dst_;

  // Built on first use; index: with bias (1) or without (0).
  ForwardStep forward_[2];
  BackwardDataStep backward_data_;
  BackwardWeightsStep backward_weights_[2];
};

}  // namespace

absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateCpuConv2dPlan(
    std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& config, CpuConvLayout layout,
    CpuConvAlgorithm algorithm, CpuVectorWidth width, int num_threads) {
  PSTRAIN_RETURN_IF_ERROR(ValidateConv2dConfig(config));
  auto plan = std::make_unique<CpuConv2dPlan>(std::move(ctx), config, UseBlocked(layout), algorithm,
                                              width, num_threads);
  PSTRAIN_RETURN_IF_ERROR(plan->Init());
  return std::unique_ptr<Conv2dPlan>(std::move(plan));
}

}  // namespace pstrain::cpu_internal
