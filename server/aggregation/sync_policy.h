// SyncPolicy: synchronous training. A chunk's version t -> t+1 once every
// member has pushed its gradient for t (the barrier of barrier_policy.h);
// the mean gradient is applied once with the server's optimizer
// (server_optimizer.h). Non-trainable chunks (running statistics) take
// KIND_PARAMETERS pushes and publish their mean per version.
//
// Pull compression (AggregationConfig::pull_compression): each trainable
// chunk not sent whole also keeps its published values, what the workers
// hold. When a step completes, the difference between the master values and
// the published ones is encoded once (common/rpc/gradient_codec.h), added
// into the published values exactly as a worker adds it, and kept as the
// chunk's delta; a pull from a worker holding the previous version (of the
// job's current values epoch, drawn when the policy is made) gets that
// delta, any other pull the published values whole. What a codec leaves out
// stays in the difference for the next step (error feedback). A pull with
// PullArgs::master, and ReadSlots, read the master values.
//
// Push pacing (AggregationConfig::pace_lead_frames): PushPacer, fed by
// every push accepted and not a duplicate.
//
// Threads: as AggregationPolicy.
#ifndef PSTRAIN_SERVER_AGGREGATION_SYNC_POLICY_H_
#define PSTRAIN_SERVER_AGGREGATION_SYNC_POLICY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "server/aggregation/barrier_policy.h"
#include "server/aggregation/push_pacer.h"
#include "server/aggregation/server_optimizer.h"

namespace pstrain {

class SyncPolicy final : public BarrierPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<SyncPolicy>> Create(const AggregationConfig& config);

  const char* name() const override { return "sync"; }
  absl::Status AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) override;
  absl::Status FinishConfiguration() override { return optimizer_->Synchronize(); }
  v1::ChunkHeader::Kind PushKind(const ShardChunk& chunk) const override;
  void Pushed(const PushArgs& args, const ShardMembership& membership, bool duplicate) override;
  PulledChunk Pulled(const ShardChunk& chunk, const PullArgs& args) const
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu) override;
  void MembershipAdopted(const ShardMembership& membership) override {
    pacer_.MembersChanged(membership);
  }
  absl::Status ReadSlots(const ShardChunk& chunk, v1::ChunkValues* out)
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu) override {
    return optimizer_->ReadSlots(chunk, out);
  }
  bool WatchPace(std::weak_ptr<PaceWatcher> watcher) override {
    return pacer_.Watch(std::move(watcher));
  }
  int64_t PaceSlack(const std::string& worker_id, int64_t version) const override {
    return pacer_.Slack(worker_id, version);
  }

  // The epoch of this configuration's published values (non-zero).
  uint64_t values_epoch() const { return values_epoch_; }

 private:
  SyncPolicy(const AggregationConfig& config, std::unique_ptr<ServerOptimizer> optimizer);

  absl::Status ApplyMeanGradient(ShardChunk& chunk, const float* mean)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) override {
    return optimizer_->Apply(chunk, mean);
  }
  void StepCompleted(ShardChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) override;
  // Pull compression: moves the published values towards the master values
  // by what pull_compression_ encodes of their difference, and keeps that
  // encoding as the chunk's delta.
  void PublishDelta(ShardChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

  // Constant after construction.
  const v1::CompressionSpec pull_compression_;
  const std::vector<bool> chunks_sent_whole_;
  const uint64_t values_epoch_;  // Non-zero; new with every configuration.
  const std::unique_ptr<ServerOptimizer> optimizer_;
  PushPacer pacer_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_AGGREGATION_SYNC_POLICY_H_
