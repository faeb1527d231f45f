#include "common/chunking.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"

namespace pstrain {

int64_t AutoChunkBytes(int64_t model_bytes, int num_shards) {
  const int64_t shards = std::max(num_shards, 1);
  int64_t chunk = kDefaultChunkBytes;
  // chunk * kMinChunksPerShard * shards <= 2^20 * 2^3 * 2^31: no overflow.
  while (chunk > kMinAutoChunkBytes && model_bytes < chunk * kMinChunksPerShard * shards) {
    chunk /= 2;
  }
  return chunk;
}

absl::StatusOr<ChunkPlan> PlanChunks(const ModelGraph& graph, int num_shards, int64_t chunk_bytes) {
  if (num_shards < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_shards must be >= 1, got ", num_shards));
  }
  if (chunk_bytes != kAutoChunkBytes && (chunk_bytes < 4 || chunk_bytes > kMaxChunkBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes must be in [4, ", kMaxChunkBytes, "], got ", chunk_bytes));
  }
  // Sizes first (overflow-checked), so that a huge model is refused before
  // the plan grows.
  std::vector<int64_t> sizes;
  sizes.reserve(graph.params.size());
  int64_t model_elements = 0;
  for (const ParamInfo& p : graph.params) {
    std::optional<int64_t> n = p.shape.CheckedNumElements();
    if (!n || *n > INT64_MAX / 4 - model_elements) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", p.name, " ", p.shape.ToString(), " is too large"));
    }
    model_elements += *n;
    sizes.push_back(*n);
  }
  if (chunk_bytes == kAutoChunkBytes) chunk_bytes = AutoChunkBytes(model_elements * 4, num_shards);
  const int64_t per_chunk = chunk_bytes / 4;
  int64_t num_chunks = 0;
  for (int64_t n : sizes) {
    const int64_t chunks = n / per_chunk + (n % per_chunk != 0 ? 1 : 0);
    if (chunks > kMaxChunks || (num_chunks += chunks) > kMaxChunks) {
      return absl::InvalidArgumentError(absl::StrCat("the model needs more than ", kMaxChunks,
                                                     " chunks of ", chunk_bytes, " bytes"));
    }
  }
  ChunkPlan plan;
  plan.chunks.reserve(static_cast<size_t>(num_chunks));
  plan.num_shards = num_shards;
  plan.chunk_bytes = chunk_bytes;
  plan.by_param.resize(graph.params.size());
  for (size_t p = 0; p < graph.params.size(); ++p) {
    const int64_t n = sizes[p];
    for (int64_t offset = 0; offset < n; offset += per_chunk) {
      ChunkInfo c;
      c.id = static_cast<int>(plan.chunks.size());
      c.param = static_cast<int>(p);
      c.offset = offset;
      c.count = std::min(per_chunk, n - offset);
      plan.by_param[p].push_back(c.id);
      plan.chunks.push_back(c);
    }
  }
  // Largest chunk first onto the least-loaded shard (ties: lower index).
  std::vector<int> order(plan.chunks.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return plan.chunks[a].count > plan.chunks[b].count;
  });
  plan.shard_bytes.assign(num_shards, 0);
  for (int id : order) {
    int best = 0;
    for (int s = 1; s < num_shards; ++s) {
      if (plan.shard_bytes[s] < plan.shard_bytes[best]) best = s;
    }
    plan.chunks[id].shard = best;
    plan.shard_bytes[best] += plan.chunks[id].count * 4;
  }
  plan.by_shard.resize(num_shards);
  for (const ChunkInfo& c : plan.chunks) plan.by_shard[c.shard].push_back(c.id);
  return plan;
}

}  // namespace pstrain
