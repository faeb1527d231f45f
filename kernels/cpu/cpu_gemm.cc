// CpuGemm: oneDNN matmul primitives per shape for large products, dnnl_sgemm
// for the rest.
#include <omp.h>

#include <memory>
#include <utility>

#include "common/status_macros.h"
#include "kernels/cpu/cpu_plans.h"

namespace pstrain::cpu_internal {

CpuGemm::CpuGemm(std::shared_ptr<DnnlContext> ctx, int num_threads)
    : ctx_(std::move(ctx)), num_threads_(num_threads) {}

absl::Status CpuGemm::Run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const float* a, const float* b, float beta, float* c) {
  omp_set_num_threads(num_threads_);
  if (ctx_ == nullptr || m * n * k < kMatmulMinMacs) {
    PSTRAIN_RETURN_IF_DNNL_ERROR(dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k,
                                            alpha, a, trans_a ? m : k, b, trans_b ? k : n, beta,
                                            c, n),
                                 "Gemm");
    return absl::OkStatus();
  }
  PSTRAIN_ASSIGN_OR_RETURN(Matmul * matmul, GetMatmul(Key(trans_a, trans_b, m, n, k, alpha, beta)));
  PSTRAIN_RETURN_IF_ERROR(Bind(matmul->a, a, "Gemm"));
  PSTRAIN_RETURN_IF_ERROR(Bind(matmul->b, b, "Gemm"));
  PSTRAIN_RETURN_IF_ERROR(Bind(matmul->c, c, "Gemm"));
  return matmul->primitive.Execute(*ctx_,
                                   {{DNNL_ARG_SRC, matmul->a.get()},
                                    {DNNL_ARG_WEIGHTS, matmul->b.get()},
                                    {DNNL_ARG_DST, matmul->c.get()}},
                                   "Gemm");
}

absl::StatusOr<CpuGemm::Matmul*> CpuGemm::GetMatmul(const Key& key) {
  auto it = matmuls_.find(key);
  if (it != matmuls_.end()) return it->second.get();
  if (matmuls_.size() >= kMaxCachedShapes) matmuls_.clear();

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
  Matmul* out = matmul.get();
  matmuls_.emplace(key, std::move(matmul));
  return out;
}

}  // namespace pstrain::cpu_internal
