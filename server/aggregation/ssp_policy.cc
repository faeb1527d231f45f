#include "server/aggregation/ssp_policy.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pstrain {

absl::StatusOr<std::unique_ptr<SspPolicy>> SspPolicy::Create(const AggregationConfig& config) {
  PSTRAIN_ASSIGN_OR_RETURN(
      std::unique_ptr<ServerOptimizer> optimizer,
      ServerOptimizer::Create(config.optimizer,
                              absl::StrCat("ConfigureJob(", config.job_id, "): ")));
  return std::unique_ptr<SspPolicy>(new SspPolicy(config, std::move(optimizer)));
}

void SspPolicy::Pushed(const PushArgs& args, const ShardMembership& /*membership*/,
                       bool /*duplicate*/) {
  // After the update is visible, so that a pull released by this clock sees it.
  absl::MutexLock lock(&clock_mu_);
  if (membership_->Has(args.worker_id)) {
    int64_t& clock = clocks_[args.worker_id];
    clock = std::max<int64_t>(clock, args.worker_clock);
  }
}

int64_t SspPolicy::MinClock() const {
  int64_t slowest = INT64_MAX;
  for (const std::string& w : membership_->members) {
    auto it = clocks_.find(w);
    slowest = std::min<int64_t>(slowest, it == clocks_.end() ? 0 : it->second);
  }
  return slowest;
}

absl::Status SspPolicy::AwaitPull(const PullArgs& args, absl::Time deadline) {
  absl::MutexLock lock(&clock_mu_);
  const int64_t needed = static_cast<int64_t>(args.worker_clock) - staleness_;
  auto released = [&]() {
    clock_mu_.AssertReaderHeld();
    return membership_->dropped || !membership_->Has(args.worker_id) || MinClock() >= needed;
  };
  if (!clock_mu_.AwaitWithDeadline(absl::Condition(&released), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("ssp: worker ", args.worker_id, " at clock ", args.worker_clock,
                     " waited for the slowest member of job ", job_id(), " (clock ", MinClock(),
                     ") to reach ", needed, " until the deadline"));
  }
  if (membership_->dropped) {
    return absl::AbortedError(absl::StrCat("job ", job_id(), " was dropped"));
  }
  if (!membership_->Has(args.worker_id)) {
    return absl::AbortedError(
        absl::StrCat("worker ", args.worker_id, " was removed from job ", job_id()));
  }
  return absl::OkStatus();
}

void SspPolicy::AdoptMembership(std::shared_ptr<const ShardMembership> next) {
  absl::MutexLock lock(&clock_mu_);
  if (!next->dropped) {
    // A member that joins starts at the slowest clock of those that stay.
    std::map<std::string, int64_t> clocks;
    int64_t slowest = INT64_MAX;
    for (const std::string& w : next->members) {
      if (auto it = clocks_.find(w); it != clocks_.end()) {
        clocks[w] = it->second;
        slowest = std::min(slowest, it->second);
      }
    }
    for (const std::string& w : next->members) {
      if (clocks.count(w) == 0) clocks[w] = slowest == INT64_MAX ? 0 : slowest;
    }
    clocks_ = std::move(clocks);
  }
  membership_ = std::move(next);
}

}  // namespace pstrain
