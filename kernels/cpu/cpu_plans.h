// Internal to kernels/cpu/: the CPU plan implementations behind
// CpuBackend::CreateConv2d / CreatePool2d / CreateBatchNorm. Each factory
// validates its config (INVALID_ARGUMENT naming the op) and builds its oneDNN
// primitives up front, so that every call afterwards only binds pointers.
//
// Threads: one thread at a time per plan; `num_threads` is the OpenMP team
// size the plan asks for (> 0).
#ifndef PSTRAIN_KERNELS_CPU_CPU_PLANS_H_
#define PSTRAIN_KERNELS_CPU_CPU_PLANS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dnnl_helpers.h"

namespace pstrain::cpu_internal {

absl::StatusOr<std::unique_ptr<Conv2dPlan>> CreateCpuConv2dPlan(
    std::shared_ptr<DnnlContext> ctx, const Conv2dConfig& config, CpuConvLayout layout,
    int num_threads);

absl::StatusOr<std::unique_ptr<Pool2dPlan>> CreateCpuPool2dPlan(std::shared_ptr<DnnlContext> ctx,
                                                                const Pool2dConfig& config,
                                                                int num_threads);

absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateCpuBatchNormPlan(
    const BatchNormConfig& config, int num_threads);

}  // namespace pstrain::cpu_internal

#endif  // PSTRAIN_KERNELS_CPU_CPU_PLANS_H_
