// Classification metrics: a confusion matrix that workers fill batch by batch
// and the server merges, and the scores derived from it (accuracy, per-class
// and macro precision / recall / F1, as scikit-learn defines them with
// zero_division=0).
//
//   ConfusionMatrix cm(10);
//   for (int i = 0; i < n; ++i) cm.Add(labels[i], predictions[i]);
//   total.Merge(cm);                         // e.g. the server, per worker.
//   ClassificationMetrics m = total.Compute();
//   m.loss = mean_loss;                      // Filled in by the caller.
//   std::cout << FormatConfusionMatrix(m);
//
// Threads: ConfusionMatrix is thread-compatible (const methods may run
// concurrently; Add and Merge need exclusive access).
#ifndef PSTRAIN_COMMON_METRICS_H_
#define PSTRAIN_COMMON_METRICS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace pstrain {

struct ClassificationMetrics {
  int64_t samples = 0;  // Pairs counted in the matrix.
  double accuracy = 0;  // Correct / samples; 0 when samples == 0.
  // Unweighted means of the per-class scores over the classes that occur as a
  // true label or as a prediction (scikit-learn's default label set); 0 when
  // samples == 0.
  double macro_precision = 0, macro_recall = 0, macro_f1 = 0;
  double loss = 0;  // Mean loss; not computed by ConfusionMatrix, set by the caller.
  // num_classes x num_classes, row-major: row = true label, column = predicted.
  std::vector<int64_t> confusion;
  int num_classes = 0;
  // Per class c: precision = TP / (TP + FP), 0 when the class is never
  // predicted; recall = TP / (TP + FN), 0 when it never occurs;
  // F1 = 2PR / (P + R), 0 when P + R == 0.
  std::vector<double> per_class_precision, per_class_recall, per_class_f1;
  // Class c's name (the dataset's, when it has them), else empty.
  std::vector<std::string> class_names;
};

class ConfusionMatrix {
 public:
  // A zeroed matrix. A negative num_classes is treated as 0.
  explicit ConfusionMatrix(int num_classes);

  // Counts one (true label, prediction) pair. A pair with either label
  // outside [0, num_classes) is not counted in the matrix; it is counted in
  // rejected() instead, so that callers can report bad labels.
  void Add(int true_label, int predicted);
  // Counts `count` (>= 0) such pairs at once: O(1) whatever the count, so
  // that merging a shard's counts never loops per sample.
  void Add(int true_label, int predicted, int64_t count);

  // Adds `other`'s counts to this matrix (aggregating workers' shards). When
  // the sizes differ the result has the larger size, each count staying at
  // its (true, predicted) position.
  void Merge(const ConfusionMatrix& other);

  ClassificationMetrics Compute() const;

  // Row-major num_classes x num_classes counts (row = true label).
  const std::vector<int64_t>& counts() const { return counts_; }
  int num_classes() const { return num_classes_; }
  // Pairs passed to Add() with an out-of-range label (merged ones included).
  int64_t rejected() const { return rejected_; }

 private:
  int num_classes_;
  std::vector<int64_t> counts_;
  int64_t rejected_ = 0;
};

// An aligned text table of m.confusion with row and column headers, e.g.
//
//   true\pred   0   1   2
//           0  50   2   0
//           1   3  41   6
//           2   0   4  44
//
// followed by one line per class with its precision, recall and F1. An empty
// string when m.num_classes == 0.
std::string FormatConfusionMatrix(const ClassificationMetrics& m);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_METRICS_H_
