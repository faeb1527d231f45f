// CudaBackendOptions (kernels/cuda_backend_options.h): the flag values parse
// strictly, the environment fallbacks keep the rules the variables always
// had, and the C form that crosses into the module converts both ways and is
// checked field by field. Runs without CUDA.
#include "kernels/cuda_backend_options.h"

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

// An environment of `values` only.
EnvironmentLookup Env(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const char* name) -> const char* {
    auto it = values.find(name);
    return it == values.end() ? nullptr : it->second.c_str();
  };
}

void ExpectSameOptions(const CudaBackendOptions& a, const CudaBackendOptions& b) {
  EXPECT_EQ(a.fft_transforms, b.fft_transforms);
  EXPECT_EQ(a.winograd_transforms, b.winograd_transforms);
  EXPECT_EQ(a.fp32_route, b.fp32_route);
  EXPECT_EQ(a.own_conv, b.own_conv);
  EXPECT_EQ(a.log_conv_routes, b.log_conv_routes);
  EXPECT_EQ(a.cudnn_batch_norm, b.cudnn_batch_norm);
  EXPECT_EQ(a.concurrent_conv_backward, b.concurrent_conv_backward);
  EXPECT_EQ(a.channels_last, b.channels_last);
}

CudaBackendOptions AllAwayFromDefaults() {
  CudaBackendOptions o;
  o.fft_transforms = false;
  o.winograd_transforms = true;
  o.fp32_route = CudaRoutePolicy::kAlways;
  o.own_conv = CudaRoutePolicy::kNever;
  o.log_conv_routes = true;
  o.cudnn_batch_norm = true;
  o.concurrent_conv_backward = false;
  o.channels_last = false;
  return o;
}

TEST(CudaBackendOptionsTest, TransformsParseEveryDocumentedValueAndNothingElse) {
  CudaBackendOptions o;
  for (const char* text : {"none", "fft", "winograd", "fft,winograd"}) {
    ASSERT_OK(ParseCudnnTransforms(text, &o));
    EXPECT_EQ(CudnnTransformsName(o), text);
  }
  ASSERT_OK(ParseCudnnTransforms("winograd,fft", &o));
  EXPECT_EQ(CudnnTransformsName(o), "fft,winograd");
  ASSERT_OK(ParseCudnnTransforms("fft", &o));
  EXPECT_THAT(ParseCudnnTransforms("fft;winograd", &o),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--cudnn-transforms")));
  EXPECT_EQ(CudnnTransformsName(o), "fft");  // Left as it was.
}

TEST(CudaBackendOptionsTest, RoutePoliciesParseTheirNames) {
  for (CudaRoutePolicy p :
       {CudaRoutePolicy::kMeasured, CudaRoutePolicy::kNever, CudaRoutePolicy::kAlways}) {
    ASSERT_OK_AND_ASSIGN(CudaRoutePolicy parsed,
                         ParseCudaRoutePolicy(CudaRoutePolicyName(p), "--x"));
    EXPECT_EQ(parsed, p);
  }
  EXPECT_THAT(ParseCudaRoutePolicy("0", "--cuda-own-conv"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--cuda-own-conv must be measured, never or always, got '0'")));
}

TEST(CudaBackendOptionsTest, EmptyEnvironmentKeepsTheDefaults) {
  ExpectSameOptions(CudaBackendOptionsFromEnvironment(Env({})), CudaBackendOptions{});
  // Empty, or values outside each variable's rules, change nothing either.
  ExpectSameOptions(
      CudaBackendOptionsFromEnvironment(Env({{"PSTRAIN_CUDNN_TRANSFORMS", ""},
                                             {"PSTRAIN_CUDNN_FP32_ROUTE", "1"},
                                             {"PSTRAIN_CUDA_OWN_CONV", "yes"},
                                             {"PSTRAIN_CUDNN_LOG_ROUTES", "true"},
                                             {"PSTRAIN_CUDNN_BATCHNORM", "0"},
                                             {"PSTRAIN_CUDNN_CONCURRENT_BACKWARD", "1"},
                                             {"PSTRAIN_CUDNN_NHWC", "1"}})),
      CudaBackendOptions{});
}

TEST(CudaBackendOptionsTest, EnvironmentFallbacksKeepTheirRules) {
  ExpectSameOptions(
      CudaBackendOptionsFromEnvironment(Env({{"PSTRAIN_CUDNN_TRANSFORMS", "winograd"},
                                             {"PSTRAIN_CUDNN_FP32_ROUTE", "always"},
                                             {"PSTRAIN_CUDA_OWN_CONV", "0"},
                                             {"PSTRAIN_CUDNN_LOG_ROUTES", "1"},
                                             {"PSTRAIN_CUDNN_BATCHNORM", "1"},
                                             {"PSTRAIN_CUDNN_CONCURRENT_BACKWARD", "0"},
                                             {"PSTRAIN_CUDNN_NHWC", "0"}})),
      AllAwayFromDefaults());
  // Transforms: by substring, as before; "none" (or anything without either
  // word) turns both off.
  CudaBackendOptions o =
      CudaBackendOptionsFromEnvironment(Env({{"PSTRAIN_CUDNN_TRANSFORMS", "fft,winograd"}}));
  EXPECT_TRUE(o.fft_transforms);
  EXPECT_TRUE(o.winograd_transforms);
  o = CudaBackendOptionsFromEnvironment(Env({{"PSTRAIN_CUDNN_TRANSFORMS", "none"}}));
  EXPECT_FALSE(o.fft_transforms);
  EXPECT_FALSE(o.winograd_transforms);
  // A variable that is set overrides what the caller passed in.
  o = CudaBackendOptionsFromEnvironment(Env({{"PSTRAIN_CUDA_OWN_CONV", "junk"}}),
                                        AllAwayFromDefaults());
  EXPECT_EQ(o.own_conv, CudaRoutePolicy::kMeasured);
  EXPECT_EQ(o.fp32_route, CudaRoutePolicy::kAlways);
}

TEST(CudaBackendOptionsTest, ModuleFormRoundTripsEveryField) {
  for (const CudaBackendOptions& options : {CudaBackendOptions{}, AllAwayFromDefaults()}) {
    const PstrainCudaBackendOptions c = ToModuleOptions(options);
    EXPECT_EQ(c.version, kCudaBackendOptionsVersion);
    EXPECT_EQ(c.size, sizeof(PstrainCudaBackendOptions));
    ASSERT_OK_AND_ASSIGN(CudaBackendOptions back, FromModuleOptions(&c));
    ExpectSameOptions(back, options);
  }
}

TEST(CudaBackendOptionsTest, ModuleFormIsCheckedBeforeUse) {
  EXPECT_THAT(FromModuleOptions(nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("none given")));
  PstrainCudaBackendOptions c = ToModuleOptions({});
  c.version = 0;
  EXPECT_THAT(FromModuleOptions(&c), StatusIs(absl::StatusCode::kInvalidArgument,
                                              HasSubstr("options of version 0 given")));
  c = ToModuleOptions({});
  c.size += 4;
  EXPECT_THAT(FromModuleOptions(&c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("were given")));
  c = ToModuleOptions({});
  c.winograd_transforms = 5;
  EXPECT_THAT(FromModuleOptions(&c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("winograd_transforms is 5")));
  c = ToModuleOptions({});
  c.fp32_route = 3;
  EXPECT_THAT(FromModuleOptions(&c),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fp32_route is 3")));
}

}  // namespace
}  // namespace pstrain
