#include "server/shard_control_service.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/rpc/channel.h"
#include "common/rpc/grpc_order.h"

namespace pstrain {

grpc::Status ShardControlService::ConfigureJob(grpc::ServerContext* ctx,
                                               const v1::ConfigureJobRequest* request,
                                               v1::ConfigureJobResponse*) {
  if (grpc::Status s = Admit(*ctx, "ConfigureJob", *request); !s.ok()) return s;
  if (request->shard_index() != shard_->shard_index()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("ConfigureJob for shard ", request->shard_index(),
                                     " sent to shard ", shard_->shard_index()));
  }
  ShardJobConfig config;
  config.job_id = request->job_id();
  config.spec = request->spec();
  config.num_shards = request->num_shards();
  config.chunk_bytes = request->chunk_bytes();
  config.members.assign(request->members().begin(), request->members().end());
  config.generation = request->generation();
  std::vector<v1::ChunkValues> chunks(request->chunks().begin(), request->chunks().end());
  return ToGrpcStatus(shard_->ConfigureJob(config, chunks));
}

grpc::Status ShardControlService::SetMembers(grpc::ServerContext* ctx,
                                             const v1::SetMembersRequest* request,
                                             v1::SetMembersResponse* response) {
  if (grpc::Status s = Admit(*ctx, "SetMembers", *request); !s.ok()) return s;
  std::vector<std::string> members(request->members().begin(), request->members().end());
  return ToGrpcStatus(
      shard_->SetMembers(request->job_id(), members, request->generation(), response));
}

grpc::Status ShardControlService::DropJob(grpc::ServerContext* ctx,
                                          const v1::DropJobRequest* request, v1::DropJobResponse*) {
  if (grpc::Status s = Admit(*ctx, "DropJob", *request); !s.ok()) return s;
  return ToGrpcStatus(shard_->DropJob(request->job_id()));
}

grpc::Status ShardControlService::ListJobs(grpc::ServerContext* ctx,
                                           const v1::ListShardJobsRequest* request,
                                           v1::ListShardJobsResponse* response) {
  if (grpc::Status s = Admit(*ctx, "ListJobs", *request); !s.ok()) return s;
  for (std::string& id : shard_->JobIds()) response->add_job_ids(std::move(id));
  return grpc::Status::OK;
}

grpc::Status ShardControlService::ReadChunks(grpc::ServerContext* ctx,
                                             const v1::ReadChunksRequest* request,
                                             grpc::ServerWriter<v1::ChunkValues>* writer) {
  if (grpc::Status s = Admit(*ctx, "ReadChunks", *request); !s.ok()) return s;
  ParameterShard::ReadOptions options;
  options.at_version = request->at_version();
  options.versions_only = request->versions_only();
  // A cut waits for the chunks below it within the caller's deadline.
  const absl::Time deadline =
      std::min(absl::FromChrono(ctx->deadline()), absl::Now() + absl::Minutes(10));
  absl::StatusOr<std::vector<v1::ChunkValues>> chunks =
      shard_->ReadChunks(request->job_id(), options, deadline);
  if (!chunks.ok()) return ToGrpcStatus(chunks.status());
  for (const v1::ChunkValues& c : *chunks) {
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    if (!writer->Write(c)) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "ReadChunks: client went away");
    }
  }
  return grpc::Status::OK;
}

grpc::Status ShardControlService::Admit(const grpc::ServerContext& ctx, const char* method,
                                        const google::protobuf::Message& request) const {
  if (grpc::Status s = authorizer_->Check(ctx, Role::kPeer, method); !s.ok()) return s;
  return CheckMessageSize(request, max_message_bytes_, "ShardControl",
                          "--max-shard-control-message-bytes");
}

}  // namespace pstrain
