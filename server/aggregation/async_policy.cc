#include "server/aggregation/async_policy.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pstrain {

absl::StatusOr<std::unique_ptr<AsyncPolicy>> AsyncPolicy::Create(const AggregationConfig& config) {
  PSTRAIN_ASSIGN_OR_RETURN(
      std::unique_ptr<ServerOptimizer> optimizer,
      ServerOptimizer::Create(config.optimizer,
                              absl::StrCat("ConfigureJob(", config.job_id, "): ")));
  return std::unique_ptr<AsyncPolicy>(new AsyncPolicy(config, std::move(optimizer)));
}

AsyncPolicy::AsyncPolicy(const AggregationConfig& config,
                         std::unique_ptr<ServerOptimizer> optimizer)
    : AggregationPolicy(config),
      max_version_lead_(config.max_version_lead),
      optimizer_(std::move(optimizer)) {}

absl::Status AsyncPolicy::AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial) {
  if (!chunk.trainable) return absl::OkStatus();
  return optimizer_->AddChunk(chunk, initial);
}

v1::ChunkHeader::Kind AsyncPolicy::PushKind(const ShardChunk& chunk) const {
  return chunk.trainable ? v1::ChunkHeader::KIND_GRADIENT : v1::ChunkHeader::KIND_PARAMETERS;
}

absl::Status AsyncPolicy::Push(ShardChunk& chunk, const PushArgs& args,
                               absl::Span<const float> values, PushOutcome* outcome) {
  if (args.version > chunk.version + max_version_lead_) {
    return absl::InvalidArgumentError(absl::StrCat("version ", args.version,
                                                   " is ahead of the server's ", chunk.version,
                                                   " (", chunk.Describe(job_id()), ")"));
  }
  if (chunk.trainable) {
    outcome->staleness = std::max<int64_t>(chunk.version - args.version, 0);
    PSTRAIN_RETURN_IF_ERROR(optimizer_->Apply(chunk, values.data()));
  } else {
    // Running statistics: the last write wins.
    std::vector<float>* target = Writable(&chunk.values);
    std::copy(values.begin(), values.end(), target->begin());
  }
  ++chunk.version;
  ++outcome->applied_updates;
  return absl::OkStatus();
}

}  // namespace pstrain
