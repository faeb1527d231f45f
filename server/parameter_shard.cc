// ParameterShard: see parameter_shard.h for the contract.
//
// This file is the map of jobs and the shard's stats. One job's state, its
// chunks and how a push or a pull reaches them, is a ShardJob
// (server/shard_job.h, which also gives the lock order). ParameterShard::mu_
// guards the job map and the stats; it is held only for a lookup or a counter
// update, never while waiting or computing, and is a leaf.
#include "server/parameter_shard.h"

#include <algorithm>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/aggregation/push_pacer.h"
#include "server/shard_job.h"

namespace pstrain {


static_assert(ParameterShard::kAutoPaceLead == PushPacer::kAutoLead);

ParameterShard::ParameterShard(Options options) : options_(std::move(options)) {
  stats_.staleness_counts.assign(std::max(options_.staleness_buckets, 1), 0);
  stats_.barrier_wait_counts.assign(std::size(kBarrierWaitBounds) + 1, 0);
}

void ParameterShard::RecordBarrierWaits(absl::Span<const absl::Duration> waits) {
  for (const absl::Duration wait : waits) {
    const double seconds = absl::ToDoubleSeconds(wait);
    const auto* bound =
        std::lower_bound(std::begin(kBarrierWaitBounds), std::end(kBarrierWaitBounds), seconds);
    ++stats_.barrier_wait_counts[bound - std::begin(kBarrierWaitBounds)];
    stats_.barrier_wait_seconds += seconds;
  }
}

ParameterShard::~ParameterShard() = default;

absl::Status ParameterShard::ConfigureJob(const ShardJobConfig& config,
                                          const std::vector<v1::ChunkValues>& chunks) {
  auto job = std::make_shared<ShardJob>();
  PSTRAIN_RETURN_IF_ERROR(CheckId("job id", config.job_id));
  for (const std::string& id : config.members) PSTRAIN_RETURN_IF_ERROR(CheckId("worker id", id));
  PSTRAIN_RETURN_IF_ERROR(job->Init(config, chunks, options_));
  std::shared_ptr<ShardJob> replaced;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<ShardJob>& slot = jobs_[config.job_id];
    replaced = std::move(slot);
    slot = std::move(job);
  }
  if (replaced != nullptr) replaced->Drop();  // Its blocked pulls fail with ABORTED.
  return absl::OkStatus();
}

absl::Status ParameterShard::CheckId(const char* what, const std::string& id) const {
  return CheckIdLength(what, id, options_.max_id_bytes);
}

absl::Status ParameterShard::SetMembers(const std::string& job_id,
                                        const std::vector<std::string>& members, int64_t generation,
                                        v1::SetMembersResponse* response) {
  for (const std::string& id : members) PSTRAIN_RETURN_IF_ERROR(CheckId("worker id", id));
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(job_id));
  PSTRAIN_ASSIGN_OR_RETURN(PushOutcome outcome, job->SetMembers(members, generation, response));
  absl::MutexLock lock(&mu_);
  stats_.applied_updates += outcome.applied_updates;
  RecordBarrierWaits(outcome.barrier_waits);
  return absl::OkStatus();
}

absl::Status ParameterShard::DropJob(const std::string& job_id) {
  std::shared_ptr<ShardJob> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("unknown job ", job_id));
    job = std::move(it->second);
    jobs_.erase(it);
    stats_.model_version_by_job.erase(job_id);
  }
  job->Drop();
  return absl::OkStatus();
}

std::vector<std::string> ParameterShard::JobIds() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  ids.reserve(jobs_.size());
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

absl::StatusOr<int64_t> ParameterShard::Push(const PushArgs& args, absl::Span<const float> values) {
  std::shared_ptr<ShardJob> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(args.job_id);
    if (it == jobs_.end()) {
      ++stats_.rejected_pushes;
      return absl::NotFoundError(absl::StrCat("unknown job ", args.job_id));
    }
    job = it->second;
  }
  PushOutcome outcome;
  absl::StatusOr<int64_t> version = job->Push(args, values, options_.reject_non_finite, &outcome);
  absl::MutexLock lock(&mu_);
  stats_.applied_updates += outcome.applied_updates;
  RecordBarrierWaits(outcome.barrier_waits);
  if (!version.ok()) {
    ++stats_.rejected_pushes;
    return version;
  }
  if (outcome.duplicate) ++stats_.duplicate_pushes;
  ++stats_.pushes;
  const int64_t represented = static_cast<int64_t>(values.size() * sizeof(float));
  stats_.push_bytes += args.payload_bytes >= 0 ? args.payload_bytes : represented;
  stats_.push_represented_bytes += represented;
  if (jobs_.count(args.job_id) != 0) {
    int64_t& model_version = stats_.model_version_by_job[args.job_id];
    model_version = std::max(model_version, *version);
  }
  if (outcome.staleness >= 0) {
    const int64_t last = static_cast<int64_t>(stats_.staleness_counts.size()) - 1;
    ++stats_.staleness_counts[std::min(outcome.staleness, last)];
  }
  return version;
}

absl::StatusOr<PulledChunk> ParameterShard::Pull(const PullArgs& args, absl::Time deadline) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(args.job_id));
  PSTRAIN_ASSIGN_OR_RETURN(PulledChunk pulled, job->Pull(args, deadline));
  absl::MutexLock lock(&mu_);
  ++stats_.pulls;
  const int64_t represented = static_cast<int64_t>(pulled.values->size() * sizeof(float));
  stats_.pull_bytes +=
      pulled.delta != nullptr ? static_cast<int64_t>(pulled.delta->bytes.size()) : represented;
  stats_.pull_represented_bytes += represented;
  if (jobs_.count(args.job_id) != 0) {
    int64_t& model_version = stats_.model_version_by_job[args.job_id];
    model_version = std::max(model_version, pulled.version);
  }
  return pulled;
}

absl::StatusOr<std::vector<v1::ChunkValues>> ParameterShard::ReadChunks(const std::string& job_id,
                                                                        ReadOptions options,
                                                                        absl::Time deadline) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(job_id));
  return job->ReadChunks(options, deadline);
}

absl::StatusOr<std::shared_ptr<ShardJob>> ParameterShard::FindJob(
    const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("unknown job ", job_id));
  return it->second;
}

absl::StatusOr<bool> ParameterShard::WatchPace(const std::string& job_id,
                                               std::weak_ptr<PaceWatcher> watcher) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(job_id));
  return job->WatchPace(std::move(watcher));
}

absl::StatusOr<int64_t> ParameterShard::PaceSlack(const std::string& job_id,
                                                  const std::string& worker_id,
                                                  int64_t version) const {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(job_id));
  return job->PaceSlack(worker_id, version);
}

absl::StatusOr<ChunkPlan> ParameterShard::Plan(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("unknown job ", job_id));
  return it->second->plan();
}

ShardStats ParameterShard::stats() const {
  absl::MutexLock lock(&mu_);
  ShardStats stats = stats_;
  for (const auto& [id, job] : jobs_) {
    stats.waiting_pulls += job->waiting_pulls();
    stats.waiting_cuts += job->waiting_cuts();
  }
  return stats;
}

}  // namespace pstrain
