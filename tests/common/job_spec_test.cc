#include "common/job_spec.h"

#include <filesystem>
#include <functional>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model_graph.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

const std::string kSource = PSTRAIN_SOURCE_DIR;

TEST(JobSpecTest, LoadsTheShippedFashionMnistJobAndResolvesItsModelFile) {
  auto job = LoadJobSpec(kSource + "/examples/fashion-mnist.json");
  ASSERT_OK(job);
  EXPECT_TRUE(job->has_model());
  EXPECT_TRUE(job->model_file().empty());
  EXPECT_EQ(job->model().name(), "fmnist-cnn");
  EXPECT_EQ(job->model().layers_size(), 12);
  EXPECT_EQ(job->dataset().format(), v1::DATASET_FORMAT_IDX);
  EXPECT_OK(ValidateJobSpec(*job));
}

TEST(JobSpecTest, TheShippedCommandJobImpliesAnExternalModelAndCommandsAreBounded) {
  auto job = LoadJobSpec(kSource + "/examples/torch/job-daemons.json");
  ASSERT_OK(job);
  EXPECT_TRUE(job->has_external_model());
  EXPECT_EQ(job->command().argv(0), "train_fmnist.py");
  EXPECT_OK(ValidateJobSpec(*job));

  auto refused = [&](const std::function<void(v1::CommandSpec&)>& edit) {
    v1::JobSpec bad = *job;
    edit(*bad.mutable_command());
    return ValidateJobSpec(bad);
  };
  EXPECT_THAT(refused([](v1::CommandSpec& c) { c.clear_argv(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 to 64 arguments")));
  EXPECT_THAT(refused([](v1::CommandSpec& c) { c.mutable_argv(0)->clear(); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("non-empty program")));
  EXPECT_THAT(refused([](v1::CommandSpec& c) { c.add_argv(std::string(5000, 'x')); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("command.argv[3] is over")));
  EXPECT_THAT(refused([](v1::CommandSpec& c) { c.add_argv(std::string("a\0b", 3)); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("NUL")));
  EXPECT_THAT(refused([](v1::CommandSpec& c) { c.mutable_env()->insert({std::string("1BAD"), std::string("x")}); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a variable name")));
  EXPECT_THAT(refused([](v1::CommandSpec& c) { c.mutable_env()->insert({std::string("PSTRAIN_SERVER"), std::string("x")}); }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("set by the daemon")));
  EXPECT_THAT(refused([](v1::CommandSpec& c) {
                for (int i = 0; i < 65; ++i) c.mutable_env()->insert({absl::StrCat("V", i), std::string("x")});
              }),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 64")));
}

TEST(JobSpecTest, UnknownFieldIsAnErrorNamingTheFile) {
  auto job = ParseJobSpec(R"({"epochz": 3})", "", "typo.json");
  ASSERT_FALSE(job.ok());
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("typo.json"));
}

TEST(JobSpecTest, BenchOnlyFixedComputeCannotBeSetFromAJob) {
  // pstrain-worker --bench_only_fixed_compute_ms is a command-line flag only:
  // a job asking for it is refused, wherever in the spec it is written.
  for (const char* json :
       {R"({"bench_only_fixed_compute_ms": 5})", R"({"benchOnlyFixedComputeMs": 5})",
        R"({"optimizer": {"bench_only_fixed_compute_ms": 5}})",
        R"({"dataset": {"bench_only_fixed_compute_ms": 5}})"}) {
    EXPECT_THAT(ParseJobSpec(json, "", "bench.json"),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bench.json")))
        << json;
  }
  // And no field of JobSpec, or of any message under it, could carry it.
  std::vector<const google::protobuf::Descriptor*> todo = {v1::JobSpec::descriptor()};
  std::set<const google::protobuf::Descriptor*> seen;
  while (!todo.empty()) {
    const google::protobuf::Descriptor* message = todo.back();
    todo.pop_back();
    if (!seen.insert(message).second) continue;
    for (int i = 0; i < message->field_count(); ++i) {
      const google::protobuf::FieldDescriptor* field = message->field(i);
      EXPECT_THAT(field->name(), ::testing::Not(HasSubstr("bench"))) << field->full_name();
      EXPECT_THAT(field->name(), ::testing::Not(HasSubstr("fixed_compute"))) << field->full_name();
      if (field->message_type() != nullptr) todo.push_back(field->message_type());
    }
  }
  EXPECT_GT(seen.size(), 3u);  // The walk reached the nested messages.
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
  ASSERT_OK(base);
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
      {[](v1::JobSpec& j) {
         j.mutable_model()->mutable_layers(0)->mutable_conv2d()->set_filters(-3);
       },
       "model: layer 'conv1' (conv2d): filters must be > 0"},
      {[](v1::JobSpec& j) {
         j.set_mode(v1::CONSISTENCY_AVERAGE);
         j.set_averaging_frequency(-1);
       },
       "averaging_frequency must be >= 0"},
      {[](v1::JobSpec& j) {
         j.mutable_compression()->set_method(v1::CompressionSpec::COMPRESSION_TOPK);
         j.mutable_compression()->set_topk_ratio(2.0f);
       },
       "compression.topk_ratio must be in (0, 1]"},
      {[](v1::JobSpec& j) {
         j.mutable_compression()->set_method(static_cast<v1::CompressionSpec::Method>(42));
       },
       "compression.method 42 is not a known method"},
      {[](v1::JobSpec& j) {
         j.set_mode(v1::CONSISTENCY_AVERAGE);
         j.mutable_compression()->set_method(v1::CompressionSpec::COMPRESSION_ONEBIT);
       },
       "compression applies to gradient pushes"},
      {[](v1::JobSpec& j) {
         j.mutable_pull_compression()->set_method(v1::CompressionSpec::COMPRESSION_TOPK);
         j.mutable_pull_compression()->set_topk_ratio(-0.5f);
       },
       "pull_compression.topk_ratio must be in (0, 1]"},
      {[](v1::JobSpec& j) {
         j.mutable_pull_compression()->set_method(v1::CompressionSpec::COMPRESSION_FP16);
         j.mutable_pull_compression()->set_min_compress_bytes(1024);
       },
       "pull_compression.min_compress_bytes is only for"},
      {[](v1::JobSpec& j) {
         j.set_mode(v1::CONSISTENCY_SSP);
         j.mutable_pull_compression()->set_method(v1::CompressionSpec::COMPRESSION_FP16);
       },
       "pull_compression applies to CONSISTENCY_SYNC"},
      {[](v1::JobSpec& j) { j.set_precision(static_cast<v1::Precision>(7)); },
       "precision 7 is not a known Precision"},
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

// Issue 43: top-k with the defaults ended 1.06 points below uncompressed
// sync; with min_compress_bytes 262144 it matched it. That is now the default,
// and an explicit 0 (compress every parameter) is kept.
TEST(JobSpecTest, SparseCompressionDefaultsToSendingSmallParametersWhole) {
  for (const v1::CompressionSpec::Method method :
       {v1::CompressionSpec::COMPRESSION_TOPK, v1::CompressionSpec::COMPRESSION_ONEBIT}) {
    v1::JobSpec job;
    job.mutable_compression()->set_method(method);
    ApplyJobDefaults(&job);
    EXPECT_EQ(job.compression().min_compress_bytes(), kDefaultMinCompressBytes);
    EXPECT_EQ(job.compression().min_compress_bytes(), 262144);

    v1::JobSpec every_parameter;
    every_parameter.mutable_compression()->set_method(method);
    every_parameter.mutable_compression()->set_min_compress_bytes(0);
    ApplyJobDefaults(&every_parameter);
    EXPECT_TRUE(every_parameter.compression().has_min_compress_bytes());
    EXPECT_EQ(every_parameter.compression().min_compress_bytes(), 0);
  }
  v1::JobSpec fp16;
  fp16.mutable_compression()->set_method(v1::CompressionSpec::COMPRESSION_FP16);
  fp16.mutable_pull_compression()->set_method(v1::CompressionSpec::COMPRESSION_TOPK);
  ApplyJobDefaults(&fp16);
  EXPECT_FALSE(fp16.compression().has_min_compress_bytes());  // Only sparse codecs use it.
  EXPECT_FALSE(fp16.pull_compression().has_min_compress_bytes());
}

// "UNSPECIFIED means sync" was guessed in seven places; the defaults say it
// once, so the stored spec, the shards and the workers read the same mode.
TEST(JobSpecTest, DefaultsSetTheModeToSync) {
  v1::JobSpec job;
  EXPECT_EQ(ConsistencyModeOf(job), v1::CONSISTENCY_SYNC);
  ApplyJobDefaults(&job);
  EXPECT_EQ(job.mode(), v1::CONSISTENCY_SYNC);
  v1::JobSpec ssp;
  ssp.set_mode(v1::CONSISTENCY_SSP);
  ApplyJobDefaults(&ssp);
  EXPECT_EQ(ssp.mode(), v1::CONSISTENCY_SSP);  // An explicit mode is kept.
  EXPECT_EQ(ConsistencyModeOf(ssp), v1::CONSISTENCY_SSP);
}

TEST(JobSpecTest, RelativeDatasetPathIsResolvedAgainstTheJobDirectory) {
  auto job = ParseJobSpec(R"({"dataset": {"path": "data/x"}})", "/jobs/team", "j.json");
  ASSERT_OK(job);
  EXPECT_EQ(job->dataset().path(), "/jobs/team/data/x");
}

// Regression (security review, issue 8): mode 42 passed validation and ran
// as async; an unknown dataset format or optimizer type was accepted too.
TEST(JobSpecTest, UnknownEnumValuesAreInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(v1::JobSpec base, LoadJobSpec(kSource + "/examples/fashion-mnist.json"));
  EXPECT_OK(ValidateJobSpec(base));
  v1::JobSpec job = base;
  job.set_mode(static_cast<v1::ConsistencyMode>(42));
  EXPECT_THAT(ValidateJobSpec(job),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mode 42 is not a known")));
  job = base;
  job.mutable_dataset()->set_format(static_cast<v1::DatasetFormat>(42));
  EXPECT_THAT(ValidateJobSpec(job),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dataset.format")));
  job = base;
  job.mutable_optimizer()->set_type(static_cast<v1::OptimizerType>(42));
  EXPECT_THAT(ValidateJobSpec(job), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("optimizer.type 42 is not a known")));
  job = base;
  job.mutable_dataset()->set_balance(static_cast<v1::Balance>(42));
  EXPECT_THAT(ValidateJobSpec(job), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("dataset.balance 42 is not a known")));
  job = base;
  job.mutable_dataset()->set_balance(v1::BALANCE_OVERSAMPLE);
  EXPECT_OK(ValidateJobSpec(job));
}

// A job whose model is `input [1, 28, 28] -> conv(filters) -> flatten ->
// dense 10 -> loss`, trained with `optimizer`.
v1::JobSpec ConvJob(int filters, v1::OptimizerType optimizer) {
  v1::JobSpec job;
  job.set_name("conv");
  v1::ModelSpec* m = job.mutable_model();
  m->add_input_shape(1);
  m->add_input_shape(28);
  m->add_input_shape(28);
  m->set_num_classes(10);
  v1::LayerSpec* conv = m->add_layers();
  conv->set_name("conv1");
  conv->mutable_conv2d()->set_filters(filters);
  conv->mutable_conv2d()->set_kernel_size(28);
  m->add_layers()->set_name("flat");
  m->mutable_layers(1)->mutable_flatten();
  v1::LayerSpec* fc = m->add_layers();
  fc->set_name("fc");
  fc->mutable_dense()->set_units(10);
  m->add_layers()->set_name("loss");
  m->mutable_layers(3)->mutable_softmax_cross_entropy();
  job.mutable_optimizer()->set_type(optimizer);
  return job;
}

// Regression (issue 8): a job with 1e9 conv filters passed SubmitJob and the
// server died with bad_alloc once a worker was idle.
TEST(JobSpecTest, JobLimitsRefuseAModelWithABillionConvFilters) {
  v1::JobSpec job = ConvJob(1000000000, v1::OPTIMIZER_SGD);
  ASSERT_OK_AND_ASSIGN(ModelGraph graph, BuildModelGraph(job.model()));
  EXPECT_THAT(CheckJobLimits(job, graph, JobLimits()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a job may have at most 268435456 (--max-job-parameters)")));

  // 25,600 filters: 20.5M parameters; Adam keeps two more copies.
  job = ConvJob(25600, v1::OPTIMIZER_ADAM);
  ASSERT_OK_AND_ASSIGN(graph, BuildModelGraph(job.model()));
  EXPECT_OK(CheckJobLimits(job, graph, JobLimits()));
  JobLimits small;
  small.max_parameter_bytes = 200 << 20;
  EXPECT_THAT(CheckJobLimits(job, graph, small),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(--max-job-bytes)")));
  job.mutable_optimizer()->set_type(v1::OPTIMIZER_SGD);
  EXPECT_OK(CheckJobLimits(job, graph, small));  // 82 MB without optimizer state.
}

TEST(JobSpecTest, JobLimitsBoundNames) {
  v1::JobSpec job = ConvJob(4, v1::OPTIMIZER_SGD);
  ASSERT_OK_AND_ASSIGN(ModelGraph graph, BuildModelGraph(job.model()));
  job.set_name(std::string(256, 'j'));
  EXPECT_OK(CheckJobLimits(job, graph, JobLimits()));
  job.set_name(std::string(257, 'j'));
  EXPECT_THAT(CheckJobLimits(job, graph, JobLimits()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("name has 257 bytes")));
  job.set_name("ok");
  job.mutable_model()->set_name(std::string(1000, 'm'));
  EXPECT_THAT(CheckJobLimits(job, graph, JobLimits()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.name")));
}

TEST(JobSpecTest, TestSetBoundComesFromTheSpecWhenItKnowsIt) {
  v1::JobSpec job;
  job.mutable_dataset()->set_format(v1::DATASET_FORMAT_IDX);
  EXPECT_EQ(TestSetBound(job), std::nullopt);
  job.mutable_dataset()->set_test_limit(500);
  EXPECT_EQ(TestSetBound(job), 500);
  job.mutable_dataset()->set_format(v1::DATASET_FORMAT_CIFAR10);
  job.mutable_dataset()->set_test_limit(0);
  EXPECT_EQ(TestSetBound(job), 10000);
  job.mutable_dataset()->set_format(v1::DATASET_FORMAT_SYNTHETIC);
  job.mutable_dataset()->mutable_synthetic()->set_test_samples(64);
  EXPECT_EQ(TestSetBound(job), 64);
  job.mutable_dataset()->set_test_limit(32);
  EXPECT_EQ(TestSetBound(job), 32);
}

TEST(JobSpecTest, AnExternalModelStandsInForTheModelAndIsChecked) {
  auto job = ParseJobSpec(R"({
      "external_model": {"framework": "torch",
                         "tensors": [{"name": "fc.weight", "shape": ["10", "784"], "trainable": true},
                                     {"name": "fc.bias", "shape": [10], "trainable": true}]},
      "optimizer": {"type": "OPTIMIZER_SGD", "learning_rate": 0.1},
      "epochs": 1, "batch_size": 32})",
                          "", "torch.json");
  ASSERT_OK(job);
  EXPECT_OK(ValidateJobSpec(*job));
  // Its workers read their own data, and declare the tensors when a
  // submitted spec leaves them out; the engine's precision is not theirs.
  v1::JobSpec with_data = *job;
  with_data.mutable_dataset()->set_format(v1::DATASET_FORMAT_SYNTHETIC);
  EXPECT_THAT(ValidateJobSpec(with_data),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has no dataset")));
  v1::JobSpec undeclared = *job;
  undeclared.mutable_external_model()->clear_tensors();
  EXPECT_OK(ValidateJobSpec(undeclared));
  EXPECT_FALSE(ExternalModelDeclared(undeclared));
  EXPECT_TRUE(ExternalModelDeclared(*job));
  v1::JobSpec bf16 = *job;
  bf16.set_precision(v1::PRECISION_BF16);
  EXPECT_THAT(ValidateJobSpec(bf16),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("leave precision unset")));
  v1::ExternalModel other = job->external_model();
  EXPECT_OK(CheckSameExternalModel(job->external_model(), other));
  other.mutable_tensors(1)->set_shape(0, 11);
  EXPECT_THAT(CheckSameExternalModel(job->external_model(), other),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("tensor 1 of the job's model is 'fc.bias' [10]; this one "
                                 "declares 'fc.bias' [11]")));
  v1::JobSpec both = *job;
  both.mutable_model()->set_name("m");
  EXPECT_THAT(ValidateJobSpec(both),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("set one of model, model_file and external_model")));
  v1::JobSpec bad = *job;
  bad.mutable_external_model()->mutable_tensors(1)->set_name("fc.weight");
  EXPECT_THAT(ValidateJobSpec(bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                             HasSubstr("declares tensor 'fc.weight' twice")));
  EXPECT_THAT(
      ParseJobSpec(R"({"model_file": "m.json", "external_model": {}})", "", "j.json").status(),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("j.json: set one of model, model_file and external_model")));
}

}  // namespace
}  // namespace pstrain
