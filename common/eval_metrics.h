// Test metrics on the wire (v1::EvalMetrics) and in memory
// (ClassificationMetrics, common/metrics.h): the one conversion each way.
//
//   ClassificationMetrics m = shard_matrix.Compute();
//   m.loss = loss_sum / samples;
//   v1::EvalMetrics proto = EvalMetricsProto(m);          // worker -> server
//   ClassificationMetrics back = MetricsFromProto(proto);  // client report
//
// Pure functions; any thread.
#ifndef PSTRAIN_COMMON_EVAL_METRICS_H_
#define PSTRAIN_COMMON_EVAL_METRICS_H_

#include "common/metrics.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

// The longest class name EvalMetrics.class_names may carry (workers cut to
// it; server 0 refuses a longer one).
inline constexpr size_t kMaxClassNameBytes = 256;

// Every field of `m` that EvalMetrics carries: the scores (macro precision,
// recall and F1 as precision, recall, f1), loss, samples, num_classes and
// the confusion counts. The per-class scores stay behind (they follow from
// the counts).
v1::EvalMetrics EvalMetricsProto(const ClassificationMetrics& m);

// The confusion counts of `m` when they fit its num_classes (num_classes^2
// of them; a negative count reads as 0), else an empty matrix of
// max(num_classes, 0) classes. Counts are added at once, never one sample at
// a time (a shard claiming 2^40 samples once looped under a lock).
ConfusionMatrix ConfusionFromProto(const v1::EvalMetrics& m);

// The metrics recomputed from `m`'s confusion counts when it has them (loss
// taken from `m`); without counts, the scores and samples as `m` states them.
ClassificationMetrics MetricsFromProto(const v1::EvalMetrics& m);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_EVAL_METRICS_H_
