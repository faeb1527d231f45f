#include "server/shard_chunk.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pstrain {

std::string KindName(v1::ChunkHeader::Kind kind) {
  return v1::ChunkHeader::Kind_IsValid(kind) ? v1::ChunkHeader::Kind_Name(kind)
                                             : absl::StrCat("kind ", static_cast<int>(kind));
}

void BarrierSum::Add(const std::string& worker_id, absl::Span<const float> values) {
  if (contributors.empty()) {
    sum.assign(values.begin(), values.end());  // Reuses the capacity.
  } else {
    float* out = sum.data();
    const float* in = values.data();
    const size_t n = values.size();
    for (size_t i = 0; i < n; ++i) out[i] += in[i];
  }
  contributors.insert(worker_id);
}

size_t TargetIndex(const PushArgs& args) {
  return args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE ? 1 + static_cast<size_t>(args.slot)
                                                            : 0;
}

std::string ShardChunk::Describe(const std::string& job_id) const {
  return absl::StrCat("chunk ", id, " (", param_name, ") of job ", job_id);
}

bool ShardChunk::AlreadyApplied(const PushArgs& args) const {
  auto it = applied.find(args.worker_id);
  if (it == applied.end() || it->second.incarnation != args.incarnation) return false;
  const size_t target = TargetIndex(args);
  return target < it->second.last_seq.size() && args.update_seq <= it->second.last_seq[target];
}

void ShardChunk::RecordApplied(const PushArgs& args) {
  AppliedUpdates& record = applied[args.worker_id];
  if (record.incarnation != args.incarnation) record = AppliedUpdates{args.incarnation, {}};
  const size_t target = TargetIndex(args);
  if (record.last_seq.size() <= target) record.last_seq.resize(target + 1, -1);
  record.last_seq[target] = std::max(record.last_seq[target], args.update_seq);
}

std::vector<float>* Writable(std::shared_ptr<std::vector<float>>* snapshot) {
  if (snapshot->use_count() == 1) {
    // Pairs with the release decrement of the last reader's reference, so its
    // reads happen before our writes.
    std::atomic_thread_fence(std::memory_order_acquire);
    return snapshot->get();
  }
  *snapshot = std::make_shared<std::vector<float>>(**snapshot);
  return snapshot->get();
}

void Publish(std::shared_ptr<std::vector<float>>* snapshot, std::vector<float>* fresh) {
  auto next = std::make_shared<std::vector<float>>(std::move(*fresh));
  fresh->clear();
  if (*snapshot != nullptr && snapshot->use_count() == 1) {
    std::atomic_thread_fence(std::memory_order_acquire);
    *fresh = std::move(**snapshot);
  }
  *snapshot = std::move(next);
}

}  // namespace pstrain
