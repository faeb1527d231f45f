// AssignmentRun on its own, against the in-process fake Coordinator
// (tests/testing/fake_coordinator.h) and parameter shards nobody listens
// on: a new generation kept with the run's spec, a dataset outside the data
// roots refused before any file or call, the failure report with its run
// and latest generation, and Cancel() reaching a run that waits for its
// shards. Whole runs (plans, tails, progress, evaluation) are trained by
// the integration tests against real shards.
#include "worker/assignment_run.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/rpc/channel.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_coordinator.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::FakeCoordinator;
using ::pstrain::testing::StartFakeCoordinator;
using ::pstrain::testing::StatusIs;
using ::pstrain::testing::SyntheticAssignment;
using ::testing::HasSubstr;

constexpr char kWorker[] = "worker-7";

class AssignmentRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int port = 0;
    server_ = StartFakeCoordinator(&fake_, &port);
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Coordinator::NewStub(CreateChannel("127.0.0.1:" + std::to_string(port)));
    absl::MutexLock lock(&fake_.mu);
    fake_.workers.insert(kWorker);
  }

  // Options for a run of this worker; datasets may lie under `data_roots`.
  AssignmentRun::Options RunOptions(const std::vector<std::string>& data_roots = {}) {
    auto policy = data::DataPathPolicy::Create(data_roots);
    EXPECT_OK(policy.status());
    policy_.emplace(*std::move(policy));
    AssignmentRun::Options options;
    options.device = "cpu";
    options.num_threads = 1;
    options.data_policy = &*policy_;
    options.worker_id = kWorker;
    options.hostname = "test-host";
    options.shards = {"127.0.0.1:1"};  // Nobody listens.
    options.coordinator = stub_.get();
    options.rpc_timeout = absl::Seconds(2);
    options.ps_rpc_timeout = absl::Seconds(120);  // Waits for the shards until cancelled.
    options.max_backoff = absl::Milliseconds(200);
    options.metrics = &metrics_;
    options.log = [](const std::string&) {};
    return options;
  }

  // Publishes `a` as the fake's current assignment and returns it.
  v1::Assignment Assign(v1::Assignment a) {
    absl::MutexLock lock(&fake_.mu);
    fake_.assignment = a;
    return a;
  }

  FakeCoordinator fake_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::optional<data::DataPathPolicy> policy_;
  TrainingMetrics metrics_{nullptr};
};

TEST_F(AssignmentRunTest, UpdateTakesTheNewGenerationAndKeepsTheSpec) {
  const v1::Assignment first = SyntheticAssignment("job-1", "job-1.1.00ab");
  std::shared_ptr<AssignmentRun> run = AssignmentRun::Create(first, RunOptions());
  EXPECT_EQ(run->job_id(), "job-1");
  EXPECT_EQ(run->run_id(), "job-1.1.00ab");
  v1::Assignment next = first;
  next.clear_spec();  // The coordinator sends it only until the run started.
  next.set_generation(2);
  next.set_rank(1);
  next.set_world_size(2);
  run->Update(next);
  const v1::Assignment now = run->Snapshot();
  EXPECT_EQ(now.generation(), 2);
  EXPECT_EQ(now.rank(), 1);
  EXPECT_EQ(now.world_size(), 2);
  EXPECT_EQ(now.spec().batch_size(), first.spec().batch_size());
  EXPECT_EQ(now.spec().model().name(), "dense");
  EXPECT_FALSE(run->stopped());
  EXPECT_FALSE(run->done());
}

// Regression (issue 8), at the run: the rule, not the path, and nothing
// asked of the coordinator.
TEST_F(AssignmentRunTest, ADatasetOutsideTheDataRootsFailsBeforeAnyFileOrCall) {
  v1::Assignment a = SyntheticAssignment("job-2", "job-2.1.00ab");
  a.mutable_spec()->mutable_dataset()->set_format(v1::DATASET_FORMAT_IDX);
  a.mutable_spec()->mutable_dataset()->set_path("/etc/../etc/ssl");
  std::shared_ptr<AssignmentRun> run =
      AssignmentRun::Create(Assign(a), RunOptions({::testing::TempDir()}));
  const absl::Status status = run->Run();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kPermissionDenied,
                               HasSubstr("outside the worker's --data-root allow-list")));
  EXPECT_THAT(status.message(), ::testing::Not(HasSubstr("/etc")));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.plan_requests.empty());
  EXPECT_TRUE(fake_.reports.empty());
}

TEST_F(AssignmentRunTest, ReportFailureSendsTheErrorWithItsRunAndLatestGeneration) {
  const v1::Assignment a = Assign(SyntheticAssignment("job-3", "job-3.1.00ab"));
  std::shared_ptr<AssignmentRun> run = AssignmentRun::Create(a, RunOptions());
  v1::Assignment next = a;
  next.set_generation(3);
  run->Update(next);
  run->ReportFailure(absl::InternalError("boom"));
  absl::MutexLock lock(&fake_.mu);
  ASSERT_EQ(fake_.reports.size(), 1u);
  const v1::ReportProgressRequest& report = fake_.reports[0];
  EXPECT_EQ(report.worker_id(), kWorker);
  EXPECT_EQ(report.job_id(), "job-3");
  EXPECT_EQ(report.run_id(), "job-3.1.00ab");
  EXPECT_EQ(report.generation(), 3);
  EXPECT_EQ(report.error(), "test-host: INTERNAL: boom");
  EXPECT_FALSE(report.finished());
}

// Without Cancel() reaching the updater, the run would wait for its shards
// for the whole resync timeout (60 s) and then fail UNAVAILABLE.
TEST_F(AssignmentRunTest, CancelEndsARunThatWaitsForItsShards) {
  const v1::Assignment a = Assign(SyntheticAssignment("job-4", "job-4.1.00ab"));
  std::shared_ptr<AssignmentRun> run = AssignmentRun::Create(a, RunOptions());
  absl::Notification ended;
  absl::Status result;
  run->Start([&](AssignmentRun& r, const absl::Status& status) {
    EXPECT_EQ(&r, run.get());
    result = status;
    ended.Notify();
  });
  run->Cancel();
  EXPECT_TRUE(run->stopped());
  ASSERT_TRUE(ended.WaitForNotificationWithTimeout(absl::Seconds(30)));
  run->Join();
  EXPECT_TRUE(run->done());
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kCancelled, ::testing::_));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.plan_requests.empty());  // It never reached its epochs.
}

}  // namespace
}  // namespace pstrain
