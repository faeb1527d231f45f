// JobWorker and ExternalUpdater (worker/, what pstrain.torch drives through
// pstrain._native) against the real Coordinator and a real ParameterShard
// (server/) on one 127.0.0.1 server, in one process: two workers bound to a
// job whose model is external declare it, the job starts on them with the
// first declaration's values, one sync step averages their gradients and
// buffers, and a cancelled job stops both workers. Runs under ThreadSanitizer
// (label loopback): the heartbeat thread, the shard calls and the step.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "common/rpc/channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "server/shard_controller.h"
#include "tests/testing/status_matchers.h"
#include "worker/external_updater.h"
#include "worker/job_worker.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A coordinator and one shard on one server.
class Cluster {
 public:
  Cluster() {
    std::vector<std::unique_ptr<ShardClient>> clients;
    clients.push_back(MakeLocalShardClient(&shard_));
    controller_ = std::make_unique<ShardController>(std::move(clients));
    Coordinator::Options options;
    options.heartbeat_interval = absl::Milliseconds(100);
    options.tick_interval = absl::Milliseconds(20);
    options.log = [](const std::string&) {};
    coordinator_ = *Coordinator::Create(options, controller_.get());
    service_ = std::make_unique<CoordinatorService>(coordinator_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    services_.Register(&builder);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    address_ = "127.0.0.1:" + std::to_string(port);
    coordinator_->SetShardAddresses({address_});
  }
  ~Cluster() {
    server_->Shutdown(DeadlineFromNow(absl::Seconds(5)));
    coordinator_.reset();
  }

  Coordinator& coordinator() { return *coordinator_; }

  JobWorker::Options WorkerOptions(const std::string& job_id) const {
    JobWorker::Options options;
    options.coordinator_address = address_;
    options.job_id = job_id;
    options.info.set_hostname("torch");
    options.rpc_timeout = absl::Seconds(10);
    options.ps_rpc_timeout = absl::Seconds(30);
    options.log = [](const std::string&) {};
    return options;
  }
  std::unique_ptr<JobWorker> Worker(const std::string& job_id) {
    auto worker = JobWorker::Create(WorkerOptions(job_id));
    EXPECT_OK(worker.status());
    return worker.ok() ? *std::move(worker) : nullptr;
  }

 private:
  ParameterShard shard_{ParameterShard::Options{.shard_index = 0}};
  ShardServices services_{&shard_, ShardServices::Options{}};
  std::unique_ptr<ShardController> controller_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

v1::JobSpec ExternalJob() {
  v1::JobSpec job;
  job.set_name("torch");
  job.mutable_external_model()->set_framework("torch");
  job.mutable_optimizer()->set_type(v1::OPTIMIZER_SGD);
  job.mutable_optimizer()->set_learning_rate(0.5f);
  job.set_epochs(1);
  job.set_batch_size(4);
  job.set_workers(2);
  job.set_mode(v1::CONSISTENCY_SYNC);
  return job;
}

// fc.weight [3, 2] (trained) and bn.running_mean [2] (a buffer).
v1::ExternalModel Model() {
  v1::ExternalModel model;
  model.set_framework("torch 1.13");
  v1::ExternalTensor* w = model.add_tensors();
  w->set_name("fc.weight");
  w->add_shape(3);
  w->add_shape(2);
  w->set_trainable(true);
  v1::ExternalTensor* mean = model.add_tensors();
  mean->set_name("bn.running_mean");
  mean->add_shape(2);
  return model;
}

// One worker's tensors, as a framework would hold them.
struct Tensors {
  std::vector<float> weight, mean, grad;
  std::vector<float*> pointers() { return {weight.data(), mean.data()}; }
};

TEST(JobWorkerLoopbackTest, TwoBoundWorkersDeclareStartAndAverageOneSyncStep) {
  Cluster cluster;
  auto job = cluster.coordinator().SubmitJob(ExternalJob());
  ASSERT_OK(job);
  Tensors a{{1, 2, 3, 4, 5, 6}, {0.5f, -0.5f}, {1, 1, 1, 1, 1, 1}};
  Tensors b{{9, 9, 9, 9, 9, 9}, {9, 9}, {3, 3, 3, 3, 3, 3}};
  std::unique_ptr<JobWorker> wa = cluster.Worker(*job);
  std::unique_ptr<JobWorker> wb = cluster.Worker(*job);
  ASSERT_NE(wa, nullptr);
  ASSERT_NE(wb, nullptr);
  auto values = [](Tensors* t) {
    return [t](int i) {
      return i == 0 ? absl::Span<const float>(t->weight) : absl::Span<const float>(t->mean);
    };
  };
  auto declared_a = wa->DeclareModel(Model(), values(&a));
  ASSERT_OK(declared_a);
  EXPECT_TRUE(*declared_a);
  v1::ExternalModel other = Model();
  other.mutable_tensors(0)->set_shape(0, 4);
  EXPECT_THAT(wb->DeclareModel(other, values(&b)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[3, 2]")));
  auto declared_b = wb->DeclareModel(Model(), values(&b));
  ASSERT_OK(declared_b);
  EXPECT_FALSE(*declared_b);

  auto start_a = wa->AwaitStart(absl::Seconds(30));
  auto start_b = wb->AwaitStart(absl::Seconds(30));
  ASSERT_OK(start_a);
  ASSERT_OK(start_b);
  EXPECT_EQ(start_a->world_size(), 2);
  EXPECT_EQ(start_a->spec().external_model().tensors_size(), 2);

  // Both start from the first declaration's values; one sync step applies
  // the mean gradient (2) at learning rate 0.5 and takes the buffers' mean.
  // Worker a overlaps its pulls (Step returns with them in flight; a
  // forward would wait per tensor), worker b waits for them in Step.
  auto step = [](JobWorker* worker, Tensors* t, bool overlap, absl::Status* result) {
    const v1::Assignment assignment = worker->assignment();
    absl::StatusOr<std::shared_ptr<PsClient>> client = worker->ConnectShards();
    if (!client.ok()) {
      *result = client.status();
      return;
    }
    const ModelGraph graph = *BuildJobGraph(assignment.spec());
    ExternalUpdater::Options options =
        ExternalUpdater::OptionsFromJob(assignment.spec(), assignment.rank());
    options.overlap_pulls = overlap;
    ExternalUpdater updater(options, graph, client->get());
    *result = updater.Start(t->pointers());
    if (!result->ok()) return;
    if (overlap) t->mean = {1.5f, 0.5f};  // Worker a's running mean moved.
    *result = updater.GradientReady(0, t->grad.data());
    if (result->ok()) *result = updater.Step();
    if (overlap && result->ok()) {
      if (absl::Status bad = updater.WaitParams({2}); !absl::IsInvalidArgument(bad)) {
        *result = absl::InternalError(absl::StrCat("WaitParams({2}): ", bad.ToString()));
        return;
      }
      *result = updater.WaitParams({0, 1});  // What a forward's pre-hooks do.
    }
    if (result->ok()) *result = updater.Finish();
  };
  absl::Status status_a, status_b;
  std::thread other_worker([&] { step(wb.get(), &b, false, &status_b); });
  step(wa.get(), &a, true, &status_a);
  other_worker.join();
  ASSERT_OK(status_a);
  ASSERT_OK(status_b);
  EXPECT_THAT(a.weight, ElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_EQ(a.weight, b.weight);
  EXPECT_THAT(a.mean, ElementsAre(1.0f, 0.0f));  // ({1.5, 0.5} + {0.5, -0.5}) / 2
  EXPECT_EQ(a.mean, b.mean);

  // One run so far; a call that names another run is refused.
  EXPECT_EQ(wa->run_number(), 1);
  EXPECT_FALSE(wa->AwaitNewRun(1, absl::Milliseconds(50)));
  v1::ReportProgressRequest stale;
  stale.set_run_id("not-this-run");
  EXPECT_THAT(wa->ReportProgress(stale).status(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("was replaced by")));

  // A cancelled job: its bound workers are told to stop.
  ASSERT_OK(cluster.coordinator().CancelJob(*job).status());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while ((!wa->stopped() || !wb->stopped()) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(wa->stopped());
  EXPECT_TRUE(wb->stopped());
  EXPECT_THAT(wa->stop_reason(), HasSubstr("said stop"));
  EXPECT_FALSE(wa->AwaitNewRun(1, absl::Seconds(30)));  // At once: it stopped.
}

TEST(JobWorkerLoopbackTest, ARegistrationTheCoordinatorCannotTakeIsRefused) {
  Cluster cluster;
  EXPECT_THAT(JobWorker::Create(cluster.WorkerOptions("job-404")).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("job-404")));
  // Nobody listening: given up after the connect timeout, saying so.
  JobWorker::Options nobody = cluster.WorkerOptions("job-1");
  nobody.coordinator_address = "127.0.0.1:1";
  nobody.connect_timeout = absl::Milliseconds(300);
  EXPECT_THAT(JobWorker::Create(nobody).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot register")));
}

}  // namespace
}  // namespace pstrain
