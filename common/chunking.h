// How a model's parameters are cut into chunks and spread over the parameter
// server shards. Server and workers compute the same plan from the same
// ModelGraph, so no plan travels on the wire.
//
//   PSTRAIN_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(graph, /*num_shards=*/2));
//   for (const ChunkInfo& c : plan.chunks) ...;   // c.param, c.offset, c.count, c.shard
#ifndef PSTRAIN_COMMON_CHUNKING_H_
#define PSTRAIN_COMMON_CHUNKING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_graph.h"

namespace pstrain {

// 1 MiB of fp32 values: the transport lessons' sweet spot, far below gRPC's
// limits. Chunks never exceed kMaxChunkBytes (4 MiB).
inline constexpr int64_t kDefaultChunkBytes = int64_t{1} << 20;
inline constexpr int64_t kMaxChunkBytes = int64_t{4} << 20;
// PlanChunks' chunk_bytes that asks for AutoChunkBytes(model, num_shards).
inline constexpr int64_t kAutoChunkBytes = 0;
// AutoChunkBytes' floor, and the chunks it wants every shard to hold.
inline constexpr int64_t kMinAutoChunkBytes = int64_t{64} << 10;
inline constexpr int64_t kMinChunksPerShard = 16;
// Tapered ends of auto plans (PlanChunks): a model that leaves at least
// kMinTaperedChunksPerShard full chunks per shard between its ends starts,
// in push order (ParamsInPushOrder), with num_shards chunks of at most 1/8
// of the chunk size, then num_shards of 1/4, then num_shards of 1/2, and
// ends with the same in reverse.
inline constexpr int kTaperLevels = 3;
inline constexpr int64_t kTaperDivisors[kTaperLevels] = {8, 4, 2};
inline constexpr int64_t kMinTaperedChunksPerShard = 2;
// Most chunks one plan may hold (1 TiB of parameters at the default chunk
// size); a plan's memory is ~40 bytes per chunk.
inline constexpr int64_t kMaxChunks = int64_t{1} << 20;

struct ChunkInfo {
  int id = 0;          // Index in ChunkPlan::chunks.
  int param = 0;       // Index into ModelGraph::params.
  int64_t offset = 0;  // First element of the parameter in this chunk.
  int64_t count = 0;   // Elements (fp32) in this chunk; > 0.
  int shard = 0;       // Owning shard, 0 .. num_shards-1.
};

struct ChunkPlan {
  int num_shards = 1;
  std::vector<ChunkInfo> chunks;           // In parameter order, then offset order.
  std::vector<std::vector<int>> by_param;  // Chunk ids of each parameter, in order.
  std::vector<std::vector<int>> by_shard;  // Chunk ids owned by each shard.
  std::vector<int64_t> shard_bytes;        // Bytes owned by each shard.
  int64_t chunk_bytes = 0;                 // The chunk size used (auto resolved).
};

// The chunk size of kAutoChunkBytes plans: kDefaultChunkBytes, halved while a
// shard would hold fewer than kMinChunksPerShard chunks of it (model_bytes /
// num_shards / chunk < kMinChunksPerShard), down to kMinAutoChunkBytes; a
// power of two. Why: a shard answers a sync pull of a chunk once every
// worker's push of it is in, so the pull starts a chunk late; without
// compression it carries as many bytes as the push over links as busy, so it
// stays a chunk behind to the end of the step. A shard's chunks arrive at
// 1/num_shards of a worker's link, so that chunk is 1/kMinChunksPerShard of
// the step's transfer whatever the shard count: 16 chunks per shard cost a
// step 1/16 more than its link time, 8 cost 1/8 (docs/BENCHMARKS.md, "Where
// the link time goes").
int64_t AutoChunkBytes(int64_t model_bytes, int num_shards);

// Cuts every parameter (running statistics included) into chunks of at most
// chunk_bytes (kAutoChunkBytes: AutoChunkBytes of the model's fp32 bytes;
// small parameters are not merged: a chunk never spans two parameters), then
// assigns chunks to shards greedily by bytes, largest first, so that shard
// loads differ by at most one chunk.
//
// Auto plans also taper both ends of the step's push (kTaperLevels above):
// walking the parameters in push order, the first num_shards chunks are cut
// at an eighth of the chunk size (or where their parameter ends), the next
// num_shards at a quarter, the next at a half, and the last chunks the same
// in reverse. The eighths are dealt one per shard, the other sizes go by
// load (so that they fill its gaps), so that every shard's first and last
// chunk of a step is at most an eighth of the chunk size, whichever layers
// they belong to. Why: a worker pushes to its shards side by side, each at
// 1/num_shards of its link, and a sync shard can send a chunk's pull only
// once every worker's push of it is in; a small first chunk lets the pulls
// start eight times sooner, and a small last chunk makes the last pull,
// which a shard sends to every worker before their next step, eight times
// shorter (docs/BENCHMARKS.md, "Tapered chunks"). Explicit chunk sizes are
// cut as asked.
//
// Deterministic: servers and workers plan the same from the same model and
// shard count. INVALID_ARGUMENT for num_shards < 1, chunk_bytes neither
// kAutoChunkBytes nor in [4, kMaxChunkBytes], or more than kMaxChunks chunks
// (counted, overflow-checked, before anything is allocated).
absl::StatusOr<ChunkPlan> PlanChunks(const ModelGraph& graph, int num_shards,
                                     int64_t chunk_bytes = kAutoChunkBytes);

// The order in which a step pushes a model's parameters: backward's, that
// is the layers last to first, each layer's trainable parameters in its
// order (an external model, which has no layers: its trainable tensors last
// to first, the order in which autograd finishes them); then the running
// statistics (and any parameter no layer lists) in parameter order. A sync
// pull asks for its chunks in this order too, since a shard answers them in
// request order, each once its push is complete.
std::vector<int> ParamsInPushOrder(const ModelGraph& graph);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CHUNKING_H_
