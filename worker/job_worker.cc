#include "worker/job_worker.h"

#include <algorithm>
#include <cstring>
#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/chunking.h"
#include "common/job_spec.h"
#include "common/model_graph.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

bool Unreachable(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
}

}  // namespace

JobWorker::JobWorker(Options options)
    : options_(std::move(options)),
      stub_(
          v1::Coordinator::NewStub(CreateChannel(options_.coordinator_address, options_.channel))) {
}

JobWorker::~JobWorker() { Shutdown(); }

void JobWorker::Log(const std::string& line) const {
  const std::string text = absl::StrCat(options_.job_id, ": ", line);
  if (options_.log) {
    options_.log(text);
  } else {
    std::cerr << "pstrain: " << text << std::endl;
  }
}

absl::StatusOr<std::unique_ptr<JobWorker>> JobWorker::Create(Options options) {
  if (options.job_id.empty()) return absl::InvalidArgumentError("JobWorker needs a job id");
  if (options.coordinator_address.empty()) {
    return absl::InvalidArgumentError("JobWorker needs the coordinator's address");
  }
  options.info.set_job_id(options.job_id);
  std::unique_ptr<JobWorker> worker(new JobWorker(std::move(options)));
  PSTRAIN_RETURN_IF_ERROR(worker->Register(""));
  worker->heartbeats_ = std::thread([w = worker.get()] { w->HeartbeatLoop(); });
  return worker;
}

absl::Status JobWorker::Register(const std::string& previous_id) {
  v1::RegisterWorkerRequest request;
  *request.mutable_info() = options_.info;
  request.set_previous_worker_id(previous_id);
  v1::RegisterWorkerResponse response;
  if (absl::Status status = CallWithRetries(
          [&](grpc::ClientContext* ctx) { return stub_->RegisterWorker(ctx, request, &response); });
      !status.ok()) {
    return absl::Status(status.code(), absl::StrCat("cannot register with the coordinator at ",
                                                    options_.coordinator_address, " for ",
                                                    options_.job_id, ": ", status.message()));
  }
  // From now on every call carries the credential of this registration.
  if (options_.identity != nullptr) {
    options_.identity->set_worker_credential(response.worker_credential());
  }
  absl::MutexLock lock(&mu_);
  worker_id_ = response.worker_id();
  shards_.assign(response.shards().begin(), response.shards().end());
  if (shards_.empty()) shards_.push_back(options_.coordinator_address);
  if (response.heartbeat_interval_ms() > 0) {
    heartbeat_interval_ = absl::Milliseconds(response.heartbeat_interval_ms());
  }
  Log(absl::StrCat(previous_id.empty() ? "registered as " : "registered again as ", worker_id_,
                   "; ", shards_.size(), " parameter shard(s)"));
  return absl::OkStatus();
}

absl::StatusOr<bool> JobWorker::DeclareModel(const v1::ExternalModel& model,
                                             std::function<absl::Span<const float>(int)> values) {
  {
    absl::MutexLock lock(&mu_);
    declared_ = model;
    values_ = std::move(values);
  }
  return SendDeclaration();
}

absl::StatusOr<bool> JobWorker::SendDeclaration() {
  v1::DeclareModelRequest request;
  {
    absl::MutexLock lock(&mu_);
    request.set_worker_id(worker_id_);
    request.set_job_id(options_.job_id);
    *request.mutable_model() = declared_;
    for (int i = 0; i < declared_.tensors_size(); ++i) {
      const absl::Span<const float> v = values_(i);
      request.add_values()->assign(reinterpret_cast<const char*>(v.data()),
                                   v.size() * sizeof(float));
    }
  }
  v1::DeclareModelResponse response;
  PSTRAIN_RETURN_IF_ERROR(CallWithRetries(
      [&](grpc::ClientContext* ctx) { return stub_->DeclareModel(ctx, request, &response); }));
  return response.declared();
}

absl::Status JobWorker::CallWithRetries(
    const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  // Idempotent calls: a coordinator that is briefly unreachable (a
  // restart, a loaded machine's slow handshake) is tried again with
  // backoff within connect_timeout.
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  absl::Duration backoff = absl::Milliseconds(100);
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
    absl::Status status = ToAbslStatus(call(&ctx));
    if (status.ok() || !Unreachable(status) || stopped() || absl::Now() + backoff > deadline) {
      return status;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
}

absl::StatusOr<v1::Assignment> JobWorker::AwaitStart(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (assignment_.run_id().empty() && !stopped() && absl::Now() < deadline) {
    changed_.WaitWithDeadline(&mu_, deadline);
  }
  if (!assignment_.run_id().empty()) return assignment_;
  if (stopped()) return absl::CancelledError(absl::StrCat("stopped: ", stop_reason_));
  return absl::DeadlineExceededError(absl::StrCat(
      options_.job_id, " did not start within ", absl::FormatDuration(timeout),
      " (are its other workers running? `pstrain status ", options_.job_id, "` says why)"));
}

absl::StatusOr<std::shared_ptr<PsClient>> JobWorker::ConnectShards() {
  PsClient::Options client_options;
  v1::JobSpec spec;
  {
    absl::MutexLock lock(&mu_);
    if (assignment_.run_id().empty()) {
      return absl::FailedPreconditionError("the job has not started (AwaitStart)");
    }
    spec = assignment_.spec();
    client_options.shard_addresses = shards_;
    client_options.worker_id = worker_id_;
    client_options.generation = assignment_.generation();
  }
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, BuildJobGraph(spec));
  PSTRAIN_ASSIGN_OR_RETURN(
      ChunkPlan plan, PlanChunks(graph, static_cast<int>(client_options.shard_addresses.size())));
  client_options.job_id = options_.job_id;
  client_options.rpc_timeout = options_.ps_rpc_timeout;
  client_options.channel = options_.channel;
  client_options.compression = spec.compression();
  client_options.pace_pushes = ConsistencyModeOf(spec) == v1::CONSISTENCY_SYNC;
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<PsClient> made,
                           PsClient::Create(client_options, std::move(plan)));
  std::shared_ptr<PsClient> client = std::move(made);
  absl::MutexLock lock(&mu_);
  client_ = client;
  if (stopped()) client->CancelAll();
  return client;
}

absl::Status JobWorker::FillRun(std::string* run_id) const {
  absl::MutexLock lock(&mu_);
  if (run_id->empty()) {
    *run_id = assignment_.run_id();
  } else if (*run_id != assignment_.run_id()) {
    return absl::AbortedError(absl::StrCat("run ", *run_id, " of ", options_.job_id,
                                           " was replaced by run ", assignment_.run_id()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::EpochPlanResponse> JobWorker::EpochPlan(v1::EpochPlanRequest request) {
  PSTRAIN_RETURN_IF_ERROR(FillRun(request.mutable_run_id()));
  {
    absl::MutexLock lock(&mu_);
    request.set_worker_id(worker_id_);
    request.set_job_id(options_.job_id);
  }
  const absl::Time deadline = absl::Now() + options_.ps_rpc_timeout;
  for (;;) {
    if (stopped()) return absl::CancelledError(absl::StrCat("stopped: ", stop_reason()));
    v1::EpochPlanResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
    absl::Status status = ToAbslStatus(stub_->EpochPlan(&ctx, request, &response));
    if (status.ok() && !response.wait()) return response;
    if (!status.ok() && !Unreachable(status)) return status;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no epoch plan within ", absl::FormatDuration(options_.ps_rpc_timeout),
          status.ok() ? " (the coordinator kept redistributing a lost worker's samples)"
                      : absl::StrCat(": ", status.message())));
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

absl::StatusOr<bool> JobWorker::ReportProgress(v1::ReportProgressRequest request) {
  PSTRAIN_RETURN_IF_ERROR(FillRun(request.mutable_run_id()));
  {
    absl::MutexLock lock(&mu_);
    request.set_worker_id(worker_id_);
    request.set_job_id(options_.job_id);
    request.set_generation(assignment_.generation());
  }
  v1::ReportProgressResponse response;
  PSTRAIN_RETURN_IF_ERROR(CallWithRetries(
      [&](grpc::ClientContext* ctx) { return stub_->ReportProgress(ctx, request, &response); }));
  // Not a stop by itself: a run replaced by a resume hears the same answer.
  // The heartbeats bring the stop (a job that ended) or the new run.
  return response.stop();
}

int64_t JobWorker::run_number() const {
  absl::MutexLock lock(&mu_);
  return run_number_;
}

bool JobWorker::AwaitNewRun(int64_t from, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (run_number_ <= from && !stopped() && absl::Now() < deadline) {
    changed_.WaitWithDeadline(&mu_, deadline);
  }
  return run_number_ > from;
}

void JobWorker::HeartbeatLoop() {
  for (;;) {
    absl::Duration interval;
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return;
      interval = heartbeat_interval_;
    }
    if (!Beat()) return;
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&shutdown_), interval);
  }
}

bool JobWorker::Beat() {
  v1::HeartbeatRequest request;
  {
    absl::MutexLock lock(&mu_);
    request.set_worker_id(worker_id_);
    if (in_run_) {
      request.set_job_id(options_.job_id);
      request.set_run_id(assignment_.run_id());
      request.set_run_steps(run_steps_.load());
    }
  }
  v1::HeartbeatResponse response;
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineFromNow(options_.rpc_timeout));
  absl::Status status = ToAbslStatus(stub_->Heartbeat(&ctx, request, &response));
  if (!status.ok()) return true;  // Tried again next interval; the shard calls have deadlines.
  switch (response.action()) {
    case v1::HeartbeatResponse::ACTION_RUN: {
      const v1::Assignment& a = response.assignment();
      std::shared_ptr<PsClient> old_run_client;
      {
        absl::MutexLock lock(&mu_);
        const bool first = run_number_ == 0;
        const bool new_run = !first && a.run_id() != assignment_.run_id();
        v1::JobSpec spec = (first || new_run) && a.has_spec() ? a.spec() : assignment_.spec();
        assignment_ = a;
        *assignment_.mutable_spec() = std::move(spec);
        in_run_ = true;
        if (first || new_run) ++run_number_;
        if (new_run) {
          // The job resumed from its checkpoint: the old run's shard calls
          // end, and the training loop rewinds to this run's start.
          old_run_client = client_.lock();
          client_.reset();
          Log(absl::StrCat("the job resumed as run ", a.run_id(), " from epoch ",
                           a.start_epoch() + 1, " (step ", a.start_step(), "): rank ", a.rank(),
                           " of ", a.world_size()));
        } else if (std::shared_ptr<PsClient> client = client_.lock()) {
          client->SetGeneration(assignment_.generation());
        }
        if (first) {
          Log(absl::StrCat("started: rank ", a.rank(), " of ", a.world_size(), " (run ", a.run_id(),
                           ")"));
        }
        changed_.SignalAll();
      }
      if (old_run_client != nullptr) old_run_client->CancelAll();
      return true;
    }
    case v1::HeartbeatResponse::ACTION_STOP:
      Stop(
          "the coordinator said stop (the job was cancelled or failed, or this worker was "
          "dropped from it)");
      return false;
    case v1::HeartbeatResponse::ACTION_REREGISTER: {
      // The coordinator restarted: the run this worker was in is over. Its
      // shard calls end before this worker can be a member of a new run
      // (whose shards would otherwise take the old run's pushes).
      std::shared_ptr<PsClient> old_run_client;
      {
        absl::MutexLock lock(&mu_);
        in_run_ = false;
        old_run_client = client_.lock();
        client_.reset();
      }
      if (old_run_client != nullptr) old_run_client->CancelAll();
      if (absl::Status s = Register(worker_id()); !s.ok()) {
        Stop(std::string(s.message()));
        return false;
      }
      bool declared;
      {
        absl::MutexLock lock(&mu_);
        declared = declared_.tensors_size() > 0;
      }
      if (declared) {
        absl::StatusOr<bool> again = SendDeclaration();
        if (!again.ok()) Log(absl::StrCat("declaring the model again: ", again.status().message()));
      }
      return true;
    }
    default:
      return true;
  }
}

void JobWorker::Stop(const std::string& why) {
  std::shared_ptr<PsClient> client;
  {
    absl::MutexLock lock(&mu_);
    if (stopped()) return;
    stop_reason_ = why;
    stopped_.store(true);
    client = client_.lock();
    changed_.SignalAll();
  }
  Log(absl::StrCat("stopped: ", why));
  if (client != nullptr) client->CancelAll();
}

void JobWorker::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  if (!stopped()) {
    std::shared_ptr<PsClient> client;
    {
      absl::MutexLock lock(&mu_);
      if (stop_reason_.empty()) stop_reason_ = "shut down";
      stopped_.store(true);
      client = client_.lock();
      changed_.SignalAll();
    }
    if (client != nullptr) client->CancelAll();
  }
  if (heartbeats_.joinable() && heartbeats_.get_id() != std::this_thread::get_id()) {
    heartbeats_.join();
  }
}

std::string JobWorker::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

v1::Assignment JobWorker::assignment() const {
  absl::MutexLock lock(&mu_);
  return assignment_;
}

std::string JobWorker::stop_reason() const {
  absl::MutexLock lock(&mu_);
  return stop_reason_;
}

}  // namespace pstrain
