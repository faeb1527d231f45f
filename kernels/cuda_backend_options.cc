#include "kernels/cuda_backend_options.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

bool Set(const char* value) { return value != nullptr; }

// "1" (or, with `on_unless_zero`, anything but "0") turns a boolean
// variable's setting on; its presence alone decides nothing else.
void ApplyBoolean(const char* value, bool on_unless_zero, bool* field) {
  if (!Set(value)) return;
  const std::string text = value;
  if (on_unless_zero) {
    *field = text != "0";
  } else {
    *field = text == "1";
  }
}

// "0": never, "always": always, anything else: measured.
void ApplyRoutePolicy(const char* value, CudaRoutePolicy* field) {
  if (!Set(value)) return;
  const std::string text = value;
  if (text == "0") {
    *field = CudaRoutePolicy::kNever;
  } else if (text == "always") {
    *field = CudaRoutePolicy::kAlways;
  } else {
    *field = CudaRoutePolicy::kMeasured;
  }
}

absl::Status CheckBoolean(const char* name, uint32_t value) {
  if (value <= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("CUDA backend options: ", name, " is ", value, ", not 0 or 1"));
}

absl::StatusOr<CudaRoutePolicy> CheckPolicy(const char* name, uint32_t value) {
  if (value <= static_cast<uint32_t>(CudaRoutePolicy::kAlways)) {
    return static_cast<CudaRoutePolicy>(value);
  }
  return absl::InvalidArgumentError(absl::StrCat("CUDA backend options: ", name, " is ", value,
                                                 ", not a route policy (0 measured, 1 never, "
                                                 "2 always)"));
}

}  // namespace

const char* CudaRoutePolicyName(CudaRoutePolicy policy) {
  switch (policy) {
    case CudaRoutePolicy::kNever:
      return "never";
    case CudaRoutePolicy::kAlways:
      return "always";
    case CudaRoutePolicy::kMeasured:
    default:
      return "measured";
  }
}

absl::StatusOr<CudaRoutePolicy> ParseCudaRoutePolicy(absl::string_view text,
                                                     absl::string_view what) {
  if (text == "measured") return CudaRoutePolicy::kMeasured;
  if (text == "never") return CudaRoutePolicy::kNever;
  if (text == "always") return CudaRoutePolicy::kAlways;
  return absl::InvalidArgumentError(
      absl::StrCat(what, " must be measured, never or always, got '", text, "'"));
}

absl::Status ParseCudnnTransforms(absl::string_view text, CudaBackendOptions* options) {
  bool fft = false;
  bool winograd = false;
  if (text == "fft") {
    fft = true;
  } else if (text == "winograd") {
    winograd = true;
  } else if (text == "fft,winograd" || text == "winograd,fft") {
    fft = winograd = true;
  } else if (text != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cudnn-transforms must be none, fft, winograd or fft,winograd, got '", text, "'"));
  }
  options->fft_transforms = fft;
  options->winograd_transforms = winograd;
  return absl::OkStatus();
}

std::string CudnnTransformsName(const CudaBackendOptions& options) {
  if (options.fft_transforms && options.winograd_transforms) return "fft,winograd";
  if (options.fft_transforms) return "fft";
  if (options.winograd_transforms) return "winograd";
  return "none";
}

CudaBackendOptions CudaBackendOptionsFromEnvironment(const EnvironmentLookup& lookup,
                                                     CudaBackendOptions options) {
  if (const char* transforms = lookup("PSTRAIN_CUDNN_TRANSFORMS");
      Set(transforms) && *transforms != '\0') {
    const std::string value = transforms;
    options.fft_transforms = value.find("fft") != std::string::npos;
    options.winograd_transforms = value.find("winograd") != std::string::npos;
  }
  ApplyRoutePolicy(lookup("PSTRAIN_CUDNN_FP32_ROUTE"), &options.fp32_route);
  ApplyRoutePolicy(lookup("PSTRAIN_CUDA_OWN_CONV"), &options.own_conv);
  ApplyBoolean(lookup("PSTRAIN_CUDNN_LOG_ROUTES"), /*on_unless_zero=*/false,
               &options.log_conv_routes);
  ApplyBoolean(lookup("PSTRAIN_CUDNN_BATCHNORM"), /*on_unless_zero=*/false,
               &options.cudnn_batch_norm);
  ApplyBoolean(lookup("PSTRAIN_CUDNN_CONCURRENT_BACKWARD"), /*on_unless_zero=*/true,
               &options.concurrent_conv_backward);
  ApplyBoolean(lookup("PSTRAIN_CUDNN_NHWC"), /*on_unless_zero=*/true, &options.channels_last);
  return options;
}

PstrainCudaBackendOptions ToModuleOptions(const CudaBackendOptions& options) {
  PstrainCudaBackendOptions c{};
  c.version = kCudaBackendOptionsVersion;
  c.size = sizeof(PstrainCudaBackendOptions);
  c.fft_transforms = options.fft_transforms ? 1 : 0;
  c.winograd_transforms = options.winograd_transforms ? 1 : 0;
  c.fp32_route = static_cast<uint32_t>(options.fp32_route);
  c.own_conv = static_cast<uint32_t>(options.own_conv);
  c.log_conv_routes = options.log_conv_routes ? 1 : 0;
  c.cudnn_batch_norm = options.cudnn_batch_norm ? 1 : 0;
  c.concurrent_conv_backward = options.concurrent_conv_backward ? 1 : 0;
  c.channels_last = options.channels_last ? 1 : 0;
  return c;
}

absl::StatusOr<CudaBackendOptions> FromModuleOptions(const PstrainCudaBackendOptions* c) {
  if (c == nullptr) return absl::InvalidArgumentError("CUDA backend options: none given");
  if (c->version != kCudaBackendOptionsVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CUDA backend options of version ", c->version, " given, but this module reads version ",
        kCudaBackendOptionsVersion, "; install the module from the same build as the binary"));
  }
  if (c->size != sizeof(PstrainCudaBackendOptions)) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA backend options of version ", c->version,
                                                   " are ", sizeof(PstrainCudaBackendOptions),
                                                   " bytes, but ", c->size, " were given"));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckBoolean("fft_transforms", c->fft_transforms));
  PSTRAIN_RETURN_IF_ERROR(CheckBoolean("winograd_transforms", c->winograd_transforms));
  PSTRAIN_RETURN_IF_ERROR(CheckBoolean("log_conv_routes", c->log_conv_routes));
  PSTRAIN_RETURN_IF_ERROR(CheckBoolean("cudnn_batch_norm", c->cudnn_batch_norm));
  PSTRAIN_RETURN_IF_ERROR(CheckBoolean("concurrent_conv_backward", c->concurrent_conv_backward));
  PSTRAIN_RETURN_IF_ERROR(CheckBoolean("channels_last", c->channels_last));
  CudaBackendOptions options;
  PSTRAIN_ASSIGN_OR_RETURN(options.fp32_route, CheckPolicy("fp32_route", c->fp32_route));
  PSTRAIN_ASSIGN_OR_RETURN(options.own_conv, CheckPolicy("own_conv", c->own_conv));
  options.fft_transforms = c->fft_transforms == 1;
  options.winograd_transforms = c->winograd_transforms == 1;
  options.log_conv_routes = c->log_conv_routes == 1;
  options.cudnn_batch_norm = c->cudnn_batch_norm == 1;
  options.concurrent_conv_backward = c->concurrent_conv_backward == 1;
  options.channels_last = c->channels_last == 1;
  return options;
}

}  // namespace pstrain
