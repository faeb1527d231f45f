#include "common/job_spec.h"

#include <filesystem>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

const std::string kSource = PSTRAIN_SOURCE_DIR;

TEST(JobSpecTest, LoadsTheShippedFashionMnistJobAndResolvesItsModelFile) {
  auto job = LoadJobSpec(kSource + "/examples/fashion-mnist.json");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_TRUE(job->has_model());
  EXPECT_TRUE(job->model_file().empty());
  EXPECT_EQ(job->model().name(), "fmnist-cnn");
  EXPECT_EQ(job->model().layers_size(), 12);
  EXPECT_EQ(job->dataset().format(), v1::DATASET_FORMAT_IDX);
  EXPECT_TRUE(ValidateJobSpec(*job).ok()) << ValidateJobSpec(*job);
}

TEST(JobSpecTest, UnknownFieldIsAnErrorNamingTheFile) {
  auto job = ParseJobSpec(R"({"epochz": 3})", "", "typo.json");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("typo.json"));
}

TEST(JobSpecTest, MissingFileIsNotFound) {
  auto job = LoadJobSpec("/nonexistent/job.json");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("/nonexistent/job.json"));
}

TEST(JobSpecTest, MissingModelFileNamesBothFiles) {
  auto job = ParseJobSpec(R"({"model_file": "nope.json"})", "/tmp", "j.json");
  ASSERT_FALSE(job.ok());
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("j.json"));
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("/tmp/nope.json"));
}

TEST(JobSpecTest, ValidationNamesTheField) {
  auto base = LoadJobSpec(kSource + "/examples/fashion-mnist.json");
  ASSERT_TRUE(base.ok());
  struct Case {
    std::function<void(v1::JobSpec&)> mutate;
    const char* message;
  } cases[] = {
      {[](v1::JobSpec& j) { j.set_epochs(0); }, "epochs must be > 0"},
      {[](v1::JobSpec& j) { j.set_batch_size(-1); }, "batch_size must be in [1, 65536]"},
      {[](v1::JobSpec& j) { j.mutable_dataset()->clear_path(); }, "dataset.path is empty"},
      {[](v1::JobSpec& j) { j.mutable_dataset()->set_format(v1::DATASET_FORMAT_UNSPECIFIED); },
       "dataset.format"},
      {[](v1::JobSpec& j) { j.mutable_dataset()->set_std(0, 0.f); }, "dataset.std"},
      {[](v1::JobSpec& j) { j.clear_model(); }, "job has no model"},
      {[](v1::JobSpec& j) { j.mutable_model()->mutable_layers(0)->mutable_conv2d()->set_filters(-3); },
       "model: layer 'conv1' (conv2d): filters must be > 0"},
      {[](v1::JobSpec& j) {
         j.set_mode(v1::CONSISTENCY_AVERAGE);
         j.set_averaging_frequency(-1);
       },
       "averaging_frequency must be >= 0"},
  };
  for (const Case& c : cases) {
    v1::JobSpec job = *base;
    c.mutate(job);
    absl::Status status = ValidateJobSpec(job);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
  }
}

// Regression: `PSTRAIN_MODE=average deploy/local/main-job.sh` failed with
// "mode average needs averaging_frequency > 0"; 0 now means DL4J's K = 5.
TEST(JobSpecTest, AverageModeDefaultsToFiveLocalSteps) {
  v1::JobSpec job;
  job.set_mode(v1::CONSISTENCY_AVERAGE);
  ApplyJobDefaults(&job);
  EXPECT_EQ(job.averaging_frequency(), kDefaultAveragingFrequency);
  EXPECT_EQ(job.averaging_frequency(), 5);
  EXPECT_EQ(job.workers(), 1);
  job.set_averaging_frequency(3);
  ApplyJobDefaults(&job);
  EXPECT_EQ(job.averaging_frequency(), 3);  // An explicit K is kept.
  v1::JobSpec sync;
  sync.set_mode(v1::CONSISTENCY_SYNC);
  ApplyJobDefaults(&sync);
  EXPECT_EQ(sync.averaging_frequency(), 0);  // Other modes have no K.
}

TEST(JobSpecTest, RelativeDatasetPathIsResolvedAgainstTheJobDirectory) {
  auto job = ParseJobSpec(R"({"dataset": {"path": "data/x"}})", "/jobs/team", "j.json");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->dataset().path(), "/jobs/team/data/x");
}

}  // namespace
}  // namespace pstrain
