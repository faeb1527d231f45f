// The Coordinator (server/coordinator.h says what it does), in order:
//   Construction and restore   Create, LoadState
//   Jobs                       SubmitJob ... CheckpointPath
//   Workers                    in coordinator_workers.cc
//   Job changes (mu_ held)     Finish, RemoveMember, RequeueRun, ReformIfWorkersWait
//   Background work (Tick)     one function per phase, in Tick's order
// Its parts: server/job_registry.h (the jobs), server/job_record.h (one
// job's state changes), server/job_run.h (one run: members, epoch plans,
// stragglers, aggregates, the checkpoint codec), server/worker_registry.h
// (the workers), server/checkpoint_writer.h, server/job_store.h and
// server/checkpointer.h (disk).
#include "server/coordinator.h"

#include <algorithm>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/job_state.h"
#include "common/status_macros.h"
#include "kernels/optimizer.h"
#include "server/eval_merge.h"

namespace pstrain {
namespace {

uint64_t RandomIncarnation() {
  absl::BitGen bits;
  return absl::Uniform<uint64_t>(bits);
}

}  // namespace

// ---------------------------------------------------------------------------
// Construction and restore
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
  {
    // Jobs it resumes may have daemons running their commands: they come
    // back within a heartbeat timeout.
    absl::MutexLock lock(&c->mu_);
    if (c->jobs_.CountIn(JobPhase::kQueued) > 0) {
      c->launch_grace_until_ = c->Now() + c->options_.heartbeat_timeout;
    }
  }
  c->PersistChangedJobs();
  if (start_thread) c->background_ = std::thread([raw = c.get()] { raw->BackgroundLoop(); });
  return c;
}

Coordinator::Coordinator(Options options, ShardController* shards)
    : options_(std::move(options)),
      num_shards_(shards->num_shards()),
      chunk_bytes_(shards->chunk_bytes()),
      incarnation_(RandomIncarnation()),
      store_(options_.state_dir),
      checkpointer_({.state_dir = options_.state_dir,
                     .keep = options_.keep_checkpoints,
                     .log = [this](const std::string& line) { Log(line); },
                     .remote_dir = options_.checkpoint_dir,
                     .store = options_.storage}),
      shards_(shards),
      checkpoint_writer_({.state_dir = options_.state_dir,
                          .cut_wait = options_.cut_wait,
                          .clock = options_.clock,
                          .log = [this](const std::string& line) { Log(line); }},
                         shards, &checkpointer_),
      workers_({.max_workers = options_.max_workers,
                .max_info_bytes = options_.max_worker_info_bytes,
                .heartbeat_timeout = options_.heartbeat_timeout,
                .forget_dead_after = options_.forget_dead_workers_after,
                .save_next_id = [this](int64_t next) { return store_.SaveNextWorkerId(next); },
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
  absl::MutexLock lock(&mu_);
  PSTRAIN_RETURN_IF_ERROR(jobs_.Load(
      store_, checkpointer_, [this](const v1::JobSpec& spec) { return ValidateJob(spec); }, Now(),
      [this](const std::string& line) { Log(line); }));
  PSTRAIN_ASSIGN_OR_RETURN(const int64_t next_worker, store_.LoadNextWorkerId());
  workers_.set_next_id(next_worker);
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
  // An external model's workers declare its tensors (DeclareModel), which
  // are checked then: until then the job has no graph.
  if (spec.has_external_model() && !ExternalModelDeclared(spec)) return ModelGraph();
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, BuildJobGraph(spec));
  PSTRAIN_RETURN_IF_ERROR(CheckJobLimits(spec, graph, options_.job_limits));
  PSTRAIN_RETURN_IF_ERROR(PlanChunks(graph, num_shards_, chunk_bytes_).status());
  return graph;
}

absl::Status Coordinator::CheckId(const char* what, const std::string& id) const {
  return CheckIdLength(what, id, options_.max_id_bytes);
}

absl::StatusOr<std::string> Coordinator::SubmitJob(v1::JobSpec spec) {
  ImplyCommandModel(&spec);
  if (!spec.has_external_model() && spec.model().layers_size() == 0) {
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
    const int queued = jobs_.CountIn(JobPhase::kQueued);
    if (queued >= options_.max_queued_jobs) {
      return absl::ResourceExhaustedError(
          absl::StrCat(queued,
                       " jobs are queued, the most this server takes (--max-queued-jobs); "
                       "submit again once some have started"));
    }
    const JobRecord& job = jobs_.Add(std::move(spec), std::move(graph), Now());
    job_id = job.status.job_id();
    RefreshQueueReasons();
    Log(absl::StrCat(job_id, ": queued (", job.status.reason(), ")"));
    Wake();
  }
  PersistChangedJobs();
  return job_id;
}

absl::StatusOr<v1::JobStatus> Coordinator::GetJob(const std::string& job_id) const {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  PSTRAIN_ASSIGN_OR_RETURN(const JobRecord* job, jobs_.Get(job_id));
  return job->status;
}

absl::StatusOr<v1::JobHistory> Coordinator::GetJobHistory(const std::string& job_id) const {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  PSTRAIN_ASSIGN_OR_RETURN(const JobRecord* job, jobs_.Get(job_id));
  return job->history;
}

std::vector<v1::JobStatus> Coordinator::ListJobs() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::JobStatus> out;
  const std::vector<JobRecord*>& jobs = jobs_.jobs();
  for (auto it = jobs.rbegin(); it != jobs.rend(); ++it) out.push_back((*it)->status);
  return out;
}

absl::StatusOr<v1::JobStatus> Coordinator::CancelJob(const std::string& job_id,
                                                     const std::string& reason) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  if (reason.size() > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("the cancel reason is ", reason.size(), " bytes; at most 1024"));
  }
  v1::JobStatus status;
  {
    absl::MutexLock lock(&mu_);
    PSTRAIN_ASSIGN_OR_RETURN(JobRecord * job, jobs_.Get(job_id));
    if (job->phase == JobPhase::kDone) return job->status;
    const bool was_running = job->phase == JobPhase::kRunning;
    Finish(*job, v1::JOB_STATE_CANCELLED,
           reason.empty() ? "cancelled by user" : absl::StrCat("cancelled: ", reason));
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
  PSTRAIN_ASSIGN_OR_RETURN(const JobRecord* job, jobs_.Get(job_id));
  // Jobs are never erased, so `job` stays valid while we wait.
  auto changed = [job, after_revision] { return job->revision > after_revision; };
  mu_.AwaitWithDeadline(absl::Condition(&changed), deadline);
  return JobUpdate{job->status, job->revision};
}

absl::StatusOr<std::string> Coordinator::CheckpointPath(const std::string& job_id) const {
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  absl::MutexLock lock(&mu_);
  PSTRAIN_ASSIGN_OR_RETURN(const JobRecord* job, jobs_.Get(job_id));
  if (!job->has_checkpoint) {
    return absl::FailedPreconditionError(absl::StrCat(job_id, " has no checkpoint yet (state ",
                                                      JobStateName(job->status.state()), ")"));
  }
  return checkpointer_.LatestPath(job_id);
}

// ---------------------------------------------------------------------------
// Job changes that reach beyond the job (mu_ held)
// ---------------------------------------------------------------------------

void Coordinator::RefreshQueueReasons() {
  const IdleWorkers idle = IdleWorkersByJob();
  const int command_daemons = static_cast<int>(
      std::count_if(idle.pool.begin(), idle.pool.end(),
                    [](const RegisteredWorker* w) { return w->info.runs_commands(); }));
  for (JobRecord* job : jobs_.jobs()) {
    if (job->phase != JobPhase::kQueued) continue;
    const auto bound = idle.bound.find(job->status.job_id());
    const int launched = job->status.spec().has_command()
                             ? static_cast<int>(Launchers(job->status.job_id()).size())
                             : 0;
    job->SetQueueReason(
        static_cast<int>(!JobTakesBoundWorkers(job->status.spec()) ? idle.pool.size()
                         : bound == idle.bound.end()               ? 0
                                                                   : bound->second.size()),
        launched, command_daemons);
  }
}

Coordinator::IdleWorkers Coordinator::IdleWorkersByJob() const {
  IdleWorkers idle;
  for (RegisteredWorker* w : workers_.IdleByNumber()) {
    if (w->info.job_id().empty()) {
      idle.pool.push_back(w);
    } else {
      idle.bound[w->info.job_id()].push_back(w);
    }
  }
  return idle;
}

void Coordinator::Finish(JobRecord& job, v1::JobState state, const std::string& reason) {
  workers_.Free(job.status.job_id(), job.End(state, reason, Now()));
  RefreshQueueReasons();
  Log(absl::StrCat(job.status.job_id(), ": ", JobStateName(state), " (", reason, ")"));
}

void Coordinator::RemoveMember(JobRecord& job, const std::string& worker_id,
                               const std::string& why) {
  if (!job.LoseMember(worker_id)) return;
  if (job.phase == JobPhase::kQueued) {
    Log(absl::StrCat(job.status.job_id(), ": lost its last worker (", worker_id, ", ", why,
                     "); queued again"));
    RefreshQueueReasons();
  } else {
    Log(absl::StrCat(job.status.job_id(), ": dropped ", worker_id, " (", why, "); ",
                     job.run->members().size(), " left, generation ", job.run->generation()));
  }
}

void Coordinator::RequeueRun(JobRecord& job, const std::string& why) {
  workers_.Free(job.status.job_id(), job.BackToQueue());
  Log(absl::StrCat(job.status.job_id(), ": ", why, "; queued again to resume from ",
                   job.has_checkpoint ? "its latest checkpoint" : "the beginning"));
  RefreshQueueReasons();
  Wake();
}

void Coordinator::ReformIfWorkersWait(JobRecord& job, int epoch) {
  const size_t wanted = static_cast<size_t>(job.status.spec().workers());
  const size_t members = job.run->members().size();
  if (job.phase != JobPhase::kRunning || !job.has_checkpoint || members >= wanted) return;
  // Jobs queued before this one take idle workers first.
  for (const JobRecord* other : jobs_.jobs()) {
    if (other == &job) break;
    if (other->phase == JobPhase::kQueued) return;
  }
  const size_t idle = static_cast<size_t>(workers_.IdleCount());
  if (members + idle < wanted) return;
  RequeueRun(job, absl::StrCat("re-forming with ", wanted, " workers at the end of epoch ", epoch,
                               " (", members, " left, ", idle,
                               " idle: a dropped worker came back or a new one registered)"));
}

// ---------------------------------------------------------------------------
// Background work: Tick and its phases, in order
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
  for (RegisteredWorker* w : workers_.Overdue(now)) {
    workers_.MarkDead(*w, now);
    w->launching.clear();  // Its command died with it (it gets SIGKILL).
    if (JobRecord* job = jobs_.Find(w->job_id);
        job != nullptr && job->phase == JobPhase::kRunning) {
      RemoveMember(*job, w->id, "missed heartbeats");
    }
    w->job_id.clear();
  }
  workers_.ForgetDead(now);
  RefreshQueueReasons();
}

void Coordinator::FindStragglers() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  const std::set<std::string> silent = workers_.Silent(3 * options_.heartbeat_interval, now);
  const StragglerPolicy policy{.report_after = options_.straggler_report_after,
                               .timeout = options_.straggler_timeout};
  for (JobRecord* job : jobs_.jobs()) {
    if (job->phase != JobPhase::kRunning) continue;
    const StragglerScan scan = job->run->FindStragglers(now, policy, silent);
    if (job->ListStragglers(scan.listed) && !scan.listed.empty()) {
      Log(absl::StrCat(job->status.job_id(), ": straggler", scan.listed.size() == 1 ? " " : "s ",
                       absl::StrJoin(scan.listed, ", ")));
    }
    for (const Straggler& s : scan.to_drop) {
      if (RegisteredWorker* w = workers_.Find(s.worker_id); w != nullptr) w->job_id.clear();
      job->status.set_stragglers_dropped(job->status.stragglers_dropped() + 1);
      RemoveMember(*job, s.worker_id,
                   absl::StrCat("a straggler: ", s.run_steps, " steps while the others reached ",
                                s.lead, ", no progress for ", absl::FormatDuration(s.stalled),
                                " (--straggler-timeout-s)"));
      if (job->phase != JobPhase::kRunning) break;
    }
  }
}

void Coordinator::CheckShards() {
  std::vector<std::string> running;
  {
    absl::MutexLock lock(&mu_);
    if (Now() - last_shard_check_ < options_.shard_check_interval) return;
    last_shard_check_ = Now();
    running = jobs_.RunningOnShards();
  }
  for (const std::string& id : running) {
    const std::vector<int> missing = shards_->ShardsMissingJob(id, options_.shard_check_timeout);
    if (missing.empty()) continue;
    const std::string why =
        absl::StrCat(shards_->Describe(missing[0]), " no longer holds the job (it restarted)");
    absl::MutexLock lock(&mu_);
    JobRecord* job = jobs_.Find(id);
    if (job != nullptr && job->phase == JobPhase::kRunning) RequeueRun(*job, why);
  }
}

void Coordinator::DropStrayJobs() {
  {
    absl::MutexLock lock(&mu_);
    if (Now() - last_stray_check_ < options_.stray_job_check_interval) return;
    last_stray_check_ = Now();
  }
  for (int s = 0; s < num_shards_; ++s) {
    absl::StatusOr<std::vector<std::string>> held =
        shards_->ListJobs(s, options_.shard_check_timeout);
    if (!held.ok()) continue;  // Down or restarting: asked again next time.
    for (const std::string& id : *held) {
      const std::string why = WhyStray(id);
      if (why.empty()) continue;
      const absl::Status dropped = shards_->DropJobOn(s, id);
      Log(absl::StrCat(id, ": ", dropped.ok() ? "dropped from " : "could not drop it from ",
                       shards_->Describe(s), ": ", why,
                       dropped.ok() ? "" : absl::StrCat(" (", dropped.message(), ")")));
    }
  }
}

std::string Coordinator::WhyStray(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  return jobs_.WhyStray(job_id);
}

void Coordinator::SyncMembership() {
  std::vector<std::pair<std::string, MembershipChange>> changes;
  {
    absl::MutexLock lock(&mu_);
    changes = jobs_.TakeMembershipChanges();
  }
  for (const auto& [id, change] : changes) {
    std::map<std::string, int64_t> removed_steps;
    absl::Status s = shards_->SetMembers(id, change.members, change.generation, &removed_steps);
    absl::MutexLock lock(&mu_);
    JobRecord* job = jobs_.Find(id);
    if (job == nullptr) continue;
    if (s.ok()) {
      job->ShardsUpdated(change, removed_steps);
      continue;
    }
    // Some shards may have the new member set and others not: rather than
    // train on mixed generations, start a new run from the checkpoint, which
    // configures every shard afresh (a shard that stays down then fails the
    // resume with its error).
    if (job->phase == JobPhase::kRunning) {
      RequeueRun(*job, absl::StrCat("could not update the shards' member set (", s.message(), ")"));
    }
  }
}

void Coordinator::StartQueuedJobs() {
  std::vector<RunReservation> starts;
  {
    absl::MutexLock lock(&mu_);
    LaunchCommands();
    starts = ReserveWorkers();
  }
  for (const RunReservation& work : starts) {
    absl::StatusOr<RunLaunch> launch = PrepareLaunch(work, checkpointer_);
    absl::Status status = launch.status();
    if (status.ok()) status = shards_->ConfigureJob(launch->shards);
    absl::MutexLock lock(&mu_);
    LaunchRun(work, status, launch.ok() ? launch->start : DataPosition{});
  }
  if (!starts.empty()) {
    absl::MutexLock lock(&mu_);
    RefreshQueueReasons();
  }
}

std::vector<RunReservation> Coordinator::ReserveWorkers() {
  // Pool workers go to the queue in order; a job with bound workers (an
  // external model, a launcher's) takes only the workers bound to it.
  IdleWorkers idle = IdleWorkersByJob();
  size_t next_pool = 0;
  std::vector<RunReservation> starts;
  for (JobRecord* job : jobs_.jobs()) {
    if (job->phase != JobPhase::kQueued || !job->ReadyToStart()) continue;
    const bool bound = JobTakesBoundWorkers(job->status.spec());
    std::vector<RegisteredWorker*>& candidates =
        bound ? idle.bound[job->status.job_id()] : idle.pool;
    const size_t first = bound ? 0 : next_pool;
    const size_t wanted = static_cast<size_t>(job->status.spec().workers());
    if (candidates.size() - first < wanted) continue;
    std::vector<std::string> members;
    for (size_t r = 0; r < wanted; ++r) {
      RegisteredWorker* w = candidates[first + r];
      w->job_id = job->status.job_id();
      members.push_back(w->id);
    }
    if (!bound) next_pool += wanted;
    starts.push_back(job->Reserve(members, Now()));
  }
  return starts;
}

void Coordinator::LaunchRun(const RunReservation& work, const absl::Status& status,
                            DataPosition start) {
  JobRecord* job = jobs_.Find(work.job_id);
  if (job == nullptr) return;
  job->shards_configured = true;                  // Possibly partly: DropJob cleans up either way.
  if (job->phase != JobPhase::kStarting) return;  // Cancelled meanwhile.
  if (!status.ok()) {
    Finish(
        *job, v1::JOB_STATE_FAILED,
        absl::StrCat(work.resume ? "could not resume: " : "could not start: ", status.message()));
    return;
  }
  job->Launch(work, start,
              absl::StrFormat("%s.%d.%016x", work.job_id, job->status.runs() + 1, incarnation_),
              Now());
  Log(absl::StrCat(work.job_id, ": RUNNING on ", absl::StrJoin(work.members, ", "), " (run ",
                   job->run->run_id(), ", generation ", work.generation,
                   work.resume ? absl::StrCat(", from epoch ", start.epoch, " step ", start.step)
                               : std::string(),
                   ")"));
}

void Coordinator::WriteDueCheckpoints() {
  std::vector<CheckpointWork> works;
  {
    absl::MutexLock lock(&mu_);
    works = DueCheckpoints();
  }
  for (const CheckpointWork& work : works) {
    const absl::Status s = WriteCheckpoint(work);
    absl::MutexLock lock(&mu_);
    if (JobRecord* job = jobs_.Find(work.job_id); job != nullptr) CheckpointDone(*job, work, s);
  }
}

std::vector<CheckpointWork> Coordinator::DueCheckpoints() {
  std::vector<CheckpointWork> works;
  for (JobRecord* job : jobs_.jobs()) {
    const std::optional<CheckpointWork::Kind> kind =
        job->CheckpointDue(options_.checkpoint_interval, Now());
    if (kind) works.push_back(job->CheckpointOf(*kind));
  }
  return works;
}

absl::Status Coordinator::WriteCheckpoint(const CheckpointWork& work) {
  PSTRAIN_ASSIGN_OR_RETURN(ModelSnapshot model, checkpoint_writer_.ReadModel(work));
  {
    absl::MutexLock lock(&mu_);
    max_model_version_ = std::max(max_model_version_, model.max_version);
  }
  return checkpoint_writer_.Write(work, std::move(model));
}

void Coordinator::CheckpointDone(JobRecord& job, const CheckpointWork& work,
                                 const absl::Status& s) {
  job.CheckpointWritten(work, s, !options_.state_dir.empty(), Now());
  switch (work.kind) {
    case CheckpointWork::kInterval:
      if (!s.ok()) Log(absl::StrCat(work.job_id, ": checkpoint failed: ", s.message()));
      break;
    case CheckpointWork::kStop:
      if (!s.ok()) Log(absl::StrCat(work.job_id, ": could not save the model: ", s.message()));
      break;
    case CheckpointWork::kEpoch:
      if (s.ok()) {
        ReformIfWorkersWait(job, work.position.epoch);
      } else {
        Log(absl::StrCat(work.job_id, ": checkpoint of epoch ", work.position.epoch,
                         " failed: ", s.message()));
      }
      break;
    case CheckpointWork::kFinal:
      if (job.phase == JobPhase::kFinalizing) FinishEvaluated(job, s);  // Else cancelled meanwhile.
      break;
  }
  job.Touch();
}

void Coordinator::FinishEvaluated(JobRecord& job, const absl::Status& final_checkpoint) {
  const absl::Status& s = final_checkpoint;
  if (absl::IsUnavailable(s) || absl::IsNotFound(s) || absl::IsDeadlineExceeded(s)) {
    // A shard is down or came back empty (seen in the chaos run: shard 1
    // killed as the last epoch ended): its part of the final model is gone,
    // so the run resumes from the latest checkpoint and its members train
    // the rest and evaluate again.
    RequeueRun(job, absl::StrCat("could not read the final model (", s.message(), ")"));
    return;
  }
  if (!s.ok()) {
    Finish(job, v1::JOB_STATE_FAILED,
           absl::StrCat("could not write the final checkpoint: ", s.message()));
    return;
  }
  const v1::EvalMetrics test = job.Evaluated();
  const int epochs = job.status.spec().epochs();
  Finish(job, v1::JOB_STATE_SUCCEEDED,
         test.samples() > 0
             ? absl::StrFormat("finished %d epochs; test accuracy %.4f on %d samples", epochs,
                               test.accuracy(), test.samples())
             : absl::StrFormat("finished %d epochs (no test set was evaluated)", epochs));
}

void Coordinator::DropFinishedJobs() {
  std::vector<std::string> drops;
  {
    absl::MutexLock lock(&mu_);
    drops = jobs_.TakeEndedOnShards();
  }
  for (const std::string& id : drops) {
    const absl::Status s = shards_->DropJob(id);
    if (!s.ok()) Log(absl::StrCat(id, ": dropping it from the shards failed: ", s.message()));
  }
}

void Coordinator::PersistChangedJobs() {
  if (options_.state_dir.empty()) return;
  absl::MutexLock persist_lock(&persist_mu_);
  JobRegistry::Unsaved unsaved;
  {
    absl::MutexLock lock(&mu_);
    unsaved = jobs_.Changed();
  }
  for (const auto& [status, revision] : unsaved.statuses) {
    if (absl::Status s = store_.SaveJob(status); !s.ok()) {
      Log(absl::StrCat(status.job_id(), ": could not save its status: ", s.message()));
      continue;
    }
    absl::MutexLock lock(&mu_);
    jobs_.StatusSaved(status.job_id(), revision);
  }
  for (const auto& [history, revision] : unsaved.histories) {
    if (absl::Status s = store_.SaveHistory(history); !s.ok()) {
      Log(absl::StrCat(history.job_id(), ": could not save its history: ", s.message()));
      continue;
    }
    absl::MutexLock lock(&mu_);
    jobs_.HistorySaved(history.job_id(), revision);
  }
}

}  // namespace pstrain
