// TrainingMetrics: the pstrain_worker_* Prometheus families of one worker
// daemon (throughput, loss, step phases, data waits, resyncs, fp16 loss
// scale). Registered once, when the daemon is created; every run of an
// assignment observes into them.
//
//   auto registry = std::make_shared<prometheus::Registry>();
//   TrainingMetrics metrics(registry.get());
//   metrics.ObserveStep(timings);  // From the updater's on_step.
//
// Without a registry every Observe* does nothing.
//
// Threads: construct on one thread; the Observe* calls may come from any
// thread (prometheus-cpp's metrics are thread-safe), but each `*seen`
// counter belongs to its caller.
#ifndef PSTRAIN_WORKER_TRAINING_METRICS_H_
#define PSTRAIN_WORKER_TRAINING_METRICS_H_

#include <cstdint>

#include "worker/model.h"
#include "worker/remote_updater.h"
#include "worker/trainer.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
}  // namespace prometheus

namespace pstrain {

class TrainingMetrics {
 public:
  // Registers the families in `registry` (null: none, every Observe* is a
  // no-op). The registry must outlive this object.
  explicit TrainingMetrics(prometheus::Registry* registry);
  TrainingMetrics(const TrainingMetrics&) = delete;
  TrainingMetrics& operator=(const TrainingMetrics&) = delete;

  // One step's phases (pull, compute, push, total) and the step counter.
  void ObserveStep(const StepTimings& t);
  // The model's loss scale, and the overflowed steps since `*seen`.
  void ObservePrecision(const Model& model, int64_t* seen);
  // The resyncs (RemoteUpdater::resyncs()) since `*seen`.
  void ObserveResyncs(int resyncs, int* seen);
  // The step's wait for its batch and the prefetcher's queue after it.
  void ObserveData(double wait_seconds, int queue_depth);
  // A progress report's throughput, loss and accuracy.
  void ObserveProgress(const StepProgress& p);
  // An epoch's data wait and samples.
  void ObserveEpoch(const EpochStats& stats);

 private:
  // Null when there is no registry.
  prometheus::Gauge* samples_per_second_ = nullptr;
  prometheus::Gauge* loss_ = nullptr;
  prometheus::Gauge* train_accuracy_ = nullptr;
  prometheus::Counter* steps_ = nullptr;
  prometheus::Counter* resyncs_ = nullptr;
  prometheus::Histogram* pull_wait_ = nullptr;
  prometheus::Histogram* compute_ = nullptr;
  prometheus::Histogram* push_wait_ = nullptr;
  prometheus::Histogram* total_ = nullptr;
  prometheus::Counter* data_wait_seconds_ = nullptr;
  prometheus::Counter* samples_ = nullptr;
  prometheus::Histogram* data_wait_ = nullptr;
  prometheus::Gauge* prefetch_queue_depth_ = nullptr;
  prometheus::Gauge* loss_scale_ = nullptr;
  prometheus::Counter* overflowed_steps_ = nullptr;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_TRAINING_METRICS_H_
