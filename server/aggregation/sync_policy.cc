#include "server/aggregation/sync_policy.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

uint64_t DrawValuesEpoch() {
  absl::BitGen bits;
  uint64_t epoch = 0;
  while (epoch == 0) epoch = absl::Uniform<uint64_t>(bits);
  return epoch;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SyncPolicy>> SyncPolicy::Create(const AggregationConfig& config) {
  PSTRAIN_ASSIGN_OR_RETURN(
      std::unique_ptr<ServerOptimizer> optimizer,
      ServerOptimizer::Create(config.optimizer,
                              absl::StrCat("ConfigureJob(", config.job_id, "): ")));
  return std::unique_ptr<SyncPolicy>(new SyncPolicy(config, std::move(optimizer)));
}

SyncPolicy::SyncPolicy(const AggregationConfig& config, std::unique_ptr<ServerOptimizer> optimizer)
    : BarrierPolicy(config),
      pull_compression_(config.pull_compression),
      chunks_sent_whole_(config.chunks_sent_whole),
      values_epoch_(DrawValuesEpoch()),
      optimizer_(std::move(optimizer)),
      pacer_({.lead_frames = config.pace_lead_frames,
              .tuner = config.pace_tuner,
              .job_id = config.job_id,
              .log = config.log,
              .clock = config.clock}) {}

absl::Status SyncPolicy::AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial) {
  const bool sent_whole =
      chunk.id < static_cast<int>(chunks_sent_whole_.size()) && chunks_sent_whole_[chunk.id];
  chunk.compress_pulls = chunk.trainable &&
                         pull_compression_.method() != v1::CompressionSpec::COMPRESSION_NONE &&
                         !sent_whole;
  if (chunk.compress_pulls) {
    chunk.published = std::make_shared<std::vector<float>>(*chunk.values);
  }
  if (!chunk.trainable) return absl::OkStatus();
  return optimizer_->AddChunk(chunk, initial);
}

v1::ChunkHeader::Kind SyncPolicy::PushKind(const ShardChunk& chunk) const {
  return chunk.trainable ? v1::ChunkHeader::KIND_GRADIENT : v1::ChunkHeader::KIND_PARAMETERS;
}

void SyncPolicy::Pushed(const PushArgs& args, const ShardMembership& membership, bool duplicate) {
  if (pacer_.paced() && !duplicate) pacer_.Count(args.worker_id, args.version, membership);
}

PulledChunk SyncPolicy::Pulled(const ShardChunk& chunk, const PullArgs& args) const {
  if (!chunk.compress_pulls || args.master) return BarrierPolicy::Pulled(chunk, args);
  PulledChunk out;
  out.version = chunk.version;
  out.values = chunk.published;
  out.values_epoch = values_epoch_;
  if (chunk.delta != nullptr && args.held_epoch == values_epoch_ && args.held_version >= 0 &&
      args.held_version + 1 == chunk.version) {
    out.delta = chunk.delta;
  }
  return out;
}

void SyncPolicy::StepCompleted(ShardChunk& chunk) {
  if (chunk.compress_pulls) PublishDelta(chunk);
}

void SyncPolicy::PublishDelta(ShardChunk& chunk) {
  chunk.delta.reset();
  const std::vector<float>& master = *chunk.values;
  std::vector<float>& published = *Writable(&chunk.published);
  const size_t n = master.size();
  thread_local std::vector<float> difference, decoded;
  difference.resize(n);
  for (size_t i = 0; i < n; ++i) difference[i] = master[i] - published[i];
  auto delta = std::make_shared<EncodedGradient>();
  absl::Status status =
      EncodeWithoutFeedback(pull_compression_, absl::MakeSpan(difference), delta.get());
  if (status.ok()) {
    v1::ChunkHeader header;
    header.set_chunk_id(chunk.id);
    header.set_num_elements(static_cast<int64_t>(n));
    header.set_dtype(delta->dtype);
    header.set_encoding(delta->encoding);
    header.set_encoded_count(delta->encoded_count);
    status = AddEncodedDelta(header, delta->bytes.data(), delta->bytes.size(),
                             absl::MakeSpan(published), &decoded);
  }
  if (!status.ok()) {
    // A difference beyond float's range: this step the workers take the
    // values whole (no delta), and they are the master's.
    std::copy(master.begin(), master.end(), published.begin());
    return;
  }
  chunk.delta = std::move(delta);
}

}  // namespace pstrain
