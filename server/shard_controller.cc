#include "server/shard_controller.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "server/parameter_shard.h"

namespace pstrain {
namespace {

// ---------------------------------------------------------------------------
// In-process shard
// ---------------------------------------------------------------------------

class LocalShardClient final : public ShardClient {
 public:
  explicit LocalShardClient(ParameterShard* shard) : shard_(shard) {}

  absl::Status ConfigureJob(const v1::ConfigureJobRequest& request) override {
    ShardJobConfig config;
    config.job_id = request.job_id();
    config.spec = request.spec();
    config.num_shards = request.num_shards();
    config.chunk_bytes = request.chunk_bytes();
    config.members.assign(request.members().begin(), request.members().end());
    config.generation = request.generation();
    std::vector<v1::ChunkValues> chunks(request.chunks().begin(), request.chunks().end());
    return shard_->ConfigureJob(config, chunks);
  }
  absl::Status SetMembers(const v1::SetMembersRequest& request,
                          v1::SetMembersResponse* response) override {
    return shard_->SetMembers(
        request.job_id(),
        std::vector<std::string>(request.members().begin(), request.members().end()),
        request.generation(), response);
  }
  absl::Status DropJob(const std::string& job_id) override { return shard_->DropJob(job_id); }
  absl::StatusOr<std::vector<v1::ChunkValues>> ReadChunks(const v1::ReadChunksRequest& request,
                                                          absl::Duration wait) override {
    ParameterShard::ReadOptions options;
    options.at_version = request.at_version();
    options.versions_only = request.versions_only();
    return shard_->ReadChunks(request.job_id(), options, absl::Now() + wait);
  }
  absl::StatusOr<bool> HasJob(const std::string& job_id, absl::Duration) override {
    absl::StatusOr<std::vector<v1::ChunkValues>> chunks =
        shard_->ReadChunks(job_id, {.versions_only = true});
    if (absl::IsNotFound(chunks.status())) return false;
    PSTRAIN_RETURN_IF_ERROR(chunks.status());
    return true;
  }
  absl::StatusOr<std::vector<std::string>> ListJobs(absl::Duration) override {
    return shard_->JobIds();
  }
  std::string Describe() const override {
    return absl::StrCat("local shard ", shard_->shard_index());
  }

 private:
  ParameterShard* const shard_;
};

// ---------------------------------------------------------------------------
// Remote shard over ShardControl
// ---------------------------------------------------------------------------

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

class RemoteShardClient final : public ShardClient {
 public:
  RemoteShardClient(std::shared_ptr<grpc::Channel> channel, std::string address,
                    absl::Duration rpc_timeout)
      : stub_(v1::ShardControl::NewStub(std::move(channel))),
        address_(std::move(address)),
        rpc_timeout_(rpc_timeout) {}

  absl::Status ConfigureJob(const v1::ConfigureJobRequest& request) override {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::ConfigureJobResponse response;
    return FromGrpc(stub_->ConfigureJob(&context, request, &response),
                    absl::StrCat(Describe(), " ConfigureJob"));
  }
  absl::Status SetMembers(const v1::SetMembersRequest& request,
                          v1::SetMembersResponse* response) override {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::SetMembersResponse ignored;
    return FromGrpc(stub_->SetMembers(&context, request, response != nullptr ? response : &ignored),
                    absl::StrCat(Describe(), " SetMembers"));
  }
  absl::Status DropJob(const std::string& job_id) override {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::DropJobRequest request;
    request.set_job_id(job_id);
    v1::DropJobResponse response;
    return FromGrpc(stub_->DropJob(&context, request, &response),
                    absl::StrCat(Describe(), " DropJob"));
  }
  absl::StatusOr<std::vector<v1::ChunkValues>> ReadChunks(const v1::ReadChunksRequest& request,
                                                          absl::Duration wait) override {
    grpc::ClientContext context;
    // A cut waits up to `wait` on the shard, then the values travel.
    context.set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout_ + wait));
    std::unique_ptr<grpc::ClientReader<v1::ChunkValues>> reader =
        stub_->ReadChunks(&context, request);
    std::vector<v1::ChunkValues> chunks;
    v1::ChunkValues chunk;
    while (reader->Read(&chunk)) chunks.push_back(std::move(chunk));
    PSTRAIN_RETURN_IF_ERROR(FromGrpc(reader->Finish(), absl::StrCat(Describe(), " ReadChunks")));
    return chunks;
  }
  absl::StatusOr<bool> HasJob(const std::string& job_id, absl::Duration timeout) override {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::ReadChunksRequest request;
    request.set_job_id(job_id);
    request.set_versions_only(true);
    std::unique_ptr<grpc::ClientReader<v1::ChunkValues>> reader =
        stub_->ReadChunks(&context, request);
    v1::ChunkValues chunk;
    while (reader->Read(&chunk)) {
    }
    const grpc::Status status = reader->Finish();
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) return false;
    PSTRAIN_RETURN_IF_ERROR(FromGrpc(status, absl::StrCat(Describe(), " ReadChunks")));
    return true;
  }
  absl::StatusOr<std::vector<std::string>> ListJobs(absl::Duration timeout) override {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::ListShardJobsRequest request;
    v1::ListShardJobsResponse response;
    PSTRAIN_RETURN_IF_ERROR(FromGrpc(stub_->ListJobs(&context, request, &response),
                                     absl::StrCat(Describe(), " ListJobs")));
    return std::vector<std::string>(response.job_ids().begin(), response.job_ids().end());
  }
  std::string Describe() const override { return absl::StrCat("shard ", address_); }

 private:
  void SetDeadline(grpc::ClientContext& context) const {
    context.set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout_));
  }

  // Constant after construction.
  const std::unique_ptr<v1::ShardControl::Stub> stub_;
  const std::string address_;
  const absl::Duration rpc_timeout_;
};

}  // namespace

std::unique_ptr<ShardClient> MakeLocalShardClient(ParameterShard* shard) {
  return std::make_unique<LocalShardClient>(shard);
}

std::unique_ptr<ShardClient> MakeRemoteShardClient(std::shared_ptr<grpc::Channel> channel,
                                                   const std::string& address,
                                                   absl::Duration rpc_timeout) {
  return std::make_unique<RemoteShardClient>(std::move(channel), address, rpc_timeout);
}

// ---------------------------------------------------------------------------
// ShardController
// ---------------------------------------------------------------------------

ShardController::ShardController(std::vector<std::unique_ptr<ShardClient>> shards,
                                 int64_t chunk_bytes)
    : shards_(std::move(shards)), chunk_bytes_(chunk_bytes) {}

absl::Status ShardController::ConfigureJob(const JobLaunch& launch) {
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, BuildJobGraph(launch.spec));
  PSTRAIN_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(graph, num_shards(), chunk_bytes_));
  if (launch.params.size() != graph.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("job ", launch.job_id, ": ",
                                                   launch.params.size(), " parameter values for ",
                                                   graph.params.size(), " parameters"));
  }
  for (size_t p = 0; p < graph.params.size(); ++p) {
    if (static_cast<int64_t>(launch.params[p].size()) != graph.params[p].shape.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job ", launch.job_id, ": parameter ", graph.params[p].name, " has ",
                       launch.params[p].size(), " values, the model needs ",
                       graph.params[p].shape.num_elements()));
    }
  }
  // Optimizer state: "<parameter>/<slot>" -> (parameter index, slot name).
  std::map<int, std::vector<std::pair<std::string, const std::vector<float>*>>> slots_by_param;
  for (const auto& [name, values] : launch.optimizer_state) {
    bool matched = false;
    for (size_t p = 0; p < graph.params.size() && !matched; ++p) {
      const std::string& pname = graph.params[p].name;
      if (name.size() > pname.size() + 1 && name.compare(0, pname.size(), pname) == 0 &&
          name[pname.size()] == '/') {
        const std::string slot = name.substr(pname.size() + 1);
        if (slot.find('/') != std::string::npos) continue;
        if (values.size() != launch.params[p].size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("job ", launch.job_id, ": optimizer state ", name, " has ",
                           values.size(), " values, its parameter has ", launch.params[p].size()));
        }
        slots_by_param[static_cast<int>(p)].emplace_back(slot, &values);
        matched = true;
      }
    }
    if (!matched) {
      return absl::InvalidArgumentError(absl::StrCat("job ", launch.job_id, ": optimizer state ",
                                                     name, " names no parameter of the model"));
    }
  }

  for (int s = 0; s < num_shards(); ++s) {
    v1::ConfigureJobRequest request;
    request.set_job_id(launch.job_id);
    *request.mutable_spec() = launch.spec;
    request.set_num_shards(num_shards());
    request.set_chunk_bytes(chunk_bytes_);  // 0 (auto) stays auto: workers plan so too.
    request.set_shard_index(s);
    for (const std::string& m : launch.members) request.add_members(m);
    request.set_generation(launch.generation);
    for (int id : plan.by_shard[s]) {
      const ChunkInfo& c = plan.chunks[id];
      v1::ChunkValues* chunk = request.add_chunks();
      chunk->set_chunk_id(id);
      chunk->set_version(launch.chunk_versions.size() == plan.chunks.size()
                             ? launch.chunk_versions[id]
                             : launch.initial_version);
      const float* begin = launch.params[c.param].data() + c.offset;
      chunk->mutable_values()->Add(begin, begin + c.count);
      auto it = slots_by_param.find(c.param);
      if (it == slots_by_param.end()) continue;
      for (const auto& [slot_name, values] : it->second) {
        v1::OptimizerSlot* slot = chunk->add_slots();
        slot->set_name(slot_name);
        const float* sbegin = values->data() + c.offset;
        slot->mutable_values()->Add(sbegin, sbegin + c.count);
      }
    }
    PSTRAIN_RETURN_IF_ERROR(shards_[s]->ConfigureJob(request));
  }
  return absl::OkStatus();
}

absl::Status ShardController::SetMembers(const std::string& job_id,
                                         const std::vector<std::string>& members,
                                         int64_t generation,
                                         std::map<std::string, int64_t>* removed_steps) {
  v1::SetMembersRequest request;
  request.set_job_id(job_id);
  for (const std::string& m : members) request.add_members(m);
  request.set_generation(generation);
  absl::Status first;
  for (const auto& shard : shards_) {
    v1::SetMembersResponse response;
    absl::Status s = shard->SetMembers(request, &response);
    if (!s.ok() && first.ok()) first = s;
    if (!s.ok() || removed_steps == nullptr) continue;
    for (const v1::MemberSteps& m : response.removed()) {
      auto [it, inserted] = removed_steps->emplace(m.worker_id(), m.steps());
      if (!inserted) it->second = std::min(it->second, m.steps());
    }
  }
  return first;
}

absl::Status ShardController::DropJob(const std::string& job_id) {
  absl::Status first;
  for (const auto& shard : shards_) {
    absl::Status s = shard->DropJob(job_id);
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

absl::StatusOr<int64_t> ShardController::MaxVersion(const std::string& job_id) {
  v1::ReadChunksRequest request;
  request.set_job_id(job_id);
  request.set_versions_only(true);
  int64_t max_version = 0;
  for (const auto& shard : shards_) {
    PSTRAIN_ASSIGN_OR_RETURN(std::vector<v1::ChunkValues> chunks,
                             shard->ReadChunks(request, absl::ZeroDuration()));
    for (const v1::ChunkValues& c : chunks) max_version = std::max(max_version, c.version());
  }
  return max_version;
}

std::vector<int> ShardController::ShardsMissingJob(const std::string& job_id,
                                                   absl::Duration timeout) {
  std::vector<int> missing;
  for (int s = 0; s < num_shards(); ++s) {
    absl::StatusOr<bool> has = shards_[s]->HasJob(job_id, timeout);
    if (has.ok() && !*has) missing.push_back(s);
  }
  return missing;
}

absl::StatusOr<ModelSnapshot> ShardController::ReadModel(const std::string& job_id,
                                                         const ModelGraph& graph) {
  return ReadModelAt(job_id, graph, 0, absl::ZeroDuration());
}

absl::StatusOr<ModelSnapshot> ShardController::ReadModelAt(const std::string& job_id,
                                                           const ModelGraph& graph, int64_t version,
                                                           absl::Duration wait) {
  v1::ReadChunksRequest request;
  request.set_job_id(job_id);
  request.set_at_version(version);
  PSTRAIN_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(graph, num_shards(), chunk_bytes_));
  ModelSnapshot snapshot;
  snapshot.params.resize(graph.params.size());
  for (size_t p = 0; p < graph.params.size(); ++p) {
    snapshot.params[p].assign(graph.params[p].shape.num_elements(), 0.0f);
  }
  std::vector<bool> seen(plan.chunks.size(), false);
  snapshot.chunk_versions.assign(plan.chunks.size(), 0);
  // Slot name -> per-parameter coverage count, to catch slots on some chunks only.
  std::map<std::string, int64_t> slot_elements;
  bool first_chunk = true;
  for (int s = 0; s < num_shards(); ++s) {
    PSTRAIN_ASSIGN_OR_RETURN(std::vector<v1::ChunkValues> chunks,
                             shards_[s]->ReadChunks(request, wait));
    for (const v1::ChunkValues& chunk : chunks) {
      const int id = chunk.chunk_id();
      if (id < 0 || id >= static_cast<int>(plan.chunks.size()) || plan.chunks[id].shard != s) {
        return absl::InternalError(absl::StrCat(shards_[s]->Describe(), " returned chunk ", id,
                                                " of job ", job_id, " which it does not own"));
      }
      const ChunkInfo& c = plan.chunks[id];
      if (seen[id] || chunk.values_size() != c.count) {
        return absl::InternalError(
            absl::StrCat(shards_[s]->Describe(), " returned chunk ", id, " of job ", job_id,
                         " twice or with ", chunk.values_size(), " values instead of ", c.count));
      }
      seen[id] = true;
      snapshot.chunk_versions[id] = chunk.version();
      std::copy(chunk.values().begin(), chunk.values().end(),
                snapshot.params[c.param].begin() + c.offset);
      if (first_chunk) {
        snapshot.min_version = snapshot.max_version = chunk.version();
        first_chunk = false;
      } else {
        snapshot.min_version = std::min(snapshot.min_version, chunk.version());
        snapshot.max_version = std::max(snapshot.max_version, chunk.version());
      }
      for (const v1::OptimizerSlot& slot : chunk.slots()) {
        if (slot.values_size() != c.count) {
          return absl::InternalError(absl::StrCat(shards_[s]->Describe(), ": slot ", slot.name(),
                                                  " of chunk ", id, " has ", slot.values_size(),
                                                  " values instead of ", c.count));
        }
        const std::string name = absl::StrCat(graph.params[c.param].name, "/", slot.name());
        std::vector<float>& dest = snapshot.optimizer_state[name];
        if (dest.empty()) dest.assign(snapshot.params[c.param].size(), 0.0f);
        std::copy(slot.values().begin(), slot.values().end(), dest.begin() + c.offset);
        slot_elements[name] += c.count;
      }
    }
  }
  for (size_t id = 0; id < seen.size(); ++id) {
    if (!seen[id]) {
      return absl::InternalError(absl::StrCat("chunk ", id, " of job ", job_id,
                                              " is missing from shard ", plan.chunks[id].shard));
    }
  }
  for (const auto& [name, count] : slot_elements) {
    if (count != static_cast<int64_t>(snapshot.optimizer_state[name].size())) {
      return absl::InternalError(absl::StrCat("optimizer state ", name, " of job ", job_id,
                                              " is present on only some of its chunks"));
    }
  }
  return snapshot;
}

}  // namespace pstrain
