#include "kernels/backend_loader.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/build_info.h"

namespace pstrain {
namespace {

constexpr size_t kMessageBytes = 1024;

// Directory of the running executable ("" when /proc is unavailable).
std::string ExecutableDir() {
  std::array<char, 4096> path{};
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) return "";
  std::string exe(path.data(), static_cast<size_t>(n));
  const size_t slash = exe.rfind('/');
  return slash == std::string::npos ? "" : exe.substr(0, slash);
}

bool FileExists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

// A C string written by a module into a fixed buffer, never unterminated.
std::string FromModuleBuffer(std::array<char, kMessageBytes>& buffer) {
  buffer.back() = '\0';
  return std::string(buffer.data());
}

#if defined(PSTRAIN_CUDA_MODULE_BUILT)
constexpr const char* kBuildHint = "";
#else
constexpr const char* kBuildHint =
    " (this build was configured without CUDA, PSTRAIN_WITH_CUDA=OFF, so it made no module)";
#endif

CudaModuleStatus FindCudaModule(CudaModuleOptions options) {
  CudaModuleStatus status;
  status.options = std::move(options);
  const std::vector<std::string> candidates = CudaModuleCandidates(status.options.path);
  for (const std::string& path : candidates) {
    if (!FileExists(path)) continue;
    std::array<char, PATH_MAX> canonical{};
    absl::StatusOr<LoadedBackendModule> module =
        LoadBackendModule(realpath(path.c_str(), canonical.data()) ? canonical.data() : path);
    if (!module.ok()) {
      status.load = module.status();
      return status;
    }
    status.module = *std::move(module);
    status.device_count = status.module->DeviceCount(&status.no_device_reason);
    return status;
  }
  status.load = absl::NotFoundError(absl::StrCat(
      "the CUDA module ", kCudaModuleFileName, " was not found (looked for ",
      absl::StrJoin(candidates, ", "), ")", kBuildHint,
      "; install it beside pstrain-worker in ../lib/pstrain/, or give its path "
      "(pstrain-worker --cuda-module, or ", kCudaModuleEnvVar, ")"));
  return status;
}

// The process's one look-up of the CUDA module, and the options it uses.
struct CudaModuleRegistry {
  absl::Mutex mu;
  CudaModuleOptions options ABSL_GUARDED_BY(mu);
  // Set once by the first CudaModule(); never freed (the module is never
  // unloaded either).
  const CudaModuleStatus* status ABSL_GUARDED_BY(mu) = nullptr;
};

CudaModuleRegistry& Registry() {
  static CudaModuleRegistry* const registry = new CudaModuleRegistry;
  return *registry;
}

}  // namespace

int LoadedBackendModule::DeviceCount(std::string* why) const {
  std::array<char, kMessageBytes> reason{};
  const int count = entry_->device_count(reason.data(), reason.size());
  if (count > 0) return count;
  if (why != nullptr) *why = FromModuleBuffer(reason);
  return 0;
}

absl::StatusOr<std::unique_ptr<Backend>> LoadedBackendModule::CreateBackend(
    int ordinal, const CudaBackendOptions& options) const {
  return CreateBackendWithModuleOptions(ordinal, ToModuleOptions(options));
}

absl::StatusOr<std::unique_ptr<Backend>> LoadedBackendModule::CreateBackendWithModuleOptions(
    int ordinal, const PstrainCudaBackendOptions& options) const {
  std::array<char, kMessageBytes> error{};
  Backend* backend = entry_->create_backend(ordinal, &options, error.data(), error.size());
  if (backend == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(entry_->device, ":", ordinal, ": ", FromModuleBuffer(error)));
  }
  return std::unique_ptr<Backend>(backend);
}

absl::StatusOr<LoadedBackendModule> LoadBackendModule(const std::string& path) {
  if (!FileExists(path)) {
    return absl::NotFoundError(absl::StrCat("backend module ", path, " does not exist"));
  }
  // RTLD_NOW: a missing library or symbol fails here, not at the first call.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return absl::FailedPreconditionError(absl::StrCat(
        "backend module ", path, " could not be loaded: ", error ? error : "unknown error",
        " (a library it needs is missing or broken: install the CUDA runtime, cuBLAS and "
        "cuDNN, or add their directory to LD_LIBRARY_PATH)"));
  }
  auto entry_point = reinterpret_cast<PstrainBackendModuleEntry>(
      dlsym(handle, kBackendModuleEntrySymbol));
  if (entry_point == nullptr) {
    dlclose(handle);
    return absl::FailedPreconditionError(absl::StrCat("backend module ", path, " exports no ",
                                                      kBackendModuleEntrySymbol,
                                                      ": it is not a pstrain backend module"));
  }
  const PstrainBackendModule* entry = entry_point();
  if (entry == nullptr || entry->abi_version != kBackendModuleAbiVersion) {
    const uint32_t abi = entry == nullptr ? 0 : entry->abi_version;
    dlclose(handle);
    return absl::FailedPreconditionError(
        absl::StrCat("backend module ", path, " speaks module ABI ", abi, ", this binary ",
                     kBackendModuleAbiVersion, "; install the module from the same build"));
  }
  if (entry->build_id == nullptr || std::strcmp(entry->build_id, BuildId()) != 0) {
    const std::string module_id = entry->build_id == nullptr ? "(none)" : entry->build_id;
    dlclose(handle);
    return absl::FailedPreconditionError(absl::StrCat(
        "backend module ", path, " was built from ", module_id, " but this binary from ",
        BuildId(), "; install the module from the same build"));
  }
  // Never dlclose'd from here on: backends it creates may live until exit.
  return LoadedBackendModule(path, entry);
}

std::vector<std::string> CudaModuleCandidates(const std::string& path) {
  if (!path.empty()) return {path};
  const std::string dir = ExecutableDir();
  if (dir.empty()) return {};
  return {
      absl::StrCat(dir, "/../lib/pstrain/", kCudaModuleFileName),
      absl::StrCat(dir, "/../lib/", kCudaModuleFileName),
      absl::StrCat(dir, "/", kCudaModuleFileName),
  };
}

std::string CudaModuleStatus::Summary() const {
  if (!load.ok()) return std::string(load.message());
  if (device_count == 0) {
    return absl::StrCat("the CUDA module ", module->path(),
                        " loaded but no CUDA device is visible: ", no_device_reason);
  }
  return absl::StrCat("cuda module ", module->path(), ": ", device_count, " device(s)");
}

absl::Status ConfigureCudaModule(CudaModuleOptions options) {
  CudaModuleRegistry& registry = Registry();
  absl::MutexLock lock(&registry.mu);
  if (registry.status != nullptr) {
    return absl::FailedPreconditionError(
        "ConfigureCudaModule: the CUDA module was already looked for in this process; "
        "configure it before anything asks for a backend or a device count");
  }
  registry.options = std::move(options);
  return absl::OkStatus();
}

const CudaModuleStatus& CudaModule() {
  CudaModuleRegistry& registry = Registry();
  absl::MutexLock lock(&registry.mu);
  if (registry.status == nullptr) {
    registry.status = new CudaModuleStatus(FindCudaModule(registry.options));
  }
  return *registry.status;
}

}  // namespace pstrain
