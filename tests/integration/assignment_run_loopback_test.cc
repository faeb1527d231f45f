// AssignmentRun (worker/) training whole runs against a real ParameterShard
// (server/) and the fake Coordinator (tests/testing/fake_coordinator.h, the
// real protocol) on one 127.0.0.1 server, in one process: the plan asked
// again while the coordinator says wait, the share, a tail, the epoch's
// report and the final report with the test shard; and a `stop` answer to a
// progress report ending the run. Lives in tests/integration/ because it
// needs both the worker and the server libraries.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "common/rpc/channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "tests/testing/fake_coordinator.h"
#include "tests/testing/shard_fixtures.h"
#include "tests/testing/status_matchers.h"
#include "worker/assignment_run.h"
#include "worker/training_metrics.h"

namespace pstrain {
namespace {

using ::pstrain::testing::FakeCoordinator;
using ::pstrain::testing::StatusIs;
using ::pstrain::testing::SyntheticAssignment;

constexpr char kWorker[] = "worker-1";

// One shard holding `assignment`'s job and the fake coordinator, on one
// server; runs of kWorker against them.
class Loopback {
 public:
  explicit Loopback(const v1::Assignment& assignment) : assignment_(assignment) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    services_.Register(&builder);
    builder.RegisterService(&fake);
    server_ = builder.BuildAndStart();
    address_ = "127.0.0.1:" + std::to_string(port);
    stub_ = v1::Coordinator::NewStub(CreateChannel(address_));
    const ModelGraph graph = *BuildModelGraph(assignment.spec().model());
    const ChunkPlan plan = *PlanChunks(graph, 1);
    ShardJobConfig config;
    config.job_id = assignment.job_id();
    config.spec = assignment.spec();
    config.members = {kWorker};
    config.generation = assignment.generation();
    EXPECT_OK(shard_.ConfigureJob(config, ::pstrain::testing::InitialChunks(graph, plan, 0)));
    absl::MutexLock lock(&fake.mu);
    fake.workers.insert(kWorker);
    fake.assignment = assignment;
  }
  ~Loopback() { server_->Shutdown(DeadlineFromNow(absl::Seconds(5))); }

  std::shared_ptr<AssignmentRun> NewRun(int progress_every_steps) {
    auto policy = data::DataPathPolicy::Create({});
    EXPECT_OK(policy.status());
    policy_.emplace(*std::move(policy));
    AssignmentRun::Options options;
    options.device = "cpu";
    options.num_threads = 1;
    options.data_policy = &*policy_;
    options.worker_id = kWorker;
    options.hostname = "test-host";
    options.shards = {address_};
    options.coordinator = stub_.get();
    options.rpc_timeout = absl::Seconds(10);
    options.ps_rpc_timeout = absl::Seconds(30);
    options.progress_every_steps = progress_every_steps;
    options.metrics = &metrics_;
    options.log = [](const std::string&) {};
    return AssignmentRun::Create(assignment_, options);
  }

  FakeCoordinator fake;

 private:
  const v1::Assignment assignment_;
  ParameterShard shard_{ParameterShard::Options{.shard_index = 0}};
  ShardServices services_{&shard_, ShardServices::Options{}};
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::optional<data::DataPathPolicy> policy_;
  TrainingMetrics metrics_{nullptr};
};

TEST(AssignmentRunLoopbackTest, TrainsItsShareThenItsTailAndReportsItsTestShard) {
  // 32 samples at batch 8: 4 steps; the tail (positions 0..8 again) 1 more.
  Loopback loopback(SyntheticAssignment("job-1", "job-1.1.00ab"));
  {
    absl::MutexLock lock(&loopback.fake.mu);
    loopback.fake.plan_waits = 2;
    v1::WorkSegment tail;
    tail.set_epoch(0);
    tail.set_begin(0);
    tail.set_end(8);
    tail.set_steps(1);
    loopback.fake.tails = {tail};
  }
  std::shared_ptr<AssignmentRun> run = loopback.NewRun(/*progress_every_steps=*/2);
  ASSERT_OK(run->Run());
  EXPECT_EQ(run->steps(), 5);

  absl::MutexLock lock(&loopback.fake.mu);
  const std::vector<v1::EpochPlanRequest>& asks = loopback.fake.plan_requests;
  // Two `wait`s, the share's plan, then after the share: the tail, and the
  // answer that ends the epoch.
  ASSERT_EQ(asks.size(), 5u);
  for (const v1::EpochPlanRequest& ask : asks) {
    EXPECT_EQ(ask.run_id(), "job-1.1.00ab");
    EXPECT_EQ(ask.epoch(), 0);
    EXPECT_EQ(ask.epoch_length(), 32);
    EXPECT_EQ(ask.batch_size(), 8);
  }
  EXPECT_FALSE(asks[2].share_done());
  EXPECT_TRUE(asks[3].share_done());
  EXPECT_EQ(asks[3].tails_done(), 0);
  EXPECT_EQ(asks[4].tails_done(), 1);
  ASSERT_EQ(asks[4].trained_size(), 1);
  EXPECT_EQ(asks[4].trained(0).samples(), 40);  // The share and the tail.

  const std::vector<v1::ReportProgressRequest>& reports = loopback.fake.reports;
  ASSERT_GE(reports.size(), 2u);
  const v1::ReportProgressRequest& epoch_end = reports[reports.size() - 2];
  EXPECT_EQ(epoch_end.epoch(), 1);
  EXPECT_EQ(epoch_end.step(), 4);  // A tail does not move the data position.
  EXPECT_EQ(epoch_end.steps_per_epoch(), 4);
  const v1::ReportProgressRequest& last = reports.back();
  EXPECT_TRUE(last.finished());
  EXPECT_EQ(last.worker_id(), kWorker);
  EXPECT_EQ(last.run_id(), "job-1.1.00ab");
  EXPECT_EQ(last.eval_shard().samples(), 8);
  EXPECT_EQ(last.eval_shard().num_classes(), 2);
}

TEST(AssignmentRunLoopbackTest, AStopAnswerToAProgressReportEndsTheRun) {
  v1::Assignment a = SyntheticAssignment("job-2", "job-2.1.00ab");
  a.mutable_spec()->set_epochs(1000);  // Far more than the test waits for.
  Loopback loopback(a);
  {
    absl::MutexLock lock(&loopback.fake.mu);
    loopback.fake.stop_reports = true;
  }
  std::shared_ptr<AssignmentRun> run = loopback.NewRun(/*progress_every_steps=*/1);
  EXPECT_THAT(run->Run(), StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  EXPECT_TRUE(run->stopped());
  EXPECT_LT(run->steps(), 4 * 1000);
  absl::MutexLock lock(&loopback.fake.mu);
  for (const v1::ReportProgressRequest& report : loopback.fake.reports) {
    EXPECT_FALSE(report.finished());
  }
}

}  // namespace
}  // namespace pstrain
