#include "server/coordinator_service.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/job_state.h"
#include "common/rpc/channel.h"

namespace pstrain {
namespace {

// Longest a streaming handler waits before it looks at its call again.
constexpr absl::Duration kStreamPoll = absl::Seconds(1);
// WatchJob repeats the latest status this often when nothing changes, so
// that a watcher can tell a quiet job from a lost connection.
constexpr absl::Duration kWatchKeepalive = absl::Seconds(10);

grpc::Status Invalid(const std::string& message) {
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, message);
}

grpc::Status Cancelled() {
  return grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled");
}

}  // namespace

grpc::Status CoordinatorService::Admit(const grpc::ServerContext& context, Role role,
                                       const char* method,
                                       const google::protobuf::Message& request) const {
  if (grpc::Status s = authorizer_->Check(context, role, method); !s.ok()) return s;
  return CheckMessageSize(request, options_.max_message_bytes, "Coordinator",
                          "--max-coordinator-message-bytes");
}

grpc::Status CoordinatorService::SubmitJob(grpc::ServerContext* context,
                                           const v1::SubmitJobRequest* request,
                                           v1::SubmitJobResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kAdmin, "SubmitJob", *request); !s.ok()) return s;
  if (!request->has_spec()) return Invalid("SubmitJob needs a spec");
  absl::StatusOr<std::string> id = coordinator_->SubmitJob(request->spec());
  if (!id.ok()) return ToGrpcStatus(id.status());
  response->set_job_id(*id);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::GetJob(grpc::ServerContext* context,
                                        const v1::GetJobRequest* request, v1::JobStatus* response) {
  if (grpc::Status s = Admit(*context, Role::kAdmin, "GetJob", *request); !s.ok()) return s;
  if (request->job_id().empty()) return Invalid("GetJob needs a job_id");
  absl::StatusOr<v1::JobStatus> status = coordinator_->GetJob(request->job_id());
  if (!status.ok()) return ToGrpcStatus(status.status());
  *response = *std::move(status);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::GetJobHistory(grpc::ServerContext* context,
                                               const v1::GetJobRequest* request,
                                               v1::JobHistory* response) {
  if (grpc::Status s = Admit(*context, Role::kAdmin, "GetJobHistory", *request); !s.ok()) {
    return s;
  }
  if (request->job_id().empty()) return Invalid("GetJobHistory needs a job_id");
  absl::StatusOr<v1::JobHistory> history = coordinator_->GetJobHistory(request->job_id());
  if (!history.ok()) return ToGrpcStatus(history.status());
  *response = *std::move(history);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListJobs(grpc::ServerContext* context,
                                          const v1::ListJobsRequest* request,
                                          v1::ListJobsResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kAdmin, "ListJobs", *request); !s.ok()) return s;
  for (v1::JobStatus& s : coordinator_->ListJobs()) *response->add_jobs() = std::move(s);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::CancelJob(grpc::ServerContext* context,
                                           const v1::CancelJobRequest* request,
                                           v1::CancelJobResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kAdmin, "CancelJob", *request); !s.ok()) return s;
  if (request->job_id().empty()) return Invalid("CancelJob needs a job_id");
  absl::StatusOr<v1::JobStatus> status =
      coordinator_->CancelJob(request->job_id(), request->reason());
  if (!status.ok()) return ToGrpcStatus(status.status());
  *response->mutable_status() = *std::move(status);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::WatchJob(grpc::ServerContext* context,
                                          const v1::WatchJobRequest* request,
                                          grpc::ServerWriter<v1::JobStatus>* writer) {
  if (grpc::Status s = Admit(*context, Role::kAdmin, "WatchJob", *request); !s.ok()) return s;
  if (request->job_id().empty()) return Invalid("WatchJob needs a job_id");
  if (request->min_interval_ms() < 0) return Invalid("min_interval_ms must be >= 0");
  const absl::Duration interval =
      absl::Milliseconds(request->min_interval_ms() == 0 ? 500 : request->min_interval_ms());

  // The current status first.
  absl::StatusOr<JobUpdate> first =
      coordinator_->WaitForJobUpdate(request->job_id(), -1, absl::InfinitePast());
  if (!first.ok()) return ToGrpcStatus(first.status());
  if (!writer->Write(first->status)) return Cancelled();
  if (IsTerminal(first->status.state())) return grpc::Status::OK;

  int64_t seen_revision = first->revision;
  v1::JobState sent_state = first->status.state();
  absl::Time last_send = absl::Now();
  bool pending = false;  // A change newer than the last status sent.
  v1::JobStatus latest;
  while (true) {
    if (context->IsCancelled()) return Cancelled();
    const absl::Time now = absl::Now();
    absl::Time deadline = now + kStreamPoll;
    if (pending) deadline = std::min(deadline, last_send + interval);
    absl::StatusOr<JobUpdate> update =
        coordinator_->WaitForJobUpdate(request->job_id(), seen_revision, deadline);
    if (!update.ok()) return ToGrpcStatus(update.status());
    if (update->revision > seen_revision) {
      seen_revision = update->revision;
      latest = std::move(update->status);
      pending = true;
    }
    if (!pending && absl::Now() - last_send >= kWatchKeepalive) {
      absl::StatusOr<v1::JobStatus> current = coordinator_->GetJob(request->job_id());
      if (!current.ok()) return ToGrpcStatus(current.status());
      latest = *std::move(current);
      pending = true;
    }
    if (!pending) continue;
    const bool state_changed = latest.state() != sent_state;
    if (!state_changed && absl::Now() < last_send + interval) continue;
    if (!writer->Write(latest)) return Cancelled();
    last_send = absl::Now();
    sent_state = latest.state();
    pending = false;
    if (IsTerminal(sent_state)) return grpc::Status::OK;
  }
}

grpc::Status CoordinatorService::DownloadModel(grpc::ServerContext* context,
                                               const v1::DownloadModelRequest* request,
                                               grpc::ServerWriter<v1::ModelChunk>* writer) {
  if (grpc::Status s = Admit(*context, Role::kAdmin, "DownloadModel", *request); !s.ok()) return s;
  if (request->job_id().empty()) return Invalid("DownloadModel needs a job_id");
  absl::StatusOr<std::string> path = coordinator_->CheckpointPath(request->job_id());
  if (!path.ok()) return ToGrpcStatus(path.status());
  // An open file keeps its bytes even if a newer checkpoint is renamed over it.
  std::ifstream in(*path, std::ios::binary);
  if (!in) {
    return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat("cannot open ", *path));
  }
  in.seekg(0, std::ios::end);
  const int64_t total = static_cast<int64_t>(in.tellg());
  in.seekg(0, std::ios::beg);
  std::string buffer;
  int64_t offset = 0;
  do {
    if (context->IsCancelled()) return Cancelled();
    const int64_t n = std::min(kModelChunkBytes, total - offset);
    buffer.resize(static_cast<size_t>(n));
    if (n > 0 && !in.read(buffer.data(), n)) {
      return grpc::Status(grpc::StatusCode::INTERNAL,
                          absl::StrCat("cannot read ", *path, " at byte ", offset));
    }
    v1::ModelChunk chunk;
    chunk.set_data(buffer);
    chunk.set_offset(offset);
    chunk.set_total_bytes(total);
    if (!writer->Write(chunk)) return Cancelled();
    offset += n;
  } while (offset < total);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RegisterWorker(grpc::ServerContext* context,
                                                const v1::RegisterWorkerRequest* request,
                                                v1::RegisterWorkerResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kWorker, "RegisterWorker", *request); !s.ok())
    return s;
  // A previous id is given back only to a caller that holds its credential.
  std::string previous;
  if (!request->previous_worker_id().empty() &&
      authorizer_->CheckWorkerCredential(*context, request->previous_worker_id()).ok()) {
    previous = request->previous_worker_id();
  }
  absl::StatusOr<v1::RegisterWorkerResponse> r =
      coordinator_->RegisterWorker(request->info(), previous);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = *std::move(r);
  response->set_worker_credential(authorizer_->IssueWorkerCredential(response->worker_id()));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* context,
                                           const v1::HeartbeatRequest* request,
                                           v1::HeartbeatResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kWorker, "Heartbeat", *request); !s.ok()) return s;
  if (request->worker_id().empty()) return Invalid("Heartbeat needs a worker_id");
  if (grpc::Status s = authorizer_->CheckWorkerCredential(*context, request->worker_id());
      !s.ok()) {
    // A genuine credential from another state directory: this server never
    // registered the caller, whatever its id says. It registers again.
    if (s.error_code() != grpc::StatusCode::FAILED_PRECONDITION) return s;
    response->set_action(v1::HeartbeatResponse::ACTION_REREGISTER);
    return grpc::Status::OK;
  }
  absl::StatusOr<v1::HeartbeatResponse> r = coordinator_->Heartbeat(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ReportProgress(grpc::ServerContext* context,
                                                const v1::ReportProgressRequest* request,
                                                v1::ReportProgressResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kWorker, "ReportProgress", *request); !s.ok())
    return s;
  if (request->worker_id().empty() || request->job_id().empty()) {
    return Invalid("ReportProgress needs a worker_id and a job_id");
  }
  if (grpc::Status s = authorizer_->CheckWorkerCredential(*context, request->worker_id());
      !s.ok()) {
    return s;
  }
  absl::StatusOr<bool> stop = coordinator_->ReportProgress(*request);
  if (!stop.ok()) return ToGrpcStatus(stop.status());
  response->set_stop(*stop);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::EpochPlan(grpc::ServerContext* context,
                                           const v1::EpochPlanRequest* request,
                                           v1::EpochPlanResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kWorker, "EpochPlan", *request); !s.ok()) return s;
  if (request->worker_id().empty() || request->job_id().empty()) {
    return Invalid("EpochPlan needs a worker_id and a job_id");
  }
  if (grpc::Status s = authorizer_->CheckWorkerCredential(*context, request->worker_id());
      !s.ok()) {
    return s;
  }
  absl::StatusOr<v1::EpochPlanResponse> r = coordinator_->EpochPlan(*request);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *response = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::DeclareModel(grpc::ServerContext* context,
                                              const v1::DeclareModelRequest* request,
                                              v1::DeclareModelResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kWorker, "DeclareModel", *request); !s.ok()) {
    return s;
  }
  if (request->worker_id().empty() || request->job_id().empty()) {
    return Invalid("DeclareModel needs a worker_id and a job_id");
  }
  if (grpc::Status s = authorizer_->CheckWorkerCredential(*context, request->worker_id());
      !s.ok()) {
    return s;
  }
  // Raw little-endian fp32, one entry per tensor; the coordinator checks the
  // counts against the tensors' shapes.
  std::vector<std::vector<float>> values(request->values_size());
  for (int i = 0; i < request->values_size(); ++i) {
    const std::string& bytes = request->values(i);
    if (bytes.size() % sizeof(float) != 0) {
      return Invalid(absl::StrCat("DeclareModel: values[", i, "] has ", bytes.size(),
                                  " bytes, not a whole number of fp32 values"));
    }
    values[i].resize(bytes.size() / sizeof(float));
    if (!bytes.empty()) std::memcpy(values[i].data(), bytes.data(), bytes.size());
  }
  absl::StatusOr<bool> declared = coordinator_->DeclareModel(
      request->worker_id(), request->job_id(), request->model(), std::move(values));
  if (!declared.ok()) return ToGrpcStatus(declared.status());
  response->set_declared(*declared);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListWorkers(grpc::ServerContext* context,
                                             const v1::ListWorkersRequest* request,
                                             v1::ListWorkersResponse* response) {
  if (grpc::Status s = Admit(*context, Role::kAdmin, "ListWorkers", *request); !s.ok()) return s;
  for (v1::WorkerStatus& w : coordinator_->ListWorkers()) *response->add_workers() = std::move(w);
  return grpc::Status::OK;
}

}  // namespace pstrain
