#include "server/aggregation/barrier_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

// True when adding `values` to `sum` element-wise would turn two finite
// floats into an infinity (|a + b| > FLT_MAX). One branch-free pass.
bool SumOverflows(const std::vector<float>& sum, absl::Span<const float> values) {
  const float* a = sum.data();
  const float* b = values.data();
  const size_t n = std::min(sum.size(), values.size());
  constexpr float kMax = std::numeric_limits<float>::max();
  bool any = false;
  for (size_t i = 0; i < n; ++i) {
    any |= std::fabs(a[i] + b[i]) > kMax && std::fabs(a[i]) <= kMax && std::fabs(b[i]) <= kMax;
  }
  return any;
}

// True when every member has contributed to `sum` (counting `extra`).
// Removed members' contributions stay in the sum: they were computed from
// the right version.
bool Covers(const BarrierSum& sum, const ShardMembership& membership,
            const BarrierContribution* extra) {
  const bool counts_extra = extra != nullptr && extra->Targets(sum);
  if (sum.contributors.empty() && !counts_extra) return false;
  for (const std::string& m : membership.members) {
    if (sum.contributors.count(m) == 0 && !(counts_extra && *extra->worker_id == m)) return false;
  }
  return true;
}

// The mean of `acc`'s contributions and `extra` (when it targets `acc`):
// either extra's own values (the only contribution) or acc->sum, overwritten
// with the mean. Exact division, so that the mean of two pushes is
// bit-identical to (a + b) / 2 whatever order they came in. Clears the
// contributors.
const float* TakeMean(BarrierSum* acc, const BarrierContribution* extra) {
  const bool counts_extra = extra != nullptr && extra->Targets(*acc);
  const size_t contributors = acc->contributors.size() + (counts_extra ? 1 : 0);
  acc->contributors.clear();
  if (counts_extra && contributors == 1) return extra->values.data();
  float* sum = acc->sum.data();
  const size_t n = acc->sum.size();
  const float divisor = static_cast<float>(contributors);
  if (counts_extra) {
    const float* in = extra->values.data();
    for (size_t i = 0; i < n; ++i) sum[i] = (sum[i] + in[i]) / divisor;
  } else if (contributors > 1) {
    for (size_t i = 0; i < n; ++i) sum[i] /= divisor;
  }
  return sum;
}

// Publishes the mean held by `acc` (or extra's values) as `*snapshot`.
void PublishMean(BarrierSum* acc, const BarrierContribution* extra,
                 std::shared_ptr<std::vector<float>>* snapshot) {
  const float* mean = TakeMean(acc, extra);
  if (mean != acc->sum.data()) acc->sum.assign(extra->values.begin(), extra->values.end());
  Publish(snapshot, &acc->sum);
}

}  // namespace

BarrierPolicy::BarrierPolicy(const AggregationConfig& config)
    : AggregationPolicy(config), clock_(config.clock) {}

absl::Status BarrierPolicy::Push(ShardChunk& chunk, const PushArgs& args,
                                 absl::Span<const float> values, PushOutcome* outcome) {
  if (args.version > chunk.version) {
    return absl::InvalidArgumentError(absl::StrCat("version ", args.version,
                                                   " is ahead of the server's ", chunk.version,
                                                   " (", chunk.Describe(job_id()), ")"));
  }
  if (args.version < chunk.version) {
    return absl::AbortedError(absl::StrCat("version ", args.version,
                                           " is stale: ", chunk.Describe(job_id()),
                                           " is at version ", chunk.version));
  }
  BarrierSum& barrier = args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE
                            ? chunk.slot_barriers[args.slot]
                            : chunk.values_barrier;
  if (barrier.contributors.count(args.worker_id) > 0) {
    if (args.incarnation != 0) {
      // A newer update of a member for a barrier it is already in (it
      // resynchronised after a failed step): its first contribution stands.
      outcome->duplicate = true;
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "duplicate push: worker ", args.worker_id, " already pushed ", KindName(args.kind),
        args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE ? absl::StrCat(" slot ", args.slot) : "",
        " for version ", args.version, " of ", chunk.Describe(job_id())));
  }
  // The mean is (sum + values) / n: refuse a push whose addition would
  // overflow to Inf (two finite gradients of 3e38 averaged to -Inf), before
  // anything is written.
  if (!barrier.contributors.empty() && SumOverflows(barrier.sum, values)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the push of ", KindName(args.kind), " to ", chunk.Describe(job_id()), " by worker ",
        args.worker_id, " overflows float when added to the other members' values for version ",
        args.version, "; values this large cannot be averaged"));
  }
  if (chunk.barrier_opened == absl::InfiniteFuture()) chunk.barrier_opened = clock_();
  const BarrierContribution contribution{&barrier, &args.worker_id, values};
  if (BarrierReady(chunk, &contribution)) return CompleteBarrier(chunk, &contribution, outcome);
  barrier.Add(args.worker_id, values);
  return absl::OkStatus();
}

absl::Status BarrierPolicy::ChunkAdopted(ShardChunk& chunk, PushOutcome* outcome) {
  if (!BarrierReady(chunk, nullptr)) return absl::OkStatus();
  return CompleteBarrier(chunk, nullptr, outcome);
}

bool BarrierPolicy::BarrierReady(const ShardChunk& chunk, const BarrierContribution* extra) const {
  const ShardMembership& membership = *chunk.membership;
  if (membership.dropped || !Covers(chunk.values_barrier, membership, extra)) return false;
  for (const BarrierSum& slot : chunk.slot_barriers) {
    if (!Covers(slot, membership, extra)) return false;
  }
  return true;
}

absl::Status BarrierPolicy::CompleteBarrier(ShardChunk& chunk, const BarrierContribution* extra,
                                            PushOutcome* outcome) {
  absl::Status status = absl::OkStatus();
  if (PushKind(chunk) == v1::ChunkHeader::KIND_GRADIENT) {
    status = ApplyMeanGradient(chunk, TakeMean(&chunk.values_barrier, extra));
  } else {
    PublishMean(&chunk.values_barrier, extra, &chunk.values);  // The mean becomes the values.
  }
  for (size_t s = 0; s < chunk.slot_barriers.size(); ++s) {
    PublishMean(&chunk.slot_barriers[s], extra, &chunk.slots[s]);
  }
  PSTRAIN_RETURN_IF_ERROR(status);
  ++chunk.version;
  ++outcome->applied_updates;
  if (chunk.barrier_opened != absl::InfiniteFuture()) {
    outcome->barrier_waits.push_back(clock_() - chunk.barrier_opened);
    chunk.barrier_opened = absl::InfiniteFuture();
  }
  StepCompleted(chunk);
  return absl::OkStatus();
}

absl::Status BarrierPolicy::ApplyMeanGradient(ShardChunk& chunk, const float* /*mean*/) {
  return absl::InternalError(
      absl::StrCat(name(), " mode applies no gradient to ", chunk.Describe(job_id())));
}

}  // namespace pstrain
