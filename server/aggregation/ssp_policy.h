// SspPolicy: stale synchronous parallel (bounded staleness s). Pushes as in
// async mode (async_policy.h); in addition each member has a clock, the
// steps it has pushed (PushArgs::worker_clock, the highest accepted), and a
// pull of a member whose clock is c waits until every member's clock is
// >= c - s (AwaitPull), so that no member runs more than s steps ahead of
// the slowest. A clock moves after its push is visible, so that a pull it
// releases sees the update. A member that joins starts at the slowest clock
// of those that stay, so that it does not hold the others back (it pulls
// current parameters); removing the slowest member releases the waiters.
//
// Threads: as AggregationPolicy; the clocks and the policy's copy of the
// member set are guarded by clock_mu_, a leaf.
#ifndef PSTRAIN_SERVER_AGGREGATION_SSP_POLICY_H_
#define PSTRAIN_SERVER_AGGREGATION_SSP_POLICY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "server/aggregation/async_policy.h"

namespace pstrain {

class SspPolicy final : public AsyncPolicy {
 public:
  static absl::StatusOr<std::unique_ptr<SspPolicy>> Create(const AggregationConfig& config);

  const char* name() const override { return "ssp"; }
  void Pushed(const PushArgs& args, const ShardMembership& membership, bool duplicate) override;
  absl::Status AwaitPull(const PullArgs& args, absl::Time deadline) override;
  void AdoptMembership(std::shared_ptr<const ShardMembership> next) override;

 private:
  SspPolicy(const AggregationConfig& config, std::unique_ptr<ServerOptimizer> optimizer)
      : AsyncPolicy(config, std::move(optimizer)), staleness_(config.staleness) {}

  int64_t MinClock() const ABSL_SHARED_LOCKS_REQUIRED(clock_mu_);

  const int staleness_;  // Constant after construction.

  mutable absl::Mutex clock_mu_;
  // The job's member set, as the store last adopted it.
  std::shared_ptr<const ShardMembership> membership_ ABSL_GUARDED_BY(clock_mu_) =
      std::make_shared<ShardMembership>();
  std::map<std::string, int64_t> clocks_ ABSL_GUARDED_BY(clock_mu_);  // Per member.
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_AGGREGATION_SSP_POLICY_H_
