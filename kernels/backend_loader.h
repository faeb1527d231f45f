// Backend modules loaded at run time (see kernels/backend_module.h for the
// contract a module implements). The CUDA backend is such a module,
// libpstrain_cuda.so, so that pstrain's binaries link no CUDA library and
// start on any machine; `--device auto` uses CUDA only when the module loads
// and a GPU is visible.
//
//   // In main, before anything creates a backend (optional: defaults else).
//   PSTRAIN_RETURN_IF_ERROR(ConfigureCudaModule({.path = flag_path, .backend = options}));
//   const CudaModuleStatus& cuda = CudaModule();   // looked up once per process
//   if (cuda.device_count > 0) {
//     PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Backend> b,
//                              cuda.module->CreateBackend(0, cuda.options.backend));
//   } else {
//     LOG(INFO) << cuda.Summary();   // says which of module, library or device is missing
//   }
//
// Where the CUDA module is looked for, in order (the first file that exists
// is loaded, the others are not tried):
//   1. CudaModuleOptions::path, when not empty (then nowhere else);
//      pstrain-worker sets it from --cuda-module, else $PSTRAIN_CUDA_MODULE;
//   2. <dir of the executable>/../lib/pstrain/libpstrain_cuda.so  (installed);
//   3. <dir of the executable>/../lib/libpstrain_cuda.so          (build tree);
//   4. <dir of the executable>/libpstrain_cuda.so.
// Nothing here reads the environment.
//
// Threads: every function here may be called from any thread. A loaded module
// is never unloaded (backends it made may live until the process exits).
#ifndef PSTRAIN_KERNELS_BACKEND_LOADER_H_
#define PSTRAIN_KERNELS_BACKEND_LOADER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/backend_module.h"
#include "kernels/cuda_backend_options.h"

namespace pstrain {

inline constexpr const char* kCudaModuleFileName = "libpstrain_cuda.so";
// The environment variable pstrain-worker's main falls back to when
// --cuda-module is not given (read there, never here).
inline constexpr const char* kCudaModuleEnvVar = "PSTRAIN_CUDA_MODULE";

// A module that loaded and whose build id matches this binary's.
class LoadedBackendModule {
 public:
  LoadedBackendModule(std::string path, const PstrainBackendModule* entry)
      : path_(std::move(path)), entry_(entry) {}

  const std::string& path() const { return path_; }
  // The module's device count; 0 with the module's reason in *why otherwise.
  int DeviceCount(std::string* why) const;
  // A backend on device `ordinal` with `options`, which cross the boundary
  // as PstrainCudaBackendOptions. FAILED_PRECONDITION with the module's
  // message when it cannot create one (no such device, options it refuses).
  absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
      int ordinal, const CudaBackendOptions& options = {}) const;
  // The same with the options in their C form as given, unchecked here: what
  // a host of another build would send (the tests of the module's checks).
  absl::StatusOr<std::unique_ptr<Backend>> CreateBackendWithModuleOptions(
      int ordinal, const PstrainCudaBackendOptions& options) const;

 private:
  std::string path_;
  const PstrainBackendModule* entry_;  // Static data of the module; never null.
};

// Opens the module at `path` and checks it before calling into it:
//  * NOT_FOUND: no file at `path`;
//  * FAILED_PRECONDITION: the dynamic loader failed (its message names the
//    library that is missing, e.g. "libcudnn.so.9: cannot open shared object
//    file"), the file exports no kBackendModuleEntrySymbol, or its ABI version
//    or build id differs from this binary's (both are named).
absl::StatusOr<LoadedBackendModule> LoadBackendModule(const std::string& path);

// The candidate paths of the CUDA module, in search order (see above):
// {path} when `path` is not empty.
std::vector<std::string> CudaModuleCandidates(const std::string& path);

// Where this process looks for the CUDA module, and the options of the
// backends that CreateBackend(const DeviceSpec&) makes with it.
struct CudaModuleOptions {
  std::string path;            // "": the default search (see above).
  CudaBackendOptions backend;  // Every CUDA backend's, unless a caller passes its own.
};

// Sets the options CudaModule() looks with. The module is looked for once per
// process, so this is for main (or a test's set-up), before anything asks for
// a backend or a device count: FAILED_PRECONDITION once CudaModule() has
// looked, so that options can never be dropped silently.
absl::Status ConfigureCudaModule(CudaModuleOptions options);

// What this process found when it looked for the CUDA backend.
struct CudaModuleStatus {
  CudaModuleOptions options;  // What it looked with (ConfigureCudaModule, else defaults).
  // OK when a module loaded; otherwise why not (NOT_FOUND naming every path
  // tried, or LoadBackendModule's FAILED_PRECONDITION).
  absl::Status load;
  std::optional<LoadedBackendModule> module;
  int device_count = 0;          // 0 unless the module loaded and sees devices.
  std::string no_device_reason;  // The module's reason when device_count is 0.

  // One line for logs and errors: which of module, library or device is
  // missing, or "cuda module <path>: N device(s)".
  std::string Summary() const;
};

// Looks for the CUDA module on first use (thread-safe), with the options of
// ConfigureCudaModule, and returns what it found; later calls return the same
// object.
const CudaModuleStatus& CudaModule();

}  // namespace pstrain

#endif  // PSTRAIN_KERNELS_BACKEND_LOADER_H_
