#include "server/job_record.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/job_state.h"
#include "common/status_macros.h"
#include "server/eval_merge.h"

namespace pstrain {
namespace {

// JobStatus.reason of a run that just started.
std::string RunningReason(const v1::JobStatus& s, size_t members, bool resumed,
                          DataPosition start) {
  std::string reason = absl::StrCat("training on ", members, " worker", members == 1 ? "" : "s");
  if (s.runs() <= 1) return reason;
  if (resumed) {
    absl::StrAppend(&reason, " (run ", s.runs(), ", resumed from the checkpoint of epoch ",
                    start.epoch, ", step ", start.step, "; ", s.steps_lost(),
                    " steps lost so far)");
  } else {
    absl::StrAppend(&reason, " (run ", s.runs(),
                    ", started again from the beginning: no checkpoint yet; ", s.steps_lost(),
                    " steps lost so far)");
  }
  return reason;
}

}  // namespace

absl::StatusOr<RunLaunch> PrepareLaunch(const RunReservation& reservation,
                                        const Checkpointer& checkpoints) {
  RunLaunch launch;
  launch.shards.job_id = reservation.job_id;
  launch.shards.spec = reservation.spec;
  launch.shards.members = reservation.members;
  launch.shards.generation = reservation.generation;
  if (!reservation.resume) {
    launch.shards.params = reservation.initial_values != nullptr
                               ? *reservation.initial_values
                               : InitialParameterValues(reservation.graph);
    return launch;
  }
  PSTRAIN_ASSIGN_OR_RETURN(const v1::Checkpoint checkpoint,
                           checkpoints.LoadLatest(reservation.job_id));
  PSTRAIN_ASSIGN_OR_RETURN(CheckpointContents contents,
                           DecodeCheckpoint(checkpoint, reservation.graph));
  launch.start = contents.position;
  ResumeLaunchFrom(std::move(contents), reservation.spec.mode(), &launch.shards);
  return launch;
}

JobRecord::JobRecord(const std::string& job_id, v1::JobSpec spec, ModelGraph graph_in,
                     absl::Time now)
    : graph(std::move(graph_in)) {
  status.set_job_id(job_id);
  history.set_job_id(job_id);
  status.set_name(spec.name());
  status.set_state(v1::JOB_STATE_QUEUED);
  *status.mutable_spec() = std::move(spec);
  status.set_submitted_unix_ms(absl::ToUnixMillis(now));
}

JobRecord::JobRecord(v1::JobStatus saved, absl::StatusOr<ModelGraph> graph_in,
                     bool has_checkpoint_in, absl::Time now)
    : status(std::move(saved)), has_checkpoint(has_checkpoint_in) {
  persisted_revision = revision;
  if (graph_in.ok()) graph = *std::move(graph_in);
  if (IsTerminal(status.state())) {
    phase = JobPhase::kDone;
  } else if (!graph_in.ok()) {
    phase = JobPhase::kDone;
    status.set_state(v1::JOB_STATE_FAILED);
    status.set_reason(absl::StrCat("server restarted and the saved job is invalid: ",
                                   graph_in.status().message()));
    status.set_finished_unix_ms(absl::ToUnixMillis(now));
    Touch();
  } else {
    phase = JobPhase::kQueued;
    status.set_state(v1::JOB_STATE_QUEUED);
    status.clear_workers();
    status.set_reason(has_checkpoint ? absl::StrCat("server restarted; resumes from the "
                                                    "checkpoint of epoch ",
                                                    status.epoch())
                                     : "server restarted; restarts from the beginning");
    Touch();
  }
}

bool JobRecord::SetQueueReason(int idle, int launched, int command_daemons) {
  const int wanted = status.spec().workers();
  const bool external = JobTakesBoundWorkers(status.spec());
  std::string reason =
      status.spec().has_external_model() && !ReadyToStart()
          ? absl::StrCat("waiting for a worker to declare the model; ", idle, " of ", wanted,
                         " bound to the job registered")
          : absl::StrCat("waiting for ", wanted, external ? " worker" : " idle worker",
                         wanted == 1 ? "" : "s", external ? " bound to the job, " : ", ", idle,
                         external ? " registered" : " available");
  if (status.spec().has_command() && launched < wanted) {
    absl::StrAppend(&reason, "; its command runs on ", launched, " of ", wanted,
                    " pstrain-worker daemons (", command_daemons,
                    " idle daemons run commands: --command-root)");
  }
  if (has_checkpoint) {
    absl::StrAppend(&reason, "; resumes from the checkpoint of epoch ", status.epoch());
  }
  if (reason == status.reason()) return false;
  status.set_reason(reason);
  Touch();
  return true;
}

absl::StatusOr<bool> JobRecord::DeclareModel(const v1::ExternalModel& model, ModelGraph graph_in,
                                             std::vector<std::vector<float>> values) {
  const std::string& id = status.job_id();
  if (!status.spec().has_external_model()) {
    return absl::FailedPreconditionError(
        absl::StrCat(id, " trains a model written as a ModelSpec; it takes no declared model"));
  }
  if (phase == JobPhase::kDone) {
    return absl::FailedPreconditionError(
        absl::StrCat(id, " has ended (", v1::JobState_Name(status.state()), ")"));
  }
  if (ExternalModelDeclared(status.spec())) {
    PSTRAIN_RETURN_IF_ERROR(CheckSameExternalModel(status.spec().external_model(), model));
    if (ReadyToStart()) return false;
    // Loaded after a restart without a checkpoint: the same model again,
    // with values to start from.
  } else {
    *status.mutable_spec()->mutable_external_model() = model;
    graph = std::move(graph_in);
  }
  initial_values = std::make_shared<const std::vector<std::vector<float>>>(std::move(values));
  Touch();
  return true;
}

bool JobRecord::ReadyToStart() const {
  if (!status.spec().has_external_model()) return true;
  return ExternalModelDeclared(status.spec()) && (has_checkpoint || initial_values != nullptr);
}

RunReservation JobRecord::Reserve(const std::vector<std::string>& workers, absl::Time now) {
  RunReservation r;
  r.job_id = status.job_id();
  r.spec = status.spec();
  r.graph = graph;
  r.members = workers;
  r.generation = run == nullptr ? 1 : run->generation() + 1;
  r.resume = has_checkpoint;
  r.step_before = status.step();
  r.initial_values = initial_values;
  run = std::make_unique<JobRun>(r.spec, r.members, r.generation, now);
  phase = JobPhase::kStarting;
  return r;
}

void JobRecord::Launch(const RunReservation& reservation, DataPosition start, std::string run_id,
                       absl::Time now) {
  phase = JobPhase::kRunning;
  // The steps past the resume point were thrown away with the model that
  // trained them: the history goes on from the kept one.
  if (DropHistoryAfter(start.step, &history)) history_revision++;
  // This run counts its epochs afresh (a resumed epoch's trained prefix is
  // reported by its members).
  auto* counts = status.mutable_epoch_samples();
  counts->erase(std::remove_if(counts->begin(), counts->end(),
                               [&](const v1::EpochSamples& e) { return e.epoch() >= start.epoch; }),
                counts->end());
  // A restart loses the steps since its checkpoint, or all of them when the
  // job had none yet.
  if (status.runs() > 0) {
    status.set_steps_lost(status.steps_lost() +
                          std::max<int64_t>(0, reservation.step_before - start.step));
  }
  status.set_runs(status.runs() + 1);
  run->Launch(std::move(run_id), start, now);
  status.set_state(v1::JOB_STATE_RUNNING);
  status.set_epoch(start.epoch);
  status.set_step(start.step);
  if (status.started_unix_ms() == 0) status.set_started_unix_ms(absl::ToUnixMillis(now));
  status.set_reason(RunningReason(status, reservation.members.size(), reservation.resume, start));
  run->Aggregate(&status);
  Touch();
}

std::vector<std::string> JobRecord::End(v1::JobState state, const std::string& reason,
                                        absl::Time now) {
  status.set_state(state);
  status.set_reason(reason);
  status.set_finished_unix_ms(absl::ToUnixMillis(now));
  status.set_samples_per_sec(0);
  status.clear_workers();
  status.clear_stragglers();
  phase = JobPhase::kDone;
  Touch();
  return run == nullptr ? std::vector<std::string>{} : run->MemberIds();
}

std::vector<std::string> JobRecord::BackToQueue() {
  std::vector<std::string> members;
  if (run != nullptr) members = run->ReleaseMembers();
  phase = JobPhase::kQueued;
  status.set_state(v1::JOB_STATE_QUEUED);
  status.clear_workers();
  status.set_samples_per_sec(0);
  Touch();
  return members;
}

bool JobRecord::LoseMember(const std::string& worker_id) {
  if (run == nullptr || !run->RemoveMember(worker_id)) return false;
  status.set_workers_lost(status.workers_lost() + 1);
  if (run->members().empty()) {
    // Nobody left: back to the queue; it resumes from its last checkpoint.
    phase = JobPhase::kQueued;
    status.set_state(v1::JOB_STATE_QUEUED);
    status.clear_workers();
    status.set_samples_per_sec(0);
  } else {
    run->Aggregate(&status);
  }
  Touch();
  return true;
}

void JobRecord::RecordProgress(RunMember& member, const v1::ReportProgressRequest& report,
                               int max_history_points, absl::Time now) {
  run->RecordProgress(member, report, status.spec().epochs());
  run->Aggregate(&status);
  if (!report.finished() && run->RecordHistory(status, max_history_points, now, &history)) {
    history_revision++;
  }
}

RunMember* JobRecord::PublishedMember(const std::string& worker_id) const {
  if (phase != JobPhase::kRunning) return nullptr;
  RunMember* member = run->FindMember(worker_id);
  return member != nullptr && !member->finished ? member : nullptr;
}

v1::Assignment JobRecord::AssignmentOf(const RunMember& member,
                                       const std::string& worker_run_id) const {
  v1::Assignment a;
  a.set_job_id(status.job_id());
  // The spec does not change within a run (issue 11, lean heartbeats).
  if (worker_run_id != run->run_id()) *a.mutable_spec() = status.spec();
  a.set_rank(member.rank);
  a.set_world_size(static_cast<int32_t>(run->members().size()));
  a.set_start_epoch(std::max(run->start().epoch, status.epoch()));
  a.set_generation(run->generation());
  a.set_run_id(run->run_id());
  a.set_start_step(run->start().step);
  return a;
}

absl::Status JobRecord::CheckEvalShard(const v1::ReportProgressRequest& report,
                                       int64_t max_eval_samples) const {
  const std::optional<int64_t> test_set = TestSetBound(status.spec());
  EvalShardBudget budget;
  budget.num_classes = graph.num_classes;
  budget.samples_left =
      test_set.value_or(max_eval_samples) - run->TestSamplesClaimedByOthers(report.worker_id());
  budget.bound_source = test_set ? absl::StrCat("the test set holds ", *test_set)
                                 : absl::StrCat("--max-eval-samples is ", max_eval_samples);
  return pstrain::CheckEvalShard(report.eval_shard(), report.worker_id(), budget);
}

void JobRecord::ShardsUpdated(const MembershipChange& change,
                              const std::map<std::string, int64_t>& removed_steps) {
  if (phase != JobPhase::kRunning || change.run_id != run->run_id() || !run->launched()) return;
  run->MembersLost(change, removed_steps);
  run->CountEpochSamples(&status);
  Touch();
}

std::optional<bool> JobRecord::AnswerWithoutRecording(const v1::ReportProgressRequest& report,
                                                      const RunMember* member) const {
  if (phase == JobPhase::kDone) return status.state() != v1::JOB_STATE_SUCCEEDED;
  if (member == nullptr || phase == JobPhase::kQueued || phase == JobPhase::kStarting) {
    return true;
  }
  if (!report.run_id().empty() && report.run_id() != run->run_id()) {
    return true;  // A replaced run: its worker stops; nothing it says counts.
  }
  if (member->finished) return false;
  return std::nullopt;
}

void JobRecord::CheckpointWritten(const CheckpointWork& work, const absl::Status& written,
                                  bool kept, absl::Time now) {
  if (written.ok() && kept) {
    has_checkpoint = true;
    initial_values = nullptr;  // A run that starts again resumes from the checkpoint.
  }
  if (written.ok()) run->CheckpointWritten(now);
  if (work.kind == CheckpointWork::kStop) save_on_stop = false;
  if (work.kind == CheckpointWork::kEpoch && written.ok()) {
    run->EpochCheckpointWritten(work.position.epoch);
  }
}

bool JobRecord::ListStragglers(const std::vector<std::string>& stragglers) {
  if (std::equal(stragglers.begin(), stragglers.end(), status.stragglers().begin(),
                 status.stragglers().end())) {
    return false;
  }
  status.mutable_stragglers()->Assign(stragglers.begin(), stragglers.end());
  Touch();
  return true;
}

std::optional<CheckpointWork::Kind> JobRecord::CheckpointDue(absl::Duration interval,
                                                             absl::Time now) {
  if (phase == JobPhase::kDone && save_on_stop) return CheckpointWork::kStop;
  if (phase != JobPhase::kRunning) return std::nullopt;
  if (run->AllFinished()) {
    phase = JobPhase::kFinalizing;
    status.set_reason("evaluated; writing the final checkpoint");
    Touch();
    return CheckpointWork::kFinal;
  }
  // After the last epoch the final checkpoint follows the evaluation.
  if (status.epoch() >= status.spec().epochs()) return std::nullopt;
  if (status.epoch() > run->last_checkpoint_epoch()) return CheckpointWork::kEpoch;
  if (interval > absl::ZeroDuration() && now - run->last_checkpoint_time() >= interval) {
    return CheckpointWork::kInterval;
  }
  return std::nullopt;
}

CheckpointWork JobRecord::CheckpointOf(CheckpointWork::Kind kind) const {
  CheckpointWork work;
  work.kind = kind;
  work.job_id = status.job_id();
  work.spec = status.spec();
  work.graph = graph;
  work.position = {.epoch = status.epoch(), .step = status.step()};
  work.steps_per_epoch = run->StepsPerEpoch();
  work.position_of_version = run->PositionOfVersion();  // A copy: written without the lock.
  return work;
}

v1::EvalMetrics JobRecord::Evaluated() {
  const v1::EvalMetrics test = run->MergedTest();
  *status.mutable_test() = test;
  status.set_epoch(status.spec().epochs());
  status.set_total_steps(status.step());
  return test;
}

}  // namespace pstrain
