// The entry point of libpstrain_cuda.so: the CUDA backend as a module loaded
// at run time by kernels/backend_loader.cc (contract: kernels/backend_module.h).
// Only pstrain_backend_module_v1 is exported; everything else in the module,
// cudart (linked statically) included, stays hidden. The build id is the
// macro compiled into this file, never a symbol the host could interpose.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/backend_module.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda_backend_options.h"
#include "pstrain_build_info.h"  // Generated; PSTRAIN_BUILD_ID.

namespace pstrain {
namespace {

void CopyMessage(std::string_view message, char* buffer, size_t buffer_size) {
  if (buffer == nullptr || buffer_size == 0) return;
  const size_t n = std::min(message.size(), buffer_size - 1);
  std::memcpy(buffer, message.data(), n);
  buffer[n] = '\0';
}

int ModuleDeviceCount(char* why, size_t why_size) {
  std::string reason;
  const int count = CudaRuntimeDeviceCount(&reason);
  if (count == 0) CopyMessage(reason, why, why_size);
  return count;
}

// The options are checked first, so that a host that sends options this
// module cannot read hears so on any machine, with or without a device.
Backend* ModuleCreateBackend(int ordinal, const PstrainCudaBackendOptions* module_options,
                             char* error, size_t error_size) {
  absl::StatusOr<CudaBackendOptions> options = FromModuleOptions(module_options);
  if (!options.ok()) {
    CopyMessage(options.status().ToString(), error, error_size);
    return nullptr;
  }
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCudaBackend(ordinal, *options);
  if (!backend.ok()) {
    CopyMessage(backend.status().ToString(), error, error_size);
    return nullptr;
  }
  return backend->release();
}

}  // namespace
}  // namespace pstrain

extern "C" PSTRAIN_MODULE_EXPORT const PstrainBackendModule* pstrain_backend_module_v1() {
  static const PstrainBackendModule module = {
      pstrain::kBackendModuleAbiVersion, PSTRAIN_BUILD_ID, "cuda",
      &pstrain::ModuleDeviceCount, &pstrain::ModuleCreateBackend};
  return &module;
}
