// The run-time loading of backend modules (kernels/backend_loader.h): every
// way a module can be missing or wrong gives a FAILED_PRECONDITION or
// NOT_FOUND that names the cause, a good module's backend works across the
// boundary, and the backend options reach the module, which refuses what it
// cannot read. The fake modules are built by tests/CMakeLists.txt from
// tests/kernels/modules/; the real CUDA module is checked when it was built.
#include "kernels/backend_loader.h"

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/build_info.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend_options.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;

std::string TestModule(const std::string& name) {
  return std::string(PSTRAIN_TEST_MODULE_DIR) + "/libpstrain_test_" + name + ".so";
}

TEST(BackendLoaderTest, MissingFileIsNotFound) {
  EXPECT_THAT(LoadBackendModule("/nonexistent/libpstrain_cuda.so"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/libpstrain_cuda.so")));
}

TEST(BackendLoaderTest, FileThatIsNoSharedObjectIsRejected) {
  const std::string path = ::testing::TempDir() + "/garbage_module.so";
  std::ofstream(path) << "this is not an ELF file";
  EXPECT_THAT(LoadBackendModule(path),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path), HasSubstr("could not be loaded"))));
}

TEST(BackendLoaderTest, MissingLibraryIsNamed) {
  EXPECT_THAT(LoadBackendModule(TestModule("needs_dep")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("could not be loaded"),
                             HasSubstr("libpstrain_test_missing_dependency.so"),
                             HasSubstr("a library it needs is missing"))));
}

TEST(BackendLoaderTest, SharedObjectWithoutEntryPointIsRejected) {
  EXPECT_THAT(LoadBackendModule(TestModule("no_entry")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("exports no pstrain_backend_module_v1")));
}

TEST(BackendLoaderTest, ModuleFromAnotherBuildIsRejected) {
  EXPECT_THAT(LoadBackendModule(TestModule("other_build")),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("was built from pstrain 0.0.0-other"),
                             HasSubstr(std::string("but this binary from ") + BuildId()))));
}

TEST(BackendLoaderTest, ModuleOfAnotherAbiIsRejected) {
  EXPECT_THAT(LoadBackendModule(TestModule("other_abi")),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("speaks module ABI 999")));
}

TEST(BackendLoaderTest, ModuleWithoutDeviceGivesItsReason) {
  ASSERT_OK_AND_ASSIGN(LoadedBackendModule module, LoadBackendModule(TestModule("no_device")));
  std::string why;
  EXPECT_EQ(module.DeviceCount(&why), 0);
  EXPECT_EQ(why, "fake module: no fake device plugged in");
  EXPECT_THAT(module.CreateBackend(0), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                HasSubstr("fake:0: fake module: no such device")));
}

// The backend made inside the module is used by the host like any other:
// memory, copies and an op run across the boundary.
TEST(BackendLoaderTest, BackendFromModuleRunsOps) {
  ASSERT_OK_AND_ASSIGN(LoadedBackendModule module, LoadBackendModule(TestModule("good")));
  std::string why;
  ASSERT_EQ(module.DeviceCount(&why), 1) << why;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> backend, module.CreateBackend(0));
  // C[2,2] = A[2,3] * B[3,2].
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<float> b = {1, 0, 0, 1, 1, 1};
  ASSERT_OK_AND_ASSIGN(Tensor ta, backend->AllocateTensor(Shape{2, 3}));
  ASSERT_OK_AND_ASSIGN(Tensor tb, backend->AllocateTensor(Shape{3, 2}));
  ASSERT_OK_AND_ASSIGN(Tensor tc, backend->AllocateTensor(Shape{2, 2}));
  EXPECT_OK(backend->CopyHostToDevice(ta.data(), a.data(), ta.bytes()));
  EXPECT_OK(backend->CopyHostToDevice(tb.data(), b.data(), tb.bytes()));
  EXPECT_OK(backend->Gemm(false, false, 2, 2, 3, 1.f, ta.data(), tb.data(), 0.f, tc.data()));
  std::vector<float> c(4);
  EXPECT_OK(backend->CopyDeviceToHost(c.data(), tc.data(), tc.bytes()));
  EXPECT_OK(backend->Synchronize());
  EXPECT_THAT(c, ElementsAre(4, 5, 10, 11));
}

TEST(BackendLoaderTest, ConfiguredPathReplacesTheSearchPath) {
  EXPECT_THAT(CudaModuleCandidates("/opt/elsewhere/libpstrain_cuda.so"),
              ElementsAre("/opt/elsewhere/libpstrain_cuda.so"));
  const std::vector<std::string> candidates = CudaModuleCandidates("");
  ASSERT_EQ(candidates.size(), 3u);
  EXPECT_THAT(candidates[0], EndsWith("/../lib/pstrain/libpstrain_cuda.so"));
  EXPECT_THAT(candidates[1], EndsWith("/../lib/libpstrain_cuda.so"));
  EXPECT_THAT(candidates[2], EndsWith("/libpstrain_cuda.so"));
}

// The module is looked for once per process: options given afterwards would
// change nothing, so they are refused rather than dropped.
TEST(BackendLoaderTest, ConfiguringAfterTheLookUpIsRefused) {
  (void)CudaModule();
  CudaModuleOptions options;
  options.path = "/opt/elsewhere/libpstrain_cuda.so";
  EXPECT_THAT(ConfigureCudaModule(options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("already looked for in this process")));
  EXPECT_THAT(CudaModule().options.path, ::testing::Not(options.path));
}

// Every field of CudaBackendOptions, set away from its default, arrives in
// the module as it was set.
TEST(BackendLoaderTest, OptionsReachTheModule) {
  ASSERT_OK_AND_ASSIGN(LoadedBackendModule module, LoadBackendModule(TestModule("echo_options")));
  CudaBackendOptions options;
  options.fft_transforms = false;
  options.winograd_transforms = true;
  options.fp32_route = CudaRoutePolicy::kNever;
  options.own_conv = CudaRoutePolicy::kAlways;
  options.log_conv_routes = true;
  options.cudnn_batch_norm = true;
  options.concurrent_conv_backward = false;
  options.channels_last = false;
  EXPECT_THAT(module.CreateBackend(0, options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("fake module: options transforms=winograd fp32_route=never "
                                 "own_conv=always cudnn_batch_norm=1 concurrent_conv_backward=0 "
                                 "channels_last=0 log_conv_routes=1")));
  EXPECT_THAT(module.CreateBackend(0),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("options transforms=fft fp32_route=measured own_conv=measured "
                                 "cudnn_batch_norm=0 concurrent_conv_backward=1 "
                                 "channels_last=1 log_conv_routes=0")));
}

// What a host of another build could send: the module refuses it, naming
// what is wrong, and creates nothing.
TEST(BackendLoaderTest, OptionsTheModuleCannotReadAreRefused) {
  ASSERT_OK_AND_ASSIGN(LoadedBackendModule module, LoadBackendModule(TestModule("good")));
  PstrainCudaBackendOptions other_version = ToModuleOptions(CudaBackendOptions{});
  other_version.version = kCudaBackendOptionsVersion + 1;
  EXPECT_THAT(
      module.CreateBackendWithModuleOptions(0, other_version),
      StatusIs(absl::StatusCode::kFailedPrecondition,
               AllOf(HasSubstr("fake:0"),
                     HasSubstr(absl::StrCat("options of version ", kCudaBackendOptionsVersion + 1)),
                     HasSubstr(absl::StrCat("reads version ", kCudaBackendOptionsVersion)))));
  PstrainCudaBackendOptions short_struct = ToModuleOptions(CudaBackendOptions{});
  short_struct.size -= sizeof(uint32_t);
  EXPECT_THAT(module.CreateBackendWithModuleOptions(0, short_struct),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("bytes, but")));
  PstrainCudaBackendOptions bad_policy = ToModuleOptions(CudaBackendOptions{});
  bad_policy.own_conv = 7;
  EXPECT_THAT(module.CreateBackendWithModuleOptions(0, bad_policy),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("own_conv is 7, not a route policy")));
  PstrainCudaBackendOptions bad_boolean = ToModuleOptions(CudaBackendOptions{});
  bad_boolean.channels_last = 2;
  EXPECT_THAT(
      module.CreateBackendWithModuleOptions(0, bad_boolean),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("channels_last is 2, not 0 or 1")));
  // The same module still makes a backend from options it can read.
  EXPECT_OK(
      module.CreateBackendWithModuleOptions(0, ToModuleOptions(CudaBackendOptions{})).status());
}

#if defined(PSTRAIN_CUDA_MODULE_PATH)
// The real module of this build: same build id, and either it sees a GPU or
// it says why not (no driver here, on the CPU machines).
TEST(CudaModuleTest, RealModuleLoadsAndExplainsAMissingDevice) {
  absl::StatusOr<LoadedBackendModule> module = LoadBackendModule(PSTRAIN_CUDA_MODULE_PATH);
  if (!module.ok() && absl::StrContains(module.status().message(), "cannot open shared object")) {
    GTEST_SKIP() << "CUDA libraries not installed here: " << module.status();
  }
  ASSERT_OK(module.status());
  std::string why;
  if (module->DeviceCount(&why) > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(why.empty());
  EXPECT_THAT(module->CreateBackend(0),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cuda:0")));
}

// The real module checks the options before it looks for a device, so this
// runs on machines without a GPU too.
TEST(CudaModuleTest, RealModuleRefusesOptionsOfAnotherVersion) {
  absl::StatusOr<LoadedBackendModule> module = LoadBackendModule(PSTRAIN_CUDA_MODULE_PATH);
  if (!module.ok() && absl::StrContains(module.status().message(), "cannot open shared object")) {
    GTEST_SKIP() << "CUDA libraries not installed here: " << module.status();
  }
  ASSERT_OK(module.status());
  PstrainCudaBackendOptions options = ToModuleOptions(CudaBackendOptions{});
  options.version = 999;
  EXPECT_THAT(module->CreateBackendWithModuleOptions(0, options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("cuda:0"), HasSubstr("options of version 999"),
                             HasSubstr("install the module from the same build"))));
  options = ToModuleOptions(CudaBackendOptions{});
  options.fp32_route = 3;
  EXPECT_THAT(module->CreateBackendWithModuleOptions(0, options),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("fp32_route is 3, not a route policy")));
}

// With a GPU: the options shape the backend the module makes (channels last
// for bf16 is an option the host can observe).
TEST(CudaModuleTest, OptionsShapeTheRealBackend) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible";
  DeviceSpec spec;
  spec.automatic = false;
  spec.type = DeviceType::kCuda;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> defaults, CreateBackend(spec, {}));
  if (!defaults->SupportsDataType(DataType::kBF16)) GTEST_SKIP() << "no bf16 on this device";
  EXPECT_TRUE(defaults->ChannelsLast(DataType::kBF16));
  CudaBackendOptions options;
  options.channels_last = false;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> nchw, CreateBackend(spec, options));
  EXPECT_FALSE(nchw->ChannelsLast(DataType::kBF16));
}

TEST(CudaModuleTest, ProcessFindsTheModuleOfItsBuild) {
  const CudaModuleStatus& cuda = CudaModule();
  if (!cuda.load.ok() && absl::StrContains(cuda.load.message(), "cannot open shared object")) {
    GTEST_SKIP() << "CUDA libraries not installed here: " << cuda.load;
  }
  ASSERT_OK(cuda.load);
  EXPECT_THAT(cuda.module->path(), EndsWith("/lib/libpstrain_cuda.so"));
  EXPECT_EQ(CudaDeviceCount(), cuda.device_count);
}
#endif

}  // namespace
}  // namespace pstrain
