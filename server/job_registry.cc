#include "server/job_registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/job_state.h"
#include "common/status_macros.h"
#include "server/worker_registry.h"

namespace pstrain {
namespace {

// A saved job as this server takes it back.
std::unique_ptr<JobRecord> Restore(v1::JobStatus status, const Checkpointer& checkpoints,
                                   const JobRegistry::Validate& validate, absl::Time now) {
  const std::string id = status.job_id();
  // A status saved before ApplyJobDefaults set the mode says what runs now.
  ApplyJobDefaults(status.mutable_spec());
  checkpoints.RemoveOrphans(id);
  // A job that would run again is checked like a new one (this server's
  // limits may be lower than those it was accepted under), so that a job
  // that cannot run fails here instead of taking the server down.
  absl::StatusOr<ModelGraph> graph =
      IsTerminal(status.state()) ? BuildJobGraph(status.spec()) : validate(status.spec());
  return std::make_unique<JobRecord>(std::move(status), std::move(graph),
                                     checkpoints.HasCheckpoint(id), now);
}

// The history is for reading back only: one that cannot be read costs the
// curves, never the job.
void RestoreHistory(const JobStore& store, JobRecord& job,
                    const std::function<void(const std::string&)>& log) {
  const std::string& id = job.status.job_id();
  absl::StatusOr<v1::JobHistory> history = store.LoadHistory(id);
  if (history.ok()) {
    job.history = *std::move(history);
  } else {
    log(absl::StrCat(id, ": its history is lost: ", history.status().message()));
    job.history.set_job_id(id);
    job.history_revision = 1;  // Saved again, readable.
  }
  job.persisted_history_revision = 0;
}

}  // namespace

absl::Status JobRegistry::Load(const JobStore& store, const Checkpointer& checkpoints,
                               const Validate& validate, absl::Time now,
                               const std::function<void(const std::string&)>& log) {
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<v1::JobStatus> saved, store.LoadJobs());
  for (v1::JobStatus& status : saved) {
    std::unique_ptr<JobRecord> job = Restore(std::move(status), checkpoints, validate, now);
    if (job->phase == JobPhase::kQueued) {
      log(absl::StrCat(job->status.job_id(), ": re-queued after a restart (",
                       job->has_checkpoint ? "from its checkpoint" : "from scratch", ")"));
    }
    RestoreHistory(store, *job, log);
    Insert(std::move(job));
  }
  return absl::OkStatus();
}

JobRecord& JobRegistry::Add(v1::JobSpec spec, ModelGraph graph, absl::Time now) {
  auto job = std::make_unique<JobRecord>(absl::StrCat("job-", next_number_), std::move(spec),
                                         std::move(graph), now);
  JobRecord& added = *job;
  Insert(std::move(job));
  return added;
}

void JobRegistry::Insert(std::unique_ptr<JobRecord> job) {
  const std::string id = job->status.job_id();
  next_number_ = std::max(next_number_, IdNumber(id, "job-") + 1);
  order_.push_back(job.get());
  by_id_[id] = std::move(job);
}

JobRecord* JobRegistry::Find(const std::string& job_id) const {
  auto it = by_id_.find(job_id);
  return it == by_id_.end() ? nullptr : it->second.get();
}

absl::StatusOr<JobRecord*> JobRegistry::Get(const std::string& job_id) const {
  JobRecord* job = Find(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
  return job;
}

int JobRegistry::CountIn(JobPhase phase) const {
  return static_cast<int>(std::count_if(order_.begin(), order_.end(),
                                        [phase](const JobRecord* j) { return j->phase == phase; }));
}

void JobRegistry::Count(std::map<v1::JobState, int>* by_state, int* stragglers) const {
  for (v1::JobState s : {v1::JOB_STATE_QUEUED, v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED,
                         v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED}) {
    (*by_state)[s] = 0;
  }
  for (const JobRecord* job : order_) {
    (*by_state)[job->status.state()]++;
    if (job->running()) *stragglers += job->status.stragglers_size();
  }
}

std::vector<std::string> JobRegistry::RunningOnShards() const {
  std::vector<std::string> running;
  for (const JobRecord* job : order_) {
    if (job->running() && job->shards_configured) running.push_back(job->status.job_id());
  }
  return running;
}

std::string JobRegistry::WhyStray(const std::string& job_id) const {
  const JobRecord* job = Find(job_id);
  if (job == nullptr) return "a job this server does not know";
  if (job->phase == JobPhase::kDone && !job->shards_configured && !job->save_on_stop) {
    return absl::StrCat("it ended (", v1::JobState_Name(job->status.state()), ")");
  }
  return "";
}

std::vector<std::pair<std::string, MembershipChange>> JobRegistry::TakeMembershipChanges() {
  std::vector<std::pair<std::string, MembershipChange>> changes;
  for (JobRecord* job : order_) {
    if (job->run == nullptr) continue;
    std::optional<MembershipChange> change = job->run->TakeMembershipChange();
    if (!change || !job->running() || !job->shards_configured) continue;
    changes.emplace_back(job->status.job_id(), *std::move(change));
  }
  return changes;
}

std::vector<std::string> JobRegistry::TakeEndedOnShards() {
  std::vector<std::string> ended;
  for (JobRecord* job : order_) {
    if (job->phase != JobPhase::kDone || !job->shards_configured || job->save_on_stop) continue;
    job->shards_configured = false;
    ended.push_back(job->status.job_id());
  }
  return ended;
}

JobRegistry::Unsaved JobRegistry::Changed() const {
  Unsaved unsaved;
  for (const JobRecord* job : order_) {
    if (job->revision > job->persisted_revision) {
      unsaved.statuses.emplace_back(job->status, job->revision);
    }
    if (job->history_revision > job->persisted_history_revision) {
      unsaved.histories.emplace_back(job->history, job->history_revision);
    }
  }
  return unsaved;
}

void JobRegistry::StatusSaved(const std::string& job_id, int64_t revision) {
  if (JobRecord* job = Find(job_id); job != nullptr) {
    job->persisted_revision = std::max(job->persisted_revision, revision);
  }
}

void JobRegistry::HistorySaved(const std::string& job_id, int64_t revision) {
  if (JobRecord* job = Find(job_id); job != nullptr) {
    job->persisted_history_revision = std::max(job->persisted_history_revision, revision);
  }
}

}  // namespace pstrain
