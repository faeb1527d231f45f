// AveragePolicy: model averaging. Pushes carry parameters (KIND_PARAMETERS)
// for round t, and, with AggregationConfig::average_optimizer_state and an
// optimizer that has state, each optimizer slot (KIND_OPTIMIZER_STATE);
// once every member pushed every part (the barrier of barrier_policy.h),
// their means become version t+1. No optimizer runs on the server: workers
// step locally between rounds.
//
// Optimizer state is pulled (KIND_OPTIMIZER_STATE) only with
// average_optimizer_state; without it every worker keeps its own state and
// the server has none to save, unless some was given at configuration (a
// resumed checkpoint), which it keeps and returns as given.
//
// Threads: as AggregationPolicy.
#ifndef PSTRAIN_SERVER_AGGREGATION_AVERAGE_POLICY_H_
#define PSTRAIN_SERVER_AGGREGATION_AVERAGE_POLICY_H_

#include "server/aggregation/barrier_policy.h"

namespace pstrain {

class AveragePolicy final : public BarrierPolicy {
 public:
  explicit AveragePolicy(const AggregationConfig& config)
      : BarrierPolicy(config), average_optimizer_state_(config.average_optimizer_state) {}

  const char* name() const override { return "average"; }
  absl::Status AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) override;
  v1::ChunkHeader::Kind PushKind(const ShardChunk& /*chunk*/) const override {
    return v1::ChunkHeader::KIND_PARAMETERS;
  }
  bool ExchangesState(const ShardChunk& chunk) const override {
    return average_optimizer_state_ && chunk.trainable && !slot_names().empty();
  }
  absl::Status ReadSlots(const ShardChunk& chunk, v1::ChunkValues* out)
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu) override;

 private:
  const bool average_optimizer_state_;  // Constant after construction.
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_AGGREGATION_AVERAGE_POLICY_H_
