#include "server/aggregation/push_pacer.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/aggregation/aggregation_policy.h"

namespace pstrain {

PushPacer::PushPacer(Options options)
    : lead_(options.lead_frames == kAutoLead ? kAutoLead : std::max(options.lead_frames, 0)),
      job_id_(std::move(options.job_id)),
      log_(std::move(options.log)),
      clock_(std::move(options.clock)) {
  if (lead_ == kAutoLead) {
    absl::MutexLock lock(&mu_);
    tuner_.emplace(options.tuner);
  }
}

bool PushPacer::Watch(std::weak_ptr<PaceWatcher> watcher) {
  if (lead_ == 0) return false;
  absl::MutexLock lock(&mu_);
  std::erase_if(watchers_, [](const std::weak_ptr<PaceWatcher>& w) { return w.expired(); });
  watchers_.push_back(std::move(watcher));
  return true;
}

int64_t PushPacer::Slack(const std::string& worker_id, int64_t version) const {
  if (lead_ == 0) return AggregationPolicy::kUnpaced;
  absl::MutexLock lock(&mu_);
  if (version < version_) return AggregationPolicy::kUnpaced;  // A retry of a step already done.
  const int64_t lead = Lead(version);
  if (version > version_) return lead;  // The first to push it.
  auto it = frames_.find(worker_id);
  const int64_t own = it == frames_.end() ? 0 : it->second;
  return std::max<int64_t>(0, min_ + lead - own);
}

int64_t PushPacer::Lead(int64_t version) const {
  return tuner_.has_value() ? tuner_->LeadFor(version) : lead_;
}

void PushPacer::Count(const std::string& worker_id, int64_t version,
                      const ShardMembership& membership) {
  std::vector<std::shared_ptr<PaceWatcher>> wake;
  std::string chosen;  // What the lead tuner chose, to log.
  {
    absl::MutexLock lock(&mu_);
    if (version < version_) return;
    if (version > version_) {
      // A new step: the one before took from its first push here to now.
      const absl::Time now = clock_();
      if (tuner_.has_value() && version_ >= 0 && version == version_ + 1) {
        const int before = tuner_->chosen();
        const bool first = tuner_->trial_summary().empty();  // No trial has ended.
        if (tuner_->StepTook(version_, now - version_started_)) {
          if (first || tuner_->chosen() != before) {
            chosen = absl::StrCat("job ", job_id_, ": push pacing lead ", tuner_->chosen(),
                                  " from version ", version, " (median step time with ",
                                  tuner_->trial_summary(), ")");
          }
        }
      }
      version_ = version;
      version_started_ = now;
      frames_.clear();
      min_ = 0;
    }
    ++frames_[worker_id];
    if (UpdateMin(membership)) wake = LiveWatchers();
  }
  if (!chosen.empty() && log_) log_(chosen);
  for (const std::shared_ptr<PaceWatcher>& w : wake) w->AllowanceChanged();
}

void PushPacer::MembersChanged(const ShardMembership& membership) {
  std::vector<std::shared_ptr<PaceWatcher>> wake;
  {
    absl::MutexLock lock(&mu_);
    if (UpdateMin(membership)) wake = LiveWatchers();
  }
  for (const std::shared_ptr<PaceWatcher>& w : wake) w->AllowanceChanged();
}

bool PushPacer::UpdateMin(const ShardMembership& membership) {
  int64_t slowest = INT64_MAX;
  for (const std::string& m : membership.members) {
    auto it = frames_.find(m);
    slowest = std::min<int64_t>(slowest, it == frames_.end() ? 0 : it->second);
  }
  if (slowest == INT64_MAX || slowest <= min_) return false;
  min_ = slowest;
  return true;
}

std::vector<std::shared_ptr<PaceWatcher>> PushPacer::LiveWatchers() {
  std::vector<std::shared_ptr<PaceWatcher>> live;
  std::erase_if(watchers_, [&live](const std::weak_ptr<PaceWatcher>& w) {
    std::shared_ptr<PaceWatcher> locked = w.lock();
    if (locked == nullptr) return true;
    live.push_back(std::move(locked));
    return false;
  });
  return live;
}

}  // namespace pstrain
