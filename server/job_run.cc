#include "server/job_run.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "server/eval_merge.h"

namespace pstrain {

// ---------------------------------------------------------------------------
// Lifecycle and members
// ---------------------------------------------------------------------------

JobRun::JobRun(const v1::JobSpec& spec, const std::vector<std::string>& workers, int64_t generation,
               absl::Time now)
    : mode_(spec.mode()),
      batch_size_(spec.batch_size()),
      epochs_(spec.epochs()),
      generation_(generation) {
  for (size_t r = 0; r < workers.size(); ++r) {
    RunMember m;
    m.worker_id = workers[r];
    m.rank = static_cast<int>(r);
    m.steps_changed_at = now;
    members_.push_back(std::move(m));
  }
}

void JobRun::Launch(std::string run_id, DataPosition start, absl::Time now) {
  run_id_ = std::move(run_id);
  start_ = start;
  lost_pending_.clear();
  planner_ = std::make_unique<EpochPlanner>(EpochPlanner::RunStart{
      .start_epoch = start.epoch,
      .start_step = start.step,
      .batch_size = std::max(1, batch_size_),
      .epochs = epochs_,
      .barrier = mode_ != v1::CONSISTENCY_ASYNC && mode_ != v1::CONSISTENCY_SSP});
  last_checkpoint_epoch_ = start.epoch;
  last_checkpoint_time_ = now;
}

std::vector<std::string> JobRun::ReleaseMembers() {
  std::vector<std::string> ids = MemberIds();
  members_.clear();
  return ids;
}

std::vector<std::string> JobRun::MemberIds() const {
  std::vector<std::string> ids;
  for (const RunMember& m : members_) ids.push_back(m.worker_id);
  return ids;
}

RunMember* JobRun::FindMember(const std::string& worker_id) {
  for (RunMember& m : members_) {
    if (m.worker_id == worker_id) return &m;
  }
  return nullptr;
}

bool JobRun::AllFinished() const {
  return !members_.empty() && std::all_of(members_.begin(), members_.end(),
                                          [](const RunMember& m) { return m.finished; });
}

bool JobRun::RemoveMember(const std::string& worker_id) {
  auto it = std::find_if(members_.begin(), members_.end(),
                         [&](const RunMember& m) { return m.worker_id == worker_id; });
  if (it == members_.end() || it->finished) return false;
  members_.erase(it);
  lost_pending_.push_back(worker_id);
  generation_++;
  for (size_t r = 0; r < members_.size(); ++r) members_[r].rank = static_cast<int>(r);
  if (!members_.empty()) membership_dirty_ = true;
  return true;
}

std::optional<MembershipChange> JobRun::TakeMembershipChange() {
  if (!membership_dirty_) return std::nullopt;
  membership_dirty_ = false;
  return MembershipChange{MemberIds(), generation_, run_id_, lost_pending_};
}

void JobRun::MembersLost(const MembershipChange& change,
                         const std::map<std::string, int64_t>& removed_steps) {
  if (change.run_id != run_id_ || planner_ == nullptr) return;
  // Every sample once: the lost members' untrained work goes to the
  // survivors within the epoch (server/epoch_planner.h).
  for (const std::string& lost : change.lost) {
    auto steps = removed_steps.find(lost);
    planner_->MemberLost(lost, steps == removed_steps.end() ? 0 : steps->second, change.members);
    std::erase(lost_pending_, lost);
  }
}

// ---------------------------------------------------------------------------
// Heartbeats and progress
// ---------------------------------------------------------------------------

void JobRun::RecordRunSteps(RunMember& member, int64_t run_steps, absl::Time now) {
  if (run_steps == member.run_steps) return;
  member.run_steps = run_steps;
  member.steps_changed_at = now;
}

void JobRun::RecordProgress(RunMember& member, const v1::ReportProgressRequest& report,
                            int epochs) {
  member.reported = true;
  if (!report.finished()) {
    member.epoch = report.epoch();
    member.step = report.step();
    member.loss = report.loss();
    member.train_accuracy = report.train_accuracy();
    member.samples_per_sec = report.samples_per_sec();
    if (report.steps_per_epoch() > 0) member.steps_per_epoch = report.steps_per_epoch();
    return;
  }
  // Done means every epoch: the final report's training figures are not
  // needed (the last progress report's loss and accuracy stay).
  member.epoch = epochs;
  member.step = std::max(member.step, report.step());
  member.samples_per_sec = 0;
  member.finished = true;
  member.eval = report.eval_shard();
}

int64_t JobRun::TestSamplesClaimedByOthers(const std::string& worker_id) const {
  int64_t claimed = 0;
  for (const RunMember& m : members_) {
    if (m.finished && m.worker_id != worker_id) claimed += m.eval.samples();
  }
  return claimed;
}

v1::EvalMetrics JobRun::MergedTest() const {
  std::vector<const v1::EvalMetrics*> shards;
  for (const RunMember& m : members_) shards.push_back(&m.eval);
  return MergeEvalShards(shards);
}

// ---------------------------------------------------------------------------
// Epoch-plan broker
// ---------------------------------------------------------------------------

absl::Status JobRun::CheckPlanRequest(const v1::EpochPlanRequest& request) const {
  if (request.run_id() != run_id_) {
    return absl::AbortedError(absl::StrCat("run ", request.run_id(), " of ", request.job_id(),
                                           " is not its current run"));
  }
  if (std::none_of(members_.begin(), members_.end(),
                   [&](const RunMember& m) { return m.worker_id == request.worker_id(); })) {
    return absl::FailedPreconditionError(
        absl::StrCat(request.worker_id(), " is not a member of ", request.job_id()));
  }
  if (request.batch_size() != batch_size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch size ", request.batch_size(), " is not the job's ", batch_size_));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::EpochPlanResponse> JobRun::Plan(const v1::EpochPlanRequest& request) {
  if (request.trained_size() > epochs_) {
    return absl::InvalidArgumentError(
        absl::StrCat("trained lists ", request.trained_size(), " epochs; the job has ", epochs_));
  }
  for (const v1::EpochSamples& t : request.trained()) {
    planner_->RecordTrained(request.worker_id(), t.epoch(), t.samples());
  }
  v1::EpochPlanResponse response;
  if (!lost_pending_.empty() || membership_dirty_) {
    response.set_wait(true);
    return response;
  }
  return planner_->Plan(request.worker_id(), request.epoch(), request.epoch_length(),
                        request.share_done(), request.tails_done(), MemberIds());
}

std::function<std::pair<int, int64_t>(int64_t)> JobRun::PositionOfVersion() const {
  if (planner_ == nullptr) return nullptr;
  auto planner = std::make_shared<EpochPlanner>(*planner_);
  return [planner](int64_t version) { return planner->PositionOfVersion(version); };
}

// ---------------------------------------------------------------------------
// Liveness
// ---------------------------------------------------------------------------

StragglerScan JobRun::FindStragglers(absl::Time now, const StragglerPolicy& policy,
                                     const std::set<std::string>& silent_workers) const {
  int64_t lead = 0;
  for (const RunMember& m : members_) lead = std::max(lead, m.run_steps);
  const bool can_drop =
      mode_ == v1::CONSISTENCY_SYNC && policy.timeout > absl::ZeroDuration() && members_.size() > 1;
  StragglerScan scan;
  for (const RunMember& m : members_) {
    if (m.finished) continue;
    const bool silent = silent_workers.count(m.worker_id) > 0;
    const absl::Duration stalled = now - m.steps_changed_at;
    const bool behind = m.run_steps < lead && stalled > policy.report_after;
    if (can_drop && behind && stalled > policy.timeout) {
      scan.to_drop.push_back(Straggler{m.worker_id, m.run_steps, lead, stalled});
    } else if (silent || behind) {
      scan.listed.push_back(m.worker_id);
    }
  }
  return scan;
}

// ---------------------------------------------------------------------------
// Aggregates
// ---------------------------------------------------------------------------

int64_t JobRun::StepsPerEpoch() const {
  int64_t slowest = 0;
  for (const RunMember& m : members_) {
    if (m.steps_per_epoch > 0 && (slowest == 0 || m.steps_per_epoch < slowest)) {
      slowest = m.steps_per_epoch;
    }
  }
  return slowest;
}

void JobRun::Aggregate(v1::JobStatus* status) const {
  if (members_.empty()) return;
  int epoch = 0;
  int64_t step = 0;
  double loss = 0, accuracy = 0, samples_per_sec = 0;
  int reported = 0;
  bool first = true;
  for (const RunMember& m : members_) {
    const int e = m.reported ? m.epoch : start_.epoch;
    const int64_t s = m.reported ? m.step : start_.step;
    if (first || e < epoch) epoch = e;
    if (first || s < step) step = s;
    first = false;
    if (!m.reported) continue;
    ++reported;
    loss += m.loss;
    accuracy += m.train_accuracy;
    if (!m.finished) samples_per_sec += m.samples_per_sec;
  }
  status->set_epoch(epoch);
  status->set_step(step);
  if (reported > 0) {
    status->set_loss(loss / reported);
    status->set_train_accuracy(accuracy / reported);
  }
  status->set_samples_per_sec(samples_per_sec);
  // Steps per epoch: as the members report it (the slowest one's), else
  // estimated from the slowest member once it completed an epoch.
  const int64_t reported_per_epoch = StepsPerEpoch();
  const int epochs_done = epoch - start_.epoch;
  if (reported_per_epoch > 0) {
    // Global steps count from the job's start at epoch * steps_per_epoch,
    // so the total is epochs * steps_per_epoch (it moves only when a
    // membership change alters the steps per epoch).
    status->set_total_steps(std::max(step, epochs_ * reported_per_epoch));
  } else if (epochs_done > 0) {
    const int64_t per_epoch = step / epochs_done;
    // Membership changes alter the steps per epoch: never below the steps done.
    status->set_total_steps(std::max(step, per_epoch * (epochs_ - start_.epoch)));
  }
  status->clear_workers();
  for (const RunMember& m : members_) status->add_workers(m.worker_id);
}

void JobRun::CountEpochSamples(v1::JobStatus* status) const {
  if (planner_ == nullptr) return;
  std::map<int, v1::EpochSamples> by_epoch;
  for (const v1::EpochSamples& e : status->epoch_samples()) by_epoch[e.epoch()] = e;
  for (const auto& [epoch, samples] : planner_->TrainedSamples()) {
    if (epoch < start_.epoch) continue;  // Counted by the run that trained it.
    v1::EpochSamples& e = by_epoch[epoch];
    e.set_epoch(epoch);
    e.set_samples(samples);
    e.set_expected(planner_->epoch_length());
  }
  status->clear_epoch_samples();
  for (const auto& [epoch, e] : by_epoch) *status->add_epoch_samples() = e;
}

bool JobRun::RecordHistory(const v1::JobStatus& status, int max_points, absl::Time now,
                           v1::JobHistory* history) const {
  if (std::none_of(members_.begin(), members_.end(),
                   [](const RunMember& m) { return m.reported; })) {
    return false;  // The figures are the previous run's.
  }
  auto* points = history->mutable_points();
  history->set_min_step_gap(std::max<int64_t>(1, history->min_step_gap()));
  if (!points->empty() && status.step() < points->rbegin()->step() + history->min_step_gap()) {
    return false;  // Not yet (the gap is not a change worth saving).
  }
  v1::HistoryPoint& p = *points->Add();
  p.set_step(status.step());
  p.set_epoch(status.epoch());
  p.set_loss(status.loss());
  p.set_train_accuracy(status.train_accuracy());
  p.set_samples_per_sec(status.samples_per_sec());
  p.set_unix_ms(absl::ToUnixMillis(now));
  p.set_run(status.runs());
  if (points->size() > max_points) {
    // Every other point goes (the newest stays), and later points come at
    // twice the gap: a long job's history keeps its whole run, evenly.
    int kept = 0;
    for (int i = 0; i < points->size(); ++i) {
      if (i % 2 == 0 || i == points->size() - 1) points->SwapElements(kept++, i);
    }
    points->DeleteSubrange(kept, points->size() - kept);
    history->set_min_step_gap(history->min_step_gap() * 2);
  }
  return true;
}

bool DropHistoryAfter(int64_t step, v1::JobHistory* history) {
  auto* points = history->mutable_points();
  const auto past = std::find_if(points->begin(), points->end(),
                                 [&](const v1::HistoryPoint& p) { return p.step() > step; });
  if (past == points->end()) return false;
  points->erase(past, points->end());
  return true;
}

// ---------------------------------------------------------------------------
// Checkpoint codec: EncodeCheckpoint and DecodeCheckpoint are inverses.
// ---------------------------------------------------------------------------

v1::Checkpoint EncodeCheckpoint(const v1::JobSpec& spec, const ModelGraph& graph,
                                const CheckpointContents& contents, absl::Time created) {
  v1::Checkpoint ckpt;
  *ckpt.mutable_job() = spec;
  for (size_t p = 0; p < graph.params.size(); ++p) {
    const ParamInfo& info = graph.params[p];
    *ckpt.add_parameters() =
        MakeTensorProto(info.name, info.shape.dims(), contents.params[p].data());
    // Optimizer state of this parameter, slots in name order.
    const std::string prefix = info.name + "/";
    for (auto it = contents.optimizer_state.lower_bound(prefix);
         it != contents.optimizer_state.end() && absl::StartsWith(it->first, prefix); ++it) {
      if (it->first.find('/', prefix.size()) != std::string::npos) continue;
      *ckpt.add_optimizer_state() =
          MakeTensorProto(it->first, info.shape.dims(), it->second.data());
    }
  }
  ckpt.mutable_chunk_versions()->Assign(contents.chunk_versions.begin(),
                                        contents.chunk_versions.end());
  ckpt.set_step(contents.position.step);
  ckpt.set_epoch(contents.position.epoch);
  ckpt.set_created_unix_ms(absl::ToUnixMillis(created));
  return ckpt;
}

absl::StatusOr<CheckpointContents> DecodeCheckpoint(const v1::Checkpoint& checkpoint,
                                                    const ModelGraph& graph) {
  CheckpointContents contents;
  std::map<std::string, const v1::TensorProto*> by_name;
  for (const v1::TensorProto& t : checkpoint.parameters()) by_name[t.name()] = &t;
  for (const ParamInfo& p : graph.params) {
    auto it = by_name.find(p.name);
    if (it == by_name.end()) {
      return absl::DataLossError(absl::StrCat("the checkpoint lacks ", p.name));
    }
    absl::StatusOr<std::vector<float>> values = TensorProtoToFloats(*it->second);
    if (!values.ok()) return values.status();
    contents.params.push_back(*std::move(values));
  }
  for (const v1::TensorProto& t : checkpoint.optimizer_state()) {
    absl::StatusOr<std::vector<float>> values = TensorProtoToFloats(t);
    if (!values.ok()) return values.status();
    contents.optimizer_state[t.name()] = *std::move(values);
  }
  contents.chunk_versions.assign(checkpoint.chunk_versions().begin(),
                                 checkpoint.chunk_versions().end());
  contents.position = {.epoch = checkpoint.epoch(), .step = checkpoint.step()};
  return contents;
}

void ResumeLaunchFrom(CheckpointContents contents, v1::ConsistencyMode mode, JobLaunch* launch) {
  launch->params = std::move(contents.params);
  launch->optimizer_state = std::move(contents.optimizer_state);
  // The server-side optimizer counts iterations by version: go on from the
  // checkpoint's (average mode counts rounds and runs no optimizer on the
  // server, so it starts again from 0). In sync mode the checkpoint is a cut
  // at the global step. In async and ssp every push is a version, so a
  // chunk's version is about members x steps: each chunk goes on from the
  // version it was saved at (resuming at the step rewound the learning-rate
  // schedule by half with two workers; the chaos run of ssp showed it as
  // +0.7 points). Workers learn every chunk's version from their first pull.
  if (mode != v1::CONSISTENCY_AVERAGE) launch->initial_version = contents.position.step;
  const std::vector<int64_t>& versions = contents.chunk_versions;
  if ((mode == v1::CONSISTENCY_ASYNC || mode == v1::CONSISTENCY_SSP) && !versions.empty() &&
      std::all_of(versions.begin(), versions.end(), [](int64_t v) { return v >= 0; })) {
    launch->chunk_versions = versions;
    // A plan of another size (another shard count) gets the newest.
    launch->initial_version = *std::max_element(versions.begin(), versions.end());
  }
}

}  // namespace pstrain
