// BarrierPolicy: the barrier that sync and average modes share. A chunk at
// version t takes one push of each member for t (and, where the mode
// exchanges optimizer state, one per slot); once every member has pushed,
// the mean of the pushes is folded in and the chunk moves to t + 1.
//
//  * A push for another version than the chunk's is refused: from the
//    future INVALID_ARGUMENT, stale ABORTED.
//  * A member's second push for the barrier it is in: acknowledged when it
//    carries an update id (it resynchronised after a failed step; its first
//    contribution stands), else INVALID_ARGUMENT.
//  * A push whose sum with the others' would overflow float is refused
//    (INVALID_ARGUMENT) before anything is written.
//  * The push that completes a barrier is folded straight into the mean
//    (one pass fewer over the chunk; with one member the mean is its values).
//    The mean is an exact division, so that the mean of two pushes is
//    bit-identical to (a + b) / 2 in whatever order they came.
//  * A removed member's push already in a barrier stays in its mean (it was
//    computed from the right version); the barrier completes as soon as
//    every remaining member has pushed (ChunkAdopted).
//  * Non-trainable chunks (running statistics) and average mode publish the
//    mean as the new values; sync's trainable chunks hand it to the
//    optimizer as a gradient (ApplyMeanGradient).
//
// Threads: as AggregationPolicy; a barrier lives in its chunk, under its mu.
#ifndef PSTRAIN_SERVER_AGGREGATION_BARRIER_POLICY_H_
#define PSTRAIN_SERVER_AGGREGATION_BARRIER_POLICY_H_

#include <functional>
#include <string>

#include "server/aggregation/aggregation_policy.h"

namespace pstrain {

// A push that has been validated but not yet added to `target`.
struct BarrierContribution {
  const BarrierSum* target = nullptr;
  const std::string* worker_id = nullptr;
  absl::Span<const float> values;

  bool Targets(const BarrierSum& sum) const { return target == &sum; }
};

class BarrierPolicy : public AggregationPolicy {
 public:
  explicit BarrierPolicy(const AggregationConfig& config);

  bool HasCommonVersions() const override { return true; }
  absl::Status Push(ShardChunk& chunk, const PushArgs& args, absl::Span<const float> values,
                    PushOutcome* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) override;
  absl::Status ChunkAdopted(ShardChunk& chunk, PushOutcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) override;

 protected:
  // Sync's trainable chunks: applies the mean gradient `mean` to the
  // chunk's values. Called only for chunks whose PushKind is KIND_GRADIENT.
  virtual absl::Status ApplyMeanGradient(ShardChunk& chunk, const float* mean)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  // After a step has moved the chunk to its next version.
  virtual void StepCompleted([[maybe_unused]] ShardChunk& chunk)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {}

 private:
  // True when every member has pushed every part of the chunk's barrier
  // (counting `extra`, which may be null).
  bool BarrierReady(const ShardChunk& chunk, const BarrierContribution* extra) const
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu);
  // Applies or publishes the mean and advances the version; BarrierReady
  // must hold.
  absl::Status CompleteBarrier(ShardChunk& chunk, const BarrierContribution* extra,
                               PushOutcome* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

  const std::function<absl::Time()> clock_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_AGGREGATION_BARRIER_POLICY_H_
