// AsyncPolicy: asynchronous training. Every push is applied on arrival
// (version += 1): a trainable chunk's gradient with the server's optimizer
// (server_optimizer.h), recording its staleness (current version - pushed
// version); a non-trainable chunk's values (running statistics) replace the
// chunk's, the last write winning. A push more than
// AggregationConfig::max_version_lead versions ahead is INVALID_ARGUMENT;
// stale ones are applied. Chunks move on alone: there is no common version
// to cut a checkpoint at.
//
// Threads: as AggregationPolicy.
#ifndef PSTRAIN_SERVER_AGGREGATION_ASYNC_POLICY_H_
#define PSTRAIN_SERVER_AGGREGATION_ASYNC_POLICY_H_

#include <cstdint>
#include <memory>

#include "server/aggregation/aggregation_policy.h"
#include "server/aggregation/server_optimizer.h"

namespace pstrain {

class AsyncPolicy : public AggregationPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<AsyncPolicy>> Create(const AggregationConfig& config);

  const char* name() const override { return "async"; }
  absl::Status AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) override;
  absl::Status FinishConfiguration() override { return optimizer_->Synchronize(); }
  v1::ChunkHeader::Kind PushKind(const ShardChunk& chunk) const override;
  bool HasCommonVersions() const override { return false; }
  absl::Status Push(ShardChunk& chunk, const PushArgs& args, absl::Span<const float> values,
                    PushOutcome* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) override;
  absl::Status ReadSlots(const ShardChunk& chunk, v1::ChunkValues* out)
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu) override {
    return optimizer_->ReadSlots(chunk, out);
  }

 protected:
  AsyncPolicy(const AggregationConfig& config, std::unique_ptr<ServerOptimizer> optimizer);

 private:
  // Constant after construction.
  const int64_t max_version_lead_;
  const std::unique_ptr<ServerOptimizer> optimizer_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_AGGREGATION_ASYNC_POLICY_H_
