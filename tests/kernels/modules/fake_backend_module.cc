// A backend module for tests/kernels/backend_loader_test.cc, built several
// times with different definitions (tests/CMakeLists.txt):
//   FAKE_BUILD_ID   the build id it reports (default: this build's, PSTRAIN_BUILD_ID)
//   FAKE_ABI        the module ABI version it reports (default: the current one)
//   FAKE_DEVICES    how many devices it reports (default 1); with 0 it gives a reason
//   FAKE_NEEDS_DEP  references a function of a library that is not on the
//                   loader's path, so dlopen fails naming that library
//   FAKE_NO_ENTRY   exports no entry point at all
// Its "device" is the CPU backend, so a test can run real ops through a
// backend that crossed the module boundary.
#include <cstddef>
#include <cstring>
#include <memory>

#include "kernels/backend.h"
#include "kernels/backend_module.h"
#include "kernels/cpu/cpu_backend.h"
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

pstrain::Backend* Create(int ordinal, char* error, size_t error_size) {
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
  return DeviceCount(nullptr, 0) + (Create(99, nullptr, 0) == nullptr ? 0 : 1);
}
#endif
