#include "worker/training_metrics.h"

#include <algorithm>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace pstrain {

// One builder chain per family: a list of declarations, not a flow, so it
// stays in one piece although it is longer than 60 lines.
TrainingMetrics::TrainingMetrics(prometheus::Registry* registry) {
  if (registry == nullptr) return;
  samples_per_second_ = &prometheus::BuildGauge()
                             .Name("pstrain_worker_samples_per_second")
                             .Help("Training throughput of this worker over its current epoch")
                             .Register(*registry)
                             .Add({});
  loss_ = &prometheus::BuildGauge()
               .Name("pstrain_worker_loss")
               .Help("Mean training loss of this worker over its current epoch")
               .Register(*registry)
               .Add({});
  train_accuracy_ = &prometheus::BuildGauge()
                         .Name("pstrain_worker_train_accuracy_ratio")
                         .Help("Training accuracy of this worker over its current epoch")
                         .Register(*registry)
                         .Add({});
  steps_ = &prometheus::BuildCounter()
                .Name("pstrain_worker_steps_total")
                .Help("Training steps completed by this worker")
                .Register(*registry)
                .Add({});
  resyncs_ = &prometheus::BuildCounter()
                  .Name("pstrain_worker_resyncs_total")
                  .Help(
                      "Times the worker re-pulled every chunk after an ABORTED or "
                      "UNAVAILABLE parameter-server call")
                  .Register(*registry)
                  .Add({});
  data_wait_seconds_ = &prometheus::BuildCounter()
                            .Name("pstrain_worker_data_wait_seconds_total")
                            .Help("Time the training loop waited for the data prefetcher")
                            .Register(*registry)
                            .Add({});
  samples_ = &prometheus::BuildCounter()
                  .Name("pstrain_worker_samples_total")
                  .Help("Training samples processed by this worker (at each progress report)")
                  .Register(*registry)
                  .Add({});
  auto& phases = prometheus::BuildHistogram()
                     .Name("pstrain_worker_step_phase_seconds")
                     .Help(
                         "Time of each training step by phase: data_wait (waiting for "
                         "the prefetched batch), pull (waiting for the step's parameters), "
                         "compute (forward and backward), push (waiting for the gradients "
                         "to be accepted), total")
                     .Register(*registry);
  const prometheus::Histogram::BucketBoundaries buckets = {
      0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  pull_wait_ = &phases.Add({{"phase", "pull"}}, buckets);
  compute_ = &phases.Add({{"phase", "compute"}}, buckets);
  push_wait_ = &phases.Add({{"phase", "push"}}, buckets);
  total_ = &phases.Add({{"phase", "total"}}, buckets);
  data_wait_ = &phases.Add({{"phase", "data_wait"}}, buckets);
  prefetch_queue_depth_ = &prometheus::BuildGauge()
                               .Name("pstrain_worker_prefetch_queue_depth")
                               .Help("Batches ready in the data prefetcher after the last step")
                               .Register(*registry)
                               .Add({});
  loss_scale_ = &prometheus::BuildGauge()
                     .Name("pstrain_worker_loss_scale")
                     .Help(
                         "The factor the loss gradient is scaled by: fp16 mixed precision's "
                         "dynamic loss scale, 1 otherwise")
                     .Register(*registry)
                     .Add({});
  overflowed_steps_ = &prometheus::BuildCounter()
                           .Name("pstrain_worker_overflowed_steps_total")
                           .Help(
                               "fp16 mixed precision: steps whose gradients overflowed (pushed "
                               "as zeros; the loss scale halves)")
                           .Register(*registry)
                           .Add({});
}

void TrainingMetrics::ObserveStep(const StepTimings& t) {
  if (steps_ == nullptr) return;
  steps_->Increment();
  pull_wait_->Observe(t.pull_wait_seconds);
  compute_->Observe(t.compute_seconds);
  push_wait_->Observe(t.push_wait_seconds);
  total_->Observe(t.total_seconds);
}

void TrainingMetrics::ObservePrecision(const Model& model, int64_t* seen) {
  if (loss_scale_ == nullptr) return;
  loss_scale_->Set(model.loss_scale());
  if (model.overflowed_steps() > *seen) {
    overflowed_steps_->Increment(static_cast<double>(model.overflowed_steps() - *seen));
    *seen = model.overflowed_steps();
  }
}

void TrainingMetrics::ObserveResyncs(int resyncs, int* seen) {
  if (resyncs_ == nullptr || resyncs <= *seen) return;
  resyncs_->Increment(resyncs - *seen);
  *seen = resyncs;
}

void TrainingMetrics::ObserveData(double wait_seconds, int queue_depth) {
  if (data_wait_ == nullptr) return;
  data_wait_->Observe(std::max(wait_seconds, 0.0));
  prefetch_queue_depth_->Set(queue_depth);
}

void TrainingMetrics::ObserveProgress(const StepProgress& p) {
  if (loss_ == nullptr) return;
  samples_per_second_->Set(p.samples_per_sec);
  loss_->Set(p.mean_loss);
  train_accuracy_->Set(p.train_accuracy);
}

void TrainingMetrics::ObserveEpoch(const EpochStats& stats) {
  if (data_wait_seconds_ == nullptr) return;
  data_wait_seconds_->Increment(std::max(stats.data_wait_seconds, 0.0));
  samples_->Increment(static_cast<double>(std::max<int64_t>(stats.samples, 0)));
}

}  // namespace pstrain
