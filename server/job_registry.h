// JobRegistry: every job server 0 knows, in submission order, with what of
// each changed since it was last saved, and the restore of the jobs a state
// directory holds. Jobs are never erased: a JobRecord* it hands out stays
// valid as long as the registry.
//
//   JobRegistry jobs;
//   PSTRAIN_RETURN_IF_ERROR(jobs.Load(store, checkpointer, validate, now, log));
//   JobRecord& job = jobs.Add(spec, graph, now);                    // "job-<n>"
//   PSTRAIN_ASSIGN_OR_RETURN(JobRecord* found, jobs.Get("job-3"));  // NOT_FOUND
//   for (const auto& [status, revision] : jobs.Unsaved().statuses) ...
//
// Threads: thread-compatible. The Coordinator owns it and calls it under its
// mutex, except Load (before any other call) and what Load calls back.
#ifndef PSTRAIN_SERVER_JOB_REGISTRY_H_
#define PSTRAIN_SERVER_JOB_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/checkpointer.h"
#include "server/job_record.h"
#include "server/job_store.h"

namespace pstrain {

class JobRegistry {
 public:
  // A saved spec as this server would take it (the Coordinator's checks).
  using Validate = std::function<absl::StatusOr<ModelGraph>(const v1::JobSpec&)>;

  // Adds every job `store` holds (after the ones already here): ended jobs
  // as they were, the others queued again from their latest checkpoint
  // (failed when `validate` refuses them); each with its history, a lost
  // history replaced by an empty one. Removes the temporary files of
  // interrupted checkpoint writes. The store's error (DATA_LOSS naming a
  // corrupt status).
  absl::Status Load(const JobStore& store, const Checkpointer& checkpoints,
                    const Validate& validate, absl::Time now,
                    const std::function<void(const std::string&)>& log);

  // A new job "job-<n>", n above every id issued, QUEUED.
  JobRecord& Add(v1::JobSpec spec, ModelGraph graph, absl::Time now);
  // Null for an unknown id.
  JobRecord* Find(const std::string& job_id) const;
  // NOT_FOUND "unknown job '<id>'" for an unknown id.
  absl::StatusOr<JobRecord*> Get(const std::string& job_id) const;
  // Every job, in submission order.
  const std::vector<JobRecord*>& jobs() const { return order_; }
  int CountIn(JobPhase phase) const;
  // Jobs by state, and stragglers over running jobs (CoordinatorStats).
  void Count(std::map<v1::JobState, int>* by_state, int* stragglers) const;

  // --- For Tick's talks with the shards --------------------------------------
  // Running jobs the shards hold.
  std::vector<std::string> RunningOnShards() const;
  // Why a shard should drop `job_id`: unknown here, or ended and dropped
  // already; "" when it should keep it.
  std::string WhyStray(const std::string& job_id) const;
  // The runs' pending member changes (each taken once), of running jobs the
  // shards hold, by job id.
  std::vector<std::pair<std::string, MembershipChange>> TakeMembershipChanges();
  // Ended jobs the shards still hold (and need not save first): marked as no
  // longer held, to be dropped.
  std::vector<std::string> TakeEndedOnShards();

  // The statuses and histories changed since they were last saved (copies,
  // with their revisions), and the marks once they are.
  struct Unsaved {
    std::vector<std::pair<v1::JobStatus, int64_t>> statuses;
    std::vector<std::pair<v1::JobHistory, int64_t>> histories;
  };
  Unsaved Changed() const;
  void StatusSaved(const std::string& job_id, int64_t revision);
  void HistorySaved(const std::string& job_id, int64_t revision);

 private:
  void Insert(std::unique_ptr<JobRecord> job);

  std::map<std::string, std::unique_ptr<JobRecord>> by_id_;
  std::vector<JobRecord*> order_;  // Submission order.
  int64_t next_number_ = 1;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_JOB_REGISTRY_H_
