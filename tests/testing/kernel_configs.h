// Plan configurations and backends the kernel tests build again and again.
#ifndef PSTRAIN_TESTS_TESTING_KERNEL_CONFIGS_H_
#define PSTRAIN_TESTS_TESTING_KERNEL_CONFIGS_H_

#include <cstdlib>
#include <memory>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend_options.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::testing {

// A convolution: input [n, c, h, w], k filters of kernel_h x kernel_w,
// strides and paddings per direction.
inline Conv2dConfig MakeConv(int n, int c, int h, int w, int k, int kernel_h, int kernel_w,
                             int stride_h, int stride_w, int pad_h, int pad_w) {
  Conv2dConfig config;
  config.n = n;
  config.c = c;
  config.h = h;
  config.w = w;
  config.filters = k;
  config.kernel_h = kernel_h;
  config.kernel_w = kernel_w;
  config.stride_h = stride_h;
  config.stride_w = stride_w;
  config.pad_h = pad_h;
  config.pad_w = pad_w;
  return config;
}

// A square convolution: the same kernel size, stride and padding in both
// directions.
inline Conv2dConfig MakeConv(int n, int c, int h, int w, int k, int kernel, int stride, int pad) {
  return MakeConv(n, c, h, w, k, kernel, kernel, stride, stride, pad, pad);
}

// The CUDA backend options of the GPU tests: the defaults, with the
// documented PSTRAIN_CUDNN_* / PSTRAIN_CUDA_OWN_CONV fallbacks applied (the
// test harness reads them as pstrain-worker's main does), so that
// bench/gpu_session.sh can run whole suites under each variant. A test that
// needs a setting sets it in code (e.g. OwnConvParityTest).
inline CudaBackendOptions HarnessCudaBackendOptions() {
  return CudaBackendOptionsFromEnvironment(
      [](const char* name) -> const char* { return std::getenv(name); });
}

// The CUDA backend on device 0 (callers skip first when CudaDeviceCount()
// is 0).
inline absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    const CudaBackendOptions& options = HarnessCudaBackendOptions()) {
  DeviceSpec spec;
  spec.automatic = false;
  spec.type = DeviceType::kCuda;
  spec.ordinal = 0;
  return CreateBackend(spec, options);
}

// A CUDA backend beside the CPU one, for parity tests: skips the test when
// no CUDA device is visible. A fixture that needs other CUDA options
// overrides CudaOptions().
class CudaAndCpuBackendsTest : public ::testing::Test {
 protected:
  virtual CudaBackendOptions CudaOptions() const { return HarnessCudaBackendOptions(); }

  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
    absl::StatusOr<std::unique_ptr<Backend>> cuda = CreateCudaBackend(CudaOptions());
    ASSERT_OK(cuda);
    cuda_ = *std::move(cuda);
    cpu_ = CreateCpuBackend();
    ASSERT_NE(cpu_, nullptr);
  }

  std::unique_ptr<Backend> cpu_;
  std::unique_ptr<Backend> cuda_;
};

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TESTING_KERNEL_CONFIGS_H_
