// Tests for server/aggregation/average_policy.{h,cc} on chunks alone.
#include "server/aggregation/average_policy.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/aggregation/chunk_fixture.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::AddChunk;
using ::pstrain::testing::ConfigOf;
using ::pstrain::testing::Members;
using ::pstrain::testing::PullOf;
using ::pstrain::testing::PushLocked;
using ::pstrain::testing::PushOf;
using ::pstrain::testing::ValuesOf;
using ::pstrain::testing::VersionOf;
using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr v1::ChunkHeader::Kind kParameters = v1::ChunkHeader::KIND_PARAMETERS;
constexpr v1::ChunkHeader::Kind kState = v1::ChunkHeader::KIND_OPTIMIZER_STATE;

AggregationConfig AverageConfig(bool average_state) {
  v1::OptimizerSpec adam;
  adam.set_type(v1::OPTIMIZER_ADAM);
  adam.set_learning_rate(0.1f);
  AggregationConfig config = ConfigOf(v1::CONSISTENCY_AVERAGE, adam);
  config.average_optimizer_state = average_state;
  return config;
}

absl::Status Push(AggregationPolicy& policy, ShardChunk& chunk, PushArgs args,
                  const std::vector<float>& values, int slot = 0) {
  args.slot = slot;
  PushOutcome outcome;
  return PushLocked(policy, chunk, args, values, &outcome);
}

TEST(AveragePolicyTest, AveragesParametersAndEveryStateSlotOnceEveryMemberPushedThemAll) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(AverageConfig(true)));
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {0, 0}, true, Members({"a", "b"}));
  ASSERT_NE(chunk, nullptr);
  EXPECT_EQ(policy->PushKind(*chunk), kParameters);
  EXPECT_TRUE(policy->ExchangesState(*chunk));
  for (const std::string worker : {"a", "b"}) {
    const float x = worker == "a" ? 1 : 3;
    ASSERT_OK(Push(*policy, *chunk, PushOf(worker, 0, kParameters), {x, 2 * x}));
    ASSERT_OK(Push(*policy, *chunk, PushOf(worker, 0, kState), {x, x}, 0));
    if (worker == "b") {
      EXPECT_EQ(VersionOf(*chunk), 0);  // adam_v is missing.
    }
    ASSERT_OK(Push(*policy, *chunk, PushOf(worker, 0, kState), {4 * x, 0}, 1));
  }
  EXPECT_EQ(VersionOf(*chunk), 1);
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(2, 4));
  absl::MutexLock lock(&chunk->mu);
  PullArgs pull = PullOf("a");
  pull.kind = kState;
  pull.slot = 1;
  EXPECT_THAT(*policy->Pulled(*chunk, pull).values, ElementsAre(8, 0));
  v1::ChunkValues read;
  ASSERT_OK(policy->ReadSlots(*chunk, &read));
  ASSERT_EQ(read.slots_size(), 2);
  EXPECT_EQ(read.slots(0).name(), "adam_m");
  EXPECT_THAT(read.slots(0).values(), ElementsAre(2, 2));
}

TEST(AveragePolicyTest, WithoutStateAveragingTheServerKeepsOnlyTheStateItWasGiven) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(AverageConfig(false)));
  std::unique_ptr<ShardChunk> bare = AddChunk(*policy, 0, {0}, true, Members({"a"}));
  v1::ChunkValues initial;
  for (const char* name : {"adam_m", "adam_v"}) {
    v1::OptimizerSlot* slot = initial.add_slots();
    slot->set_name(name);
    slot->add_values(7);
  }
  std::unique_ptr<ShardChunk> resumed = AddChunk(*policy, 1, {0}, true, Members({"a"}), initial);
  ASSERT_NE(bare, nullptr);
  ASSERT_NE(resumed, nullptr);
  EXPECT_FALSE(policy->ExchangesState(*bare));
  ASSERT_OK(Push(*policy, *bare, PushOf("a", 0, kParameters), {5}));
  EXPECT_THAT(ValuesOf(*bare), ElementsAre(5));  // One member: its values.
  {
    absl::MutexLock lock(&bare->mu);
    v1::ChunkValues read;
    ASSERT_OK(policy->ReadSlots(*bare, &read));
    EXPECT_THAT(read.slots(), IsEmpty());
  }
  absl::MutexLock lock(&resumed->mu);
  v1::ChunkValues read;
  ASSERT_OK(policy->ReadSlots(*resumed, &read));
  ASSERT_EQ(read.slots_size(), 2);
  EXPECT_THAT(read.slots(1).values(), ElementsAre(7));
}

}  // namespace
}  // namespace pstrain
