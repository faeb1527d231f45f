// Chunks and calls for the aggregation policies' tests: a chunk as the store
// (ParameterShard) would have filled it, with no model behind it.
#ifndef PSTRAIN_TESTS_SERVER_AGGREGATION_CHUNK_FIXTURE_H_
#define PSTRAIN_TESTS_SERVER_AGGREGATION_CHUNK_FIXTURE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "server/aggregation/aggregation_policy.h"
#include "server/shard_calls.h"
#include "server/shard_chunk.h"

namespace pstrain::testing {

inline std::shared_ptr<const ShardMembership> Members(const std::vector<std::string>& ids,
                                                      int64_t generation = 1) {
  auto membership = std::make_shared<ShardMembership>();
  membership->members.insert(ids.begin(), ids.end());
  membership->generation = generation;
  for (const std::string& id : ids) membership->joined[id] = generation;
  return membership;
}

// Chunk `id` holding `values` at version 0, readied by `policy`.
inline std::unique_ptr<ShardChunk> AddChunk(AggregationPolicy& policy, int id,
                                            const std::vector<float>& values, bool trainable,
                                            std::shared_ptr<const ShardMembership> membership,
                                            const v1::ChunkValues& initial = {}) {
  auto chunk = std::make_unique<ShardChunk>();
  chunk->id = id;
  chunk->count = static_cast<int64_t>(values.size());
  chunk->trainable = trainable;
  chunk->param_name = trainable ? "w" : "running_mean";
  absl::MutexLock lock(&chunk->mu);
  chunk->membership = std::move(membership);
  chunk->values = std::make_shared<std::vector<float>>(values);
  absl::Status added = policy.AddChunk(*chunk, initial);
  if (!added.ok()) return nullptr;
  return chunk;
}

inline PushArgs PushOf(const std::string& worker, int64_t version,
                       v1::ChunkHeader::Kind kind = v1::ChunkHeader::KIND_GRADIENT) {
  // Designated initializers: GCC 12 warns (-Wrestrict) wrongly about
  // assigning a short literal to a std::string here.
  return PushArgs{
      .job_id = "j", .worker_id = worker, .generation = 1, .version = version, .kind = kind};
}

inline PullArgs PullOf(const std::string& worker, int worker_clock = 0) {
  return PullArgs{
      .job_id = "j", .worker_id = worker, .generation = 1, .worker_clock = worker_clock};
}

inline v1::OptimizerSpec Sgd(float learning_rate, float momentum = 0.f) {
  v1::OptimizerSpec spec;
  spec.set_type(v1::OPTIMIZER_SGD);
  spec.set_learning_rate(learning_rate);
  spec.set_momentum(momentum);
  return spec;
}

// A policy's configuration for job "j" in `mode`.
inline AggregationConfig ConfigOf(v1::ConsistencyMode mode,
                                  const v1::OptimizerSpec& optimizer = Sgd(0.5f)) {
  AggregationConfig config;
  config.job_id = "j";
  config.mode = mode;
  config.optimizer = optimizer;
  return config;
}

// policy.Push under the chunk's lock, as the store calls it.
inline absl::Status PushLocked(AggregationPolicy& policy, ShardChunk& chunk, const PushArgs& args,
                               const std::vector<float>& values, PushOutcome* outcome) {
  absl::MutexLock lock(&chunk.mu);
  return policy.Push(chunk, args, values, outcome);
}

// The chunk's values and version, read under its lock.
inline std::vector<float> ValuesOf(ShardChunk& chunk) {
  absl::MutexLock lock(&chunk.mu);
  return *chunk.values;
}
inline int64_t VersionOf(ShardChunk& chunk) {
  absl::MutexLock lock(&chunk.mu);
  return chunk.version;
}

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_SERVER_AGGREGATION_CHUNK_FIXTURE_H_
