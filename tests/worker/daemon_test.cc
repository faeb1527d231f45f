// WorkerDaemon against an in-process fake Coordinator that speaks the real
// protocol (tests/testing/fake_coordinator.h): registration with the
// machine's description, heartbeats, re-registration, retry while the
// coordinator is down, a failing run reported as the job's error and not
// run again, and a new run of the same job run.
#include "worker/daemon.h"

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_coordinator.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

using ::pstrain::testing::FakeCoordinator;
using ::pstrain::testing::StartFakeCoordinator;
using ::pstrain::testing::WaitFor;

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

TEST(WorkerDaemonTest, RegistersHeartbeatsAndReregistersWhenAsked) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartFakeCoordinator(&fake, &port);
  ASSERT_NE(server, nullptr);
  auto daemon = WorkerDaemon::Create(TestOptions(port));
  ASSERT_OK(daemon);
  std::thread run([&] { EXPECT_OK((*daemon)->Run()); });

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
  auto server = StartFakeCoordinator(&fake, &port);
  ASSERT_NE(server, nullptr);
  WorkerDaemon::Options options = TestOptions(port);
  options.rpc_timeout = absl::Seconds(120);  // Far beyond the wait below.
  auto daemon = WorkerDaemon::Create(options);
  ASSERT_OK(daemon);
  absl::Notification returned;
  std::thread run([&] {
    EXPECT_OK((*daemon)->Run());
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
    auto server = StartFakeCoordinator(&probe, &port);
    ASSERT_NE(server, nullptr);
    server->Shutdown();
  }
  WorkerDaemon::Options options = TestOptions(port);
  absl::Notification unreachable;  // The first registration failed.
  options.on_coordinator_state = [&unreachable](bool connected) {
    if (!connected && !unreachable.HasBeenNotified()) unreachable.Notify();
  };
  auto daemon = WorkerDaemon::Create(options);
  ASSERT_OK(daemon);
  std::thread run([&] { EXPECT_OK((*daemon)->Run()); });
  ASSERT_TRUE(unreachable.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ((*daemon)->worker_id(), "");
  FakeCoordinator fake;
  auto server = StartFakeCoordinator(&fake, &port);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(WaitFor(fake, [&] { return !fake.heartbeats.empty(); }));
  (*daemon)->Shutdown();
  run.join();
}

// An assignment of run `run_id` whose IDX dataset lies at `path`.
v1::Assignment IdxAssignment(const std::string& job_id, const std::string& run_id,
                             const std::string& path) {
  v1::Assignment a;
  a.set_job_id(job_id);
  a.set_run_id(run_id);
  a.set_rank(0);
  a.set_world_size(1);
  a.set_generation(1);
  v1::JobSpec* spec = a.mutable_spec();
  spec->set_epochs(1);
  spec->set_batch_size(8);
  spec->mutable_dataset()->set_format(v1::DATASET_FORMAT_IDX);
  spec->mutable_dataset()->set_path(path);
  return a;
}

// Log lines, from any thread.
class LogLines {
 public:
  std::function<void(const std::string&)> Sink() {
    return [this](const std::string& line) {
      absl::MutexLock lock(&mu_);
      lines_.push_back(line);
    };
  }
  // Waits up to 10 s for a line that contains `text`.
  bool WaitForLine(const std::string& text) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      {
        absl::MutexLock lock(&mu_);
        for (const std::string& line : lines_) {
          if (line.find(text) != std::string::npos) return true;
        }
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> lines_;
};

TEST(WorkerDaemonTest, AnAssignmentThatCannotRunIsReportedAsTheJobsError) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartFakeCoordinator(&fake, &port);
  ASSERT_NE(server, nullptr);
  {
    absl::MutexLock lock(&fake.mu);
    fake.assignment = IdxAssignment("job-3", "job-3.1.00ab", "/nonexistent/dataset/dir");
  }
  auto daemon = WorkerDaemon::Create(TestOptions(port));
  ASSERT_OK(daemon);
  std::thread run([&] { EXPECT_OK((*daemon)->Run()); });
  ASSERT_TRUE(WaitFor(fake, [&] { return !fake.reports.empty(); }));
  size_t heartbeats_at_report = 0;
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_EQ(fake.reports[0].job_id(), "job-3");
    EXPECT_EQ(fake.reports[0].run_id(), "job-3.1.00ab");
    EXPECT_EQ(fake.reports[0].worker_id(), "worker-1");
    EXPECT_THAT(fake.reports[0].error(), HasSubstr("test-host"));
    EXPECT_FALSE(fake.reports[0].finished());
    heartbeats_at_report = fake.heartbeats.size();
  }
  // The failed run is not started again although the fake keeps assigning
  // it, spec included: five more heartbeats handled, still one report, and
  // the worker idle.
  ASSERT_TRUE(WaitFor(fake, [&] { return fake.heartbeats.size() >= heartbeats_at_report + 5; }));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_EQ(fake.reports.size(), 1u);
    EXPECT_EQ(fake.heartbeats.back(), "worker-1/");
  }
  // A new run of the same job (resumed after a restart) is run.
  {
    absl::MutexLock lock(&fake.mu);
    fake.assignment.set_run_id("job-3.2.00ab");
  }
  ASSERT_TRUE(WaitFor(fake, [&] { return fake.reports.size() == 2; }));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_EQ(fake.reports[1].run_id(), "job-3.2.00ab");
    EXPECT_THAT(fake.reports[1].error(), HasSubstr("test-host"));
  }
  (*daemon)->Shutdown();
  run.join();
}

// A run that waits for its parameter servers (nobody listens): its
// heartbeats carry its run, so the coordinator sends no spec; a new
// generation reaches the run, and a coordinator that no longer assigns the
// job stops it.
TEST(WorkerDaemonTest, ARunFollowsItsGenerationsAndStopsWhenTheCoordinatorSaysSo) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartFakeCoordinator(&fake, &port);
  ASSERT_NE(server, nullptr);
  {
    absl::MutexLock lock(&fake.mu);
    fake.assignment = ::pstrain::testing::SyntheticAssignment("job-5", "job-5.1.00ab");
  }
  LogLines log;
  WorkerDaemon::Options options = TestOptions(port);
  options.log = log.Sink();
  options.ps_rpc_timeout = absl::Seconds(120);  // The run waits for its shards until stopped.
  auto daemon = WorkerDaemon::Create(options);
  ASSERT_OK(daemon);
  std::thread run([&] { EXPECT_OK((*daemon)->Run()); });
  ASSERT_TRUE(WaitFor(fake, [&] {
    return !fake.heartbeats.empty() && fake.heartbeats.back() == "worker-1/job-5";
  }));
  EXPECT_EQ((*daemon)->current_job(), "job-5");
  {
    absl::MutexLock lock(&fake.mu);
    fake.assignment.set_generation(2);
    fake.assignment.set_rank(1);
    fake.assignment.set_world_size(2);
  }
  EXPECT_TRUE(log.WaitForLine("job-5: generation 2, rank 1 of 2 (was 0 of 1)"));
  {
    absl::MutexLock lock(&fake.mu);
    fake.assignment.Clear();
  }
  EXPECT_TRUE(log.WaitForLine("job-5: stopping (the coordinator asked to stop)"));
  EXPECT_TRUE(log.WaitForLine("job-5: stopped"));
  EXPECT_EQ((*daemon)->current_job(), "");
  (*daemon)->Shutdown();
  run.join();
  absl::MutexLock lock(&fake.mu);
  EXPECT_TRUE(fake.reports.empty());  // A stopped run reports nothing.
}

// Regression (issue 8): a job could make workers read any path on their
// hosts through dataset.path, and the failure reason echoed the path.
TEST(WorkerDaemonTest, ADatasetOutsideTheDataRootsFailsTheJobWithTheRule) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartFakeCoordinator(&fake, &port);
  ASSERT_NE(server, nullptr);
  {
    absl::MutexLock lock(&fake.mu);
    fake.assignment = IdxAssignment("job-4", "job-4.1.00ab", "/etc/../etc/ssl");
  }
  WorkerDaemon::Options options = TestOptions(port);
  options.data_roots = {::testing::TempDir()};
  auto daemon = WorkerDaemon::Create(options);
  ASSERT_OK(daemon);
  std::thread run([&] { EXPECT_OK((*daemon)->Run()); });
  ASSERT_TRUE(WaitFor(fake, [&] { return !fake.reports.empty(); }));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_THAT(fake.reports[0].error(), HasSubstr("outside the worker's --data-root allow-list"));
    EXPECT_THAT(fake.reports[0].error(), ::testing::Not(HasSubstr("/etc")));
  }
  (*daemon)->Shutdown();
  run.join();
}

// `pstrain-worker --job`, a Spark barrier task: registers bound to its job,
// and Run() returns once the job is over, or with a refusal at once.
TEST(WorkerDaemonTest, ABoundDaemonWorksForItsJobAndReturnsOnceItEnded) {
  FakeCoordinator fake;
  int port = 0;
  auto server = StartFakeCoordinator(&fake, &port);
  ASSERT_NE(server, nullptr);
  WorkerDaemon::Options options = TestOptions(port);
  options.job_id = "job-7";
  auto daemon = WorkerDaemon::Create(options);
  ASSERT_OK(daemon);
  absl::Notification returned;
  absl::Status status;
  std::thread run([&] {
    status = (*daemon)->Run();
    returned.Notify();
  });
  ASSERT_TRUE(WaitFor(fake, [&] { return fake.heartbeats.size() >= 3; }));
  {
    absl::MutexLock lock(&fake.mu);
    EXPECT_EQ(fake.infos[0].job_id(), "job-7");
  }
  EXPECT_FALSE(returned.HasBeenNotified());  // Idle: the job has not started.
  {
    absl::MutexLock lock(&fake.mu);
    fake.stop_idle = true;  // The job ended.
  }
  ASSERT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_OK(status);
  run.join();

  FakeCoordinator refusing;
  refusing.refuse_registration =
      grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "job-7 has ended (JOB_STATE_CANCELLED)");
  int refusing_port = 0;
  auto refusing_server = StartFakeCoordinator(&refusing, &refusing_port);
  ASSERT_NE(refusing_server, nullptr);
  auto refused = WorkerDaemon::Create([&] {
    WorkerDaemon::Options o = TestOptions(refusing_port);
    o.job_id = "job-7";
    return o;
  }());
  ASSERT_OK(refused);
  EXPECT_THAT((*refused)->Run(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("has ended")));
}

TEST(WorkerDaemonTest, CreateRejectsBadOptions) {
  WorkerDaemon::Options options = TestOptions(1);
  options.device = "tpu";
  EXPECT_FALSE(WorkerDaemon::Create(options).ok());
  options = TestOptions(1);
  options.coordinator_address.clear();
  EXPECT_TRUE(absl::IsInvalidArgument(WorkerDaemon::Create(options).status()));
  options = TestOptions(1);
  options.job_id = "job-1";
  options.command_roots = {"/tmp"};
  EXPECT_THAT(WorkerDaemon::Create(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--job")));
}

}  // namespace
}  // namespace pstrain
