#include "common/chunking.h"

#include <algorithm>
#include <initializer_list>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

ModelGraph Fmnist() {
  auto model = LoadModelSpec(std::string(PSTRAIN_SOURCE_DIR) + "/examples/models/fmnist-cnn.json");
  EXPECT_TRUE(model.ok());
  auto graph = BuildModelGraph(*model);
  EXPECT_TRUE(graph.ok());
  return *graph;
}

TEST(ChunkingTest, ChunksCoverEveryParameterExactlyOnce) {
  ModelGraph graph = Fmnist();
  for (int shards : {1, 2, 3, 5}) {
    auto plan = PlanChunks(graph, shards);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (size_t p = 0; p < graph.params.size(); ++p) {
      int64_t next = 0;
      for (int id : plan->by_param[p]) {
        const ChunkInfo& c = plan->chunks[id];
        EXPECT_EQ(c.param, static_cast<int>(p));
        EXPECT_EQ(c.offset, next);
        EXPECT_GT(c.count, 0);
        EXPECT_LE(c.count * 4, kDefaultChunkBytes);
        next += c.count;
      }
      EXPECT_EQ(next, graph.params[p].shape.num_elements());
    }
    int64_t total = 0;
    for (int s = 0; s < shards; ++s) {
      for (int id : plan->by_shard[s]) EXPECT_EQ(plan->chunks[id].shard, s);
      total += plan->shard_bytes[s];
    }
    EXPECT_EQ(total, graph.trainable_params * 4);
  }
}

TEST(ChunkingTest, ShardsAreBalancedByBytesNotTensorCount) {
  ModelGraph graph = Fmnist();  // fc1/weight is 98% of the bytes.
  auto plan = PlanChunks(graph, 2);
  ASSERT_TRUE(plan.ok());
  int64_t lo = *std::min_element(plan->shard_bytes.begin(), plan->shard_bytes.end());
  int64_t hi = *std::max_element(plan->shard_bytes.begin(), plan->shard_bytes.end());
  EXPECT_LE(hi - lo, kDefaultChunkBytes);
  EXPECT_GT(plan->by_param[4].size(), 1u);  // fc1/weight spans several chunks...
  std::vector<int> owners;
  for (int id : plan->by_param[4]) owners.push_back(plan->chunks[id].shard);
  EXPECT_NE(std::count(owners.begin(), owners.end(), 0), static_cast<long>(owners.size()));
}

TEST(ChunkingTest, DeterministicAndValidated) {
  ModelGraph graph = Fmnist();
  auto a = PlanChunks(graph, 3, 4096);
  auto b = PlanChunks(graph, 3, 4096);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->chunks.size(), b->chunks.size());
  for (size_t i = 0; i < a->chunks.size(); ++i) EXPECT_EQ(a->chunks[i].shard, b->chunks[i].shard);
  EXPECT_FALSE(PlanChunks(graph, 0).ok());
  EXPECT_FALSE(PlanChunks(graph, 1, kMaxChunkBytes + 1).ok());
}

// A stack of dense layers (fc1, fc2, ...; the last has num_classes units)
// over `input` (flattened first when it has more than one dimension), then
// softmax cross-entropy.
absl::StatusOr<ModelGraph> DenseGraph(std::initializer_list<int> input,
                                      std::initializer_list<int> hidden, int num_classes) {
  v1::ModelSpec model;
  for (int d : input) model.add_input_shape(d);
  model.set_num_classes(num_classes);
  if (input.size() > 1) model.add_layers()->mutable_flatten();
  std::vector<int> units(hidden);
  units.push_back(num_classes);
  for (int u : units) model.add_layers()->mutable_dense()->set_units(u);
  model.add_layers()->mutable_softmax_cross_entropy();
  for (int i = 0; i < model.layers_size(); ++i) {
    model.mutable_layers(i)->set_name(absl::StrCat("layer", i));
  }
  return BuildModelGraph(model);
}

// The dense 2048 -> 1024 -> 10 model of bench/jobs/dense-8mb-synthetic.json.
ModelGraph Dense8Mb() {
  absl::StatusOr<ModelGraph> graph = DenseGraph({1, 32, 64}, {1024}, 10);
  EXPECT_TRUE(graph.ok()) << graph.status();
  return *graph;
}

TEST(ChunkingTest, AutoChunkBytesHalvesUntilEveryShardHoldsEightChunks) {
  EXPECT_EQ(AutoChunkBytes(int64_t{100} << 20, 1), kDefaultChunkBytes);  // Large: 1 MiB.
  EXPECT_EQ(AutoChunkBytes(int64_t{8} << 20, 1), kDefaultChunkBytes);    // Exactly 8 chunks.
  EXPECT_EQ(AutoChunkBytes(int64_t{8} << 20, 2), int64_t{512} << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{8} << 20, 8), int64_t{128} << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{8} << 20, 64), kMinAutoChunkBytes);  // Floor: 16 KiB wanted.
  EXPECT_EQ(AutoChunkBytes(0, 1), kMinAutoChunkBytes);
  EXPECT_EQ(AutoChunkBytes(INT64_MAX, INT32_MAX), kDefaultChunkBytes);  // No overflow.
}

// Plans made with the default chunk size (kAutoChunkBytes, as servers and
// workers make them) give every shard of an 8.4 MB model at least 8 chunks,
// where 1 MiB chunks gave each of 8 shards one or two.
TEST(ChunkingTest, DefaultPlansGiveEveryShardEightChunksOfAnEightMegabyteModel) {
  ModelGraph graph = Dense8Mb();
  for (int shards : {1, 2, 4, 8}) {
    SCOPED_TRACE(shards);
    absl::StatusOr<ChunkPlan> plan = PlanChunks(graph, shards);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->chunk_bytes, kDefaultChunkBytes / shards);
    for (const std::vector<int>& owned : plan->by_shard) EXPECT_GE(owned.size(), 8u);
    for (const ChunkInfo& c : plan->chunks) EXPECT_LE(c.count * 4, plan->chunk_bytes);
  }
  absl::StatusOr<ChunkPlan> fixed = PlanChunks(graph, 8, kDefaultChunkBytes);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->chunk_bytes, kDefaultChunkBytes);  // An explicit size is kept.
  EXPECT_LE(fixed->by_shard[7].size(), 2u);
}

// Auto plans cut the ends of a large parameter small and deal its eighths
// one per shard, so that every shard's first and last chunk of it is an
// eighth of the chunk size; the shards stay balanced and an explicit chunk
// size is cut as asked.
TEST(ChunkingTest, AutoPlansTaperALargeParametersEndsOneSmallChunkPerShard) {
  ModelGraph graph = Dense8Mb();
  const int weight = 0;  // fc1's [1024, 2048] weights: 8 MiB.
  ASSERT_EQ(graph.params[weight].shape.num_elements(), int64_t{2048} * 1024);
  for (int shards : {1, 2, 3, 8}) {
    SCOPED_TRACE(shards);
    absl::StatusOr<ChunkPlan> plan = PlanChunks(graph, shards);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const int64_t full = plan->chunk_bytes / 4;
    const std::vector<int>& chunks = plan->by_param[weight];
    const size_t ends = static_cast<size_t>(kTaperLevels) * shards;
    ASSERT_GT(chunks.size(), 2 * ends);
    // Offsets run on without a gap; the ends are 1/8, 1/4, 1/2 of a chunk.
    int64_t next = 0;
    for (size_t k = 0; k < chunks.size(); ++k) {
      const ChunkInfo& c = plan->chunks[chunks[k]];
      EXPECT_EQ(c.offset, next);
      next += c.count;
      if (k < ends) {
        EXPECT_EQ(c.count, full / kTaperDivisors[k / shards]) << k;
        if (k < static_cast<size_t>(shards)) {
          EXPECT_EQ(c.shard, static_cast<int>(k)) << k;
        }
      } else if (k >= chunks.size() - ends) {
        const size_t from_end = chunks.size() - 1 - k;
        EXPECT_EQ(c.count, full / kTaperDivisors[from_end / shards]) << k;
      } else if (k + 1 < chunks.size() - ends) {
        EXPECT_EQ(c.count, full) << k;
      }
    }
    EXPECT_EQ(next, graph.params[weight].shape.num_elements());
    // Every shard's first and last chunk of the weights is the smallest.
    for (int s = 0; s < shards; ++s) {
      std::vector<int64_t> counts;
      for (int id : chunks) {
        if (plan->chunks[id].shard == s) counts.push_back(plan->chunks[id].count);
      }
      ASSERT_FALSE(counts.empty()) << s;
      EXPECT_EQ(counts.front(), full / kTaperDivisors[0]) << s;
      EXPECT_EQ(counts.back(), full / kTaperDivisors[0]) << s;
    }
    // Balanced by bytes, and the small bias is one chunk, untapered.
    const int64_t lo = *std::min_element(plan->shard_bytes.begin(), plan->shard_bytes.end());
    const int64_t hi = *std::max_element(plan->shard_bytes.begin(), plan->shard_bytes.end());
    EXPECT_LE(hi - lo, plan->chunk_bytes);
    EXPECT_EQ(plan->by_param[1].size(), 1u);
    // The same size asked for explicitly: full chunks from the first.
    absl::StatusOr<ChunkPlan> exact = PlanChunks(graph, shards, plan->chunk_bytes);
    ASSERT_TRUE(exact.ok());
    EXPECT_EQ(exact->chunks[exact->by_param[weight].front()].count, full);
    EXPECT_EQ(exact->by_param[weight].size(),
              static_cast<size_t>(graph.params[weight].shape.num_elements() / full));
  }
}

// Regression (issue 8): a dense layer of 2^31-1 units grew the plan past
// 3 GiB at submit. The chunks are counted before anything is allocated.
TEST(ChunkingTest, ADenseLayerOf2To31UnitsIsRefusedBeforeThePlanGrows) {
  absl::StatusOr<ModelGraph> graph = DenseGraph({400}, {2147483647}, 2);
  ASSERT_TRUE(graph.ok()) << graph.status();
  absl::StatusOr<ChunkPlan> plan = PlanChunks(*graph, 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("more than 1048576 chunks"), std::string::npos)
      << plan.status();
}

}  // namespace
}  // namespace pstrain
