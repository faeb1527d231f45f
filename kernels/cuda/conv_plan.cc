#include "kernels/cuda/cudnn_plans.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/cuda/conv_algorithms.h"
#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/cudnn_util.h"

namespace pstrain::cuda {
namespace {

absl::Status CheckConvConfig(const Conv2dConfig& c) {
  if (c.n <= 0 || c.c <= 0 || c.h <= 0 || c.w <= 0 || c.filters <= 0 || c.kernel_h <= 0 ||
      c.kernel_w <= 0 || c.stride_h <= 0 || c.stride_w <= 0 || c.pad_h < 0 || c.pad_w < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CreateConv2d: sizes, kernel and strides must be positive and pads non-negative; got "
        "input [",
        c.n, ", ", c.c, ", ", c.h, ", ", c.w, "] filters ", c.filters, " kernel ", c.kernel_h, "x",
        c.kernel_w, " stride ", c.stride_h, "x", c.stride_w, " pad ", c.pad_h, "x", c.pad_w));
  }
  if (c.h + 2 * c.pad_h < c.kernel_h || c.w + 2 * c.pad_w < c.kernel_w) {
    return absl::InvalidArgumentError(absl::StrCat("CreateConv2d: kernel ", c.kernel_h, "x",
                                                   c.kernel_w, " larger than padded input ",
                                                   c.h + 2 * c.pad_h, "x", c.w + 2 * c.pad_w));
  }
  return absl::OkStatus();
}

// How a bf16 or fp16 plan runs one of its passes: cuDNN in the plan's type,
// cuDNN in fp32 between conversions, or pstrain's own kernel. fp32 plans
// always run kNative. Which routes compete is the backend's options'
// fp32_route and own_conv (CudnnConv2dPlan::ChooseRoutes): where measured
// faster (the default), never, or always (for the parity tests of a route).
enum class Route { kNative, kViaF32, kOwn };
const char* RouteName(Route route, DataType dtype) {
  switch (route) {
    case Route::kViaF32:
      return "fp32";
    case Route::kOwn:
      return "own";
    case Route::kNative:
    default:
      return DataTypeName(dtype);
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A convolution in cuDNN (see CreateCudnnConv2dPlan in cudnn_plans.h):
// cuDNN's descriptors and algorithms for the plan's type and, for bf16 and
// fp16, for fp32 and pstrain's own kernels' launch sizes, with the route
// each pass measured fastest; its workspaces and scratch buffers.
class CudnnConv2dPlan final : public Conv2dPlan {
 public:
  static absl::StatusOr<std::unique_ptr<Conv2dPlan>> Create(const CudnnContext& context,
                                                            const Conv2dConfig& config) {
    PSTRAIN_RETURN_IF_ERROR(CheckConvConfig(config));
    auto plan = std::unique_ptr<CudnnConv2dPlan>(new CudnnConv2dPlan(context, config));
    PSTRAIN_RETURN_IF_ERROR(plan->Init());
    return std::unique_ptr<Conv2dPlan>(std::move(plan));
  }

  absl::Status Forward(const void* x, const void* w, const void* bias, void* y) override {
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(context_.device_ordinal));
    PSTRAIN_RETURN_IF_ERROR(EnqueueForward(forward_route_, x, w, y));
    if (bias != nullptr) {
      const int64_t planes = int64_t{config_.n} * out_h_ * out_w_;
      PSTRAIN_RETURN_IF_ERROR(
          nhwc()
              ? LaunchAddBias(config_.dtype, y, bias, planes, config_.filters, 1, context_.stream)
              : LaunchAddBias(config_.dtype, y, bias, config_.n, config_.filters,
                              int64_t{out_h_} * out_w_, context_.stream));
    }
    return absl::OkStatus();
  }

  absl::Status BackwardData(const void* dy, const void* w, void* dx) override {
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(context_.device_ordinal));
    return EnqueueBackwardData(data_route_, dy, /*dy32=*/nullptr, w, dx);
  }

  absl::Status BackwardFilter(const void* x, const void* dy, void* dw, void* dbias) override {
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(context_.device_ordinal));
    return EnqueueBackwardFilter(filter_route_, context_.cudnn, context_.stream, workspace_, x, dy,
                                 /*dy32=*/nullptr, dw, dbias);
  }

  // With a side stream: the backward-filter pass (and the bias gradient)
  // there, the backward-data pass here, and the main stream waits for both,
  // so that what follows on it sees dw, dbias and dx as if they had run in
  // order. The side stream waits for everything enqueued before (x and dy
  // written, the buffers allocated, dy converted to fp32 for passes that
  // run in fp32).
  absl::Status Backward(const void* x, const void* dy, const void* w, void* dx, void* dw,
                        void* dbias) override {
    if (dx == nullptr || !fork_) return Conv2dPlan::Backward(x, dy, w, dx, dw, dbias);
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(context_.device_ordinal));
    const float* dy32 = nullptr;
    if (data_route_ == Route::kViaF32 || filter_route_ == Route::kViaF32) {
      PSTRAIN_RETURN_IF_ERROR(ToF32(dy, y_count(), &y32_, context_.stream));
      dy32 = static_cast<const float*>(y32_.data());
    }
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventRecord(fork_.get(), context_.stream));
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(context_.side_stream, fork_.get(), 0));
    absl::Status filter =
        EnqueueBackwardFilter(filter_route_, context_.side_cudnn, context_.side_stream,
                              side_workspace_, x, dy, dy32, dw, dbias);
    absl::Status data = EnqueueBackwardData(data_route_, dy, dy32, w, dx);
    // Joined even after a failure: nothing on the side stream may outlive
    // the main stream's view of it.
    const cudaError_t joined = cudaEventRecord(join_.get(), context_.side_stream);
    const cudaError_t waited = joined == cudaSuccess
                                   ? cudaStreamWaitEvent(context_.stream, join_.get(), 0)
                                   : cudaStreamSynchronize(context_.side_stream);
    PSTRAIN_RETURN_IF_ERROR(filter);
    PSTRAIN_RETURN_IF_ERROR(data);
    PSTRAIN_RETURN_IF_CUDA_ERROR(joined);
    PSTRAIN_RETURN_IF_CUDA_ERROR(waited);
    return absl::OkStatus();
  }

 private:
  CudnnConv2dPlan(const CudnnContext& context, const Conv2dConfig& config)
      : context_(context), config_(config), out_h_(config.out_h()), out_w_(config.out_w()) {}

  const CudaBackendOptions& options() const { return context_.options; }
  bool reduced() const { return config_.dtype != DataType::kF32; }
  bool nhwc() const { return config_.layout == TensorLayout::kNHWC; }
  bool concurrent() const {
    return context_.side_stream != nullptr && context_.side_cudnn != nullptr;
  }
  int64_t x_count() const { return int64_t{config_.n} * config_.c * config_.h * config_.w; }
  int64_t y_count() const { return int64_t{config_.n} * config_.filters * out_h_ * out_w_; }
  int64_t w_count() const {
    return int64_t{config_.filters} * config_.c * config_.kernel_h * config_.kernel_w;
  }

  // --- The passes ------------------------------------------------------------
  // A pass "via fp32" (bf16 and fp16 plans only; see ChooseRoutes) converts
  // its inputs to fp32 scratch buffers, runs cuDNN's fp32 algorithm, and
  // rounds its output to the plan's type once.

  // x (config dtype, `count` elements) into *f32, on `stream`.
  absl::Status ToF32(const void* x, int64_t count, DeviceBuffer* f32, cudaStream_t stream) {
    return LaunchConvert(config_.dtype, x, DataType::kF32, f32->data(), count, 1.f, nullptr,
                         stream);
  }
  absl::Status FromF32(const DeviceBuffer& f32, int64_t count, void* y, cudaStream_t stream) {
    return LaunchConvert(DataType::kF32, f32.data(), config_.dtype, y, count, 1.f, nullptr, stream);
  }

  // NHWC: cuDNN's channels-last kernels take the filter as [K, R, S, C];
  // w stays [K, C, R, S] outside the plan, so each pass that reads it
  // transposes it into w_t_ (main stream), and the backward-filter pass
  // writes dw_t_ and transposes that into dw (small: a layer's weights).
  absl::StatusOr<const void*> KernelWeights(const void* w) {
    if (!nhwc()) return w;
    PSTRAIN_RETURN_IF_ERROR(LaunchTranspose(config_.dtype, w, w_t_.data(), config_.filters,
                                            config_.c, int64_t{config_.kernel_h} * config_.kernel_w,
                                            context_.stream));
    return static_cast<const void*>(w_t_.data());
  }

  absl::Status EnqueueForward(Route route, const void* x, const void* w_kcrs, void* y) {
    PSTRAIN_ASSIGN_OR_RETURN(const void* w, KernelWeights(w_kcrs));
    // Own kernels need 16-byte aligned buffers (Backend::Allocate's always
    // are); any other pointer takes cuDNN's kernel in the plan's type.
    if (route == Route::kOwn && Aligned16(x) && Aligned16(y)) {
      return LaunchNarrowConvForward(config_, narrow_, x, w, y, context_.stream);
    }
    if (route != Route::kViaF32) {
      PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionForward(
          context_.cudnn, &kOne, native_.x.get(), x, native_.w.get(), w, native_.conv.get(),
          native_.forward, workspace_.data(), workspace_.bytes(), &kZero, native_.y.get(), y));
      return absl::OkStatus();
    }
    PSTRAIN_RETURN_IF_ERROR(ToF32(x, x_count(), &x32_, context_.stream));
    PSTRAIN_RETURN_IF_ERROR(ToF32(w, w_count(), &w32_, context_.stream));
    PSTRAIN_RETURN_IF_CUDNN_ERROR(
        cudnnConvolutionForward(context_.cudnn, &kOne, f32_.x.get(), x32_.data(), f32_.w.get(),
                                w32_.data(), f32_.conv.get(), f32_.forward, workspace_.data(),
                                workspace_.bytes(), &kZero, f32_.y.get(), y32_.data()));
    return FromF32(y32_, y_count(), y, context_.stream);
  }

  // On the main stream. `dy32`: dy already in fp32 (y32_), or null.
  absl::Status EnqueueBackwardData(Route route, const void* dy, const float* dy32,
                                   const void* w_kcrs, void* dx) {
    PSTRAIN_ASSIGN_OR_RETURN(const void* w, KernelWeights(w_kcrs));
    if (route != Route::kViaF32) {
      PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionBackwardData(
          context_.cudnn, &kOne, native_.w.get(), w, native_.y.get(), dy, native_.conv.get(),
          native_.backward_data, workspace_.data(), workspace_.bytes(), &kZero, native_.x.get(),
          dx));
      return absl::OkStatus();
    }
    if (dy32 == nullptr) {
      PSTRAIN_RETURN_IF_ERROR(ToF32(dy, y_count(), &y32_, context_.stream));
      dy32 = static_cast<const float*>(y32_.data());
    }
    PSTRAIN_RETURN_IF_ERROR(ToF32(w, w_count(), &w32_, context_.stream));
    PSTRAIN_RETURN_IF_CUDNN_ERROR(
        cudnnConvolutionBackwardData(context_.cudnn, &kOne, f32_.w.get(), w32_.data(), f32_.y.get(),
                                     dy32, f32_.conv.get(), f32_.backward_data, workspace_.data(),
                                     workspace_.bytes(), &kZero, f32_.x.get(), dx32_.data()));
    return FromF32(dx32_, x_count(), dx, context_.stream);
  }

  // On `stream` (the main one or the side one, with its handle and
  // workspace). Via fp32 it writes x32_ and dw32_, which nothing on the
  // other stream touches meanwhile.
  absl::Status EnqueueBackwardFilter(Route route, cudnnHandle_t cudnn, cudaStream_t stream,
                                     const DeviceBuffer& workspace, const void* x, const void* dy,
                                     const float* dy32, void* dw_kcrs, void* dbias) {
    if (route == Route::kOwn && Aligned16(x) && Aligned16(dy)) {
      // Writes dw as [K, C, R, S] itself: no transpose.
      PSTRAIN_RETURN_IF_ERROR(LaunchNarrowConvWeightGrad(
          config_, narrow_, x, dy, dw_kcrs, static_cast<float*>(narrow_scratch_.data()), stream));
      return EnqueueBiasGrad(dy, dbias, stream);
    }
    void* dw = nhwc() ? dw_t_.data() : dw_kcrs;
    if (route != Route::kViaF32) {
      PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionBackwardFilter(
          cudnn, &kOne, native_.x.get(), x, native_.y.get(), dy, native_.conv.get(),
          native_.backward_filter, workspace.data(), workspace.bytes(), &kZero, native_.w.get(),
          dw));
    } else {
      if (dy32 == nullptr) {
        PSTRAIN_RETURN_IF_ERROR(ToF32(dy, y_count(), &y32_, stream));
        dy32 = static_cast<const float*>(y32_.data());
      }
      PSTRAIN_RETURN_IF_ERROR(ToF32(x, x_count(), &x32_, stream));
      PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnConvolutionBackwardFilter(
          cudnn, &kOne, f32_.x.get(), x32_.data(), f32_.y.get(), dy32, f32_.conv.get(),
          f32_.backward_filter, workspace.data(), workspace.bytes(), &kZero, f32_.w.get(),
          dw32_.data()));
      PSTRAIN_RETURN_IF_ERROR(FromF32(dw32_, w_count(), dw, stream));
    }
    if (nhwc()) {
      PSTRAIN_RETURN_IF_ERROR(LaunchTranspose(config_.dtype, dw, dw_kcrs, config_.filters,
                                              int64_t{config_.kernel_h} * config_.kernel_w,
                                              config_.c, stream));
    }
    return EnqueueBiasGrad(dy, dbias, stream);
  }

  absl::Status EnqueueBiasGrad(const void* dy, void* dbias, cudaStream_t stream) {
    if (dbias != nullptr) {
      const int64_t planes = int64_t{config_.n} * out_h_ * out_w_;
      PSTRAIN_RETURN_IF_ERROR(
          nhwc() ? LaunchColumnSums(config_.dtype, dy, dbias, planes, config_.filters,
                                    static_cast<float*>(bias_scratch_.data()), stream)
                 : LaunchBiasGrad(config_.dtype, dy, dbias, config_.n, config_.filters,
                                  int64_t{out_h_} * out_w_, stream));
    }
    return absl::OkStatus();
  }

  // --- Set-up --------------------------------------------------------------------

  absl::Status Init() {
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(context_.device_ordinal));
    if (nhwc()) {
      Backend* b = context_.backend;
      const size_t w_bytes = w_count() * DataTypeBytes(config_.dtype);
      PSTRAIN_ASSIGN_OR_RETURN(w_t_, b->Allocate(w_bytes));
      PSTRAIN_ASSIGN_OR_RETURN(dw_t_, b->Allocate(w_bytes));
      PSTRAIN_ASSIGN_OR_RETURN(
          bias_scratch_, b->Allocate(ColumnSumScratchFloats(int64_t{config_.n} * out_h_ * out_w_,
                                                            config_.filters) *
                                     sizeof(float)));
    }
    PSTRAIN_RETURN_IF_ERROR(MakeSetup(config_.dtype, &native_));
    if (reduced() && options().own_conv != CudaRoutePolicy::kNever &&
        options().fp32_route != CudaRoutePolicy::kAlways) {
      PSTRAIN_ASSIGN_OR_RETURN(narrow_, NarrowConvLaunchGrids(config_, context_.device_ordinal));
      const bool unlaunchable =
          (NarrowConvForwardSupported(config_) && narrow_.forward_blocks <= 0) ||
          (NarrowConvWeightGradSupported(config_) && narrow_.filter_blocks <= 0);
      if (unlaunchable && options().own_conv == CudaRoutePolicy::kAlways) {
        return absl::InternalError(
            "CreateConv2d: own_conv=always (--cuda-own-conv), but the own kernels cannot be "
            "launched on this device");
      }
    }
    if (reduced() && options().fp32_route != CudaRoutePolicy::kNever) {
      PSTRAIN_RETURN_IF_ERROR(MakeSetup(DataType::kF32, &f32_));
    }
    if (reduced() && (f32_.x || narrow_.forward_blocks > 0 || narrow_.filter_blocks > 0)) {
      PSTRAIN_RETURN_IF_ERROR(ChooseRoutes());
    }
    PSTRAIN_RETURN_IF_ERROR(AllocateWorkspaces());
    if (concurrent()) {
      PSTRAIN_ASSIGN_OR_RETURN(fork_, CudaEvent::Create());
      PSTRAIN_ASSIGN_OR_RETURN(join_, CudaEvent::Create());
    }
    return absl::OkStatus();
  }

  // Descriptors for `dtype`, and the algorithms measured fastest for them.
  absl::Status MakeSetup(DataType dtype, ConvSetup* setup) {
    const Conv2dConfig& c = config_;
    PSTRAIN_ASSIGN_OR_RETURN(setup->x, NewTensor4d(c.n, c.c, c.h, c.w, dtype, c.layout));
    PSTRAIN_ASSIGN_OR_RETURN(setup->w, FilterDescriptor::Create());
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnSetFilter4dDescriptor(setup->w.get(), CudnnType(dtype),
                                                             CudnnFormat(c.layout), c.filters, c.c,
                                                             c.kernel_h, c.kernel_w));
    PSTRAIN_ASSIGN_OR_RETURN(setup->conv, ConvolutionDescriptor::Create());
    // fp32 accumulation for every data type (cuDNN's PSEUDO_HALF and
    // PSEUDO_BFLOAT16 configurations for bf16 and fp16).
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolution2dDescriptor(
        setup->conv.get(), c.pad_h, c.pad_w, c.stride_h, c.stride_w, /*dilation_h=*/1,
        /*dilation_w=*/1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    // fp32: FMA only, as TF32 would put the results ~1e-3 away from the
    // CPU's. bf16 and fp16: tensor cores.
    const bool tensor_ops = dtype != DataType::kF32;
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnSetConvolutionMathType(
        setup->conv.get(), tensor_ops ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH));

    int n = 0, k = 0, p = 0, q = 0;
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolution2dForwardOutputDim(
        setup->conv.get(), setup->x.get(), setup->w.get(), &n, &k, &p, &q));
    if (n != c.n || k != c.filters || p != out_h_ || q != out_w_) {
      return absl::InternalError(absl::StrCat("CreateConv2d: cuDNN output [", n, ", ", k, ", ", p,
                                              ", ", q, "] differs from the expected [", c.n, ", ",
                                              c.filters, ", ", out_h_, ", ", out_w_, "]"));
    }
    PSTRAIN_ASSIGN_OR_RETURN(setup->y,
                             NewTensor4d(c.n, c.filters, out_h_, out_w_, dtype, c.layout));
    return ChooseConvAlgorithms(context_.cudnn, context_.options, tensor_ops, setup);
  }

  // Workspace bytes of each pass's cuDNN algorithm, native or via fp32. An
  // own kernel's pass counts the native one's, which runs when a caller's
  // buffers are not aligned for the own kernel.
  absl::StatusOr<size_t> ForwardBytes(Route route) {
    const ConvSetup& s = route == Route::kViaF32 ? f32_ : native_;
    size_t bytes = 0;
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionForwardWorkspaceSize(
        context_.cudnn, s.x.get(), s.w.get(), s.conv.get(), s.y.get(), s.forward, &bytes));
    return bytes;
  }
  absl::StatusOr<size_t> BackwardDataBytes(Route route) {
    const ConvSetup& s = route == Route::kViaF32 ? f32_ : native_;
    size_t bytes = 0;
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardDataWorkspaceSize(
        context_.cudnn, s.w.get(), s.y.get(), s.conv.get(), s.x.get(), s.backward_data, &bytes));
    return bytes;
  }
  absl::StatusOr<size_t> BackwardFilterBytes(Route route) {
    const ConvSetup& s = route == Route::kViaF32 ? f32_ : native_;
    size_t bytes = 0;
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnGetConvolutionBackwardFilterWorkspaceSize(
        context_.cudnn, s.x.get(), s.y.get(), s.conv.get(), s.w.get(), s.backward_filter, &bytes));
    return bytes;
  }

  // The main workspace holds what the chosen passes that run on the main
  // stream need (all three without a side stream); the side workspace the
  // backward-filter pass's. With fp32 routes, the fp32 scratch buffers.
  absl::Status AllocateWorkspaces() {
    PSTRAIN_ASSIGN_OR_RETURN(const size_t fwd_bytes, ForwardBytes(forward_route_));
    PSTRAIN_ASSIGN_OR_RETURN(const size_t data_bytes, BackwardDataBytes(data_route_));
    PSTRAIN_ASSIGN_OR_RETURN(const size_t filter_bytes, BackwardFilterBytes(filter_route_));
    // BackwardFilter alone runs on the main stream too.
    const size_t bytes = std::max({fwd_bytes, data_bytes, filter_bytes});
    workspace_ = DeviceBuffer();
    side_workspace_ = DeviceBuffer();
    if (bytes > 0) {
      PSTRAIN_ASSIGN_OR_RETURN(workspace_, context_.backend->Allocate(bytes));
    }
    if (concurrent() && filter_bytes > 0) {
      PSTRAIN_ASSIGN_OR_RETURN(side_workspace_, context_.backend->Allocate(filter_bytes));
    }
    if (filter_route_ == Route::kOwn) {
      PSTRAIN_RETURN_IF_ERROR(AllocateNarrowScratch());
    } else {
      narrow_scratch_ = DeviceBuffer();
    }
    if (forward_route_ == Route::kViaF32 || data_route_ == Route::kViaF32 ||
        filter_route_ == Route::kViaF32) {
      PSTRAIN_RETURN_IF_ERROR(AllocateF32Scratch());
    } else {
      x32_ = DeviceBuffer();
      dx32_ = DeviceBuffer();
      y32_ = DeviceBuffer();
      w32_ = DeviceBuffer();
      dw32_ = DeviceBuffer();
    }
    return absl::OkStatus();
  }

  absl::Status AllocateNarrowScratch() {
    if (!narrow_scratch_.data() && narrow_.filter_scratch_floats > 0) {
      PSTRAIN_ASSIGN_OR_RETURN(narrow_scratch_, context_.backend->Allocate(
                                                    narrow_.filter_scratch_floats * sizeof(float)));
    }
    return absl::OkStatus();
  }

  absl::Status AllocateF32Scratch() {
    Backend* b = context_.backend;
    if (!x32_.data()) {
      PSTRAIN_ASSIGN_OR_RETURN(x32_, b->Allocate(x_count() * sizeof(float)));
    }
    if (!dx32_.data()) {
      PSTRAIN_ASSIGN_OR_RETURN(dx32_, b->Allocate(x_count() * sizeof(float)));
    }
    if (!y32_.data()) {
      PSTRAIN_ASSIGN_OR_RETURN(y32_, b->Allocate(y_count() * sizeof(float)));
    }
    if (!w32_.data()) {
      PSTRAIN_ASSIGN_OR_RETURN(w32_, b->Allocate(w_count() * sizeof(float)));
    }
    if (!dw32_.data()) {
      PSTRAIN_ASSIGN_OR_RETURN(dw32_, b->Allocate(w_count() * sizeof(float)));
    }
    return absl::OkStatus();
  }

  // ms per call of what `enqueue` puts on the main stream: one call to warm
  // up, then the mean of kTimingReps.
  template <typename Fn>
  absl::StatusOr<float> TimeOnStream(Fn&& enqueue) {
    constexpr int kTimingReps = 5;
    PSTRAIN_ASSIGN_OR_RETURN(CudaEvent start, CudaEvent::CreateTimed());
    PSTRAIN_ASSIGN_OR_RETURN(CudaEvent stop, CudaEvent::CreateTimed());
    PSTRAIN_RETURN_IF_ERROR(enqueue());
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventRecord(start.get(), context_.stream));
    for (int i = 0; i < kTimingReps; ++i) PSTRAIN_RETURN_IF_ERROR(enqueue());
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventRecord(stop.get(), context_.stream));
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(stop.get()));
    float ms = 0.f;
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    return ms / kTimingReps;
  }

  // bf16 and fp16: for each pass, times the reduced-type algorithm against
  // the fp32 route (conversions included) and against pstrain's own kernel
  // where one applies, on this shape and on buffers of small constant
  // values, and keeps the fastest. cuDNN's tensor-core algorithms are built
  // for NHWC; in NCHW some of their backward passes, strided 1x1 and 3x3
  // ones above all, run 5 to 20 times slower than fp32's, and at 16
  // channels even NHWC ones fill an H200 poorly (bench/gpu_layers_bench).
  // The fp32 route and the own kernels round once, at their output, so they
  // are at least as accurate.
  absl::Status ChooseRoutes() {
    const bool f32_allowed = static_cast<bool>(f32_.x);
    size_t bytes = 0;
    for (Route route : {Route::kNative, Route::kViaF32}) {
      if (route == Route::kViaF32 && !f32_allowed) continue;
      PSTRAIN_ASSIGN_OR_RETURN(const size_t fwd, ForwardBytes(route));
      PSTRAIN_ASSIGN_OR_RETURN(const size_t data, BackwardDataBytes(route));
      PSTRAIN_ASSIGN_OR_RETURN(const size_t filter, BackwardFilterBytes(route));
      bytes = std::max({bytes, fwd, data, filter});
    }
    Backend* b = context_.backend;
    if (bytes > 0) {
      PSTRAIN_ASSIGN_OR_RETURN(workspace_, b->Allocate(bytes));
    }
    if (f32_allowed) PSTRAIN_RETURN_IF_ERROR(AllocateF32Scratch());
    PSTRAIN_RETURN_IF_ERROR(AllocateNarrowScratch());
    const size_t element = DataTypeBytes(config_.dtype);
    PSTRAIN_ASSIGN_OR_RETURN(DeviceBuffer x, b->Allocate(x_count() * element));
    PSTRAIN_ASSIGN_OR_RETURN(DeviceBuffer y, b->Allocate(y_count() * element));
    PSTRAIN_ASSIGN_OR_RETURN(DeviceBuffer w, b->Allocate(w_count() * element));
    PSTRAIN_ASSIGN_OR_RETURN(DeviceBuffer dx, b->Allocate(x_count() * element));
    PSTRAIN_ASSIGN_OR_RETURN(DeviceBuffer dw, b->Allocate(w_count() * element));
    for (const DeviceBuffer* buffer : {&x, &y, &w}) {
      // Small non-zero values (0x3c3c: about 0.012 in bf16, 1.06 in fp16).
      PSTRAIN_RETURN_IF_CUDA_ERROR(
          cudaMemsetAsync(buffer->data(), 0x3c, buffer->bytes(), context_.stream));
    }
    // Times each route `pass` may take and returns the fastest. A route that
    // fails here (cuDNN without an fp32 algorithm for the layout) is not taken.
    auto fastest = [&](const char* pass, bool own_applies, auto&& run) -> absl::StatusOr<Route> {
      if (options().fp32_route == CudaRoutePolicy::kAlways) return Route::kViaF32;
      if (own_applies && options().own_conv == CudaRoutePolicy::kAlways) return Route::kOwn;
      auto time = [&](Route route) -> float {
        absl::StatusOr<float> ms = TimeOnStream([&] { return run(route); });
        if (ms.ok()) return *ms;
        (void)cudaStreamSynchronize(context_.stream);
        (void)cudaGetLastError();
        return -1.f;
      };
      PSTRAIN_ASSIGN_OR_RETURN(const float native_ms,
                               TimeOnStream([&] { return run(Route::kNative); }));
      const float f32_ms = f32_allowed ? time(Route::kViaF32) : -1.f;
      const float own_ms = own_applies ? time(Route::kOwn) : -1.f;
      Route best = Route::kNative;
      float best_ms = native_ms;
      if (f32_ms >= 0.f && f32_ms < best_ms) {
        best = Route::kViaF32;
        best_ms = f32_ms;
      }
      if (own_ms >= 0.f && own_ms < best_ms) best = Route::kOwn;
      if (options().log_conv_routes) {
        const Conv2dConfig& c = config_;
        auto shown = [](float ms) {
          return ms >= 0.f ? absl::StrFormat("%.4f ms", ms) : std::string("n/a");
        };
        std::fprintf(stderr,
                     "pstrain cudnn route: conv [%d, %d, %d, %d] -> %d filters %dx%d stride %d "
                     "%s %s %s: %s %.4f ms, via fp32 %s, own %s -> %s\n",
                     c.n, c.c, c.h, c.w, c.filters, c.kernel_h, c.kernel_w, c.stride_h,
                     DataTypeName(c.dtype), TensorLayoutName(c.layout), pass, DataTypeName(c.dtype),
                     native_ms, shown(f32_ms).c_str(), shown(own_ms).c_str(),
                     RouteName(best, c.dtype));
      }
      return best;
    };
    PSTRAIN_ASSIGN_OR_RETURN(forward_route_,
                             fastest("forward", narrow_.forward_blocks > 0, [&](Route route) {
                               return EnqueueForward(route, x.data(), w.data(), y.data());
                             }));
    PSTRAIN_ASSIGN_OR_RETURN(data_route_, fastest("backward data", false, [&](Route route) {
                               return EnqueueBackwardData(route, y.data(), nullptr, w.data(),
                                                          dx.data());
                             }));
    PSTRAIN_ASSIGN_OR_RETURN(
        filter_route_, fastest("backward filter", narrow_.filter_blocks > 0, [&](Route route) {
          return EnqueueBackwardFilter(route, context_.cudnn, context_.stream, workspace_, x.data(),
                                       y.data(), nullptr, dw.data(), nullptr);
        }));
    return absl::OkStatus();
  }

  // Constant after construction.
  const CudnnContext context_;
  const Conv2dConfig config_;
  const int out_h_;
  const int out_w_;
  ConvSetup native_;  // config_.dtype
  ConvSetup f32_;     // bf16 and fp16 plans that may route passes via fp32; else empty
  Route forward_route_ = Route::kNative;
  Route data_route_ = Route::kNative;
  Route filter_route_ = Route::kNative;
  // Own kernels' launch sizes (zero where they do not apply) and the
  // backward-filter pass's scratch (its stream) when it runs there.
  NarrowConvGrids narrow_;
  DeviceBuffer narrow_scratch_;
  // The passes that run on the main stream use workspace_ in its order.
  DeviceBuffer workspace_;
  // With a side stream (else empty): the backward-filter pass's workspace
  // there, and the events that order the two streams.
  DeviceBuffer side_workspace_;
  CudaEvent fork_;
  CudaEvent join_;
  // fp32 scratch of the passes that run via fp32 (else empty): x32_ and
  // dw32_ are the backward-filter pass's (on the side stream), dx32_ and
  // w32_ the backward-data pass's (main stream); y32_ holds y or dy.
  DeviceBuffer x32_;
  DeviceBuffer dx32_;
  DeviceBuffer y32_;
  DeviceBuffer w32_;
  DeviceBuffer dw32_;
  // NHWC only (else empty): w as [K, R, S, C] (main stream), the
  // backward-filter pass's dw before it is transposed back (its stream),
  // and the scratch of the bias gradient's column sums.
  DeviceBuffer w_t_;
  DeviceBuffer dw_t_;
  DeviceBuffer bias_scratch_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateCudnnConv2dPlan(const CudnnContext& context,
                                                                  const Conv2dConfig& config) {
  return CudnnConv2dPlan::Create(context, config);
}

}  // namespace pstrain::cuda
