// Evaluation shards: the check of one worker's share of the test set against
// the job and the shards already in, and the merge of every member's share
// into the job's test metrics. Pure functions; no lock, no I/O.
//
//   EvalShardBudget budget{.num_classes = 10, .samples_left = 10000 - claimed_by_others};
//   PSTRAIN_RETURN_IF_ERROR(CheckEvalShard(report.eval_shard(), "worker-2", budget));
//   ...
//   v1::EvalMetrics test = MergeEvalShards({&shard_a, &shard_b});  // counts added
//
// The members' shards are disjoint parts of one test set: together they
// cannot hold more samples than it does (its size when the spec states it,
// else the server's --max-eval-samples), and counts are added, never
// replayed one sample at a time (a shard claiming 2^40 samples once made the
// coordinator loop under its lock).
#ifndef PSTRAIN_SERVER_EVAL_MERGE_H_
#define PSTRAIN_SERVER_EVAL_MERGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

// What one shard may claim.
struct EvalShardBudget {
  int num_classes = 0;       // The model's classes.
  int64_t samples_left = 0;  // The test set (or the bound) less the other members' shards.
  // For messages: where samples_left comes from ("the test set holds 10000").
  std::string bound_source;
};

// INVALID_ARGUMENT naming `worker_id` when `eval` does not fit the model
// (num_classes, confusion size), has a negative count, counts that do not add
// up to `samples`, more samples than the budget leaves, or class names that
// are not one per class or longer than kMaxClassNameBytes. An empty shard
// (no classes, no counts, no samples: a worker that evaluated nothing) is OK.
absl::Status CheckEvalShard(const v1::EvalMetrics& eval, const std::string& worker_id,
                            const EvalShardBudget& budget);

// The job's test metrics from every member's (checked) shard: confusion
// counts added, accuracy and macro precision, recall and F1 computed from
// the sum, loss weighted by samples; the class names of the first shard
// that has them.
v1::EvalMetrics MergeEvalShards(const std::vector<const v1::EvalMetrics*>& shards);

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_EVAL_MERGE_H_
