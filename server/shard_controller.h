// ShardController: server 0's control path to every parameter-server shard
// (itself included). It configures a job's chunks on each shard, changes the
// member set, drops jobs and reads the model back for checkpoints. The hot
// path (workers' pushes and pulls) never comes through here.
//
//   std::vector<std::unique_ptr<ShardClient>> shards;
//   shards.push_back(MakeLocalShardClient(&local_shard));             // shard 0
//   shards.push_back(MakeRemoteShardClient(channel, absl::Seconds(60)));  // shard 1
//   ShardController controller(std::move(shards));
//   PSTRAIN_RETURN_IF_ERROR(controller.ConfigureJob(launch));
//   PSTRAIN_ASSIGN_OR_RETURN(ModelSnapshot model, controller.ReadModel("job-1", graph));
//
// Every remote call carries a deadline (the client's rpc timeout), so no call
// waits forever on a dead shard.
//
// Threads: ShardController is thread-compatible for configuration but all its
// methods may be called concurrently for different jobs (the shards themselves
// are thread-safe). The coordinator calls it from its background thread only,
// never while holding its own lock.
#ifndef PSTRAIN_SERVER_SHARD_CONTROLLER_H_
#define PSTRAIN_SERVER_SHARD_CONTROLLER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/service.pb.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace pstrain {

class ParameterShard;

// The ShardControl operations on one shard. Implementations: in-process
// (a ParameterShard in this process) and remote (ShardControl over gRPC).
// Thread-safe.
class ShardClient {
 public:
  virtual ~ShardClient() = default;
  virtual absl::Status ConfigureJob(const v1::ConfigureJobRequest& request) = 0;
  // `response` (may be null) receives the removed members' steps.
  virtual absl::Status SetMembers(const v1::SetMembersRequest& request,
                                  v1::SetMembersResponse* response) = 0;
  virtual absl::Status DropJob(const std::string& job_id) = 0;
  // Every chunk the shard owns for the job, with version and optimizer slots;
  // `request` as in ReadChunksRequest (at_version, versions_only), waiting
  // at most `wait` for a cut.
  virtual absl::StatusOr<std::vector<v1::ChunkValues>> ReadChunks(
      const v1::ReadChunksRequest& request, absl::Duration wait) = 0;
  // False when the shard answers that it does not hold the job (it
  // restarted and lost it); the call's error when it does not answer within
  // `timeout`.
  virtual absl::StatusOr<bool> HasJob(const std::string& job_id, absl::Duration timeout) = 0;
  // The ids of every job the shard holds.
  virtual absl::StatusOr<std::vector<std::string>> ListJobs(absl::Duration timeout) = 0;
  // For messages: "local shard 0", "shard 127.0.0.1:7071".
  virtual std::string Describe() const = 0;
};

// A client for a ParameterShard living in this process; `shard` must outlive it.
std::unique_ptr<ShardClient> MakeLocalShardClient(ParameterShard* shard);

// A client for a remote shard's ShardControl service. Every call has
// `rpc_timeout` as its deadline; transport failures come back as UNAVAILABLE
// or DEADLINE_EXCEEDED with the address in the message.
std::unique_ptr<ShardClient> MakeRemoteShardClient(std::shared_ptr<grpc::Channel> channel,
                                                   const std::string& address,
                                                   absl::Duration rpc_timeout);

// What a job starts from: its spec, members and the initial value of every
// parameter (ModelGraph::params order) and, optionally, optimizer state
// named "<parameter>/<slot>" (resuming from a checkpoint).
struct JobLaunch {
  std::string job_id;
  v1::JobSpec spec;  // Model inline.
  std::vector<std::string> members;
  int64_t generation = 1;
  std::vector<std::vector<float>> params;
  std::map<std::string, std::vector<float>> optimizer_state;
  int64_t initial_version = 0;  // Version of every chunk (> 0 when resuming).
  // By chunk id, when resuming async or ssp from a checkpoint that recorded
  // them: each chunk goes on from its own version (its optimizer iteration
  // count), else every chunk starts at initial_version.
  std::vector<int64_t> chunk_versions;
};

// The whole model of a job read back from every shard.
struct ModelSnapshot {
  std::vector<std::vector<float>> params;  // ModelGraph::params order.
  // "<parameter>/<slot>" -> values, for every parameter that has slots.
  std::map<std::string, std::vector<float>> optimizer_state;
  int64_t min_version = 0;  // Lowest chunk version seen.
  int64_t max_version = 0;
  std::vector<int64_t> chunk_versions;  // By chunk id.
};

class ShardController {
 public:
  // Shard i of the chunk plan is shards[i]. `chunk_bytes` is the plan's chunk
  // size (the same on workers: see common/chunking.h).
  explicit ShardController(std::vector<std::unique_ptr<ShardClient>> shards,
                           int64_t chunk_bytes = kAutoChunkBytes);

  int num_shards() const { return static_cast<int>(shards_.size()); }
  int64_t chunk_bytes() const { return chunk_bytes_; }

  // Plans the chunks, cuts the initial values (and optimizer state) by shard
  // and configures every shard. INVALID_ARGUMENT when the values do not match
  // the model; the first shard error otherwise (the job may then be
  // configured on some shards: call DropJob).
  absl::Status ConfigureJob(const JobLaunch& launch);
  // New member set and generation on every shard; the first error.
  // `removed_steps` (may be null) receives, for each member removed, the
  // lowest of the steps the shards hold of it (SetMembersResponse.removed;
  // shards without trainable chunks do not count).
  absl::Status SetMembers(const std::string& job_id, const std::vector<std::string>& members,
                          int64_t generation,
                          std::map<std::string, int64_t>* removed_steps = nullptr);
  // Forgets the job on every shard (all are tried); the first error.
  absl::Status DropJob(const std::string& job_id);
  // Reads every shard's chunks and reassembles whole parameters and
  // optimizer-state tensors by the plan. INTERNAL when a shard returns a
  // chunk that is not its own, of the wrong size, or is missing one.
  absl::StatusOr<ModelSnapshot> ReadModel(const std::string& job_id, const ModelGraph& graph);
  // The same as one consistent cut at model version `version` (sync and
  // average modes; see ReadChunksRequest.at_version), waiting at most
  // `wait` for chunks below it.
  absl::StatusOr<ModelSnapshot> ReadModelAt(const std::string& job_id, const ModelGraph& graph,
                                            int64_t version, absl::Duration wait);
  // The highest chunk version of the job over every shard.
  absl::StatusOr<int64_t> MaxVersion(const std::string& job_id);
  // The shards that answer, within `timeout` each, that they do not hold the
  // job (they restarted); shards that do not answer are not counted (they
  // may be restarting: ask again later).
  std::vector<int> ShardsMissingJob(const std::string& job_id, absl::Duration timeout);
  // The jobs shard `shard` holds, asked within `timeout`.
  absl::StatusOr<std::vector<std::string>> ListJobs(int shard, absl::Duration timeout) {
    return shards_[shard]->ListJobs(timeout);
  }
  // Forgets the job on shard `shard` only.
  absl::Status DropJobOn(int shard, const std::string& job_id) {
    return shards_[shard]->DropJob(job_id);
  }
  // For messages.
  std::string Describe(int shard) const { return shards_[shard]->Describe(); }

 private:
  // Constant after construction.
  const std::vector<std::unique_ptr<ShardClient>> shards_;
  const int64_t chunk_bytes_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_SHARD_CONTROLLER_H_
