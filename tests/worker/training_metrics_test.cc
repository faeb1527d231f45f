// TrainingMetrics: the pstrain_worker_* families in a registry, what one step
// and one resync count add, and nothing at all without a registry.
#include "worker/training_metrics.h"

#include <memory>
#include <string>

#include "common/metrics_http.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

TEST(TrainingMetricsTest, RegistersTheWorkerFamilies) {
  auto registry = std::make_shared<prometheus::Registry>();
  TrainingMetrics metrics(registry.get());
  const std::string text = PrometheusTextOf(registry)();
  for (const char* name :
       {"pstrain_worker_samples_per_second", "pstrain_worker_loss", "pstrain_worker_steps_total",
        "pstrain_worker_step_phase_seconds_bucket", "pstrain_worker_data_wait_seconds_total",
        "pstrain_worker_loss_scale", "pstrain_worker_overflowed_steps_total",
        "pstrain_worker_resyncs_total", "pstrain_worker_prefetch_queue_depth"}) {
    EXPECT_THAT(text, HasSubstr(name));
  }
  EXPECT_THAT(text, HasSubstr("phase=\"compute\""));
}

TEST(TrainingMetricsTest, CountsStepsAndOnlyNewResyncs) {
  auto registry = std::make_shared<prometheus::Registry>();
  TrainingMetrics metrics(registry.get());
  StepTimings t;
  t.compute_seconds = 0.02;
  metrics.ObserveStep(t);
  metrics.ObserveStep(t);
  int seen = 0;
  metrics.ObserveResyncs(3, &seen);
  EXPECT_EQ(seen, 3);
  metrics.ObserveResyncs(3, &seen);  // Nothing new.
  metrics.ObserveResyncs(4, &seen);
  EXPECT_EQ(seen, 4);
  const std::string text = PrometheusTextOf(registry)();
  EXPECT_THAT(text, HasSubstr("pstrain_worker_steps_total 2"));
  EXPECT_THAT(text, HasSubstr("pstrain_worker_resyncs_total 4"));
}

TEST(TrainingMetricsTest, WithoutARegistryNothingIsCounted) {
  TrainingMetrics metrics(nullptr);
  metrics.ObserveStep(StepTimings{});
  metrics.ObserveData(0.5, 2);
  metrics.ObserveProgress(StepProgress{});
  metrics.ObserveEpoch(EpochStats{});
  int seen = 0;
  metrics.ObserveResyncs(2, &seen);
  EXPECT_EQ(seen, 0);
}

}  // namespace
}  // namespace pstrain
