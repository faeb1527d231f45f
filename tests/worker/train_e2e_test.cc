// End-to-end: the standalone engine trains fmnist-cnn on a subset of the real
// Fashion-MNIST files, the loss falls, accuracy lands far above chance, and
// the checkpoint it saves evaluates to the same accuracy.
#include <filesystem>
#include <sstream>
#include <string>

#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/standalone.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

const char kFashionMnist[] = "/usr/share/datasets/fashion-mnist";

TEST(TrainEndToEndTest, FmnistCnnLearnsOnASubsetAndItsCheckpointEvaluatesTheSame) {
  if (!std::filesystem::exists(std::string(kFashionMnist) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  auto job = LoadJobSpec(std::string(PSTRAIN_SOURCE_DIR) + "/examples/fashion-mnist.json");
  ASSERT_OK(job);
  job->mutable_dataset()->set_test_limit(2000);
  job->mutable_optimizer()->mutable_schedule()->Clear();

  StandaloneOptions options;
  options.device = "cpu";
  options.epochs = 2;
  options.limit = 3200;
  options.checkpoint_path = ::testing::TempDir() + "/e2e.ckpt";
  std::ostringstream log;
  auto result = RunStandalone(*job, options, log);
  ASSERT_OK(result);
  EXPECT_THAT(log.str(), ::testing::HasSubstr("epoch 2/2"));
  EXPECT_EQ(result->epochs, 2);
  EXPECT_EQ(result->steps, 2 * 3200 / 64);
  EXPECT_EQ(result->test.samples, 2000);
  EXPECT_LT(result->final_train_loss, result->first_epoch_loss);
  EXPECT_GT(result->test.accuracy, 0.65) << log.str();  // Chance is 0.10.
  EXPECT_GT(result->test.macro_f1, 0.55);
  EXPECT_EQ(result->device, "cpu");

  std::string device;
  auto metrics = EvaluateCheckpoint(options.checkpoint_path, "", "cpu", &device);
  ASSERT_OK(metrics);
  EXPECT_DOUBLE_EQ(metrics->accuracy, result->test.accuracy);
  EXPECT_EQ(metrics->confusion, result->test.confusion);

  auto ckpt = ReadCheckpointFile(options.checkpoint_path);
  ASSERT_OK(ckpt);
  EXPECT_EQ(ckpt->step(), result->steps);
  EXPECT_EQ(ckpt->parameters_size(), 8);
  EXPECT_EQ(ckpt->optimizer_state_size(), 8);  // One momentum slot per parameter.
  std::filesystem::remove(options.checkpoint_path);
}

TEST(TrainEndToEndTest, MissingDataIsAClearErrorNotACrash) {
  auto job = LoadJobSpec(std::string(PSTRAIN_SOURCE_DIR) + "/examples/fashion-mnist.json");
  ASSERT_OK(job);
  job->mutable_dataset()->set_path("/nonexistent/fashion");
  StandaloneOptions options;
  options.device = "cpu";
  std::ostringstream log;
  auto result = RunStandalone(*job, options, log);
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(std::string(result.status().message()), ::testing::HasSubstr("/nonexistent/fashion"));
}

TEST(TrainEndToEndTest, AskingForCudaWithoutAGpuIsFailedPrecondition) {
  if (CudaAvailable()) GTEST_SKIP() << "a GPU is present";
  auto job = LoadJobSpec(std::string(PSTRAIN_SOURCE_DIR) + "/examples/fashion-mnist.json");
  ASSERT_OK(job);
  StandaloneOptions options;
  options.device = "cuda";
  std::ostringstream log;
  auto result = RunStandalone(*job, options, log);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace pstrain
