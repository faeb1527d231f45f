#include "server/eval_merge.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/eval_metrics.h"
#include "common/metrics.h"

namespace pstrain {

absl::Status CheckEvalShard(const v1::EvalMetrics& eval, const std::string& worker_id,
                            const EvalShardBudget& budget) {
  const int n = eval.num_classes();
  // A worker that evaluated nothing (an external model's, whose framework
  // evaluates on its own) sends an empty shard.
  if (n == 0 && eval.confusion_size() == 0 && eval.samples() == 0) return absl::OkStatus();
  if (n <= 0 || n > budget.num_classes || eval.confusion_size() != static_cast<int64_t>(n) * n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval_shard of ", worker_id, ": num_classes ", n, " and ", eval.confusion_size(),
        " confusion counts do not fit a model with ", budget.num_classes, " classes"));
  }
  const int64_t allowed = budget.samples_left;
  // `what` names the count and its verb ("a count of 7 exceeds").
  auto too_many = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(
        "eval_shard of ", worker_id, ": ", what, " the ", std::max<int64_t>(allowed, 0),
        " test samples left for this shard (", budget.bound_source, ")"));
  };
  int64_t total = 0;  // <= n * n * max(allowed, 0): no overflow.
  for (int64_t c : eval.confusion()) {
    if (c < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("eval_shard of ", worker_id, ": negative count ", c));
    }
    if (c > allowed) return too_many(absl::StrCat("a count of ", c, " exceeds"));
    total += c;
  }
  if (total != eval.samples()) {
    return absl::InvalidArgumentError(absl::StrCat("eval_shard of ", worker_id,
                                                   ": the confusion matrix counts ", total,
                                                   " samples but samples is ", eval.samples()));
  }
  if (total > allowed) return too_many(absl::StrCat(total, " samples exceed"));
  if (eval.class_names_size() != 0 && eval.class_names_size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("eval_shard of ", worker_id, ": ",
                                                   eval.class_names_size(),
                                                   " class names for ", n, " classes"));
  }
  for (const std::string& name : eval.class_names()) {
    if (name.size() > kMaxClassNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("eval_shard of ", worker_id,
                                                     ": a class name longer than ",
                                                     kMaxClassNameBytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

v1::EvalMetrics MergeEvalShards(const std::vector<const v1::EvalMetrics*>& shards) {
  int num_classes = 0;
  for (const v1::EvalMetrics* e : shards) num_classes = std::max(num_classes, e->num_classes());
  ConfusionMatrix total(num_classes);
  double loss_sum = 0;
  int64_t samples = 0;
  for (const v1::EvalMetrics* e : shards) {
    total.Merge(ConfusionFromProto(*e));
    loss_sum += e->loss() * static_cast<double>(e->samples());
    samples += e->samples();
  }
  ClassificationMetrics metrics = total.Compute();
  metrics.loss = samples > 0 ? loss_sum / static_cast<double>(samples) : 0.0;
  // The names of the first shard that has them for every class (every
  // worker read the same dataset).
  for (const v1::EvalMetrics* e : shards) {
    if (e->class_names_size() == num_classes && num_classes > 0) {
      metrics.class_names.assign(e->class_names().begin(), e->class_names().end());
      break;
    }
  }
  return EvalMetricsProto(metrics);
}

}  // namespace pstrain
