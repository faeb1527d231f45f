// PushPacer: push pacing of one sync job at one shard. A member may push at
// most `lead` frames of a version more than the slowest member has pushed
// here, so that the frames of one version reach the shards' ports in step
// and a chunk's barrier does not wait for the push that TCP served last
// (docs/BENCHMARKS.md, "Push pacing"). The lead is fixed, or chosen by a
// PaceLeadTuner (kAutoLead) that times the job's steps.
//
//   PushPacer pacer({.lead_frames = 1, .job_id = "j"});
//   int64_t slack = pacer.Slack("w1", version);  // Frames w1 may push now.
//   pacer.Count("w1", version, membership);      // After each accepted push.
//
// The pacer counts the frames each member pushed for the newest version
// pushed here: a member pushes version t + 1 only after pulling every chunk
// at t + 1, so older versions are done.
//
// Threads: thread-safe; every method takes mu_, a leaf (never held with a
// chunk's or the job's lock). Watchers are told with mu_ released.
#ifndef PSTRAIN_SERVER_AGGREGATION_PUSH_PACER_H_
#define PSTRAIN_SERVER_AGGREGATION_PUSH_PACER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/pace_lead_tuner.h"
#include "server/shard_calls.h"
#include "server/shard_chunk.h"

namespace pstrain {

class PushPacer {
 public:
  static constexpr int kAutoLead = -1;
  struct Options {
    int lead_frames = 0;                // 0 (or < 0 other than kAutoLead): not paced.
    PaceLeadTuner::Options tuner = {};  // kAutoLead.
    std::string job_id;                 // For the log line.
    // Told what the tuner chose, when first chosen or changed (null: not told).
    std::function<void(const std::string&)> log = nullptr;
    std::function<absl::Time()> clock = [] { return absl::Now(); };  // Times steps.
  };
  explicit PushPacer(Options options);

  bool paced() const { return lead_ != 0; }
  // Adds a watcher (held weakly), told whenever the slowest member has
  // pushed more here or left. False, and not added, when not paced.
  bool Watch(std::weak_ptr<PaceWatcher> watcher);
  // How many more frames of `version` `worker_id` may push here now: the
  // slowest member's frames of that version, plus the lead, less its own
  // (>= 0; AggregationPolicy::kUnpaced for a version already past or when
  // not paced).
  int64_t Slack(const std::string& worker_id, int64_t version) const;
  // Counts a member's accepted push of `version` and, when the slowest
  // member moved on, tells the watchers.
  void Count(const std::string& worker_id, int64_t version, const ShardMembership& membership);
  // The member set changed: a removed member no longer holds pushes back.
  void MembersChanged(const ShardMembership& membership);

 private:
  // Recomputes the slowest member's count for `membership`; true if it grew.
  bool UpdateMin(const ShardMembership& membership) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The lead for pushes of `version`.
  int64_t Lead(int64_t version) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The live watchers (the expired ones are forgotten).
  std::vector<std::shared_ptr<PaceWatcher>> LiveWatchers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction. kAutoLead: tuner_ sets the lead.
  const int lead_;
  const std::string job_id_;
  const std::function<void(const std::string&)> log_;
  const std::function<absl::Time()> clock_;

  mutable absl::Mutex mu_;
  int64_t version_ ABSL_GUARDED_BY(mu_) = -1;                   // The newest version pushed here.
  absl::Time version_started_ ABSL_GUARDED_BY(mu_);             // Its first push here.
  std::optional<PaceLeadTuner> tuner_ ABSL_GUARDED_BY(mu_);     // kAutoLead.
  std::map<std::string, int64_t> frames_ ABSL_GUARDED_BY(mu_);  // Of version_, per member.
  int64_t min_ ABSL_GUARDED_BY(mu_) = 0;                        // The slowest member's frames.
  std::vector<std::weak_ptr<PaceWatcher>> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_AGGREGATION_PUSH_PACER_H_
