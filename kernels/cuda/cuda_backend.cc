#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_handles.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/cudnn_plans.h"

namespace pstrain {
namespace {

using cuda::CublasHandle;
using cuda::CudaEvent;
using cuda::CudnnHandle;
using cuda::Stream;

// An Event recorded on the backend's stream. Wait() may be called from any
// thread; the event may outlive the backend (the CUDA context outlives both).
class CudaStreamEvent final : public Event {
 public:
  explicit CudaStreamEvent(CudaEvent event) : event_(std::move(event)) {}
  absl::Status Wait() override {
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(event_.get()));
    return absl::OkStatus();
  }

 private:
  CudaEvent event_;
};

absl::Status CheckGemm(int64_t m, int64_t n, int64_t k, const void* a, const void* b,
                       const void* c) {
  if (m < 0 || n < 0 || k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: negative size m=", m, " n=", n, " k=", k));
  }
  if (m > 0 && n > 0 && (c == nullptr || (k > 0 && (a == nullptr || b == nullptr)))) {
    return absl::InvalidArgumentError("Gemm: null matrix pointer");
  }
  return absl::OkStatus();
}

absl::Status CheckCopy(const char* op, void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && (dst == nullptr || src == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": null pointer for ", bytes, " bytes"));
  }
  return absl::OkStatus();
}

// One CUDA device: a non-blocking stream that every op and copy is enqueued
// on, a cuBLAS and a cuDNN handle bound to it, and own kernels.
//
// Memory comes from the device's stream-ordered pool (cudaMallocAsync) where
// supported, else cudaMalloc; frees are ordered on the stream too, so a buffer
// may be released right after the last op that uses it was enqueued.
//
// Out-of-range labels in SoftmaxCrossEntropy are recorded by the kernel in a
// device flag, copied to pinned host memory in stream order, and reported as
// INVALID_ARGUMENT by the next Synchronize() (not by Event::Wait()).
//
// Threads: one thread at a time, as for every Backend.
class CudaBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<Backend>> Create(int ordinal,
                                                         const CudaBackendOptions& options) {
    auto backend = std::unique_ptr<CudaBackend>(new CudaBackend(ordinal, options));
    PSTRAIN_RETURN_IF_ERROR(backend->Init());
    return std::unique_ptr<Backend>(std::move(backend));
  }

  ~CudaBackend() override {
    // Let queued work finish before its buffers and handles go away; errors
    // cannot be reported from a destructor and leave nothing to clean up.
    (void)cudaSetDevice(ordinal_);
    if (stream_) (void)cudaStreamSynchronize(stream_.get());
    // Buffers first (their Free() uses the stream), then handles and stream.
    label_error_host_.Reset();
    label_error_device_.Reset();
    loss_scratch_.Reset();
    if (stream_) (void)cudaStreamSynchronize(stream_.get());
  }

  DeviceType type() const override { return DeviceType::kCuda; }
  std::string Describe() const override { return description_; }
  std::string DeviceName() const override { return absl::StrCat("cuda:", ordinal_); }

  // --- Memory ----------------------------------------------------------------

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    void* ptr = nullptr;
    const size_t request = bytes == 0 ? 1 : bytes;  // Keep pointers distinct and non-null.
    if (stream_ordered_allocation_) {
      PSTRAIN_RETURN_IF_CUDA_ERROR(cudaMallocAsync(&ptr, request, stream_.get()));
    } else {
      PSTRAIN_RETURN_IF_CUDA_ERROR(cudaMalloc(&ptr, request));
    }
    return DeviceBuffer(this, ptr, bytes);
  }

  absl::StatusOr<PinnedBuffer> AllocatePinned(size_t bytes) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    void* ptr = nullptr;
    PSTRAIN_RETURN_IF_CUDA_ERROR(
        cudaHostAlloc(&ptr, bytes == 0 ? 1 : bytes, cudaHostAllocPortable));
    return PinnedBuffer(this, ptr, bytes);
  }

  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    (void)cudaSetDevice(ordinal_);
    // Release failures leave nothing to recover; the pointer is gone either way.
    if (stream_ordered_allocation_) {
      (void)cudaFreeAsync(ptr, stream_.get());
    } else {
      (void)cudaFree(ptr);
    }
  }

  void FreePinned(void* ptr) override {
    if (ptr != nullptr) (void)cudaFreeHost(ptr);
  }

  absl::Status CopyHostToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy("CopyHostToDevice", dst, src, bytes, cudaMemcpyHostToDevice);
  }
  absl::Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) override {
    return Copy("CopyDeviceToHost", dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy("CopyDeviceToDevice", dst, src, bytes, cudaMemcpyDeviceToDevice);
  }

  absl::Status Synchronize() override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_.get()));
    return TakeLabelError();
  }

  absl::StatusOr<std::unique_ptr<Event>> RecordEvent() override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    PSTRAIN_ASSIGN_OR_RETURN(CudaEvent event, CudaEvent::Create());
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaEventRecord(event.get(), stream_.get()));
    return std::unique_ptr<Event>(new CudaStreamEvent(std::move(event)));
  }

  // --- Dense linear algebra ----------------------------------------------------

  absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, const float* b, float beta, float* c) override {
    PSTRAIN_RETURN_IF_ERROR(CheckGemm(m, n, k, a, b, c));
    if (m == 0 || n == 0) return absl::OkStatus();
    PSTRAIN_RETURN_IF_ERROR(Activate());
    if (k == 0) {  // op(A) op(B) is all zeros: C = beta * C.
      return beta == 0.f ? cuda::LaunchFill(c, 0.f, m * n, stream_.get())
                         : cuda::LaunchScale(beta, c, m * n, stream_.get());
    }
    // cuBLAS is column-major: a row-major [r, s] matrix is its transpose
    // [s, r] there. So compute C^T[n, m] = op(B)^T[n, k] * op(A)^T[k, m]:
    // B is passed first, each with the leading dimension of its stored rows.
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int64_t ldb = trans_b ? k : n;
    const int64_t lda = trans_a ? m : k;
    PSTRAIN_RETURN_IF_CUBLAS_ERROR(
        cublasSgemm_64(cublas_.get(), op_b, op_a, n, m, k, &alpha, b, ldb, a, lda, &beta, c, n));
    return absl::OkStatus();
  }

  absl::Status AddBias(float* y, const float* bias, int64_t outer, int64_t channels,
                       int64_t inner) override {
    return AddBias(DataType::kF32, y, bias, outer, channels, inner);
  }
  absl::Status AddBias(DataType dtype, void* y, const void* bias, int64_t outer, int64_t channels,
                       int64_t inner) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchAddBias(dtype, y, bias, outer, channels, inner, stream_.get());
  }

  absl::Status BiasGrad(const float* dy, float* dbias, int64_t outer, int64_t channels,
                        int64_t inner) override {
    return BiasGrad(DataType::kF32, dy, dbias, outer, channels, inner);
  }
  absl::Status BiasGrad(DataType dtype, const void* dy, void* dbias, int64_t outer,
                        int64_t channels, int64_t inner) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchBiasGrad(dtype, dy, dbias, outer, channels, inner, stream_.get());
  }

  // Half-precision GEMMs run on tensor cores with fp32 accumulation and
  // alpha/beta (cublasGemmEx, CUBLAS_COMPUTE_32F).
  absl::Status Gemm(DataType dtype, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                    float alpha, const void* a, const void* b, float beta, void* c) override {
    if (dtype == DataType::kF32) {
      return Gemm(trans_a, trans_b, m, n, k, alpha, static_cast<const float*>(a),
                  static_cast<const float*>(b), beta, static_cast<float*>(c));
    }
    PSTRAIN_RETURN_IF_ERROR(CheckGemm(m, n, k, a, b, c));
    if (m == 0 || n == 0) return absl::OkStatus();
    if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Gemm: ", DataTypeName(dtype), " sizes beyond 2^31-1: m=", m, " n=", n, " k=", k));
    }
    PSTRAIN_RETURN_IF_ERROR(Activate());
    const cudaDataType_t type = dtype == DataType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
    if (k == 0) {  // C = beta * C, through a GEMM-free path: scale in fp32 and round.
      return cuda::LaunchConvert(dtype, c, dtype, c, m * n, beta, nullptr, stream_.get());
    }
    // Column-major, as in the fp32 Gemm above.
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int ldb = static_cast<int>(trans_b ? k : n);
    const int lda = static_cast<int>(trans_a ? m : k);
    PSTRAIN_RETURN_IF_CUBLAS_ERROR(
        cublasGemmEx(cublas_.get(), op_b, op_a, static_cast<int>(n), static_cast<int>(m),
                     static_cast<int>(k), &alpha, b, type, ldb, a, type, lda, &beta, c, type,
                     static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

  // --- Plans -------------------------------------------------------------------

  absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateConv2d(const Conv2dConfig& config) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::CreateCudnnConv2dPlan(Context(), config);
  }
  absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreatePool2d(const Pool2dConfig& config) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::CreateCudnnPool2dPlan(Context(), config);
  }
  absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateBatchNorm(
      const BatchNormConfig& config) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::CreateBatchNormPlan(Context(), config);
  }

  // --- Element-wise --------------------------------------------------------------

  absl::Status ActivationForward(Activation kind, float alpha, const float* x, float* y,
                                 int64_t count) override {
    return ActivationForward(DataType::kF32, kind, alpha, x, y, count);
  }
  absl::Status ActivationForward(DataType dtype, Activation kind, float alpha, const void* x,
                                 void* y, int64_t count) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchActivationForward(dtype, kind, alpha, x, y, count, stream_.get());
  }
  absl::Status ActivationBackward(Activation kind, float alpha, const float* x, const float* y,
                                  const float* dy, float* dx, int64_t count) override {
    return ActivationBackward(DataType::kF32, kind, alpha, x, y, dy, dx, count);
  }
  absl::Status ActivationBackward(DataType dtype, Activation kind, float alpha, const void* x,
                                  const void* y, const void* dy, void* dx, int64_t count) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchActivationBackward(dtype, kind, alpha, x, y, dy, dx, count, stream_.get());
  }
  absl::Status DropoutForward(const float* x, float* y, float* mask, int64_t count, float rate,
                              uint64_t seed) override {
    return DropoutForward(DataType::kF32, x, y, mask, count, rate, seed);
  }
  absl::Status DropoutForward(DataType dtype, const void* x, void* y, void* mask, int64_t count,
                              float rate, uint64_t seed) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchDropoutForward(dtype, x, y, mask, count, rate, seed, stream_.get());
  }
  absl::Status Multiply(const float* a, const float* b, float* y, int64_t count) override {
    return Multiply(DataType::kF32, a, b, y, count);
  }
  absl::Status Multiply(DataType dtype, const void* a, const void* b, void* y,
                        int64_t count) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchMultiply(dtype, a, b, y, count, stream_.get());
  }
  absl::Status Add(const float* a, const float* b, float* y, int64_t count) override {
    return Add(DataType::kF32, a, b, y, count);
  }
  absl::Status Add(DataType dtype, const void* a, const void* b, void* y, int64_t count) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchAdd(dtype, a, b, y, count, stream_.get());
  }
  absl::Status Axpy(float alpha, const float* x, float* y, int64_t count) override {
    return Axpy(DataType::kF32, alpha, x, y, count);
  }
  absl::Status Axpy(DataType dtype, float alpha, const void* x, void* y, int64_t count) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchAxpy(dtype, alpha, x, y, count, stream_.get());
  }
  absl::Status Convert(DataType from, const void* x, DataType to, void* y, int64_t count,
                       float scale, int32_t* nonfinite) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchConvert(from, x, to, y, count, scale, nonfinite, stream_.get());
  }
  absl::Status Scale(float alpha, float* x, int64_t count) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchScale(alpha, x, count, stream_.get());
  }
  absl::Status Fill(float* x, float value, int64_t count) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchFill(x, value, count, stream_.get());
  }

  // --- Loss ----------------------------------------------------------------------

  absl::Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int64_t n,
                                   int64_t classes, float* loss, float* dlogits,
                                   float* probs) override {
    return RunSoftmaxCrossEntropy(DataType::kF32, logits, labels, n, classes, loss, dlogits, probs,
                                  1.f);
  }
  absl::Status SoftmaxCrossEntropy(DataType dtype, const void* logits, const int32_t* labels,
                                   int64_t n, int64_t classes, float* loss, void* dlogits,
                                   float dlogits_scale) override {
    return RunSoftmaxCrossEntropy(dtype, logits, labels, n, classes, loss, dlogits, nullptr,
                                  dlogits_scale);
  }

  // --- Optimizer updates -----------------------------------------------------------

  absl::Status SgdUpdate(float* param, const float* grad, float* velocity, int64_t count,
                         const SgdHyper& hyper) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchSgdUpdate(param, grad, velocity, count, hyper, stream_.get());
  }
  absl::Status AdamUpdate(float* param, const float* grad, float* m, float* v, int64_t count,
                          const AdamHyper& hyper) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchAdamUpdate(param, grad, m, v, count, hyper, stream_.get());
  }

  // bf16 and fp16 run channels last: cuDNN's tensor-core convolutions are
  // built for NHWC, and in NCHW their backward passes were no faster than
  // fp32's (bench/gpu_layers_bench on an H200). fp32 stays NCHW, where its
  // FMA algorithms match the CPU backend. options.channels_last = false
  // (--cuda-channels-last=false) keeps NCHW.
  bool ChannelsLast(DataType dtype) const override {
    return dtype != DataType::kF32 && options_.channels_last && SupportsDataType(dtype);
  }

  absl::Status Transpose(DataType dtype, const void* x, void* y, int64_t batch, int64_t rows,
                         int64_t cols) override {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    return cuda::LaunchTranspose(dtype, x, y, batch, rows, cols, stream_.get());
  }

  // Tensor cores for fp16 from compute capability 7.0 (Volta), for bf16
  // from 8.0 (Ampere); below that cuDNN has no reduced-precision algorithms
  // worth running, and the job is refused up front.
  bool SupportsDataType(DataType dtype) const override {
    switch (dtype) {
      case DataType::kF32:
        return true;
      case DataType::kF16:
        return compute_capability_ >= 70;
      case DataType::kBF16:
        return compute_capability_ >= 80;
    }
    return false;
  }

 private:
  absl::Status RunSoftmaxCrossEntropy(DataType dtype, const void* logits, const int32_t* labels,
                                      int64_t n, int64_t classes, float* loss, void* dlogits,
                                      float* probs, float dlogits_scale) {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    if (n > 0 && loss_scratch_.bytes() < static_cast<size_t>(n) * sizeof(float)) {
      // Stream-ordered: the old scratch is released after the ops using it.
      PSTRAIN_ASSIGN_OR_RETURN(loss_scratch_, Allocate(static_cast<size_t>(n) * sizeof(float)));
    }
    PSTRAIN_RETURN_IF_ERROR(cuda::LaunchSoftmaxCrossEntropy(
        dtype, logits, labels, n, classes, loss, dlogits, probs, dlogits_scale,
        static_cast<float*>(loss_scratch_.data()),
        static_cast<int32_t*>(label_error_device_.data()), stream_.get()));
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(label_error_host_.data(),
                                                 label_error_device_.data(), kLabelErrorBytes,
                                                 cudaMemcpyDeviceToHost, stream_.get()));
    label_check_pending_ = true;
    last_loss_classes_ = classes;
    return absl::OkStatus();
  }

  // {row + 1, label} of the first out-of-range label, or {0, 0}.
  static constexpr size_t kLabelErrorBytes = 2 * sizeof(int32_t);

  CudaBackend(int ordinal, const CudaBackendOptions& options)
      : ordinal_(ordinal), options_(options) {}

  absl::Status Init() {
    PSTRAIN_RETURN_IF_ERROR(Activate());
    cudaDeviceProp prop;
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&prop, ordinal_));
    compute_capability_ = prop.major * 10 + prop.minor;
    PSTRAIN_ASSIGN_OR_RETURN(stream_, Stream::Create());
    PSTRAIN_ASSIGN_OR_RETURN(cublas_, CublasHandle::Create());
    PSTRAIN_RETURN_IF_CUBLAS_ERROR(cublasSetStream(cublas_.get(), stream_.get()));
    // Plain fp32 (no TF32 tensor ops), so that fp32 GEMMs match the CPU
    // backend; bf16 and fp16 GEMMs (cublasGemmEx) use tensor cores anyway.
    PSTRAIN_RETURN_IF_CUBLAS_ERROR(cublasSetMathMode(cublas_.get(), CUBLAS_DEFAULT_MATH));
    PSTRAIN_ASSIGN_OR_RETURN(cudnn_, CudnnHandle::Create());
    PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnSetStream(cudnn_.get(), stream_.get()));
    if (options_.concurrent_conv_backward) {
      // A convolution's backward-filter pass runs here while its
      // backward-data pass runs on stream_ (conv_plan.cc).
      PSTRAIN_ASSIGN_OR_RETURN(side_stream_, Stream::Create());
      PSTRAIN_ASSIGN_OR_RETURN(side_cudnn_, CudnnHandle::Create());
      PSTRAIN_RETURN_IF_CUDNN_ERROR(cudnnSetStream(side_cudnn_.get(), side_stream_.get()));
    }

    int pools_supported = 0;
    PSTRAIN_RETURN_IF_CUDA_ERROR(
        cudaDeviceGetAttribute(&pools_supported, cudaDevAttrMemoryPoolsSupported, ordinal_));
    if (pools_supported != 0) {
      // Keep freed memory in the pool instead of returning it to the driver at
      // every synchronisation: steady-state training then never calls it.
      cudaMemPool_t pool = nullptr;
      PSTRAIN_RETURN_IF_CUDA_ERROR(cudaDeviceGetDefaultMemPool(&pool, ordinal_));
      uint64_t threshold = std::numeric_limits<uint64_t>::max();
      PSTRAIN_RETURN_IF_CUDA_ERROR(
          cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
      stream_ordered_allocation_ = true;
    }

    PSTRAIN_ASSIGN_OR_RETURN(label_error_device_, Allocate(kLabelErrorBytes));
    PSTRAIN_ASSIGN_OR_RETURN(label_error_host_, AllocatePinned(kLabelErrorBytes));
    std::memset(label_error_host_.data(), 0, kLabelErrorBytes);
    PSTRAIN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(label_error_device_.data(), 0, kLabelErrorBytes, stream_.get()));
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_.get()));

    const int cudnn_version = static_cast<int>(cudnnGetVersion());
    description_ =
        absl::StrCat("cuda:", ordinal_, " (", prop.name, ", cuDNN ", cudnn_version / 10000, ".",
                     (cudnn_version % 10000) / 100, ".", cudnn_version % 100, ", sm_", prop.major,
                     prop.minor, ", ", prop.totalGlobalMem >> 20, " MiB)");
    return absl::OkStatus();
  }

  // Makes this backend's device current on the calling thread (the trainer
  // may have used another device in between).
  absl::Status Activate() const {
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaSetDevice(ordinal_));
    return absl::OkStatus();
  }

  cuda::CudnnContext Context() {
    return cuda::CudnnContext{this,     stream_.get(),      cudnn_.get(),
                              ordinal_, side_stream_.get(), side_cudnn_.get(),
                              options_};
  }

  absl::Status Copy(const char* op, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    PSTRAIN_RETURN_IF_ERROR(CheckCopy(op, dst, src, bytes));
    if (bytes == 0) return absl::OkStatus();
    PSTRAIN_RETURN_IF_ERROR(Activate());
    PSTRAIN_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream_.get()));
    return absl::OkStatus();
  }

  // After a stream synchronisation: reports (once) an out-of-range label seen
  // by a SoftmaxCrossEntropy since the last report, and clears the flag.
  absl::Status TakeLabelError() {
    if (!label_check_pending_) return absl::OkStatus();
    label_check_pending_ = false;
    int32_t error[2];
    std::memcpy(error, label_error_host_.data(), kLabelErrorBytes);
    if (error[0] == 0) return absl::OkStatus();
    std::memset(label_error_host_.data(), 0, kLabelErrorBytes);
    PSTRAIN_RETURN_IF_CUDA_ERROR(
        cudaMemsetAsync(label_error_device_.data(), 0, kLabelErrorBytes, stream_.get()));
    return absl::InvalidArgumentError(absl::StrCat(
        "SoftmaxCrossEntropy: label ", error[1], " in row ", error[0] - 1, " is outside [0, ",
        last_loss_classes_, "); that row's loss is NaN (reported by Synchronize)"));
  }

  // Constant after construction.
  const int ordinal_;
  const CudaBackendOptions options_;
  std::string description_;
  int compute_capability_ = 0;  // 90 for sm_90.
  bool stream_ordered_allocation_ = false;
  Stream stream_;
  CublasHandle cublas_;
  CudnnHandle cudnn_;
  // Empty unless options_.concurrent_conv_backward; side_cudnn_ is bound to
  // side_stream_.
  Stream side_stream_;
  CudnnHandle side_cudnn_;

  // Used by the trainer's thread only. Declared after stream_ so that they are
  // released (via Free, on the stream) before it.
  DeviceBuffer loss_scratch_;        // Per-row losses, grown on demand.
  DeviceBuffer label_error_device_;  // kLabelErrorBytes, written by the loss kernel.
  PinnedBuffer label_error_host_;    // Its copy, valid after a stream sync.
  bool label_check_pending_ = false;
  int64_t last_loss_classes_ = 0;
};

}  // namespace

int CudaRuntimeDeviceCount(std::string* why) {
  // The runtime needs the driver's libcuda.so.1; say so plainly when it is
  // absent rather than cudart's "driver version is insufficient".
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (driver == nullptr) {
    if (why != nullptr) *why = "no NVIDIA driver (libcuda.so.1 not found)";
    return 0;
  }
  dlclose(driver);
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    (void)cudaGetLastError();  // No driver or no device: not an error here.
    if (why != nullptr) *why = cudaGetErrorString(error);
    return 0;
  }
  if (count == 0 && why != nullptr) *why = "the driver reports 0 devices";
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int ordinal,
                                                           const CudaBackendOptions& options) {
  std::string why;
  const int count = CudaRuntimeDeviceCount(&why);
  if (ordinal < 0 || ordinal >= count) {
    return absl::FailedPreconditionError(absl::StrCat("CreateCudaBackend: device cuda:", ordinal,
                                                      " requested but ", count,
                                                      " CUDA device(s) are visible", count == 0 ? ": " + why : ""));
  }
  return CudaBackend::Create(ordinal, options);
}

}  // namespace pstrain
