// Tests for server/worker_registry.{h,cc}: ids issued once, a previous id
// given back, the limit, liveness and the idle order.
#include "server/worker_registry.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

std::vector<std::string> Ids(const std::vector<RegisteredWorker*>& workers) {
  std::vector<std::string> ids;
  for (const RegisteredWorker* w : workers) ids.push_back(w->id);
  return ids;
}

TEST(WorkerRegistryTest, IdsAreSavedBeforeTheyAreIssuedAndAPreviousOneComesBack) {
  std::vector<int64_t> saved;
  WorkerRegistry::Options options;
  options.save_next_id = [&](int64_t next) {
    saved.push_back(next);
    return absl::OkStatus();
  };
  WorkerRegistry workers(options);
  workers.set_next_id(5);
  ASSERT_OK_AND_ASSIGN(RegisteredWorker * a, workers.Register({}, "", kStart));
  EXPECT_EQ(a->id, "worker-5");
  EXPECT_THAT(saved, ElementsAre(6));
  // Issued by this registry and free: given back, nothing saved.
  ASSERT_OK_AND_ASSIGN(RegisteredWorker * b, workers.Register({}, "worker-2", kStart));
  EXPECT_EQ(b->id, "worker-2");
  // Held, never issued, or of another form: a new id.
  for (const char* previous : {"worker-5", "worker-9", "worker-02", "job-1"}) {
    ASSERT_OK_AND_ASSIGN(RegisteredWorker * c, workers.Register({}, previous, kStart));
    EXPECT_NE(c->id, previous);
  }
  EXPECT_THAT(saved, ElementsAre(6, 7, 8, 9, 10));
}

TEST(WorkerRegistryTest, AnIdWhoseCounterCannotBeSavedIsNotUsedUp) {
  bool fail = true;
  WorkerRegistry::Options options;
  options.save_next_id = [&](int64_t) {
    return fail ? absl::InternalError("disk full") : absl::OkStatus();
  };
  WorkerRegistry workers(options);
  EXPECT_THAT(workers.Register({}, "", kStart),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("disk full")));
  EXPECT_EQ(workers.size(), 0);
  fail = false;
  ASSERT_OK_AND_ASSIGN(RegisteredWorker * w, workers.Register({}, "", kStart));
  EXPECT_EQ(w->id, "worker-1");
}

TEST(WorkerRegistryTest, AFullRegistryForgetsTheLongDeadFirst) {
  WorkerRegistry::Options options;
  options.max_workers = 2;
  options.heartbeat_timeout = absl::Seconds(10);
  options.forget_dead_after = absl::Minutes(1);
  WorkerRegistry workers(options);
  ASSERT_OK_AND_ASSIGN(RegisteredWorker * a, workers.Register({}, "", kStart));
  ASSERT_OK(workers.Register({}, "", kStart + absl::Minutes(2)).status());
  EXPECT_THAT(workers.Register({}, "", kStart + absl::Minutes(2)),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-workers")));
  const absl::Time later = kStart + absl::Minutes(2);
  EXPECT_THAT(Ids(workers.Overdue(later)), ElementsAre("worker-1"));
  workers.MarkDead(*a, later);
  EXPECT_EQ(workers.AliveCount(), 1);
  ASSERT_OK_AND_ASSIGN(RegisteredWorker * c, workers.Register({}, "", later));
  EXPECT_EQ(c->id, "worker-3");
  EXPECT_EQ(workers.Find("worker-1"), nullptr);  // Forgotten to make room.
}

TEST(WorkerRegistryTest, ADeadWorkerHeardAgainIsAliveAndIdleWorkersComeByNumber) {
  WorkerRegistry workers({});
  std::vector<RegisteredWorker*> all;
  for (int i = 0; i < 11; ++i) {
    ASSERT_OK_AND_ASSIGN(RegisteredWorker * w, workers.Register({}, "", kStart));
    all.push_back(w);
  }
  all[0]->job_id = "job-1";
  workers.MarkDead(*all[1], kStart);
  EXPECT_EQ(workers.IdleCount(), 9);
  const std::vector<std::string> idle = Ids(workers.IdleByNumber());
  EXPECT_EQ(idle.front(), "worker-3");
  EXPECT_EQ(idle.back(), "worker-11");  // Not between worker-1 and worker-2.
  EXPECT_TRUE(workers.Heard(*all[1], kStart + absl::Seconds(1)));
  EXPECT_FALSE(workers.Heard(*all[1], kStart + absl::Seconds(2)));
  EXPECT_EQ(workers.IdleCount(), 10);
  EXPECT_THAT(workers.Silent(absl::Seconds(1), kStart + absl::Seconds(2)).count("worker-2"), 0u);
  EXPECT_EQ(workers.Silent(absl::Seconds(1), kStart + absl::Seconds(2)).size(), 10u);
  workers.Free("job-2", {"worker-1"});
  EXPECT_EQ(all[0]->job_id, "job-1");  // Trains another job.
  workers.Free("job-1", {"worker-1"});
  EXPECT_EQ(all[0]->job_id, "");
  EXPECT_EQ(workers.List().back().worker_id(), "worker-11");
}

}  // namespace
}  // namespace pstrain
