#include "common/chunking.h"

#include <algorithm>

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

// Regression (issue 8): a dense layer of 2^31-1 units grew the plan past
// 3 GiB at submit. The chunks are counted before anything is allocated.
TEST(ChunkingTest, ADenseLayerOf2To31UnitsIsRefusedBeforeThePlanGrows) {
  v1::ModelSpec model;
  model.add_input_shape(400);
  model.set_num_classes(2);
  model.add_layers()->set_name("fc1");
  model.mutable_layers(0)->mutable_dense()->set_units(2147483647);
  model.add_layers()->set_name("fc2");
  model.mutable_layers(1)->mutable_dense()->set_units(2);
  model.add_layers()->set_name("loss");
  model.mutable_layers(2)->mutable_softmax_cross_entropy();
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(model);
  ASSERT_TRUE(graph.ok()) << graph.status();
  absl::StatusOr<ChunkPlan> plan = PlanChunks(*graph, 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("more than 1048576 chunks"), std::string::npos)
      << plan.status();
}

}  // namespace
}  // namespace pstrain
