// Tests for common/metrics.{h,cc}. Expected values are computed by hand with
// scikit-learn's definitions (precision_recall_fscore_support with
// average="macro", zero_division=0; confusion_matrix rows = true labels).
#include "common/metrics.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

void AddPairs(ConfusionMatrix& cm, const std::vector<int>& truth, const std::vector<int>& pred) {
  ASSERT_EQ(truth.size(), pred.size());
  for (size_t i = 0; i < truth.size(); ++i) cm.Add(truth[i], pred[i]);
}

TEST(ConfusionMatrixTest, EmptyMatrixGivesZeros) {
  ConfusionMatrix cm(3);
  ClassificationMetrics m = cm.Compute();
  EXPECT_EQ(m.samples, 0);
  EXPECT_EQ(m.num_classes, 3);
  EXPECT_EQ(m.accuracy, 0);
  EXPECT_EQ(m.macro_f1, 0);
  EXPECT_THAT(m.confusion, ElementsAre(0, 0, 0, 0, 0, 0, 0, 0, 0));
  EXPECT_THAT(m.per_class_precision, ElementsAre(0, 0, 0));
}

TEST(ConfusionMatrixTest, PerfectPredictions) {
  ConfusionMatrix cm(3);
  AddPairs(cm, {0, 1, 2, 2, 1}, {0, 1, 2, 2, 1});
  ClassificationMetrics m = cm.Compute();
  EXPECT_EQ(m.samples, 5);
  EXPECT_DOUBLE_EQ(m.accuracy, 1.0);
  EXPECT_DOUBLE_EQ(m.macro_precision, 1.0);
  EXPECT_DOUBLE_EQ(m.macro_recall, 1.0);
  EXPECT_DOUBLE_EQ(m.macro_f1, 1.0);
  EXPECT_THAT(m.confusion, ElementsAre(1, 0, 0, 0, 2, 0, 0, 0, 2));
}

// y_true = [0, 0, 1, 1, 2, 2, 2], y_pred = [0, 1, 1, 1, 2, 0, 1]
// confusion_matrix = [[1,1,0],[0,2,0],[1,1,1]]
// precision = [1/2, 2/4, 1/1], recall = [1/2, 2/2, 1/3]
// f1 = [0.5, 2*.5*1/1.5 = 2/3, 2*1*(1/3)/(4/3) = 0.5]
TEST(ConfusionMatrixTest, MatchesSklearnOnAHandComputedCase) {
  ConfusionMatrix cm(3);
  AddPairs(cm, {0, 0, 1, 1, 2, 2, 2}, {0, 1, 1, 1, 2, 0, 1});
  ClassificationMetrics m = cm.Compute();
  EXPECT_EQ(m.samples, 7);
  EXPECT_THAT(m.confusion, ElementsAre(1, 1, 0, 0, 2, 0, 1, 1, 1));
  EXPECT_DOUBLE_EQ(m.accuracy, 4.0 / 7.0);
  EXPECT_THAT(m.per_class_precision,
              ElementsAre(testing::DoubleEq(0.5), testing::DoubleEq(0.5), testing::DoubleEq(1.0)));
  EXPECT_THAT(m.per_class_recall, ElementsAre(testing::DoubleEq(0.5), testing::DoubleEq(1.0),
                                              testing::DoubleEq(1.0 / 3.0)));
  EXPECT_THAT(m.per_class_f1, ElementsAre(testing::DoubleEq(0.5), testing::DoubleEq(2.0 / 3.0),
                                          testing::DoubleEq(0.5)));
  EXPECT_DOUBLE_EQ(m.macro_precision, (0.5 + 0.5 + 1.0) / 3);
  EXPECT_DOUBLE_EQ(m.macro_recall, (0.5 + 1.0 + 1.0 / 3.0) / 3);
  EXPECT_DOUBLE_EQ(m.macro_f1, (0.5 + 2.0 / 3.0 + 0.5) / 3);
}

// y_true = [0, 1, 1, 2], y_pred = [0, 0, 0, 0]: classes 1 and 2 are never
// predicted, so their precision is 0 (zero_division=0), and so is their F1.
// precision = [1/4, 0, 0], recall = [1, 0, 0], f1 = [0.4, 0, 0].
TEST(ConfusionMatrixTest, NeverPredictedClassHasZeroPrecision) {
  ConfusionMatrix cm(3);
  AddPairs(cm, {0, 1, 1, 2}, {0, 0, 0, 0});
  ClassificationMetrics m = cm.Compute();
  EXPECT_THAT(m.per_class_precision, ElementsAre(0.25, 0.0, 0.0));
  EXPECT_THAT(m.per_class_recall, ElementsAre(1.0, 0.0, 0.0));
  EXPECT_THAT(m.per_class_f1, ElementsAre(testing::DoubleEq(0.4), 0.0, 0.0));
  EXPECT_DOUBLE_EQ(m.accuracy, 0.25);
  EXPECT_DOUBLE_EQ(m.macro_precision, 0.25 / 3);
  EXPECT_DOUBLE_EQ(m.macro_recall, 1.0 / 3);
  EXPECT_DOUBLE_EQ(m.macro_f1, 0.4 / 3);
}

// sklearn's default label set is the union of y_true and y_pred: a class that
// appears in neither does not dilute the macro averages.
// y_true = [0, 0, 1], y_pred = [0, 1, 1] with 4 classes (2 and 3 absent):
// precision = [1, 1/2], recall = [1/2, 1], f1 = [2/3, 2/3].
TEST(ConfusionMatrixTest, AbsentClassesAreLeftOutOfMacroAverages) {
  ConfusionMatrix cm(4);
  AddPairs(cm, {0, 0, 1}, {0, 1, 1});
  ClassificationMetrics m = cm.Compute();
  EXPECT_DOUBLE_EQ(m.macro_precision, 0.75);
  EXPECT_DOUBLE_EQ(m.macro_recall, 0.75);
  EXPECT_DOUBLE_EQ(m.macro_f1, 2.0 / 3.0);
  EXPECT_EQ(m.per_class_f1[2], 0.0);
  EXPECT_EQ(m.per_class_f1[3], 0.0);
}

// A class that is predicted but never true still counts (it is in y_pred):
// y_true = [0, 0], y_pred = [0, 1]: precision = [1, 0], recall = [1/2, 0],
// f1 = [2/3, 0].
TEST(ConfusionMatrixTest, PredictedButNeverTrueClassCounts) {
  ConfusionMatrix cm(2);
  AddPairs(cm, {0, 0}, {0, 1});
  ClassificationMetrics m = cm.Compute();
  EXPECT_DOUBLE_EQ(m.macro_precision, 0.5);
  EXPECT_DOUBLE_EQ(m.macro_recall, 0.25);
  EXPECT_DOUBLE_EQ(m.macro_f1, 1.0 / 3.0);
}

TEST(ConfusionMatrixTest, OutOfRangeLabelsAreRejectedNotCounted) {
  ConfusionMatrix cm(2);
  cm.Add(0, 0);
  cm.Add(-1, 0);
  cm.Add(0, 2);
  cm.Add(5, 5);
  EXPECT_EQ(cm.rejected(), 3);
  EXPECT_EQ(cm.Compute().samples, 1);
  EXPECT_THAT(cm.counts(), ElementsAre(1, 0, 0, 0));
}

TEST(ConfusionMatrixTest, NegativeClassCountIsAnEmptyMatrix) {
  ConfusionMatrix cm(-3);
  EXPECT_EQ(cm.num_classes(), 0);
  cm.Add(0, 0);
  EXPECT_EQ(cm.rejected(), 1);
  EXPECT_EQ(cm.Compute().samples, 0);
}

TEST(ConfusionMatrixTest, MergeEqualsCountingEverythingInOneMatrix) {
  const std::vector<int> truth = {0, 1, 2, 2, 1, 0, 2, 1, 1, 0};
  const std::vector<int> pred = {0, 2, 2, 1, 1, 0, 2, 0, 1, 1};
  ConfusionMatrix whole(3), first(3), second(3);
  AddPairs(whole, truth, pred);
  for (size_t i = 0; i < truth.size(); ++i) (i < 4 ? first : second).Add(truth[i], pred[i]);
  first.Add(7, 0);
  first.Merge(second);
  EXPECT_EQ(first.counts(), whole.counts());
  EXPECT_EQ(first.rejected(), 1);
  ClassificationMetrics a = first.Compute(), b = whole.Compute();
  EXPECT_EQ(a.samples, 10);
  EXPECT_DOUBLE_EQ(a.macro_f1, b.macro_f1);
  EXPECT_DOUBLE_EQ(a.accuracy, 0.6);
}

TEST(ConfusionMatrixTest, MergeIntoSmallerMatrixGrowsIt) {
  ConfusionMatrix small(2), large(3);
  small.Add(1, 0);
  large.Add(2, 1);
  large.Add(1, 0);
  small.Merge(large);
  EXPECT_EQ(small.num_classes(), 3);
  EXPECT_THAT(small.counts(), ElementsAre(0, 0, 0, 2, 0, 0, 0, 1, 0));
  large.Merge(ConfusionMatrix(2));  // Smaller into larger: unchanged.
  EXPECT_THAT(large.counts(), ElementsAre(0, 0, 0, 1, 0, 0, 0, 1, 0));
}

TEST(FormatConfusionMatrixTest, AlignsColumnsUnderHeaders) {
  ConfusionMatrix cm(3);
  for (int i = 0; i < 120; ++i) cm.Add(0, 0);
  cm.Add(1, 2);
  cm.Add(2, 2);
  std::string text = FormatConfusionMatrix(cm.Compute());
  const std::string table =
      "true\\pred    0    1    2\n"
      "        0  120    0    0\n"
      "        1    0    0    1\n"
      "        2    0    0    1\n";
  EXPECT_EQ(text.substr(0, table.size()), table) << text;
  EXPECT_THAT(text, HasSubstr("precision"));
  EXPECT_THAT(text, HasSubstr("        2     0.5000     1.0000     0.6667\n"));
}

TEST(FormatConfusionMatrixTest, EmptyForNoClasses) {
  EXPECT_EQ(FormatConfusionMatrix(ClassificationMetrics{}), "");
}

// Merging eval shards adds counts: 2^40 samples cost one addition, not 2^40.
TEST(ConfusionMatrixTest, AddingACountIsOneStepAndOutOfRangeCountsAreRejected) {
  ConfusionMatrix m(2);
  m.Add(1, 0, int64_t{1} << 40);
  m.Add(0, 0, 3);
  m.Add(0, 0, 0);
  m.Add(0, 0, -5);  // Ignored.
  m.Add(2, 0, 7);   // Out of range: rejected.
  EXPECT_EQ(m.counts(), (std::vector<int64_t>{3, 0, int64_t{1} << 40, 0}));
  EXPECT_EQ(m.rejected(), 7);
}

}  // namespace
}  // namespace pstrain
