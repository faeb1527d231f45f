#include "common/chunking.h"

#include <algorithm>
#include <cstdint>
#include <optional>

#include "absl/strings/str_cat.h"

namespace pstrain {

int64_t AutoChunkBytes(int64_t model_bytes, int num_shards) {
  const int64_t shards = std::max(num_shards, 1);
  int64_t chunk = kDefaultChunkBytes;
  // chunk * kMinChunksPerShard * shards <= 2^20 * 2^4 * 2^31: no overflow.
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
  // Tapered ends (auto plans): at most num_shards * (1/8 + 1/4 + 1/2) chunks'
  // elements at each end of the push, and at least kMinTaperedChunksPerShard
  // full chunks per shard between them.
  const int64_t end_elements =
      num_shards * (per_chunk / kTaperDivisors[0] + per_chunk / kTaperDivisors[1] +
                    per_chunk / kTaperDivisors[2]);
  const bool tapered = auto_size && model_elements - 2 * end_elements >=
                                        kMinTaperedChunksPerShard * num_shards * per_chunk;
  // At most ceil(n / per_chunk) chunks per parameter between the tapered
  // ends, and 2 * kTaperLevels * num_shards chunks in them.
  int64_t num_chunks = tapered ? 2 * kTaperLevels * int64_t{num_shards} : 0;
  for (int64_t n : sizes) {
    const int64_t chunks = n / per_chunk + (n % per_chunk != 0 ? 1 : 0);
    if (chunks > kMaxChunks || (num_chunks += chunks) > kMaxChunks) {
      return absl::InvalidArgumentError(absl::StrCat("the model needs more than ", kMaxChunks,
                                                     " chunks of ", chunk_bytes, " bytes"));
    }
  }

  // The cuts of each parameter, by offset: count elements from offset, on a
  // dealt shard (an eighth of a tapered end) or on -1 (placed by load).
  struct Cut {
    int64_t offset = 0;
    int64_t count = 0;
    int shard = -1;
  };
  std::vector<std::vector<Cut>> cuts(graph.params.size());
  std::vector<int> pushed;  // Parameters in push order, the empty ones left out.
  for (int p : ParamsInPushOrder(graph)) {
    if (sizes[p] > 0) pushed.push_back(p);
  }
  // The middle of parameter pushed[i] is [lo[i], hi[i]): what the tapered
  // ends leave of it.
  std::vector<int64_t> lo(pushed.size(), 0), hi(pushed.size());
  for (size_t i = 0; i < pushed.size(); ++i) hi[i] = sizes[pushed[i]];
  if (tapered) {
    // The head, from the first parameter pushed on, then the tail, from the
    // last one back; `tapered` leaves full chunks between them.
    size_t i = 0;
    for (int k = 0; k < kTaperLevels * num_shards; ++k) {
      while (lo[i] == hi[i]) ++i;
      const int64_t want = per_chunk / kTaperDivisors[k / num_shards];
      const int64_t count = std::min(want, hi[i] - lo[i]);
      cuts[pushed[i]].push_back({lo[i], count, k < num_shards ? k : -1});
      lo[i] += count;
    }
    size_t j = pushed.size() - 1;
    for (int k = 0; k < kTaperLevels * num_shards; ++k) {
      while (lo[j] == hi[j]) --j;
      const int64_t want = per_chunk / kTaperDivisors[k / num_shards];
      const int64_t count = std::min(want, hi[j] - lo[j]);
      hi[j] -= count;
      cuts[pushed[j]].push_back({hi[j], count, k < num_shards ? k : -1});
    }
  }
  for (size_t i = 0; i < pushed.size(); ++i) {
    for (int64_t offset = lo[i]; offset < hi[i]; offset += per_chunk) {
      cuts[pushed[i]].push_back({offset, std::min(per_chunk, hi[i] - offset), -1});
    }
  }

  ChunkPlan plan;
  plan.chunks.reserve(static_cast<size_t>(num_chunks));
  plan.num_shards = num_shards;
  plan.chunk_bytes = chunk_bytes;
  plan.by_param.resize(graph.params.size());
  plan.shard_bytes.assign(num_shards, 0);
  std::vector<bool> placed;  // By chunk: an eighth of a tapered end, dealt one per shard.
  for (size_t p = 0; p < graph.params.size(); ++p) {
    std::sort(cuts[p].begin(), cuts[p].end(),
              [](const Cut& a, const Cut& b) { return a.offset < b.offset; });
    for (const Cut& cut : cuts[p]) {
      ChunkInfo c;
      c.id = static_cast<int>(plan.chunks.size());
      c.param = static_cast<int>(p);
      c.offset = cut.offset;
      c.count = cut.count;
      c.shard = std::max(cut.shard, 0);
      plan.by_param[p].push_back(c.id);
      plan.chunks.push_back(c);
      placed.push_back(cut.shard >= 0);
      if (cut.shard >= 0) plan.shard_bytes[cut.shard] += cut.count * 4;
    }
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

std::vector<int> ParamsInPushOrder(const ModelGraph& graph) {
  std::vector<int> order;
  order.reserve(graph.params.size());
  std::vector<bool> listed(graph.params.size(), false);
  for (auto layer = graph.layers.rbegin(); layer != graph.layers.rend(); ++layer) {
    for (int p : layer->params) {
      if (p < 0 || p >= static_cast<int>(graph.params.size())) continue;
      if (!graph.params[p].trainable || listed[p]) continue;
      listed[p] = true;
      order.push_back(p);
    }
  }
  if (graph.layers.empty()) {  // An external model: autograd's order, last tensor first.
    for (size_t p = graph.params.size(); p-- > 0;) {
      if (!graph.params[p].trainable) continue;
      listed[p] = true;
      order.push_back(static_cast<int>(p));
    }
  }
  for (size_t p = 0; p < graph.params.size(); ++p) {
    if (!listed[p]) order.push_back(static_cast<int>(p));
  }
  return order;
}

}  // namespace pstrain
