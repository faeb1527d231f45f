// Coordinator and ShardController without processes: fake shards that keep
// the configured chunks in memory (and one real in-process ParameterShard),
// an injected clock, and Tick() called by the test instead of the background
// thread.
#include "server/coordinator.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/checkpoint.h"
#include "common/chunking.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "common/model_graph.h"
#include "common/rpc/channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "server/coordinator_service.h"
#include "server/parameter_shard.h"
#include "server/shard_controller.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// A shard that stores what it is configured with. ReadChunks returns the
// stored values; when `add_momentum` it also returns a "momentum" slot
// (values 0.5) for chunks of trainable parameters, like a shard running SGD
// with momentum.
class FakeShard {
 public:
  struct JobState {
    v1::ConfigureJobRequest config;
    std::vector<std::string> members;
    int64_t generation = 0;
  };

  mutable absl::Mutex mu;
  std::map<std::string, JobState> jobs ABSL_GUARDED_BY(mu);
  std::vector<std::string> dropped ABSL_GUARDED_BY(mu);
  int set_members_calls ABSL_GUARDED_BY(mu) = 0;
  bool fail_configure ABSL_GUARDED_BY(mu) = false;
  bool fail_set_members ABSL_GUARDED_BY(mu) = false;
  bool fail_drop ABSL_GUARDED_BY(mu) = false;
  bool fail_read ABSL_GUARDED_BY(mu) = false;
  bool add_momentum ABSL_GUARDED_BY(mu) = false;
  std::vector<v1::ReadChunksRequest> reads ABSL_GUARDED_BY(mu);
  // Steps reported for a member when SetMembers removes it (absent: 0).
  std::map<std::string, int64_t> member_steps ABSL_GUARDED_BY(mu);
};

class FakeShardClient final : public ShardClient {
 public:
  explicit FakeShardClient(FakeShard* shard) : shard_(shard) {}
  absl::Status ConfigureJob(const v1::ConfigureJobRequest& request) override {
    absl::MutexLock lock(&shard_->mu);
    if (shard_->fail_configure) return absl::UnavailableError("fake shard is down");
    auto& job = shard_->jobs[request.job_id()];
    job.config = request;
    job.members.assign(request.members().begin(), request.members().end());
    job.generation = request.generation();
    return absl::OkStatus();
  }
  absl::Status SetMembers(const v1::SetMembersRequest& request,
                          v1::SetMembersResponse* response) override {
    absl::MutexLock lock(&shard_->mu);
    if (shard_->fail_set_members) return absl::UnavailableError("fake shard is down");
    auto it = shard_->jobs.find(request.job_id());
    if (it == shard_->jobs.end()) return absl::NotFoundError("unknown job");
    for (const std::string& m : it->second.members) {
      if (std::find(request.members().begin(), request.members().end(), m) !=
              request.members().end() ||
          response == nullptr) {
        continue;
      }
      v1::MemberSteps* removed = response->add_removed();
      removed->set_worker_id(m);
      removed->set_steps(shard_->member_steps.count(m) ? shard_->member_steps[m] : 0);
    }
    it->second.members.assign(request.members().begin(), request.members().end());
    it->second.generation = request.generation();
    shard_->set_members_calls++;
    return absl::OkStatus();
  }
  absl::Status DropJob(const std::string& job_id) override {
    absl::MutexLock lock(&shard_->mu);
    if (shard_->fail_drop) return absl::UnavailableError("fake shard is down");
    shard_->jobs.erase(job_id);
    shard_->dropped.push_back(job_id);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> ListJobs(absl::Duration) override {
    absl::MutexLock lock(&shard_->mu);
    if (shard_->fail_drop) return absl::UnavailableError("fake shard is down");
    std::vector<std::string> ids;
    for (const auto& [id, job] : shard_->jobs) ids.push_back(id);
    return ids;
  }
  absl::StatusOr<std::vector<v1::ChunkValues>> ReadChunks(const v1::ReadChunksRequest& request,
                                                          absl::Duration wait) override {
    absl::MutexLock lock(&shard_->mu);
    if (shard_->fail_read) return absl::UnavailableError("fake shard is down");
    shard_->reads.push_back(request);
    auto it = shard_->jobs.find(request.job_id());
    if (it == shard_->jobs.end()) return absl::NotFoundError("unknown job");
    std::vector<v1::ChunkValues> out(it->second.config.chunks().begin(),
                                     it->second.config.chunks().end());
    // The fake's chunks stay at their configured version: a cut at a later
    // one never comes.
    for (const v1::ChunkValues& c : out) {
      if (request.at_version() > 0 && c.version() != request.at_version()) {
        return absl::DeadlineExceededError("the cut's version was not reached");
      }
    }
    if (shard_->add_momentum) {
      for (v1::ChunkValues& c : out) {
        if (c.slots_size() > 0) continue;
        v1::OptimizerSlot* slot = c.add_slots();
        slot->set_name("momentum");
        for (int i = 0; i < c.values_size(); ++i) slot->add_values(0.5f);
      }
    }
    return out;
  }
  absl::StatusOr<bool> HasJob(const std::string& job_id, absl::Duration) override {
    absl::MutexLock lock(&shard_->mu);
    return shard_->jobs.count(job_id) > 0;
  }
  std::string Describe() const override { return "fake shard"; }

 private:
  FakeShard* const shard_;
};

// input [4] -> dense fc (3 units) -> softmax cross-entropy; 15 parameters.
v1::JobSpec TinyJob(int workers) {
  v1::JobSpec job;
  job.set_name("tiny");
  v1::ModelSpec* model = job.mutable_model();
  model->set_name("tiny");
  model->add_input_shape(4);
  model->set_num_classes(3);
  model->set_init_seed(7);
  v1::LayerSpec* fc = model->add_layers();
  fc->set_name("fc");
  fc->mutable_dense()->set_units(3);
  v1::LayerSpec* loss = model->add_layers();
  loss->set_name("loss");
  loss->mutable_softmax_cross_entropy();
  job.mutable_dataset()->set_format(v1::DATASET_FORMAT_SYNTHETIC);
  job.mutable_optimizer()->set_type(v1::OPTIMIZER_SGD);
  job.mutable_optimizer()->set_learning_rate(0.1f);
  job.set_epochs(2);
  job.set_batch_size(8);
  job.set_workers(workers);
  return job;
}

v1::EvalMetrics EvalShard(const std::vector<std::pair<int, int>>& pairs, double loss) {
  v1::EvalMetrics e;
  e.set_num_classes(3);
  std::vector<int64_t> counts(9, 0);
  for (auto [t, p] : pairs) counts[t * 3 + p]++;
  for (int64_t c : counts) e.add_confusion(c);
  e.set_samples(static_cast<int64_t>(pairs.size()));
  e.set_loss(loss);
  return e;
}

v1::ReportProgressRequest Progress(const std::string& worker, const std::string& job, int epoch,
                                   int64_t step, double loss, double accuracy, double sps) {
  v1::ReportProgressRequest r;
  r.set_worker_id(worker);
  r.set_job_id(job);
  r.set_generation(1);
  r.set_epoch(epoch);
  r.set_step(step);
  r.set_loss(loss);
  r.set_train_accuracy(accuracy);
  r.set_samples_per_sec(sps);
  return r;
}

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    state_dir_ = absl::StrCat(::testing::TempDir(), "/coordinator_test_", getpid(), "_",
                              ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(state_dir_);
    now_ = absl::FromUnixSeconds(1700000000);
    MakeController(1);
    Restart();
  }
  void TearDown() override {
    coordinator_.reset();
    fs::remove_all(state_dir_);
  }

  void MakeController(int num_shards) {
    coordinator_.reset();
    fakes_.clear();
    std::vector<std::unique_ptr<ShardClient>> clients;
    for (int i = 0; i < num_shards; ++i) {
      fakes_.push_back(std::make_unique<FakeShard>());
      clients.push_back(std::make_unique<FakeShardClient>(fakes_.back().get()));
    }
    controller_ = std::make_unique<ShardController>(std::move(clients), /*chunk_bytes=*/16);
  }

  // (Re)creates the coordinator over the same state directory and shards.
  void Restart() {
    coordinator_.reset();
    Coordinator::Options options;
    options.state_dir = state_dir_;
    options.heartbeat_timeout = absl::Seconds(2);
    options.heartbeat_interval = absl::Milliseconds(500);
    options.shard_addresses = {"127.0.0.1:1"};
    options.clock = [this] { return now_; };
    options.start_background_thread = false;
    options.log = [this](const std::string& line) { log_.push_back(line); };
    if (tweak_options_) tweak_options_(&options);
    auto c = Coordinator::Create(std::move(options), controller_.get());
    ASSERT_OK(c);
    coordinator_ = *std::move(c);
  }

  std::string Register(const std::string& host = "node") {
    v1::WorkerInfo info;
    info.set_hostname(host);
    info.set_backend("cpu");
    return coordinator_->RegisterWorker(info)->worker_id();
  }

  v1::HeartbeatResponse Beat(const std::string& worker, const std::string& job = "") {
    auto r = coordinator_->Heartbeat(worker, job);
    EXPECT_OK(r);
    return r.ok() ? *r : v1::HeartbeatResponse();
  }

  // Every chunk of `job` on the fake shards is at `version`, as if the
  // shards had applied that many sync steps (checkpoints cut there).
  void Train(const std::string& job, int64_t version) {
    for (auto& fake : fakes_) {
      absl::MutexLock lock(&fake->mu);
      auto it = fake->jobs.find(job);
      if (it == fake->jobs.end()) continue;
      for (auto& c : *it->second.config.mutable_chunks()) c.set_version(version);
    }
  }

  v1::JobStatus Status(const std::string& job) {
    auto s = coordinator_->GetJob(job);
    EXPECT_OK(s);
    return s.ok() ? *s : v1::JobStatus();
  }

  // Submits a job, registers `workers` more workers and starts it; its
  // members (in rank order) go to `worker_ids`.
  std::string StartJob(int workers, std::vector<std::string>* worker_ids) {
    auto id = coordinator_->SubmitJob(TinyJob(workers));
    EXPECT_OK(id);
    for (int i = 0; i < workers; ++i) Register();
    coordinator_->Tick();
    const v1::JobStatus status = Status(*id);
    EXPECT_EQ(status.state(), v1::JOB_STATE_RUNNING);
    worker_ids->assign(status.workers().begin(), status.workers().end());
    return *id;
  }

  std::string state_dir_;
  std::function<void(Coordinator::Options*)> tweak_options_;  // Applied by Restart().
  std::vector<std::string> log_;
  absl::Time now_;
  std::vector<std::unique_ptr<FakeShard>> fakes_;
  std::unique_ptr<ShardController> controller_;
  std::unique_ptr<Coordinator> coordinator_;
};

TEST_F(CoordinatorTest, SubmitRejectsBadSpecsWithTheValidationMessage) {
  v1::JobSpec no_epochs = TinyJob(1);
  no_epochs.set_epochs(0);
  auto r = coordinator_->SubmitJob(no_epochs);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("epochs must be > 0"));

  v1::JobSpec bad_rate = TinyJob(1);
  bad_rate.mutable_optimizer()->set_learning_rate(-1);
  r = coordinator_->SubmitJob(bad_rate);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("learning_rate"));

  r = coordinator_->SubmitJob(TinyJob(65));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("workers must be in [1, 64], got 65"));

  v1::JobSpec bad_model = TinyJob(1);
  bad_model.mutable_model()->mutable_layers(0)->mutable_dense()->set_units(5);
  r = coordinator_->SubmitJob(bad_model);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);

  v1::JobSpec model_file = TinyJob(1);
  model_file.clear_model();
  model_file.set_model_file("models/fmnist-cnn.json");
  r = coordinator_->SubmitJob(model_file);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("inline"));

  // An external model's workers read their own data.
  v1::JobSpec external = TinyJob(1);
  external.clear_model();
  external.mutable_external_model()->set_framework("torch");
  r = coordinator_->SubmitJob(external);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("has no dataset"));

  EXPECT_TRUE(coordinator_->ListJobs().empty());
}

// A job whose model is external (a PyTorch module): submitted with its
// framework only; the workers bound to it declare the tensors and initial
// values; it starts on those workers only, with those values.
v1::JobSpec ExternalJob(int workers) {
  v1::JobSpec job = TinyJob(workers);
  job.clear_model();
  job.clear_dataset();
  job.mutable_external_model()->set_framework("torch");
  return job;
}

v1::ExternalModel TwoTensors(int64_t weight_rows) {
  v1::ExternalModel model;
  model.set_framework("torch 2.5.1");
  v1::ExternalTensor* w = model.add_tensors();
  w->set_name("fc.weight");
  w->add_shape(weight_rows);
  w->add_shape(2);
  w->set_trainable(true);
  v1::ExternalTensor* mean = model.add_tensors();
  mean->set_name("bn.running_mean");
  mean->add_shape(2);
  return model;
}

TEST_F(CoordinatorTest, AnExternalModelStartsOnItsBoundWorkersWithTheDeclaredValues) {
  auto job = coordinator_->SubmitJob(ExternalJob(2));
  ASSERT_OK(job);
  auto modelspec_job = coordinator_->SubmitJob(TinyJob(5));
  ASSERT_OK(modelspec_job);
  const std::string pool = Register("pool");
  v1::WorkerInfo bound_info;
  bound_info.set_hostname("torch");
  bound_info.set_job_id(*job);
  auto a = coordinator_->RegisterWorker(bound_info);
  ASSERT_OK(a);

  // Binding is to an external model's live job.
  v1::WorkerInfo elsewhere = bound_info;
  elsewhere.set_job_id("job-404");
  EXPECT_EQ(coordinator_->RegisterWorker(elsewhere).status().code(), absl::StatusCode::kNotFound);
  elsewhere.set_job_id(*modelspec_job);
  EXPECT_THAT(coordinator_->RegisterWorker(elsewhere).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("pool")));

  // Nothing starts before a declaration.
  coordinator_->Tick();
  EXPECT_EQ(Status(*job).state(), v1::JOB_STATE_QUEUED);
  EXPECT_THAT(Status(*job).reason(), HasSubstr("declare the model; 1 of 2"));

  const std::vector<std::vector<float>> values = {{1, 2, 3, 4, 5, 6}, {0.5f, -0.5f}};
  EXPECT_THAT(coordinator_->DeclareModel(pool, *job, TwoTensors(3), values).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not bound")));
  EXPECT_THAT(
      coordinator_->DeclareModel(a->worker_id(), *job, TwoTensors(3), {{1, 2, 3}, {0, 0}}).status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'fc.weight' has 6 values; 3")));
  EXPECT_THAT(
      coordinator_
          ->DeclareModel(a->worker_id(), *job, TwoTensors(3), {{1, 2, 3, 4, 5, NAN}, {0, 0}})
          .status(),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not finite")));
  auto declared = coordinator_->DeclareModel(a->worker_id(), *job, TwoTensors(3), values);
  ASSERT_OK(declared);
  EXPECT_TRUE(*declared);
  coordinator_->Tick();
  EXPECT_EQ(Status(*job).state(), v1::JOB_STATE_QUEUED);  // One of two bound workers.
  EXPECT_THAT(Status(*job).reason(), HasSubstr("waiting for 2 workers bound to the job, 1"));

  // The second worker declares the same model (kept), or another (refused).
  bound_info.set_hostname("torch-2");
  auto b = coordinator_->RegisterWorker(bound_info);
  ASSERT_OK(b);
  EXPECT_THAT(coordinator_->DeclareModel(b->worker_id(), *job, TwoTensors(4), {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[3, 2]")));
  auto again =
      coordinator_->DeclareModel(b->worker_id(), *job, TwoTensors(3), {{9, 9, 9, 9, 9, 9}, {9, 9}});
  ASSERT_OK(again);
  EXPECT_FALSE(*again);

  coordinator_->Tick();
  const v1::JobStatus running = Status(*job);
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(running.workers(), ElementsAre(a->worker_id(), b->worker_id()));
  EXPECT_EQ(running.spec().external_model().tensors_size(), 2);
  EXPECT_EQ(Beat(pool).action(), v1::HeartbeatResponse::ACTION_IDLE);
  const v1::HeartbeatResponse hb = Beat(a->worker_id());
  ASSERT_EQ(hb.action(), v1::HeartbeatResponse::ACTION_RUN);
  EXPECT_EQ(hb.assignment().spec().external_model().tensors(0).name(), "fc.weight");
  // The shards start from the first declaration's values.
  std::vector<float> configured;
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    for (const v1::ChunkValues& c : fakes_[0]->jobs[*job].config.chunks()) {
      configured.insert(configured.end(), c.values().begin(), c.values().end());
    }
  }
  std::sort(configured.begin(), configured.end());
  EXPECT_THAT(configured, ElementsAre(-0.5f, 0.5f, 1, 2, 3, 4, 5, 6));

  // Once the job ended, its bound workers are told to stop; the pool's idle.
  ASSERT_OK(coordinator_->CancelJob(*job));
  EXPECT_EQ(Beat(a->worker_id()).action(), v1::HeartbeatResponse::ACTION_STOP);
  EXPECT_EQ(Beat(pool).action(), v1::HeartbeatResponse::ACTION_IDLE);
  EXPECT_THAT(coordinator_->RegisterWorker(bound_info).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("has ended")));
}

// A launcher's ModelSpec job (JobSpec.bound_workers, a Spark barrier
// stage): only the workers bound to it train it, the pool never does, and
// a launcher's cancel names its cause.
TEST_F(CoordinatorTest, ALaunchersModelSpecJobRunsOnlyOnItsBoundWorkers) {
  v1::JobSpec spec = TinyJob(2);
  spec.set_bound_workers(true);
  auto job = coordinator_->SubmitJob(spec);
  ASSERT_OK(job);
  const std::string pool_a = Register("pool-a");
  const std::string pool_b = Register("pool-b");
  coordinator_->Tick();
  EXPECT_EQ(Status(*job).state(), v1::JOB_STATE_QUEUED);
  EXPECT_THAT(Status(*job).reason(), HasSubstr("waiting for 2 workers bound to the job, 0"));

  v1::WorkerInfo bound_info;
  bound_info.set_hostname("spark-task-0");
  bound_info.set_job_id(*job);
  auto a = coordinator_->RegisterWorker(bound_info);
  ASSERT_OK(a);
  bound_info.set_hostname("spark-task-1");
  auto b = coordinator_->RegisterWorker(bound_info);
  ASSERT_OK(b);
  coordinator_->Tick();
  const v1::JobStatus running = Status(*job);
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(running.workers(), ElementsAre(a->worker_id(), b->worker_id()));
  EXPECT_EQ(Beat(pool_a).action(), v1::HeartbeatResponse::ACTION_IDLE);
  const v1::HeartbeatResponse hb = Beat(a->worker_id());
  ASSERT_EQ(hb.action(), v1::HeartbeatResponse::ACTION_RUN);
  EXPECT_TRUE(hb.assignment().spec().has_model());

  // A ModelSpec job without bound_workers still refuses bound workers; a
  // command job cannot take them.
  auto pool_job = coordinator_->SubmitJob(TinyJob(5));
  ASSERT_OK(pool_job);
  bound_info.set_job_id(*pool_job);
  EXPECT_THAT(coordinator_->RegisterWorker(bound_info).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("bound_workers")));
  v1::JobSpec both = TinyJob(1);
  both.clear_model();
  both.clear_dataset();
  both.mutable_command()->add_argv("train.py");
  both.set_bound_workers(true);
  EXPECT_THAT(coordinator_->SubmitJob(both).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bound_workers")));

  // The launcher cancels with its cause; the bound workers are told to stop.
  EXPECT_THAT(coordinator_->CancelJob(*job, std::string(1025, 'x')).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1024")));
  auto cancelled = coordinator_->CancelJob(*job, "the Spark stage failed: executor lost");
  ASSERT_OK(cancelled);
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(cancelled->reason(), "cancelled: the Spark stage failed: executor lost");
  EXPECT_EQ(Beat(a->worker_id(), *job).action(), v1::HeartbeatResponse::ACTION_STOP);
  EXPECT_EQ(Beat(b->worker_id()).action(), v1::HeartbeatResponse::ACTION_STOP);
  EXPECT_EQ(Beat(pool_b).action(), v1::HeartbeatResponse::ACTION_IDLE);
}

v1::JobSpec CommandJob(int workers) {
  v1::JobSpec job = TinyJob(workers);
  job.clear_model();
  job.clear_dataset();
  job.mutable_command()->add_argv("train.py");
  return job;
}

// A daemon's heartbeat telling how its command for `job` ended.
v1::HeartbeatRequest CommandEnded(const std::string& daemon, const std::string& job,
                                  int exit_code, int signal, const std::string& tail = "") {
  v1::HeartbeatRequest request;
  request.set_worker_id(daemon);
  request.mutable_command_end()->set_job_id(job);
  request.mutable_command_end()->set_exit_code(exit_code);
  request.mutable_command_end()->set_signal(signal);
  request.mutable_command_end()->set_output_tail(tail);
  return request;
}

v1::WorkerInfo DaemonInfo(const std::string& host) {
  v1::WorkerInfo info;
  info.set_hostname(host);
  info.set_runs_commands(true);
  return info;
}

TEST_F(CoordinatorTest, ACommandJobRunsOnDaemonsThatRunCommandsAndTheirEndsDecide) {
  const v1::WorkerInfo daemon_info = DaemonInfo("gpu-node");
  const std::string plain = Register("plain");  // Runs no commands.
  const std::string d1 = coordinator_->RegisterWorker(daemon_info)->worker_id();
  const std::string d2 = coordinator_->RegisterWorker(daemon_info)->worker_id();
  v1::JobSpec with_model = CommandJob(2);
  *with_model.mutable_model() = TinyJob(1).model();
  with_model.clear_external_model();
  EXPECT_THAT(coordinator_->SubmitJob(with_model).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("remove `model`")));
  v1::JobSpec bad_env = CommandJob(1);
  (*bad_env.mutable_command()->mutable_env())["PSTRAIN_JOB"] = "job-9";
  EXPECT_THAT(coordinator_->SubmitJob(bad_env).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("set by the daemon")));

  auto job = coordinator_->SubmitJob(CommandJob(2));
  ASSERT_OK(job);
  EXPECT_TRUE(Status(*job).spec().has_external_model());  // Implied.
  coordinator_->Tick();
  // Both daemons are told to run it, the other worker is not; they are busy.
  EXPECT_EQ(Beat(plain).action(), v1::HeartbeatResponse::ACTION_IDLE);
  v1::HeartbeatResponse launch = Beat(d1);
  ASSERT_EQ(launch.action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  EXPECT_EQ(launch.assignment().job_id(), *job);
  EXPECT_EQ(launch.assignment().spec().command().argv(0), "train.py");
  ASSERT_EQ(Beat(d2).action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  EXPECT_EQ(coordinator_->Stats().workers_registered, 3);

  // The daemons' processes register bound to the job, naming their daemon.
  v1::HeartbeatRequest running;
  running.set_worker_id(d1);
  running.set_command_job_id(*job);
  EXPECT_EQ(coordinator_->Heartbeat(running)->action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  std::vector<std::string> procs;
  for (const std::string& d : {d1, d2}) {
    v1::WorkerInfo p;
    p.set_hostname("gpu-node");
    p.set_job_id(*job);
    p.set_launched_by(d);
    procs.push_back(coordinator_->RegisterWorker(p)->worker_id());
    ASSERT_OK(coordinator_->DeclareModel(procs.back(), *job, TwoTensors(3),
                                         {{1, 2, 3, 4, 5, 6}, {0, 0}}));
  }
  coordinator_->Tick();
  ASSERT_EQ(Status(*job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Status(*job).workers(), ElementsAre(procs[0], procs[1]));

  // Another daemon cannot speak for d1's command.
  ASSERT_OK(coordinator_->Heartbeat(CommandEnded(plain, *job, 1, 0)));
  EXPECT_EQ(Status(*job).state(), v1::JOB_STATE_RUNNING);

  // kill -9 of d1's process: a lost worker, the job goes on with d2's.
  EXPECT_EQ(coordinator_->Heartbeat(CommandEnded(d1, *job, 0, 9))->action(),
            v1::HeartbeatResponse::ACTION_IDLE);
  EXPECT_EQ(Status(*job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Status(*job).workers(), ElementsAre(procs[1]));
  EXPECT_EQ(Status(*job).workers_lost(), 1);
  EXPECT_TRUE(std::any_of(log_.begin(), log_.end(), [](const std::string& l) {
    return absl::StrContains(l, "was killed by signal 9");
  }));

  // Status 1 from the other one's process fails the job with its output.
  ASSERT_OK(coordinator_->Heartbeat(
      CommandEnded(d2, *job, 1, 0, "Traceback ...\nValueError: bad batch\n")));
  const v1::JobStatus ended = Status(*job);
  EXPECT_EQ(ended.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(ended.reason(), HasSubstr("exited with status 1"));
  EXPECT_THAT(ended.reason(), HasSubstr("ValueError: bad batch"));

  // A refusal fails its job with the daemon's words; a daemon that still
  // runs the command of a job that ended is told to stop.
  auto refused = coordinator_->SubmitJob(CommandJob(1));
  ASSERT_OK(refused);
  coordinator_->Tick();
  ASSERT_EQ(Beat(d1).action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  v1::HeartbeatRequest no;
  no.set_worker_id(d1);
  no.mutable_command_end()->set_job_id(*refused);
  no.mutable_command_end()->set_refused("'train.py' is not an executable file under this worker's --command-root (/opt/jobs)");
  ASSERT_OK(coordinator_->Heartbeat(no));
  EXPECT_THAT(Status(*refused).reason(), HasSubstr("refused to run the command: 'train.py'"));
  v1::HeartbeatRequest stale;
  stale.set_worker_id(d2);
  stale.set_command_job_id(*job);
  EXPECT_EQ(coordinator_->Heartbeat(stale)->action(), v1::HeartbeatResponse::ACTION_STOP);
}

TEST_F(CoordinatorTest, ACommandThatExitsBeforeItsJobStartsFailsItAndAKilledOneIsLaunchedAgain) {
  const v1::WorkerInfo daemon_info = DaemonInfo("node");
  const std::string d1 = coordinator_->RegisterWorker(daemon_info)->worker_id();
  auto job = coordinator_->SubmitJob(CommandJob(1));
  ASSERT_OK(job);
  coordinator_->Tick();
  ASSERT_EQ(Beat(d1).action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  EXPECT_THAT(Status(*job).reason(), Not(HasSubstr("its command runs on")));
  // Killed before it joined: launched again on the next pass.
  ASSERT_OK(coordinator_->Heartbeat(CommandEnded(d1, *job, 0, 9)));
  EXPECT_EQ(Status(*job).state(), v1::JOB_STATE_QUEUED);
  EXPECT_THAT(Status(*job).reason(), HasSubstr("its command runs on 0 of 1"));
  coordinator_->Tick();
  ASSERT_EQ(Beat(d1).action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  // Status 2 before it joined: the job fails with its output.
  ASSERT_OK(coordinator_->Heartbeat(
      CommandEnded(d1, *job, 2, 0, "python3: can't open file 'train.py'")));
  EXPECT_EQ(Status(*job).state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(Status(*job).reason(), HasSubstr("exited with status 2; its last output:\npython3"));
  EXPECT_EQ(Beat(d1).action(), v1::HeartbeatResponse::ACTION_IDLE);
}

TEST_F(CoordinatorTest, AfterARestartADaemonsRunningCommandIsCountedNotLaunchedTwice) {
  const v1::WorkerInfo daemon_info = DaemonInfo("node");
  const std::string d1 = coordinator_->RegisterWorker(daemon_info)->worker_id();
  auto job = coordinator_->SubmitJob(CommandJob(1));
  ASSERT_OK(job);
  coordinator_->Tick();
  ASSERT_EQ(Beat(d1).action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  Restart();
  // Another daemon registers first: nothing is launched on it within one
  // heartbeat timeout, while the job's own daemon (busy with it) comes back
  // and says so; then it counts.
  const std::string d2 = coordinator_->RegisterWorker(daemon_info)->worker_id();
  coordinator_->Tick();
  EXPECT_EQ(Beat(d2).action(), v1::HeartbeatResponse::ACTION_IDLE);
  auto again = coordinator_->RegisterWorker(daemon_info, d1);
  ASSERT_OK(again);
  ASSERT_EQ(again->worker_id(), d1);
  v1::HeartbeatRequest running;
  running.set_worker_id(d1);
  running.set_command_job_id(*job);
  EXPECT_EQ(coordinator_->Heartbeat(running)->action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  now_ += absl::Seconds(3);
  ASSERT_EQ(coordinator_->Heartbeat(running)->action(), v1::HeartbeatResponse::ACTION_LAUNCH);
  coordinator_->Tick();
  EXPECT_EQ(Beat(d2).action(), v1::HeartbeatResponse::ACTION_IDLE);
}

TEST_F(CoordinatorTest, JobWaitsInTheQueueUntilEnoughWorkersRegister) {
  v1::JobSpec zero = TinyJob(0);
  auto one = coordinator_->SubmitJob(zero);
  ASSERT_OK(one);
  EXPECT_EQ(Status(*one).spec().workers(), 1);  // 0 means 1.
  ASSERT_OK(coordinator_->CancelJob(*one));

  auto id = coordinator_->SubmitJob(TinyJob(2));
  ASSERT_OK(id);
  EXPECT_EQ(*id, "job-2");
  EXPECT_EQ(Status(*id).state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(Status(*id).reason(), "waiting for 2 idle workers, 0 available");

  const std::string w1 = Register();
  EXPECT_EQ(w1, "worker-1");
  coordinator_->Tick();
  EXPECT_EQ(Status(*id).state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(Status(*id).reason(), "waiting for 2 idle workers, 1 available");
  EXPECT_EQ(Beat(w1).action(), v1::HeartbeatResponse::ACTION_IDLE);

  const std::string w2 = Register();
  coordinator_->Tick();
  const v1::JobStatus running = Status(*id);
  EXPECT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(running.workers(), ElementsAre(w1, w2));
  EXPECT_GT(running.started_unix_ms(), 0);

  // Ranks 0..n-1, world size n, generation 1.
  std::vector<int> ranks;
  for (const std::string& w : {w1, w2}) {
    const v1::HeartbeatResponse hb = Beat(w);
    ASSERT_EQ(hb.action(), v1::HeartbeatResponse::ACTION_RUN);
    EXPECT_EQ(hb.assignment().job_id(), *id);
    EXPECT_EQ(hb.assignment().world_size(), 2);
    EXPECT_EQ(hb.assignment().generation(), 1);
    EXPECT_EQ(hb.assignment().spec().name(), "tiny");
    ranks.push_back(hb.assignment().rank());
  }
  EXPECT_THAT(ranks, ElementsAre(0, 1));

  // The shard holds the model's initial values, cut by the plan.
  absl::MutexLock lock(&fakes_[0]->mu);
  const auto& config = fakes_[0]->jobs.at(*id).config;
  EXPECT_THAT(config.members(), ElementsAre(w1, w2));
  EXPECT_EQ(config.generation(), 1);
  auto graph = BuildModelGraph(TinyJob(2).model());
  ASSERT_OK(graph);
  auto plan = PlanChunks(*graph, 1, 16);
  ASSERT_OK(plan);
  const auto initial = InitialParameterValues(*graph);
  ASSERT_EQ(config.chunks_size(), static_cast<int>(plan->chunks.size()));
  for (const v1::ChunkValues& c : config.chunks()) {
    const ChunkInfo& info = plan->chunks[c.chunk_id()];
    ASSERT_EQ(c.values_size(), info.count);
    for (int i = 0; i < c.values_size(); ++i) {
      EXPECT_EQ(c.values(i), initial[info.param][info.offset + i]);
    }
  }
}

TEST_F(CoordinatorTest, MissedHeartbeatsDropTheWorkerBumpTheGenerationAndReassign) {
  std::vector<std::string> w;
  const std::string job = StartJob(3, &w);
  for (const std::string& id : w) Beat(id);

  now_ += absl::Milliseconds(1500);
  Beat(w[0], job);
  Beat(w[2], job);
  now_ += absl::Milliseconds(1000);  // w[1] silent for 2.5 s > 2 s.
  coordinator_->Tick();

  const v1::JobStatus s = Status(job);
  EXPECT_EQ(s.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(s.workers_lost(), 1);
  EXPECT_THAT(s.workers(), ElementsAre(w[0], w[2]));
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    EXPECT_EQ(fakes_[0]->set_members_calls, 1);
    EXPECT_THAT(fakes_[0]->jobs.at(job).members, ElementsAre(w[0], w[2]));
    EXPECT_EQ(fakes_[0]->jobs.at(job).generation, 2);
  }
  const v1::HeartbeatResponse a = Beat(w[0], job);
  const v1::HeartbeatResponse b = Beat(w[2], job);
  ASSERT_EQ(a.action(), v1::HeartbeatResponse::ACTION_RUN);
  ASSERT_EQ(b.action(), v1::HeartbeatResponse::ACTION_RUN);
  EXPECT_EQ(a.assignment().rank(), 0);
  EXPECT_EQ(b.assignment().rank(), 1);
  EXPECT_EQ(a.assignment().world_size(), 2);
  EXPECT_EQ(a.assignment().generation(), 2);

  auto workers = coordinator_->ListWorkers();
  ASSERT_EQ(workers.size(), 3u);
  EXPECT_FALSE(workers[1].alive());
  EXPECT_TRUE(workers[0].alive());

  // The dropped worker comes back: it must stop the old job and is idle.
  EXPECT_EQ(Beat(w[1], job).action(), v1::HeartbeatResponse::ACTION_STOP);
  EXPECT_EQ(Beat(w[1]).action(), v1::HeartbeatResponse::ACTION_IDLE);
  EXPECT_TRUE(coordinator_->ListWorkers()[1].alive());
  auto stop = coordinator_->ReportProgress(Progress(w[1], job, 0, 3, 1, 0, 0));
  ASSERT_OK(stop);
  EXPECT_TRUE(*stop);
}

// Issue 9 part 6: every sample once per epoch. Members ask for their work
// in each epoch; a lost member's untrained samples (from the steps the
// shards hold of it) go to the survivors, and the status counts every
// epoch's samples.
TEST_F(CoordinatorTest, ALostMembersSamplesGoToTheSurvivorsAndEveryEpochCountsItsSize) {
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  const std::string run = Beat(w[0]).assignment().run_id();
  Beat(w[1]);
  auto ask = [&](const std::string& worker, int epoch, bool share_done, int tails_done,
                 int64_t trained) {
    v1::EpochPlanRequest r;
    r.set_worker_id(worker);
    r.set_job_id(job);
    r.set_run_id(run);
    r.set_epoch(epoch);
    r.set_epoch_length(800);
    r.set_batch_size(8);
    r.set_share_done(share_done);
    r.set_tails_done(tails_done);
    if (trained >= 0) {
      v1::EpochSamples* t = r.add_trained();
      t->set_epoch(epoch);
      t->set_samples(trained);
    }
    return coordinator_->EpochPlan(r);
  };
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p0, ask(w[0], 0, false, 0, -1));
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse p1, ask(w[1], 0, false, 0, -1));
  EXPECT_EQ(p0.rank(), 0);
  EXPECT_EQ(p1.rank(), 1);
  EXPECT_EQ(p0.world_size(), 2);
  EXPECT_EQ(p0.base_steps(), 50);

  // w[1] goes silent after 20 steps (the shards hold 20 of its steps).
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    fakes_[0]->member_steps[w[1]] = 20;
  }
  now_ += absl::Milliseconds(1500);
  Beat(w[0], job);
  now_ += absl::Milliseconds(1000);
  coordinator_->Tick();
  ASSERT_EQ(Status(job).workers_lost(), 1);

  // w[0] ends its share and gets w[1]'s 240 untrained samples as a tail.
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse tail, ask(w[0], 0, true, 0, 400));
  ASSERT_EQ(tail.tails_size(), 1);
  EXPECT_EQ(tail.tails(0).epoch(), 0);
  EXPECT_EQ(tail.tails(0).begin(), 400 + 20 * 8);
  EXPECT_EQ(tail.tails(0).end(), 800);
  EXPECT_EQ(tail.tails(0).steps(), 30);
  // Once trained, the epoch ends for w[0] and the count is the epoch's size.
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse done, ask(w[0], 0, true, 1, 400 + 240));
  EXPECT_EQ(done.tails_size(), 1);
  const v1::JobStatus s = Status(job);
  ASSERT_EQ(s.epoch_samples_size(), 1);
  EXPECT_EQ(s.epoch_samples(0).epoch(), 0);
  EXPECT_EQ(s.epoch_samples(0).samples(), 800);
  EXPECT_EQ(s.epoch_samples(0).expected(), 800);
  // The next epoch is planned for the one member left.
  ASSERT_OK_AND_ASSIGN(v1::EpochPlanResponse next, ask(w[0], 1, false, 0, -1));
  EXPECT_EQ(next.world_size(), 1);
  EXPECT_EQ(next.base_steps(), 100);
}

TEST_F(CoordinatorTest, EpochPlanRefusesAsksOutsideTheRun) {
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  const std::string outsider = Register();
  v1::EpochPlanRequest r;
  r.set_worker_id(w[0]);
  r.set_job_id(job);
  r.set_run_id(Beat(w[0]).assignment().run_id());
  r.set_epoch_length(800);
  r.set_batch_size(8);
  ASSERT_OK(coordinator_->EpochPlan(r).status());
  auto refused = [&](auto change, absl::StatusCode code) {
    v1::EpochPlanRequest bad = r;
    change(bad);
    EXPECT_THAT(coordinator_->EpochPlan(bad), StatusIs(code, ::testing::_)) << bad.DebugString();
  };
  using Req = v1::EpochPlanRequest;
  refused([](Req& b) { b.set_run_id("job-1.9.0"); }, absl::StatusCode::kAborted);
  refused([](Req& b) { b.set_batch_size(9); }, absl::StatusCode::kInvalidArgument);
  refused([](Req& b) { b.set_epoch(7); }, absl::StatusCode::kInvalidArgument);
  refused([](Req& b) { b.set_epoch_length(801); }, absl::StatusCode::kInvalidArgument);
  refused([](Req& b) { b.set_worker_id("worker-99"); }, absl::StatusCode::kNotFound);
  refused([](Req& b) { b.set_job_id("job-99"); }, absl::StatusCode::kNotFound);
  refused([&](Req& b) { b.set_worker_id(outsider); }, absl::StatusCode::kFailedPrecondition);
  refused(
      [](Req& b) {
        for (int i = 0; i < 3; ++i) b.add_trained()->set_epoch(i);
      },
      absl::StatusCode::kInvalidArgument);
}

// Issue 9 (elastic scale-up): a worker that was dropped and comes back (or
// a new one) idled until the job ended. At the next epoch boundary the job
// re-forms with every worker it wants, from the epoch's checkpoint.
TEST_F(CoordinatorTest, ADroppedWorkerThatComesBackRejoinsAtTheNextEpochBoundary) {
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  const std::string first_run = Beat(w[0]).assignment().run_id();
  Beat(w[1]);
  now_ += absl::Milliseconds(2500);  // w[1] silent: dropped.
  Beat(w[0], job);
  coordinator_->Tick();
  ASSERT_THAT(Status(job).workers(), ElementsAre(w[0]));
  // w[1] comes back (SIGCONT): told to stop, then idle.
  EXPECT_EQ(Beat(w[1], job).action(), v1::HeartbeatResponse::ACTION_STOP);
  EXPECT_EQ(Beat(w[1]).action(), v1::HeartbeatResponse::ACTION_IDLE);
  // Mid-epoch nothing changes.
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 0, 3, 0.5, 0.5, 10)).status());
  coordinator_->Tick();
  EXPECT_EQ(Status(job).runs(), 1);
  EXPECT_EQ(Beat(w[1]).action(), v1::HeartbeatResponse::ACTION_IDLE);
  // The epoch ends: its checkpoint, then the job re-forms with both.
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 1, 6, 0.5, 0.5, 10)).status());
  Train(job, 6);
  coordinator_->Tick();
  coordinator_->Tick();
  const v1::JobStatus s = Status(job);
  EXPECT_EQ(s.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(s.runs(), 2);
  EXPECT_EQ(s.workers_size(), 2);
  EXPECT_EQ(s.steps_lost(), 0);
  const v1::HeartbeatResponse a = Beat(w[0], job);
  const v1::HeartbeatResponse b = Beat(w[1]);
  ASSERT_EQ(a.action(), v1::HeartbeatResponse::ACTION_RUN);
  ASSERT_EQ(b.action(), v1::HeartbeatResponse::ACTION_RUN);
  EXPECT_NE(a.assignment().run_id(), first_run);
  EXPECT_EQ(a.assignment().run_id(), b.assignment().run_id());
  EXPECT_EQ(b.assignment().world_size(), 2);
  EXPECT_EQ(b.assignment().start_epoch(), 1);
  EXPECT_EQ(b.assignment().start_step(), 6);
  bool logged = false;
  for (const std::string& line : log_) {
    logged |= line.find("re-forming with 2 workers at the end of epoch 1") != std::string::npos;
  }
  EXPECT_TRUE(logged);
}

// Without a worker to spare (or with an older job waiting for one), a job
// that lost a member goes on with the rest.
TEST_F(CoordinatorTest, AJobDoesNotReformWithoutIdleWorkersOrBeforeAnOlderQueuedJob) {
  ASSERT_OK_AND_ASSIGN(const std::string older, coordinator_->SubmitJob(TinyJob(3)));
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);  // The older job waits for a third worker.
  Beat(w[0]);
  Beat(w[1]);
  now_ += absl::Milliseconds(2500);
  Beat(w[0], job);
  coordinator_->Tick();  // w[1] dropped; it stays away.
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 1, 6, 0.5, 0.5, 10)).status());
  Train(job, 6);
  coordinator_->Tick();
  coordinator_->Tick();
  EXPECT_EQ(Status(job).runs(), 1);
  EXPECT_THAT(Status(job).workers(), ElementsAre(w[0]));
  // w[1] comes back, but the older job is first in line for idle workers.
  EXPECT_EQ(Beat(w[1]).action(), v1::HeartbeatResponse::ACTION_IDLE);
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 2, 12, 0.5, 0.5, 10)).status());
  Train(job, 12);
  coordinator_->Tick();
  coordinator_->Tick();
  EXPECT_EQ(Status(job).runs(), 1);
  EXPECT_EQ(Status(older).state(), v1::JOB_STATE_QUEUED);
}

TEST_F(CoordinatorTest, AJobThatLosesEveryWorkerIsQueuedAgain) {
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  now_ += absl::Seconds(3);
  coordinator_->Tick();
  const v1::JobStatus s = Status(job);
  EXPECT_EQ(s.state(), v1::JOB_STATE_QUEUED);
  EXPECT_EQ(s.workers_lost(), 1);
  EXPECT_TRUE(s.workers().empty());

  // A fresh worker picks it up with a new generation.
  const std::string fresh = Register();
  coordinator_->Tick();
  EXPECT_EQ(Status(job).state(), v1::JOB_STATE_RUNNING);
  const v1::HeartbeatResponse hb = Beat(fresh);
  ASSERT_EQ(hb.action(), v1::HeartbeatResponse::ACTION_RUN);
  EXPECT_GT(hb.assignment().generation(), 2);  // Pushes of the first run are stale.
}

TEST_F(CoordinatorTest, ProgressIsAggregatedOverMembers) {
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 1, 10, 0.5, 0.8, 100)));
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[1], job, 0, 8, 0.7, 0.6, 50)));
  const v1::JobStatus s = Status(job);
  EXPECT_EQ(s.epoch(), 0);  // The slowest member's.
  EXPECT_EQ(s.step(), 8);
  EXPECT_DOUBLE_EQ(s.loss(), 0.6);
  EXPECT_DOUBLE_EQ(s.train_accuracy(), 0.7);
  EXPECT_DOUBLE_EQ(s.samples_per_sec(), 150);
  EXPECT_EQ(s.total_steps(), 0);  // Unknown until the slowest member ends an epoch.

  ASSERT_OK(coordinator_->ReportProgress(Progress(w[1], job, 1, 10, 0.3, 0.9, 60)));
  EXPECT_EQ(Status(job).epoch(), 1);
  EXPECT_EQ(Status(job).total_steps(), 20);  // 10 steps per epoch x 2 epochs.
  // A finished report's training figures are not used; its epoch is all of them.
  v1::ReportProgressRequest finished = Progress(w[1], job, -7, 20, 0, 0, 0);
  finished.set_finished(true);
  *finished.mutable_eval_shard() = EvalShard({{0, 0}}, 0.1);
  ASSERT_OK(coordinator_->ReportProgress(finished));
  EXPECT_EQ(Status(job).epoch(), 1);  // w[0] is still at 1.
  EXPECT_DOUBLE_EQ(Status(job).loss(), 0.4);
  EXPECT_DOUBLE_EQ(Status(job).samples_per_sec(), 100);

  // Bad reports.
  auto unknown = coordinator_->ReportProgress(Progress("worker-99", job, 0, 0, 0, 0, 0));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  unknown = coordinator_->ReportProgress(Progress(w[0], "job-99", 0, 0, 0, 0, 0));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(coordinator_->ReportProgress(Progress(w[0], job, 3, 30, 0, 0, 0)).status().code(),
            absl::StatusCode::kInvalidArgument);  // Epoch beyond the job's 2.
  EXPECT_EQ(coordinator_->ReportProgress(Progress(w[0], job, -1, 0, 0, 0, 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::ReportProgressRequest bad = Progress(w[0], job, 2, 20, 0.1, 1, 0);
  bad.set_finished(true);
  *bad.mutable_eval_shard() = EvalShard({{0, 0}, {1, 1}}, 0.1);
  bad.mutable_eval_shard()->set_samples(5);  // The matrix counts 2.
  EXPECT_EQ(coordinator_->ReportProgress(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.mutable_eval_shard()->set_samples(2);
  bad.mutable_eval_shard()->set_num_classes(4);  // The model has 3.
  EXPECT_EQ(coordinator_->ReportProgress(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

// Regression: total_steps was estimated as step / epochs_done, which counts
// the partial current epoch and overshot (4780 for a 4680-step job).
TEST_F(CoordinatorTest, TotalStepsComeFromTheReportedStepsPerEpoch) {
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);  // 2 epochs.
  v1::ReportProgressRequest a = Progress(w[0], job, 1, 14, 0.5, 0.8, 100);
  a.set_steps_per_epoch(10);
  v1::ReportProgressRequest b = Progress(w[1], job, 1, 13, 0.5, 0.8, 100);
  b.set_steps_per_epoch(10);
  ASSERT_OK(coordinator_->ReportProgress(a));
  ASSERT_OK(coordinator_->ReportProgress(b));
  EXPECT_EQ(Status(job).step(), 13);
  EXPECT_EQ(Status(job).total_steps(), 20);  // Not 13 / 1 x 2 = 26.
}

// Regression (chaos run): a shard killed as the last epoch ended made the
// final checkpoint's read fail, and the job FAILED with its training done.
// It is queued again to resume from its latest checkpoint instead.
TEST_F(CoordinatorTest, AShardDownAtTheFinalCheckpointResumesTheRunInsteadOfFailing) {
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    fakes_[0]->fail_read = true;
  }
  for (const std::string& worker : w) {
    v1::ReportProgressRequest done = Progress(worker, job, 2, 10, 0.3, 0.9, 10);
    done.set_finished(true);
    *done.mutable_eval_shard() = EvalShard({{0, 0}, {1, 1}}, 0.4);
    ASSERT_OK(coordinator_->ReportProgress(done));
  }
  coordinator_->Tick();
  v1::JobStatus s = Status(job);
  EXPECT_EQ(s.state(), v1::JOB_STATE_QUEUED) << s.reason();
  EXPECT_THAT(log_, ::testing::Contains(::testing::HasSubstr(
                        "could not read the final model (fake shard is down); queued again")));
  // The shard is back: the job runs again on its workers as a new run.
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    fakes_[0]->fail_read = false;
  }
  coordinator_->Tick();
  EXPECT_EQ(Status(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Status(job).runs(), 2);
}

TEST_F(CoordinatorTest, EvalShardsAreMergedAndTheFinalCheckpointIsWritten) {
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    fakes_[0]->add_momentum = true;
  }
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  EXPECT_EQ(coordinator_->CheckpointPath(job).status().code(),
            absl::StatusCode::kFailedPrecondition);

  // Epoch 1 of both members: a checkpoint of epoch 1, cut at version 5.
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 1, 5, 0.5, 0.8, 10)));
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[1], job, 1, 5, 0.5, 0.8, 10)));
  Train(job, 5);
  coordinator_->Tick();
  auto path = coordinator_->CheckpointPath(job);
  ASSERT_OK(path);
  auto epoch1 = ReadCheckpointFile(*path);
  ASSERT_OK(epoch1);
  EXPECT_EQ(epoch1->epoch(), 1);
  EXPECT_EQ(epoch1->step(), 5);

  const v1::EvalMetrics a = EvalShard({{0, 0}, {0, 1}, {1, 1}, {2, 2}, {2, 0}}, 0.4);
  const v1::EvalMetrics b = EvalShard({{0, 0}, {1, 2}, {1, 1}}, 0.8);
  v1::ReportProgressRequest done = Progress(w[0], job, 2, 10, 0.3, 0.9, 10);
  done.set_finished(true);
  *done.mutable_eval_shard() = a;
  ASSERT_OK(coordinator_->ReportProgress(done));
  coordinator_->Tick();
  EXPECT_EQ(Status(job).state(), v1::JOB_STATE_RUNNING);  // Waits for w[1].
  // w[0] finished: it is idle and may be given other work.
  EXPECT_EQ(Beat(w[0], job).action(), v1::HeartbeatResponse::ACTION_IDLE);

  done = Progress(w[1], job, 2, 10, 0.3, 0.9, 10);
  done.set_finished(true);
  *done.mutable_eval_shard() = b;
  ASSERT_OK(coordinator_->ReportProgress(done));
  coordinator_->Tick();

  const v1::JobStatus s = Status(job);
  ASSERT_EQ(s.state(), v1::JOB_STATE_SUCCEEDED) << s.reason();
  EXPECT_THAT(s.reason(), HasSubstr("test accuracy"));
  EXPECT_GT(s.finished_unix_ms(), 0);
  EXPECT_THAT(log_, ::testing::Contains("job-1: checkpoint written (epoch 2, step 10, final)"));
  // The last progress reports' training figures (not the final reports').
  EXPECT_DOUBLE_EQ(s.loss(), 0.5);
  EXPECT_DOUBLE_EQ(s.train_accuracy(), 0.8);
  ConfusionMatrix ca(3), cb(3);
  for (auto [t, p] : std::vector<std::pair<int, int>>{{0, 0}, {0, 1}, {1, 1}, {2, 2}, {2, 0}}) {
    ca.Add(t, p);
  }
  for (auto [t, p] : std::vector<std::pair<int, int>>{{0, 0}, {1, 2}, {1, 1}}) cb.Add(t, p);
  ca.Merge(cb);
  const ClassificationMetrics expected = ca.Compute();
  EXPECT_EQ(std::vector<int64_t>(s.test().confusion().begin(), s.test().confusion().end()),
            expected.confusion);
  EXPECT_DOUBLE_EQ(s.test().accuracy(), expected.accuracy);
  EXPECT_DOUBLE_EQ(s.test().accuracy(), 5.0 / 8.0);
  EXPECT_DOUBLE_EQ(s.test().precision(), expected.macro_precision);
  EXPECT_DOUBLE_EQ(s.test().recall(), expected.macro_recall);
  EXPECT_DOUBLE_EQ(s.test().f1(), expected.macro_f1);
  EXPECT_DOUBLE_EQ(s.test().loss(), (0.4 * 5 + 0.8 * 3) / 8);
  EXPECT_EQ(s.test().samples(), 8);

  // The final checkpoint: parameters named as in the graph, with the
  // shard's values, and the optimizer state named "<param>/<slot>".
  auto ckpt = ReadCheckpointFile(*coordinator_->CheckpointPath(job));
  ASSERT_OK(ckpt);
  EXPECT_EQ(ckpt->epoch(), 2);
  EXPECT_EQ(ckpt->job().name(), "tiny");
  std::vector<std::string> names, state_names;
  for (const auto& t : ckpt->parameters()) names.push_back(t.name());
  for (const auto& t : ckpt->optimizer_state()) state_names.push_back(t.name());
  EXPECT_THAT(names, ElementsAre("fc/weight", "fc/bias"));
  EXPECT_THAT(state_names, ElementsAre("fc/weight/momentum", "fc/bias/momentum"));
  auto graph = BuildModelGraph(TinyJob(2).model());
  ASSERT_OK(graph);
  const auto initial = InitialParameterValues(*graph);
  EXPECT_EQ(*TensorProtoToFloats(ckpt->parameters(0)), initial[0]);
  EXPECT_EQ(ckpt->parameters(0).shape_size(), 2);
  EXPECT_EQ(*TensorProtoToFloats(ckpt->optimizer_state(1)), std::vector<float>(3, 0.5f));

  // The shards forget the job; the workers are idle.
  absl::MutexLock lock(&fakes_[0]->mu);
  EXPECT_THAT(fakes_[0]->dropped, ElementsAre(job));
  EXPECT_TRUE(fakes_[0]->jobs.empty());
}

// Regression (issue 8): a confusion count of 2^40 made the merge loop one
// sample at a time under the coordinator's lock, so every call timed out.
// Shards cannot claim more samples than the test set holds (together), and
// the merge adds counts.
TEST_F(CoordinatorTest, EvalShardOf2To40SamplesIsRejectedAndMergingAddsCounts) {
  v1::JobSpec spec = TinyJob(2);
  spec.mutable_dataset()->mutable_synthetic()->set_test_samples(10);
  ASSERT_OK_AND_ASSIGN(const std::string job, coordinator_->SubmitJob(spec));
  Register();
  Register();
  coordinator_->Tick();
  const v1::JobStatus running = Status(job);
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  const std::string w0 = running.workers(0), w1 = running.workers(1);

  v1::ReportProgressRequest huge = Progress(w0, job, 2, 10, 0.3, 0.9, 10);
  huge.set_finished(true);
  *huge.mutable_eval_shard() = EvalShard({{0, 0}}, 0.1);
  huge.mutable_eval_shard()->set_confusion(0, int64_t{1} << 40);
  huge.mutable_eval_shard()->set_samples(int64_t{1} << 40);
  EXPECT_THAT(coordinator_->ReportProgress(huge),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("exceeds the 10 test samples left for this shard (the test set "
                                 "holds 10)")));

  // 7 samples from w0 leave 3 for w1.
  v1::ReportProgressRequest done = Progress(w0, job, 2, 10, 0.3, 0.9, 10);
  done.set_finished(true);
  *done.mutable_eval_shard() =
      EvalShard({{0, 0}, {0, 0}, {1, 1}, {1, 1}, {2, 2}, {2, 2}, {2, 0}}, 0.5);
  EXPECT_OK(coordinator_->ReportProgress(done));
  done = Progress(w1, job, 2, 10, 0.3, 0.9, 10);
  done.set_finished(true);
  *done.mutable_eval_shard() = EvalShard({{0, 0}, {1, 1}, {2, 2}, {2, 2}}, 0.5);
  EXPECT_THAT(coordinator_->ReportProgress(done),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("4 samples exceed the 3 test samples left")));
  *done.mutable_eval_shard() = EvalShard({{0, 0}, {1, 1}, {2, 2}}, 0.5);
  EXPECT_OK(coordinator_->ReportProgress(done));
  coordinator_->Tick();
  const v1::JobStatus s = Status(job);
  ASSERT_EQ(s.state(), v1::JOB_STATE_SUCCEEDED) << s.reason();
  EXPECT_EQ(s.test().samples(), 10);
  EXPECT_THAT(s.test().confusion(), ElementsAre(3, 0, 0, 0, 3, 0, 1, 0, 3));
}

TEST_F(CoordinatorTest, EvalShardsWithoutAStatedTestSetAreBoundedByMaxEvalSamples) {
  tweak_options_ = [](Coordinator::Options* o) { o->max_eval_samples = 4; };
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  v1::ReportProgressRequest done = Progress(w[0], job, 2, 10, 0.3, 0.9, 10);
  done.set_finished(true);
  *done.mutable_eval_shard() = EvalShard({{0, 0}, {1, 1}, {2, 2}, {2, 2}, {1, 1}}, 0.5);
  EXPECT_THAT(coordinator_->ReportProgress(done),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--max-eval-samples is 4")));
}

// Regression (issue 8): a job with 1e9 conv filters passed SubmitJob; the
// server then died with bad_alloc as soon as a worker was idle and, the job
// being saved as QUEUED, again after every restart.
TEST_F(CoordinatorTest, AJobBeyondTheLimitsIsRefusedAndASavedOneFailsInsteadOfCrashLooping) {
  v1::JobSpec huge = TinyJob(1);
  v1::ModelSpec* model = huge.mutable_model();
  model->clear_input_shape();
  for (int d : {1, 28, 28}) model->add_input_shape(d);
  *model->mutable_layers(0) = v1::LayerSpec();
  model->mutable_layers(0)->set_name("conv");
  model->mutable_layers(0)->mutable_conv2d()->set_filters(1000000000);
  model->mutable_layers(0)->mutable_conv2d()->set_kernel_size(28);
  v1::LayerSpec loss = model->layers(1);
  model->mutable_layers()->RemoveLast();
  model->add_layers()->set_name("flat");
  model->mutable_layers(1)->mutable_flatten();
  model->add_layers()->set_name("fc");
  model->mutable_layers(2)->mutable_dense()->set_units(3);
  *model->add_layers() = loss;
  EXPECT_THAT(coordinator_->SubmitJob(huge),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--max-job-parameters")));
  EXPECT_TRUE(coordinator_->ListJobs().empty());

  // A status saved by a server without the limit: loaded as FAILED.
  v1::JobStatus saved;
  saved.set_job_id("job-7");
  saved.set_state(v1::JOB_STATE_QUEUED);
  *saved.mutable_spec() = huge;
  fs::create_directories(state_dir_ + "/jobs/job-7");
  std::ofstream(state_dir_ + "/jobs/job-7/status.pb", std::ios::binary)
      << saved.SerializeAsString();
  Restart();
  const v1::JobStatus loaded = Status("job-7");
  EXPECT_EQ(loaded.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(loaded.reason(), HasSubstr("saved job is invalid"));
  EXPECT_THAT(loaded.reason(), HasSubstr("--max-job-parameters"));
  Register();
  coordinator_->Tick();  // An idle worker starts nothing.
  absl::MutexLock lock(&fakes_[0]->mu);
  EXPECT_TRUE(fakes_[0]->jobs.empty());
}

// Regression (issue 8): the job and worker registries only grew; a 65 MiB
// job name stayed in memory and on disk for good.
TEST_F(CoordinatorTest, NamesIdsQueuedJobsAndWorkersAreBounded) {
  tweak_options_ = [](Coordinator::Options* o) {
    o->max_queued_jobs = 2;
    o->max_workers = 2;
    o->forget_dead_workers_after = absl::Seconds(60);
  };
  Restart();
  v1::JobSpec named = TinyJob(5);
  named.set_name(std::string(65 << 20, 'n'));
  EXPECT_THAT(coordinator_->SubmitJob(named),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(--max-name-bytes)")));
  EXPECT_OK(coordinator_->SubmitJob(TinyJob(5)));
  EXPECT_OK(coordinator_->SubmitJob(TinyJob(5)));
  EXPECT_THAT(coordinator_->SubmitJob(TinyJob(5)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-queued-jobs")));
  EXPECT_EQ(coordinator_->ListJobs().size(), 2u);

  const std::string long_id(129, 'x');
  EXPECT_THAT(coordinator_->GetJob(long_id),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(--max-id-bytes)")));
  EXPECT_THAT(coordinator_->Heartbeat(long_id, ""),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("(--max-id-bytes)")));
  v1::WorkerInfo fat;
  fat.set_hostname(std::string(5000, 'h'));
  EXPECT_THAT(coordinator_->RegisterWorker(fat),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("worker info has")));

  const std::string a = Register();
  Register();
  EXPECT_THAT(coordinator_->RegisterWorker(v1::WorkerInfo()),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-workers")));
  // Both go silent: dead after the heartbeat timeout, forgotten a minute later.
  now_ += absl::Seconds(3);
  coordinator_->Tick();
  EXPECT_EQ(coordinator_->ListWorkers().size(), 2u);
  now_ += absl::Seconds(61);
  coordinator_->Tick();
  EXPECT_TRUE(coordinator_->ListWorkers().empty());
  EXPECT_EQ(Beat(a).action(), v1::HeartbeatResponse::ACTION_REREGISTER);
  EXPECT_OK(coordinator_->RegisterWorker(v1::WorkerInfo()));
}

TEST_F(CoordinatorTest, CancelStopsWorkersKeepsTheModelAndIsIdempotent) {
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  auto cancelled = coordinator_->CancelJob(job);
  ASSERT_OK(cancelled);
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(cancelled->reason(), "cancelled by user");
  EXPECT_EQ(Beat(w[0], job).action(), v1::HeartbeatResponse::ACTION_STOP);
  EXPECT_EQ(Beat(w[0]).action(), v1::HeartbeatResponse::ACTION_IDLE);
  auto stop = coordinator_->ReportProgress(Progress(w[1], job, 0, 1, 1, 0, 0));
  ASSERT_OK(stop);
  EXPECT_TRUE(*stop);

  coordinator_->Tick();
  EXPECT_OK(coordinator_->CheckpointPath(job));  // The last model is kept.
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    EXPECT_THAT(fakes_[0]->dropped, ElementsAre(job));
  }
  auto again = coordinator_->CancelJob(job);
  ASSERT_OK(again);
  EXPECT_EQ(again->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(coordinator_->CancelJob("job-42").status().code(), absl::StatusCode::kNotFound);

  // The freed workers take the next job.
  auto next = coordinator_->SubmitJob(TinyJob(2));
  ASSERT_OK(next);
  coordinator_->Tick();
  EXPECT_EQ(Status(*next).state(), v1::JOB_STATE_RUNNING);
}

TEST_F(CoordinatorTest, AWorkerErrorFailsTheJobWithItsReason) {
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  v1::ReportProgressRequest error = Progress(w[1], job, 0, 3, 0, 0, 0);
  error.set_error("dataset.path /nope: no such file");
  auto stop = coordinator_->ReportProgress(error);
  ASSERT_OK(stop);
  EXPECT_TRUE(*stop);
  const v1::JobStatus s = Status(job);
  EXPECT_EQ(s.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(s.reason(), HasSubstr(w[1]));
  EXPECT_THAT(s.reason(), HasSubstr("dataset.path /nope: no such file"));
  EXPECT_EQ(Beat(w[0], job).action(), v1::HeartbeatResponse::ACTION_STOP);
}

TEST_F(CoordinatorTest, ShardConfigurationFailureFailsTheJob) {
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    fakes_[0]->fail_configure = true;
  }
  auto id = coordinator_->SubmitJob(TinyJob(1));
  ASSERT_OK(id);
  const std::string w = Register();
  coordinator_->Tick();
  const v1::JobStatus s = Status(*id);
  EXPECT_EQ(s.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(s.reason(), HasSubstr("fake shard is down"));
  EXPECT_EQ(Beat(w).action(), v1::HeartbeatResponse::ACTION_IDLE);
}

TEST_F(CoordinatorTest, StatusesSurviveARestartAndRunningJobsResumeFromTheirCheckpoint) {
  std::vector<std::string> w;
  const std::string done = StartJob(1, &w);
  v1::ReportProgressRequest finish = Progress(w[0], done, 2, 4, 0.2, 1, 0);
  finish.set_finished(true);
  *finish.mutable_eval_shard() = EvalShard({{0, 0}, {1, 1}, {2, 1}}, 0.5);
  ASSERT_OK(coordinator_->ReportProgress(finish));
  coordinator_->Tick();
  ASSERT_EQ(Status(done).state(), v1::JOB_STATE_SUCCEEDED);

  // A second job trains one epoch (the shard's values change) and is
  // checkpointed.
  std::vector<std::string> w2;
  const std::string running = StartJob(1, &w2);
  std::vector<float> trained;
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    for (auto& c : *fakes_[0]->jobs.at(running).config.mutable_chunks()) {
      for (float& v : *c.mutable_values()) {
        v += 1.0f;
        trained.push_back(v);
      }
    }
  }
  ASSERT_OK(coordinator_->ReportProgress(Progress(w2[0], running, 1, 2, 0.2, 1, 0)));
  Train(running, 2);
  coordinator_->Tick();
  ASSERT_OK(coordinator_->CheckpointPath(running));

  Restart();
  const v1::JobStatus first = Status(done);
  EXPECT_EQ(first.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_DOUBLE_EQ(first.test().accuracy(), 2.0 / 3.0);
  EXPECT_OK(coordinator_->CheckpointPath(done));
  const v1::JobStatus second = Status(running);
  EXPECT_EQ(second.state(), v1::JOB_STATE_QUEUED);
  EXPECT_THAT(second.reason(), HasSubstr("resumes from the checkpoint of epoch 1"));
  EXPECT_EQ(coordinator_->ListJobs().size(), 2u);
  auto third = coordinator_->SubmitJob(TinyJob(5));
  ASSERT_OK(third);
  EXPECT_EQ(*third, "job-3");  // Ids continue after the saved ones.

  // Old worker ids are unknown to the new coordinator.
  EXPECT_EQ(Beat(w2[0], running).action(), v1::HeartbeatResponse::ACTION_REREGISTER);
  const std::string fresh = Register();
  coordinator_->Tick();
  EXPECT_EQ(Status(running).state(), v1::JOB_STATE_RUNNING);
  const v1::HeartbeatResponse hb = Beat(fresh);
  ASSERT_EQ(hb.action(), v1::HeartbeatResponse::ACTION_RUN);
  EXPECT_EQ(hb.assignment().job_id(), running);
  EXPECT_EQ(hb.assignment().start_epoch(), 1);
  std::vector<float> configured;
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    for (const auto& c : fakes_[0]->jobs.at(running).config.chunks()) {
      configured.insert(configured.end(), c.values().begin(), c.values().end());
    }
  }
  EXPECT_EQ(configured, trained);
  {
    // The optimizer's iteration count goes on from the checkpoint's step.
    absl::MutexLock lock(&fakes_[0]->mu);
    for (const auto& c : fakes_[0]->jobs.at(running).config.chunks()) EXPECT_EQ(c.version(), 2);
  }
}

// Issue 12 (the report): the coordinator keeps each job's loss, accuracy and
// throughput over its steps, bounded: past max_history_points every other
// point goes and the step gap doubles, so a long job keeps its whole run.
TEST_F(CoordinatorTest, TheHistoryFollowsTheStepsAndThinsPastItsBound) {
  tweak_options_ = [](Coordinator::Options* o) { o->max_history_points = 4; };
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  ASSERT_OK_AND_ASSIGN(v1::JobHistory empty, coordinator_->GetJobHistory(job));
  EXPECT_EQ(empty.job_id(), job);
  EXPECT_EQ(empty.points_size(), 0);
  // Only w[0] reports at first: the job's step is still the slowest
  // member's (0), and the figures are w[0]'s alone.
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 0, 3, 2.0, 0.1, 10)));
  for (int64_t step = 1; step <= 6; ++step) {
    now_ += absl::Seconds(1);
    ASSERT_OK(
        coordinator_->ReportProgress(Progress(w[0], job, 0, step, 2.0 / step, 0.1 * step, 10)));
    ASSERT_OK(
        coordinator_->ReportProgress(Progress(w[1], job, 0, step, 2.0 / step, 0.1 * step, 20)));
  }
  ASSERT_OK_AND_ASSIGN(v1::JobHistory h, coordinator_->GetJobHistory(job));
  // Steps 0 (w[0] alone), 0 again is not a new point, then 1..6: 7 points
  // through a bound of 4 -> thinned at the 5th (0,2,4 kept; gap 2), 6 next.
  std::vector<int64_t> steps;
  for (const v1::HistoryPoint& p : h.points()) steps.push_back(p.step());
  EXPECT_THAT(steps, ElementsAre(0, 2, 4, 6));
  EXPECT_EQ(h.min_step_gap(), 2);
  const v1::HistoryPoint& last = h.points(3);
  EXPECT_EQ(last.epoch(), 0);
  EXPECT_DOUBLE_EQ(last.loss(), 2.0 / 6);
  EXPECT_DOUBLE_EQ(last.train_accuracy(), 0.6);
  EXPECT_DOUBLE_EQ(last.samples_per_sec(), 30);  // The sum over the workers.
  EXPECT_EQ(last.unix_ms(), absl::ToUnixMillis(now_));
  EXPECT_EQ(last.run(), 1);
  // Step 7 is within the gap of 6; 8 is a point and thins again.
  for (int64_t step : {7, 8}) {
    for (const std::string& worker : w) {
      ASSERT_OK(coordinator_->ReportProgress(Progress(worker, job, 0, step, 0.2, 0.9, 10)));
    }
  }
  ASSERT_OK_AND_ASSIGN(h, coordinator_->GetJobHistory(job));
  steps.clear();
  for (const v1::HistoryPoint& p : h.points()) steps.push_back(p.step());
  EXPECT_THAT(steps, ElementsAre(0, 4, 8));
  EXPECT_EQ(h.min_step_gap(), 4);

  EXPECT_EQ(coordinator_->GetJobHistory("job-99").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(coordinator_->GetJobHistory(std::string(4096, 'j')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CoordinatorTest, TheHistorySurvivesARestartAndAResumeDropsWhatItsCheckpointLost) {
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  for (int64_t step : {1, 2}) {
    ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 0, step, 1.0, 0.5, 10)));
  }
  // Epoch 1 ends at step 2: the checkpoint is cut there.
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 1, 2, 0.9, 0.6, 10)));
  Train(job, 2);
  coordinator_->Tick();
  ASSERT_OK(coordinator_->CheckpointPath(job));
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 1, 3, 0.8, 0.7, 10)));
  coordinator_->Tick();  // Persists.

  Restart();
  ASSERT_OK_AND_ASSIGN(v1::JobHistory saved, coordinator_->GetJobHistory(job));
  ASSERT_EQ(saved.points_size(), 3);
  EXPECT_EQ(saved.points(2).step(), 3);
  EXPECT_DOUBLE_EQ(saved.points(2).loss(), 0.8);
  // The resumed run starts at the checkpoint's step 2: step 3 was lost.
  const std::string fresh = Register();
  coordinator_->Tick();
  ASSERT_EQ(Status(job).state(), v1::JOB_STATE_RUNNING);
  ASSERT_OK_AND_ASSIGN(v1::JobHistory resumed, coordinator_->GetJobHistory(job));
  ASSERT_EQ(resumed.points_size(), 2);
  EXPECT_EQ(resumed.points(1).step(), 2);
  ASSERT_OK(coordinator_->ReportProgress(Progress(fresh, job, 1, 3, 0.7, 0.8, 10)));
  ASSERT_OK_AND_ASSIGN(resumed, coordinator_->GetJobHistory(job));
  ASSERT_EQ(resumed.points_size(), 3);
  EXPECT_EQ(resumed.points(2).run(), 2);
  EXPECT_DOUBLE_EQ(resumed.points(2).loss(), 0.7);
  coordinator_->Tick();

  // A history file that cannot be read costs the curves, not the job.
  coordinator_.reset();
  {
    std::ofstream corrupt(fs::path(state_dir_) / "jobs" / job / "history.pb",
                          std::ios::binary | std::ios::trunc);
    corrupt << "\xff\xff\xff not a history";
  }
  log_.clear();
  Restart();
  EXPECT_EQ(Status(job).state(), v1::JOB_STATE_QUEUED);
  ASSERT_OK_AND_ASSIGN(v1::JobHistory lost, coordinator_->GetJobHistory(job));
  EXPECT_EQ(lost.job_id(), job);
  EXPECT_EQ(lost.points_size(), 0);
  EXPECT_THAT(absl::StrJoin(log_, "\n"), HasSubstr(job + ": its history is lost: corrupt job "
                                                         "history"));
}

// Chaos run of ssp: a resumed async or ssp job went on at version = the
// checkpoint's step, but every push is a version there (about members x
// steps), so the learning-rate schedule rewound by half and disturbed runs
// ended 0.7 points above the undisturbed one. Each chunk now goes on from the
// version it was saved at.
TEST_F(CoordinatorTest, AResumedAsyncJobGoesOnFromEachChunksSavedVersion) {
  v1::JobSpec spec = TinyJob(1);
  spec.set_mode(v1::CONSISTENCY_ASYNC);
  auto id = coordinator_->SubmitJob(spec);
  ASSERT_OK(id);
  Register();
  coordinator_->Tick();
  const v1::JobStatus status = Status(*id);
  ASSERT_EQ(status.state(), v1::JOB_STATE_RUNNING);
  const std::string worker = status.workers(0);
  std::map<int, int64_t> saved;  // Chunk id -> version, all above the step.
  for (auto& fake : fakes_) {
    absl::MutexLock lock(&fake->mu);
    auto it = fake->jobs.find(*id);
    if (it == fake->jobs.end()) continue;
    for (auto& c : *it->second.config.mutable_chunks()) {
      c.set_version(40 + c.chunk_id());
      saved[c.chunk_id()] = c.version();
    }
  }
  ASSERT_FALSE(saved.empty());
  ASSERT_OK(coordinator_->ReportProgress(Progress(worker, *id, 1, 20, 0.2, 1, 0)));
  coordinator_->Tick();
  ASSERT_OK(coordinator_->CheckpointPath(*id));

  Restart();
  Register();
  coordinator_->Tick();
  ASSERT_EQ(Status(*id).state(), v1::JOB_STATE_RUNNING);
  for (auto& fake : fakes_) {
    absl::MutexLock lock(&fake->mu);
    auto it = fake->jobs.find(*id);
    if (it == fake->jobs.end()) continue;
    for (const auto& c : it->second.config.chunks()) {
      EXPECT_EQ(c.version(), saved.at(c.chunk_id())) << "chunk " << c.chunk_id();
    }
  }
}

// Issue 9 (run identity): a restarted server handed the id worker-1 to
// another process, and the original worker-1's heartbeats were then
// accepted under that id. Ids are never issued twice, across restarts too;
// a worker that registers again gets its own id back.
TEST_F(CoordinatorTest, WorkerIdsAreNeverReissuedAndComeBackToTheirHolder) {
  const std::string first = Register();
  const std::string second = Register();
  EXPECT_EQ(first, "worker-1");
  EXPECT_EQ(second, "worker-2");
  Restart();
  // A new process gets a new id, not worker-1 again.
  EXPECT_EQ(Register(), "worker-3");
  // The holder of worker-2 asks for it back and gets it; asking again while
  // it is held, or for an id this server never issued, gets a new one.
  ASSERT_OK_AND_ASSIGN(v1::RegisterWorkerResponse back,
                       coordinator_->RegisterWorker(v1::WorkerInfo(), second));
  EXPECT_EQ(back.worker_id(), "worker-2");
  ASSERT_OK_AND_ASSIGN(v1::RegisterWorkerResponse taken,
                       coordinator_->RegisterWorker(v1::WorkerInfo(), second));
  EXPECT_EQ(taken.worker_id(), "worker-4");
  ASSERT_OK_AND_ASSIGN(v1::RegisterWorkerResponse unknown,
                       coordinator_->RegisterWorker(v1::WorkerInfo(), "worker-99"));
  EXPECT_EQ(unknown.worker_id(), "worker-5");
  ASSERT_OK_AND_ASSIGN(v1::RegisterWorkerResponse odd,
                       coordinator_->RegisterWorker(v1::WorkerInfo(), "worker-01"));
  EXPECT_EQ(odd.worker_id(), "worker-6");
  EXPECT_EQ(Beat(second).action(), v1::HeartbeatResponse::ACTION_IDLE);
}

TEST_F(CoordinatorTest, ACorruptWorkerIdCounterIsDataLoss) {
  Register();
  coordinator_.reset();
  std::ofstream(state_dir_ + "/next_worker_id") << "not a number";
  Coordinator::Options options;
  options.state_dir = state_dir_;
  options.start_background_thread = false;
  EXPECT_THAT(Coordinator::Create(options, controller_.get()).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("next_worker_id")));
}

// Issue 9 (run identity): every start of a job is a new run with its own
// id, also after a restart; a report of a replaced run changes nothing.
TEST_F(CoordinatorTest, EveryRunHasItsOwnIdAndReportsOfAReplacedRunAreIgnored) {
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  v1::HeartbeatResponse hb = Beat(w[0]);
  ASSERT_EQ(hb.action(), v1::HeartbeatResponse::ACTION_RUN);
  const std::string first_run = hb.assignment().run_id();
  EXPECT_THAT(first_run, HasSubstr(job));
  EXPECT_EQ(Status(job).runs(), 1);
  v1::ReportProgressRequest epoch1 = Progress(w[0], job, 1, 2, 0.2, 1, 0);
  epoch1.set_run_id(first_run);
  ASSERT_OK(coordinator_->ReportProgress(epoch1).status());
  Train(job, 2);
  coordinator_->Tick();
  ASSERT_OK(coordinator_->CheckpointPath(job).status());
  v1::ReportProgressRequest later = Progress(w[0], job, 1, 5, 0.2, 1, 0);
  later.set_run_id(first_run);
  ASSERT_OK(coordinator_->ReportProgress(later).status());
  coordinator_->Tick();

  Restart();
  EXPECT_EQ(Beat(w[0], job).action(), v1::HeartbeatResponse::ACTION_REREGISTER);
  ASSERT_OK_AND_ASSIGN(v1::RegisterWorkerResponse again,
                       coordinator_->RegisterWorker(v1::WorkerInfo(), w[0]));
  ASSERT_EQ(again.worker_id(), w[0]);
  coordinator_->Tick();
  hb = Beat(w[0], job);
  ASSERT_EQ(hb.action(), v1::HeartbeatResponse::ACTION_RUN);
  const std::string second_run = hb.assignment().run_id();
  EXPECT_NE(second_run, first_run);
  EXPECT_EQ(hb.assignment().start_epoch(), 1);
  EXPECT_EQ(hb.assignment().start_step(), 2);  // The checkpoint's step.
  v1::JobStatus status = Status(job);
  EXPECT_EQ(status.runs(), 2);
  EXPECT_EQ(status.steps_lost(), 3);  // Steps 3..5 are trained again.
  EXPECT_EQ(status.step(), 2);
  EXPECT_THAT(status.reason(), HasSubstr("resumed from the checkpoint of epoch 1, step 2"));

  // The old run's error (its pushes failed while the server was down)
  // arrives late: it neither fails the job nor counts as progress.
  v1::ReportProgressRequest stale = Progress(w[0], job, 1, 9, 0.2, 1, 0);
  stale.set_run_id(first_run);
  stale.set_error("push to shard: unknown job");
  ASSERT_OK_AND_ASSIGN(bool stop, coordinator_->ReportProgress(stale));
  EXPECT_TRUE(stop);
  EXPECT_EQ(Status(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Status(job).step(), 2);
}

// Issue 9: checkpoints were written per epoch only, so a crash could lose a
// whole epoch. A running job is checkpointed every checkpoint_interval too;
// in sync mode as a cut at the shards' current version, whose number is the
// checkpoint's step (and, with the steps per epoch, its epoch).
TEST_F(CoordinatorTest, ARunningSyncJobIsCheckpointedEveryIntervalAtACut) {
  tweak_options_ = [](Coordinator::Options* o) { o->checkpoint_interval = absl::Seconds(60); };
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  v1::ReportProgressRequest report = Progress(w[0], job, 0, 7, 0.5, 0.5, 10);
  report.set_steps_per_epoch(4);
  ASSERT_OK(coordinator_->ReportProgress(report).status());
  Train(job, 7);
  coordinator_->Tick();
  EXPECT_THAT(coordinator_->CheckpointPath(job).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no checkpoint")));
  now_ += absl::Seconds(61);
  Beat(w[0], job);
  coordinator_->Tick();
  ASSERT_OK_AND_ASSIGN(std::string path, coordinator_->CheckpointPath(job));
  ASSERT_OK_AND_ASSIGN(v1::Checkpoint ckpt, ReadCheckpointFile(path));
  EXPECT_EQ(ckpt.step(), 7);
  EXPECT_EQ(ckpt.epoch(), 1);  // 7 steps of 4 per epoch: epoch 1 is under way.
  for (int64_t v : ckpt.chunk_versions()) EXPECT_EQ(v, 7);
  EXPECT_GT(ckpt.chunk_versions_size(), 0);
  {
    absl::MutexLock lock(&fakes_[0]->mu);
    bool cut = false;
    for (const v1::ReadChunksRequest& r : fakes_[0]->reads) cut |= r.at_version() == 7;
    EXPECT_TRUE(cut) << "no read at version 7";
  }
  // Not again before the next interval.
  const size_t files =
      fs::exists(state_dir_ + "/jobs/" + job + "/checkpoints")
          ? std::distance(fs::directory_iterator(state_dir_ + "/jobs/" + job + "/checkpoints"),
                          fs::directory_iterator())
          : 0;
  now_ += absl::Seconds(30);
  Beat(w[0], job);
  coordinator_->Tick();
  EXPECT_EQ(std::distance(fs::directory_iterator(state_dir_ + "/jobs/" + job + "/checkpoints"),
                          fs::directory_iterator()),
            static_cast<std::ptrdiff_t>(files));
}

// A cut that the shards do not reach in time (a stalled step) is not
// written half-way: the checkpoint is tried again on a later tick.
TEST_F(CoordinatorTest, ACutNotReachedInTimeIsRetriedLater) {
  tweak_options_ = [](Coordinator::Options* o) { o->checkpoint_interval = absl::Seconds(60); };
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  Train(job, 3);
  {
    // One chunk lags behind: the cut at version 3 does not come.
    absl::MutexLock lock(&fakes_[0]->mu);
    fakes_[0]->jobs.at(job).config.mutable_chunks(0)->set_version(2);
  }
  now_ += absl::Seconds(61);
  Beat(w[0], job);
  coordinator_->Tick();
  EXPECT_THAT(coordinator_->CheckpointPath(job).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no checkpoint")));
  Train(job, 3);
  coordinator_->Tick();
  EXPECT_OK(coordinator_->CheckpointPath(job).status());
}

TEST_F(CoordinatorTest, AsyncCheckpointsReadTheChunksAsTheyAre) {
  tweak_options_ = [](Coordinator::Options* o) { o->checkpoint_interval = absl::Seconds(60); };
  Restart();
  v1::JobSpec spec = TinyJob(1);
  spec.set_mode(v1::CONSISTENCY_ASYNC);
  ASSERT_OK_AND_ASSIGN(std::string job, coordinator_->SubmitJob(spec));
  const std::string worker = Register();
  coordinator_->Tick();
  ASSERT_OK(coordinator_->ReportProgress(Progress(worker, job, 0, 9, 0.5, 0.5, 10)).status());
  Train(job, 11);
  now_ += absl::Seconds(61);
  Beat(worker, job);
  coordinator_->Tick();
  ASSERT_OK_AND_ASSIGN(std::string path, coordinator_->CheckpointPath(job));
  ASSERT_OK_AND_ASSIGN(v1::Checkpoint ckpt, ReadCheckpointFile(path));
  EXPECT_EQ(ckpt.step(), 9);  // The slowest member's position.
  for (int64_t v : ckpt.chunk_versions()) EXPECT_EQ(v, 11);
  absl::MutexLock lock(&fakes_[0]->mu);
  for (const v1::ReadChunksRequest& r : fakes_[0]->reads) EXPECT_EQ(r.at_version(), 0);
}

// Issue 9: nothing watched shards 1..S-1, so a restarted shard lost its
// jobs and they failed. A shard that no longer holds a running job sends it
// back to the queue; it resumes from its checkpoint on every shard, as a
// new run, on the same workers.
TEST_F(CoordinatorTest, AJobAShardLostResumesFromItsCheckpointAsANewRun) {
  MakeController(2);
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  const std::string first_run = Beat(w[0]).assignment().run_id();
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 1, 4, 0.5, 0.5, 10)).status());
  Train(job, 4);
  coordinator_->Tick();  // The checkpoint of epoch 1.
  ASSERT_OK(coordinator_->CheckpointPath(job).status());
  {
    absl::MutexLock lock(&fakes_[1]->mu);
    fakes_[1]->jobs.erase(job);  // Shard 1 restarted empty.
  }
  now_ += absl::Seconds(2);
  Beat(w[0], job);
  coordinator_->Tick();
  EXPECT_EQ(Status(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Status(job).runs(), 2);
  const v1::HeartbeatResponse hb = Beat(w[0], job);
  ASSERT_EQ(hb.action(), v1::HeartbeatResponse::ACTION_RUN);
  EXPECT_NE(hb.assignment().run_id(), first_run);
  EXPECT_EQ(hb.assignment().start_epoch(), 1);
  {
    absl::MutexLock lock(&fakes_[1]->mu);
    EXPECT_EQ(fakes_[1]->jobs.count(job), 1u);  // Configured again.
  }
  bool logged = false;
  for (const std::string& line : log_)
    logged |= line.find("no longer holds the job") != std::string::npos;
  EXPECT_TRUE(logged);
}

// Seen in bench/chaos.sh: a shard lost before the job's first checkpoint
// started the job again from the beginning with steps_lost 0.
TEST_F(CoordinatorTest, ARestartBeforeTheFirstCheckpointCountsEveryStepAsLost) {
  MakeController(2);
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  ASSERT_OK(coordinator_->ReportProgress(Progress(w[0], job, 0, 7, 0.5, 0.5, 10)).status());
  {
    absl::MutexLock lock(&fakes_[1]->mu);
    fakes_[1]->jobs.erase(job);  // Shard 1 restarted empty.
  }
  now_ += absl::Seconds(2);
  Beat(w[0], job);
  coordinator_->Tick();
  const v1::JobStatus status = Status(job);
  EXPECT_EQ(status.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(status.runs(), 2);
  EXPECT_EQ(status.steps_lost(), 7);
  EXPECT_EQ(status.step(), 0);
  EXPECT_THAT(status.reason(), HasSubstr("started again from the beginning: no checkpoint yet"));
}

// Issue 11 (lean control traffic): every heartbeat answer resent the whole
// spec, model included. It goes only to a worker that does not run the
// current run yet.
TEST_F(CoordinatorTest, HeartbeatsCarryTheSpecOnlyUntilTheWorkerRunsTheRun) {
  const char* source = std::getenv("PSTRAIN_SOURCE_DIR");
  ASSERT_NE(source, nullptr);
  absl::StatusOr<v1::JobSpec> spec =
      LoadJobSpec(absl::StrCat(source, "/examples/fashion-mnist.json"));
  ASSERT_OK(spec.status());
  spec->set_workers(1);
  ASSERT_OK_AND_ASSIGN(std::string job, coordinator_->SubmitJob(*spec));
  const std::string w = Register();
  coordinator_->Tick();
  ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse first, coordinator_->Heartbeat(w, "", "", -1));
  ASSERT_EQ(first.action(), v1::HeartbeatResponse::ACTION_RUN);
  ASSERT_TRUE(first.assignment().has_spec());
  EXPECT_EQ(first.assignment().spec().model().layers_size(), spec->model().layers_size());
  const std::string run = first.assignment().run_id();
  ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse later, coordinator_->Heartbeat(w, job, run, 3));
  ASSERT_EQ(later.action(), v1::HeartbeatResponse::ACTION_RUN);
  EXPECT_FALSE(later.assignment().has_spec());
  EXPECT_EQ(later.assignment().run_id(), run);
  // A worker on an older run (of this job or another) gets it again.
  ASSERT_OK_AND_ASSIGN(v1::HeartbeatResponse other, coordinator_->Heartbeat(w, job, "old-run", 3));
  EXPECT_TRUE(other.assignment().has_spec());
  std::cout << "heartbeat answer for examples/fashion-mnist.json: " << first.ByteSizeLong()
            << " bytes with the spec, " << later.ByteSizeLong() << " bytes without\n";
}

// Issue 9 (shard failures): a job that ended while a shard could not drop
// it (or before server 0 restarted) stayed on that shard for good; so did
// a job the shard held that server 0 never knew.
TEST_F(CoordinatorTest, JobsThatEndedOrAreUnknownAreDroppedFromTheShardsAfterARestart) {
  MakeController(2);
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(1, &w);
  {
    absl::MutexLock lock(&fakes_[1]->mu);
    fakes_[1]->fail_drop = true;  // Shard 1 is unreachable when the job ends.
    fakes_[1]->jobs["job-77"];    // And holds a job nobody knows.
  }
  ASSERT_OK(coordinator_->CancelJob(job).status());
  coordinator_->Tick();
  {
    absl::MutexLock lock(&fakes_[1]->mu);
    EXPECT_EQ(fakes_[1]->jobs.count(job), 1u);
    fakes_[1]->fail_drop = false;  // Back, after server 0 went down.
  }
  Restart();
  coordinator_->Tick();
  {
    absl::MutexLock lock(&fakes_[1]->mu);
    EXPECT_TRUE(fakes_[1]->jobs.empty());
  }
  int logged = 0;
  for (const std::string& line : log_) {
    logged += line.find(": dropped from ") != std::string::npos;
  }
  EXPECT_EQ(logged, 2);
}

// Issue 9: a straggler (alive but slow, or stopped) held a sync job without
// a word. One behind the others' steps is listed after
// straggler_report_after and, in sync mode, dropped after
// straggler_timeout; a silent one is listed after three heartbeat
// intervals (and dropped at the heartbeat timeout, as before).
TEST_F(CoordinatorTest, StragglersAreListedThenDroppedInSyncMode) {
  tweak_options_ = [](Coordinator::Options* o) {
    o->heartbeat_timeout = absl::Seconds(100);
    o->straggler_report_after = absl::Seconds(5);
    o->straggler_timeout = absl::Seconds(60);
  };
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(3, &w);
  const std::string run = Beat(w[0]).assignment().run_id();
  auto beat = [&](int i, int64_t steps) {
    ASSERT_OK(coordinator_->Heartbeat(w[i], job, run, steps).status());
  };
  beat(0, 10);
  beat(1, 10);
  beat(2, 9);
  now_ += absl::Seconds(6);
  beat(0, 10);
  beat(1, 10);
  beat(2, 9);
  coordinator_->Tick();
  EXPECT_THAT(Status(job).stragglers(), ElementsAre(w[2]));
  EXPECT_EQ(Status(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Status(job).workers_size(), 3);

  // w[1] goes silent too: listed after three intervals (1.5 s here).
  now_ += absl::Seconds(2);
  beat(0, 10);
  beat(2, 9);
  coordinator_->Tick();
  EXPECT_THAT(Status(job).stragglers(), ElementsAre(w[1], w[2]));
  beat(1, 10);

  now_ += absl::Seconds(55);
  beat(0, 10);
  beat(1, 10);
  beat(2, 9);
  coordinator_->Tick();
  const v1::JobStatus status = Status(job);
  EXPECT_EQ(status.state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(status.workers(), ElementsAre(w[0], w[1]));
  EXPECT_EQ(status.stragglers_dropped(), 1);
  EXPECT_TRUE(status.stragglers().empty());
  EXPECT_EQ(Beat(w[2], job).action(), v1::HeartbeatResponse::ACTION_STOP);
}

TEST_F(CoordinatorTest, AsyncStragglersAreListedButNotDropped) {
  tweak_options_ = [](Coordinator::Options* o) {
    o->heartbeat_timeout = absl::Seconds(100);
    o->straggler_timeout = absl::Seconds(10);
  };
  Restart();
  v1::JobSpec spec = TinyJob(2);
  spec.set_mode(v1::CONSISTENCY_ASYNC);
  ASSERT_OK_AND_ASSIGN(std::string job, coordinator_->SubmitJob(spec));
  const std::string a = Register(), b = Register();
  coordinator_->Tick();
  const std::string run = Beat(a).assignment().run_id();
  for (int i = 0; i < 3; ++i) {
    now_ += absl::Seconds(8);
    ASSERT_OK(coordinator_->Heartbeat(a, job, run, 100 + i).status());
    ASSERT_OK(coordinator_->Heartbeat(b, job, run, 5).status());
    coordinator_->Tick();
  }
  EXPECT_THAT(Status(job).stragglers(), ElementsAre(b));
  EXPECT_EQ(Status(job).workers_size(), 2);
  EXPECT_EQ(Status(job).stragglers_dropped(), 0);
}

// Issue 9: a SetMembers that failed on one shard left the shards on mixed
// generations (and failed the job). The job starts a new run from its
// checkpoint instead, which configures every shard afresh.
TEST_F(CoordinatorTest, AMembershipChangeOneShardMissedStartsANewRun) {
  MakeController(2);
  Restart();
  std::vector<std::string> w;
  const std::string job = StartJob(2, &w);
  {
    absl::MutexLock lock(&fakes_[1]->mu);
    fakes_[1]->fail_set_members = true;
  }
  now_ += absl::Milliseconds(1500);
  Beat(w[0], job);
  now_ += absl::Milliseconds(1000);  // w[1] silent for 2.5 s > 2 s.
  coordinator_->Tick();              // Drops w[1]; shard 1 misses the change.
  {
    absl::MutexLock lock(&fakes_[1]->mu);
    fakes_[1]->fail_set_members = false;
  }
  coordinator_->Tick();
  const v1::JobStatus status = Status(job);
  EXPECT_EQ(status.state(), v1::JOB_STATE_QUEUED) << status.reason();
  // The survivor takes the job up again once another worker joins.
  Register();
  Beat(w[0]);
  coordinator_->Tick();
  EXPECT_EQ(Status(job).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Status(job).runs(), 2);
  int64_t generations[2] = {0, 0};
  for (int s = 0; s < 2; ++s) {
    FakeShard& shard = *fakes_[s];
    absl::MutexLock lock(&shard.mu);
    generations[s] = shard.jobs.at(job).generation;
  }
  EXPECT_EQ(generations[0], generations[1]);
}

TEST_F(CoordinatorTest, WaitForJobUpdateWakesOnChangeAndTimesOut) {
  auto id = coordinator_->SubmitJob(TinyJob(1));
  ASSERT_OK(id);
  auto first = coordinator_->WaitForJobUpdate(*id, -1, absl::InfinitePast());
  ASSERT_OK(first);
  const absl::Time start = absl::Now();
  auto same =
      coordinator_->WaitForJobUpdate(*id, first->revision, absl::Now() + absl::Milliseconds(50));
  ASSERT_OK(same);
  EXPECT_EQ(same->revision, first->revision);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(45));

  ASSERT_OK(coordinator_->CancelJob(*id));
  auto changed =
      coordinator_->WaitForJobUpdate(*id, first->revision, absl::Now() + absl::Seconds(10));
  ASSERT_OK(changed);
  EXPECT_GT(changed->revision, first->revision);
  EXPECT_EQ(changed->status.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(coordinator_->WaitForJobUpdate("job-9", 0, absl::Now()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(CoordinatorTest, ShardControllerSplitsAndReassemblesAcrossShards) {
  MakeController(2);
  auto graph = BuildModelGraph(TinyJob(1).model());
  ASSERT_OK(graph);
  JobLaunch launch;
  launch.job_id = "job-1";
  launch.spec = TinyJob(1);
  launch.members = {"worker-1"};
  launch.params = InitialParameterValues(*graph);
  launch.optimizer_state["fc/weight/momentum"] = std::vector<float>(12, 0.25f);
  ASSERT_OK(controller_->ConfigureJob(launch));
  {
    // Named, so that the lock analysis tells the two shards' mutexes apart
    // (it reads fakes_[0] and fakes_[1] as the same expression).
    FakeShard& shard0 = *fakes_[0];
    FakeShard& shard1 = *fakes_[1];
    absl::MutexLock l0(&shard0.mu);
    absl::MutexLock l1(&shard1.mu);
    // 15 floats in 16-byte chunks: both shards own some.
    EXPECT_GT(shard0.jobs.at("job-1").config.chunks_size(), 0);
    EXPECT_GT(shard1.jobs.at("job-1").config.chunks_size(), 0);
    EXPECT_EQ(shard1.jobs.at("job-1").config.shard_index(), 1);
    EXPECT_EQ(shard1.jobs.at("job-1").config.num_shards(), 2);
  }
  auto model = controller_->ReadModel("job-1", *graph);
  ASSERT_OK(model);
  EXPECT_EQ(model->params, launch.params);
  ASSERT_EQ(model->optimizer_state.size(), 1u);
  EXPECT_EQ(model->optimizer_state.at("fc/weight/momentum"), std::vector<float>(12, 0.25f));

  launch.params[0].pop_back();
  EXPECT_EQ(controller_->ConfigureJob(launch).code(), absl::StatusCode::kInvalidArgument);
  launch.params = InitialParameterValues(*graph);
  launch.optimizer_state["nope/momentum"] = {1};
  EXPECT_EQ(controller_->ConfigureJob(launch).code(), absl::StatusCode::kInvalidArgument);
}

// The same flow against a real in-process ParameterShard.
TEST(CoordinatorWithParameterShardTest, StartsAJobAndCheckpointsTheShardsModel) {
  ParameterShard shard({.shard_index = 0});
  std::vector<std::unique_ptr<ShardClient>> clients;
  clients.push_back(MakeLocalShardClient(&shard));
  ShardController controller(std::move(clients));
  const std::string dir = absl::StrCat(::testing::TempDir(), "/coordinator_real_", getpid());
  fs::remove_all(dir);
  Coordinator::Options options;
  options.state_dir = dir;
  options.start_background_thread = false;
  options.log = [](const std::string&) {};
  auto coordinator = Coordinator::Create(std::move(options), &controller);
  ASSERT_OK(coordinator);
  Coordinator& c = **coordinator;

  v1::JobSpec spec = TinyJob(1);
  spec.mutable_optimizer()->set_momentum(0.9f);
  auto job = c.SubmitJob(spec);
  ASSERT_OK(job);
  const std::string worker = c.RegisterWorker(v1::WorkerInfo())->worker_id();
  c.Tick();
  ASSERT_EQ(c.GetJob(*job)->state(), v1::JOB_STATE_RUNNING) << c.GetJob(*job)->reason();
  auto plan = shard.Plan(*job);
  ASSERT_OK(plan);

  v1::ReportProgressRequest done = Progress(worker, *job, 2, 4, 0.1, 1, 0);
  done.set_finished(true);
  *done.mutable_eval_shard() = EvalShard({{0, 0}, {2, 2}}, 0.1);
  ASSERT_OK(c.ReportProgress(done));
  c.Tick();
  ASSERT_EQ(c.GetJob(*job)->state(), v1::JOB_STATE_SUCCEEDED) << c.GetJob(*job)->reason();
  auto ckpt = ReadCheckpointFile(*c.CheckpointPath(*job));
  ASSERT_OK(ckpt);
  auto graph = BuildModelGraph(spec.model());
  ASSERT_OK(graph);
  const auto initial = InitialParameterValues(*graph);
  ASSERT_EQ(ckpt->parameters_size(), 2);
  EXPECT_EQ(ckpt->parameters(0).name(), "fc/weight");
  EXPECT_EQ(*TensorProtoToFloats(ckpt->parameters(0)), initial[0]);
  EXPECT_EQ(*TensorProtoToFloats(ckpt->parameters(1)), initial[1]);
  // Dropped from the shard once finished.
  EXPECT_FALSE(shard.Plan(*job).ok());
  fs::remove_all(dir);
}

// The gRPC edge over an in-process channel.
class CoordinatorServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/coordinator_service_", getpid());
    fs::remove_all(dir_);
    std::vector<std::unique_ptr<ShardClient>> clients;
    clients.push_back(std::make_unique<FakeShardClient>(&fake_));
    controller_ = std::make_unique<ShardController>(std::move(clients));
    Coordinator::Options options;
    options.state_dir = dir_;
    options.start_background_thread = false;
    options.log = [](const std::string&) {};
    auto c = Coordinator::Create(std::move(options), controller_.get());
    ASSERT_OK(c);
    coordinator_ = *std::move(c);
    service_ = std::make_unique<CoordinatorService>(coordinator_.get());
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Coordinator::NewStub(server_->InProcessChannel(grpc::ChannelArguments()));
  }
  void TearDown() override {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    server_.reset();
    fs::remove_all(dir_);
  }
  void Deadline(grpc::ClientContext& ctx, absl::Duration d = absl::Seconds(20)) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + d));
  }
  // A running job whose model (1.2 MB) spans two 1 MiB download chunks.
  std::string StartBigJob() {
    v1::JobSpec spec = TinyJob(1);
    spec.mutable_model()->set_input_shape(0, 600);
    spec.mutable_model()->mutable_layers(0)->mutable_dense()->set_units(500);
    spec.mutable_model()->set_num_classes(500);
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::SubmitJobResponse response;
    grpc::ClientContext ctx;
    Deadline(ctx);
    EXPECT_OK(stub_->SubmitJob(&ctx, request, &response));
    grpc::ClientContext rctx;
    Deadline(rctx);
    v1::RegisterWorkerResponse worker;
    EXPECT_OK(stub_->RegisterWorker(&rctx, v1::RegisterWorkerRequest(), &worker));
    coordinator_->Tick();
    return response.job_id();
  }

  std::string dir_;
  FakeShard fake_;
  std::unique_ptr<ShardController> controller_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

// Regression (issue 8): message size was unlimited on every service; a
// 65 MiB job name was accepted. Over real gRPC: the service's own limit
// (1 MiB here) and the server's receive limit (8 MiB) both answer
// RESOURCE_EXHAUSTED, and the server keeps serving.
TEST_F(CoordinatorServiceTest, OversizedRequestsAreResourceExhaustedAndTheServerKeepsServing) {
  CoordinatorService limited(coordinator_.get(),
                             {.max_message_bytes = 1 << 20, .authorizer = nullptr});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  ConfigureServerBuilder(&builder, 8 << 20);
  builder.RegisterService(&limited);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = v1::Coordinator::NewStub(CreateChannel(absl::StrCat("127.0.0.1:", port)));
  auto submit = [&](size_t name_bytes) {
    v1::SubmitJobRequest request;
    *request.mutable_spec() = TinyJob(1);
    request.mutable_spec()->set_name(std::string(name_bytes, 'n'));
    v1::SubmitJobResponse response;
    grpc::ClientContext ctx;
    Deadline(ctx);
    return stub->SubmitJob(&ctx, request, &response);
  };
  grpc::Status status = submit(2 << 20);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--max-coordinator-message-bytes"));
  status = submit(65 << 20);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  status = submit(300);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("--max-name-bytes"));
  EXPECT_OK(submit(10));
  EXPECT_EQ(coordinator_->ListJobs().size(), 1u);
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
}

TEST_F(CoordinatorServiceTest, SubmitMapsValidationErrorsAndUnknownJobs) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = TinyJob(1);
  request.mutable_spec()->set_batch_size(0);
  v1::SubmitJobResponse response;
  grpc::ClientContext ctx;
  Deadline(ctx);
  const grpc::Status s = stub_->SubmitJob(&ctx, request, &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("batch_size"));

  v1::GetJobRequest get;
  get.set_job_id("job-404");
  v1::JobStatus status;
  grpc::ClientContext gctx;
  Deadline(gctx);
  EXPECT_EQ(stub_->GetJob(&gctx, get, &status).error_code(), grpc::StatusCode::NOT_FOUND);

  v1::HeartbeatRequest hb;
  v1::HeartbeatResponse hb_response;
  grpc::ClientContext hctx;
  Deadline(hctx);
  EXPECT_EQ(stub_->Heartbeat(&hctx, hb, &hb_response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CoordinatorServiceTest, WatchJobStreamsUntilATerminalState) {
  const std::string job = StartBigJob();
  std::vector<v1::JobStatus> seen;
  grpc::Status end;
  absl::Notification first_status;
  std::thread watcher([&] {
    v1::WatchJobRequest request;
    request.set_job_id(job);
    request.set_min_interval_ms(10);
    grpc::ClientContext ctx;
    Deadline(ctx);
    auto reader = stub_->WatchJob(&ctx, request);
    v1::JobStatus s;
    while (reader->Read(&s)) {
      seen.push_back(s);
      if (!first_status.HasBeenNotified()) first_status.Notify();
    }
    end = reader->Finish();
    if (!first_status.HasBeenNotified()) first_status.Notify();
  });
  // Cancels once the stream has delivered a status: a fixed sleep raced a
  // loaded machine, where the first status could come after the cancel.
  first_status.WaitForNotificationWithTimeout(absl::Seconds(30));
  ASSERT_OK(coordinator_->CancelJob(job));
  watcher.join();
  EXPECT_OK(end);
  ASSERT_GE(seen.size(), 2u);
  EXPECT_EQ(seen.front().state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(seen.back().state(), v1::JOB_STATE_CANCELLED);
}

TEST_F(CoordinatorServiceTest, DownloadModelStreamsTheCheckpointInChunks) {
  const std::string job = StartBigJob();
  {
    v1::DownloadModelRequest request;
    request.set_job_id(job);
    grpc::ClientContext ctx;
    Deadline(ctx);
    auto reader = stub_->DownloadModel(&ctx, request);
    v1::ModelChunk chunk;
    while (reader->Read(&chunk)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  }
  ASSERT_OK(coordinator_->CancelJob(job));
  coordinator_->Tick();  // Saves the cancelled job's model.
  auto path = coordinator_->CheckpointPath(job);
  ASSERT_OK(path);
  std::ifstream in(*path, std::ios::binary);
  std::stringstream file;
  file << in.rdbuf();

  v1::DownloadModelRequest request;
  request.set_job_id(job);
  grpc::ClientContext ctx;
  Deadline(ctx);
  auto reader = stub_->DownloadModel(&ctx, request);
  v1::ModelChunk chunk;
  std::string bytes;
  int chunks = 0;
  while (reader->Read(&chunk)) {
    EXPECT_EQ(chunk.offset(), static_cast<int64_t>(bytes.size()));
    EXPECT_EQ(chunk.total_bytes(), static_cast<int64_t>(file.str().size()));
    EXPECT_LE(chunk.data().size(), static_cast<size_t>(kModelChunkBytes));
    bytes += chunk.data();
    ++chunks;
  }
  ASSERT_OK(reader->Finish());
  EXPECT_EQ(chunks, 2);
  EXPECT_EQ(bytes, file.str());
}

}  // namespace
}  // namespace pstrain
