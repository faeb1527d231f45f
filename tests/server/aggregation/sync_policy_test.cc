// Tests for server/aggregation/sync_policy.{h,cc} (with barrier_policy and
// push_pacer) on chunks alone, without a model or a ParameterShard.
#include "server/aggregation/sync_policy.h"

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
using ::pstrain::testing::StatusIs;
using ::pstrain::testing::ValuesOf;
using ::pstrain::testing::VersionOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

AggregationConfig SyncConfig() { return ConfigOf(v1::CONSISTENCY_SYNC); }

TEST(SyncPolicyTest, AppliesTheMeanGradientOnceEveryMemberHasPushed) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(SyncConfig()));
  EXPECT_STREQ(policy->name(), "sync");
  EXPECT_TRUE(policy->HasCommonVersions());
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {1, 2, 3}, true, Members({"a", "b"}));
  ASSERT_NE(chunk, nullptr);
  ASSERT_OK(policy->FinishConfiguration());
  EXPECT_EQ(policy->PushKind(*chunk), v1::ChunkHeader::KIND_GRADIENT);

  PushOutcome first;
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("a", 0), {2, 0, 0}, &first));
  EXPECT_EQ(first.applied_updates, 0);
  EXPECT_EQ(VersionOf(*chunk), 0);
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(1, 2, 3));

  PushOutcome last;
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("b", 0), {0, 2, 4}, &last));
  EXPECT_EQ(last.applied_updates, 1);
  EXPECT_EQ(last.barrier_waits.size(), 1u);
  EXPECT_EQ(VersionOf(*chunk), 1);
  // Mean gradient {1, 1, 2}, one SGD step of 0.5.
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(0.5f, 1.5f, 2.f));
}

TEST(SyncPolicyTest, RefusesFutureAndStaleVersionsAndASecondPushWithoutAnUpdateId) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(SyncConfig()));
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {1}, true, Members({"a", "b"}));
  ASSERT_NE(chunk, nullptr);
  PushOutcome outcome;
  EXPECT_THAT(PushLocked(*policy, *chunk, PushOf("a", 1), {1}, &outcome),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ahead")));
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("a", 0), {1}, &outcome));
  EXPECT_THAT(PushLocked(*policy, *chunk, PushOf("a", 0), {1}, &outcome),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("duplicate push")));
  PushArgs retry = PushOf("a", 0);
  retry.incarnation = 7;
  ASSERT_OK(PushLocked(*policy, *chunk, retry, {5}, &outcome));
  EXPECT_TRUE(outcome.duplicate);
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("b", 0), {1}, &outcome));
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(0.5f));  // The retry's 5 is not in the mean.
  EXPECT_THAT(PushLocked(*policy, *chunk, PushOf("a", 0), {1}, &outcome),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("stale")));
}

TEST(SyncPolicyTest, RemovingTheMissingMemberCompletesTheStepAndARemovedMembersPushStays) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(SyncConfig()));
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {4}, true, Members({"a", "b"}));
  ASSERT_NE(chunk, nullptr);
  PushOutcome outcome;
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("a", 0), {2}, &outcome));
  {
    absl::MutexLock lock(&chunk->mu);
    chunk->membership = Members({"a"}, 2);  // "b", which has not pushed, leaves.
    ASSERT_OK(policy->ChunkAdopted(*chunk, &outcome));
    EXPECT_EQ(chunk->version, 1);
    EXPECT_EQ(outcome.applied_updates, 1);
    EXPECT_THAT(*chunk->values, ElementsAre(3.f));  // 4 - 0.5 * 2.
    chunk->membership = Members({"a", "b"}, 3);
  }
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("a", 1), {2}, &outcome));
  {
    absl::MutexLock lock(&chunk->mu);
    chunk->membership = Members({"b"}, 4);  // "a" leaves after pushing.
    ASSERT_OK(policy->ChunkAdopted(*chunk, &outcome));
    EXPECT_EQ(chunk->version, 1);  // "b" has not pushed.
  }
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("b", 1), {4}, &outcome));
  EXPECT_EQ(VersionOf(*chunk), 2);
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(1.5f));  // 3 - 0.5 * (2 + 4) / 2.
}

TEST(SyncPolicyTest, NonTrainableChunksTakeTheMeanOfTheMembersParameters) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(SyncConfig()));
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {0, 0}, false, Members({"a", "b"}));
  ASSERT_NE(chunk, nullptr);
  EXPECT_EQ(policy->PushKind(*chunk), v1::ChunkHeader::KIND_PARAMETERS);
  PushOutcome outcome;
  ASSERT_OK(
      PushLocked(*policy, *chunk, PushOf("a", 0, v1::ChunkHeader::KIND_PARAMETERS), {1, 2}, &outcome));
  ASSERT_OK(
      PushLocked(*policy, *chunk, PushOf("b", 0, v1::ChunkHeader::KIND_PARAMETERS), {3, 6}, &outcome));
  EXPECT_THAT(ValuesOf(*chunk), ElementsAre(2, 4));
}

TEST(SyncPolicyTest, PullCompressionSendsTheStepsDeltaOnlyToAHolderOfThePreviousVersion) {
  AggregationConfig config = SyncConfig();
  config.pull_compression.set_method(v1::CompressionSpec::COMPRESSION_FP16);
  config.chunks_sent_whole = {false, true};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy, CreateAggregationPolicy(config));
  std::unique_ptr<ShardChunk> chunk = AddChunk(*policy, 0, {1, 2}, true, Members({"a"}));
  std::unique_ptr<ShardChunk> whole = AddChunk(*policy, 1, {1, 2}, true, Members({"a"}));
  ASSERT_NE(chunk, nullptr);
  ASSERT_NE(whole, nullptr);
  PushOutcome outcome;
  ASSERT_OK(PushLocked(*policy, *chunk, PushOf("a", 0), {1, 1}, &outcome));

  absl::MutexLock lock(&chunk->mu);
  EXPECT_TRUE(chunk->compress_pulls);
  PullArgs pull = PullOf("a");
  const PulledChunk fresh = policy->Pulled(*chunk, pull);
  EXPECT_EQ(fresh.version, 1);
  EXPECT_NE(fresh.values_epoch, 0u);
  EXPECT_EQ(fresh.delta, nullptr);                      // Holds nothing: the values whole.
  EXPECT_THAT(*fresh.values, ElementsAre(0.5f, 1.5f));  // Exact in FP16.
  pull.held_version = 0;
  pull.held_epoch = fresh.values_epoch;
  EXPECT_NE(policy->Pulled(*chunk, pull).delta, nullptr);
  pull.held_epoch = fresh.values_epoch + 1;  // Another configuration's values.
  EXPECT_EQ(policy->Pulled(*chunk, pull).delta, nullptr);
  pull.held_epoch = fresh.values_epoch;
  pull.master = true;
  const PulledChunk master = policy->Pulled(*chunk, pull);
  EXPECT_EQ(master.delta, nullptr);
  EXPECT_EQ(master.values_epoch, 0u);

  absl::MutexLock whole_lock(&whole->mu);
  EXPECT_FALSE(whole->compress_pulls);
}

TEST(SyncPolicyTest, APacedMemberMayRunTheLeadAheadOfTheSlowest) {
  AggregationConfig config = SyncConfig();
  config.pace_lead_frames = 1;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy, CreateAggregationPolicy(config));
  const std::shared_ptr<const ShardMembership> members = Members({"a", "b"});
  EXPECT_EQ(policy->PaceSlack("a", 0), 1);  // The first to push version 0.
  policy->Pushed(PushOf("a", 0), *members, /*duplicate=*/false);
  EXPECT_EQ(policy->PaceSlack("a", 0), 0);  // One ahead of "b".
  EXPECT_EQ(policy->PaceSlack("b", 0), 1);
  policy->Pushed(PushOf("a", 0), *members, /*duplicate=*/true);  // Not counted.
  policy->Pushed(PushOf("b", 0), *members, /*duplicate=*/false);
  EXPECT_EQ(policy->PaceSlack("a", 0), 1);
  policy->MembershipAdopted(*Members({"a"}));
  EXPECT_EQ(policy->PaceSlack("a", 0), 1);
  EXPECT_EQ(policy->PaceSlack("a", -1), AggregationPolicy::kUnpaced);  // A step already done.
}

TEST(SyncPolicyTest, WithoutALeadNothingIsPaced) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<AggregationPolicy> policy,
                       CreateAggregationPolicy(SyncConfig()));
  EXPECT_FALSE(policy->WatchPace(std::weak_ptr<PaceWatcher>()));
  EXPECT_EQ(policy->PaceSlack("a", 0), AggregationPolicy::kUnpaced);
}

}  // namespace
}  // namespace pstrain
