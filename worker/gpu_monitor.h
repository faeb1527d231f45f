// GpuMonitor: per-GPU utilization, memory, temperature and power read
// through NVML, which is loaded at run time (dlopen of libnvidia-ml.so.1) so
// that pstrain-worker starts on a machine without an NVIDIA driver: there the
// monitor is simply unavailable and reports no GPU. Nothing here includes
// nvml.h or links libnvidia-ml; the handful of entry points used are declared
// in gpu_monitor.cc with NVML's documented C signatures.
//
//   std::unique_ptr<GpuMonitor> monitor = GpuMonitor::Open();
//   if (!monitor->available()) std::cerr << "no GPU: " << monitor->unavailable_reason();
//   for (const GpuSample& gpu : monitor->Sample()) use(gpu.utilization_ratio);
//
//   // Or export pstrain_worker_gpu_* to a registry, refreshed every second:
//   GpuMetricsExporter exporter(std::move(monitor), registry, absl::Seconds(1));
//
// Threads: GpuMonitor is thread-compatible (Sample from one thread at a time).
// GpuMetricsExporter owns one thread that samples and sets gauges; Refresh()
// may also be called directly (tests) from one thread at a time.
#ifndef PSTRAIN_WORKER_GPU_MONITOR_H_
#define PSTRAIN_WORKER_GPU_MONITOR_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace pstrain {

// One GPU at one instant. A reading NVML could not give (e.g. power on a
// board without a sensor) is marked absent by its has_ flag.
struct GpuSample {
  int index = 0;
  std::string name;
  bool has_utilization = false;
  double utilization_ratio = 0;  // Fraction of the last sample period a kernel ran, [0, 1].
  bool has_memory = false;
  int64_t memory_used_bytes = 0;
  int64_t memory_total_bytes = 0;
  bool has_temperature = false;
  double temperature_celsius = 0;
  bool has_power = false;
  double power_watts = 0;
};

class GpuMonitor {
 public:
  // Never fails: when the library cannot be loaded, lacks an entry point, or
  // nvmlInit fails (no driver, no device), the monitor is unavailable, counts
  // no GPU and says why in unavailable_reason().
  static std::unique_ptr<GpuMonitor> Open(const std::string& library = "libnvidia-ml.so.1");
  ~GpuMonitor();  // nvmlShutdown and dlclose when they were opened.
  GpuMonitor(const GpuMonitor&) = delete;
  GpuMonitor& operator=(const GpuMonitor&) = delete;

  bool available() const { return available_; }
  const std::string& unavailable_reason() const { return reason_; }
  // GPUs NVML sees (0 when unavailable).
  int gpu_count() const { return gpu_count_; }
  // One sample per GPU that NVML could open, in index order; empty when
  // unavailable.
  std::vector<GpuSample> Sample();

 private:
  struct Api;  // The resolved NVML entry points (gpu_monitor.cc).
  GpuMonitor();

  void* library_ = nullptr;
  std::unique_ptr<Api> api_;
  bool initialized_ = false;
  bool available_ = false;
  std::string reason_;
  int gpu_count_ = 0;
};

// Exports a GpuMonitor as pstrain_worker_gpus, pstrain_worker_gpu_available
// and, per GPU (label gpu="N"), pstrain_worker_gpu_utilization_ratio,
// _memory_used_bytes, _memory_total_bytes, _temperature_celsius and
// _power_watts. The label set is bounded by the GPUs on the machine.
class GpuMetricsExporter {
 public:
  // Samples once at construction, then every `interval` on an owned thread
  // (interval <= 0: no thread; call Refresh()).
  GpuMetricsExporter(std::unique_ptr<GpuMonitor> monitor, prometheus::Registry* registry,
                     absl::Duration interval);
  ~GpuMetricsExporter();  // Joins the thread.
  GpuMetricsExporter(const GpuMetricsExporter&) = delete;
  GpuMetricsExporter& operator=(const GpuMetricsExporter&) = delete;

  void Refresh();
  const GpuMonitor& monitor() const { return *monitor_; }

 private:
  struct PerGpu {
    prometheus::Gauge* utilization = nullptr;
    prometheus::Gauge* memory_used = nullptr;
    prometheus::Gauge* memory_total = nullptr;
    prometheus::Gauge* temperature = nullptr;
    prometheus::Gauge* power = nullptr;
  };
  PerGpu& GaugesFor(int index);

  // Constant after construction.
  const std::unique_ptr<GpuMonitor> monitor_;
  prometheus::Gauge* gpus_;
  prometheus::Gauge* available_;
  prometheus::Family<prometheus::Gauge>* utilization_;
  prometheus::Family<prometheus::Gauge>* memory_used_;
  prometheus::Family<prometheus::Gauge>* memory_total_;
  prometheus::Family<prometheus::Gauge>* temperature_;
  prometheus::Family<prometheus::Gauge>* power_;

  std::map<int, PerGpu> per_gpu_;  // Only touched by Refresh's caller.
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_GPU_MONITOR_H_
