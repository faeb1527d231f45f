#include "common/metrics.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pstrain {

ConfusionMatrix::ConfusionMatrix(int num_classes)
    : num_classes_(std::max(num_classes, 0)),
      counts_(static_cast<size_t>(num_classes_) * num_classes_, 0) {}

void ConfusionMatrix::Add(int true_label, int predicted) {
  if (true_label < 0 || true_label >= num_classes_ || predicted < 0 || predicted >= num_classes_) {
    ++rejected_;
    return;
  }
  ++counts_[static_cast<size_t>(true_label) * num_classes_ + predicted];
}

void ConfusionMatrix::Add(int true_label, int predicted, int64_t count) {
  if (count <= 0) return;
  if (true_label < 0 || true_label >= num_classes_ || predicted < 0 || predicted >= num_classes_) {
    rejected_ += count;
    return;
  }
  counts_[static_cast<size_t>(true_label) * num_classes_ + predicted] += count;
}

void ConfusionMatrix::Merge(const ConfusionMatrix& other) {
  if (other.num_classes_ > num_classes_) {
    const int grown = other.num_classes_;
    std::vector<int64_t> counts(static_cast<size_t>(grown) * grown, 0);
    for (int t = 0; t < num_classes_; ++t) {
      for (int p = 0; p < num_classes_; ++p) {
        counts[static_cast<size_t>(t) * grown + p] =
            counts_[static_cast<size_t>(t) * num_classes_ + p];
      }
    }
    counts_ = std::move(counts);
    num_classes_ = grown;
  }
  for (int t = 0; t < other.num_classes_; ++t) {
    for (int p = 0; p < other.num_classes_; ++p) {
      counts_[static_cast<size_t>(t) * num_classes_ + p] +=
          other.counts_[static_cast<size_t>(t) * other.num_classes_ + p];
    }
  }
  rejected_ += other.rejected_;
}

ClassificationMetrics ConfusionMatrix::Compute() const {
  const int k = num_classes_;
  ClassificationMetrics m;
  m.num_classes = k;
  m.confusion = counts_;
  m.per_class_precision.assign(k, 0.0);
  m.per_class_recall.assign(k, 0.0);
  m.per_class_f1.assign(k, 0.0);

  std::vector<int64_t> row_sum(k, 0), col_sum(k, 0);
  int64_t correct = 0;
  for (int t = 0; t < k; ++t) {
    for (int p = 0; p < k; ++p) {
      const int64_t c = counts_[static_cast<size_t>(t) * k + p];
      row_sum[t] += c;
      col_sum[p] += c;
      m.samples += c;
      if (t == p) correct += c;
    }
  }
  if (m.samples == 0) return m;
  m.accuracy = static_cast<double>(correct) / static_cast<double>(m.samples);

  int present = 0;
  for (int c = 0; c < k; ++c) {
    const double tp = static_cast<double>(counts_[static_cast<size_t>(c) * k + c]);
    const double precision = col_sum[c] > 0 ? tp / static_cast<double>(col_sum[c]) : 0.0;
    const double recall = row_sum[c] > 0 ? tp / static_cast<double>(row_sum[c]) : 0.0;
    const double f1 =
        precision + recall > 0 ? 2.0 * precision * recall / (precision + recall) : 0.0;
    m.per_class_precision[c] = precision;
    m.per_class_recall[c] = recall;
    m.per_class_f1[c] = f1;
    if (row_sum[c] + col_sum[c] > 0) {
      ++present;
      m.macro_precision += precision;
      m.macro_recall += recall;
      m.macro_f1 += f1;
    }
  }
  // present > 0 because samples > 0.
  m.macro_precision /= present;
  m.macro_recall /= present;
  m.macro_f1 /= present;
  return m;
}

std::string FormatConfusionMatrix(const ClassificationMetrics& m) {
  const int k = m.num_classes;
  if (k <= 0 || m.confusion.size() != static_cast<size_t>(k) * k) return "";
  constexpr char kCorner[] = "true\\pred";
  size_t width = std::to_string(k - 1).size();
  for (int64_t c : m.confusion) width = std::max(width, std::to_string(c).size());
  const int cell = static_cast<int>(width);
  const int first = static_cast<int>(sizeof(kCorner) - 1);

  std::string out = absl::StrFormat("%*s", first, kCorner);
  for (int p = 0; p < k; ++p) absl::StrAppendFormat(&out, "  %*d", cell, p);
  out += "\n";
  for (int t = 0; t < k; ++t) {
    absl::StrAppendFormat(&out, "%*d", first, t);
    for (int p = 0; p < k; ++p) {
      absl::StrAppendFormat(&out, "  %*d", cell, m.confusion[static_cast<size_t>(t) * k + p]);
    }
    out += "\n";
  }
  const bool has_scores = m.per_class_precision.size() == static_cast<size_t>(k) &&
                          m.per_class_recall.size() == static_cast<size_t>(k) &&
                          m.per_class_f1.size() == static_cast<size_t>(k);
  const bool has_names = m.class_names.size() == static_cast<size_t>(k);
  if (has_scores) {
    absl::StrAppendFormat(&out, "%*s  %9s  %9s  %9s%s\n", first, "class", "precision", "recall",
                          "f1", has_names ? "  name" : "");
    for (int c = 0; c < k; ++c) {
      absl::StrAppendFormat(&out, "%*d  %9.4f  %9.4f  %9.4f%s\n", first, c,
                            m.per_class_precision[c], m.per_class_recall[c], m.per_class_f1[c],
                            has_names ? "  " + m.class_names[c] : "");
    }
  } else if (has_names) {
    absl::StrAppendFormat(&out, "%*s  name\n", first, "class");
    for (int c = 0; c < k; ++c) absl::StrAppendFormat(&out, "%*d  %s\n", first, c, m.class_names[c]);
  }
  return out;
}

}  // namespace pstrain
