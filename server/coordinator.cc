#include "server/coordinator.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "common/status_macros.h"
#include "kernels/optimizer.h"
#include "server/eval_merge.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;

enum class Phase {
  kQueued,      // Waiting for workers.
  kStarting,    // Workers reserved; shards being configured (inside Tick).
  kRunning,     // Assignments published.
  kFinalizing,  // Every member finished; final checkpoint being written.
  kDone,        // Terminal state.
};

bool IsTerminal(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
}

int64_t ToUnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

// "RUNNING" for JOB_STATE_RUNNING.
std::string StateName(v1::JobState s) {
  const std::string name = v1::JobState_Name(s);
  return absl::StartsWith(name, "JOB_STATE_") ? name.substr(10) : name;
}

// "job-12" -> 12; 0 when the id has another form.
int64_t IdNumber(const std::string& id, const std::string& prefix) {
  int64_t n = 0;
  if (!absl::StartsWith(id, prefix) || !absl::SimpleAtoi(id.substr(prefix.size()), &n)) return 0;
  return n;
}

// `text` cut to at most `max_bytes` (a note says so).
std::string Truncated(const std::string& text, int max_bytes) {
  if (static_cast<int64_t>(text.size()) <= max_bytes) return text;
  return absl::StrCat(text.substr(0, static_cast<size_t>(max_bytes)), "... (",
                      text.size() - static_cast<size_t>(max_bytes), " more bytes cut)");
}

}  // namespace

// ---------------------------------------------------------------------------
// State
// ---------------------------------------------------------------------------

struct Coordinator::Worker {
  std::string id;
  v1::WorkerInfo info;
  std::string job_id;        // The job it trains (an unfinished member), or "".
  std::string finished_job;  // The last job it finished training.
  absl::Time last_heartbeat;
  bool alive = true;
};

struct Coordinator::Member {
  std::string worker_id;
  int rank = 0;
  bool reported = false;
  int epoch = 0;
  int64_t step = 0;
  int64_t steps_per_epoch = 0;  // As last reported; 0 = unknown.
  double loss = 0, train_accuracy = 0, samples_per_sec = 0;
  bool finished = false;
  v1::EvalMetrics eval;
  int64_t run_steps = 0;        // As its heartbeats last said.
  absl::Time steps_changed_at;  // When run_steps last changed (or the run began).
};

struct Coordinator::Job {
  v1::JobStatus status;
  ModelGraph graph;
  Phase phase = Phase::kQueued;
  std::vector<Member> members;  // Rank order.
  int64_t generation = 0;
  std::string run_id;              // Of the current run ("" before the first).
  int start_epoch = 0;             // Epoch the current run started from.
  int64_t start_step = 0;          // Global step the current run started from.
  bool shards_configured = false;  // The shards hold the job (DropJob when done).
  bool membership_dirty = false;   // Shards need SetMembers.
  // Members removed whose untrained work is not redistributed yet (their
  // steps come back from the shards' SetMembers): EpochPlan waits.
  std::vector<std::string> lost_pending;
  std::unique_ptr<EpochPlanner> planner;  // Of the current run.
  bool save_on_stop = false;       // Save the model before dropping it (cancel).
  int last_checkpoint_epoch = -1;
  absl::Time last_checkpoint_time;  // Of this run (its start until the first).
  bool has_checkpoint = false;
  int64_t revision = 1;
  int64_t persisted_revision = 0;
  v1::JobHistory history;
  int64_t history_revision = 0;  // Bumped with every change to `history`.
  int64_t persisted_history_revision = 0;
};

struct Coordinator::StartWork {
  std::string job_id;
  v1::JobSpec spec;
  ModelGraph graph;
  std::vector<std::string> members;
  int64_t generation = 0;
  bool resume = false;
  int64_t step_before = 0;  // The job's step when it was interrupted (resume).
};

struct Coordinator::CheckpointWork {
  enum Kind { kEpoch, kInterval, kFinal, kStop };
  Kind kind = kEpoch;
  std::string job_id;
  v1::JobSpec spec;
  ModelGraph graph;
  int epoch = 0;
  int64_t step = 0;
  int64_t steps_per_epoch = 0;  // As the members report it; 0 = unknown.
  // sync: the data position of every version up to the newest (the run's
  // planner knows where its epochs' tails shift versions); empty = unknown.
  std::function<std::pair<int, int64_t>(int64_t)> position_of_version;
};

// ---------------------------------------------------------------------------
// Construction
// ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options,
                                                                 ShardController* shards) {
  if (shards == nullptr || shards->num_shards() < 1) {
    return absl::InvalidArgumentError("the coordinator needs at least one shard");
  }
  if (options.heartbeat_timeout <= absl::ZeroDuration() ||
      options.heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("heartbeat timeout and interval must be > 0");
  }
  if (options.max_workers_per_job < 1) {
    return absl::InvalidArgumentError("max_workers_per_job must be >= 1");
  }
  if (options.max_queued_jobs < 1 || options.max_workers < 1 || options.max_id_bytes < 16 ||
      options.max_worker_info_bytes < 1 || options.max_reason_bytes < 1 ||
      options.max_eval_samples < 1 || options.max_history_points < 2 ||
      options.job_limits.max_parameters < 1 || options.job_limits.max_parameter_bytes < 4 ||
      options.job_limits.max_name_bytes < 1 ||
      options.forget_dead_workers_after <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "coordinator limits must be >= 1 (max_id_bytes >= 16, max_history_points >= 2, "
        "forget_dead_workers_after > 0)");
  }
  if (!options.clock) options.clock = [] { return absl::Now(); };
  const bool start_thread = options.start_background_thread;
  std::unique_ptr<Coordinator> c(new Coordinator(std::move(options), shards));
  PSTRAIN_RETURN_IF_ERROR(c->LoadState());
  c->PersistChangedJobs();
  if (start_thread) c->background_ = std::thread([raw = c.get()] { raw->BackgroundLoop(); });
  return c;
}

namespace {
uint64_t RandomIncarnation() {
  absl::BitGen bits;
  return absl::Uniform<uint64_t>(bits);
}
}  // namespace

Coordinator::Coordinator(Options options, ShardController* shards)
    : options_(std::move(options)),
      shards_(shards),
      incarnation_(RandomIncarnation()),
      store_(options_.state_dir),
      checkpointer_({.state_dir = options_.state_dir,
                     .keep = options_.keep_checkpoints,
                     .log = [this](const std::string& line) { Log(line); }}) {
  absl::MutexLock lock(&mu_);
  shard_addresses_ = options_.shard_addresses;
}

void Coordinator::SetShardAddresses(std::vector<std::string> addresses) {
  absl::MutexLock lock(&mu_);
  shard_addresses_ = std::move(addresses);
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    wake_ = true;
  }
  if (background_.joinable()) background_.join();
}

void Coordinator::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::cerr << "pstrain-server: " << line << std::endl;
  }
}

absl::Status Coordinator::LoadState() {
  if (options_.state_dir.empty()) return absl::OkStatus();
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<v1::JobStatus> saved, store_.LoadJobs());
  PSTRAIN_ASSIGN_OR_RETURN(const int64_t next_worker, store_.LoadNextWorkerId());
  absl::MutexLock lock(&mu_);
  next_worker_ = next_worker;
  for (v1::JobStatus& status : saved) {
    const std::string id = status.job_id();
    const int64_t n = IdNumber(id, "job-");
    auto job = std::make_unique<Job>();
    job->status = std::move(status);
    checkpointer_.RemoveOrphans(id);
    job->has_checkpoint = checkpointer_.HasCheckpoint(id);
    job->persisted_revision = job->revision;
    const v1::JobState state = job->status.state();
    // A job that would run again is checked like a new one (this server's
    // limits may be lower than those it was accepted under), so that a job
    // that cannot run fails here instead of taking the server down.
    absl::StatusOr<ModelGraph> graph = IsTerminal(state)
                                           ? BuildModelGraph(job->status.spec().model())
                                           : ValidateJob(job->status.spec());
    if (graph.ok()) job->graph = *std::move(graph);
    if (IsTerminal(state)) {
      job->phase = Phase::kDone;
    } else if (!graph.ok()) {
      job->phase = Phase::kDone;
      job->status.set_state(v1::JOB_STATE_FAILED);
      job->status.set_reason(absl::StrCat("server restarted and the saved job is invalid: ",
                                          graph.status().message()));
      job->status.set_finished_unix_ms(ToUnixMs(Now()));
      job->revision++;
    } else {
      job->phase = Phase::kQueued;
      job->status.set_state(v1::JOB_STATE_QUEUED);
      job->status.clear_workers();
      job->status.set_reason(job->has_checkpoint
                                 ? absl::StrCat("server restarted; resumes from the checkpoint "
                                                "of epoch ",
                                                job->status.epoch())
                                 : "server restarted; restarts from the beginning");
      job->revision++;
      Log(absl::StrCat(id, ": re-queued after a restart (",
                       job->has_checkpoint ? "from its checkpoint" : "from scratch", ")"));
    }
    // The history is for reading back only: one that cannot be read costs
    // the curves, never the job.
    absl::StatusOr<v1::JobHistory> history = store_.LoadHistory(id);
    if (history.ok()) {
      job->history = *std::move(history);
    } else {
      Log(absl::StrCat(id, ": its history is lost: ", history.status().message()));
      job->history.set_job_id(id);
      job->history_revision = 1;  // Saved again, readable.
    }
    job->persisted_history_revision = 0;
    next_job_ = std::max(next_job_, n + 1);
    job_order_.push_back(id);
    jobs_[id] = std::move(job);
  }
  RefreshQueueReasons();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Jobs
// ---------------------------------------------------------------------------

absl::StatusOr<ModelGraph> Coordinator::ValidateJob(const v1::JobSpec& spec) const {
  if (spec.workers() < 0 || spec.workers() > options_.max_workers_per_job) {
    return absl::InvalidArgumentError(absl::StrCat(
        "workers must be in [1, ", options_.max_workers_per_job, "], got ", spec.workers()));
  }
  PSTRAIN_RETURN_IF_ERROR(ValidateJobSpec(spec));
  PSTRAIN_RETURN_IF_ERROR(ValidateOptimizerSpec(spec.optimizer()));
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, BuildModelGraph(spec.model()));
  PSTRAIN_RETURN_IF_ERROR(CheckJobLimits(spec, graph, options_.job_limits));
  PSTRAIN_RETURN_IF_ERROR(
      PlanChunks(graph, shards_->num_shards(), shards_->chunk_bytes()).status());
  return graph;
}

absl::Status Coordinator::CheckId(const char* what, const std::string& id) const {
  return CheckIdLength(what, id, options_.max_id_bytes);
}

absl::StatusOr<std::string> Coordinator::SubmitJob(v1::JobSpec spec) {
  if (spec.model().layers_size() == 0) {
    return absl::InvalidArgumentError(
        spec.model_file().empty()
            ? "the job has no model: set `model` (or `model_file`, resolved by the client)"
            : absl::StrCat("the model must be sent inline; model_file '", spec.model_file(),
                           "' is resolved by the client"));
  }
  spec.clear_model_file();
  ApplyJobDefaults(&spec);
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, ValidateJob(spec));

  std::string job_id;
  {
    absl::MutexLock lock(&mu_);
    int queued = 0;
    for (const auto& [id, job] : jobs_) queued += job->phase == Phase::kQueued ? 1 : 0;
    if (queued >= options_.max_queued_jobs) {
      return absl::ResourceExhaustedError(
          absl::StrCat(queued,
                       " jobs are queued, the most this server takes (--max-queued-jobs); "
                       "submit again once some have started"));
    }
    job_id = absl::StrCat("job-", next_job_++);
    auto job = std::make_unique<Job>();
    job->graph = std::move(graph);
    job->status.set_job_id(job_id);
    job->history.set_job_id(job_id);
    job->status.set_name(spec.name());
    job->status.set_state(v1::JOB_STATE_QUEUED);
    *job->status.mutable_spec() = std::move(spec);
    job->status.set_submitted_unix_ms(ToUnixMs(Now()));
    job_order_.push_back(job_id);
    jobs_[job_id] = std::move(job);
    RefreshQueueReasons();
    Log(absl::StrCat(job_id, ": queued (", jobs_[job_id]->status.reason(), ")"));
    Wake();
  }
  PersistChangedJobs();
  return job_id;
}

absl::StatusOr<v1::JobStatus> Coordinator::GetJob(const std::string& job_id) const {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  Job* job = FindJob(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
  return job->status;
}

absl::StatusOr<v1::JobHistory> Coordinator::GetJobHistory(const std::string& job_id) const {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  Job* job = FindJob(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
  return job->history;
}

std::vector<v1::JobStatus> Coordinator::ListJobs() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::JobStatus> out;
  for (auto it = job_order_.rbegin(); it != job_order_.rend(); ++it) {
    out.push_back(jobs_.at(*it)->status);
  }
  return out;
}

absl::StatusOr<v1::JobStatus> Coordinator::CancelJob(const std::string& job_id) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  v1::JobStatus status;
  {
    absl::MutexLock lock(&mu_);
    Job* job = FindJob(job_id);
    if (job == nullptr) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
    if (job->phase == Phase::kDone) return job->status;
    const bool was_running = job->phase == Phase::kRunning;
    Finish(*job, v1::JOB_STATE_CANCELLED, "cancelled by user");
    // The last model is kept: save it before the shards forget the job.
    job->save_on_stop = was_running && job->shards_configured;
    Wake();
    status = job->status;
  }
  PersistChangedJobs();
  return status;
}

absl::StatusOr<JobUpdate> Coordinator::WaitForJobUpdate(const std::string& job_id,
                                                        int64_t after_revision,
                                                        absl::Time deadline) const {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  Job* job = FindJob(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
  // Jobs are never erased, so `job` stays valid while we wait.
  auto changed = [job, after_revision] { return job->revision > after_revision; };
  mu_.AwaitWithDeadline(absl::Condition(&changed), deadline);
  return JobUpdate{job->status, job->revision};
}

absl::StatusOr<std::string> Coordinator::CheckpointPath(const std::string& job_id) const {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  Job* job = FindJob(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("unknown job '", job_id, "'"));
  if (!job->has_checkpoint) {
    return absl::FailedPreconditionError(absl::StrCat(job_id, " has no checkpoint yet (state ",
                                                      StateName(job->status.state()), ")"));
  }
  return checkpointer_.LatestPath(job_id);
}

// ---------------------------------------------------------------------------
// Workers
// ---------------------------------------------------------------------------

absl::Status Coordinator::SaveNextWorkerId() { return store_.SaveNextWorkerId(next_worker_); }

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::RegisterWorker(
    const v1::WorkerInfo& info, const std::string& previous_worker_id) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("previous_worker_id", previous_worker_id));
  if (const size_t bytes = info.ByteSizeLong();
      bytes > static_cast<size_t>(options_.max_worker_info_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("worker info has ", bytes, " bytes; at most ",
                                                   options_.max_worker_info_bytes, " are allowed"));
  }
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(workers_.size()) >= options_.max_workers) ForgetDeadWorkers();
  if (static_cast<int64_t>(workers_.size()) >= options_.max_workers) {
    return absl::ResourceExhaustedError(
        absl::StrCat(workers_.size(),
                     " workers are registered, the most this server takes "
                     "(--max-workers)"));
  }
  auto worker = std::make_unique<Worker>();
  // The caller's previous id when this state directory issued it and it is
  // free (the caller registers again after a restart); else a new one.
  const int64_t previous = IdNumber(previous_worker_id, "worker-");
  if (previous > 0 && previous < next_worker_ &&
      previous_worker_id == absl::StrCat("worker-", previous) &&
      workers_.count(previous_worker_id) == 0) {
    worker->id = previous_worker_id;
  } else {
    worker->id = absl::StrCat("worker-", next_worker_++);
    // Saved before the id is handed out: never issued twice.
    if (absl::Status saved = SaveNextWorkerId(); !saved.ok()) {
      --next_worker_;
      return absl::UnavailableError(
          absl::StrCat("cannot save the worker id counter: ", saved.message()));
    }
  }
  worker->info = info;
  worker->last_heartbeat = Now();
  v1::RegisterWorkerResponse response;
  response.set_worker_id(worker->id);
  response.set_heartbeat_interval_ms(
      static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  for (const std::string& a : shard_addresses_) response.add_shards(a);
  Log(absl::StrCat(worker->id,
                   worker->id == previous_worker_id ? ": registered again (" : ": registered (",
                   info.hostname(), ", ", info.backend(), ")"));
  workers_[worker->id] = std::move(worker);
  RefreshQueueReasons();
  Wake();
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const std::string& worker_id,
                                                             const std::string& job_id,
                                                             const std::string& run_id,
                                                             int64_t run_steps) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("run_id", run_id));
  PSTRAIN_RETURN_IF_ERROR(CheckId("worker_id", worker_id));
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  v1::HeartbeatResponse response;
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    response.set_action(v1::HeartbeatResponse::ACTION_REREGISTER);
    return response;
  }
  Worker& worker = *it->second;
  worker.last_heartbeat = Now();
  if (!worker.alive) {
    worker.alive = true;
    Log(absl::StrCat(worker_id, ": heartbeats again; back in the pool"));
    RefreshQueueReasons();
    Wake();
  }
  // The job whose assignment is published for this worker, if any.
  const Job* current = nullptr;
  Member* member = nullptr;
  if (!worker.job_id.empty()) {
    Job* job = FindJob(worker.job_id);
    if (job != nullptr && job->phase == Phase::kRunning) {
      for (Member& m : job->members) {
        if (m.worker_id == worker_id && !m.finished) member = &m;
      }
      if (member != nullptr) current = job;
    }
  }
  if (!job_id.empty() && (current == nullptr || job_id != worker.job_id) &&
      job_id != worker.finished_job) {
    response.set_action(v1::HeartbeatResponse::ACTION_STOP);
    return response;
  }
  if (current == nullptr) {
    response.set_action(v1::HeartbeatResponse::ACTION_IDLE);
    return response;
  }
  if (run_steps >= 0 && run_id == current->run_id) {
    if (run_steps != member->run_steps) {
      member->run_steps = run_steps;
      member->steps_changed_at = Now();
    }
  }
  response.set_action(v1::HeartbeatResponse::ACTION_RUN);
  v1::Assignment* a = response.mutable_assignment();
  a->set_job_id(current->status.job_id());
  // The spec (model included) only to a worker that does not run this run
  // yet: it does not change within a run (issue 11, lean heartbeats).
  if (run_id != current->run_id) *a->mutable_spec() = current->status.spec();
  a->set_rank(member->rank);
  a->set_world_size(static_cast<int32_t>(current->members.size()));
  a->set_start_epoch(std::max(current->start_epoch, current->status.epoch()));
  a->set_generation(current->generation);
  a->set_run_id(current->run_id);
  a->set_start_step(current->start_step);
  return response;
}

absl::StatusOr<bool> Coordinator::ReportProgress(const v1::ReportProgressRequest& report) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("worker_id", report.worker_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", report.job_id()));
  {
    absl::MutexLock lock(&mu_);
    auto wit = workers_.find(report.worker_id());
    if (wit == workers_.end()) {
      return absl::NotFoundError(
          absl::StrCat("unknown worker '", report.worker_id(), "'; register again"));
    }
    Worker& worker = *wit->second;
    Job* job = FindJob(report.job_id());
    if (job == nullptr) {
      return absl::NotFoundError(absl::StrCat("unknown job '", report.job_id(), "'"));
    }
    worker.last_heartbeat = Now();
    Member* member = nullptr;
    for (Member& m : job->members) {
      if (m.worker_id == report.worker_id()) member = &m;
    }
    if (job->phase == Phase::kDone) return job->status.state() != v1::JOB_STATE_SUCCEEDED;
    if (member == nullptr || job->phase == Phase::kQueued || job->phase == Phase::kStarting) {
      return true;
    }
    if (!report.run_id().empty() && report.run_id() != job->run_id) {
      return true;  // A replaced run: its worker stops; nothing it says counts.
    }
    if (member->finished) return false;

    if (report.error().empty() && !report.finished() &&
        (report.epoch() < 0 || report.epoch() > job->status.spec().epochs() || report.step() < 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "progress of ", report.worker_id(), ": epoch ", report.epoch(), " is outside [0, ",
          job->status.spec().epochs(), "] or step ", report.step(), " is negative"));
    }
    if (!report.error().empty()) {
      Finish(*job, v1::JOB_STATE_FAILED,
             absl::StrCat(report.worker_id(), " (rank ", member->rank,
                          ") failed: ", Truncated(report.error(), options_.max_reason_bytes)));
      Wake();
    } else {
      if (report.finished()) PSTRAIN_RETURN_IF_ERROR(CheckEvalShard(*job, report));
      member->reported = true;
      if (report.finished()) {
        // Done means every epoch: the final report's training figures are
        // not needed (the last progress report's loss and accuracy stay).
        member->epoch = job->status.spec().epochs();
        member->step = std::max(member->step, report.step());
        member->samples_per_sec = 0;
      } else {
        member->epoch = report.epoch();
        member->step = report.step();
        member->loss = report.loss();
        member->train_accuracy = report.train_accuracy();
        member->samples_per_sec = report.samples_per_sec();
        if (report.steps_per_epoch() > 0) member->steps_per_epoch = report.steps_per_epoch();
      }
      if (report.finished()) {
        member->finished = true;
        member->eval = report.eval_shard();
        worker.job_id.clear();
        worker.finished_job = job->status.job_id();
        Log(absl::StrCat(job->status.job_id(), ": ", report.worker_id(), " finished (",
                         report.eval_shard().samples(), " test samples)"));
        RefreshQueueReasons();
      }
      const int old_epoch = job->status.epoch();
      RefreshAggregates(*job);
      if (!report.finished()) RecordHistory(*job);
      if (report.finished() || job->status.epoch() != old_epoch) Wake();
    }
    Touch(*job);
    if (job->phase == Phase::kDone) return true;
  }
  return false;
}

absl::StatusOr<v1::EpochPlanResponse> Coordinator::EpochPlan(const v1::EpochPlanRequest& request) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("worker_id", request.worker_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", request.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckId("run_id", request.run_id()));
  absl::MutexLock lock(&mu_);
  auto wit = workers_.find(request.worker_id());
  if (wit == workers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("unknown worker '", request.worker_id(), "'; register again"));
  }
  Job* job = FindJob(request.job_id());
  if (job == nullptr)
    return absl::NotFoundError(absl::StrCat("unknown job '", request.job_id(), "'"));
  if (job->phase != Phase::kRunning || job->planner == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(request.job_id(), " is not running"));
  }
  if (request.run_id() != job->run_id) {
    return absl::AbortedError(absl::StrCat("run ", request.run_id(), " of ", request.job_id(),
                                           " is not its current run"));
  }
  std::vector<std::string> members;
  for (const Member& m : job->members) members.push_back(m.worker_id);
  if (std::find(members.begin(), members.end(), request.worker_id()) == members.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat(request.worker_id(), " is not a member of ", request.job_id()));
  }
  if (request.batch_size() != job->status.spec().batch_size()) {
    return absl::InvalidArgumentError(absl::StrCat("batch size ", request.batch_size(),
                                                   " is not the job's ",
                                                   job->status.spec().batch_size()));
  }
  wit->second->last_heartbeat = Now();
  if (request.trained_size() > job->status.spec().epochs()) {
    return absl::InvalidArgumentError(absl::StrCat("trained lists ", request.trained_size(),
                                                   " epochs; the job has ",
                                                   job->status.spec().epochs()));
  }
  for (const v1::EpochSamples& t : request.trained()) {
    job->planner->RecordTrained(request.worker_id(), t.epoch(), t.samples());
  }
  v1::EpochPlanResponse response;
  if (!job->lost_pending.empty() || job->membership_dirty) {
    response.set_wait(true);
  } else {
    PSTRAIN_ASSIGN_OR_RETURN(
        response, job->planner->Plan(request.worker_id(), request.epoch(), request.epoch_length(),
                                     request.share_done(), request.tails_done(), members));
  }
  RefreshEpochSamples(*job);
  Touch(*job);
  return response;
}

void Coordinator::RefreshEpochSamples(Job& job) {
  if (job.planner == nullptr) return;
  std::map<int, v1::EpochSamples> by_epoch;
  for (const v1::EpochSamples& e : job.status.epoch_samples()) by_epoch[e.epoch()] = e;
  for (const auto& [epoch, samples] : job.planner->TrainedSamples()) {
    if (epoch < job.start_epoch) continue;  // Counted by the run that trained it.
    v1::EpochSamples& e = by_epoch[epoch];
    e.set_epoch(epoch);
    e.set_samples(samples);
    e.set_expected(job.planner->epoch_length());
  }
  job.status.clear_epoch_samples();
  for (const auto& [epoch, e] : by_epoch) *job.status.add_epoch_samples() = e;
}

absl::Status Coordinator::CheckEvalShard(const Job& job,
                                         const v1::ReportProgressRequest& report) const {
  const std::optional<int64_t> test_set = TestSetBound(job.status.spec());
  EvalShardBudget budget;
  budget.num_classes = job.graph.num_classes;
  budget.samples_left = test_set.value_or(options_.max_eval_samples);
  budget.bound_source = test_set
                            ? absl::StrCat("the test set holds ", *test_set)
                            : absl::StrCat("--max-eval-samples is ", options_.max_eval_samples);
  for (const Member& m : job.members) {
    if (m.finished && m.worker_id != report.worker_id()) budget.samples_left -= m.eval.samples();
  }
  return pstrain::CheckEvalShard(report.eval_shard(), report.worker_id(), budget);
}

std::vector<v1::WorkerStatus> Coordinator::ListWorkers() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<int64_t, v1::WorkerStatus>> rows;
  for (const auto& [id, w] : workers_) {
    v1::WorkerStatus s;
    s.set_worker_id(id);
    *s.mutable_info() = w->info;
    s.set_job_id(w->job_id);
    s.set_last_heartbeat_unix_ms(ToUnixMs(w->last_heartbeat));
    s.set_alive(w->alive);
    rows.emplace_back(IdNumber(id, "worker-"), std::move(s));
  }
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<v1::WorkerStatus> out;
  for (auto& [n, s] : rows) out.push_back(std::move(s));
  return out;
}

CoordinatorStats Coordinator::Stats() const {
  absl::MutexLock lock(&mu_);
  CoordinatorStats stats;
  for (v1::JobState s : {v1::JOB_STATE_QUEUED, v1::JOB_STATE_RUNNING, v1::JOB_STATE_SUCCEEDED,
                         v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED}) {
    stats.jobs_by_state[s] = 0;
  }
  for (const auto& [id, job] : jobs_) {
    stats.jobs_by_state[job->status.state()]++;
    if (job->phase == Phase::kRunning) stats.stragglers += job->status.stragglers_size();
  }
  for (const auto& [id, w] : workers_) {
    stats.workers_registered++;
    if (w->alive) stats.workers_alive++;
  }
  stats.max_model_version = max_model_version_;
  return stats;
}

// ---------------------------------------------------------------------------
// Helpers (mu_ held)
// ---------------------------------------------------------------------------

Coordinator::Job* Coordinator::FindJob(const std::string& job_id) const {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second.get();
}

void Coordinator::Touch(Job& job) { job.revision++; }

void Coordinator::RecordHistory(Job& job) {
  if (std::none_of(job.members.begin(), job.members.end(),
                   [](const Member& m) { return m.reported; })) {
    return;  // The figures are the previous run's.
  }
  const v1::JobStatus& s = job.status;
  auto* points = job.history.mutable_points();
  job.history.set_min_step_gap(std::max<int64_t>(1, job.history.min_step_gap()));
  if (!points->empty() && s.step() < points->rbegin()->step() + job.history.min_step_gap()) return;
  v1::HistoryPoint& p = *points->Add();
  p.set_step(s.step());
  p.set_epoch(s.epoch());
  p.set_loss(s.loss());
  p.set_train_accuracy(s.train_accuracy());
  p.set_samples_per_sec(s.samples_per_sec());
  p.set_unix_ms(ToUnixMs(Now()));
  p.set_run(s.runs());
  if (points->size() > options_.max_history_points) {
    // Every other point goes (the newest stays), and later points come at
    // twice the gap: a long job's history keeps its whole run, evenly.
    int kept = 0;
    for (int i = 0; i < points->size(); ++i) {
      if (i % 2 == 0 || i == points->size() - 1) points->SwapElements(kept++, i);
    }
    points->DeleteSubrange(kept, points->size() - kept);
    job.history.set_min_step_gap(job.history.min_step_gap() * 2);
  }
  job.history_revision++;
}

int Coordinator::IdleLiveWorkers() const {
  int n = 0;
  for (const auto& [id, w] : workers_) {
    if (w->alive && w->job_id.empty()) ++n;
  }
  return n;
}

void Coordinator::ForgetDeadWorkers() {
  const absl::Time now = Now();
  for (auto it = workers_.begin(); it != workers_.end();) {
    const Worker& w = *it->second;
    if (!w.alive && w.job_id.empty() &&
        now - w.last_heartbeat > options_.forget_dead_workers_after) {
      Log(absl::StrCat(it->first, ": forgotten (no heartbeat for ",
                       absl::FormatDuration(now - w.last_heartbeat), ")"));
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
}

void Coordinator::RefreshQueueReasons() {
  const int idle = IdleLiveWorkers();
  for (const std::string& id : job_order_) {
    Job& job = *jobs_.at(id);
    if (job.phase != Phase::kQueued) continue;
    const int wanted = job.status.spec().workers();
    std::string reason = absl::StrCat("waiting for ", wanted, " idle worker",
                                      wanted == 1 ? "" : "s", ", ", idle, " available");
    if (job.has_checkpoint) {
      absl::StrAppend(&reason, "; resumes from the checkpoint of epoch ", job.status.epoch());
    }
    if (reason != job.status.reason()) {
      job.status.set_reason(reason);
      Touch(job);
    }
  }
}

void Coordinator::RefreshAggregates(Job& job) {
  if (job.members.empty()) return;
  int epoch = 0;
  int64_t step = 0;
  double loss = 0, accuracy = 0, samples_per_sec = 0;
  int reported = 0;
  bool first = true;
  for (const Member& m : job.members) {
    const int e = m.reported ? m.epoch : job.start_epoch;
    const int64_t s = m.reported ? m.step : job.start_step;
    if (first || e < epoch) epoch = e;
    if (first || s < step) step = s;
    first = false;
    if (!m.reported) continue;
    ++reported;
    loss += m.loss;
    accuracy += m.train_accuracy;
    if (!m.finished) samples_per_sec += m.samples_per_sec;
  }
  job.status.set_epoch(epoch);
  job.status.set_step(step);
  if (reported > 0) {
    job.status.set_loss(loss / reported);
    job.status.set_train_accuracy(accuracy / reported);
  }
  job.status.set_samples_per_sec(samples_per_sec);
  // Steps per epoch: as the members report it (the slowest one's), else
  // estimated from the slowest member once it completed an epoch.
  int64_t reported_per_epoch = 0;
  for (const Member& m : job.members) {
    if (m.steps_per_epoch > 0 &&
        (reported_per_epoch == 0 || m.steps_per_epoch < reported_per_epoch)) {
      reported_per_epoch = m.steps_per_epoch;
    }
  }
  const int epochs_done = epoch - job.start_epoch;
  if (reported_per_epoch > 0) {
    // Global steps count from the job's start at epoch * steps_per_epoch,
    // so the total is epochs * steps_per_epoch (it moves only when a
    // membership change alters the steps per epoch).
    job.status.set_total_steps(std::max(step, job.status.spec().epochs() * reported_per_epoch));
  } else if (epochs_done > 0) {
    const int64_t per_epoch = step / epochs_done;
    // Membership changes alter the steps per epoch: never below the steps done.
    job.status.set_total_steps(
        std::max(step, per_epoch * (job.status.spec().epochs() - job.start_epoch)));
  }
  job.status.clear_workers();
  for (const Member& m : job.members) job.status.add_workers(m.worker_id);
}

void Coordinator::Finish(Job& job, v1::JobState state, const std::string& reason) {
  job.status.set_state(state);
  job.status.set_reason(reason);
  job.status.set_finished_unix_ms(ToUnixMs(Now()));
  job.status.set_samples_per_sec(0);
  job.status.clear_workers();
  job.status.clear_stragglers();
  job.phase = Phase::kDone;
  for (const Member& m : job.members) {
    auto it = workers_.find(m.worker_id);
    if (it != workers_.end() && it->second->job_id == job.status.job_id()) {
      it->second->job_id.clear();
    }
  }
  Touch(job);
  RefreshQueueReasons();
  Log(absl::StrCat(job.status.job_id(), ": ", StateName(state), " (", reason, ")"));
}

void Coordinator::RemoveMember(Job& job, const std::string& worker_id, const std::string& why) {
  auto it = std::find_if(job.members.begin(), job.members.end(),
                         [&](const Member& m) { return m.worker_id == worker_id; });
  if (it == job.members.end() || it->finished) return;
  job.members.erase(it);
  job.lost_pending.push_back(worker_id);
  job.status.set_workers_lost(job.status.workers_lost() + 1);
  job.generation++;
  for (size_t r = 0; r < job.members.size(); ++r) job.members[r].rank = static_cast<int>(r);
  if (job.members.empty()) {
    // Nobody left: back to the queue; it resumes from its last checkpoint.
    job.phase = Phase::kQueued;
    job.status.set_state(v1::JOB_STATE_QUEUED);
    job.status.clear_workers();
    job.status.set_samples_per_sec(0);
    Log(absl::StrCat(job.status.job_id(), ": lost its last worker (", worker_id, ", ", why,
                     "); queued again"));
    RefreshQueueReasons();
  } else {
    job.membership_dirty = true;
    Log(absl::StrCat(job.status.job_id(), ": dropped ", worker_id, " (", why, "); ",
                     job.members.size(), " left, generation ", job.generation));
    RefreshAggregates(job);
  }
  Touch(job);
}

// ---------------------------------------------------------------------------
// Background work
// ---------------------------------------------------------------------------

void Coordinator::BackgroundLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&wake_), options_.tick_interval);
      if (stopping_) return;
      wake_ = false;
    }
    Tick();
  }
}

void Coordinator::Tick() {
  absl::MutexLock tick_lock(&tick_mu_);
  DropDeadWorkers();
  FindStragglers();
  CheckShards();
  DropStrayJobs();
  SyncMembership();
  StartQueuedJobs();
  WriteDueCheckpoints();
  DropFinishedJobs();
  PersistChangedJobs();
}

void Coordinator::DropDeadWorkers() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  for (auto& [id, w] : workers_) {
    if (!w->alive || now - w->last_heartbeat <= options_.heartbeat_timeout) continue;
    w->alive = false;
    Log(absl::StrCat(id, ": no heartbeat for ", absl::FormatDuration(now - w->last_heartbeat),
                     "; marked dead"));
    if (!w->job_id.empty()) {
      Job* job = FindJob(w->job_id);
      if (job != nullptr && job->phase == Phase::kRunning) {
        RemoveMember(*job, id, "missed heartbeats");
      }
      w->job_id.clear();
    }
  }
  ForgetDeadWorkers();
  RefreshQueueReasons();
}

void Coordinator::FindStragglers() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  for (const std::string& id : job_order_) {
    Job& job = *jobs_.at(id);
    if (job.phase != Phase::kRunning) continue;
    int64_t lead = 0;
    for (const Member& m : job.members) lead = std::max(lead, m.run_steps);
    const bool sync = job.status.spec().mode() == v1::CONSISTENCY_SYNC ||
                      job.status.spec().mode() == v1::CONSISTENCY_UNSPECIFIED;
    std::vector<std::string> stragglers, drop;
    for (const Member& m : job.members) {
      if (m.finished) continue;
      auto w = workers_.find(m.worker_id);
      const bool silent =
          w != workers_.end() && now - w->second->last_heartbeat > 3 * options_.heartbeat_interval;
      const absl::Duration stalled = now - m.steps_changed_at;
      const bool behind = m.run_steps < lead && stalled > options_.straggler_report_after;
      if (sync && behind && options_.straggler_timeout > absl::ZeroDuration() &&
          stalled > options_.straggler_timeout && job.members.size() > 1) {
        drop.push_back(absl::StrCat(m.worker_id, "|", m.run_steps, "|", lead, "|",
                                    absl::FormatDuration(stalled)));
      } else if (silent || behind) {
        stragglers.push_back(m.worker_id);
      }
    }
    if (!std::equal(stragglers.begin(), stragglers.end(), job.status.stragglers().begin(),
                    job.status.stragglers().end())) {
      job.status.mutable_stragglers()->Assign(stragglers.begin(), stragglers.end());
      if (!stragglers.empty()) {
        Log(absl::StrCat(id, ": straggler", stragglers.size() == 1 ? " " : "s ",
                         absl::StrJoin(stragglers, ", ")));
      }
      Touch(job);
    }
    for (const std::string& d : drop) {
      const std::vector<std::string> f = absl::StrSplit(d, '|');
      auto w = workers_.find(f[0]);
      if (w != workers_.end()) w->second->job_id.clear();
      job.status.set_stragglers_dropped(job.status.stragglers_dropped() + 1);
      RemoveMember(job, f[0],
                   absl::StrCat("a straggler: ", f[1], " steps while the others reached ", f[2],
                                ", no progress for ", f[3], " (--straggler-timeout-s)"));
      if (job.phase != Phase::kRunning) break;
    }
  }
}

void Coordinator::CheckShards() {
  std::vector<std::string> running;
  {
    absl::MutexLock lock(&mu_);
    if (Now() - last_shard_check_ < options_.shard_check_interval) return;
    last_shard_check_ = Now();
    for (const std::string& id : job_order_) {
      const Job& job = *jobs_.at(id);
      if (job.phase == Phase::kRunning && job.shards_configured) running.push_back(id);
    }
  }
  for (const std::string& id : running) {
    const std::vector<int> missing = shards_->ShardsMissingJob(id, options_.shard_check_timeout);
    if (missing.empty()) continue;
    absl::MutexLock lock(&mu_);
    Job& job = *jobs_.at(id);
    if (job.phase != Phase::kRunning) continue;
    RequeueRun(job, absl::StrCat(shards_->Describe(missing[0]),
                                 " no longer holds the job (it restarted)"));
  }
}

void Coordinator::DropStrayJobs() {
  {
    absl::MutexLock lock(&mu_);
    if (Now() - last_stray_check_ < options_.stray_job_check_interval) return;
    last_stray_check_ = Now();
  }
  for (int s = 0; s < shards_->num_shards(); ++s) {
    absl::StatusOr<std::vector<std::string>> held =
        shards_->ListJobs(s, options_.shard_check_timeout);
    if (!held.ok()) continue;  // Down or restarting: asked again next time.
    for (const std::string& id : *held) {
      std::string why;
      {
        absl::MutexLock lock(&mu_);
        const Job* job = FindJob(id);
        if (job == nullptr) {
          why = "a job this server does not know";
        } else if (job->phase == Phase::kDone && !job->shards_configured && !job->save_on_stop) {
          why = absl::StrCat("it ended (", v1::JobState_Name(job->status.state()), ")");
        }
      }
      if (why.empty()) continue;
      const absl::Status dropped = shards_->DropJobOn(s, id);
      Log(absl::StrCat(id, ": ", dropped.ok() ? "dropped from " : "could not drop it from ",
                       shards_->Describe(s), ": ", why,
                       dropped.ok() ? "" : absl::StrCat(" (", dropped.message(), ")")));
    }
  }
}

void Coordinator::ReformIfWorkersWait(Job& job, int epoch) {
  const size_t wanted = static_cast<size_t>(job.status.spec().workers());
  if (job.phase != Phase::kRunning || !job.has_checkpoint || job.members.size() >= wanted) return;
  // Jobs queued before this one take idle workers first.
  for (const std::string& id : job_order_) {
    if (id == job.status.job_id()) break;
    if (jobs_.at(id)->phase == Phase::kQueued) return;
  }
  size_t idle = 0;
  for (const auto& [id, w] : workers_) idle += w->alive && w->job_id.empty();
  if (job.members.size() + idle < wanted) return;
  RequeueRun(job, absl::StrCat("re-forming with ", wanted, " workers at the end of epoch ", epoch,
                               " (", job.members.size(), " left, ", idle,
                               " idle: a dropped worker came back or a new one registered)"));
}

void Coordinator::RequeueRun(Job& job, const std::string& why) {
  for (const Member& m : job.members) {
    auto it = workers_.find(m.worker_id);
    if (it != workers_.end() && it->second->job_id == job.status.job_id()) {
      it->second->job_id.clear();
    }
  }
  job.members.clear();
  job.phase = Phase::kQueued;
  job.status.set_state(v1::JOB_STATE_QUEUED);
  job.status.clear_workers();
  job.status.set_samples_per_sec(0);
  Log(absl::StrCat(job.status.job_id(), ": ", why, "; queued again to resume from ",
                   job.has_checkpoint ? "its latest checkpoint" : "the beginning"));
  RefreshQueueReasons();
  Touch(job);
  Wake();
}

void Coordinator::SyncMembership() {
  struct Change {
    std::string job_id;
    std::vector<std::string> members;
    int64_t generation;
    std::string run_id;
    std::vector<std::string> lost;
  };
  std::vector<Change> changes;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : job_order_) {
      Job& job = *jobs_.at(id);
      if (!job.membership_dirty) continue;
      job.membership_dirty = false;
      if (job.phase != Phase::kRunning || !job.shards_configured) continue;
      Change c{id, {}, job.generation, job.run_id, job.lost_pending};
      for (const Member& m : job.members) c.members.push_back(m.worker_id);
      changes.push_back(std::move(c));
    }
  }
  for (const Change& c : changes) {
    std::map<std::string, int64_t> removed_steps;
    absl::Status s = shards_->SetMembers(c.job_id, c.members, c.generation, &removed_steps);
    absl::MutexLock lock(&mu_);
    Job& job = *jobs_.at(c.job_id);
    if (s.ok()) {
      if (job.phase != Phase::kRunning || job.run_id != c.run_id || job.planner == nullptr) {
        continue;
      }
      // Every sample once: the lost members' untrained work goes to the
      // survivors within the epoch (server/epoch_planner.h).
      for (const std::string& lost : c.lost) {
        auto steps = removed_steps.find(lost);
        job.planner->MemberLost(lost, steps == removed_steps.end() ? 0 : steps->second, c.members);
        std::erase(job.lost_pending, lost);
      }
      RefreshEpochSamples(job);
      Touch(job);
      continue;
    }
    // Some shards may have the new member set and others not: rather than
    // train on mixed generations, start a new run from the checkpoint, which
    // configures every shard afresh (a shard that stays down then fails the
    // resume with its error).
    if (job.phase == Phase::kRunning) {
      RequeueRun(job, absl::StrCat("could not update the shards' member set (", s.message(), ")"));
    }
  }
}

void Coordinator::StartQueuedJobs() {
  std::vector<StartWork> starts;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::pair<int64_t, Worker*>> idle;
    for (auto& [id, w] : workers_) {
      if (w->alive && w->job_id.empty()) idle.emplace_back(IdNumber(id, "worker-"), w.get());
    }
    std::sort(idle.begin(), idle.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    size_t next_idle = 0;
    for (const std::string& id : job_order_) {
      Job& job = *jobs_.at(id);
      if (job.phase != Phase::kQueued) continue;
      const size_t wanted = static_cast<size_t>(job.status.spec().workers());
      if (idle.size() - next_idle < wanted) continue;
      StartWork work;
      work.job_id = id;
      work.spec = job.status.spec();
      work.graph = job.graph;
      work.generation = ++job.generation;
      work.resume = job.has_checkpoint;
      work.step_before = job.status.step();
      job.members.clear();
      for (size_t r = 0; r < wanted; ++r) {
        Worker* w = idle[next_idle++].second;
        w->job_id = id;
        Member m;
        m.worker_id = w->id;
        m.rank = static_cast<int>(r);
        m.steps_changed_at = Now();
        job.members.push_back(m);
        work.members.push_back(w->id);
      }
      job.phase = Phase::kStarting;
      starts.push_back(std::move(work));
    }
  }

  for (StartWork& work : starts) {
    // Initial values: the last checkpoint when resuming, else the model's
    // deterministic initialisation.
    JobLaunch launch;
    launch.job_id = work.job_id;
    launch.spec = work.spec;
    launch.members = work.members;
    launch.generation = work.generation;
    int start_epoch = 0;
    int64_t start_step = 0;
    absl::Status status;
    if (work.resume) {
      absl::StatusOr<v1::Checkpoint> ckpt = checkpointer_.LoadLatest(work.job_id);
      if (ckpt.ok()) {
        std::map<std::string, const v1::TensorProto*> by_name;
        for (const v1::TensorProto& t : ckpt->parameters()) by_name[t.name()] = &t;
        for (const ParamInfo& p : work.graph.params) {
          auto it = by_name.find(p.name);
          if (it == by_name.end()) {
            status = absl::DataLossError(
                absl::StrCat("the checkpoint of ", work.job_id, " lacks ", p.name));
            break;
          }
          absl::StatusOr<std::vector<float>> values = TensorProtoToFloats(*it->second);
          if (!values.ok()) {
            status = values.status();
            break;
          }
          launch.params.push_back(*std::move(values));
        }
        for (const v1::TensorProto& t : ckpt->optimizer_state()) {
          if (!status.ok()) break;
          absl::StatusOr<std::vector<float>> values = TensorProtoToFloats(t);
          if (!values.ok()) {
            status = values.status();
            break;
          }
          launch.optimizer_state[t.name()] = *std::move(values);
        }
        start_epoch = ckpt->epoch();
        start_step = ckpt->step();
        // The server-side optimizer counts iterations by version: go on from
        // the checkpoint's (average mode counts rounds and runs no optimizer
        // on the server, so it starts again from 0). In sync mode the
        // checkpoint is a cut at the global step. In async and ssp every
        // push is a version, so a chunk's version is about members x steps:
        // each chunk goes on from the version it was saved at (resuming at
        // the step rewound the learning-rate schedule by half with two
        // workers; the chaos run of ssp showed it as +0.7 points). Workers
        // learn every chunk's version from their first pull.
        const v1::ConsistencyMode mode = work.spec.mode();
        if (mode != v1::CONSISTENCY_AVERAGE) launch.initial_version = ckpt->step();
        if ((mode == v1::CONSISTENCY_ASYNC || mode == v1::CONSISTENCY_SSP) &&
            ckpt->chunk_versions_size() > 0 &&
            std::all_of(ckpt->chunk_versions().begin(), ckpt->chunk_versions().end(),
                        [](int64_t v) { return v >= 0; })) {
          launch.chunk_versions.assign(ckpt->chunk_versions().begin(),
                                       ckpt->chunk_versions().end());
          // A plan of another size (another shard count) gets the newest.
          launch.initial_version =
              *std::max_element(launch.chunk_versions.begin(), launch.chunk_versions.end());
        }
      } else {
        status = ckpt.status();
      }
    } else {
      launch.params = InitialParameterValues(work.graph);
    }
    if (status.ok()) status = shards_->ConfigureJob(launch);

    absl::MutexLock lock(&mu_);
    Job& job = *jobs_.at(work.job_id);
    job.shards_configured = true;                 // Possibly partly: DropJob cleans up either way.
    if (job.phase != Phase::kStarting) continue;  // Cancelled meanwhile.
    if (!status.ok()) {
      Finish(
          job, v1::JOB_STATE_FAILED,
          absl::StrCat(work.resume ? "could not resume: " : "could not start: ", status.message()));
      continue;
    }
    job.phase = Phase::kRunning;
    job.start_epoch = start_epoch;
    job.start_step = start_step;
    {
      // The steps past the resume point were thrown away with the model
      // that trained them: the history goes on from the kept one.
      auto* points = job.history.mutable_points();
      const auto past =
          std::find_if(points->begin(), points->end(),
                       [&](const v1::HistoryPoint& p) { return p.step() > start_step; });
      if (past != points->end()) {
        points->erase(past, points->end());
        job.history_revision++;
      }
    }
    job.lost_pending.clear();
    {
      const v1::ConsistencyMode mode = job.status.spec().mode();
      job.planner = std::make_unique<EpochPlanner>(EpochPlanner::RunStart{
          .start_epoch = start_epoch,
          .start_step = start_step,
          .batch_size = std::max(1, job.status.spec().batch_size()),
          .epochs = job.status.spec().epochs(),
          .barrier = mode != v1::CONSISTENCY_ASYNC && mode != v1::CONSISTENCY_SSP});
      // This run counts its epochs afresh (a resumed epoch's trained prefix
      // is reported by its members).
      auto* counts = job.status.mutable_epoch_samples();
      counts->erase(std::remove_if(counts->begin(), counts->end(),
                                   [start_epoch](const v1::EpochSamples& e) {
                                     return e.epoch() >= start_epoch;
                                   }),
                    counts->end());
    }
    job.last_checkpoint_epoch = start_epoch;
    job.last_checkpoint_time = Now();
    // A restart loses the steps since its checkpoint, or all of them when
    // the job had none yet.
    const bool restart = job.status.runs() > 0;
    if (restart) {
      job.status.set_steps_lost(job.status.steps_lost() +
                                std::max<int64_t>(0, work.step_before - start_step));
    }
    job.status.set_runs(job.status.runs() + 1);
    job.run_id = absl::StrFormat("%s.%d.%016x", work.job_id, job.status.runs(), incarnation_);
    job.status.set_state(v1::JOB_STATE_RUNNING);
    job.status.set_epoch(start_epoch);
    job.status.set_step(start_step);
    if (job.status.started_unix_ms() == 0) job.status.set_started_unix_ms(ToUnixMs(Now()));
    job.status.set_reason(absl::StrCat(
        "training on ", job.members.size(), " worker", job.members.size() == 1 ? "" : "s",
        !restart ? std::string()
        : work.resume
            ? absl::StrCat(" (run ", job.status.runs(), ", resumed from the checkpoint of epoch ",
                           start_epoch, ", step ", start_step, "; ", job.status.steps_lost(),
                           " steps lost so far)")
            : absl::StrCat(" (run ", job.status.runs(),
                           ", started again from the beginning: no checkpoint yet; ",
                           job.status.steps_lost(), " steps lost so far)")));
    RefreshAggregates(job);
    Touch(job);
    Log(absl::StrCat(work.job_id, ": RUNNING on ", absl::StrJoin(work.members, ", "), " (run ",
                     job.run_id, ", generation ", work.generation,
                     work.resume ? absl::StrCat(", from epoch ", start_epoch, " step ", start_step)
                                 : std::string(),
                     ")"));
  }
  if (!starts.empty()) {
    absl::MutexLock lock(&mu_);
    RefreshQueueReasons();
  }
}

void Coordinator::WriteDueCheckpoints() {
  std::vector<CheckpointWork> works;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : job_order_) {
      Job& job = *jobs_.at(id);
      CheckpointWork work;
      work.job_id = id;
      if (job.phase == Phase::kDone && job.save_on_stop) {
        work.kind = CheckpointWork::kStop;
      } else if (job.phase == Phase::kRunning && !job.members.empty() &&
                 std::all_of(job.members.begin(), job.members.end(),
                             [](const Member& m) { return m.finished; })) {
        work.kind = CheckpointWork::kFinal;
        job.phase = Phase::kFinalizing;
        job.status.set_reason("evaluated; writing the final checkpoint");
        Touch(job);
      } else if (job.phase == Phase::kRunning && job.status.epoch() > job.last_checkpoint_epoch &&
                 job.status.epoch() < job.status.spec().epochs()) {
        // (After the last epoch the final checkpoint follows the evaluation.)
        work.kind = CheckpointWork::kEpoch;
      } else if (job.phase == Phase::kRunning &&
                 options_.checkpoint_interval > absl::ZeroDuration() &&
                 Now() - job.last_checkpoint_time >= options_.checkpoint_interval &&
                 job.status.epoch() < job.status.spec().epochs()) {
        work.kind = CheckpointWork::kInterval;
      } else {
        continue;
      }
      work.spec = job.status.spec();
      work.graph = job.graph;
      work.epoch = job.status.epoch();
      work.step = job.status.step();
      if (job.planner != nullptr) {
        // A copy: the checkpoint is written without the lock.
        auto planner = std::make_shared<EpochPlanner>(*job.planner);
        work.position_of_version = [planner](int64_t version) {
          return planner->PositionOfVersion(version);
        };
      }
      for (const Member& m : job.members) {
        if (m.steps_per_epoch > 0 &&
            (work.steps_per_epoch == 0 || m.steps_per_epoch < work.steps_per_epoch)) {
          work.steps_per_epoch = m.steps_per_epoch;
        }
      }
      works.push_back(std::move(work));
    }
  }

  for (const CheckpointWork& work : works) {
    const absl::Status s = WriteCheckpoint(work);
    absl::MutexLock lock(&mu_);
    Job& job = *jobs_.at(work.job_id);
    if (s.ok() && !options_.state_dir.empty()) job.has_checkpoint = true;
    if (s.ok()) job.last_checkpoint_time = Now();
    switch (work.kind) {
      case CheckpointWork::kInterval:
        if (!s.ok()) {
          Log(absl::StrCat(work.job_id, ": checkpoint failed: ", s.message()));
        }
        break;
      case CheckpointWork::kStop:
        job.save_on_stop = false;
        if (!s.ok()) Log(absl::StrCat(work.job_id, ": could not save the model: ", s.message()));
        break;
      case CheckpointWork::kEpoch:
        if (s.ok()) {
          job.last_checkpoint_epoch = work.epoch;
          ReformIfWorkersWait(job, work.epoch);
        } else {
          Log(absl::StrCat(work.job_id, ": checkpoint of epoch ", work.epoch,
                           " failed: ", s.message()));
        }
        break;
      case CheckpointWork::kFinal: {
        if (job.phase != Phase::kFinalizing) break;  // Cancelled meanwhile.
        if (absl::IsUnavailable(s) || absl::IsNotFound(s) || absl::IsDeadlineExceeded(s)) {
          // A shard is down or came back empty (seen in the chaos run: shard
          // 1 killed as the last epoch ended): its part of the final model
          // is gone, so the run resumes from the latest checkpoint and its
          // members train the rest and evaluate again.
          RequeueRun(job, absl::StrCat("could not read the final model (", s.message(), ")"));
          break;
        }
        if (!s.ok()) {
          Finish(job, v1::JOB_STATE_FAILED,
                 absl::StrCat("could not write the final checkpoint: ", s.message()));
          break;
        }
        // Merge every member's test shard.
        std::vector<const v1::EvalMetrics*> shards;
        for (const Member& m : job.members) shards.push_back(&m.eval);
        const v1::EvalMetrics test = MergeEvalShards(shards);
        *job.status.mutable_test() = test;
        job.status.set_epoch(job.status.spec().epochs());
        job.status.set_total_steps(job.status.step());
        Finish(job, v1::JOB_STATE_SUCCEEDED,
               absl::StrFormat("finished %d epochs; test accuracy %.4f on %d samples",
                               job.status.spec().epochs(), test.accuracy(), test.samples()));
        break;
      }
    }
    Touch(job);
  }
}

absl::Status Coordinator::WriteCheckpoint(const CheckpointWork& work) {
  // ReadModel: a cut at one version where the mode has one and training
  // goes on (sync, average); else every chunk as it is.
  const v1::ConsistencyMode mode = work.spec.mode();
  const bool cut =
      (work.kind == CheckpointWork::kEpoch || work.kind == CheckpointWork::kInterval) &&
      (mode == v1::CONSISTENCY_SYNC || mode == v1::CONSISTENCY_UNSPECIFIED ||
       mode == v1::CONSISTENCY_AVERAGE);
  ModelSnapshot snapshot;
  if (cut) {
    PSTRAIN_ASSIGN_OR_RETURN(const int64_t version, shards_->MaxVersion(work.job_id));
    PSTRAIN_ASSIGN_OR_RETURN(
        snapshot, shards_->ReadModelAt(work.job_id, work.graph, version, options_.cut_wait));
  } else {
    PSTRAIN_ASSIGN_OR_RETURN(snapshot, shards_->ReadModel(work.job_id, work.graph));
  }
  {
    absl::MutexLock lock(&mu_);
    max_model_version_ = std::max(max_model_version_, snapshot.max_version);
  }
  if (options_.state_dir.empty()) return absl::OkStatus();
  // DataPosition: in sync mode the cut's version is the global step.
  int64_t step = work.step;
  int epoch = work.epoch;
  const bool sync = mode == v1::CONSISTENCY_SYNC || mode == v1::CONSISTENCY_UNSPECIFIED;
  if (cut && sync) {
    step = snapshot.max_version;
    const std::pair<int, int64_t> position =
        work.position_of_version ? work.position_of_version(step) : std::pair<int, int64_t>{-1, 0};
    if (position.first >= 0 && work.steps_per_epoch > 0) {
      // Tails (a lost worker's samples) add versions inside an epoch: the
      // data position is the epoch and the steps into its share.
      epoch = std::min(position.first, work.spec.epochs());
      step = static_cast<int64_t>(epoch) * work.steps_per_epoch +
             (epoch < work.spec.epochs() ? position.second : 0);
    } else if (work.steps_per_epoch > 0) {
      epoch = static_cast<int>(std::min<int64_t>(step / work.steps_per_epoch, work.spec.epochs()));
    }
  }
  v1::Checkpoint ckpt;
  *ckpt.mutable_job() = work.spec;
  for (size_t p = 0; p < work.graph.params.size(); ++p) {
    const ParamInfo& info = work.graph.params[p];
    *ckpt.add_parameters() =
        MakeTensorProto(info.name, info.shape.dims(), snapshot.params[p].data());
    // Optimizer state of this parameter, slots in name order.
    const std::string prefix = info.name + "/";
    for (auto it = snapshot.optimizer_state.lower_bound(prefix);
         it != snapshot.optimizer_state.end() && absl::StartsWith(it->first, prefix); ++it) {
      if (it->first.find('/', prefix.size()) != std::string::npos) continue;
      *ckpt.add_optimizer_state() =
          MakeTensorProto(it->first, info.shape.dims(), it->second.data());
    }
  }
  ckpt.mutable_chunk_versions()->Assign(snapshot.chunk_versions.begin(),
                                        snapshot.chunk_versions.end());
  ckpt.set_step(step);
  ckpt.set_epoch(epoch);
  ckpt.set_created_unix_ms(ToUnixMs(Now()));
  PSTRAIN_RETURN_IF_ERROR(checkpointer_.Write(work.job_id, ckpt));
  const char* kind = work.kind == CheckpointWork::kFinal      ? ", final"
                     : work.kind == CheckpointWork::kInterval ? ", interval"
                     : work.kind == CheckpointWork::kStop     ? ", stopped"
                                                              : "";
  Log(absl::StrCat(work.job_id, ": checkpoint written (epoch ", epoch, ", step ", step, kind,
                   cut ? absl::StrCat(", cut at version ", snapshot.max_version) : std::string(),
                   ")"));
  return absl::OkStatus();
}

void Coordinator::DropFinishedJobs() {
  std::vector<std::string> drops;
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : job_order_) {
      Job& job = *jobs_.at(id);
      if (job.phase != Phase::kDone || !job.shards_configured || job.save_on_stop) continue;
      job.shards_configured = false;
      drops.push_back(id);
    }
  }
  for (const std::string& id : drops) {
    const absl::Status s = shards_->DropJob(id);
    if (!s.ok()) Log(absl::StrCat(id, ": dropping it from the shards failed: ", s.message()));
  }
}

void Coordinator::PersistChangedJobs() {
  if (options_.state_dir.empty()) return;
  absl::MutexLock persist_lock(&persist_mu_);
  std::vector<std::pair<v1::JobStatus, int64_t>> changed;
  std::vector<std::pair<v1::JobHistory, int64_t>> histories;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) {
      if (job->revision > job->persisted_revision) changed.emplace_back(job->status, job->revision);
      if (job->history_revision > job->persisted_history_revision) {
        histories.emplace_back(job->history, job->history_revision);
      }
    }
  }
  for (const auto& [status, revision] : changed) {
    if (absl::Status s = store_.SaveJob(status); !s.ok()) {
      Log(absl::StrCat(status.job_id(), ": could not save its status: ", s.message()));
      continue;
    }
    absl::MutexLock lock(&mu_);
    Job& job = *jobs_.at(status.job_id());
    job.persisted_revision = std::max(job.persisted_revision, revision);
  }
  for (const auto& [history, revision] : histories) {
    if (absl::Status s = store_.SaveHistory(history); !s.ok()) {
      Log(absl::StrCat(history.job_id(), ": could not save its history: ", s.message()));
      continue;
    }
    absl::MutexLock lock(&mu_);
    Job& job = *jobs_.at(history.job_id());
    job.persisted_history_revision = std::max(job.persisted_history_revision, revision);
  }
}

}  // namespace pstrain
