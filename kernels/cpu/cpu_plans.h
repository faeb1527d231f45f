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

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dnnl_helpers.h"

namespace pstrain::cpu_internal {

absl::Status ValidateConv2dConfig(const Conv2dConfig& config);
absl::Status ValidatePool2dConfig(const Pool2dConfig& config);

// UNIMPLEMENTED when oneDNN has no primitive for the shapes (the model then
// runs the ops one by one).
absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> CreateCpuConvReluPoolPlan(
    std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& conv, bool with_bias,
    const Pool2dConfig& pool, int num_threads);

absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateCpuConv2dPlan(
    std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& config, CpuConvLayout layout,
    int num_threads);

absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreateCpuPool2dPlan(const Pool2dConfig& config,
                                                                int num_threads);

absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateCpuBatchNormPlan(
    const BatchNormConfig& config, int num_threads);

// Row-major C = alpha * op(A) * op(B) + beta * C, as Backend::Gemm. Large
// products run on oneDNN matmul primitives (brgemm kernels), created once per
// shape and kept (up to kMaxCachedShapes, then the cache starts over); small
// ones on dnnl_sgemm. Measured on the 2-core AVX-512 machine: for
// [64,3136] x [1024,3136]^T (a dense layer's forward) dnnl_sgemm took ~1.8x
// the time of the matmul primitive, which handles the transposes as strides.
class CpuGemm {
 public:
  CpuGemm(std::shared_ptr<DnnlContext> ctx, int num_threads);
  // Arguments are validated by the caller.
  absl::Status Run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, const float* b, float beta, float* c);

 private:
  static constexpr size_t kMaxCachedShapes = 64;
  // Products with fewer multiply-adds go to dnnl_sgemm.
  static constexpr int64_t kMatmulMinMacs = int64_t{1} << 20;

  struct Matmul {
    DnnlPrimitive primitive;
    DnnlMemory a, b, c;
  };
  using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, float, float>;
  absl::StatusOr<Matmul*> GetMatmul(const Key& key);

  // Constant after construction.
  const std::shared_ptr<DnnlContext> ctx_;
  const int num_threads_;

  std::map<Key, std::unique_ptr<Matmul>> matmuls_;
};

}  // namespace pstrain::cpu_internal

#endif  // PSTRAIN_KERNELS_CPU_CPU_PLANS_H_
