// DataPathPolicy: the directories a worker may read datasets from
// (pstrain-worker --data-root). A job names its dataset by path, and jobs
// come from whoever holds the admin token: without a policy, a job could make
// every worker read any file its user can (and the failure reason would echo
// the path and what the reader made of it).
//
//   PSTRAIN_ASSIGN_OR_RETURN(DataPathPolicy policy,
//                            DataPathPolicy::Create({"/usr/share/datasets"}));
//   PSTRAIN_RETURN_IF_ERROR(policy.Check(job.dataset().path()));  // before opening
//
// A path is allowed when, with symlinks and "." / ".." resolved, it is one
// of the roots or below one. Object-store roots ("s3://bucket" or
// "s3://bucket/prefix") allow that bucket, or the keys below that prefix
// (whole segments: s3://data/fmnist does not allow s3://data/fmnist-private);
// the local root "/" allows no bucket. Check never opens a file and answers a path
// outside the roots the same way whether it exists or not, naming the rule
// and the roots, not the file.
//
// Threads: immutable after Create; Check is thread-safe.
#ifndef PSTRAIN_COMMON_DATA_PATH_POLICY_H_
#define PSTRAIN_COMMON_DATA_PATH_POLICY_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pstrain::data {

class DataPathPolicy {
 public:
  // `roots` must be existing directories (resolved once, here) or s3://
  // URIs. "/" allows every local path; no roots allow none. INVALID_ARGUMENT
  // names a root that is not a directory or not a valid s3:// URI.
  static absl::StatusOr<DataPathPolicy> Create(const std::vector<std::string>& roots);

  // OK when `path` resolves inside a root; PERMISSION_DENIED otherwise
  // ("dataset path is outside the worker's --data-root allow-list (ROOTS)").
  absl::Status Check(const std::string& path) const;

  const std::vector<std::string>& roots() const { return roots_; }

 private:
  explicit DataPathPolicy(std::vector<std::string> roots) : roots_(std::move(roots)) {}
  std::vector<std::string> roots_;  // Canonical, no trailing '/' (except "/").
};

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_PATH_POLICY_H_
