#include "worker/remote_updater.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/job_spec.h"
#include "common/status_macros.h"

namespace pstrain {

RemoteUpdaterOptions RemoteUpdaterOptionsFromJob(const v1::JobSpec& job, int rank) {
  RemoteUpdaterOptions options;
  options.mode = ConsistencyModeOf(job);
  options.rank = rank;
  options.optimizer = job.optimizer();
  options.averaging_frequency = std::max(1, job.averaging_frequency());
  options.average_optimizer_state = job.average_optimizer_state();
  options.compress_pulls = options.mode == v1::CONSISTENCY_SYNC &&
                           job.pull_compression().method() != v1::CompressionSpec::COMPRESSION_NONE;
  return options;
}

absl::StatusOr<std::unique_ptr<RemoteUpdater>> RemoteUpdater::Create(RemoteUpdaterOptions options,
                                                                     Model* model,
                                                                     PsClient* client) {
  if (model == nullptr || client == nullptr) {
    return absl::InvalidArgumentError("RemoteUpdater::Create: null model or client");
  }
  if (options.mode == v1::CONSISTENCY_AVERAGE && options.averaging_frequency < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "averaging_frequency must be > 0 in average mode, got ", options.averaging_frequency));
  }
  std::unique_ptr<RemoteUpdater> updater(new RemoteUpdater(std::move(options), model, client));
  PSTRAIN_RETURN_IF_ERROR(updater->Init());
  return updater;
}

RemoteUpdater::RemoteUpdater(RemoteUpdaterOptions options, Model* model, PsClient* client)
    : options_(std::move(options)), model_(model), client_(client), plan_(client->plan()) {
  rank_.store(options_.rank);
}

RemoteUpdater::~RemoteUpdater() {
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](RemoteUpdater* u) ABSL_EXCLUSIVE_LOCKS_REQUIRED(u->mu_) {
          return u->tasks_.empty() && u->tasks_in_flight_ == 0;
        },
        this));
    stop_dispatcher_ = true;
  }
  if (dispatcher_.joinable()) dispatcher_.join();
  std::vector<std::unique_ptr<PendingOp>> pushes;
  {
    absl::MutexLock lock(&mu_);
    pushes.swap(pushes_);
  }
  for (auto& op : pushes) op->Wait().IgnoreError();
  for (auto& pull : pulls_) pull.op->Wait().IgnoreError();
}

absl::Status RemoteUpdater::Init() {
  const ModelGraph& graph = model_->graph();
  if (plan_.by_param.size() != graph.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the chunk plan covers ", plan_.by_param.size(),
                                                   " parameters but the model has ",
                                                   graph.params.size()));
  }
  for (const ChunkInfo& c : plan_.chunks) {
    if (c.param < 0 || c.param >= static_cast<int>(graph.params.size()) || c.offset < 0 ||
        c.offset + c.count > graph.params[c.param].shape.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", c.id, " does not fit parameter ", c.param, " of the model"));
    }
  }
  Backend* backend = model_->backend();
  auto make_view = [&](Tensor* tensor) -> absl::StatusOr<HostView> {
    HostView view;
    view.tensor = tensor;
    if (direct()) {
      view.host = tensor->data();
    } else {
      PSTRAIN_ASSIGN_OR_RETURN(view.staging, backend->AllocatePinned(tensor->bytes()));
      view.host = static_cast<float*>(view.staging.data());
    }
    return view;
  };
  params_.resize(graph.params.size());
  grads_.resize(graph.params.size());
  for (int i = 0; i < model_->num_params(); ++i) {
    PSTRAIN_ASSIGN_OR_RETURN(params_[i], make_view(&model_->param(i)));
    const bool trainable = graph.params[i].trainable;
    if (trainable && options_.mode != v1::CONSISTENCY_AVERAGE) {
      PSTRAIN_ASSIGN_OR_RETURN(grads_[i], make_view(&model_->grad(i)));
    }
    for (int c : plan_.by_param[i]) {
      all_chunks_.push_back(c);
      (trainable ? trainable_chunks_ : running_stat_chunks_).push_back(c);
    }
  }
  for (int p : ParamsInPushOrder(graph)) {
    push_order_chunks_.insert(push_order_chunks_.end(), plan_.by_param[p].begin(),
                              plan_.by_param[p].end());
  }
  chunk_version_.assign(plan_.chunks.size(), 0);
  held_.assign(plan_.chunks.size(), PsClient::HeldValues{});

  if (options_.mode == v1::CONSISTENCY_AVERAGE) {
    PSTRAIN_ASSIGN_OR_RETURN(local_, LocalUpdater::Create(options_.optimizer, model_));
    if (options_.average_optimizer_state) {
      // StateTensors() lists "<param>/<slot>" per parameter in slot order;
      // the slot index on the wire is the position within the parameter.
      std::map<int, int> slots_seen;
      for (const auto& [name, tensor] : local_->optimizer().StateTensors()) {
        const size_t cut = name.rfind('/');
        const int param = cut == std::string::npos ? -1 : model_->FindParam(name.substr(0, cut));
        if (param < 0) {
          return absl::InternalError(absl::StrCat("optimizer state '", name,
                                                  "' names no parameter of the model"));
        }
        const int slot = slots_seen[param]++;
        if (slot >= static_cast<int>(state_.size())) state_.emplace_back(graph.params.size());
        PSTRAIN_ASSIGN_OR_RETURN(state_[slot][param], make_view(tensor));
        if (slot == 0) state_params_.push_back(param);
      }
    }
  }
  if (!direct()) {
    dispatcher_ = std::thread([this] { DispatcherLoop(); });
  }
  return absl::OkStatus();
}

bool RemoteUpdater::PushesRunningStats() const {
  // Sync and average keep the mean over every member per version, so every
  // member pushes; async and ssp take the last write: rank 0's.
  if (options_.mode == v1::CONSISTENCY_SYNC || options_.mode == v1::CONSISTENCY_AVERAGE) {
    return true;
  }
  return rank_.load() == 0;
}

bool RemoteUpdater::Retryable(const absl::Status& status) {
  // NOT_FOUND: a shard no longer holds the job. It restarted empty (the
  // coordinator then starts a new run from the checkpoint and stops this
  // one) or the job ended (this runner is stopped too): keep resyncing
  // until one of those happens, or resync_timeout.
  return absl::IsAborted(status) || absl::IsUnavailable(status) || absl::IsNotFound(status);
}

int64_t RemoteUpdater::version() const {
  if (chunk_version_.empty()) return 0;
  return *std::min_element(chunk_version_.begin(), chunk_version_.end());
}

// --- Start, steps, finish -------------------------------------------------------

absl::Status RemoteUpdater::Start() {
  for (auto& pull : pulls_) pull.op->Wait().IgnoreError();
  pulls_.clear();
  PSTRAIN_RETURN_IF_ERROR(Resync());
  PSTRAIN_RETURN_IF_ERROR(CopyPulledIntoModel());
  return model_->backend()->Synchronize();
}

absl::Status RemoteUpdater::BeforeStep(int64_t step, Model& model) {
  step_start_ = absl::Now();
  timings_ = StepTimings();
  timings_.step = step;
  if (cancelled()) return absl::CancelledError("the job was stopped");
  if (options_.mode != v1::CONSISTENCY_AVERAGE) {
    PSTRAIN_RETURN_IF_ERROR(WaitPulls());
  }
  if (need_resync_) {
    PSTRAIN_RETURN_IF_ERROR(Resync());
    ++resyncs_;
  }
  PSTRAIN_RETURN_IF_ERROR(CopyPulledIntoModel());
  compute_start_ = absl::Now();
  timings_.pull_wait_seconds = absl::ToDoubleSeconds(compute_start_ - step_start_);
  return absl::OkStatus();
}

void RemoteUpdater::OnGradientsReady(int64_t step, int layer, absl::Span<const int> params) {
  if (options_.mode == v1::CONSISTENCY_AVERAGE || !staging_error_.ok()) return;
  StageGradients(params);
}

absl::Status RemoteUpdater::ApplyUpdate(int64_t step, Model& model) {
  const absl::Time apply_start = absl::Now();
  timings_.compute_seconds = absl::ToDoubleSeconds(apply_start - compute_start_);
  if (options_.mode == v1::CONSISTENCY_AVERAGE) {
    PSTRAIN_RETURN_IF_ERROR(local_->ApplyUpdate(step, model));
    ++clock_;
    if (++local_steps_ >= options_.averaging_frequency) {
      PSTRAIN_RETURN_IF_ERROR(AverageRound());
    }
    timings_.push_wait_seconds = absl::ToDoubleSeconds(absl::Now() - apply_start);
  } else {
    if (!staging_error_.ok()) return std::exchange(staging_error_, absl::OkStatus());
    // PushGradients: the rest of backward's gradients, then running statistics.
    FlushGradients();
    PSTRAIN_RETURN_IF_ERROR(PushRunningStats());
    // PullNext, in flight while the trainer takes the next batch. In sync
    // mode it goes out with the pushes rather than after their answers: a
    // shard answers the pull of version t+1 only once every member's push
    // of t, this one's included, is applied, so the pull cannot overtake
    // them (nor write a chunk's values before that chunk's push was sent),
    // and a step waits one round trip less. Async and ssp pull after the
    // answers, so that a pull sees this worker's own update.
    const bool pipelined = options_.mode == v1::CONSISTENCY_SYNC && !need_resync_;
    ++clock_;
    if (pipelined) IssuePulls();
    PSTRAIN_RETURN_IF_ERROR(WaitPushes());
    last_applied_ = !need_resync_;  // Else this step's contribution was dropped.
    timings_.push_wait_seconds = absl::ToDoubleSeconds(absl::Now() - apply_start);
    if (need_resync_ && pipelined) {
      // A refused push: version t+1 may wait for it for good. BeforeStep
      // resynchronises instead.
      for (PullOp& pull : pulls_) pull.op->Cancel();
      for (PullOp& pull : pulls_) pull.op->Wait().IgnoreError();
      pulls_.clear();
    }
    if (!pipelined && !need_resync_) IssuePulls();
  }
  timings_.total_seconds = absl::ToDoubleSeconds(absl::Now() - step_start_);
  if (options_.on_step) options_.on_step(timings_);
  return absl::OkStatus();
}

absl::Status RemoteUpdater::Finish() {
  if (options_.mode == v1::CONSISTENCY_AVERAGE) {
    if (local_steps_ > 0) PSTRAIN_RETURN_IF_ERROR(AverageRound());
  } else {
    PSTRAIN_RETURN_IF_ERROR(WaitPulls());
    if (need_resync_) PSTRAIN_RETURN_IF_ERROR(Resync());
    if (options_.compress_pulls) {
      // The workers trained on the published values, which trail the master
      // by what the pull codec has not sent; the run ends on the master's,
      // so that the final evaluation is of the model users download.
      absl::Status status = PullMaster();
      if (Retryable(status)) {
        PSTRAIN_RETURN_IF_ERROR(Resync());  // Waits for the servers, within resync_timeout.
        status = PullMaster();
      }
      PSTRAIN_RETURN_IF_ERROR(status);
    }
    PSTRAIN_RETURN_IF_ERROR(CopyPulledIntoModel());
  }
  return model_->backend()->Synchronize();
}

// --- Pulls ---------------------------------------------------------------------

absl::Status RemoteUpdater::PullMaster() {
  if (!direct()) {
    // Pulled values land in the staging buffers: let earlier copies finish.
    PSTRAIN_RETURN_IF_ERROR(model_->backend()->Synchronize());
  }
  std::vector<PullOp> ops = PullChunks(v1::ChunkHeader::KIND_PARAMETERS, 0, all_chunks_, params_, 0,
                                       false, /*master=*/true);
  absl::Status status = WaitPullOps(ops, /*record_versions=*/true);
  pulled_not_copied_ = true;
  return status;
}

std::vector<RemoteUpdater::PullOp> RemoteUpdater::PullChunks(v1::ChunkHeader::Kind kind, int slot,
                                                             const std::vector<int>& chunks,
                                                             std::vector<HostView>& views,
                                                             int64_t version_delta,
                                                             bool one_per_chunk, bool master) {
  const bool versioned =
      options_.mode == v1::CONSISTENCY_SYNC || options_.mode == v1::CONSISTENCY_AVERAGE;
  std::map<int64_t, std::vector<int>> groups;  // min_version -> chunks.
  for (int c : chunks) {
    groups[versioned ? chunk_version_[c] + version_delta : 0].push_back(c);
  }
  std::vector<PullOp> ops;
  auto issue = [&](int64_t min_version, std::vector<int> group) {
    std::vector<PsClient::ChunkDest> dests;
    dests.reserve(group.size());
    for (int c : group) {
      const ChunkInfo& info = plan_.chunks[c];
      PsClient::HeldValues* held =
          options_.compress_pulls && kind == v1::ChunkHeader::KIND_PARAMETERS ? &held_[c] : nullptr;
      dests.push_back({c, views[info.param].host + info.offset, held});
    }
    ops.push_back({client_->Pull(kind, min_version, clock_, std::move(dests), slot, master),
                   std::move(group)});
  };
  for (auto& [min_version, group] : groups) {
    if (one_per_chunk) {
      for (int c : group) issue(min_version, {c});
    } else {
      issue(min_version, std::move(group));
    }
  }
  return ops;
}

absl::Status RemoteUpdater::WaitPullOps(std::vector<PullOp>& ops, bool record_versions) {
  absl::Status first;
  for (PullOp& pull : ops) {
    absl::Status status = pull.op->Wait();
    if (!status.ok()) {
      first.Update(status);
      continue;
    }
    if (record_versions) {
      for (int c : pull.chunks) chunk_version_[c] = pull.op->version();
    }
  }
  ops.clear();
  return first;
}

void RemoteUpdater::IssuePulls() {
  if (!direct() && h2d_done_ != nullptr) {
    // The staging buffers feed the previous H2D copies until they complete;
    // on CUDA the pushes' events (recorded later on the stream) already imply
    // it, so this wait returns at once.
    h2d_done_->Wait().IgnoreError();
    h2d_done_.reset();
  }
  const int64_t delta = options_.mode == v1::CONSISTENCY_SYNC ? 1 : 0;
  pulls_ =
      PullChunks(v1::ChunkHeader::KIND_PARAMETERS, 0, push_order_chunks_, params_, delta, false);
}

absl::Status RemoteUpdater::WaitPulls() {
  if (pulls_.empty()) return absl::OkStatus();
  absl::Status status = WaitPullOps(pulls_, /*record_versions=*/true);
  pulled_not_copied_ = true;
  if (Retryable(status)) {
    need_resync_ = true;
    return absl::OkStatus();
  }
  return status;
}

absl::Status RemoteUpdater::CopyPulledIntoModel() {
  if (direct() || !pulled_not_copied_) {
    pulled_not_copied_ = false;
    return absl::OkStatus();
  }
  Backend* backend = model_->backend();
  for (HostView& view : params_) {
    PSTRAIN_RETURN_IF_ERROR(
        backend->CopyHostToDevice(view.tensor->data(), view.host, view.tensor->bytes()));
  }
  PSTRAIN_ASSIGN_OR_RETURN(h2d_done_, backend->RecordEvent());
  pulled_not_copied_ = false;
  return absl::OkStatus();
}

absl::Status RemoteUpdater::CopyStateIntoModel() {
  if (direct()) return absl::OkStatus();
  Backend* backend = model_->backend();
  for (auto& slot : state_) {
    for (int p : state_params_) {
      HostView& view = slot[p];
      PSTRAIN_RETURN_IF_ERROR(
          backend->CopyHostToDevice(view.tensor->data(), view.host, view.tensor->bytes()));
    }
  }
  return absl::OkStatus();
}

absl::Status RemoteUpdater::Resync() {
  if (!direct()) {
    // Pulled values land in the staging buffers: let earlier copies finish.
    PSTRAIN_RETURN_IF_ERROR(model_->backend()->Synchronize());
  }
  const absl::Time deadline = absl::Now() + options_.resync_timeout;
  absl::Duration backoff = absl::Milliseconds(50);
  std::vector<int> state_chunks;
  for (int p : state_params_) {
    for (int c : plan_.by_param[p]) state_chunks.push_back(c);
  }
  for (;;) {
    if (cancelled()) return absl::CancelledError("the job was stopped");
    // Every chunk on its own: learns each chunk's version (a membership
    // change may leave them a step apart).
    std::vector<PullOp> ops =
        PullChunks(v1::ChunkHeader::KIND_PARAMETERS, 0, all_chunks_, params_, 0, true);
    absl::Status status = WaitPullOps(ops, /*record_versions=*/true);
    for (int slot = 0; status.ok() && slot < static_cast<int>(state_.size()); ++slot) {
      std::vector<PullOp> state_ops = PullChunks(v1::ChunkHeader::KIND_OPTIMIZER_STATE, slot,
                                                 state_chunks, state_[slot], 0, true);
      status = WaitPullOps(state_ops, /*record_versions=*/false);
    }
    if (status.ok()) break;
    if (!Retryable(status) || absl::Now() + backoff > deadline) {
      return absl::Status(status.code(),
                          absl::StrCat("cannot resynchronise with the parameter servers: ",
                                       status.message()));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
  need_resync_ = false;
  pulled_not_copied_ = true;
  local_steps_ = 0;
  PSTRAIN_RETURN_IF_ERROR(CopyStateIntoModel());
  return absl::OkStatus();
}

// --- Pushes --------------------------------------------------------------------

std::vector<std::unique_ptr<PendingOp>> RemoteUpdater::PushChunks(
    v1::ChunkHeader::Kind kind, int slot, int clock, const std::vector<int>& chunks,
    const std::vector<HostView>& views) {
  std::map<int64_t, std::vector<PsClient::ChunkRef>> groups;  // version -> chunks.
  for (int c : chunks) {
    const ChunkInfo& info = plan_.chunks[c];
    groups[chunk_version_[c]].push_back({c, views[info.param].host + info.offset});
  }
  std::vector<std::unique_ptr<PendingOp>> ops;
  for (auto& [version, refs] : groups) {
    ops.push_back(client_->Push(kind, version, clock, std::move(refs), slot));
  }
  return ops;
}

void RemoteUpdater::StageGradients(absl::Span<const int> params) {
  Backend* backend = model_->backend();
  for (int p : params) {
    HostView& view = grads_[p];
    if (view.tensor == nullptr) continue;  // Not trainable.
    if (!direct()) {
      absl::Status status = backend->CopyDeviceToHost(view.host, view.tensor->data(),
                                                      view.tensor->bytes());
      if (!status.ok()) {
        staging_error_ = status;
        return;
      }
    }
    for (int c : plan_.by_param[p]) {
      gradient_batch_.push_back(c);
      gradient_batch_bytes_ += plan_.chunks[c].count * static_cast<int64_t>(sizeof(float));
    }
  }
  if (gradient_batch_bytes_ >= options_.min_push_bytes && !GradientPushInFlight()) {
    FlushGradients();
  }
}

bool RemoteUpdater::GradientPushInFlight() {
  absl::MutexLock lock(&mu_);
  return !tasks_.empty() || tasks_in_flight_ > 0 ||
         std::any_of(pushes_.begin(), pushes_.end(),
                     [](const std::unique_ptr<PendingOp>& op) { return !op->Done(); });
}

void RemoteUpdater::FlushGradients() {
  if (gradient_batch_.empty()) return;
  PushTask task;
  task.kind = v1::ChunkHeader::KIND_GRADIENT;
  task.clock = clock_ + 1;
  task.chunks = std::move(gradient_batch_);
  task.views = &grads_;
  gradient_batch_.clear();
  gradient_batch_bytes_ = 0;
  if (!direct()) {
    absl::StatusOr<std::unique_ptr<Event>> event = model_->backend()->RecordEvent();
    if (!event.ok()) {
      staging_error_ = event.status();
      return;
    }
    task.ready = *std::move(event);
  }
  Dispatch(std::move(task));
}

absl::Status RemoteUpdater::PushRunningStats() {
  if (running_stat_chunks_.empty() || !PushesRunningStats()) return absl::OkStatus();
  PushTask task;
  task.kind = v1::ChunkHeader::KIND_PARAMETERS;
  task.clock = clock_ + 1;
  task.chunks = running_stat_chunks_;
  task.views = &params_;
  if (!direct()) {
    Backend* backend = model_->backend();
    for (int i = 0; i < model_->num_params(); ++i) {
      if (model_->param_info(i).trainable) continue;
      HostView& view = params_[i];
      PSTRAIN_RETURN_IF_ERROR(
          backend->CopyDeviceToHost(view.host, view.tensor->data(), view.tensor->bytes()));
    }
    PSTRAIN_ASSIGN_OR_RETURN(task.ready, backend->RecordEvent());
  }
  Dispatch(std::move(task));
  return absl::OkStatus();
}

void RemoteUpdater::Dispatch(PushTask task) {
  if (direct()) {
    // The CPU backend has finished every op: push from the trainer's thread
    // (PsClient::Push only enqueues).
    auto ops = PushChunks(task.kind, 0, task.clock, task.chunks, *task.views);
    absl::MutexLock lock(&mu_);
    for (auto& op : ops) pushes_.push_back(std::move(op));
    return;
  }
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

void RemoteUpdater::DispatcherLoop() {
  for (;;) {
    PushTask task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](RemoteUpdater* u) ABSL_EXCLUSIVE_LOCKS_REQUIRED(u->mu_) {
            return u->stop_dispatcher_ || !u->tasks_.empty();
          },
          this));
      if (tasks_.empty()) return;  // Stopping.
      task = std::move(tasks_.front());
      tasks_.pop_front();
      ++tasks_in_flight_;
    }
    absl::Status ready = task.ready ? task.ready->Wait() : absl::OkStatus();
    std::vector<std::unique_ptr<PendingOp>> ops;
    if (ready.ok()) ops = PushChunks(task.kind, 0, task.clock, task.chunks, *task.views);
    absl::MutexLock lock(&mu_);
    dispatch_error_.Update(ready);
    for (auto& op : ops) pushes_.push_back(std::move(op));
    --tasks_in_flight_;
  }
}

absl::Status RemoteUpdater::WaitPushes() {
  std::vector<std::unique_ptr<PendingOp>> pushes;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](RemoteUpdater* u) ABSL_EXCLUSIVE_LOCKS_REQUIRED(u->mu_) {
          return u->tasks_.empty() && u->tasks_in_flight_ == 0;
        },
        this));
    pushes.swap(pushes_);
    status = std::exchange(dispatch_error_, absl::OkStatus());
  }
  for (auto& op : pushes) status.Update(op->Wait());
  if (Retryable(status)) {
    // This step's contribution is dropped; BeforeStep pulls every chunk anew.
    need_resync_ = true;
    return absl::OkStatus();
  }
  return status;
}

// --- Average mode ---------------------------------------------------------------

absl::Status RemoteUpdater::AverageRound() {
  local_steps_ = 0;
  Backend* backend = model_->backend();
  std::vector<int> state_chunks;
  for (int p : state_params_) {
    for (int c : plan_.by_param[p]) state_chunks.push_back(c);
  }
  // PushParameters (and optimizer state) for this round.
  if (!direct()) {
    for (HostView& view : params_) {
      PSTRAIN_RETURN_IF_ERROR(
          backend->CopyDeviceToHost(view.host, view.tensor->data(), view.tensor->bytes()));
    }
    for (auto& slot : state_) {
      for (int p : state_params_) {
        PSTRAIN_RETURN_IF_ERROR(backend->CopyDeviceToHost(slot[p].host, slot[p].tensor->data(),
                                                          slot[p].tensor->bytes()));
      }
    }
    PSTRAIN_RETURN_IF_ERROR(backend->Synchronize());
  }
  std::vector<std::unique_ptr<PendingOp>> pushes =
      PushChunks(v1::ChunkHeader::KIND_PARAMETERS, 0, clock_, all_chunks_, params_);
  for (int slot = 0; slot < static_cast<int>(state_.size()); ++slot) {
    for (auto& op : PushChunks(v1::ChunkHeader::KIND_OPTIMIZER_STATE, slot, clock_, state_chunks,
                               state_[slot])) {
      pushes.push_back(std::move(op));
    }
  }
  absl::Status status;
  for (auto& op : pushes) status.Update(op->Wait());
  if (Retryable(status)) return Resync();
  PSTRAIN_RETURN_IF_ERROR(status);

  // PullAverage: round r+1 is the mean over every member's round r.
  std::vector<PullOp> pulls =
      PullChunks(v1::ChunkHeader::KIND_PARAMETERS, 0, all_chunks_, params_, 1, false);
  for (int slot = 0; slot < static_cast<int>(state_.size()); ++slot) {
    std::vector<PullOp> state_pulls = PullChunks(v1::ChunkHeader::KIND_OPTIMIZER_STATE, slot,
                                                 state_chunks, state_[slot], 1, false);
    for (auto& pull : state_pulls) {
      pull.chunks.clear();  // Versions come from the parameter pulls.
      pulls.push_back(std::move(pull));
    }
  }
  status = WaitPullOps(pulls, /*record_versions=*/true);
  if (Retryable(status)) return Resync();
  PSTRAIN_RETURN_IF_ERROR(status);
  pulled_not_copied_ = true;
  PSTRAIN_RETURN_IF_ERROR(CopyPulledIntoModel());
  PSTRAIN_RETURN_IF_ERROR(CopyStateIntoModel());
  return backend->Synchronize();
}

}  // namespace pstrain
