// Internal to kernels/cpu/: the CPU plan implementations behind
// CpuBackend::CreateConv2d / CreatePool2d / CreateBatchNorm, and the GEMM
// dispatcher. Each factory validates its config (INVALID_ARGUMENT naming the
// op); the convolution plan builds its oneDNN primitives up front (the
// no-bias variants on first use), so that later calls only bind pointers.
//
// Threads: one thread at a time per plan; `num_threads` is the OpenMP team
// size the plan asks for (> 0).
#ifndef PSTRAIN_KERNELS_CPU_CPU_PLANS_H_
#define PSTRAIN_KERNELS_CPU_CPU_PLANS_H_

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dnnl_helpers.h"
#include "kernels/cpu/winograd.h"

namespace pstrain::cpu_internal {

// CPU plans hold fp32 only (the backend refuses other DataTypes); these read
// the plan interfaces' untyped pointers as such.
inline const float* AsF32(const void* p) { return static_cast<const float*>(p); }
inline float* AsF32(void* p) { return static_cast<float*>(p); }

absl::Status ValidateConv2dConfig(const Conv2dConfig& config);
absl::Status ValidatePool2dConfig(const Pool2dConfig& config);

// UNIMPLEMENTED when oneDNN has no primitive for the shapes (the model then
// runs the ops one by one).
absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> CreateCpuConvReluPoolPlan(
    std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& conv, bool with_bias,
    const Pool2dConfig& pool, CpuConvAlgorithm algorithm, CpuVectorWidth width, int num_threads);

absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateCpuConv2dPlan(
    std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& config, CpuConvLayout layout,
    CpuConvAlgorithm algorithm, CpuVectorWidth width, int num_threads);

absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreateCpuPool2dPlan(const Pool2dConfig& config,
                                                                int num_threads);

absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateCpuBatchNormPlan(
    const BatchNormConfig& config, int num_threads);

// The register width of a Winograd pass (WinogradShape::avx512), one call
// at a time. For CpuVectorWidth::kMeasured the pass's own first 2 x
// kTrials calls alternate 256 and 512 bits, timed (both give the same bits,
// so the trials are the pass's real work), and then the width with the
// lower median holds for the pass's life: 512 only if its median was under
// kMargin of 256's, so that a near tie stays on the narrower registers.
// Without AVX-512 (or for k256) always 256 bits; for k512, 512.
class VectorWidthChoice {
 public:
  void Init(CpuVectorWidth width, bool avx512_available = WinogradAvx512Available());
  // The width of the next call.
  bool NextIs512() const { return trials_left_ > 0 ? calls_ % 2 == 1 : use_512_; }
  // How long the call that NextIs512() was asked for took.
  void Record(absl::Duration took);
  bool decided() const { return trials_left_ == 0; }

  static constexpr int kTrials = 4;
  static constexpr double kMargin = 0.97;

 private:
  bool use_512_ = false;
  int trials_left_ = 0;  // Calls still to time; 0 once decided.
  int calls_ = 0;
  std::vector<absl::Duration> took_[2];  // By width: [0] 256 bits, [1] 512.
};

// A convolution pass (forward or backward data) by winograd.h between
// oneDNN memories in channel-blocked layouts, where CpuConvAlgorithm allows
// it; the plans fall back to their oneDNN primitive when it is not
// enabled. Both convolution plans decide the same way for the same shape,
// so that the fused and the layer-by-layer paths keep giving the same bits.
class WinogradPass {
 public:
  enum class Role { kForward, kBackwardData };
  // Enabled when `algorithm` is kAuto, WinogradApplies(c) and both layouts
  // are blocked (ChannelBlock 8 or 16). The memories the pass reads and
  // writes: forward x and y, backward data dy and dx.
  void Init(const Conv2dConfig& c, Role role, CpuConvAlgorithm algorithm, CpuVectorWidth width,
            const dnnl_memory_desc_t& first_md, const dnnl_memory_desc_t& second_md,
            int num_threads);
  bool enabled() const { return enabled_; }
  // Forward (out = y) and backward data (out = dx): from `in` and the
  // filters w ([K, C, R, S]) and, forward only, bias (nullptr: none).
  absl::Status Run(const float* w, const float* bias, dnnl_memory_t in, dnnl_memory_t out,
                   absl::string_view what);

 private:
  Conv2dConfig config_;
  Role role_ = Role::kForward;
  bool enabled_ = false;
  WinogradShape shape_;
  VectorWidthChoice width_;
  std::vector<float> filters_;  // U, rebuilt from w on every call.
};

// The weight gradient by winograd.h (WinogradWeightGrad5x5) from x and dy in
// channel-blocked oneDNN memories, enabled as WinogradPass is (and both
// plans decide the same way for the same shape). It writes dw in the
// plan's [filters, c, 5, 5] layout and, when asked, dbias.
class WinogradWeightGradPass {
 public:
  void Init(const Conv2dConfig& c, CpuConvAlgorithm algorithm, CpuVectorWidth width,
            const dnnl_memory_desc_t& x_md, const dnnl_memory_desc_t& dy_md, int num_threads);
  bool enabled() const { return enabled_; }
  absl::Status Run(dnnl_memory_t x, dnnl_memory_t dy, float* dw, float* dbias,
                   absl::string_view what);

 private:
  bool enabled_ = false;
  WinogradShape shape_;
  VectorWidthChoice width_;
  std::vector<float> scratch_;  // The sums, kept between calls.
};

// Row-major C = alpha * op(A) * op(B) + beta * C, as Backend::Gemm. Small
// products run on dnnl_sgemm. Large ones run on a oneDNN matmul primitive
// (brgemm kernels, created once per shape and kept) or on dnnl_sgemm,
// whichever CpuGemmChoice says; kMeasured times both on the shape's first
// call (kTrials runs each, alternating, fewer past kMaxTrialTime, on the
// caller's operands into scratch memory, so C is written once) and keeps
// the faster for the shape. Neither wins everywhere: on the 2-core AVX-512
// machine of 2026-11-21 dnnl_sgemm ran a dense layer's forward ([64,3136] x
// [1024,3136]^T) ~1.8x slower than the primitive; on a Zen 4 EPYC the
// primitive is still faster for that forward, dnnl_sgemm for the same
// layer's dx ([64,1024] x [1024,3136]: 1.9 vs 2.2 ms), and dW is a near tie.
class CpuGemm {
 public:
  CpuGemm(std::shared_ptr<DnnlContext> ctx, int num_threads, CpuGemmChoice choice);
  // Arguments are validated by the caller.
  absl::Status Run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, const float* b, float beta, float* c);

 private:
  static constexpr size_t kMaxCachedShapes = 64;
  // Products with fewer multiply-adds go to dnnl_sgemm.
  static constexpr int64_t kMatmulMinMacs = int64_t{1} << 20;
  static constexpr int kTrials = 3;
  // dnnl_sgemm is kept only when its best trial took less than this share of
  // the primitive's.
  static constexpr double kSgemmMargin = 0.95;
  // Trials stop after the first pair that ends past this much measuring.
  static constexpr absl::Duration kMaxTrialTime = absl::Milliseconds(100);

  struct Matmul {
    DnnlPrimitive primitive;
    DnnlMemory a, b, c;
  };
  struct Shape {
    bool use_sgemm = false;
    std::unique_ptr<Matmul> matmul;  // Null when use_sgemm.
  };
  using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, float, float>;
  absl::StatusOr<Shape*> GetShape(const Key& key, const float* a, const float* b, const float* c);
  absl::StatusOr<std::unique_ptr<Matmul>> CreateMatmul(const Key& key);
  absl::Status RunMatmul(Matmul& matmul, const float* a, const float* b, float* c);
  absl::Status RunSgemm(const Key& key, const float* a, const float* b, float* c);

  // Constant after construction.
  const std::shared_ptr<DnnlContext> ctx_;
  const int num_threads_;
  const CpuGemmChoice choice_;

  std::map<Key, Shape> shapes_;
};

}  // namespace pstrain::cpu_internal

#endif  // PSTRAIN_KERNELS_CPU_CPU_PLANS_H_
