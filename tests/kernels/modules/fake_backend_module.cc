// A backend module for tests/kernels/backend_loader_test.cc, built several
// times with different definitions (tests/CMakeLists.txt):
//   FAKE_BUILD_ID   the build id it reports (default: this build's, PSTRAIN_BUILD_ID)
//   FAKE_ABI        the module ABI version it reports (default: the current one)
//   FAKE_DEVICES    how many devices it reports (default 1); with 0 it gives a reason
//   FAKE_NEEDS_DEP  references a function of a library that is not on the
//                   loader's path, so dlopen fails naming that library
//   FAKE_NO_ENTRY   exports no entry point at all
//   FAKE_ECHO_OPTIONS  creates no backend: refuses with a message that names
//                   every option it received, so a test sees what crossed
// Its "device" is the CPU backend, so a test can run real ops through a
// backend that crossed the module boundary. It checks the options it is given
// as the CUDA module does (FromModuleOptions) and refuses what that refuses,
// so the loader's side of the options is tested without CUDA.
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/backend_module.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda_backend_options.h"
#include "pstrain_build_info.h"

#ifndef FAKE_BUILD_ID
#define FAKE_BUILD_ID PSTRAIN_BUILD_ID
#endif
#ifndef FAKE_ABI
#define FAKE_ABI ::pstrain::kBackendModuleAbiVersion
#endif
#ifndef FAKE_DEVICES
#define FAKE_DEVICES 1
#endif

#if defined(FAKE_NEEDS_DEP)
extern "C" int pstrain_test_missing_dependency();
#endif

namespace {

void Write(const char* text, char* buffer, size_t size) {
  if (buffer == nullptr || size == 0) return;
  std::strncpy(buffer, text, size - 1);
  buffer[size - 1] = '\0';
}

int DeviceCount(char* why, size_t why_size) {
#if defined(FAKE_NEEDS_DEP)
  if (pstrain_test_missing_dependency() != 0) return 0;
#endif
  if (FAKE_DEVICES == 0) Write("fake module: no fake device plugged in", why, why_size);
  return FAKE_DEVICES;
}

pstrain::Backend* Create(int ordinal, const PstrainCudaBackendOptions* module_options, char* error,
                         size_t error_size) {
  absl::StatusOr<pstrain::CudaBackendOptions> options = pstrain::FromModuleOptions(module_options);
  if (!options.ok()) {
    Write(options.status().ToString().c_str(), error, error_size);
    return nullptr;
  }
#if defined(FAKE_ECHO_OPTIONS)
  {
    const std::string echo = absl::StrCat(
        "fake module: options transforms=", pstrain::CudnnTransformsName(*options),
        " fp32_route=", pstrain::CudaRoutePolicyName(options->fp32_route),
        " own_conv=", pstrain::CudaRoutePolicyName(options->own_conv),
        " cudnn_batch_norm=", static_cast<int>(options->cudnn_batch_norm),
        " concurrent_conv_backward=", static_cast<int>(options->concurrent_conv_backward),
        " channels_last=", static_cast<int>(options->channels_last),
        " log_conv_routes=", static_cast<int>(options->log_conv_routes));
    Write(echo.c_str(), error, error_size);
    return nullptr;
  }
#endif
  if (ordinal >= FAKE_DEVICES) {
    Write("fake module: no such device", error, error_size);
    return nullptr;
  }
  return pstrain::CreateCpuBackend().release();
}

}  // namespace

#if !defined(FAKE_NO_ENTRY)
extern "C" PSTRAIN_MODULE_EXPORT const PstrainBackendModule* pstrain_backend_module_v1() {
  static const PstrainBackendModule module = {FAKE_ABI, FAKE_BUILD_ID, "fake", &DeviceCount,
                                              &Create};
  return &module;
}
#else
// Exports something, just not the entry point.
extern "C" PSTRAIN_MODULE_EXPORT int pstrain_not_a_backend_module() {
  return DeviceCount(nullptr, 0) + (Create(99, nullptr, nullptr, 0) == nullptr ? 0 : 1);
}
#endif
