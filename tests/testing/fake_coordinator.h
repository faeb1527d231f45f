// FakeCoordinator: the worker-facing side of the Coordinator service
// (RegisterWorker, Heartbeat, ReportProgress, EpochPlan) for one assignment,
// in memory, speaking the protocol as server/coordinator.cc does:
//   - Heartbeat answers ACTION_RUN with `assignment` (its run id included),
//     and sends the spec only to a worker that does not run that run yet
//     (HeartbeatRequest.run_id differs); ACTION_STOP to a worker that runs
//     a job it is not assigned, ACTION_IDLE without an assignment;
//   - EpochPlan refuses an unknown worker or job (NOT_FOUND), a run that is
//     not the current one (ABORTED) and a batch size that is not the job's
//     (INVALID_ARGUMENT); it answers `wait` while `plan_waits` > 0, else the
//     assignment's rank and world size with data::BaseSteps, and, once the
//     share is done, the scripted `tails`;
//   - ReportProgress records the report and answers `stop` when asked to.
// Knobs for the tests: reregister_next, hang_heartbeats (with release).
//
//   FakeCoordinator fake;
//   int port = 0;
//   std::unique_ptr<grpc::Server> server = StartFakeCoordinator(&fake, &port);
//   { absl::MutexLock lock(&fake.mu); fake.assignment = ...; }
//
// Threads: the gRPC threads call the service; tests read and set the public
// state under `mu` (WaitFor below).
#ifndef PSTRAIN_TESTS_TESTING_FAKE_COORDINATOR_H_
#define PSTRAIN_TESTS_TESTING_FAKE_COORDINATOR_H_

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/data/epoch_work.h"
#include "pstrain/v1/service.grpc.pb.h"

namespace pstrain::testing {

class FakeCoordinator final : public v1::Coordinator::Service {
 public:
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override {
    absl::MutexLock lock(&mu);
    infos.push_back(request->info());
    if (!refuse_registration.ok()) return refuse_registration;
    response->set_worker_id("worker-" + std::to_string(infos.size()));
    workers.insert(response->worker_id());
    response->set_heartbeat_interval_ms(50);
    for (const std::string& shard : shards) response->add_shards(shard);
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override {
    {
      absl::MutexLock lock(&mu);
      heartbeats.push_back(request->worker_id() + "/" + request->job_id());
      if (hang_heartbeats) hanging = true;
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
    // A worker that runs a job it is no longer assigned is told to stop.
    if (!request->job_id().empty() && request->job_id() != assignment.job_id()) {
      response->set_action(v1::HeartbeatResponse::ACTION_STOP);
      return grpc::Status::OK;
    }
    if (assignment.job_id().empty()) {
      response->set_action(stop_idle ? v1::HeartbeatResponse::ACTION_STOP
                                     : v1::HeartbeatResponse::ACTION_IDLE);
      return grpc::Status::OK;
    }
    response->set_action(v1::HeartbeatResponse::ACTION_RUN);
    *response->mutable_assignment() = assignment;
    // The spec only to a worker that does not run this run yet.
    if (request->run_id() == assignment.run_id()) response->mutable_assignment()->clear_spec();
    return grpc::Status::OK;
  }

  grpc::Status ReportProgress(grpc::ServerContext*, const v1::ReportProgressRequest* request,
                              v1::ReportProgressResponse* response) override {
    absl::MutexLock lock(&mu);
    reports.push_back(*request);
    response->set_stop(stop_reports);
    return grpc::Status::OK;
  }

  grpc::Status EpochPlan(grpc::ServerContext*, const v1::EpochPlanRequest* request,
                         v1::EpochPlanResponse* response) override {
    absl::MutexLock lock(&mu);
    plan_requests.push_back(*request);
    if (workers.count(request->worker_id()) == 0) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown worker; register again");
    }
    if (request->job_id() != assignment.job_id()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown job");
    }
    if (request->run_id() != assignment.run_id()) {
      return grpc::Status(grpc::StatusCode::ABORTED, "not the job's current run");
    }
    if (request->batch_size() != assignment.spec().batch_size()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "not the job's batch size");
    }
    if (plan_waits > 0) {
      --plan_waits;
      response->set_wait(true);
      return grpc::Status::OK;
    }
    const int world_size = std::max(1, assignment.world_size());
    response->set_rank(assignment.rank());
    response->set_world_size(world_size);
    response->set_base_steps(
        data::BaseSteps(request->epoch_length(), world_size, request->batch_size()));
    if (request->share_done()) {
      for (const v1::WorkSegment& tail : tails) *response->add_tails() = tail;
    }
    return grpc::Status::OK;
  }

  absl::Mutex mu;  // Guards every member below but the last two.
  // Given to every worker that registers (nobody listens on port 1).
  std::vector<std::string> shards = {"127.0.0.1:1"};
  std::vector<v1::WorkerInfo> infos;
  std::set<std::string> workers;        // Ids given out (a test may add its own).
  std::vector<std::string> heartbeats;  // "<worker id>/<job id>"
  std::vector<v1::ReportProgressRequest> reports;
  std::vector<v1::EpochPlanRequest> plan_requests;
  v1::Assignment assignment;           // No job id: ACTION_IDLE.
  int plan_waits = 0;                  // EpochPlan answers `wait` this often.
  std::vector<v1::WorkSegment> tails;  // Handed out after the share.
  bool stop_reports = false;           // ReportProgress answers `stop`.
  bool reregister_next = false;
  bool stop_idle = false;  // An idle worker is told to stop (its bound job ended).
  grpc::Status refuse_registration = grpc::Status::OK;  // RegisterWorker's answer when set.
  bool hang_heartbeats = false;
  std::atomic<bool> hanging{false};
  absl::Notification release;
};

// An assignment a worker can train: run `run_id` of `job_id`, rank 0 of 1,
// generation 1, a dense classifier on synthetic data (4 values per sample,
// 2 classes, 32 training and 8 test samples, batch 8, 1 epoch, sync).
inline v1::Assignment SyntheticAssignment(const std::string& job_id, const std::string& run_id) {
  v1::Assignment a;
  a.set_job_id(job_id);
  a.set_run_id(run_id);
  a.set_rank(0);
  a.set_world_size(1);
  a.set_generation(1);
  v1::JobSpec* job = a.mutable_spec();
  job->set_name(job_id);
  v1::ModelSpec* model = job->mutable_model();
  model->set_name("dense");
  model->add_input_shape(4);
  model->set_num_classes(2);
  model->set_init_seed(7);
  v1::LayerSpec* fc = model->add_layers();
  fc->set_name("fc");
  fc->mutable_dense()->set_units(2);
  v1::LayerSpec* loss = model->add_layers();
  loss->set_name("loss");
  loss->mutable_softmax_cross_entropy();
  v1::DatasetSpec* dataset = job->mutable_dataset();
  dataset->set_format(v1::DATASET_FORMAT_SYNTHETIC);
  v1::SyntheticSpec* synthetic = dataset->mutable_synthetic();
  synthetic->set_channels(1);
  synthetic->set_height(2);
  synthetic->set_width(2);
  synthetic->set_num_classes(2);
  synthetic->set_train_samples(32);
  synthetic->set_test_samples(8);
  job->mutable_optimizer()->set_type(v1::OPTIMIZER_SGD);
  job->mutable_optimizer()->set_learning_rate(0.1f);
  job->set_epochs(1);
  job->set_batch_size(8);
  job->set_mode(v1::CONSISTENCY_SYNC);
  return a;
}

// Serves `service` on 127.0.0.1:*port (0: a free port, written back).
inline std::unique_ptr<grpc::Server> StartFakeCoordinator(FakeCoordinator* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(*port), grpc::InsecureServerCredentials(),
                           port);
  builder.RegisterService(service);
  return builder.BuildAndStart();
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

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TESTING_FAKE_COORDINATOR_H_
