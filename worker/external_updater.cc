#include "worker/external_updater.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/status_macros.h"

namespace pstrain {

ExternalUpdater::Options ExternalUpdater::OptionsFromJob(const v1::JobSpec& spec, int rank) {
  Options options;
  options.mode = ConsistencyModeOf(spec);
  options.rank = rank;
  options.averaging_frequency =
      spec.averaging_frequency() > 0 ? spec.averaging_frequency() : kDefaultAveragingFrequency;
  return options;
}

ExternalUpdater::ExternalUpdater(Options options, const ModelGraph& graph, PsClient* client)
    : options_(std::move(options)), graph_(graph), client_(client), plan_(client->plan()) {
  rank_.store(options_.rank);
}

ExternalUpdater::~ExternalUpdater() {
  for (auto& op : pushes_) op->Wait().IgnoreError();
  for (PullOp& pull : inflight_) {  // They write into params: done before the caller frees them.
    pull.op->Cancel();
    pull.op->Wait().IgnoreError();
  }
}

bool ExternalUpdater::Retryable(const absl::Status& status) {
  // As RemoteUpdater: a stale generation, a restarting shard, or a shard
  // that no longer holds the job (the coordinator then stops this run).
  return absl::IsAborted(status) || absl::IsUnavailable(status) || absl::IsNotFound(status);
}

int64_t ExternalUpdater::version() const {
  if (chunk_version_.empty()) return 0;
  return *std::min_element(chunk_version_.begin(), chunk_version_.end());
}

void ExternalUpdater::Cancel() {
  cancelled_.store(true);
  client_->CancelAll();
}

absl::Status ExternalUpdater::Start(std::vector<float*> params) {
  if (params.size() != graph_.params.size() || plan_.by_param.size() != graph_.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the model has ", graph_.params.size(),
                                                   " tensors; ", params.size(), " were given"));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("no memory for '", graph_.params[i].name, "'"));
    }
  }
  params_ = std::move(params);
  param_sources_.assign(params_.begin(), params_.end());
  grads_.assign(params_.size(), nullptr);
  zeros_.assign(params_.size(), {});
  for (size_t i = 0; i < params_.size(); ++i) {
    for (int c : plan_.by_param[i]) {
      all_chunks_.push_back(c);
      if (!graph_.params[i].trainable) buffer_chunks_.push_back(c);
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    forward_order_chunks_.insert(forward_order_chunks_.end(), plan_.by_param[i].begin(),
                                 plan_.by_param[i].end());
  }
  param_pulls_.assign(params_.size(), {});
  for (int p : ParamsInPushOrder(graph_)) {
    push_order_chunks_.insert(push_order_chunks_.end(), plan_.by_param[p].begin(),
                              plan_.by_param[p].end());
  }
  chunk_version_.assign(plan_.chunks.size(), 0);
  started_ = true;
  return Resync();
}

absl::Status ExternalUpdater::GradientReady(int param, const float* grad) {
  if (!started_) return absl::FailedPreconditionError("Start() first");
  if (options_.mode == v1::CONSISTENCY_AVERAGE) return absl::OkStatus();
  if (param < 0 || param >= static_cast<int>(params_.size()) || grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("no tensor ", param, " (or no gradient)"));
  }
  const ParamInfo& info = graph_.params[param];
  if (!info.trainable) {
    return absl::InvalidArgumentError(absl::StrCat("'", info.name, "' is a buffer: no gradient"));
  }
  if (grads_[param] != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", info.name, "''s gradient was given twice in one step"));
  }
  // Pushes are tagged with the chunks' versions: the pulls come in first.
  if (!inflight_.empty()) deferred_.Update(Settle());
  if (!deferred_.ok()) return absl::OkStatus();  // Step returns it.
  grads_[param] = grad;
  for (int c : plan_.by_param[param]) {
    pending_grads_.push_back(c);
    pending_bytes_ += plan_.chunks[c].count * static_cast<int64_t>(sizeof(float));
  }
  if (pending_bytes_ >= options_.min_push_bytes) FlushGradients();
  return absl::OkStatus();
}

void ExternalUpdater::PushChunks(v1::ChunkHeader::Kind kind, const std::vector<int>& chunks,
                                 const std::vector<const float*>& sources) {
  std::map<int64_t, std::vector<PsClient::ChunkRef>> groups;  // version -> chunks.
  for (int c : chunks) {
    const ChunkInfo& info = plan_.chunks[c];
    groups[chunk_version_[c]].push_back({c, sources[info.param] + info.offset});
  }
  for (auto& [version, refs] : groups) {
    pushes_.push_back(client_->Push(kind, version, clock_ + 1, std::move(refs)));
  }
}

void ExternalUpdater::FlushGradients() {
  if (pending_grads_.empty()) return;
  PushChunks(v1::ChunkHeader::KIND_GRADIENT, pending_grads_, grads_);
  pending_grads_.clear();
  pending_bytes_ = 0;
}

absl::Status ExternalUpdater::WaitPushes() {
  absl::Status status;
  for (auto& op : pushes_) status.Update(op->Wait());
  pushes_.clear();
  return status;
}

std::vector<ExternalUpdater::PullOp> ExternalUpdater::IssuePulls(const std::vector<int>& chunks,
                                                                 int64_t version_delta,
                                                                 int64_t bucket_bytes) {
  const bool versioned =
      options_.mode == v1::CONSISTENCY_SYNC || options_.mode == v1::CONSISTENCY_AVERAGE;
  std::map<int64_t, std::vector<int>> groups;  // min_version -> chunks, in the given order.
  for (int c : chunks) groups[versioned ? chunk_version_[c] + version_delta : 0].push_back(c);
  std::vector<PullOp> ops;
  for (auto& [min_version, group] : groups) {
    std::vector<int> bucket;
    std::vector<PsClient::ChunkDest> dests;
    int64_t bytes = 0;
    for (size_t i = 0; i < group.size(); ++i) {
      const ChunkInfo& info = plan_.chunks[group[i]];
      bucket.push_back(group[i]);
      dests.push_back({group[i], params_[info.param] + info.offset, nullptr});
      bytes += info.count * static_cast<int64_t>(sizeof(float));
      if (bytes >= bucket_bytes || i + 1 == group.size()) {
        PullOp& op = ops.emplace_back();
        op.op =
            client_->Pull(v1::ChunkHeader::KIND_PARAMETERS, min_version, clock_, std::move(dests));
        op.chunks = std::move(bucket);
        bucket = {};
        dests = {};
        bytes = 0;
      }
    }
  }
  return ops;
}

absl::Status ExternalUpdater::Collect(PullOp& pull) {
  if (!pull.waited) {
    pull.waited = true;
    pull.status = pull.op->Wait();
    if (pull.status.ok()) {
      for (int c : pull.chunks) chunk_version_[c] = pull.op->version();
    }
  }
  return pull.status;
}

absl::Status ExternalUpdater::WaitParams(const std::vector<int>& params) {
  for (int p : params) {
    if (p < 0 || p >= static_cast<int>(param_pulls_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("no tensor ", p));
    }
    for (int op : param_pulls_[p]) {
      if (!Collect(inflight_[op]).ok()) return Settle();
    }
  }
  return absl::OkStatus();
}

absl::Status ExternalUpdater::Settle() {
  if (inflight_.empty()) return absl::OkStatus();
  absl::Status first;
  for (PullOp& pull : inflight_) first.Update(Collect(pull));
  inflight_.clear();
  for (std::vector<int>& ops : param_pulls_) ops.clear();
  if (Retryable(first)) {
    ++resyncs_;  // As Step: what the step pushed stays pushed; every chunk again.
    return Resync();
  }
  return first;
}

absl::Status ExternalUpdater::PullParams(int64_t version_delta, bool one_per_chunk) {
  std::vector<PullOp> ops = IssuePulls(push_order_chunks_, version_delta,
                                       one_per_chunk ? 0 : std::numeric_limits<int64_t>::max());
  absl::Status first;
  for (PullOp& pull : ops) first.Update(Collect(pull));
  return first;
}

absl::Status ExternalUpdater::Resync() {
  const absl::Time deadline = absl::Now() + options_.resync_timeout;
  absl::Duration backoff = absl::Milliseconds(50);
  for (;;) {
    if (cancelled()) return absl::CancelledError("the job was stopped");
    // Every chunk on its own: learns each chunk's version (a membership
    // change may leave them a step apart).
    absl::Status status = PullParams(0, /*one_per_chunk=*/true);
    if (status.ok()) break;
    if (!Retryable(status) || absl::Now() + backoff > deadline) {
      return absl::Status(
          status.code(),
          absl::StrCat("cannot resynchronise with the parameter servers: ", status.message()));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(2));
  }
  local_steps_ = 0;
  return absl::OkStatus();
}

absl::Status ExternalUpdater::Step() {
  if (!started_) return absl::FailedPreconditionError("Start() first");
  if (cancelled()) return absl::CancelledError("the job was stopped");
  ++steps_;
  if (options_.mode == v1::CONSISTENCY_AVERAGE) {
    ++clock_;
    if (++local_steps_ >= options_.averaging_frequency) return AverageRound();
    return absl::OkStatus();
  }
  absl::Status settled = Settle();  // Overlapped pulls a step used no tensor of.
  if (!deferred_.ok()) {
    settled = deferred_;
    deferred_ = absl::OkStatus();
  }
  if (!settled.ok()) {
    std::fill(grads_.begin(), grads_.end(), nullptr);
    pending_grads_.clear();
    pending_bytes_ = 0;
    WaitPushes().IgnoreError();
    return settled;
  }
  // PushGradients: what backward has not sent (zeros for tensors this step
  // did not use), then the buffers.
  for (size_t p = 0; p < params_.size(); ++p) {
    if (!graph_.params[p].trainable || grads_[p] != nullptr) continue;
    zeros_[p].assign(graph_.params[p].shape.num_elements(), 0.f);
    GradientReady(static_cast<int>(p), zeros_[p].data()).IgnoreError();
  }
  FlushGradients();
  const bool buffers = options_.mode == v1::CONSISTENCY_SYNC || rank_.load() == 0;
  if (buffers && !buffer_chunks_.empty()) {
    PushChunks(v1::ChunkHeader::KIND_PARAMETERS, buffer_chunks_, param_sources_);
  }
  absl::Status status = WaitPushes();
  std::fill(grads_.begin(), grads_.end(), nullptr);
  ++clock_;
  // PullNext: sync waits for version v+1 of every chunk (the barrier);
  // async and ssp take what the shards hold.
  if (status.ok() && options_.overlap_pulls && options_.mode == v1::CONSISTENCY_SYNC) {
    inflight_ = IssuePulls(forward_order_chunks_, 1, options_.pull_bucket_bytes);
    for (size_t i = 0; i < inflight_.size(); ++i) {
      for (int c : inflight_[i].chunks) {
        std::vector<int>& ops = param_pulls_[plan_.chunks[c].param];
        if (ops.empty() || ops.back() != static_cast<int>(i)) ops.push_back(static_cast<int>(i));
      }
    }
    return absl::OkStatus();  // WaitParams and Settle wait for them.
  }
  if (status.ok()) status = PullParams(options_.mode == v1::CONSISTENCY_SYNC ? 1 : 0, false);
  if (Retryable(status)) {
    ++resyncs_;  // This step's contribution is dropped.
    return Resync();
  }
  return status;
}

absl::Status ExternalUpdater::AverageRound() {
  local_steps_ = 0;
  PushChunks(v1::ChunkHeader::KIND_PARAMETERS, all_chunks_, param_sources_);
  absl::Status status = WaitPushes();
  // Round r+1 is the mean over every member's round r.
  if (status.ok()) status = PullParams(1, false);
  if (Retryable(status)) {
    ++resyncs_;
    return Resync();
  }
  return status;
}

absl::Status ExternalUpdater::Finish() {
  if (!started_) return absl::FailedPreconditionError("Start() first");
  PSTRAIN_RETURN_IF_ERROR(Settle());
  if (options_.mode == v1::CONSISTENCY_AVERAGE) {
    return local_steps_ > 0 ? AverageRound() : absl::OkStatus();
  }
  PSTRAIN_RETURN_IF_ERROR(WaitPushes());
  if (options_.mode == v1::CONSISTENCY_SYNC) return absl::OkStatus();
  // Async and ssp: the run ends on the servers' model, which took the other
  // members' last pushes after this one's last pull.
  absl::Status status = PullParams(0, false);
  if (Retryable(status)) status = Resync();
  return status;
}

}  // namespace pstrain
