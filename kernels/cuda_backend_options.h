// The settings of the CUDA backend (kernels/cuda/, the module
// libpstrain_cuda.so): which algorithms its convolutions may choose among,
// how bf16/fp16 convolution passes are routed, cuDNN's or pstrain's batch
// norm, the concurrent backward passes, channels last. The host sets them
// (pstrain-worker's flags, tests, bench programs) and they cross into the
// module with the backend's creation, in the C form
// PstrainCudaBackendOptions (kernels/backend_module.h), versioned and
// checked on the module's side. Nothing here reads the environment.
//
//   CudaBackendOptions options;
//   options.own_conv = CudaRoutePolicy::kAlways;     // parity tests of the own kernels
//   PSTRAIN_ASSIGN_OR_RETURN(auto backend, CreateBackend(spec, options));
//
//   // pstrain-worker: flags, with the documented PSTRAIN_* variables as
//   // fallbacks, read in main through a lookup it passes.
//   CudaBackendOptions options = CudaBackendOptionsFromEnvironment(&Environment);
//   PSTRAIN_RETURN_IF_ERROR(ParseCudnnTransforms("fft,winograd", &options));
//
// Adding a setting: a field here, one in PstrainCudaBackendOptions (and a
// kCudaBackendOptionsVersion bump), both conversions in
// cuda_backend_options.cc, a flag in worker/worker_main.cc, and the row in
// its --help and README's table.
//
// Threads: plain values; the functions keep no state.
#ifndef PSTRAIN_KERNELS_CUDA_BACKEND_OPTIONS_H_
#define PSTRAIN_KERNELS_CUDA_BACKEND_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend_module.h"

namespace pstrain {

// How a bf16 or fp16 convolution plan routes a pass through an alternative
// (cuDNN in fp32 between conversions; pstrain's own narrow-convolution
// kernels): where it measures faster than cuDNN in the plan's type, never, or
// wherever it applies (for the parity tests of that route).
enum class CudaRoutePolicy : uint32_t { kMeasured = 0, kNever = 1, kAlways = 2 };

struct CudaBackendOptions {
  // cuDNN convolution algorithms that work on transformed tiles. FFT ones
  // agree with the CPU backend to 1e-4 (the parity tests' bound); Winograd
  // ones put fp32 results 4e-3 to 6e-3 away (on an H200), so they are off
  // unless asked for (PyTorch's choice: resnet-small 1.09x faster).
  bool fft_transforms = true;
  bool winograd_transforms = false;
  // bf16/fp16 convolution passes in fp32 between conversions.
  CudaRoutePolicy fp32_route = CudaRoutePolicy::kMeasured;
  // bf16/fp16 channels-last convolution passes with pstrain's own kernels
  // (narrow_conv_kernels.cu: channels and filters multiples of 16).
  CudaRoutePolicy own_conv = CudaRoutePolicy::kMeasured;
  // Each bf16/fp16 convolution plan prints its per-pass times and choice to
  // stderr (for bench/gpu_layers_bench).
  bool log_conv_routes = false;
  // cuDNN's batch norm instead of pstrain's kernels (NCHW plans only), for
  // comparison.
  bool cudnn_batch_norm = false;
  // A convolution's backward-filter pass on a side stream while its
  // backward-data pass runs on the main one; the results are the same.
  bool concurrent_conv_backward = true;
  // bf16/fp16 activations channels last (NHWC), where cuDNN's tensor-core
  // convolutions are built for; false keeps NCHW. fp32 is always NCHW.
  bool channels_last = true;
};

// "measured", "never", "always".
const char* CudaRoutePolicyName(CudaRoutePolicy policy);
// INVALID_ARGUMENT naming `what` (the flag) for any other text.
absl::StatusOr<CudaRoutePolicy> ParseCudaRoutePolicy(absl::string_view text,
                                                     absl::string_view what);

// "none", "fft", "winograd" or "fft,winograd" (either order) into
// options->fft_transforms and ->winograd_transforms; INVALID_ARGUMENT
// otherwise, leaving *options as it was.
absl::Status ParseCudnnTransforms(absl::string_view text, CudaBackendOptions* options);
// The inverse: "none", "fft", "winograd" or "fft,winograd".
std::string CudnnTransformsName(const CudaBackendOptions& options);

// The value of an environment variable, or null when it is unset (main
// passes a lookup of the process's environment; tests pass a map).
using EnvironmentLookup = std::function<const char*(const char* name)>;

// The documented environment fallbacks, applied to `options` by the rules
// these variables have always had (unset, or a value not listed: the field
// keeps its value):
//   PSTRAIN_CUDNN_TRANSFORMS           FFT on when the value contains "fft",
//                                      Winograd when it contains "winograd"
//                                      ("none": both off; empty: unchanged)
//   PSTRAIN_CUDNN_FP32_ROUTE           0: never, always: always
//   PSTRAIN_CUDA_OWN_CONV              0: never, always: always
//   PSTRAIN_CUDNN_LOG_ROUTES           1: on
//   PSTRAIN_CUDNN_BATCHNORM            1: on
//   PSTRAIN_CUDNN_CONCURRENT_BACKWARD  0: off
//   PSTRAIN_CUDNN_NHWC                 0: off
CudaBackendOptions CudaBackendOptionsFromEnvironment(const EnvironmentLookup& lookup,
                                                     CudaBackendOptions options = {});

// The C form that crosses into the module, with this build's version and
// size.
PstrainCudaBackendOptions ToModuleOptions(const CudaBackendOptions& options);

// The module's side: INVALID_ARGUMENT when `options` is null, of a version
// this build does not read, of another size than that version's, or has a
// field outside its range (each named); the C++ form otherwise.
absl::StatusOr<CudaBackendOptions> FromModuleOptions(const PstrainCudaBackendOptions* options);

}  // namespace pstrain

#endif  // PSTRAIN_KERNELS_CUDA_BACKEND_OPTIONS_H_
