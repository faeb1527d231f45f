// Backend: the only seam that knows the device.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
//                            CreateBackend(*ParseDeviceSpec("auto")));
//   PSTRAIN_ASSIGN_OR_RETURN(Tensor x, backend->AllocateTensor(Shape{64, 784}));
//   PSTRAIN_RETURN_IF_ERROR(backend->CopyHostToDevice(x.data(), host, x.bytes()));
//   PSTRAIN_RETURN_IF_ERROR(backend->Gemm(false, true, 64, 10, 784, 1.f, x.data(),
//                                         w.data(), 0.f, y.data()));
//   PSTRAIN_RETURN_IF_ERROR(backend->Synchronize());
//
// Adding a backend: implement every pure virtual below in kernels/<dev>/,
// build it as a module (kernels/backend_module.h, as kernels/cuda/ does) or
// into pstrain_kernels, add a case to CreateBackend() in backend.cc, and add
// the device to the parity tests in tests/kernels/, which run every op
// against the CPU backend.
//
// Conventions for every op:
//  * Pointers are device pointers obtained from this backend (AllocateTensor,
//    Allocate) and hold fp32 unless stated otherwise; layouts are row-major,
//    images NCHW, convolution weights [K, C, R, S], dense weights [out, in].
//  * Ops are enqueued in order on the backend's stream and may return before
//    the device has finished (the CUDA backend does; the CPU backend runs them
//    synchronously). Host code that reads device memory calls CopyDeviceToHost
//    and then Synchronize(), or waits on an Event.
//  * Outputs are overwritten, never accumulated, unless the op says otherwise.
//  * Errors (bad arguments, CUDA/cuDNN/cuBLAS failures, allocation failure)
//    come back as a Status naming the op; no op aborts the process.
//
// Threads: a Backend and the plans it creates are used from one thread at a
// time (the trainer's thread). Event::Wait may be called from any thread.
#ifndef PSTRAIN_KERNELS_BACKEND_H_
#define PSTRAIN_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/shape.h"
#include "common/status_macros.h"

namespace pstrain {

enum class DeviceType { kCpu, kCuda };

// Element type of activations and of the parameter copies the ops read
// (mixed-precision training, ModelOptions::precision). Parameters the
// optimizer updates, gradients it reads, and batch-norm scales and
// statistics stay fp32 whatever the activations are.
enum class DataType {
  kF32,
  kBF16,  // bfloat16: fp32's range, 8 bits of mantissa.
  kF16,   // IEEE half: 11 bits of mantissa, largest finite 65504.
};
size_t DataTypeBytes(DataType dtype);
const char* DataTypeName(DataType dtype);  // "fp32", "bf16", "fp16".

// What `--device` asked for: "auto", "cpu", "cuda" or "cuda:N".
struct DeviceSpec {
  bool automatic = true;  // "auto": CUDA device 0 when present, else CPU.
  DeviceType type = DeviceType::kCpu;
  int ordinal = 0;  // CUDA device index.
};
absl::StatusOr<DeviceSpec> ParseDeviceSpec(std::string_view text);

class Backend;

// Owning handle to device memory allocated by a Backend. Move-only. The
// backend must outlive every buffer it allocated.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend* backend, void* ptr, size_t bytes)
      : backend_(backend), ptr_(ptr), bytes_(bytes) {}
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      backend_ = std::exchange(other.backend_, nullptr);
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  inline void Reset();

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Host memory the backend can copy from asynchronously (page-locked with
// cudaHostAlloc on CUDA; 64-byte aligned ordinary memory on the CPU).
// Move-only; the backend must outlive it.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(Backend* backend, void* ptr, size_t bytes)
      : backend_(backend), ptr_(ptr), bytes_(bytes) {}
  ~PinnedBuffer() { Reset(); }
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      backend_ = std::exchange(other.backend_, nullptr);
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  inline void Reset();

 private:
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A dense tensor in device memory, fp32 unless made with another DataType.
// data() is for fp32 tensors, raw() for any. Move-only.
class Tensor {
 public:
  Tensor() = default;
  Tensor(Shape shape, DeviceBuffer buffer, DataType dtype = DataType::kF32)
      : shape_(std::move(shape)), buffer_(std::move(buffer)), dtype_(dtype) {}

  const Shape& shape() const { return shape_; }
  DataType dtype() const { return dtype_; }
  int64_t num_elements() const { return shape_.num_elements(); }
  size_t bytes() const { return static_cast<size_t>(num_elements()) * DataTypeBytes(dtype_); }
  float* data() { return static_cast<float*>(buffer_.data()); }
  const float* data() const { return static_cast<const float*>(buffer_.data()); }
  void* raw() { return buffer_.data(); }
  const void* raw() const { return buffer_.data(); }
  bool empty() const { return buffer_.data() == nullptr; }

 private:
  Shape shape_;
  DeviceBuffer buffer_;
  DataType dtype_ = DataType::kF32;
};

// A point in the backend's stream. Wait() blocks the calling host thread until
// every op enqueued before the event was recorded has finished.
class Event {
 public:
  virtual ~Event() = default;
  virtual absl::Status Wait() = 0;
};

// Memory order of the 4-D activations a plan reads and writes. Shapes in
// the configs stay (n, c, h, w) either way. kNHWC (channels last) is what
// tensor-core convolutions are built for; a backend asks for it through
// Backend::ChannelsLast, and backends that do not support it refuse plans
// that ask for it.
enum class TensorLayout { kNCHW, kNHWC };
const char* TensorLayoutName(TensorLayout layout);  // "NCHW", "NHWC".

// ---------------------------------------------------------------------------
// Plans: per-shape state (cuDNN descriptors and algorithms, oneDNN primitives,
// workspaces). Create once per input shape and reuse every step.
// ---------------------------------------------------------------------------

struct Conv2dConfig {
  int n = 0, c = 0, h = 0, w = 0;  // Input NCHW.
  int filters = 0;                 // K.
  int kernel_h = 0, kernel_w = 0;  // R, S.
  int stride_h = 1, stride_w = 1;
  int pad_h = 0, pad_w = 0;
  // Of x, y, w, bias and their gradients. Reduced precision runs on tensor
  // cores with fp32 accumulation (backends that support it: SupportsDataType).
  DataType dtype = DataType::kF32;
  // Of x, y and their gradients; w and dw are [K, C, R, S] either way.
  TensorLayout layout = TensorLayout::kNCHW;
  int out_h() const { return (h + 2 * pad_h - kernel_h) / stride_h + 1; }
  int out_w() const { return (w + 2 * pad_w - kernel_w) / stride_w + 1; }
};

// Every pointer of a Conv2dPlan holds config.dtype elements.
class Conv2dPlan {
 public:
  virtual ~Conv2dPlan() = default;
  // y[n,k,p,q] = sum_{c,r,s} w[k,c,r,s] * x[n,c,p*sh-ph+r,q*sw-pw+s] + bias[k].
  // `bias` may be nullptr (no bias).
  virtual absl::Status Forward(const void* x, const void* w, const void* bias, void* y) = 0;
  // dx = gradient of the loss w.r.t. x, given dy and w.
  virtual absl::Status BackwardData(const void* dy, const void* w, void* dx) = 0;
  // dw, and dbias unless nullptr, given x and dy.
  virtual absl::Status BackwardFilter(const void* x, const void* dy, void* dw, void* dbias) = 0;
  // Both backward passes of one step: BackwardFilter, then BackwardData
  // unless dx is nullptr. A plan may share work between them (the CPU plan
  // converts dy to its internal layout once).
  virtual absl::Status Backward(const void* x, const void* dy, const void* w, void* dx, void* dw,
                                void* dbias) {
    absl::Status status = BackwardFilter(x, dy, dw, dbias);
    if (!status.ok() || dx == nullptr) return status;
    return BackwardData(dy, w, dx);
  }
};

enum class PoolMode {
  kMax,
  kAverage,  // Padding is excluded from the divisor.
};

struct Pool2dConfig {
  PoolMode mode = PoolMode::kMax;
  int n = 0, c = 0, h = 0, w = 0;  // Input NCHW.
  int window = 2, stride = 2, pad = 0;
  DataType dtype = DataType::kF32;  // Of x, y, dx and dy.
  TensorLayout layout = TensorLayout::kNCHW;
  int out_h() const { return (h + 2 * pad - window) / stride + 1; }
  int out_w() const { return (w + 2 * pad - window) / stride + 1; }
};

class Pool2dPlan {
 public:
  virtual ~Pool2dPlan() = default;
  // `training` lets the plan keep what Backward needs (e.g. argmax indices).
  virtual absl::Status Forward(const void* x, void* y, bool training) = 0;
  // Uses x and y of the most recent Forward(training=true) on this plan.
  virtual absl::Status Backward(const void* x, const void* y, const void* dy, void* dx) = 0;
};

// A convolution, a ReLU and a max-pool as one plan, for a backend that can
// keep the convolution's output in its own layout: the CPU keeps it in
// oneDNN's blocked layout, so that neither that output nor its gradient is
// converted to NCHW and back, and pools there. x and dx are the
// convolution's input and its gradient, y and dy the pool's output and its
// gradient, all NCHW. Results are those of the three ops one after another.
class ConvReluPoolPlan {
 public:
  virtual ~ConvReluPoolPlan() = default;
  // y = maxpool(relu(conv(x, w) + bias)); `bias` is nullptr exactly when the
  // plan was created without one. `training` keeps what Backward needs.
  virtual absl::Status Forward(const float* x, const float* w, const float* bias, float* y,
                               bool training) = 0;
  // Requires the most recent Forward to have been a training one with the
  // same x and w. dx may be nullptr (nobody needs it); dbias is nullptr
  // exactly when there is no bias.
  virtual absl::Status Backward(const float* x, const float* w, const float* dy, float* dx,
                                float* dw, float* dbias) = 0;
};

struct BatchNormConfig {
  int n = 0, c = 0, spatial = 1;  // Input [N, C, spatial...] (spatial = H*W, or 1).
  float epsilon = 1e-5f;
  float momentum = 0.1f;  // running = (1-momentum)*running + momentum*batch.
  // Of x, y, dx and dy; gamma, beta, the statistics and dgamma, dbeta are
  // fp32 whatever it is.
  DataType dtype = DataType::kF32;
  // kNHWC: x is [N, spatial, C] (the same as kNCHW when spatial is 1).
  TensorLayout layout = TensorLayout::kNCHW;
};

class BatchNormPlan {
 public:
  virtual ~BatchNormPlan() = default;
  // Normalises with batch statistics, updates running_mean/running_var (the
  // unbiased variance, as PyTorch and cuDNN do) in place, and saves the batch
  // mean and 1/sqrt(var+eps) for Backward.
  virtual absl::Status ForwardTraining(const void* x, const float* gamma, const float* beta,
                                       void* y, float* running_mean, float* running_var,
                                       float* save_mean, float* save_inv_std) = 0;
  virtual absl::Status ForwardInference(const void* x, const float* gamma, const float* beta,
                                        const float* running_mean, const float* running_var,
                                        void* y) = 0;
  virtual absl::Status Backward(const void* x, const void* dy, const float* gamma,
                                const float* save_mean, const float* save_inv_std, void* dx,
                                float* dgamma, float* dbeta) = 0;
};

enum class Activation { kRelu, kLeakyRelu, kTanh, kSigmoid };

// Optimizer hyper-parameters for one update call (the learning rate already
// comes from the schedule).
struct SgdHyper {
  float learning_rate = 0.01f;
  float momentum = 0.f;       // 0: plain SGD, velocity unused (may be nullptr).
  bool nesterov = false;
  float weight_decay = 0.f;   // L2: g += weight_decay * p.
};
struct AdamHyper {
  float learning_rate = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-8f;
  float weight_decay = 0.f;
  bool decoupled_weight_decay = false;  // AdamW: p -= lr * wd * p.
  int64_t step = 1;                     // 1-based step, for bias correction.
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual DeviceType type() const = 0;
  // Human-readable, e.g. "cpu (oneDNN 2.6.3, 2 threads)" or "cuda:0 (NVIDIA H100)".
  virtual std::string Describe() const = 0;
  // "cpu" or "cuda:N", as reported in job results.
  virtual std::string DeviceName() const = 0;

  // --- Memory ------------------------------------------------------------
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  absl::StatusOr<Tensor> AllocateTensor(const Shape& shape, DataType dtype = DataType::kF32);
  virtual absl::StatusOr<PinnedBuffer> AllocatePinned(size_t bytes) = 0;
  // Called by DeviceBuffer / PinnedBuffer; not for direct use.
  virtual void Free(void* ptr) = 0;
  virtual void FreePinned(void* ptr) = 0;

  // Copies are ordered with ops on the stream. A host source must stay valid
  // (and unmodified) until the next Synchronize() or a later event's Wait().
  virtual absl::Status CopyHostToDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) = 0;
  // Blocks until every enqueued op has finished; reports asynchronous errors.
  virtual absl::Status Synchronize() = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> RecordEvent() = 0;

  // --- Dense linear algebra ------------------------------------------------
  // C[m,n] = alpha * op(A)[m,k] * op(B)[k,n] + beta * C, all row-major and
  // tightly packed (A is [m,k], or [k,m] when trans_a; B is [k,n], or [n,k]
  // when trans_b).
  virtual absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                            float alpha, const float* a, const float* b, float beta,
                            float* c) = 0;
  // y[o, ch, i] += bias[ch] for y viewed as [outer, channels, inner].
  virtual absl::Status AddBias(float* y, const float* bias, int64_t outer, int64_t channels,
                               int64_t inner) = 0;
  // dbias[ch] = sum over outer and inner of dy[o, ch, i].
  virtual absl::Status BiasGrad(const float* dy, float* dbias, int64_t outer, int64_t channels,
                                int64_t inner) = 0;

  // --- Plans -----------------------------------------------------------------
  virtual absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateConv2d(const Conv2dConfig& config) = 0;
  virtual absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreatePool2d(const Pool2dConfig& config) = 0;
  virtual absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateBatchNorm(
      const BatchNormConfig& config) = 0;
  // Optional. `pool` must be a max-pool over the convolution's output
  // shape. UNIMPLEMENTED (the default, and the CPU backend's answer for
  // shapes it does not fuse) means: run the three ops instead.
  virtual absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> CreateConvReluPool(
      const Conv2dConfig& conv, bool with_bias, const Pool2dConfig& pool) {
    return absl::UnimplementedError("CreateConvReluPool: this backend runs the ops one by one");
  }

  // --- Element-wise ----------------------------------------------------------
  // `alpha` is the negative slope for kLeakyRelu and ignored otherwise.
  virtual absl::Status ActivationForward(Activation kind, float alpha, const float* x, float* y,
                                         int64_t count) = 0;
  // dx from dy; x is the forward input and y the forward output (each kind
  // uses whichever it needs; both are always passed).
  virtual absl::Status ActivationBackward(Activation kind, float alpha, const float* x,
                                          const float* y, const float* dy, float* dx,
                                          int64_t count) = 0;
  // Inverted dropout. mask[i] = keep ? 1/(1-rate) : 0 with keep decided by
  // DropoutKeep(seed, i, rate) from common/rng.h (identical on every
  // backend); y = x * mask.
  virtual absl::Status DropoutForward(const float* x, float* y, float* mask, int64_t count,
                                      float rate, uint64_t seed) = 0;
  // y = a * b element-wise (dropout backward: dx = dy * mask).
  virtual absl::Status Multiply(const float* a, const float* b, float* y, int64_t count) = 0;
  // y = a + b.
  virtual absl::Status Add(const float* a, const float* b, float* y, int64_t count) = 0;
  // y += alpha * x.
  virtual absl::Status Axpy(float alpha, const float* x, float* y, int64_t count) = 0;
  // x *= alpha.
  virtual absl::Status Scale(float alpha, float* x, int64_t count) = 0;
  virtual absl::Status Fill(float* x, float value, int64_t count) = 0;

  // --- Loss ----------------------------------------------------------------
  // Softmax cross-entropy of logits [n, classes] against int32 labels (device
  // memory, each in [0, classes); an out-of-range label is an error).
  // *loss (a device scalar) = mean over the batch; dlogits (unless nullptr) =
  // (softmax - onehot) / n; probs (unless nullptr) = softmax.
  virtual absl::Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int64_t n,
                                           int64_t classes, float* loss, float* dlogits,
                                           float* probs) = 0;

  // --- Optimizer updates (shared with the parameter server) ----------------
  // PyTorch's formulation: g = grad + wd*p; v = mu*v + g;
  // p -= lr * (nesterov ? g + mu*v : v). With momentum 0: p -= lr * g.
  virtual absl::Status SgdUpdate(float* param, const float* grad, float* velocity, int64_t count,
                                 const SgdHyper& hyper) = 0;
  // Adam / AdamW with bias correction at hyper.step.
  virtual absl::Status AdamUpdate(float* param, const float* grad, float* m, float* v,
                                  int64_t count, const AdamHyper& hyper) = 0;

  // --- Any DataType (mixed precision) -----------------------------------------
  // The ops above, on elements of `dtype` (every pointer except `loss`),
  // computed in fp32 and rounded once when stored. Plans take their dtype
  // from their config. A backend runs only the types SupportsDataType
  // accepts; for the others each op returns UNIMPLEMENTED. The defaults run
  // fp32 through the ops above, and refuse everything else.
  virtual bool SupportsDataType(DataType dtype) const { return dtype == DataType::kF32; }
  // Whether this backend wants `dtype`'s 4-D activations channels last
  // (TensorLayout::kNHWC) in the plans it creates; the model then keeps
  // them so, and Transpose converts where a layer needs NCHW order.
  virtual bool ChannelsLast(DataType dtype) const { return false; }
  // y[b][c][r] = x[b][r][c] for b < batch, r < rows, c < cols (NHWC to NCHW
  // with rows = H*W and cols = C, and back with the two swapped). x and y
  // must not overlap. The default runs fp32 through CopyDeviceToHost and
  // back; backends with their own memory override it.
  virtual absl::Status Transpose(DataType dtype, const void* x, void* y, int64_t batch,
                                 int64_t rows, int64_t cols);
  virtual absl::Status Gemm(DataType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n,
                            int64_t k, float alpha, const void* a, const void* b, float beta,
                            void* c);
  virtual absl::Status AddBias(DataType dtype, void* y, const void* bias, int64_t outer,
                               int64_t channels, int64_t inner);
  virtual absl::Status BiasGrad(DataType dtype, const void* dy, void* dbias, int64_t outer,
                                int64_t channels, int64_t inner);
  virtual absl::Status ActivationForward(DataType dtype, Activation kind, float alpha,
                                         const void* x, void* y, int64_t count);
  virtual absl::Status ActivationBackward(DataType dtype, Activation kind, float alpha,
                                          const void* x, const void* y, const void* dy, void* dx,
                                          int64_t count);
  // `mask` holds `dtype` elements too.
  virtual absl::Status DropoutForward(DataType dtype, const void* x, void* y, void* mask,
                                      int64_t count, float rate, uint64_t seed);
  virtual absl::Status Multiply(DataType dtype, const void* a, const void* b, void* y,
                                int64_t count);
  virtual absl::Status Add(DataType dtype, const void* a, const void* b, void* y, int64_t count);
  virtual absl::Status Axpy(DataType dtype, float alpha, const void* x, void* y, int64_t count);
  // As SoftmaxCrossEntropy, with `dtype` logits and dlogits; *loss stays
  // fp32 and dlogits are multiplied by `dlogits_scale` (a loss scale) before
  // they are rounded.
  virtual absl::Status SoftmaxCrossEntropy(DataType dtype, const void* logits,
                                           const int32_t* labels, int64_t n, int64_t classes,
                                           float* loss, void* dlogits, float dlogits_scale);
  // y[i] = scale * x[i], read as `from` and stored as `to` (round to nearest
  // even); x == y is allowed when from == to. When `nonfinite` (a device
  // int32) is not null, a non-finite result stores 1 there (the flag is never
  // cleared here): how loss scaling finds overflowed gradients.
  virtual absl::Status Convert(DataType from, const void* x, DataType to, void* y, int64_t count,
                               float scale, int32_t* nonfinite);
};

inline void DeviceBuffer::Reset() {
  if (ptr_ != nullptr && backend_ != nullptr) backend_->Free(ptr_);
  backend_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

inline void PinnedBuffer::Reset() {
  if (ptr_ != nullptr && backend_ != nullptr) backend_->FreePinned(ptr_);
  backend_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

inline absl::StatusOr<Tensor> Backend::AllocateTensor(const Shape& shape, DataType dtype) {
  for (int64_t d : shape.dims()) {
    if (d < 0) {
      return absl::InvalidArgumentError("AllocateTensor: negative dimension in " + shape.ToString());
    }
  }
  size_t bytes = static_cast<size_t>(shape.num_elements()) * DataTypeBytes(dtype);
  absl::StatusOr<DeviceBuffer> buffer = Allocate(bytes == 0 ? sizeof(float) : bytes);
  if (!buffer.ok()) return buffer.status();
  return Tensor(shape, *std::move(buffer), dtype);
}

inline const char* TensorLayoutName(TensorLayout layout) {
  return layout == TensorLayout::kNHWC ? "NHWC" : "NCHW";
}

inline size_t DataTypeBytes(DataType dtype) { return dtype == DataType::kF32 ? 4 : 2; }

inline const char* DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kF32:
      return "fp32";
    case DataType::kBF16:
      return "bf16";
    case DataType::kF16:
      return "fp16";
  }
  return "unknown";
}

namespace backend_internal {

inline absl::Status Unsupported(const Backend& backend, const char* op, DataType dtype) {
  return absl::UnimplementedError(absl::StrCat(op, ": ", DataTypeName(dtype), " on ",
                                               backend.DeviceName(),
                                               " is not supported (this backend computes in fp32 "
                                               "only; reduced precision needs a CUDA device)"));
}

}  // namespace backend_internal

// The defaults of the typed ops: fp32 goes to the fp32 ops, the rest is
// refused.
inline absl::Status Backend::Gemm(DataType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n,
                                  int64_t k, float alpha, const void* a, const void* b, float beta,
                                  void* c) {
  if (dtype != DataType::kF32) return backend_internal::Unsupported(*this, "Gemm", dtype);
  return Gemm(trans_a, trans_b, m, n, k, alpha, static_cast<const float*>(a),
              static_cast<const float*>(b), beta, static_cast<float*>(c));
}

inline absl::Status Backend::AddBias(DataType dtype, void* y, const void* bias, int64_t outer,
                                     int64_t channels, int64_t inner) {
  if (dtype != DataType::kF32) return backend_internal::Unsupported(*this, "AddBias", dtype);
  return AddBias(static_cast<float*>(y), static_cast<const float*>(bias), outer, channels, inner);
}

inline absl::Status Backend::BiasGrad(DataType dtype, const void* dy, void* dbias, int64_t outer,
                                      int64_t channels, int64_t inner) {
  if (dtype != DataType::kF32) return backend_internal::Unsupported(*this, "BiasGrad", dtype);
  return BiasGrad(static_cast<const float*>(dy), static_cast<float*>(dbias), outer, channels,
                  inner);
}

inline absl::Status Backend::ActivationForward(DataType dtype, Activation kind, float alpha,
                                               const void* x, void* y, int64_t count) {
  if (dtype != DataType::kF32)
    return backend_internal::Unsupported(*this, "ActivationForward", dtype);
  return ActivationForward(kind, alpha, static_cast<const float*>(x), static_cast<float*>(y),
                           count);
}

inline absl::Status Backend::ActivationBackward(DataType dtype, Activation kind, float alpha,
                                                const void* x, const void* y, const void* dy,
                                                void* dx, int64_t count) {
  if (dtype != DataType::kF32)
    return backend_internal::Unsupported(*this, "ActivationBackward", dtype);
  return ActivationBackward(kind, alpha, static_cast<const float*>(x), static_cast<const float*>(y),
                            static_cast<const float*>(dy), static_cast<float*>(dx), count);
}

inline absl::Status Backend::DropoutForward(DataType dtype, const void* x, void* y, void* mask,
                                            int64_t count, float rate, uint64_t seed) {
  if (dtype != DataType::kF32) return backend_internal::Unsupported(*this, "DropoutForward", dtype);
  return DropoutForward(static_cast<const float*>(x), static_cast<float*>(y),
                        static_cast<float*>(mask), count, rate, seed);
}

inline absl::Status Backend::Multiply(DataType dtype, const void* a, const void* b, void* y,
                                      int64_t count) {
  if (dtype != DataType::kF32) return backend_internal::Unsupported(*this, "Multiply", dtype);
  return Multiply(static_cast<const float*>(a), static_cast<const float*>(b),
                  static_cast<float*>(y), count);
}

inline absl::Status Backend::Add(DataType dtype, const void* a, const void* b, void* y,
                                 int64_t count) {
  if (dtype != DataType::kF32) return backend_internal::Unsupported(*this, "Add", dtype);
  return Add(static_cast<const float*>(a), static_cast<const float*>(b), static_cast<float*>(y),
             count);
}

inline absl::Status Backend::Axpy(DataType dtype, float alpha, const void* x, void* y,
                                  int64_t count) {
  if (dtype != DataType::kF32) return backend_internal::Unsupported(*this, "Axpy", dtype);
  return Axpy(alpha, static_cast<const float*>(x), static_cast<float*>(y), count);
}

inline absl::Status Backend::SoftmaxCrossEntropy(DataType dtype, const void* logits,
                                                 const int32_t* labels, int64_t n, int64_t classes,
                                                 float* loss, void* dlogits, float dlogits_scale) {
  if (dtype != DataType::kF32)
    return backend_internal::Unsupported(*this, "SoftmaxCrossEntropy", dtype);
  float* d = static_cast<float*>(dlogits);
  PSTRAIN_RETURN_IF_ERROR(
      SoftmaxCrossEntropy(static_cast<const float*>(logits), labels, n, classes, loss, d, nullptr));
  if (d == nullptr || dlogits_scale == 1.f) return absl::OkStatus();
  return Scale(dlogits_scale, d, n * classes);
}

inline absl::Status Backend::Transpose(DataType dtype, const void* x, void* y, int64_t batch,
                                       int64_t rows, int64_t cols) {
  if (dtype != DataType::kF32) return backend_internal::Unsupported(*this, "Transpose", dtype);
  if (batch < 0 || rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Transpose: negative shape [", batch, ", ", rows, ", ", cols, "]"));
  }
  const int64_t count = batch * rows * cols;
  if (count == 0) return absl::OkStatus();
  std::vector<float> in(count), out(count);
  PSTRAIN_RETURN_IF_ERROR(CopyDeviceToHost(in.data(), x, count * sizeof(float)));
  PSTRAIN_RETURN_IF_ERROR(Synchronize());
  for (int64_t b = 0; b < batch; ++b) {
    const float* src = in.data() + b * rows * cols;
    float* dst = out.data() + b * rows * cols;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
    }
  }
  PSTRAIN_RETURN_IF_ERROR(CopyHostToDevice(y, out.data(), count * sizeof(float)));
  return Synchronize();
}

inline absl::Status Backend::Convert(DataType from, const void* x, DataType to, void* y,
                                     int64_t count, float scale, int32_t* nonfinite) {
  if (from != DataType::kF32) return backend_internal::Unsupported(*this, "Convert", from);
  if (to != DataType::kF32) return backend_internal::Unsupported(*this, "Convert", to);
  if (nonfinite != nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("Convert: the non-finite flag is not supported on ", DeviceName()));
  }
  if (count < 0) return absl::InvalidArgumentError("Convert: negative count");
  if (x != y) PSTRAIN_RETURN_IF_ERROR(CopyDeviceToDevice(y, x, count * sizeof(float)));
  return scale == 1.f ? absl::OkStatus() : Scale(scale, static_cast<float*>(y), count);
}

// The CPU backend; never fails to construct.
std::unique_ptr<Backend> CreateCpuBackend();

// True when the CUDA module (libpstrain_cuda.so, kernels/backend_loader.h)
// loaded and sees at least one device; CudaDeviceCount() is that count (0
// without module, CUDA libraries, driver or GPU). Looked up once per process.
bool CudaAvailable();
int CudaDeviceCount();

// Resolves "auto" (CUDA device 0 when CudaAvailable(), else CPU) and creates
// the backend. Asking for cuda without a usable device is FAILED_PRECONDITION
// with a message that says which of module, library or device is missing.
// A CUDA backend gets the process's options (ConfigureCudaModule,
// kernels/backend_loader.h), or `cuda` where given.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const DeviceSpec& spec);
struct CudaBackendOptions;  // kernels/cuda_backend_options.h
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const DeviceSpec& spec,
                                                       const CudaBackendOptions& cuda);

}  // namespace pstrain

#endif  // PSTRAIN_KERNELS_BACKEND_H_
