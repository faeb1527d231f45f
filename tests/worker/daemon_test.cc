// WorkerDaemon against an in-process fake Coordinator: registration with the
// machine's description, heartbeats, re-registration, retry while the
// coordinator is down, a failing assignment reported as the job's error, and
// the /metrics endpoint.
#include "worker/daemon.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "tests/testing/http_get.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override {
    absl::MutexLock lock(&mu);
    infos.push_back(request->info());
    response->set_worker_id("worker-" + std::to_string(infos.size()));
    response->set_heartbeat_interval_ms(50);
    response->add_shards("127.0.0.1:1");  // Nobody listens: a pull fails at once.
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    {
      absl::MutexLock lock(&mu);
      heartbeats.push_back(request->worker_id() + "/" + request->job_id());
      if (hang_heartbeats) {
        hanging = true;
      }
    }
    // A coordinator that stops answering (a SIGSTOPped server): the call
    // stays open until the test lets go.
    if (hanging) release.WaitForNotificationWithTimeout(absl::Seconds(120));
    absl::MutexLock lock(&mu);
    if (reregister_next) {
      reregister_next = false;
      response->set_action(v1::HeartbeatResponse::ACTION_REREGISTER);
      return grpc::Status::OK;
    }
    if (assignment.job_id().empty()) {
      response->set_action(v1::HeartbeatResponse::ACTION_IDLE);
    } else {
      response->set_action(v1::HeartbeatResponse::ACTION_RUN);
      *response->mutable_assignment() = assignment;
    }
    return grpc::Status::OK;
  }
  grpc::Status ReportProgress(grpc::ServerContext*, const v1::ReportProgressRequest* request,
                              v1::ReportProgressResponse*) override {
    absl::MutexLock lock(&mu);
    reports.push_back(*request);
    return grpc::Status::OK;
  }

  absl::Mutex mu;
  std::vector<v1::WorkerInfo> infos;
  std::vector<std::string> heartbeats;
  std::vector<v1::ReportProgressRequest> reports;
  bool reregister_next = false;
  bool hang_heartbeats = false;
  std::atomic<bool> hanging{false};
  absl::Notification release;
  v1::Assignment assignment;
};

std::unique_ptr<grpc::Server> StartServer(FakeCoordinator* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(*port), grpc::InsecureServerCredentials(),
                           port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

WorkerDaemon::Options TestOptions(int port) {
  WorkerDaemon::Options options;
  options.coordinator_address = "127.0.0.1:" + std::to_string(port);
  options.device = "cpu";
  options.num_threads = 1;
  options.hostname = "test-host";
  options.heartbeat_interval = absl::Milliseconds(50);
  options.rpc_timeout = absl::Seconds(2);
  options.ps_rpc_timeout = absl::Seconds(2);
  options.max_backoff = absl::Milliseconds(200);
  options.log = [](const std::string&) {};
  return options;
}

// Waits up to 10 s for `done` (checked under the fake's lock).
template <typename Fn>
bool WaitFor(FakeCoordinator& fake, Fn done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    {
      absl::MutexLock lock(&fake.mu);
      if (done()) return true;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

TEST(WorkerDaemonTest, RegistersHeartbeatsAndReregistersWhenAsked) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartServer(&fake, &port);
  ASSERT_NE(server, nullptr);
  auto daemon = WorkerDaemon::Create(TestOptions(port));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  std::thread run([&] { EXPECT_TRUE((*daemon)->Run().ok()); });

  ASSERT_TRUE(WaitFor(fake, [&] { return fake.heartbeats.size() >= 3; }));
  {
    absl::MutexLock lock(&fake.mu);
    ASSERT_EQ(fake.infos.size(), 1u);
    EXPECT_EQ(fake.infos[0].hostname(), "test-host");
    EXPECT_EQ(fake.infos[0].backend(), "cpu");
    EXPECT_THAT(fake.infos[0].device_info(), HasSubstr("cpu"));
    EXPECT_EQ(fake.heartbeats[0], "worker-1/");  // Idle: no job.
    fake.reregister_next = true;
  }
  ASSERT_TRUE(WaitFor(fake, [&] { return fake.infos.size() == 2; }));
  ASSERT_TRUE(WaitFor(fake, [&] { return fake.heartbeats.back() == "worker-2/"; }));
  EXPECT_EQ((*daemon)->worker_id(), "worker-2");
  (*daemon)->Shutdown();
  run.join();
}

// Seen in a test run: a worker whose servers had stopped answering took the
// whole RPC deadline to exit after SIGTERM. Shutdown cancels the call in flight.
TEST(WorkerDaemonTest, ShutdownDoesNotWaitForAHeartbeatThatNeverAnswers) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartServer(&fake, &port);
  ASSERT_NE(server, nullptr);
  WorkerDaemon::Options options = TestOptions(port);
  options.rpc_timeout = absl::Seconds(120);  // Far beyond the wait below.
  auto daemon = WorkerDaemon::Create(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  absl::Notification returned;
  std::thread run([&] {
    EXPECT_TRUE((*daemon)->Run().ok());
    returned.Notify();
  });
  ASSERT_TRUE(WaitFor(fake, [&] { return !fake.heartbeats.empty(); }));
  {
    absl::MutexLock lock(&fake.mu);
    fake.hang_heartbeats = true;
  }
  ASSERT_TRUE(WaitFor(fake, [&] { return fake.hanging.load(); }));
  (*daemon)->Shutdown();
  // A deadline against a hang, not a speed check: without the cancellation
  // Run() returns only after the 120 s RPC deadline.
  EXPECT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(30)));
  fake.release.Notify();
  run.join();
}

TEST(WorkerDaemonTest, KeepsRetryingUntilTheCoordinatorComesUp) {
  // Reserve a port, then start the coordinator on it only later.
  int port = 0;
  {
    FakeCoordinator probe;
    auto server = StartServer(&probe, &port);
    ASSERT_NE(server, nullptr);
    server->Shutdown();
  }
  auto daemon = WorkerDaemon::Create(TestOptions(port));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  std::thread run([&] { EXPECT_TRUE((*daemon)->Run().ok()); });
  absl::SleepFor(absl::Milliseconds(700));  // Several failed attempts.
  EXPECT_EQ((*daemon)->worker_id(), "");
  FakeCoordinator fake;
  auto server = StartServer(&fake, &port);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(WaitFor(fake, [&] { return !fake.heartbeats.empty(); }));
  (*daemon)->Shutdown();
  run.join();
}

TEST(WorkerDaemonTest, AnAssignmentThatCannotRunIsReportedAsTheJobsError) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartServer(&fake, &port);
  ASSERT_NE(server, nullptr);
  {
    absl::MutexLock lock(&fake.mu);
    fake.assignment.set_job_id("job-3");
    fake.assignment.set_rank(0);
    fake.assignment.set_world_size(1);
    fake.assignment.set_generation(1);
    v1::JobSpec* spec = fake.assignment.mutable_spec();
    spec->set_epochs(1);
    spec->set_batch_size(8);
    spec->mutable_dataset()->set_format(v1::DATASET_FORMAT_IDX);
    spec->mutable_dataset()->set_path("/nonexistent/dataset/dir");
  }
  auto daemon = WorkerDaemon::Create(TestOptions(port));
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  std::thread run([&] { EXPECT_TRUE((*daemon)->Run().ok()); });
  ASSERT_TRUE(WaitFor(fake, [&] { return !fake.reports.empty(); }));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_EQ(fake.reports[0].job_id(), "job-3");
    EXPECT_EQ(fake.reports[0].worker_id(), "worker-1");
    EXPECT_THAT(fake.reports[0].error(), HasSubstr("test-host"));
    EXPECT_FALSE(fake.reports[0].finished());
  }
  // The failed job is not started again although the fake keeps assigning it.
  absl::SleepFor(absl::Milliseconds(300));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_EQ(fake.reports.size(), 1u);
    EXPECT_EQ(fake.heartbeats.back(), "worker-1/");
  }
  (*daemon)->Shutdown();
  run.join();
}

// Regression (issue 8): a job could make workers read any path on their
// hosts through dataset.path, and the failure reason echoed the path.
TEST(WorkerDaemonTest, ADatasetOutsideTheDataRootsFailsTheJobWithTheRule) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartServer(&fake, &port);
  ASSERT_NE(server, nullptr);
  {
    absl::MutexLock lock(&fake.mu);
    fake.assignment.set_job_id("job-4");
    fake.assignment.set_rank(0);
    fake.assignment.set_world_size(1);
    fake.assignment.set_generation(1);
    v1::JobSpec* spec = fake.assignment.mutable_spec();
    spec->set_epochs(1);
    spec->set_batch_size(8);
    spec->mutable_dataset()->set_format(v1::DATASET_FORMAT_IDX);
    spec->mutable_dataset()->set_path("/etc/../etc/ssl");
  }
  WorkerDaemon::Options options = TestOptions(port);
  options.data_roots = {::testing::TempDir()};
  auto daemon = WorkerDaemon::Create(options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  std::thread run([&] { EXPECT_TRUE((*daemon)->Run().ok()); });
  ASSERT_TRUE(WaitFor(fake, [&] { return !fake.reports.empty(); }));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_THAT(fake.reports[0].error(), HasSubstr("outside the worker's --data-root allow-list"));
    EXPECT_THAT(fake.reports[0].error(), ::testing::Not(HasSubstr("/etc")));
  }
  (*daemon)->Shutdown();
  run.join();
}

TEST(WorkerDaemonTest, CreateRejectsBadOptions) {
  WorkerDaemon::Options options = TestOptions(1);
  options.device = "tpu";
  EXPECT_FALSE(WorkerDaemon::Create(options).ok());
  options = TestOptions(1);
  options.coordinator_address.clear();
  EXPECT_TRUE(absl::IsInvalidArgument(WorkerDaemon::Create(options).status()));
}

using ::pstrain::testing::HttpGet;

TEST(MetricsEndpointTest, ServesTheRegistryInTextFormat) {
  auto registry = std::make_shared<prometheus::Registry>();
  WorkerDaemon::Options options = TestOptions(1);
  options.registry = registry;
  auto daemon = WorkerDaemon::Create(options);  // Registers the pstrain_worker_* families.
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  auto endpoint = MetricsEndpoint::Start("127.0.0.1", 0, registry);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  std::string response = HttpGet((*endpoint)->port(), "/metrics");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  for (const char* name :
       {"pstrain_worker_samples_per_second", "pstrain_worker_loss", "pstrain_worker_steps_total",
        "pstrain_worker_step_phase_seconds_bucket", "pstrain_worker_data_wait_seconds_total",
        "pstrain_worker_loss_scale", "pstrain_worker_overflowed_steps_total"}) {
    EXPECT_THAT(response, HasSubstr(name));
  }
  EXPECT_THAT(response, HasSubstr("phase=\"compute\""));
  EXPECT_THAT(HttpGet((*endpoint)->port(), "/"), HasSubstr("404"));
  // The port is taken now: a second endpoint on it fails cleanly.
  auto second = MetricsEndpoint::Start("127.0.0.1", (*endpoint)->port(), registry);
  EXPECT_TRUE(absl::IsUnavailable(second.status())) << second.status();
}

}  // namespace
}  // namespace pstrain
