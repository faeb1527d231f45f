// Tests for common/eval_metrics.{h,cc}: EvalMetrics <-> ClassificationMetrics.
#include "common/eval_metrics.h"

#include <cstdint>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::ElementsAre;

TEST(EvalMetricsTest, AProtoCarriesTheMetricsAndBack) {
  ConfusionMatrix cm(2);
  cm.Add(0, 0, 6);
  cm.Add(0, 1, 2);
  cm.Add(1, 1, 2);
  ClassificationMetrics m = cm.Compute();
  m.loss = 0.75;
  const v1::EvalMetrics proto = EvalMetricsProto(m);
  EXPECT_DOUBLE_EQ(proto.accuracy(), 0.8);
  EXPECT_DOUBLE_EQ(proto.precision(), m.macro_precision);
  EXPECT_DOUBLE_EQ(proto.recall(), m.macro_recall);
  EXPECT_DOUBLE_EQ(proto.f1(), m.macro_f1);
  EXPECT_DOUBLE_EQ(proto.loss(), 0.75);
  EXPECT_EQ(proto.samples(), 10);
  EXPECT_EQ(proto.num_classes(), 2);
  EXPECT_THAT(proto.confusion(), ElementsAre(6, 2, 0, 2));

  const ClassificationMetrics back = MetricsFromProto(proto);
  EXPECT_EQ(back.confusion, m.confusion);
  EXPECT_DOUBLE_EQ(back.accuracy, m.accuracy);
  EXPECT_DOUBLE_EQ(back.macro_f1, m.macro_f1);
  EXPECT_DOUBLE_EQ(back.loss, 0.75);
  EXPECT_EQ(back.per_class_recall, m.per_class_recall);
}

TEST(EvalMetricsTest, WithoutAMatrixTheProtosFiguresStandAndNegativeCountsReadAsZero) {
  v1::EvalMetrics proto;
  proto.set_num_classes(2);
  proto.set_accuracy(0.5);
  proto.set_samples(8);
  const ClassificationMetrics m = MetricsFromProto(proto);
  EXPECT_DOUBLE_EQ(m.accuracy, 0.5);
  EXPECT_EQ(m.samples, 8);

  for (int64_t c : {3, -4, 0, 1}) proto.add_confusion(c);
  EXPECT_THAT(ConfusionFromProto(proto).counts(), ElementsAre(3, 0, 0, 1));
}

}  // namespace
}  // namespace pstrain
