// Fused optimizer updates (one pass over param, grad and state) in PyTorch's
// formulation, as specified in kernels/backend.h. Bias corrections are
// computed once on the host in double precision.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch_util.cuh"

namespace pstrain::cuda {

// --- SGD (optionally momentum, Nesterov, L2) -----------------------------------

__global__ void SgdUpdateKernel(float* param, const float* grad, float* velocity, int64_t count,
                                float learning_rate, float momentum, bool nesterov,
                                float weight_decay) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) {
    const float p = param[i];
    const float g = grad[i] + weight_decay * p;
    float step = g;
    if (momentum != 0.f) {
      const float v = momentum * velocity[i] + g;
      velocity[i] = v;
      step = nesterov ? g + momentum * v : v;
    }
    param[i] = p - learning_rate * step;
  }
}

absl::Status LaunchSgdUpdate(float* param, const float* grad, float* velocity, int64_t count,
                             const SgdHyper& hyper, cudaStream_t stream) {
  constexpr const char* kOp = "SgdUpdate";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (!std::isfinite(hyper.learning_rate) || !std::isfinite(hyper.momentum) ||
      !std::isfinite(hyper.weight_decay)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": non-finite hyper-parameter"));
  }
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {param, grad}));
  if (hyper.momentum != 0.f) PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {velocity}));
  SgdUpdateKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(
      param, grad, velocity, count, hyper.learning_rate, hyper.momentum, hyper.nesterov,
      hyper.weight_decay);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

// --- Adam / AdamW ----------------------------------------------------------------

__global__ void AdamUpdateKernel(float* param, const float* grad, float* m, float* v, int64_t count,
                                 float learning_rate, float beta1, float beta2, float epsilon,
                                 float weight_decay, bool decoupled, float step_size,
                                 float inv_sqrt_bias_correction2) {
  for (int64_t i = GlobalThreadIndex(); i < count; i += GridStride()) {
    float p = param[i];
    float g = grad[i];
    if (decoupled) {
      p *= 1.f - learning_rate * weight_decay;
    } else {
      g += weight_decay * p;
    }
    const float m_new = beta1 * m[i] + (1.f - beta1) * g;
    const float v_new = beta2 * v[i] + (1.f - beta2) * g * g;
    m[i] = m_new;
    v[i] = v_new;
    const float denom = sqrtf(v_new) * inv_sqrt_bias_correction2 + epsilon;
    param[i] = p - step_size * (m_new / denom);
  }
}

absl::Status LaunchAdamUpdate(float* param, const float* grad, float* m, float* v, int64_t count,
                              const AdamHyper& hyper, cudaStream_t stream) {
  constexpr const char* kOp = "AdamUpdate";
  PSTRAIN_RETURN_IF_ERROR(CheckCount(kOp, count));
  if (hyper.step < 1) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": step is 1-based, got ", hyper.step));
  }
  if (!(hyper.beta1 >= 0.f && hyper.beta1 < 1.f) || !(hyper.beta2 >= 0.f && hyper.beta2 < 1.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": betas must be in [0, 1), got ", hyper.beta1, ", ", hyper.beta2));
  }
  if (!std::isfinite(hyper.learning_rate) || !std::isfinite(hyper.weight_decay) ||
      !(hyper.epsilon > 0.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": need finite learning rate and weight decay and epsilon > 0"));
  }
  if (count == 0) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(CheckPointers(kOp, {param, grad, m, v}));
  const double step = static_cast<double>(hyper.step);
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(hyper.beta1), step);
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(hyper.beta2), step);
  const float step_size = static_cast<float>(hyper.learning_rate / bias_correction1);
  const float inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  AdamUpdateKernel<<<BlocksFor(count), kThreadsPerBlock, 0, stream>>>(
      param, grad, m, v, count, hyper.learning_rate, hyper.beta1, hyper.beta2, hyper.epsilon,
      hyper.weight_decay, hyper.decoupled_weight_decay, step_size, inv_sqrt_bias_correction2);
  PSTRAIN_RETURN_IF_LAUNCH_FAILED(kOp);
  return absl::OkStatus();
}

}  // namespace pstrain::cuda
