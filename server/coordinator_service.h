// CoordinatorService: the gRPC edge of the Coordinator (proto/pstrain/v1/
// service.proto). Each handler decodes and validates the request, calls the
// Coordinator and maps its absl::Status to a grpc::Status (codes 1:1).
//
//   Coordinator* coordinator = ...;
//   CoordinatorService service(coordinator);
//   grpc::ServerBuilder builder;
//   builder.RegisterService(&service);
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
//   ...
//   server->Shutdown(deadline);   // ends open WatchJob/DownloadModel streams
//
// WatchJob sends the current status at once, then the latest status at most
// every min_interval_ms (0 means 500) and at once on every state change,
// repeats it every 10 s while nothing changes (a watcher can tell a quiet job
// from a lost connection), and ends after a terminal state has been sent. DownloadModel streams the
// latest checkpoint file in ModelChunk messages of at most 1 MiB.
//
// Every call is authorized first (Options::authorizer; UNAUTHENTICATED or
// PERMISSION_DENIED). A request above Options::max_message_bytes is RESOURCE_EXHAUSTED before
// the Coordinator sees it (the server's own receive limit may be higher, as
// other services on it may need more).
//
// Threads: gRPC's synchronous API; handlers run on gRPC's thread pool.
// The two streaming handlers hold their thread while they stream but wake at
// least every second to notice a cancelled call or a server shutdown, so no
// handler outlives Shutdown by more than that. `coordinator` must outlive
// the server.
#ifndef PSTRAIN_SERVER_COORDINATOR_SERVICE_H_
#define PSTRAIN_SERVER_COORDINATOR_SERVICE_H_

#include <cstdint>
#include <memory>
#include <utility>

#include "absl/time/time.h"
#include "common/rpc/security.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "server/coordinator.h"

namespace pstrain {

// Largest ModelChunk.data sent by DownloadModel.
inline constexpr int64_t kModelChunkBytes = int64_t{1} << 20;

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  struct Options {
    int64_t max_message_bytes = int64_t{64} << 20;
    // Who may call what (null: everyone, as with Authorizer::Disabled()):
    // SubmitJob, GetJob, GetJobHistory, ListJobs, CancelJob, WatchJob,
    // DownloadModel and ListWorkers need the admin role; RegisterWorker, Heartbeat,
    // ReportProgress, EpochPlan and DeclareModel the worker role, and all
    // but RegisterWorker also the worker credential of the worker id they
    // name.
    std::shared_ptr<const Authorizer> authorizer;
  };
  explicit CoordinatorService(Coordinator* coordinator)
      : CoordinatorService(coordinator, Options()) {}
  CoordinatorService(Coordinator* coordinator, Options options)
      : coordinator_(coordinator),
        options_(std::move(options)),
        authorizer_(options_.authorizer != nullptr ? options_.authorizer : Authorizer::Disabled()) {
  }

  grpc::Status SubmitJob(grpc::ServerContext* context, const v1::SubmitJobRequest* request,
                         v1::SubmitJobResponse* response) override;
  grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request,
                      v1::JobStatus* response) override;
  grpc::Status GetJobHistory(grpc::ServerContext* context, const v1::GetJobRequest* request,
                             v1::JobHistory* response) override;
  grpc::Status ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* request,
                        v1::ListJobsResponse* response) override;
  grpc::Status CancelJob(grpc::ServerContext* context, const v1::CancelJobRequest* request,
                         v1::CancelJobResponse* response) override;
  grpc::Status WatchJob(grpc::ServerContext* context, const v1::WatchJobRequest* request,
                        grpc::ServerWriter<v1::JobStatus>* writer) override;
  grpc::Status DownloadModel(grpc::ServerContext* context, const v1::DownloadModelRequest* request,
                             grpc::ServerWriter<v1::ModelChunk>* writer) override;
  grpc::Status RegisterWorker(grpc::ServerContext* context,
                              const v1::RegisterWorkerRequest* request,
                              v1::RegisterWorkerResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status ReportProgress(grpc::ServerContext* context,
                              const v1::ReportProgressRequest* request,
                              v1::ReportProgressResponse* response) override;
  grpc::Status ListWorkers(grpc::ServerContext* context, const v1::ListWorkersRequest* request,
                           v1::ListWorkersResponse* response) override;
  grpc::Status EpochPlan(grpc::ServerContext* context, const v1::EpochPlanRequest* request,
                         v1::EpochPlanResponse* response) override;
  grpc::Status DeclareModel(grpc::ServerContext* context, const v1::DeclareModelRequest* request,
                            v1::DeclareModelResponse* response) override;

 private:
  // Authorization, then the size limit: the first failure, or OK.
  grpc::Status Admit(const grpc::ServerContext& context, Role role, const char* method,
                     const google::protobuf::Message& request) const;

  Coordinator* const coordinator_;  // Not owned.
  const Options options_;
  const std::shared_ptr<const Authorizer> authorizer_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_COORDINATOR_SERVICE_H_
