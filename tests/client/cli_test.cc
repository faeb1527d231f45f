// The pstrain CLI against an in-process fake Coordinator on 127.0.0.1: usage
// errors, option spellings, --json as the proto3 JSON mapping of the RPC's
// message, exit codes by job state, download, and deadlines when the server
// does not answer.
#include "client/cli.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/checkpoint.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A coordinator whose answers the test scripts.
class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest* request,
                         v1::SubmitJobResponse* response) override {
    Sleep();
    absl::MutexLock lock(&mu_);
    submitted.push_back(request->spec());
    if (request->spec().name() == "rejected-by-server") {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "optimizer.learning_rate must be > 0");
    }
    response->set_job_id("job-1");
    v1::JobStatus status;
    status.set_job_id("job-1");
    status.set_name(request->spec().name());
    status.set_state(v1::JOB_STATE_QUEUED);
    status.set_reason("waiting for 2 idle workers, 0 available");
    *status.mutable_spec() = request->spec();
    jobs["job-1"] = status;
    return grpc::Status::OK;
  }
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* request,
                      v1::JobStatus* response) override {
    Sleep();
    absl::MutexLock lock(&mu_);
    auto it = jobs.find(request->job_id());
    if (it == jobs.end()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown job '" + request->job_id() + "'");
    }
    *response = it->second;
    return grpc::Status::OK;
  }
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse* response) override {
    Sleep();
    absl::MutexLock lock(&mu_);
    for (const auto& [id, status] : jobs) *response->add_jobs() = status;
    return grpc::Status::OK;
  }
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest* request,
                         v1::CancelJobResponse* response) override {
    Sleep();
    absl::MutexLock lock(&mu_);
    auto it = jobs.find(request->job_id());
    if (it == jobs.end()) return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown job");
    it->second.set_state(v1::JOB_STATE_CANCELLED);
    it->second.set_reason("cancelled by a user");
    *response->mutable_status() = it->second;
    return grpc::Status::OK;
  }
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobStatus>* writer) override {
    Sleep();
    std::vector<v1::JobStatus> events;
    {
      absl::MutexLock lock(&mu_);
      events = watch_events;
    }
    for (const v1::JobStatus& e : events) writer->Write(e);
    return grpc::Status::OK;
  }
  grpc::Status DownloadModel(grpc::ServerContext*, const v1::DownloadModelRequest* request,
                             grpc::ServerWriter<v1::ModelChunk>* writer) override {
    Sleep();
    std::string bytes;
    {
      absl::MutexLock lock(&mu_);
      bytes = download_bytes;
    }
    if (bytes.empty()) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no checkpoint yet");
    }
    constexpr size_t kChunk = 1000;
    for (size_t offset = 0; offset < bytes.size(); offset += kChunk) {
      v1::ModelChunk chunk;
      chunk.set_offset(static_cast<int64_t>(offset));
      chunk.set_total_bytes(static_cast<int64_t>(bytes.size()));
      chunk.set_data(bytes.substr(offset, kChunk));
      writer->Write(chunk);
    }
    return grpc::Status::OK;
  }
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse* response) override {
    Sleep();
    auto* w = response->add_workers();
    w->set_worker_id("worker-7");
    w->mutable_info()->set_hostname("gpu-node-3");
    w->mutable_info()->set_backend("cuda");
    w->mutable_info()->set_gpus(2);
    w->set_job_id("job-1");
    w->set_alive(true);
    w->set_last_heartbeat_unix_ms(absl::ToUnixMillis(absl::Now()));
    return grpc::Status::OK;
  }

  void Sleep() {
    absl::Duration d;
    {
      absl::MutexLock lock(&mu_);
      d = sleep;
    }
    absl::SleepFor(d);
  }

  absl::Mutex mu_;
  std::vector<v1::JobSpec> submitted;
  std::map<std::string, v1::JobStatus> jobs;
  std::vector<v1::JobStatus> watch_events;
  std::string download_bytes;
  absl::Duration sleep;
};

v1::JobStatus Succeeded(const std::string& id) {
  v1::JobStatus s;
  s.set_job_id(id);
  s.set_name("fashion-mnist");
  s.set_state(v1::JOB_STATE_SUCCEEDED);
  s.set_epoch(2);
  s.set_step(1874);
  s.set_total_steps(1874);
  s.set_loss(0.31);
  s.set_samples_per_sec(2500);
  s.add_workers("worker-1");
  s.add_workers("worker-2");
  s.mutable_spec()->set_epochs(2);
  v1::EvalMetrics* t = s.mutable_test();
  t->set_accuracy(0.75);
  t->set_precision(0.7);
  t->set_recall(0.72);
  t->set_f1(0.71);
  t->set_samples(4);
  t->set_num_classes(2);
  for (int64_t c : {2, 0, 1, 1}) t->add_confusion(c);
  return s;
}

v1::JobStatus Running(const std::string& id, int64_t step) {
  v1::JobStatus s;
  s.set_job_id(id);
  s.set_state(v1::JOB_STATE_RUNNING);
  s.set_step(step);
  s.set_total_steps(1874);
  s.set_loss(1.0 / (step + 1));
  s.mutable_spec()->set_epochs(2);
  return s;
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = "127.0.0.1:" + std::to_string(port);
    dir_ = std::filesystem::temp_directory_path() /
           ("cli_test." + std::to_string(getpid()) + "." +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    std::filesystem::remove_all(dir_);
  }

  // Runs the CLI with --server pointing at the fake.
  int Run(std::vector<std::string> args) {
    args.insert(args.begin(), {"--server", address_});
    return RunCliRaw(args);
  }
  int RunCliRaw(const std::vector<std::string>& args) {
    out_.str("");
    err_.str("");
    return RunCli(args, env_, out_, err_);
  }
  std::string WriteJob(const std::string& json) {
    const std::string path = (dir_ / "job.json").string();
    std::ofstream(path) << json;
    return path;
  }
  std::string ExampleJob() const {
    return std::string(PSTRAIN_SOURCE_DIR) + "/examples/fashion-mnist.json";
  }
  // The last non-empty stdout line, parsed as a JSON object.
  google::protobuf::Struct LastLineJson() {
    std::vector<std::string> lines = absl::StrSplit(out_.str(), '\n', absl::SkipEmpty());
    google::protobuf::Struct parsed;
    EXPECT_FALSE(lines.empty());
    if (lines.empty()) return parsed;
    auto status = google::protobuf::util::JsonStringToMessage(lines.back(), &parsed);
    EXPECT_OK(status) << status << " in: " << lines.back();
    return parsed;
  }

  // The last non-empty stdout line, parsed as a `Message` (which fails on a
  // field the message does not have).
  template <typename Message>
  Message LastLineAs() {
    std::vector<std::string> lines = absl::StrSplit(out_.str(), '\n', absl::SkipEmpty());
    Message parsed;
    EXPECT_FALSE(lines.empty());
    if (lines.empty()) return parsed;
    auto status = google::protobuf::util::JsonStringToMessage(lines.back(), &parsed);
    EXPECT_OK(status) << status << " in: " << lines.back();
    return parsed;
  }

  FakeCoordinator fake_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::filesystem::path dir_;
  CliEnvironment env_;
  std::ostringstream out_, err_;
};

TEST_F(CliTest, UsageErrorsExitTwo) {
  EXPECT_EQ(RunCliRaw({}), 2);
  EXPECT_EQ(Run({"frobnicate"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("unknown command 'frobnicate'"));
  EXPECT_EQ(Run({"status"}), 2);
  EXPECT_EQ(Run({"status", "job-1", "--bogus"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("unknown option '--bogus'"));
  EXPECT_EQ(Run({"download", "job-1"}), 2);
  EXPECT_EQ(Run({"submit", ExampleJob(), "--mode", "eventual"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--mode must be sync, async, ssp or average"));
  EXPECT_EQ(Run({"submit", ExampleJob(), "--workers", "0"}), 2);
  EXPECT_EQ(Run({"submit", ExampleJob(), "--epochs"}), 2);
  EXPECT_EQ(Run({"submit", ExampleJob(), "--compression", "topk", "--min-compress-bytes", "-1"}),
            2);
  EXPECT_THAT(err_.str(), HasSubstr("--min-compress-bytes must be an integer >= 0"));
  EXPECT_EQ(Run({"submit", ExampleJob(), "--compression", "fp16", "--min-compress-bytes", "9"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("min_compress_bytes is only for COMPRESSION_TOPK"));
  EXPECT_EQ(Run({"--timeout-ms", "soon", "list"}), 2);
  EXPECT_EQ(Run({"submit", (dir_ / "missing.json").string()}), 2);
  absl::MutexLock lock(&fake_.mu_);
  EXPECT_TRUE(fake_.submitted.empty());
}

TEST_F(CliTest, EverySubcommandHasHelp) {
  for (const char* command : {"submit", "status", "report", "list", "watch", "cancel", "download",
                              "export", "prepare", "workers", "summary", "health"}) {
    for (const char* help : {"--help", "-h"}) {
      EXPECT_EQ(Run({command, help}), 0) << command;
      EXPECT_THAT(out_.str(), HasSubstr(std::string("usage: pstrain ") + command)) << command;
    }
  }
  EXPECT_EQ(RunCliRaw({"--help"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("download JOB -o FILE"));
}

// The option lists of --help come from the flags' help texts and defaults.
TEST_F(CliTest, HelpListsTheFlagsWithTheirDefaults) {
  ASSERT_EQ(Run({"submit", "--help"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("--averaging-frequency N"));
  EXPECT_THAT(out_.str(), HasSubstr("local steps between parameter averages"));
  EXPECT_THAT(out_.str(), HasSubstr("--watch "));
  EXPECT_THAT(out_.str(), Not(HasSubstr("--watch WATCH")));  // A switch takes no value.
  ASSERT_EQ(Run({"download", "--help"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("-o, --output FILE"));
  ASSERT_EQ(RunCliRaw({"--help"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("--timeout-ms N"));
  EXPECT_THAT(out_.str(), HasSubstr("(default: 10000)"));
  EXPECT_THAT(out_.str(), HasSubstr("--tls-server-name"));
}

// Every spelling the CLI always took still works, global options anywhere.
TEST_F(CliTest, OptionSpellings) {
  ASSERT_EQ(RunCliRaw({"submit", ExampleJob(), "--server=" + address_, "--mode=average",
                       "--averaging-frequency", "7", "--epochs=3", "--nowatch"}),
            0)
      << err_.str();
  ASSERT_EQ(RunCliRaw({"submit", ExampleJob(), "--averaging_frequency=9", "--server", address_,
                       "--workers", "2", "--json=false"}),
            0)
      << err_.str();
  EXPECT_EQ(out_.str(), "job-1\n");
  {
    absl::MutexLock lock(&fake_.mu_);
    ASSERT_EQ(fake_.submitted.size(), 2u);
    EXPECT_EQ(fake_.submitted[0].mode(), v1::CONSISTENCY_AVERAGE);
    EXPECT_EQ(fake_.submitted[0].averaging_frequency(), 7);
    EXPECT_EQ(fake_.submitted[0].epochs(), 3);
    EXPECT_EQ(fake_.submitted[1].averaging_frequency(), 9);
    EXPECT_EQ(fake_.submitted[1].workers(), 2);
  }
  EXPECT_EQ(Run({"download", "job-1", "--output=" + (dir_ / "a.ckpt").string()}), 1);
  EXPECT_THAT(err_.str(), HasSubstr("no checkpoint yet"));  // Parsed, then asked the server.
  EXPECT_EQ(Run({"download", "job-1", "-o=" + (dir_ / "a.ckpt").string()}), 1);
  EXPECT_THAT(err_.str(), HasSubstr("no checkpoint yet"));
  EXPECT_EQ(Run({"--timeout-ms", "0", "list"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--timeout-ms must be a positive integer"));
  EXPECT_EQ(Run({"submit", ExampleJob(), "--workers", "many"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--workers: 'many' is not a valid N"));
}

// Flags are process-wide: each RunCli starts from the defaults again.
TEST_F(CliTest, EveryCallStartsFromTheDefaults) {
  ASSERT_EQ(Run({"submit", ExampleJob(), "--workers", "3", "--epochs", "4", "--json"}), 0)
      << err_.str();
  ASSERT_EQ(Run({"submit", ExampleJob()}), 0) << err_.str();
  EXPECT_EQ(out_.str(), "job-1\n");  // No --json left over.
  absl::MutexLock lock(&fake_.mu_);
  ASSERT_EQ(fake_.submitted.size(), 2u);
  EXPECT_EQ(fake_.submitted[0].workers(), 3);
  EXPECT_NE(fake_.submitted[1].workers(), 3);  // The job file's.
  EXPECT_NE(fake_.submitted[1].epochs(), 4);
}

// Flags are process-wide, and RunCli may run on several threads at once:
// each call sees its own options (prepare refuses each --format by name,
// without a server, so that the calls overlap as much as they can).
TEST_F(CliTest, ConcurrentCallsKeepTheirOwnOptions) {
  constexpr int kCalls = 2000;
  auto prepare = [&](const std::string& format, int* mixed_up) {
    for (int i = 0; i < kCalls; ++i) {
      std::ostringstream out, err;
      const int code =
          RunCli({"prepare", "--format", format, "--path", "x", "-o", "y"}, env_, out, err);
      if (code != 2 || err.str().find("got '" + format + "'") == std::string::npos) ++*mixed_up;
    }
  };
  int mixed_up_a = 0, mixed_up_b = 0;
  std::thread a(prepare, "format-a", &mixed_up_a);
  std::thread b(prepare, "format-b", &mixed_up_b);
  a.join();
  b.join();
  EXPECT_EQ(mixed_up_a, 0);
  EXPECT_EQ(mixed_up_b, 0);
}

TEST_F(CliTest, AnOptionOfAnotherCommandIsAUsageError) {
  EXPECT_EQ(Run({"status", "job-1", "--workers", "3"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("unknown option '--workers'"));
  EXPECT_THAT(err_.str(), HasSubstr("usage: pstrain status"));
  EXPECT_EQ(Run({"list", "--flagfile=/etc/passwd"}), 2);  // Abseil's own flags too.
  EXPECT_THAT(err_.str(), HasSubstr("unknown option '--flagfile=/etc/passwd'"));
  EXPECT_EQ(Run({"list", "--nojson=1"}), 2);
  EXPECT_EQ(Run({"watch", "job-1", "--noservice"}), 2);
}

TEST_F(CliTest, InvalidSpecIsRejectedLocallyWithExitTwo) {
  std::string path = WriteJob(R"({"name": "x", "model_file": ")" + std::string(PSTRAIN_SOURCE_DIR) +
                              R"(/examples/models/fmnist-cnn.json", "epochs": 1, "batch_size": 0,
      "dataset": {"format": "DATASET_FORMAT_IDX", "path": "/tmp"},
      "optimizer": {"type": "OPTIMIZER_SGD", "learning_rate": 0.1}})");
  EXPECT_EQ(Run({"submit", path}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("batch_size"));
  absl::MutexLock lock(&fake_.mu_);
  EXPECT_TRUE(fake_.submitted.empty());
}

TEST_F(CliTest, ServerSideValidationErrorExitsTwo) {
  std::string path = WriteJob(R"({"name": "rejected-by-server", "model_file": ")" +
                              std::string(PSTRAIN_SOURCE_DIR) +
                              R"(/examples/models/fmnist-cnn.json", "epochs": 1, "batch_size": 8,
      "dataset": {"format": "DATASET_FORMAT_IDX", "path": "/tmp"},
      "optimizer": {"type": "OPTIMIZER_SGD", "learning_rate": 0.1}})");
  EXPECT_EQ(Run({"submit", path}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("learning_rate"));
}

TEST_F(CliTest, SubmitAppliesOverridesAndInlinesTheModel) {
  ASSERT_EQ(Run({"submit", ExampleJob(), "--workers", "3", "--mode", "ssp", "--staleness", "2",
                 "--epochs", "4", "--compression", "topk:0.02", "--min-compress-bytes", "262144",
                 "--json"}),
            0)
      << err_.str();
  const v1::JobStatus status = LastLineAs<v1::JobStatus>();
  EXPECT_EQ(status.job_id(), "job-1");
  EXPECT_EQ(status.state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(status.spec().workers(), 3);
  absl::MutexLock lock(&fake_.mu_);
  ASSERT_EQ(fake_.submitted.size(), 1u);
  const v1::JobSpec& spec = fake_.submitted[0];
  EXPECT_EQ(spec.workers(), 3);
  EXPECT_EQ(spec.mode(), v1::CONSISTENCY_SSP);
  EXPECT_EQ(spec.staleness(), 2);
  EXPECT_EQ(spec.epochs(), 4);
  EXPECT_EQ(spec.compression().method(), v1::CompressionSpec::COMPRESSION_TOPK);
  EXPECT_FLOAT_EQ(spec.compression().topk_ratio(), 0.02f);
  EXPECT_EQ(spec.compression().min_compress_bytes(), 262144);
  EXPECT_TRUE(spec.model_file().empty());
  EXPECT_GT(spec.model().layers_size(), 0);
}

TEST_F(CliTest, SubmitSetsThePrecision) {
  ASSERT_EQ(Run({"submit", ExampleJob(), "--precision", "bf16", "--json"}), 0) << err_.str();
  ASSERT_EQ(Run({"submit", ExampleJob(), "--precision", "fp16", "--json"}), 0) << err_.str();
  EXPECT_EQ(Run({"submit", ExampleJob(), "--precision", "fp8"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--precision must be fp32, bf16 or fp16, got 'fp8'"));
  absl::MutexLock lock(&fake_.mu_);
  ASSERT_EQ(fake_.submitted.size(), 2u);
  EXPECT_EQ(fake_.submitted[0].precision(), v1::PRECISION_BF16);
  EXPECT_EQ(fake_.submitted[1].precision(), v1::PRECISION_FP16);
}

TEST_F(CliTest, SubmitSetsPullCompressionAndItsMinCompressBytes) {
  // fp16 pushes, 1-bit pulls: --min-compress-bytes goes to the pull codec
  // only (F16 sends every parameter whole anyway).
  ASSERT_EQ(Run({"submit", ExampleJob(), "--compression", "fp16", "--pull-compression", "onebit",
                 "--min-compress-bytes", "262144", "--json"}),
            0)
      << err_.str();
  // Top-k both ways: to both.
  ASSERT_EQ(Run({"submit", ExampleJob(), "--compression", "topk", "--pull-compression", "topk:0.05",
                 "--min-compress-bytes", "4096", "--json"}),
            0)
      << err_.str();
  EXPECT_EQ(Run({"submit", ExampleJob(), "--pull-compression", "lz4"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("--pull-compression must be none, fp16, bf16"));
  EXPECT_EQ(Run({"submit", ExampleJob(), "--mode", "async", "--pull-compression", "fp16"}), 2);
  EXPECT_THAT(err_.str(), HasSubstr("pull_compression applies to CONSISTENCY_SYNC"));
  absl::MutexLock lock(&fake_.mu_);
  ASSERT_EQ(fake_.submitted.size(), 2u);
  const v1::JobSpec& first = fake_.submitted[0];
  EXPECT_EQ(first.compression().method(), v1::CompressionSpec::COMPRESSION_FP16);
  EXPECT_EQ(first.compression().min_compress_bytes(), 0);
  EXPECT_EQ(first.pull_compression().method(), v1::CompressionSpec::COMPRESSION_ONEBIT);
  EXPECT_EQ(first.pull_compression().min_compress_bytes(), 262144);
  const v1::JobSpec& second = fake_.submitted[1];
  EXPECT_EQ(second.compression().min_compress_bytes(), 4096);
  EXPECT_EQ(second.pull_compression().method(), v1::CompressionSpec::COMPRESSION_TOPK);
  EXPECT_FLOAT_EQ(second.pull_compression().topk_ratio(), 0.05f);
  EXPECT_EQ(second.pull_compression().min_compress_bytes(), 4096);
}

TEST_F(CliTest, SubmitWatchJsonEndsWithTheFinalStateAndExitsByIt) {
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.watch_events = {Running("job-1", 100), Running("job-1", 900), Succeeded("job-1")};
  }
  ASSERT_EQ(Run({"submit", ExampleJob(), "--watch", "--json"}), 0) << err_.str();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(LastLineAs<v1::JobStatus>(),
                                                                 Succeeded("job-1")))
      << out_.str();
  EXPECT_THAT(out_.str(), HasSubstr("step 900/1874"));
  EXPECT_THAT(out_.str(), HasSubstr("true\\pred"));  // The confusion matrix.

  v1::JobStatus failed = Succeeded("job-1");
  failed.set_state(v1::JOB_STATE_FAILED);
  failed.set_reason("worker-2: training diverged");
  failed.clear_test();
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.watch_events = {Running("job-1", 5), failed};
  }
  EXPECT_EQ(Run({"submit", ExampleJob(), "--watch", "--json"}), 1);
  google::protobuf::Struct json = LastLineJson();
  EXPECT_EQ(json.fields().at("state").string_value(), "JOB_STATE_FAILED");
  EXPECT_EQ(json.fields().at("reason").string_value(), "worker-2: training diverged");
}

TEST_F(CliTest, StatusJsonIsTheProto3MappingOfJobStatus) {
  v1::JobStatus job = Succeeded("job-9");
  job.set_reason("all 2 workers \"finished\"\n");
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.jobs["job-9"] = job;
  }
  ASSERT_EQ(Run({"status", "job-9", "--json"}), 0) << err_.str();
  const std::string out = out_.str();
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << out;  // One line.
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(LastLineAs<v1::JobStatus>(), job))
      << out_.str();
  // The mapping: names as in the .proto, enums by name, 64-bit integers as
  // strings, defaults printed, unset messages left out.
  google::protobuf::Struct json = LastLineJson();
  EXPECT_EQ(json.fields().at("state").string_value(), "JOB_STATE_SUCCEEDED");
  EXPECT_EQ(json.fields().at("reason").string_value(), "all 2 workers \"finished\"\n");
  EXPECT_EQ(json.fields().at("step").string_value(), "1874");
  EXPECT_DOUBLE_EQ(json.fields().at("epoch").number_value(), 2);
  EXPECT_DOUBLE_EQ(json.fields().at("runs").number_value(), 0);
  EXPECT_EQ(json.fields().at("stragglers").list_value().values_size(), 0);
  EXPECT_EQ(json.fields().at("workers").list_value().values_size(), 2);
  const google::protobuf::Struct& test = json.fields().at("test").struct_value();
  EXPECT_DOUBLE_EQ(test.fields().at("f1").number_value(), 0.71);
  EXPECT_EQ(test.fields().at("samples").string_value(), "4");
  EXPECT_EQ(test.fields().at("confusion").list_value().values_size(), 4);
  EXPECT_TRUE(json.fields().contains("total_steps"));
  EXPECT_TRUE(json.fields().contains("samples_per_sec"));

  EXPECT_EQ(Run({"status", "job-9"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("accuracy 0.7500"));

  EXPECT_EQ(Run({"status", "job-404"}), 1);
  EXPECT_THAT(err_.str(), HasSubstr("unknown job 'job-404'"));
}

TEST_F(CliTest, WatchPrintsOneLinePerUpdateAndExitsByFinalState) {
  v1::JobStatus cancelled = Running("job-2", 300);
  cancelled.set_state(v1::JOB_STATE_CANCELLED);
  cancelled.set_reason("cancelled by a user");
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.watch_events = {Running("job-2", 100), Running("job-2", 200), cancelled};
  }
  EXPECT_EQ(Run({"watch", "job-2"}), 1);
  EXPECT_THAT(out_.str(), HasSubstr("step 100/1874"));
  EXPECT_THAT(out_.str(), HasSubstr("step 200/1874"));
  EXPECT_THAT(out_.str(), HasSubstr("job-2 CANCELLED: cancelled by a user"));
  EXPECT_THAT(out_.str(), Not(HasSubstr("\r")));

  env_.stdout_is_tty = true;
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.watch_events = {Running("job-3", 100), Running("job-3", 1000), Succeeded("job-3")};
  }
  EXPECT_EQ(Run({"watch", "job-3"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("\rjob-3 RUNNING"));
  EXPECT_THAT(out_.str(), HasSubstr("ETA"));
}

// Regression: main-job.sh's log printed every step twice, once per worker's
// report (the two statuses differ only in their rates and ETA).
TEST_F(CliTest, WatchIntoALogPrintsEachUpdateOnce) {
  v1::JobStatus first_report = Running("job-2", 100);
  first_report.set_samples_per_sec(900);
  v1::JobStatus second_report = Running("job-2", 100);
  second_report.set_samples_per_sec(1100);
  v1::JobStatus cancelled = Running("job-2", 300);
  cancelled.set_state(v1::JOB_STATE_CANCELLED);
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.watch_events = {first_report, second_report, Running("job-2", 200), cancelled};
  }
  EXPECT_EQ(Run({"watch", "job-2"}), 1);
  const std::string out = out_.str();
  size_t lines_of_step_100 = 0;
  for (size_t at = out.find("step 100/"); at != std::string::npos;
       at = out.find("step 100/", at + 1)) {
    ++lines_of_step_100;
  }
  EXPECT_EQ(lines_of_step_100, 1u) << out;
  EXPECT_THAT(out, HasSubstr("step 200/1874"));
}

TEST_F(CliTest, CancelPrintsTheNewState) {
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.jobs["job-4"] = Running("job-4", 10);
  }
  EXPECT_EQ(Run({"cancel", "job-4"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("job-4 CANCELLED"));
  EXPECT_EQ(Run({"cancel", "job-5"}), 1);
}

TEST_F(CliTest, ListAndWorkersPrintTables) {
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.jobs["job-1"] = Succeeded("job-1");
  }
  EXPECT_EQ(Run({"list"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("job-1"));
  EXPECT_THAT(out_.str(), HasSubstr("SUCCEEDED"));
  EXPECT_THAT(out_.str(), HasSubstr("0.7500"));
  EXPECT_EQ(Run({"workers"}), 0);
  EXPECT_THAT(out_.str(), HasSubstr("worker-7"));
  EXPECT_THAT(out_.str(), HasSubstr("gpu-node-3"));
  EXPECT_THAT(out_.str(), HasSubstr("busy"));
}

TEST_F(CliTest, ListAndWorkersJsonAreTheirResponses) {
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.jobs["job-1"] = Succeeded("job-1");
    fake_.jobs["job-2"] = Running("job-2", 7);
  }
  ASSERT_EQ(Run({"list", "--json"}), 0) << err_.str();
  const auto jobs = LastLineAs<v1::ListJobsResponse>();
  ASSERT_EQ(jobs.jobs_size(), 2) << out_.str();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(jobs.jobs(0), Succeeded("job-1")));
  EXPECT_TRUE(
      google::protobuf::util::MessageDifferencer::Equals(jobs.jobs(1), Running("job-2", 7)));
  ASSERT_EQ(Run({"workers", "--json"}), 0) << err_.str();
  const auto workers = LastLineAs<v1::ListWorkersResponse>();
  ASSERT_EQ(workers.workers_size(), 1) << out_.str();
  EXPECT_EQ(workers.workers(0).worker_id(), "worker-7");
  EXPECT_EQ(workers.workers(0).info().gpus(), 2);
  EXPECT_TRUE(workers.workers(0).alive());
}

TEST_F(CliTest, DownloadWritesAVerifiedCheckpoint) {
  v1::Checkpoint ckpt;
  ckpt.mutable_job()->set_name("fashion-mnist");
  std::vector<float> w(3000, 0.5f);
  *ckpt.add_parameters() = MakeTensorProto("fc1/weight", {3000}, w.data());
  ckpt.set_step(42);
  const std::string source = (dir_ / "server.ckpt").string();
  ASSERT_OK(WriteCheckpointFile(source, ckpt));
  std::ifstream in(source, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.download_bytes = bytes;
  }
  const std::string target = (dir_ / "model.ckpt").string();
  ASSERT_EQ(Run({"download", "job-1", "-o", target}), 0) << err_.str();
  auto loaded = ReadCheckpointFile(target);
  ASSERT_OK(loaded);
  EXPECT_EQ(loaded->step(), 42);
  EXPECT_FALSE(std::filesystem::exists(target + ".tmp"));

  // A corrupt download is rejected and leaves nothing behind.
  bytes[bytes.size() / 2] ^= 0x5a;
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.download_bytes = bytes;
  }
  const std::string bad = (dir_ / "bad.ckpt").string();
  EXPECT_EQ(Run({"download", "job-1", "-o", bad}), 1);
  EXPECT_THAT(err_.str(), HasSubstr("invalid"));
  EXPECT_FALSE(std::filesystem::exists(bad));
  EXPECT_FALSE(std::filesystem::exists(bad + ".tmp"));

  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.download_bytes.clear();
  }
  EXPECT_EQ(Run({"download", "job-1", "-o", bad}), 1);
  EXPECT_THAT(err_.str(), HasSubstr("no checkpoint yet"));
}

TEST_F(CliTest, CallsGiveUpAtTheirDeadlineWhenTheServerDoesNotAnswer) {
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.sleep = absl::Seconds(3);
    fake_.jobs["job-1"] = Running("job-1", 1);
  }
  for (std::vector<std::string> command :
       {std::vector<std::string>{"status", "job-1"}, {"list"}, {"workers"},
        {"download", "job-1", "-o", (dir_ / "x.ckpt").string()}}) {
    command.insert(command.begin(), {"--timeout-ms", "300"});
    const absl::Time start = absl::Now();
    EXPECT_EQ(Run(command), 1) << command[2];
    EXPECT_LT(absl::Now() - start, absl::Milliseconds(2500)) << command[2];
    EXPECT_THAT(err_.str(), HasSubstr("300 ms")) << command[2];
  }
}

TEST_F(CliTest, WatchWarnsWhenNoEventArrives) {
  {
    absl::MutexLock lock(&fake_.mu_);
    fake_.sleep = absl::Milliseconds(800);
    fake_.watch_events = {Succeeded("job-1")};
  }
  env_.watch_silence_warning = absl::Milliseconds(200);
  EXPECT_EQ(Run({"watch", "job-1"}), 0);
  EXPECT_THAT(err_.str(), HasSubstr("no update about job-1"));
}

// Seen: a `pstrain list` issued right after the server began listening
// failed 1 time in 10 ("tcp handshaker shutdown"). Calls wait for the channel
// within their deadline.
TEST_F(CliTest, ACallMadeBeforeTheServerListensWaitsForItWithinTheDeadline) {
  server_->Shutdown(std::chrono::system_clock::now());
  const int port = std::stoi(address_.substr(address_.rfind(':') + 1));
  int code = -1;
  std::thread cli([&] { code = Run({"--timeout-ms", "20000", "list"}); });
  absl::SleepFor(absl::Milliseconds(500));  // The CLI is waiting for the channel now.
  FakeCoordinator late;
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(),
                           &bound);
  builder.RegisterService(&late);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_EQ(bound, port);
  cli.join();
  EXPECT_EQ(code, 0) << err_.str();
  server->Shutdown(std::chrono::system_clock::now());
}

TEST_F(CliTest, UnreachableServerSaysItCouldNotConnect) {
  server_->Shutdown(std::chrono::system_clock::now());
  EXPECT_EQ(Run({"--timeout-ms", "500", "status", "job-1"}), 1);
  EXPECT_THAT(err_.str(), HasSubstr("could not connect to " + address_));
}

TEST_F(CliTest, UnreachableServerIsAnRpcError) {
  server_->Shutdown(std::chrono::system_clock::now());
  EXPECT_EQ(Run({"--timeout-ms", "500", "status", "job-1"}), 1);
  EXPECT_THAT(err_.str(), Not(HasSubstr("OK")));
}

TEST(CliFormatTest, ProgressLineShowsBarAndEta) {
  v1::JobStatus s = Running("job-1", 937);
  std::string line = FormatProgressLine(s, 100);
  EXPECT_THAT(line, HasSubstr("[##########----------]  50%"));
  EXPECT_THAT(line, HasSubstr("ETA 9s"));
  s.set_state(v1::JOB_STATE_QUEUED);
  s.set_reason("waiting for 2 idle workers, 1 available");
  EXPECT_EQ(FormatProgressLine(s, 0), "job-1 QUEUED: waiting for 2 idle workers, 1 available");
}

}  // namespace
}  // namespace pstrain
