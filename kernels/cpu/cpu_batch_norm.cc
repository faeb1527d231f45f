// BatchNormPlan with OpenMP loops, one channel per iteration: statistics are
// accumulated in double (two passes: mean, then centred variance), so the
// result does not drift with large N*spatial.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/cpu_plans.h"

namespace pstrain::cpu_internal {
namespace {

// Channels below this much total work run on one thread.
constexpr int64_t kParallelElements = int64_t{1} << 15;

class CpuBatchNormPlan final : public BatchNormPlan {
 public:
  CpuBatchNormPlan(const BatchNormConfig& config, int num_threads)
      : config_(config), num_threads_(num_threads) {}

  absl::Status ForwardTraining(const void* x, const float* gamma, const float* beta, void* y,
                               float* running_mean, float* running_var, float* save_mean,
                               float* save_inv_std) override {
    return ForwardTrainingF32(AsF32(x), gamma, beta, AsF32(y), running_mean, running_var, save_mean,
                              save_inv_std);
  }
  absl::Status ForwardInference(const void* x, const float* gamma, const float* beta,
                                const float* running_mean, const float* running_var,
                                void* y) override {
    return ForwardInferenceF32(AsF32(x), gamma, beta, running_mean, running_var, AsF32(y));
  }
  absl::Status Backward(const void* x, const void* dy, const float* gamma, const float* save_mean,
                        const float* save_inv_std, void* dx, float* dgamma, float* dbeta) override {
    return BackwardF32(AsF32(x), AsF32(dy), gamma, save_mean, save_inv_std, AsF32(dx), dgamma,
                       dbeta);
  }

 private:
  absl::Status ForwardTrainingF32(const float* x, const float* gamma, const float* beta, float* y,
                                  float* running_mean, float* running_var, float* save_mean,
                                  float* save_inv_std) {
    if (x == nullptr || gamma == nullptr || beta == nullptr || y == nullptr ||
        running_mean == nullptr || running_var == nullptr || save_mean == nullptr ||
        save_inv_std == nullptr) {
      return absl::InvalidArgumentError("BatchNorm.ForwardTraining: null pointer argument");
    }
    const int64_t n = config_.n, channels = config_.c, spatial = config_.spatial;
    const int64_t m = n * spatial;
    const double unbias = m > 1 ? static_cast<double>(m) / static_cast<double>(m - 1) : 1.0;
    const float momentum = config_.momentum;
#pragma omp parallel for schedule(static) num_threads(num_threads_) if (m * channels >= kParallelElements)
    for (int64_t c = 0; c < channels; ++c) {
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float* row = x + (i * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s) sum += row[s];
      }
      const double mean = sum / static_cast<double>(m);
      double sq = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float* row = x + (i * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s) {
          const double d = row[s] - mean;
          sq += d * d;
        }
      }
      const double var = sq / static_cast<double>(m);
      const float inv_std = static_cast<float>(1.0 / std::sqrt(var + config_.epsilon));
      const float scale = gamma[c] * inv_std;
      const float shift = beta[c] - static_cast<float>(mean) * scale;
      for (int64_t i = 0; i < n; ++i) {
        const float* in = x + (i * channels + c) * spatial;
        float* out = y + (i * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s) out[s] = in[s] * scale + shift;
      }
      save_mean[c] = static_cast<float>(mean);
      save_inv_std[c] = inv_std;
      running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * static_cast<float>(mean);
      running_var[c] =
          (1.f - momentum) * running_var[c] + momentum * static_cast<float>(var * unbias);
    }
    return absl::OkStatus();
  }

  absl::Status ForwardInferenceF32(const float* x, const float* gamma, const float* beta,
                                   const float* running_mean, const float* running_var, float* y) {
    if (x == nullptr || gamma == nullptr || beta == nullptr || running_mean == nullptr ||
        running_var == nullptr || y == nullptr) {
      return absl::InvalidArgumentError("BatchNorm.ForwardInference: null pointer argument");
    }
    const int64_t n = config_.n, channels = config_.c, spatial = config_.spatial;
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads_) if (n * channels * spatial >= kParallelElements)
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t c = 0; c < channels; ++c) {
        const float scale = gamma[c] / std::sqrt(running_var[c] + config_.epsilon);
        const float shift = beta[c] - running_mean[c] * scale;
        const float* in = x + (i * channels + c) * spatial;
        float* out = y + (i * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s) out[s] = in[s] * scale + shift;
      }
    }
    return absl::OkStatus();
  }

  absl::Status BackwardF32(const float* x, const float* dy, const float* gamma,
                           const float* save_mean, const float* save_inv_std, float* dx,
                           float* dgamma, float* dbeta) {
    if (x == nullptr || dy == nullptr || gamma == nullptr || save_mean == nullptr ||
        save_inv_std == nullptr || dx == nullptr || dgamma == nullptr || dbeta == nullptr) {
      return absl::InvalidArgumentError("BatchNorm.Backward: null pointer argument");
    }
    const int64_t n = config_.n, channels = config_.c, spatial = config_.spatial;
    const int64_t m = n * spatial;
#pragma omp parallel for schedule(static) num_threads(num_threads_) if (m * channels >= kParallelElements)
    for (int64_t c = 0; c < channels; ++c) {
      const double mean = save_mean[c];
      const double inv_std = save_inv_std[c];
      double sum_dy = 0, sum_dy_xhat = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float* xr = x + (i * channels + c) * spatial;
        const float* dyr = dy + (i * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s) {
          sum_dy += dyr[s];
          sum_dy_xhat += dyr[s] * ((xr[s] - mean) * inv_std);
        }
      }
      dbeta[c] = static_cast<float>(sum_dy);
      dgamma[c] = static_cast<float>(sum_dy_xhat);
      // dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat)).
      const float k = static_cast<float>(gamma[c] * inv_std);
      const float mean_dy = static_cast<float>(sum_dy / static_cast<double>(m));
      const float mean_dy_xhat = static_cast<float>(sum_dy_xhat / static_cast<double>(m));
      const float mean_f = static_cast<float>(mean), inv_std_f = static_cast<float>(inv_std);
      for (int64_t i = 0; i < n; ++i) {
        const float* xr = x + (i * channels + c) * spatial;
        const float* dyr = dy + (i * channels + c) * spatial;
        float* dxr = dx + (i * channels + c) * spatial;
        for (int64_t s = 0; s < spatial; ++s) {
          const float xhat = (xr[s] - mean_f) * inv_std_f;
          dxr[s] = k * (dyr[s] - mean_dy - xhat * mean_dy_xhat);
        }
      }
    }
    return absl::OkStatus();
  }

  // Constant after construction.
  const BatchNormConfig config_;
  const int num_threads_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BatchNormPlan>> CreateCpuBatchNormPlan(
    const BatchNormConfig& config, int num_threads) {
  if (config.n <= 0 || config.c <= 0 || config.spatial <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("BatchNorm: n, c and spatial must be positive (n=",
                                                   config.n, " c=", config.c,
                                                   " spatial=", config.spatial, ")"));
  }
  if (!(config.epsilon > 0.f) || !(config.momentum >= 0.f && config.momentum <= 1.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("BatchNorm: epsilon must be > 0 and momentum in [0, 1] (epsilon=",
                     config.epsilon, " momentum=", config.momentum, ")"));
  }
  return std::unique_ptr<BatchNormPlan>(std::make_unique<CpuBatchNormPlan>(config, num_threads));
}

}  // namespace pstrain::cpu_internal
