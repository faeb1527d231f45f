// CpuGemm: per large shape, a oneDNN matmul primitive or dnnl_sgemm, measured
// or chosen (cpu_plans.h); dnnl_sgemm for small products.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <new>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_plans.h"

namespace pstrain::cpu_internal {

CpuGemm::CpuGemm(std::shared_ptr<DnnlContext> ctx, int num_threads, CpuGemmChoice choice)
    : ctx_(std::move(ctx)), num_threads_(num_threads), choice_(choice) {}

absl::Status CpuGemm::Run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const float* a, const float* b, float beta, float* c) {
  omp_set_num_threads(num_threads_);
  const Key key(trans_a, trans_b, m, n, k, alpha, beta);
  if (ctx_ == nullptr || m * n * k < kMatmulMinMacs || choice_ == CpuGemmChoice::kSgemm) {
    return RunSgemm(key, a, b, c);
  }
  PSTRAIN_ASSIGN_OR_RETURN(Shape * shape, GetShape(key, a, b, c));
  if (shape->use_sgemm) return RunSgemm(key, a, b, c);
  return RunMatmul(*shape->matmul, a, b, c);
}

absl::Status CpuGemm::RunSgemm(const Key& key, const float* a, const float* b, float* c) {
  const auto [trans_a, trans_b, m, n, k, alpha, beta] = key;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha,
                                          a, trans_a ? m : k, b, trans_b ? k : n, beta, c, n),
                               "Gemm");
  return absl::OkStatus();
}

absl::Status CpuGemm::RunMatmul(Matmul& matmul, const float* a, const float* b, float* c) {
  PSTRAIN_RETURN_IF_ERROR(Bind(matmul.a, a, "Gemm"));
  PSTRAIN_RETURN_IF_ERROR(Bind(matmul.b, b, "Gemm"));
  PSTRAIN_RETURN_IF_ERROR(Bind(matmul.c, c, "Gemm"));
  return matmul.primitive.Execute(*ctx_,
                                  {{DNNL_ARG_SRC, matmul.a.get()},
                                   {DNNL_ARG_WEIGHTS, matmul.b.get()},
                                   {DNNL_ARG_DST, matmul.c.get()}},
                                  "Gemm");
}

absl::StatusOr<CpuGemm::Shape*> CpuGemm::GetShape(const Key& key, const float* a, const float* b,
                                                  const float* c) {
  auto it = shapes_.find(key);
  if (it != shapes_.end()) return &it->second;
  if (shapes_.size() >= kMaxCachedShapes) shapes_.clear();

  Shape shape;
  PSTRAIN_ASSIGN_OR_RETURN(shape.matmul, CreateMatmul(key));
  const auto [trans_a, trans_b, m, n, k, alpha, beta] = key;
  // Trials write scratch memory, never C: with beta != 0 they read a copy
  // of it, so the caller's C is accumulated into exactly once. Without the
  // memory for it the shape keeps the primitive, unmeasured.
  std::unique_ptr<float[]> scratch;
  if (choice_ == CpuGemmChoice::kMeasured) {
    scratch.reset(new (std::nothrow) float[static_cast<size_t>(m * n)]);
  }
  if (scratch != nullptr) {
    if (beta != 0.f) std::copy_n(c, m * n, scratch.get());
    double best_matmul = std::numeric_limits<double>::infinity();
    double best_sgemm = std::numeric_limits<double>::infinity();
    const absl::Time trials_start = absl::Now();
    for (int trial = 0; trial < kTrials; ++trial) {
      absl::Time start = absl::Now();
      PSTRAIN_RETURN_IF_ERROR(RunMatmul(*shape.matmul, a, b, scratch.get()));
      best_matmul = std::min(best_matmul, absl::ToDoubleSeconds(absl::Now() - start));
      start = absl::Now();
      PSTRAIN_RETURN_IF_ERROR(RunSgemm(key, a, b, scratch.get()));
      best_sgemm = std::min(best_sgemm, absl::ToDoubleSeconds(absl::Now() - start));
      // A product so large that one pair takes long is measured once.
      if (absl::Now() - trials_start > kMaxTrialTime) break;
    }
    // The matmul primitive unless dnnl_sgemm is clearly faster, so that a
    // near tie does not flip from one process to the next.
    if (best_sgemm < kSgemmMargin * best_matmul) {
      shape.use_sgemm = true;
      shape.matmul.reset();
    }
  }
  return &shapes_.emplace(key, std::move(shape)).first->second;
}

absl::StatusOr<std::unique_ptr<CpuGemm::Matmul>> CpuGemm::CreateMatmul(const Key& key) {
  const auto [trans_a, trans_b, m, n, k, alpha, beta] = key;
  // op(A) is [m, k] and op(B) is [k, n]; a transpose is just other strides.
  dnnl_dims_t a_dims = {m, k}, b_dims = {k, n}, c_dims = {m, n};
  dnnl_dims_t a_strides = {trans_a ? 1 : k, trans_a ? m : 1};
  dnnl_dims_t b_strides = {trans_b ? 1 : n, trans_b ? k : 1};
  dnnl_dims_t c_strides = {n, 1};
  dnnl_memory_desc_t a_md, b_md, c_md;
  PSTRAIN_RETURN_IF_DNNL_ERROR(
      dnnl_memory_desc_init_by_strides(&a_md, 2, a_dims, dnnl_f32, a_strides), "Gemm");
  PSTRAIN_RETURN_IF_DNNL_ERROR(
      dnnl_memory_desc_init_by_strides(&b_md, 2, b_dims, dnnl_f32, b_strides), "Gemm");
  PSTRAIN_RETURN_IF_DNNL_ERROR(
      dnnl_memory_desc_init_by_strides(&c_md, 2, c_dims, dnnl_f32, c_strides), "Gemm");
  dnnl_matmul_desc_t desc;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_matmul_desc_init(&desc, &a_md, &b_md, nullptr, &c_md), "Gemm");

  // alpha as an output scale, beta as a sum post-op (absent when 0, so that
  // C is never read and may hold garbage).
  dnnl_primitive_attr_t raw_attr = nullptr;
  PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_primitive_attr_create(&raw_attr), "Gemm");
  DnnlAttr attr(raw_attr);
  if (alpha != 1.f) {
    PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_primitive_attr_set_output_scales(attr.get(), 1, 0, &alpha),
                                 "Gemm");
  }
  if (beta != 0.f) {
    dnnl_post_ops_t raw_post_ops = nullptr;
    PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_post_ops_create(&raw_post_ops), "Gemm");
    DnnlPostOps post_ops(raw_post_ops);
    PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_post_ops_append_sum(post_ops.get(), beta), "Gemm");
    PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_primitive_attr_set_post_ops(attr.get(), post_ops.get()),
                                 "Gemm");
  }
  PSTRAIN_ASSIGN_OR_RETURN(DnnlPrimitiveDesc pd,
                           CreatePrimitiveDesc(&desc, *ctx_, nullptr, "Gemm", attr.get()));
  auto matmul = std::make_unique<Matmul>();
  PSTRAIN_ASSIGN_OR_RETURN(matmul->primitive, DnnlPrimitive::Create(std::move(pd), "Gemm"));
  PSTRAIN_ASSIGN_OR_RETURN(matmul->a, CreateMemory(a_md, *ctx_, /*allocate=*/false, "Gemm"));
  PSTRAIN_ASSIGN_OR_RETURN(matmul->b, CreateMemory(b_md, *ctx_, /*allocate=*/false, "Gemm"));
  PSTRAIN_ASSIGN_OR_RETURN(matmul->c, CreateMemory(c_md, *ctx_, /*allocate=*/false, "Gemm"));
  return matmul;
}

}  // namespace pstrain::cpu_internal
