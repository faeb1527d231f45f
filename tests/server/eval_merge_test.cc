// Tests for server/eval_merge.{h,cc}: the check of one worker's test shard
// against its budget, and the merge of shards by adding counts.
#include "server/eval_merge.h"

#include <cstdint>
#include <vector>

#include "common/eval_metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A 2-class shard with the given row-major counts.
v1::EvalMetrics Shard(std::vector<int64_t> counts, double loss) {
  v1::EvalMetrics e;
  e.set_num_classes(2);
  int64_t samples = 0;
  for (int64_t c : counts) {
    e.add_confusion(c);
    samples += c;
  }
  e.set_samples(samples);
  e.set_loss(loss);
  return e;
}

EvalShardBudget Budget(int64_t left) {
  return {.num_classes = 2, .samples_left = left, .bound_source = "the test set holds 10"};
}

TEST(EvalMergeTest, AShardWithinItsBudgetPasses) {
  EXPECT_OK(CheckEvalShard(Shard({3, 1, 0, 4}, 0.5), "worker-1", Budget(8)));
}

TEST(EvalMergeTest, ShardsThatDoNotFitAreRefusedWithTheWorkerNamed) {
  EXPECT_THAT(CheckEvalShard(Shard({3, 1, 0, 4}, 0.5), "worker-1", Budget(7)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("worker-1: 8 samples exceed the 7 test samples left")));
  EXPECT_THAT(CheckEvalShard(Shard({int64_t{1} << 40, 0, 0, 0}, 0.5), "worker-2", Budget(10)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a count of 1099511627776 exceeds the 10")));
  EXPECT_THAT(CheckEvalShard(Shard({3, -1, 0, 4}, 0.5), "worker-3", Budget(10)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("negative count -1")));
  v1::EvalMetrics lying = Shard({3, 1, 0, 4}, 0.5);
  lying.set_samples(9);
  EXPECT_THAT(CheckEvalShard(lying, "worker-4", Budget(10)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("counts 8 samples")));
  v1::EvalMetrics wide = Shard({3, 1, 0, 4}, 0.5);
  wide.set_num_classes(3);
  EXPECT_THAT(CheckEvalShard(wide, "worker-5", Budget(10)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 classes")));
}

TEST(EvalMergeTest, MergingAddsCountsAndWeighsTheLossBySamples) {
  const v1::EvalMetrics a = Shard({3, 1, 0, 4}, 0.5);  // 8 samples, 7 right.
  const v1::EvalMetrics b = Shard({1, 0, 1, 0}, 2.0);  // 2 samples, 1 right.
  const v1::EvalMetrics merged = MergeEvalShards({&a, &b});
  EXPECT_EQ(merged.samples(), 10);
  EXPECT_THAT(merged.confusion(), ElementsAre(4, 1, 1, 4));
  EXPECT_DOUBLE_EQ(merged.accuracy(), 0.8);
  EXPECT_DOUBLE_EQ(merged.loss(), (0.5 * 8 + 2.0 * 2) / 10);
  EXPECT_EQ(merged.num_classes(), 2);
  EXPECT_EQ(merged.class_names_size(), 0);
}

TEST(EvalMergeTest, ClassNamesAreOnePerClassBoundedAndKeptInTheMerge) {
  v1::EvalMetrics named = Shard({3, 1, 0, 4}, 0.5);
  named.add_class_names("T-shirt/top");
  named.add_class_names("Trouser");
  EXPECT_OK(CheckEvalShard(named, "worker-1", Budget(8)));
  const v1::EvalMetrics unnamed = Shard({1, 0, 1, 0}, 2.0);
  const v1::EvalMetrics merged = MergeEvalShards({&unnamed, &named});
  EXPECT_THAT(merged.class_names(), ElementsAre("T-shirt/top", "Trouser"));
  v1::EvalMetrics one_short = Shard({3, 1, 0, 4}, 0.5);
  one_short.add_class_names("T-shirt/top");
  EXPECT_THAT(CheckEvalShard(one_short, "worker-2", Budget(8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1 class names for 2")));
  v1::EvalMetrics long_name = named;
  long_name.set_class_names(1, std::string(kMaxClassNameBytes + 1, 'x'));
  EXPECT_THAT(CheckEvalShard(long_name, "worker-3", Budget(8)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("longer than 256")));
}

}  // namespace
}  // namespace pstrain
