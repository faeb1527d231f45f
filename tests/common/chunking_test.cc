#include "common/chunking.h"

#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

ModelGraph Fmnist() {
  auto model = LoadModelSpec(std::string(PSTRAIN_SOURCE_DIR) + "/examples/models/fmnist-cnn.json");
  EXPECT_OK(model);
  auto graph = BuildModelGraph(*model);
  EXPECT_OK(graph);
  return *graph;
}

TEST(ChunkingTest, ChunksCoverEveryParameterExactlyOnce) {
  ModelGraph graph = Fmnist();
  for (int shards : {1, 2, 3, 5}) {
    auto plan = PlanChunks(graph, shards);
    ASSERT_OK(plan);
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
  ASSERT_OK(plan);
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
  ASSERT_OK(a);
  ASSERT_OK(b);
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
  EXPECT_OK(graph);
  return *graph;
}

TEST(ChunkingTest, AutoChunkBytesHalvesUntilEveryShardHoldsSixteenChunks) {
  EXPECT_EQ(AutoChunkBytes(int64_t{100} << 20, 1), kDefaultChunkBytes);  // Large: 1 MiB.
  EXPECT_EQ(AutoChunkBytes(int64_t{16} << 20, 1), kDefaultChunkBytes);   // Exactly 16 chunks.
  EXPECT_EQ(AutoChunkBytes(int64_t{8} << 20, 1), int64_t{512} << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{8} << 20, 2), int64_t{256} << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{8} << 20, 8), int64_t{64} << 10);
  EXPECT_EQ(AutoChunkBytes(int64_t{8} << 20, 64), kMinAutoChunkBytes);  // Floor: 8 KiB wanted.
  EXPECT_EQ(AutoChunkBytes(0, 1), kMinAutoChunkBytes);
  EXPECT_EQ(AutoChunkBytes(INT64_MAX, INT32_MAX), kDefaultChunkBytes);  // No overflow.
}

// Plans made with the default chunk size (kAutoChunkBytes, as servers and
// workers make them) give every shard of an 8.4 MB model at least 16 chunks,
// where 1 MiB chunks gave each of 8 shards one or two.
TEST(ChunkingTest, DefaultPlansGiveEveryShardSixteenChunksOfAnEightMegabyteModel) {
  ModelGraph graph = Dense8Mb();
  for (int shards : {1, 2, 4, 8}) {
    SCOPED_TRACE(shards);
    absl::StatusOr<ChunkPlan> plan = PlanChunks(graph, shards);
    ASSERT_OK(plan);
    EXPECT_EQ(plan->chunk_bytes, kDefaultChunkBytes / 2 / shards);
    for (const std::vector<int>& owned : plan->by_shard) EXPECT_GE(owned.size(), 16u);
    for (const ChunkInfo& c : plan->chunks) EXPECT_LE(c.count * 4, plan->chunk_bytes);
  }
  absl::StatusOr<ChunkPlan> fixed = PlanChunks(graph, 8, kDefaultChunkBytes);
  ASSERT_OK(fixed);
  EXPECT_EQ(fixed->chunk_bytes, kDefaultChunkBytes);  // An explicit size is kept.
  EXPECT_LE(fixed->by_shard[7].size(), 2u);
}

// The dense 1024 -> 1024 -> 512 -> 512 -> 512 -> 10 model of
// bench/jobs/mlp-8mb-synthetic.json: 8.4 MB over five layers, the largest
// (fc1, 4 MB) pushed last.
ModelGraph Mlp8Mb() {
  absl::StatusOr<ModelGraph> graph = DenseGraph({1, 32, 32}, {1024, 512, 512, 512}, 10);
  EXPECT_OK(graph);
  return *graph;
}

// fmnist-cnn's shape with a batch norm after the first dense layer: running
// statistics, pushed after every trainable parameter.
ModelGraph DenseWithBatchNorm() {
  v1::ModelSpec model;
  for (int d : {1, 32, 64}) model.add_input_shape(d);
  model.set_num_classes(10);
  model.add_layers()->mutable_flatten();
  model.add_layers()->mutable_dense()->set_units(1024);
  model.add_layers()->mutable_batch_norm();
  model.add_layers()->mutable_dense()->set_units(10);
  model.add_layers()->mutable_softmax_cross_entropy();
  for (int i = 0; i < model.layers_size(); ++i) {
    model.mutable_layers(i)->set_name(absl::StrCat("layer", i));
  }
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(model);
  EXPECT_OK(graph);
  return *graph;
}

TEST(ChunkingTest, ParamsArePushedLastLayerFirstThenTheRunningStatistics) {
  ModelGraph graph = DenseWithBatchNorm();
  std::vector<std::string> names;
  for (int p : ParamsInPushOrder(graph)) names.push_back(graph.params[p].name);
  EXPECT_EQ(names, (std::vector<std::string>{"layer3/weight", "layer3/bias", "layer2/gamma",
                                             "layer2/beta", "layer1/weight", "layer1/bias",
                                             "layer2/running_mean", "layer2/running_var"}));
}

// Auto plans cut both ends of a step's push small, whatever layers they
// fall in: walking the parameters in push order, the first S chunks are at
// most an eighth of the chunk size and dealt one per shard, the next S at
// most a quarter, the next S at most a half (each either that size or the
// rest of its parameter), and the last chunks the same in reverse; so every
// shard's first and last chunk of a step is at most an eighth. The shards
// stay balanced, and an explicit chunk size is cut as asked.
TEST(ChunkingTest, AutoPlansTaperBothEndsOfThePushOneSmallChunkPerShard) {
  const std::vector<std::pair<std::string, ModelGraph>> models = {
      {"dense-8mb", Dense8Mb()}, {"mlp-8mb", Mlp8Mb()}, {"dense+batch norm", DenseWithBatchNorm()}};
  for (const auto& model : models) {
    const std::string& name = model.first;
    const ModelGraph& graph = model.second;  // A plain reference: lambdas capture it.
    for (int shards : {1, 2, 3, 8}) {
      SCOPED_TRACE(absl::StrCat(name, ", ", shards, " shards"));
      absl::StatusOr<ChunkPlan> plan = PlanChunks(graph, shards);
      ASSERT_OK(plan);
      const int64_t full = plan->chunk_bytes / 4;
      // The chunks in push order; within a parameter, offsets run on
      // without a gap.
      std::vector<int> pushed;
      for (int p : ParamsInPushOrder(graph)) {
        int64_t next = 0;
        for (int id : plan->by_param[p]) {
          EXPECT_EQ(plan->chunks[id].offset, next);
          next += plan->chunks[id].count;
          pushed.push_back(id);
        }
        EXPECT_EQ(next, graph.params[p].shape.num_elements());
      }
      const size_t ends = static_cast<size_t>(kTaperLevels) * shards;
      ASSERT_GT(pushed.size(), 2 * ends);
      auto ends_its_param = [&](int id, bool head) {
        const ChunkInfo& c = plan->chunks[id];
        return head ? c.offset + c.count == graph.params[c.param].shape.num_elements()
                    : c.offset == 0;
      };
      std::vector<bool> dealt_head(shards, false), dealt_tail(shards, false);
      for (size_t k = 0; k < pushed.size(); ++k) {
        const ChunkInfo& c = plan->chunks[pushed[k]];
        const size_t from_end = pushed.size() - 1 - k;
        if (k < ends || from_end < ends) {
          const bool head = k < ends;
          const size_t level = (head ? k : from_end) / shards;
          const int64_t want = full / kTaperDivisors[level];
          EXPECT_LE(c.count, want) << k;
          if (c.count < want) {
            EXPECT_TRUE(ends_its_param(c.id, head)) << k;
          }
          if (level == 0) {
            std::vector<bool>& dealt = head ? dealt_head : dealt_tail;
            EXPECT_FALSE(dealt[c.shard]) << k;  // One eighth per shard.
            dealt[c.shard] = true;
          }
        } else {
          EXPECT_LE(c.count, full) << k;
          // Short only where its parameter or the untapered middle ends.
          if (c.count < full && from_end != ends) {
            EXPECT_EQ(c.offset + c.count, graph.params[c.param].shape.num_elements()) << k;
          }
        }
      }
      // Every shard's first and last chunk of the push is an eighth or less.
      for (int s = 0; s < shards; ++s) {
        std::vector<int64_t> counts;
        for (int id : pushed) {
          if (plan->chunks[id].shard == s) counts.push_back(plan->chunks[id].count);
        }
        ASSERT_FALSE(counts.empty()) << s;
        EXPECT_LE(counts.front(), full / kTaperDivisors[0]) << s;
        EXPECT_LE(counts.back(), full / kTaperDivisors[0]) << s;
      }
      // Balanced by bytes.
      const int64_t lo = *std::min_element(plan->shard_bytes.begin(), plan->shard_bytes.end());
      const int64_t hi = *std::max_element(plan->shard_bytes.begin(), plan->shard_bytes.end());
      EXPECT_LE(hi - lo, plan->chunk_bytes);
      // The same size asked for explicitly: every parameter in full chunks
      // from its first element.
      absl::StatusOr<ChunkPlan> exact = PlanChunks(graph, shards, plan->chunk_bytes);
      ASSERT_OK(exact);
      for (const ChunkInfo& c : exact->chunks) {
        EXPECT_EQ(c.offset % full, 0);
        const int64_t n = graph.params[c.param].shape.num_elements();
        EXPECT_EQ(c.count, std::min(full, n - c.offset));
      }
    }
  }
  // A model too small for its shards is not tapered: fmnist-cnn over 64.
  ModelGraph small = Fmnist();
  absl::StatusOr<ChunkPlan> plan = PlanChunks(small, 64);
  ASSERT_OK(plan);
  for (const ChunkInfo& c : plan->chunks) {
    EXPECT_EQ(c.offset % (plan->chunk_bytes / 4), 0);
  }
}

// Regression (issue 8): a dense layer of 2^31-1 units grew the plan past
// 3 GiB at submit. The chunks are counted before anything is allocated.
TEST(ChunkingTest, ADenseLayerOf2To31UnitsIsRefusedBeforeThePlanGrows) {
  absl::StatusOr<ModelGraph> graph = DenseGraph({400}, {2147483647}, 2);
  ASSERT_OK(graph);
  absl::StatusOr<ChunkPlan> plan = PlanChunks(*graph, 1);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("more than 1048576 chunks"), std::string::npos)
      << plan.status();
}

TEST(ChunkingTest, AnExternalModelPushesItsTrainableTensorsLastToFirstThenItsBuffers) {
  v1::ExternalModel model;
  for (auto [name, trainable] : {std::pair{"embed.weight", true},
                                 {"bn.running_mean", false},
                                 {"lstm.weight_hh_l0", true},
                                 {"head.bias", true}}) {
    v1::ExternalTensor* t = model.add_tensors();
    t->set_name(name);
    t->add_shape(4);
    t->set_trainable(trainable);
  }
  absl::StatusOr<ModelGraph> graph = BuildExternalGraph(model);
  ASSERT_OK(graph);
  std::vector<std::string> names;
  for (int p : ParamsInPushOrder(*graph)) names.push_back(graph->params[p].name);
  EXPECT_EQ(names, (std::vector<std::string>{"head.bias", "lstm.weight_hh_l0", "embed.weight",
                                             "bn.running_mean"}));
  absl::StatusOr<ChunkPlan> plan = PlanChunks(*graph, 2, /*chunk_bytes=*/8);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->chunks.size(), 8u);  // 4 tensors of 16 bytes, 8-byte chunks.
}

}  // namespace
}  // namespace pstrain
