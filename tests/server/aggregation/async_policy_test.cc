// Tests for server/aggregation/async_policy.{h,cc} on chunks alone, and for
// the factory's choice of policy by mode.
#include "server/aggregation/async_policy.h"

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
using ::pstrain::testing::PushLocked;
using ::pstrain::testing::PushOf;
using ::pstrain::testing::Sgd;
using ::pstrain::testing::StatusIs;
using ::pstrain::testing::ValuesOf;
using ::pstrain::testing::VersionOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

AggregationConfig AsyncConfig(const v1::OptimizerSpec& optimizer = Sgd(0.5f)) {
  AggregationConfig config = ConfigOf(v1::CONSISTENCY_ASYNC, optimizer);
  config.max_version_lead = 1;
  return config;
}

TEST(AggregationPolicyFactoryTest, ChoosesThePolicyOfTheMode) {
  for (const auto& [mode, name] : std::vector<std::pair<v1::ConsistencyMode, std::string>>{
           {v1::CONSISTENCY_SYNC, "sync"},
           {v1::CONSISTENCY_ASYNC, "async"},
           {v1::CONSISTENCY_SSP, "ssp"},
           {v1::CONSISTENCY_AVERAGE, "average"}}) {
    AggregationConfig config = AsyncConfig();
    config.mode = mode;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                         CreateAggregationPolicy(config));
    EXPECT_EQ(policy->name(), name);
  }
  AggregationConfig unspecified = AsyncConfig();
  unspecified.mode = v1::CONSISTENCY_UNSPECIFIED;  // The store resolves it first.
  EXPECT_THAT(CreateAggregationPolicy(unspecified),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("consistency mode")));
}

TEST(AsyncPolicyTest, AppliesEveryPushOnArrivalAndRecordsItsStaleness) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(AsyncConfig()));
  EXPECT_FALSE(policy->HasCommonVersions());
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {1, 1}, true, Members({"a", "b"}));
  ASSERT_NE(chunk, nullptr);
  ASSERT_OK(policy->FinishConfiguration());

  PushOutcome first;
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("a", 0), {1, 0}, &first));
  EXPECT_EQ(first.staleness, 0);
  EXPECT_EQ(first.applied_updates, 1);
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(0.5f, 1.f));
  PushOutcome stale;
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("b", 0), {0, 1}, &stale));
  EXPECT_EQ(stale.staleness, 1);
  EXPECT_EQ(VersionOf(*chunk), 2);
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(0.5f, 0.5f));
  EXPECT_TRUE(stale.barrier_waits.empty());
}

TEST(AsyncPolicyTest, RefusesPushesBeyondTheVersionLead) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(AsyncConfig()));
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {1}, true, Members({"a"}));
  ASSERT_NE(chunk, nullptr);
  PushOutcome outcome;
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("a", 1), {0}, &outcome));  // Within the lead of 1.
  EXPECT_THAT(PushLocked(*policy, *chunk, PushOf("a", 3), {0}, &outcome),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ahead")));
  EXPECT_EQ(VersionOf(*chunk), 1);
}

TEST(AsyncPolicyTest, RunningStatisticsTakeTheLastWrite) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(AsyncConfig()));
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {0, 0}, false, Members({"a", "b"}));
  ASSERT_NE(chunk, nullptr);
  EXPECT_EQ(policy->PushKind(*chunk), v1::ChunkHeader::KIND_PARAMETERS);
  PushOutcome outcome;
  ASSERT_OK(
      PushLocked(*policy, *chunk, PushOf("a", 0, v1::ChunkHeader::KIND_PARAMETERS), {1, 2}, &outcome));
  ASSERT_OK(
      PushLocked(*policy, *chunk, PushOf("b", 0, v1::ChunkHeader::KIND_PARAMETERS), {3, 4}, &outcome));
  EXPECT_EQ(outcome.staleness, -1);  // Not a gradient.
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(3, 4));
}

TEST(AsyncPolicyTest, TheOptimizerStateIsReadBackAndResumed) {
  v1::ChunkValues initial;
  v1::OptimizerSlot* slot = initial.add_slots();
  slot->set_name("momentum");
  slot->add_values(2.f);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(AsyncConfig(Sgd(0.5f, 0.5f))));
  EXPECT_THAT(policy->slot_names(), ElementsAre("momentum"));
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {0}, true, Members({"a"}), initial);
  ASSERT_NE(chunk, nullptr);
  ASSERT_OK(policy->FinishConfiguration());
  absl::MutexLock lock(&chunk->mu);
  v1::ChunkValues read;
  ASSERT_OK(policy->ReadSlots(*chunk, &read));
  ASSERT_EQ(read.slots_size(), 1);
  EXPECT_EQ(read.slots(0).name(), "momentum");
  EXPECT_THAT(read.slots(0).values(), ElementsAre(2.f));
}

}  // namespace
}  // namespace pstrain
