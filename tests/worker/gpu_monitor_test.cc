// GpuMonitor and GpuMetricsExporter: NVML is loaded at run time; without it
// (this CI machine has no driver) the worker reports "no GPU" instead of
// failing. On a machine with a driver, the real GPUs are sampled.
#include "worker/gpu_monitor.h"

#include <dlfcn.h>

#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace pstrain {
namespace {

std::string Text(prometheus::Registry& registry) {
  std::ostringstream text;
  prometheus::TextSerializer().Serialize(text, registry.Collect());
  return text.str();
}

bool DriverPresent() {
  void* handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return false;
  dlclose(handle);
  return true;
}

TEST(GpuMonitorTest, MissingLibraryMeansNoGpuWithAReason) {
  auto monitor = GpuMonitor::Open("/nonexistent/libnvidia-ml.so.1");
  EXPECT_FALSE(monitor->available());
  EXPECT_EQ(monitor->gpu_count(), 0);
  EXPECT_TRUE(monitor->Sample().empty());
  EXPECT_NE(monitor->unavailable_reason().find("/nonexistent/libnvidia-ml.so.1"), std::string::npos)
      << monitor->unavailable_reason();
}

TEST(GpuMonitorTest, LibraryWithoutNvmlSymbolsIsUnavailable) {
  // libc loads but has no NVML entry points.
  auto monitor = GpuMonitor::Open("libc.so.6");
  EXPECT_FALSE(monitor->available());
  EXPECT_EQ(monitor->gpu_count(), 0);
  EXPECT_NE(monitor->unavailable_reason().find("lacks nvmlInit_v2"), std::string::npos)
      << monitor->unavailable_reason();
}

TEST(GpuMetricsExporterTest, NoGpuIsExportedAsZeroGpus) {
  prometheus::Registry registry;
  GpuMetricsExporter exporter(GpuMonitor::Open("/nonexistent/libnvidia-ml.so.1"), &registry,
                              absl::ZeroDuration());
  const std::string text = Text(registry);
  EXPECT_NE(text.find("pstrain_worker_gpus 0"), std::string::npos) << text;
  EXPECT_NE(text.find("pstrain_worker_gpu_available 0"), std::string::npos) << text;
  EXPECT_EQ(text.find("gpu=\""), std::string::npos) << text;
}

TEST(GpuMonitorTest, RealDriverSamplesEveryGpu) {
  if (!DriverPresent()) GTEST_SKIP() << "libnvidia-ml.so.1 is not installed (no NVIDIA driver)";
  auto monitor = GpuMonitor::Open();
  ASSERT_TRUE(monitor->available()) << monitor->unavailable_reason();
  ASSERT_GT(monitor->gpu_count(), 0);
  const std::vector<GpuSample> samples = monitor->Sample();
  ASSERT_EQ(static_cast<int>(samples.size()), monitor->gpu_count());
  for (const GpuSample& s : samples) {
    EXPECT_FALSE(s.name.empty());
    ASSERT_TRUE(s.has_memory);
    EXPECT_GT(s.memory_total_bytes, 0);
    EXPECT_LE(s.memory_used_bytes, s.memory_total_bytes);
    if (s.has_utilization) {
      EXPECT_GE(s.utilization_ratio, 0.0);
      EXPECT_LE(s.utilization_ratio, 1.0);
    }
    if (s.has_temperature) {
      EXPECT_GT(s.temperature_celsius, 0.0);
    }
    if (s.has_power) {
      EXPECT_GT(s.power_watts, 0.0);
    }
  }
  prometheus::Registry registry;
  GpuMetricsExporter exporter(GpuMonitor::Open(), &registry, absl::ZeroDuration());
  const std::string text = Text(registry);
  EXPECT_NE(text.find("pstrain_worker_gpu_available 1"), std::string::npos) << text;
  EXPECT_NE(text.find("pstrain_worker_gpu_memory_total_bytes{gpu=\"0\"}"), std::string::npos)
      << text;
}

}  // namespace
}  // namespace pstrain
