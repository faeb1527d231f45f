#include "worker/gpu_monitor.h"

#include <dlfcn.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "prometheus/family.h"

namespace pstrain {

namespace {

// NVML's C ABI, as documented in nvml.h (only what is used here).
using NvmlReturn = int;  // nvmlReturn_t; 0 = NVML_SUCCESS.
using NvmlDevice = struct NvmlDeviceOpaque*;
struct NvmlUtilization {  // nvmlUtilization_t
  unsigned int gpu;       // Percent of the sample period a kernel ran.
  unsigned int memory;    // Percent of the period device memory was read or written.
};
struct NvmlMemory {  // nvmlMemory_t (v1)
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
constexpr int kNvmlTemperatureGpu = 0;    // NVML_TEMPERATURE_GPU
constexpr unsigned int kNameLength = 96;  // NVML_DEVICE_NAME_V2_BUFFER_SIZE

template <typename F>
bool Resolve(void* library, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(library, name));
  if (*out == nullptr && missing->empty()) *missing = name;
  return *out != nullptr;
}

}  // namespace

struct GpuMonitor::Api {
  NvmlReturn (*init)() = nullptr;
  NvmlReturn (*shutdown)() = nullptr;
  NvmlReturn (*get_count)(unsigned int*) = nullptr;
  NvmlReturn (*get_handle)(unsigned int, NvmlDevice*) = nullptr;
  NvmlReturn (*get_utilization)(NvmlDevice, NvmlUtilization*) = nullptr;
  NvmlReturn (*get_memory)(NvmlDevice, NvmlMemory*) = nullptr;
  NvmlReturn (*get_temperature)(NvmlDevice, int, unsigned int*) = nullptr;
  NvmlReturn (*get_power)(NvmlDevice, unsigned int*) = nullptr;  // Milliwatts.
  NvmlReturn (*get_name)(NvmlDevice, char*, unsigned int) = nullptr;
  const char* (*error_string)(NvmlReturn) = nullptr;  // Optional.

  std::string Error(NvmlReturn code) const {
    if (error_string != nullptr) return absl::StrCat(error_string(code), " (", code, ")");
    return absl::StrCat("NVML error ", code);
  }
};

GpuMonitor::GpuMonitor() : api_(std::make_unique<Api>()) {}

std::unique_ptr<GpuMonitor> GpuMonitor::Open(const std::string& library) {
  std::unique_ptr<GpuMonitor> monitor(new GpuMonitor());
  monitor->library_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (monitor->library_ == nullptr) {
    const char* error = dlerror();
    monitor->reason_ =
        absl::StrCat("cannot load ", library,
                     " (no NVIDIA driver?): ", error != nullptr ? error : "unknown error");
    return monitor;
  }
  Api& api = *monitor->api_;
  std::string missing;
  void* lib = monitor->library_;
  Resolve(lib, "nvmlInit_v2", &api.init, &missing);
  Resolve(lib, "nvmlShutdown", &api.shutdown, &missing);
  Resolve(lib, "nvmlDeviceGetCount_v2", &api.get_count, &missing);
  Resolve(lib, "nvmlDeviceGetHandleByIndex_v2", &api.get_handle, &missing);
  Resolve(lib, "nvmlDeviceGetUtilizationRates", &api.get_utilization, &missing);
  Resolve(lib, "nvmlDeviceGetMemoryInfo", &api.get_memory, &missing);
  Resolve(lib, "nvmlDeviceGetTemperature", &api.get_temperature, &missing);
  Resolve(lib, "nvmlDeviceGetPowerUsage", &api.get_power, &missing);
  Resolve(lib, "nvmlDeviceGetName", &api.get_name, &missing);
  api.error_string = reinterpret_cast<const char* (*)(NvmlReturn)>(dlsym(lib, "nvmlErrorString"));
  if (!missing.empty()) {
    monitor->reason_ = absl::StrCat(library, " lacks ", missing);
    return monitor;
  }
  const NvmlReturn init = api.init();
  if (init != 0) {
    monitor->reason_ = absl::StrCat("nvmlInit_v2 failed: ", api.Error(init));
    return monitor;
  }
  monitor->initialized_ = true;
  unsigned int count = 0;
  const NvmlReturn counted = api.get_count(&count);
  if (counted != 0) {
    monitor->reason_ = absl::StrCat("nvmlDeviceGetCount_v2 failed: ", api.Error(counted));
    return monitor;
  }
  if (count == 0) {
    monitor->reason_ = "NVML sees no GPU";
    return monitor;
  }
  monitor->gpu_count_ = static_cast<int>(count);
  monitor->available_ = true;
  return monitor;
}

GpuMonitor::~GpuMonitor() {
  if (initialized_) api_->shutdown();
  if (library_ != nullptr) dlclose(library_);
}

std::vector<GpuSample> GpuMonitor::Sample() {
  std::vector<GpuSample> samples;
  if (!available_) return samples;
  const Api& api = *api_;
  for (int i = 0; i < gpu_count_; ++i) {
    NvmlDevice device = nullptr;
    if (api.get_handle(static_cast<unsigned int>(i), &device) != 0) continue;
    GpuSample s;
    s.index = i;
    char name[kNameLength] = {};
    if (api.get_name(device, name, kNameLength) == 0) s.name = name;
    NvmlUtilization utilization{};
    if (api.get_utilization(device, &utilization) == 0) {
      s.has_utilization = true;
      s.utilization_ratio = utilization.gpu / 100.0;
    }
    NvmlMemory memory{};
    if (api.get_memory(device, &memory) == 0) {
      s.has_memory = true;
      s.memory_used_bytes = static_cast<int64_t>(memory.used);
      s.memory_total_bytes = static_cast<int64_t>(memory.total);
    }
    unsigned int celsius = 0;
    if (api.get_temperature(device, kNvmlTemperatureGpu, &celsius) == 0) {
      s.has_temperature = true;
      s.temperature_celsius = celsius;
    }
    unsigned int milliwatts = 0;
    if (api.get_power(device, &milliwatts) == 0) {
      s.has_power = true;
      s.power_watts = milliwatts / 1000.0;
    }
    samples.push_back(std::move(s));
  }
  return samples;
}

// --- GpuMetricsExporter -------------------------------------------------------------

GpuMetricsExporter::GpuMetricsExporter(std::unique_ptr<GpuMonitor> monitor,
                                       prometheus::Registry* registry, absl::Duration interval)
    : monitor_(std::move(monitor)) {
  using prometheus::BuildGauge;
  gpus_ = &BuildGauge()
               .Name("pstrain_worker_gpus")
               .Help("GPUs NVML sees on this worker (0: no GPU or no driver)")
               .Register(*registry)
               .Add({});
  available_ = &BuildGauge()
                    .Name("pstrain_worker_gpu_available")
                    .Help("1 when NVML loaded and sees at least one GPU, else 0 (no GPU)")
                    .Register(*registry)
                    .Add({});
  utilization_ = &BuildGauge()
                      .Name("pstrain_worker_gpu_utilization_ratio")
                      .Help("Fraction of the last NVML sample period in which a kernel ran")
                      .Register(*registry);
  memory_used_ = &BuildGauge()
                      .Name("pstrain_worker_gpu_memory_used_bytes")
                      .Help("Device memory in use")
                      .Register(*registry);
  memory_total_ = &BuildGauge()
                       .Name("pstrain_worker_gpu_memory_total_bytes")
                       .Help("Device memory installed")
                       .Register(*registry);
  temperature_ = &BuildGauge()
                      .Name("pstrain_worker_gpu_temperature_celsius")
                      .Help("GPU die temperature")
                      .Register(*registry);
  power_ = &BuildGauge()
                .Name("pstrain_worker_gpu_power_watts")
                .Help("Board power draw")
                .Register(*registry);
  Refresh();
  if (interval > absl::ZeroDuration() && monitor_->available()) {
    thread_ = std::thread([this, interval] {
      while (!stop_.WaitForNotificationWithTimeout(interval)) Refresh();
    });
  }
}

GpuMetricsExporter::~GpuMetricsExporter() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

GpuMetricsExporter::PerGpu& GpuMetricsExporter::GaugesFor(int index) {
  auto it = per_gpu_.find(index);
  if (it != per_gpu_.end()) return it->second;
  const std::map<std::string, std::string> labels = {{"gpu", std::to_string(index)}};
  PerGpu gauges;
  gauges.utilization = &utilization_->Add(labels);
  gauges.memory_used = &memory_used_->Add(labels);
  gauges.memory_total = &memory_total_->Add(labels);
  gauges.temperature = &temperature_->Add(labels);
  gauges.power = &power_->Add(labels);
  return per_gpu_.emplace(index, gauges).first->second;
}

void GpuMetricsExporter::Refresh() {
  gpus_->Set(monitor_->gpu_count());
  available_->Set(monitor_->available() ? 1 : 0);
  for (const GpuSample& s : monitor_->Sample()) {
    PerGpu& g = GaugesFor(s.index);
    if (s.has_utilization) g.utilization->Set(s.utilization_ratio);
    if (s.has_memory) {
      g.memory_used->Set(static_cast<double>(s.memory_used_bytes));
      g.memory_total->Set(static_cast<double>(s.memory_total_bytes));
    }
    if (s.has_temperature) g.temperature->Set(s.temperature_celsius);
    if (s.has_power) g.power->Set(s.power_watts);
  }
}

}  // namespace pstrain
