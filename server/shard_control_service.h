// ShardControlService: the ShardControl service of one shard (protobuf; the
// control path by which server 0 configures every shard): ConfigureJob,
// SetMembers, DropJob, ListJobs and ReadChunks over one ParameterShard. Each
// call needs the peer role, then a request within max_message_bytes
// (RESOURCE_EXHAUSTED beyond); the shard's errors keep their code.
//
// Threads: sync handlers, run on gRPC's sync-server threads, which may block
// (a ReadChunks cut waits for its version within the caller's deadline).
// Part of ShardServices (ps_service.h), which registers it.
#ifndef PSTRAIN_SERVER_SHARD_CONTROL_SERVICE_H_
#define PSTRAIN_SERVER_SHARD_CONTROL_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "common/rpc/security.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "server/parameter_shard.h"

namespace pstrain {

class ShardControlService final : public v1::ShardControl::Service {
 public:
  // `shard` and `authorizer` must outlive this object.
  ShardControlService(ParameterShard* shard, int max_message_bytes, const Authorizer* authorizer)
      : shard_(shard), max_message_bytes_(max_message_bytes), authorizer_(authorizer) {}

  grpc::Status ConfigureJob(grpc::ServerContext* ctx, const v1::ConfigureJobRequest* request,
                            v1::ConfigureJobResponse*) override;
  grpc::Status SetMembers(grpc::ServerContext* ctx, const v1::SetMembersRequest* request,
                          v1::SetMembersResponse* response) override;
  grpc::Status DropJob(grpc::ServerContext* ctx, const v1::DropJobRequest* request,
                       v1::DropJobResponse*) override;
  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListShardJobsRequest* request,
                        v1::ListShardJobsResponse* response) override;
  grpc::Status ReadChunks(grpc::ServerContext* ctx, const v1::ReadChunksRequest* request,
                          grpc::ServerWriter<v1::ChunkValues>* writer) override;

 private:
  // The peer role, then the size limit.
  grpc::Status Admit(const grpc::ServerContext& ctx, const char* method,
                     const google::protobuf::Message& request) const;

  ParameterShard* const shard_;
  const int max_message_bytes_;
  const Authorizer* const authorizer_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_SHARD_CONTROL_SERVICE_H_
