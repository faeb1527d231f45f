// The contract between a pstrain binary and a backend module loaded at run
// time (libpstrain_cuda.so), so that one pstrain-worker binary runs on every
// node: a CPU-only machine needs no CUDA library, a GPU node adds the module.
//
// A module is a shared object that exports one C symbol,
// kBackendModuleEntrySymbol, returning a pointer to a static
// PstrainBackendModule:
//
//   extern "C" PSTRAIN_MODULE_EXPORT const PstrainBackendModule* pstrain_backend_module_v1() {
//     static const PstrainBackendModule module = {kBackendModuleAbiVersion, PSTRAIN_BUILD_ID,
//                                                 "cuda", &DeviceCount, &Create};
//     return &module;
//   }
//
// The host (kernels/backend_loader.h) reads abi_version and build_id before it
// calls anything else, and refuses a module whose build_id differs from its
// own (common/build_info.h): Backend is a C++ interface, so both sides must be
// built from the same sources. Backends cross the boundary as plain pointers
// the host takes ownership of; errors cross as text, because a Status may not
// be passed before the build ids are known to match. The backend's options
// cross as PstrainCudaBackendOptions, a C struct that opens with its version
// and size: create_backend checks both, and every field's range, before it
// does anything else (FromModuleOptions, kernels/cuda_backend_options.h), so
// that a host that sends options the module cannot read gets a message, not
// a backend configured by accident.
//
// Threads: device_count and create_backend may be called from any thread; a
// module must make them safe to call concurrently.
#ifndef PSTRAIN_KERNELS_BACKEND_MODULE_H_
#define PSTRAIN_KERNELS_BACKEND_MODULE_H_

#include <cstddef>
#include <cstdint>

namespace pstrain {
class Backend;
}  // namespace pstrain

#define PSTRAIN_MODULE_EXPORT __attribute__((visibility("default")))

extern "C" {

// The CUDA backend's options in their C form (the C++ form, and the
// conversions both ways, are in kernels/cuda_backend_options.h). `version`
// and `size` open every version of this struct; the fields after them are
// those of that version. Every field is a uint32_t, so the layout has no
// padding; booleans are 0 or 1, policies a CudaRoutePolicy value.
struct PstrainCudaBackendOptions {
  uint32_t version;  // kCudaBackendOptionsVersion of the host's build.
  uint32_t size;     // sizeof(PstrainCudaBackendOptions) in the host's build.
  uint32_t fft_transforms;
  uint32_t winograd_transforms;
  uint32_t fp32_route;
  uint32_t own_conv;
  uint32_t log_conv_routes;
  uint32_t cudnn_batch_norm;
  uint32_t concurrent_conv_backward;
  uint32_t channels_last;
};

struct PstrainBackendModule {
  // kBackendModuleAbiVersion of the module's build; the host checks it first.
  uint32_t abi_version;
  // PSTRAIN_BUILD_ID of the module's build (common/build_info.h).
  const char* build_id;
  // The device kind the module drives, e.g. "cuda".
  const char* device;
  // Number of usable devices. Returns 0 and writes a NUL-terminated reason
  // ("no CUDA driver", "no CUDA-capable device is detected", ...) into
  // why[0..why_size) when there is none; never fails otherwise.
  int (*device_count)(char* why, size_t why_size);
  // Creates a backend on device `ordinal` with `options` (never null; read
  // during the call only); the caller owns the result. Returns nullptr and
  // writes a NUL-terminated message into error[0..error_size) on failure,
  // options the module cannot read included.
  pstrain::Backend* (*create_backend)(int ordinal, const PstrainCudaBackendOptions* options,
                                      char* error, size_t error_size);
};

typedef const PstrainBackendModule* (*PstrainBackendModuleEntry)();

}  // extern "C"

namespace pstrain {

// Bumped whenever PstrainBackendModule changes shape (2: create_backend takes
// the options). The entry symbol's "v1" names the entry function's own
// signature, which has not changed.
inline constexpr uint32_t kBackendModuleAbiVersion = 2;
// Bumped whenever PstrainCudaBackendOptions changes shape or meaning.
inline constexpr uint32_t kCudaBackendOptionsVersion = 1;
inline constexpr const char* kBackendModuleEntrySymbol = "pstrain_backend_module_v1";

}  // namespace pstrain

#endif  // PSTRAIN_KERNELS_BACKEND_MODULE_H_
