#include "server/aggregation/aggregation_policy.h"

#include "absl/strings/str_cat.h"
#include "server/aggregation/async_policy.h"
#include "server/aggregation/average_policy.h"
#include "server/aggregation/ssp_policy.h"
#include "server/aggregation/sync_policy.h"

namespace pstrain {

std::vector<std::string> OptimizerSlotNames(const v1::OptimizerSpec& spec) {
  if (spec.type() == v1::OPTIMIZER_ADAM || spec.type() == v1::OPTIMIZER_ADAMW) {
    return {"adam_m", "adam_v"};
  }
  if (spec.type() == v1::OPTIMIZER_SGD && spec.momentum() > 0.f) return {"momentum"};
  return {};
}

AggregationPolicy::AggregationPolicy(const AggregationConfig& config)
    : job_id_(config.job_id), slot_names_(OptimizerSlotNames(config.optimizer)) {}

PulledChunk AggregationPolicy::Pulled(const ShardChunk& chunk, const PullArgs& args) const {
  PulledChunk out;
  out.version = chunk.version;
  out.values =
      args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE ? chunk.slots[args.slot] : chunk.values;
  return out;
}

absl::StatusOr<std::unique_ptr<AggregationPolicy>> CreateAggregationPolicy(
    const AggregationConfig& config) {
  switch (config.mode) {
    case v1::CONSISTENCY_SYNC:
      return SyncPolicy::Create(config);
    case v1::CONSISTENCY_ASYNC:
      return AsyncPolicy::Create(config);
    case v1::CONSISTENCY_SSP:
      return SspPolicy::Create(config);
    case v1::CONSISTENCY_AVERAGE:
      return std::make_unique<AveragePolicy>(config);
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "job ", config.job_id, ": no aggregation policy for consistency mode ",
          v1::ConsistencyMode_Name(config.mode), " (", static_cast<int>(config.mode), ")"));
  }
}

}  // namespace pstrain
