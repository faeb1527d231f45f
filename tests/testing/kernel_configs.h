// Plan configurations and backends the kernel tests build again and again.
#ifndef PSTRAIN_TESTS_TESTING_KERNEL_CONFIGS_H_
#define PSTRAIN_TESTS_TESTING_KERNEL_CONFIGS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace pstrain::testing {

// A square convolution: input [n, c, h, w], k filters of kernel x kernel,
// the same stride and padding in both directions.
inline Conv2dConfig MakeConv(int n, int c, int h, int w, int k, int kernel, int stride, int pad) {
  Conv2dConfig config;
  config.n = n;
  config.c = c;
  config.h = h;
  config.w = w;
  config.filters = k;
  config.kernel_h = config.kernel_w = kernel;
  config.stride_h = config.stride_w = stride;
  config.pad_h = config.pad_w = pad;
  return config;
}

// The CUDA backend on device 0 (callers skip first when CudaDeviceCount()
// is 0).
inline absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend() {
  DeviceSpec spec;
  spec.automatic = false;
  spec.type = DeviceType::kCuda;
  spec.ordinal = 0;
  return CreateBackend(spec);
}

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TESTING_KERNEL_CONFIGS_H_
