#include "kernels/backend.h"

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/backend_loader.h"

namespace pstrain {

absl::StatusOr<DeviceSpec> ParseDeviceSpec(std::string_view text_view) {
  const std::string text(text_view);
  DeviceSpec spec;
  if (text == "auto" || text.empty()) return spec;
  spec.automatic = false;
  if (text == "cpu") {
    spec.type = DeviceType::kCpu;
    return spec;
  }
  if (text == "cuda" || text == "gpu") {
    spec.type = DeviceType::kCuda;
    return spec;
  }
  if (text.rfind("cuda:", 0) == 0) {
    int ordinal = 0;
    if (!absl::SimpleAtoi(text.substr(5), &ordinal) || ordinal < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad device '", text, "': expected auto, cpu, cuda or cuda:N"));
    }
    spec.type = DeviceType::kCuda;
    spec.ordinal = ordinal;
    return spec;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("bad device '", text, "': expected auto, cpu, cuda or cuda:N"));
}

int CudaDeviceCount() { return CudaModule().device_count; }

bool CudaAvailable() { return CudaDeviceCount() > 0; }

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const DeviceSpec& spec) {
  return CreateBackend(spec, CudaModule().options.backend);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const DeviceSpec& spec,
                                                       const CudaBackendOptions& cuda_options) {
  DeviceSpec resolved = spec;
  if (spec.automatic) {
    resolved.type = CudaAvailable() ? DeviceType::kCuda : DeviceType::kCpu;
    resolved.ordinal = 0;
  }
  if (resolved.type == DeviceType::kCpu) return CreateCpuBackend();
  const CudaModuleStatus& cuda = CudaModule();
  if (cuda.device_count == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device cuda requested but ", cuda.Summary(), "; use --device cpu"));
  }
  if (resolved.ordinal >= cuda.device_count) {
    return absl::FailedPreconditionError(absl::StrCat("device cuda:", resolved.ordinal,
                                                      " requested but only ", cuda.device_count,
                                                      " CUDA device(s) are visible"));
  }
  return cuda.module->CreateBackend(resolved.ordinal, cuda_options);
}

}  // namespace pstrain
