#include "common/eval_metrics.h"

#include <algorithm>
#include <cstdint>

namespace pstrain {

v1::EvalMetrics EvalMetricsProto(const ClassificationMetrics& m) {
  v1::EvalMetrics proto;
  proto.set_accuracy(m.accuracy);
  proto.set_precision(m.macro_precision);
  proto.set_recall(m.macro_recall);
  proto.set_f1(m.macro_f1);
  proto.set_loss(m.loss);
  proto.set_samples(m.samples);
  proto.set_num_classes(m.num_classes);
  proto.mutable_confusion()->Assign(m.confusion.begin(), m.confusion.end());
  for (const std::string& name : m.class_names) proto.add_class_names(name);
  return proto;
}

namespace {

bool HasMatrix(const v1::EvalMetrics& m) {
  const int k = std::max(0, m.num_classes());
  return k > 0 && m.confusion_size() == static_cast<int64_t>(k) * k;
}

}  // namespace

ConfusionMatrix ConfusionFromProto(const v1::EvalMetrics& m) {
  const int k = std::max(0, m.num_classes());
  ConfusionMatrix cm(k);
  if (!HasMatrix(m)) return cm;
  for (int t = 0; t < k; ++t) {
    for (int p = 0; p < k; ++p) cm.Add(t, p, std::max<int64_t>(0, m.confusion(t * k + p)));
  }
  return cm;
}

ClassificationMetrics MetricsFromProto(const v1::EvalMetrics& m) {
  ClassificationMetrics metrics = ConfusionFromProto(m).Compute();
  metrics.loss = m.loss();
  if (!HasMatrix(m)) {
    metrics.accuracy = m.accuracy();
    metrics.macro_precision = m.precision();
    metrics.macro_recall = m.recall();
    metrics.macro_f1 = m.f1();
    metrics.samples = m.samples();
  }
  if (m.class_names_size() == metrics.num_classes) {
    metrics.class_names.assign(m.class_names().begin(), m.class_names().end());
  }
  return metrics;
}

}  // namespace pstrain
