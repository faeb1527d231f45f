// Tests for server/aggregation/ssp_policy.{h,cc}: the clocks and the pull
// bound, without a model or a ParameterShard.
#include "server/aggregation/ssp_policy.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/aggregation/chunk_fixture.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::ConfigOf;
using ::pstrain::testing::Members;
using ::pstrain::testing::PullOf;
using ::pstrain::testing::PushOf;
using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

constexpr absl::Duration kLongWait = absl::Seconds(20);

AggregationConfig SspConfig(int staleness) {
  AggregationConfig config = ConfigOf(v1::CONSISTENCY_SSP);
  config.staleness = staleness;
  return config;
}

std::unique_ptr<AggregationPolicy> Ssp(int staleness,
                                       const std::shared_ptr<const ShardMembership>& members) {
  const AggregationConfig config = SspConfig(staleness);
  absl::StatusOr<std::unique_ptr<AggregationPolicy>> policy = CreateAggregationPolicy(config);
  if (!policy.ok()) return nullptr;
  (*policy)->AdoptMembership(members);
  return *std::move(policy);
}

void PushClock(AggregationPolicy& policy, const std::string& worker, int clock) {
  PushArgs args = PushOf(worker, 0);
  args.worker_clock = clock;
  policy.Pushed(args, *Members({}), /*duplicate=*/false);
}

TEST(SspPolicyTest, APullWaitsUntilTheSlowestMemberIsWithinTheBound) {
  std::unique_ptr<AggregationPolicy> policy = Ssp(1, Members({"a", "b"}));
  ASSERT_NE(policy, nullptr);
  EXPECT_STREQ(policy->name(), "ssp");
  PushClock(*policy, "a", 2);
  // "a" at clock 2 needs every clock >= 1; "b" is at 0.
  EXPECT_THAT(policy->AwaitPull(PullOf("a", 2), absl::Now()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("slowest member")));
  absl::Notification released;
  std::thread puller([&] {
    EXPECT_OK(policy->AwaitPull(PullOf("a", 2), absl::Now() + kLongWait));
    released.Notify();
  });
  EXPECT_FALSE(released.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  PushClock(*policy, "b", 1);
  puller.join();
  EXPECT_TRUE(released.HasBeenNotified());
}

TEST(SspPolicyTest, AMemberThatJoinsStartsAtTheSlowestClockOfThoseThatStay) {
  std::unique_ptr<AggregationPolicy> policy = Ssp(0, Members({"a", "b"}));
  ASSERT_NE(policy, nullptr);
  PushClock(*policy, "a", 5);
  PushClock(*policy, "b", 3);
  policy->AdoptMembership(Members({"a", "b", "c"}, 2));
  EXPECT_OK(policy->AwaitPull(PullOf("a", 3), absl::Now()));  // "c" starts at 3.
  EXPECT_THAT(policy->AwaitPull(PullOf("a", 4), absl::Now()),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("slowest member")));
  PushClock(*policy, "x", 9);                  // Not a member: no clock.
  policy->AdoptMembership(Members({"a"}, 3));  // The slow ones leave.
  EXPECT_OK(policy->AwaitPull(PullOf("a", 5), absl::Now()));
}

TEST(SspPolicyTest, RemovalAndDropEndTheWaitWithAborted) {
  std::unique_ptr<AggregationPolicy> policy = Ssp(0, Members({"a", "b"}));
  ASSERT_NE(policy, nullptr);
  std::thread removed([&] {
    EXPECT_THAT(policy->AwaitPull(PullOf("a", 1), absl::Now() + kLongWait),
                StatusIs(absl::StatusCode::kAborted, HasSubstr("was removed")));
  });
  policy->AdoptMembership(Members({"b"}, 2));
  removed.join();
  std::thread dropped([&] {
    EXPECT_THAT(policy->AwaitPull(PullOf("b", 1), absl::Now() + kLongWait),
                StatusIs(absl::StatusCode::kAborted, HasSubstr("was dropped")));
  });
  auto gone = std::make_shared<ShardMembership>(*Members({"b"}, 2));
  gone->dropped = true;
  policy->AdoptMembership(gone);
  dropped.join();
}

}  // namespace
}  // namespace pstrain
