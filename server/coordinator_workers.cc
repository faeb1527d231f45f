// The Coordinator's calls from workers (server/coordinator.h): RegisterWorker,
// Heartbeat, ReportProgress, EpochPlan, DeclareModel and ListWorkers. The
// rest of the class is in coordinator.cc.
#include <algorithm>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/job_state.h"
#include "common/status_macros.h"
#include "server/coordinator.h"

namespace pstrain {
namespace {

// `text` cut to at most `max_bytes` (a note says so).
std::string Truncated(const std::string& text, int max_bytes) {
  if (static_cast<int64_t>(text.size()) <= max_bytes) return text;
  return absl::StrCat(text.substr(0, static_cast<size_t>(max_bytes)), "... (",
                      text.size() - static_cast<size_t>(max_bytes), " more bytes cut)");
}

}  // namespace

// ---------------------------------------------------------------------------
// Workers
// ---------------------------------------------------------------------------

absl::StatusOr<v1::RegisterWorkerResponse> Coordinator::RegisterWorker(
    const v1::WorkerInfo& info, const std::string& previous_worker_id) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("previous_worker_id", previous_worker_id));
  PSTRAIN_RETURN_IF_ERROR(CheckId("info.job_id", info.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckId("info.launched_by", info.launched_by()));
  absl::MutexLock lock(&mu_);
  if (!info.job_id().empty()) {  // Bound to one job: one that takes bound workers.
    PSTRAIN_ASSIGN_OR_RETURN(const JobRecord* job, jobs_.Get(info.job_id()));
    if (job->phase == JobPhase::kDone || !JobTakesBoundWorkers(job->status.spec())) {
      return absl::FailedPreconditionError(absl::StrCat(
          info.job_id(),
          job->phase == JobPhase::kDone
              ? absl::StrCat(" has ended (", v1::JobState_Name(job->status.state()), ")")
              : " trains a ModelSpec model: the pool's pstrain-worker daemons run it "
                "(a launcher's job sets bound_workers)"));
    }
  }
  PSTRAIN_ASSIGN_OR_RETURN(RegisteredWorker * worker,
                           workers_.Register(info, previous_worker_id, Now()));
  v1::RegisterWorkerResponse response;
  response.set_worker_id(worker->id);
  response.set_heartbeat_interval_ms(
      static_cast<int32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  for (const std::string& a : shard_addresses_) response.add_shards(a);
  Log(absl::StrCat(worker->id,
                   worker->id == previous_worker_id ? ": registered again (" : ": registered (",
                   info.hostname(), ", ", info.backend(), ")"));
  RefreshQueueReasons();
  Wake();
  return response;
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const std::string& worker_id,
                                                             const std::string& job_id,
                                                             const std::string& run_id,
                                                             int64_t run_steps) {
  v1::HeartbeatRequest request;
  request.set_worker_id(worker_id);
  request.set_job_id(job_id);
  request.set_run_id(run_id);
  request.set_run_steps(run_steps);
  return Heartbeat(request);
}

absl::StatusOr<v1::HeartbeatResponse> Coordinator::Heartbeat(const v1::HeartbeatRequest& request) {
  const std::string& worker_id = request.worker_id();
  const std::string& job_id = request.job_id();
  const std::string& run_id = request.run_id();
  const int64_t run_steps = request.run_steps();
  PSTRAIN_RETURN_IF_ERROR(CheckId("run_id", run_id));
  PSTRAIN_RETURN_IF_ERROR(CheckId("worker_id", worker_id));
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  PSTRAIN_RETURN_IF_ERROR(CheckId("command_job_id", request.command_job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckId("command_end.job_id", request.command_end().job_id()));
  absl::MutexLock lock(&mu_);
  v1::HeartbeatResponse response;
  RegisteredWorker* found = workers_.Find(worker_id);
  if (found == nullptr) {
    response.set_action(v1::HeartbeatResponse::ACTION_REREGISTER);
    return response;
  }
  RegisteredWorker& worker = *found;
  if (workers_.Heard(worker, Now())) {
    Log(absl::StrCat(worker_id, ": heartbeats again; back in the pool"));
    RefreshQueueReasons();
    Wake();
  }
  if (request.has_command_end()) CommandEnded(worker, request.command_end());
  if (!request.command_job_id().empty() || !worker.launching.empty()) {
    return AnswerLauncher(worker, request.command_job_id());
  }
  // The run whose assignment is published for this worker, if any.
  const JobRecord* current = jobs_.Find(worker.job_id);
  RunMember* member = current == nullptr ? nullptr : current->PublishedMember(worker_id);
  if (member == nullptr) current = nullptr;
  if (!job_id.empty() && (current == nullptr || job_id != worker.job_id) &&
      job_id != worker.finished_job) {
    response.set_action(v1::HeartbeatResponse::ACTION_STOP);
    return response;
  }
  if (current == nullptr) {
    // A worker bound to a job that ended (or that this server forgot) has
    // nothing left to wait for.
    const JobRecord* bound =
        worker.info.job_id().empty() ? nullptr : jobs_.Find(worker.info.job_id());
    const bool bound_job_over =
        !worker.info.job_id().empty() && (bound == nullptr || bound->phase == JobPhase::kDone);
    response.set_action(bound_job_over ? v1::HeartbeatResponse::ACTION_STOP
                                       : v1::HeartbeatResponse::ACTION_IDLE);
    return response;
  }
  if (run_steps >= 0 && run_id == current->run->run_id()) {
    current->run->RecordRunSteps(*member, run_steps, Now());
  }
  response.set_action(v1::HeartbeatResponse::ACTION_RUN);
  *response.mutable_assignment() = current->AssignmentOf(*member, run_id);
  return response;
}

absl::StatusOr<bool> Coordinator::ReportProgress(const v1::ReportProgressRequest& report) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("worker_id", report.worker_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", report.job_id()));
  absl::MutexLock lock(&mu_);
  RegisteredWorker* worker = workers_.Find(report.worker_id());
  if (worker == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("unknown worker '", report.worker_id(), "'; register again"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(JobRecord * job, jobs_.Get(report.job_id()));
  worker->last_heartbeat = Now();
  RunMember* member = job->run == nullptr ? nullptr : job->run->FindMember(report.worker_id());
  if (std::optional<bool> stop = job->AnswerWithoutRecording(report, member)) return *stop;
  PSTRAIN_RETURN_IF_ERROR(ApplyProgress(*job, *worker, *member, report));
  job->Touch();
  return job->phase == JobPhase::kDone;
}

absl::Status Coordinator::ApplyProgress(JobRecord& job, RegisteredWorker& worker, RunMember& member,
                                        const v1::ReportProgressRequest& report) {
  const int epochs = job.status.spec().epochs();
  if (!report.error().empty()) {
    Finish(job, v1::JOB_STATE_FAILED,
           absl::StrCat(report.worker_id(), " (rank ", member.rank,
                        ") failed: ", Truncated(report.error(), options_.max_reason_bytes)));
    Wake();
    return absl::OkStatus();
  }
  if (!report.finished() && (report.epoch() < 0 || report.epoch() > epochs || report.step() < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("progress of ", report.worker_id(), ": epoch ",
                                                   report.epoch(), " is outside [0, ", epochs,
                                                   "] or step ", report.step(), " is negative"));
  }
  if (report.finished()) {
    PSTRAIN_RETURN_IF_ERROR(job.CheckEvalShard(report, options_.max_eval_samples));
  }
  const int old_epoch = job.status.epoch();
  job.RecordProgress(member, report, options_.max_history_points, Now());
  if (report.finished()) {
    worker.job_id.clear();
    worker.finished_job = job.status.job_id();
    Log(absl::StrCat(job.status.job_id(), ": ", report.worker_id(), " finished (",
                     report.eval_shard().samples(), " test samples)"));
    RefreshQueueReasons();
  }
  if (report.finished() || job.status.epoch() != old_epoch) Wake();
  return absl::OkStatus();
}

absl::StatusOr<v1::EpochPlanResponse> Coordinator::EpochPlan(const v1::EpochPlanRequest& request) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("worker_id", request.worker_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", request.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckId("run_id", request.run_id()));
  absl::MutexLock lock(&mu_);
  RegisteredWorker* worker = workers_.Find(request.worker_id());
  if (worker == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("unknown worker '", request.worker_id(), "'; register again"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(JobRecord * job, jobs_.Get(request.job_id()));
  if (job->phase != JobPhase::kRunning || !job->run->launched()) {
    return absl::FailedPreconditionError(absl::StrCat(request.job_id(), " is not running"));
  }
  PSTRAIN_RETURN_IF_ERROR(job->run->CheckPlanRequest(request));
  worker->last_heartbeat = Now();
  PSTRAIN_ASSIGN_OR_RETURN(v1::EpochPlanResponse response, job->run->Plan(request));
  job->run->CountEpochSamples(&job->status);
  job->Touch();
  return response;
}

absl::StatusOr<bool> Coordinator::DeclareModel(const std::string& worker_id,
                                               const std::string& job_id,
                                               const v1::ExternalModel& model,
                                               std::vector<std::vector<float>> values) {
  PSTRAIN_RETURN_IF_ERROR(CheckId("worker_id", worker_id));
  PSTRAIN_RETURN_IF_ERROR(CheckId("job_id", job_id));
  v1::JobSpec spec;
  {
    absl::MutexLock lock(&mu_);
    RegisteredWorker* worker = workers_.Find(worker_id);
    if (worker == nullptr) {
      return absl::NotFoundError(absl::StrCat("unknown worker '", worker_id, "'; register again"));
    }
    if (worker->info.job_id() != job_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          worker_id, " is not bound to ", job_id, " (WorkerInfo.job_id at its registration)"));
    }
    PSTRAIN_ASSIGN_OR_RETURN(const JobRecord* job, jobs_.Get(job_id));
    spec = job->status.spec();
    if (ExternalModelDeclared(spec)) {  // A later worker's: the same model, values ignored.
      PSTRAIN_RETURN_IF_ERROR(CheckSameExternalModel(spec.external_model(), model));
      if (job->ReadyToStart() || job->phase == JobPhase::kDone) {
        return job->phase == JobPhase::kDone
                   ? absl::FailedPreconditionError(absl::StrCat(
                         job_id, " has ended (", v1::JobState_Name(job->status.state()), ")"))
                   : absl::StatusOr<bool>(false);
      }
    }
  }
  // The checks of a submitted spec, with this model, outside the lock.
  if (!spec.has_external_model()) {
    return absl::FailedPreconditionError(
        absl::StrCat(job_id, " trains a model written as a ModelSpec; it takes no declared model"));
  }
  *spec.mutable_external_model() = model;
  if (model.tensors_size() == 0) return absl::InvalidArgumentError("the model has no tensors");
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, ValidateJob(spec));
  PSTRAIN_RETURN_IF_ERROR(CheckParameterValues(graph, values));
  absl::MutexLock lock(&mu_);
  PSTRAIN_ASSIGN_OR_RETURN(JobRecord * job, jobs_.Get(job_id));
  PSTRAIN_ASSIGN_OR_RETURN(bool declared,
                           job->DeclareModel(model, std::move(graph), std::move(values)));
  if (declared) {
    Log(absl::StrCat(job_id, ": ", worker_id, " declared the model (", model.tensors_size(),
                     " tensors, ", job->graph.trainable_params + job->graph.non_trainable_params,
                     " values, ", model.framework(), ")"));
    RefreshQueueReasons();
    Wake();
  }
  return declared;
}

std::vector<v1::WorkerStatus> Coordinator::ListWorkers() const {
  absl::MutexLock lock(&mu_);
  return workers_.List();
}

CoordinatorStats Coordinator::Stats() const {
  absl::MutexLock lock(&mu_);
  CoordinatorStats stats;
  jobs_.Count(&stats.jobs_by_state, &stats.stragglers);
  stats.workers_registered = workers_.size();
  stats.workers_alive = workers_.AliveCount();
  stats.max_model_version = max_model_version_;
  return stats;
}

// ---------------------------------------------------------------------------
// Command jobs: daemons that run a job's command (see coordinator.h)
// ---------------------------------------------------------------------------

std::set<std::string> Coordinator::Launchers(const std::string& job_id) const {
  std::set<std::string> launchers;
  for (const RegisteredWorker* w : workers_.All()) {
    if (w->launching == job_id) launchers.insert(w->id);
    if (w->alive && w->info.job_id() == job_id && !w->info.launched_by().empty()) {
      launchers.insert(w->info.launched_by());
    }
  }
  return launchers;
}

void Coordinator::LaunchCommands() {
  std::vector<RegisteredWorker*> daemons;
  for (RegisteredWorker* w : workers_.IdleByNumber()) {
    if (w->info.job_id().empty() && w->info.runs_commands()) daemons.push_back(w);
  }
  size_t next = 0;
  for (JobRecord* job : jobs_.jobs()) {
    if (next == daemons.size()) break;
    if (job->phase != JobPhase::kQueued || !job->status.spec().has_command()) continue;
    // Loaded after a restart: its daemons and processes come back first.
    if (Now() < launch_grace_until_) continue;
    const std::string& id = job->status.job_id();
    size_t have = Launchers(id).size();
    const size_t wanted = static_cast<size_t>(job->status.spec().workers());
    while (have < wanted && next < daemons.size()) {
      RegisteredWorker* d = daemons[next++];
      d->launching = id;
      ++have;
      Log(absl::StrCat(id, ": ", d->id, " (", d->info.hostname(), ") runs its command (", have,
                       " of ", wanted, ")"));
    }
  }
  if (next > 0) RefreshQueueReasons();
}

v1::HeartbeatResponse Coordinator::AnswerLauncher(RegisteredWorker& daemon,
                                                  const std::string& running) {
  v1::HeartbeatResponse response;
  const std::string job_id = running.empty() ? daemon.launching : running;
  const JobRecord* job = jobs_.Find(job_id);
  const bool live =
      job != nullptr && job->phase != JobPhase::kDone && job->status.spec().has_command();
  if (!running.empty()) {
    if (!live || !daemon.info.runs_commands()) {
      if (daemon.launching == running) daemon.launching.clear();
      response.set_action(v1::HeartbeatResponse::ACTION_STOP);
      return response;
    }
    if (daemon.launching != running) {  // This server restarted: the daemon's word.
      Log(absl::StrCat(running, ": ", daemon.id, " runs its command"));
      daemon.launching = running;
      RefreshQueueReasons();
    }
    response.set_action(v1::HeartbeatResponse::ACTION_LAUNCH);
  } else if (live && job->phase == JobPhase::kQueued) {
    response.set_action(v1::HeartbeatResponse::ACTION_LAUNCH);
  } else {
    // Told to launch, and the job started or ended without it: nothing runs.
    daemon.launching.clear();
    RefreshQueueReasons();
    response.set_action(v1::HeartbeatResponse::ACTION_IDLE);
    return response;
  }
  response.mutable_assignment()->set_job_id(job_id);
  *response.mutable_assignment()->mutable_spec() = job->status.spec();
  return response;
}

void Coordinator::CommandEnded(RegisteredWorker& daemon, const v1::CommandEnd& end) {
  JobRecord* job = jobs_.Find(end.job_id());
  std::vector<RegisteredWorker*> processes;  // The workers its command made.
  for (RegisteredWorker* w : workers_.All()) {
    if (w->info.job_id() == end.job_id() && w->info.launched_by() == daemon.id) {
      processes.push_back(w);
    }
  }
  // Only the daemon told to run the command speaks for it.
  if (daemon.launching != end.job_id() && processes.empty()) return;
  if (daemon.launching == end.job_id()) daemon.launching.clear();
  Wake();
  if (job == nullptr || job->phase == JobPhase::kDone) return;
  const std::string on = absl::StrCat("the command on ", daemon.id, " (", daemon.info.hostname(), ")");
  if (!end.refused().empty()) {
    Finish(*job, v1::JOB_STATE_FAILED,
           absl::StrCat(daemon.id, " refused to run the command: ",
                        Truncated(end.refused(), options_.max_reason_bytes)));
    return;
  }
  const std::string how = end.signal() != 0
                              ? absl::StrCat("was killed by signal ", end.signal())
                              : absl::StrCat("exited with status ", end.exit_code());
  const std::string output =
      end.output_tail().empty()
          ? std::string()
          : absl::StrCat("; its last output:\n", Truncated(end.output_tail(), options_.max_reason_bytes));
  // A member it made that had not finished.
  RegisteredWorker* member = nullptr;
  for (RegisteredWorker* w : processes) {
    const RunMember* m = job->run == nullptr ? nullptr : job->run->FindMember(w->id);
    if (m != nullptr && !m->finished) member = w;
  }
  const bool before_start = job->phase == JobPhase::kQueued && member == nullptr;
  if (end.signal() != 0) {
    for (RegisteredWorker* w : processes) {
      if (w->alive) workers_.MarkDead(*w, Now());
    }
    if (member != nullptr) {
      member->job_id.clear();
      RemoveMember(*job, member->id, absl::StrCat("its process: ", on, " ", how));
    } else {
      Log(absl::StrCat(job->status.job_id(), ": ", on, " ", how,
                       before_start ? "; launched again" : ""));
      RefreshQueueReasons();
    }
    return;
  }
  if (end.exit_code() == 0) {
    if (member != nullptr) {
      member->job_id.clear();
      RemoveMember(*job, member->id, absl::StrCat("its process ended before it finished: ", on,
                                                   " ", how));
    } else if (before_start) {
      Finish(*job, v1::JOB_STATE_FAILED,
             absl::StrCat(on, " ", how,
                          " before it joined the job (does it call pstrain.torch.init()?)", output));
    }
    return;
  }
  if (member != nullptr || before_start) {
    Finish(*job, v1::JOB_STATE_FAILED,
           absl::StrCat(on, member != nullptr ? absl::StrCat(" (", member->id, ")") : "", " ", how,
                        output));
  }
}

}  // namespace pstrain
