// CpuBackend: memory, GEMM (dnnl_sgemm), and the element-wise, loss and
// optimizer ops as OpenMP loops. Plans live in cpu_conv.cc, cpu_pool.cc and
// cpu_batch_norm.cc.
//
// Adding an op: declare it in kernels/backend.h, implement it here (validate
// pointers and sizes first, INVALID_ARGUMENT naming the op), and add a test
// against a naive loop in tests/kernels/cpu_backend_test.cc.
#include "kernels/cpu/cpu_backend.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_plans.h"
#include "kernels/cpu/dnnl_helpers.h"
#include "common/rng.h"

namespace pstrain {
namespace {

using cpu_internal::DnnlContext;

constexpr size_t kAlignment = 64;
// Element-wise loops shorter than this run on the calling thread: forking
// the OpenMP team costs a few microseconds, as much as ~32K simple flops.
constexpr int64_t kParallelElements = int64_t{1} << 15;

absl::Status CheckCount(int64_t count, const char* op) {
  if (count <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": count must be positive, got ", count));
  }
  return absl::OkStatus();
}

absl::Status NullError(const char* op) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": null pointer argument"));
}

void* AlignedAlloc(size_t bytes) {
  size_t rounded = (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  return std::aligned_alloc(kAlignment, rounded);
}

// The team size before any backend changed it: the cores, or OMP_NUM_THREADS.
int DefaultThreads() {
  static const int threads = omp_get_max_threads();
  return threads;
}

class CpuEvent final : public Event {
 public:
  absl::Status Wait() override { return absl::OkStatus(); }
};

absl::Status CheckF32(const char* op, DataType dtype) {
  if (dtype == DataType::kF32) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      op, ": ", DataTypeName(dtype),
      " is not supported on the CPU, which trains in fp32 only (mixed precision needs a CUDA "
      "device)"));
}

absl::Status CheckNchw(const char* op, TensorLayout layout) {
  if (layout == TensorLayout::kNCHW) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      op, ": ", TensorLayoutName(layout),
      " activations are not supported on the CPU (its plans take NCHW; channels last is for "
      "CUDA's reduced precision)"));
}

class CpuBackend final : public Backend {
 public:
  // The typed ops of Backend: fp32 runs the ops below, the rest is refused.
  using Backend::ActivationBackward;
  using Backend::ActivationForward;
  using Backend::Add;
  using Backend::AddBias;
  using Backend::Axpy;
  using Backend::BiasGrad;
  using Backend::DropoutForward;
  using Backend::Gemm;
  using Backend::Multiply;
  using Backend::SoftmaxCrossEntropy;

  explicit CpuBackend(const CpuBackendOptions& options) : options_(options) {
    threads_ = options_.num_threads > 0 ? options_.num_threads : DefaultThreads();
    absl::StatusOr<std::shared_ptr<DnnlContext>> ctx = DnnlContext::Create();
    if (ctx.ok()) {
      ctx_ = *std::move(ctx);
    } else {
      ctx_status_ = ctx.status();
    }
    gemm_ = std::make_unique<cpu_internal::CpuGemm>(ctx_, threads_, options_.gemm);
  }

  DeviceType type() const override { return DeviceType::kCpu; }

  std::string Describe() const override {
    const dnnl_version_t* v = dnnl_version();
    return absl::StrCat("cpu (oneDNN ", v->major, ".", v->minor, ".", v->patch, ", ", threads_,
                        threads_ == 1 ? " thread)" : " threads)");
  }

  std::string DeviceName() const override { return "cpu"; }

  // --- Memory --------------------------------------------------------------
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    void* ptr = AlignedAlloc(bytes);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("Allocate: out of memory for ", bytes,
                                                       " bytes"));
    }
    return DeviceBuffer(this, ptr, bytes);
  }

  absl::StatusOr<PinnedBuffer> AllocatePinned(size_t bytes) override {
    void* ptr = AlignedAlloc(bytes);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("AllocatePinned: out of memory for ",
                                                       bytes, " bytes"));
    }
    return PinnedBuffer(this, ptr, bytes);
  }

  void Free(void* ptr) override { std::free(ptr); }
  void FreePinned(void* ptr) override { std::free(ptr); }

  absl::Status CopyHostToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, "CopyHostToDevice");
  }
  absl::Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, "CopyDeviceToHost");
  }
  absl::Status CopyDeviceToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, "CopyDeviceToDevice");
  }

  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::StatusOr<std::unique_ptr<Event>> RecordEvent() override {
    return std::unique_ptr<Event>(std::make_unique<CpuEvent>());
  }

  // --- Dense linear algebra -------------------------------------------------
  absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, const float* b, float beta, float* c) override {
    if (a == nullptr || b == nullptr || c == nullptr) return NullError("Gemm");
    if (m <= 0 || n <= 0 || k <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Gemm: m, n and k must be positive, got ", m, ", ", n, ", ", k));
    }
    return gemm_->Run(trans_a, trans_b, m, n, k, alpha, a, b, beta, c);
  }

  absl::Status AddBias(float* y, const float* bias, int64_t outer, int64_t channels,
                       int64_t inner) override {
    if (y == nullptr || bias == nullptr) return NullError("AddBias");
    PSTRAIN_RETURN_IF_ERROR(CheckShape(outer, channels, inner, "AddBias"));
    const int64_t rows = outer * channels;
#pragma omp parallel for schedule(static) num_threads(threads_) if (rows * inner >= kParallelElements)
    for (int64_t r = 0; r < rows; ++r) {
      const float value = bias[r % channels];
      float* row = y + r * inner;
      for (int64_t i = 0; i < inner; ++i) row[i] += value;
    }
    return absl::OkStatus();
  }

  absl::Status BiasGrad(const float* dy, float* dbias, int64_t outer, int64_t channels,
                        int64_t inner) override {
    if (dy == nullptr || dbias == nullptr) return NullError("BiasGrad");
    PSTRAIN_RETURN_IF_ERROR(CheckShape(outer, channels, inner, "BiasGrad"));
    const bool parallel = outer * channels * inner >= kParallelElements;
    if (inner == 1) {
      // Dense layers: sum rows of [outer, channels]; threads split the
      // channels so that each accumulates a contiguous, vectorised slice.
#pragma omp parallel num_threads(threads_) if (parallel)
      {
        const int64_t team = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t per = (channels + team - 1) / team;
        const int64_t begin = std::min(channels, id * per);
        const int64_t end = std::min(channels, begin + per);
        for (int64_t ch = begin; ch < end; ++ch) dbias[ch] = 0.f;
        for (int64_t o = 0; o < outer; ++o) {
          const float* row = dy + o * channels;
          for (int64_t ch = begin; ch < end; ++ch) dbias[ch] += row[ch];
        }
      }
      return absl::OkStatus();
    }
#pragma omp parallel for schedule(static) num_threads(threads_) if (parallel)
    for (int64_t ch = 0; ch < channels; ++ch) {
      double total = 0;
      for (int64_t o = 0; o < outer; ++o) {
        const float* row = dy + (o * channels + ch) * inner;
        float partial = 0.f;
        for (int64_t i = 0; i < inner; ++i) partial += row[i];
        total += partial;
      }
      dbias[ch] = static_cast<float>(total);
    }
    return absl::OkStatus();
  }

  // --- Plans -------------------------------------------------------------------
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateConv2d(const Conv2dConfig& config) override {
    PSTRAIN_RETURN_IF_ERROR(ctx_status_);
    PSTRAIN_RETURN_IF_ERROR(CheckF32("CreateConv2d", config.dtype));
    PSTRAIN_RETURN_IF_ERROR(CheckNchw("CreateConv2d", config.layout));
    return cpu_internal::CreateCpuConv2dPlan(ctx_, config, options_.conv_layout,
                                             options_.conv_algorithm, options_.vector_width,
                                             threads_);
  }

  absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> CreateConvReluPool(
      const Conv2dConfig& conv, bool with_bias, const Pool2dConfig& pool) override {
    PSTRAIN_RETURN_IF_ERROR(ctx_status_);
    if (options_.conv_layout == CpuConvLayout::kPlain) {
      return absl::UnimplementedError("CreateConvReluPool: plain layout asked for");
    }
    return cpu_internal::CreateCpuConvReluPoolPlan(
        ctx_, conv, with_bias, pool, options_.conv_algorithm, options_.vector_width, threads_);
  }

  absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreatePool2d(const Pool2dConfig& config) override {
    PSTRAIN_RETURN_IF_ERROR(CheckF32("CreatePool2d", config.dtype));
    PSTRAIN_RETURN_IF_ERROR(CheckNchw("CreatePool2d", config.layout));
    return cpu_internal::CreateCpuPool2dPlan(config, threads_);
  }

  absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateBatchNorm(
      const BatchNormConfig& config) override {
    PSTRAIN_RETURN_IF_ERROR(CheckF32("CreateBatchNorm", config.dtype));
    if (config.spatial > 1) PSTRAIN_RETURN_IF_ERROR(CheckNchw("CreateBatchNorm", config.layout));
    return cpu_internal::CreateCpuBatchNormPlan(config, threads_);
  }

  absl::Status Transpose(DataType dtype, const void* x, void* y, int64_t batch, int64_t rows,
                         int64_t cols) override {
    PSTRAIN_RETURN_IF_ERROR(CheckF32("Transpose", dtype));
    if (batch < 0 || rows < 0 || cols < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Transpose: negative shape [", batch, ", ", rows, ", ", cols, "]"));
    }
    if (batch * rows * cols == 0) return absl::OkStatus();
    if (x == nullptr || y == nullptr) return NullError("Transpose");
    for (int64_t b = 0; b < batch; ++b) {
      const float* src = static_cast<const float*>(x) + b * rows * cols;
      float* dst = static_cast<float*>(y) + b * rows * cols;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
      }
    }
    return absl::OkStatus();
  }

  // --- Element-wise -------------------------------------------------------------
  absl::Status ActivationForward(Activation kind, float alpha, const float* x, float* y,
                                 int64_t count) override {
    if (x == nullptr || y == nullptr) return NullError("ActivationForward");
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "ActivationForward"));
    const bool parallel = count >= kParallelElements;
    switch (kind) {
      case Activation::kRelu:
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
        for (int64_t i = 0; i < count; ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;
        break;
      case Activation::kLeakyRelu:
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
        for (int64_t i = 0; i < count; ++i) y[i] = x[i] > 0.f ? x[i] : alpha * x[i];
        break;
      case Activation::kTanh:
#pragma omp parallel for schedule(static) num_threads(threads_) if (parallel)
        for (int64_t i = 0; i < count; ++i) y[i] = std::tanh(x[i]);
        break;
      case Activation::kSigmoid:
#pragma omp parallel for schedule(static) num_threads(threads_) if (parallel)
        for (int64_t i = 0; i < count; ++i) y[i] = 1.f / (1.f + std::exp(-x[i]));
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("ActivationForward: unknown activation ", static_cast<int>(kind)));
    }
    return absl::OkStatus();
  }

  absl::Status ActivationBackward(Activation kind, float alpha, const float* x, const float* y,
                                  const float* dy, float* dx, int64_t count) override {
    if (x == nullptr || y == nullptr || dy == nullptr || dx == nullptr) {
      return NullError("ActivationBackward");
    }
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "ActivationBackward"));
    const bool parallel = count >= kParallelElements;
    switch (kind) {
      case Activation::kRelu:
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
        for (int64_t i = 0; i < count; ++i) dx[i] = x[i] > 0.f ? dy[i] : 0.f;
        break;
      case Activation::kLeakyRelu:
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
        for (int64_t i = 0; i < count; ++i) dx[i] = x[i] > 0.f ? dy[i] : alpha * dy[i];
        break;
      case Activation::kTanh:
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
        for (int64_t i = 0; i < count; ++i) dx[i] = dy[i] * (1.f - y[i] * y[i]);
        break;
      case Activation::kSigmoid:
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
        for (int64_t i = 0; i < count; ++i) dx[i] = dy[i] * y[i] * (1.f - y[i]);
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("ActivationBackward: unknown activation ", static_cast<int>(kind)));
    }
    return absl::OkStatus();
  }

  absl::Status DropoutForward(const float* x, float* y, float* mask, int64_t count, float rate,
                              uint64_t seed) override {
    if (x == nullptr || y == nullptr || mask == nullptr) return NullError("DropoutForward");
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "DropoutForward"));
    if (!(rate >= 0.f && rate < 1.f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("DropoutForward: rate must be in [0, 1), got ", rate));
    }
    const float scale = 1.f / (1.f - rate);
    const uint32_t threshold = DropoutKeepThreshold(rate);  // DropoutKeep, vectorisable.
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (count >= kParallelElements / 4)
    for (int64_t i = 0; i < count; ++i) {
      const float keep = DropoutKeepBits(seed, static_cast<uint64_t>(i), threshold) ? scale : 0.f;
      mask[i] = keep;
      y[i] = x[i] * keep;
    }
    return absl::OkStatus();
  }

  absl::Status Multiply(const float* a, const float* b, float* y, int64_t count) override {
    if (a == nullptr || b == nullptr || y == nullptr) return NullError("Multiply");
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "Multiply"));
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (count >= kParallelElements)
    for (int64_t i = 0; i < count; ++i) y[i] = a[i] * b[i];
    return absl::OkStatus();
  }

  absl::Status Add(const float* a, const float* b, float* y, int64_t count) override {
    if (a == nullptr || b == nullptr || y == nullptr) return NullError("Add");
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "Add"));
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (count >= kParallelElements)
    for (int64_t i = 0; i < count; ++i) y[i] = a[i] + b[i];
    return absl::OkStatus();
  }

  absl::Status Axpy(float alpha, const float* x, float* y, int64_t count) override {
    if (x == nullptr || y == nullptr) return NullError("Axpy");
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "Axpy"));
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (count >= kParallelElements)
    for (int64_t i = 0; i < count; ++i) y[i] += alpha * x[i];
    return absl::OkStatus();
  }

  absl::Status Scale(float alpha, float* x, int64_t count) override {
    if (x == nullptr) return NullError("Scale");
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "Scale"));
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (count >= kParallelElements)
    for (int64_t i = 0; i < count; ++i) x[i] *= alpha;
    return absl::OkStatus();
  }

  absl::Status Fill(float* x, float value, int64_t count) override {
    if (x == nullptr) return NullError("Fill");
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "Fill"));
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (count >= kParallelElements)
    for (int64_t i = 0; i < count; ++i) x[i] = value;
    return absl::OkStatus();
  }

  // --- Loss --------------------------------------------------------------------
  absl::Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int64_t n,
                                   int64_t classes, float* loss, float* dlogits,
                                   float* probs) override {
    if (logits == nullptr || labels == nullptr || loss == nullptr) {
      return NullError("SoftmaxCrossEntropy");
    }
    if (n <= 0 || classes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SoftmaxCrossEntropy: n and classes must be positive, got ", n, ", ", classes));
    }
    for (int64_t i = 0; i < n; ++i) {
      if (labels[i] < 0 || labels[i] >= classes) {
        return absl::InvalidArgumentError(absl::StrCat("SoftmaxCrossEntropy: label ", labels[i],
                                                       " of sample ", i, " is outside [0, ",
                                                       classes, ")"));
      }
    }
    const float inv_n = 1.f / static_cast<float>(n);
    double total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads_) if (n * classes >= kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = logits + i * classes;
      float max = row[0];
      for (int64_t j = 1; j < classes; ++j) max = std::max(max, row[j]);
      double sum = 0;
      for (int64_t j = 0; j < classes; ++j) sum += std::exp(static_cast<double>(row[j] - max));
      const double log_sum = std::log(sum);
      total += log_sum - static_cast<double>(row[labels[i]] - max);
      if (dlogits != nullptr || probs != nullptr) {
        const float inv_sum = static_cast<float>(1.0 / sum);
        for (int64_t j = 0; j < classes; ++j) {
          const float p = std::exp(row[j] - max) * inv_sum;
          if (probs != nullptr) probs[i * classes + j] = p;
          if (dlogits != nullptr) {
            dlogits[i * classes + j] = (p - (j == labels[i] ? 1.f : 0.f)) * inv_n;
          }
        }
      }
    }
    *loss = static_cast<float>(total / static_cast<double>(n));
    return absl::OkStatus();
  }

  // --- Optimizer updates -------------------------------------------------------
  absl::Status SgdUpdate(float* param, const float* grad, float* velocity, int64_t count,
                         const SgdHyper& hyper) override {
    if (param == nullptr || grad == nullptr) return NullError("SgdUpdate");
    if (hyper.momentum != 0.f && velocity == nullptr) {
      return absl::InvalidArgumentError("SgdUpdate: momentum needs a velocity buffer");
    }
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "SgdUpdate"));
    const float lr = hyper.learning_rate, mu = hyper.momentum, wd = hyper.weight_decay;
    const bool parallel = count >= kParallelElements;
    if (mu == 0.f) {
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
      for (int64_t i = 0; i < count; ++i) param[i] -= lr * (grad[i] + wd * param[i]);
    } else if (hyper.nesterov) {
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
      for (int64_t i = 0; i < count; ++i) {
        const float g = grad[i] + wd * param[i];
        const float v = mu * velocity[i] + g;
        velocity[i] = v;
        param[i] -= lr * (g + mu * v);
      }
    } else {
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (parallel)
      for (int64_t i = 0; i < count; ++i) {
        const float v = mu * velocity[i] + grad[i] + wd * param[i];
        velocity[i] = v;
        param[i] -= lr * v;
      }
    }
    return absl::OkStatus();
  }

  absl::Status AdamUpdate(float* param, const float* grad, float* m, float* v, int64_t count,
                          const AdamHyper& hyper) override {
    if (param == nullptr || grad == nullptr || m == nullptr || v == nullptr) {
      return NullError("AdamUpdate");
    }
    PSTRAIN_RETURN_IF_ERROR(CheckCount(count, "AdamUpdate"));
    if (hyper.step < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("AdamUpdate: step is 1-based, got ", hyper.step));
    }
    const float lr = hyper.learning_rate, b1 = hyper.beta1, b2 = hyper.beta2;
    const float eps = hyper.epsilon;
    const double t = static_cast<double>(hyper.step);
    const float bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t));
    const float bias2_sqrt =
        static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(b2), t)));
    const float step_size = lr / bias1;
    // L2 (Adam) folds weight decay into the gradient; AdamW decays the
    // parameter directly, before the moment update (as PyTorch does).
    const float l2 = hyper.decoupled_weight_decay ? 0.f : hyper.weight_decay;
    const float decay = hyper.decoupled_weight_decay ? 1.f - lr * hyper.weight_decay : 1.f;
#pragma omp parallel for simd schedule(static) num_threads(threads_) if (count >= kParallelElements / 4)
    for (int64_t i = 0; i < count; ++i) {
      const float p = param[i] * decay;
      const float g = grad[i] + l2 * param[i];
      const float mi = b1 * m[i] + (1.f - b1) * g;
      const float vi = b2 * v[i] + (1.f - b2) * g * g;
      m[i] = mi;
      v[i] = vi;
      param[i] = p - step_size * mi / (std::sqrt(vi) / bias2_sqrt + eps);
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status Copy(void* dst, const void* src, size_t bytes, const char* op) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr) return NullError(op);
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

  static absl::Status CheckShape(int64_t outer, int64_t channels, int64_t inner, const char* op) {
    if (outer <= 0 || channels <= 0 || inner <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": outer, channels and inner must be "
                                                     "positive, got ",
                                                     outer, ", ", channels, ", ", inner));
    }
    return absl::OkStatus();
  }

  // Constant after construction.
  const CpuBackendOptions options_;
  int threads_ = 1;
  std::shared_ptr<DnnlContext> ctx_;
  absl::Status ctx_status_;
  std::unique_ptr<cpu_internal::CpuGemm> gemm_;  // Shape-keyed primitive cache.
};

}  // namespace

std::unique_ptr<Backend> CreateCpuBackend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

std::unique_ptr<Backend> CreateCpuBackend() { return CreateCpuBackend(CpuBackendOptions{}); }

}  // namespace pstrain
