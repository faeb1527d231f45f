#include "common/chunking.h"

#include <algorithm>
#include <cstdint>
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
  const bool auto_size = chunk_bytes == kAutoChunkBytes;
  if (auto_size) chunk_bytes = AutoChunkBytes(model_elements * 4, num_shards);
  const int64_t per_chunk = chunk_bytes / 4;
  // Tapered ends (auto plans): num_shards chunks of per_chunk/8, then /4,
  // then /2 elements at each end of a parameter large enough.
  const int64_t end_elements =
      num_shards * (per_chunk / kTaperDivisors[0] + per_chunk / kTaperDivisors[1] +
                    per_chunk / kTaperDivisors[2]);
  auto tapered = [&](int64_t n) {
    return auto_size && n - 2 * end_elements >= kMinTaperedChunksPerShard * num_shards * per_chunk;
  };
  int64_t num_chunks = 0;
  for (int64_t n : sizes) {
    const int64_t middle = tapered(n) ? n - 2 * end_elements : n;
    const int64_t chunks = middle / per_chunk + (middle % per_chunk != 0 ? 1 : 0) +
                           (tapered(n) ? 2 * kTaperLevels * int64_t{num_shards} : 0);
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
  plan.shard_bytes.assign(num_shards, 0);
  std::vector<bool> placed;  // By chunk: an eighth of a tapered end, dealt one per shard.
  auto add = [&](int p, int64_t offset, int64_t count, int shard) {
    ChunkInfo c;
    c.id = static_cast<int>(plan.chunks.size());
    c.param = p;
    c.offset = offset;
    c.count = count;
    c.shard = std::max(shard, 0);
    plan.by_param[p].push_back(c.id);
    plan.chunks.push_back(c);
    placed.push_back(shard >= 0);
    if (shard >= 0) plan.shard_bytes[shard] += count * 4;
  };
  for (size_t p = 0; p < graph.params.size(); ++p) {
    const int param = static_cast<int>(p);
    const int64_t n = sizes[p];
    int64_t offset = 0;
    auto taper = [&](bool head) {
      for (int level = 0; level < kTaperLevels; ++level) {
        const int64_t divisor = kTaperDivisors[head ? level : kTaperLevels - 1 - level];
        const int64_t count = per_chunk / divisor;
        // The eighths one per shard; the rest by load, filling its gaps.
        const bool dealt = divisor == kTaperDivisors[0];
        for (int s = 0; s < num_shards; ++s, offset += count) {
          add(param, offset, count, dealt ? s : -1);
        }
      }
    };
    const bool taper_ends = tapered(n);
    if (taper_ends) taper(/*head=*/true);
    const int64_t middle_end = taper_ends ? n - end_elements : n;
    while (offset < middle_end) {
      const int64_t count = std::min(per_chunk, middle_end - offset);
      add(param, offset, count, /*shard=*/-1);
      offset += count;
    }
    if (taper_ends) taper(/*head=*/false);
  }
  // The dealt eighths add the same bytes to every shard; the rest goes
  // largest chunk first onto the least-loaded shard (ties: lower index).
  std::vector<int> order;
  for (const ChunkInfo& c : plan.chunks) {
    if (!placed[c.id]) order.push_back(c.id);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return plan.chunks[a].count > plan.chunks[b].count; });
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
