#include "common/data/path_policy.h"

#include <filesystem>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/storage/storage.h"

namespace pstrain::data {
namespace {

namespace fs = std::filesystem;

bool Within(const std::string& path, const std::string& root) {
  if (root == "/") return true;
  return path == root || (path.size() > root.size() && path.compare(0, root.size(), root) == 0 &&
                          path[root.size()] == '/');
}

}  // namespace

absl::StatusOr<DataPathPolicy> DataPathPolicy::Create(const std::vector<std::string>& roots) {
  std::vector<std::string> canonical;
  for (const std::string& root : roots) {
    if (storage::IsS3Uri(root)) {
      absl::StatusOr<storage::S3Uri> s3 = storage::ParseS3Uri(root);
      if (!s3.ok()) return absl::InvalidArgumentError(absl::StrCat("--data-root: ", s3.status().message()));
      std::string key(absl::StripSuffix(s3->key, "/"));
      canonical.push_back(key.empty() ? absl::StrCat("s3://", s3->bucket)
                                      : absl::StrCat("s3://", s3->bucket, "/", key));
      continue;
    }
    std::error_code error;
    const fs::path resolved = fs::canonical(root, error);
    if (error || !fs::is_directory(resolved, error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--data-root ", root, " is not an existing directory"));
    }
    canonical.push_back(resolved.string());
  }
  return DataPathPolicy(std::move(canonical));
}

absl::Status DataPathPolicy::Check(const std::string& path) const {
  const absl::Status refused = absl::PermissionDeniedError(absl::StrCat(
      "dataset path is outside the worker's --data-root allow-list (",
      roots_.empty() ? "empty: start the worker with --data-root DIR" : absl::StrJoin(roots_, ", "),
      ")"));
  if (path.empty()) return refused;
  if (storage::IsS3Uri(path)) {
    // Keys are compared as written: ParseS3Uri refuses "." and ".." segments,
    // so a prefix cannot be left by spelling.
    absl::StatusOr<storage::S3Uri> s3 = storage::ParseS3Uri(path);
    if (!s3.ok()) return s3.status();
    const std::string p(absl::StripSuffix(path, "/"));
    for (const std::string& root : roots_) {
      if (storage::IsS3Uri(root) && Within(p, root)) return absl::OkStatus();
    }
    return refused;
  }
  std::error_code error;
  // Symlinks resolved as far as the path exists, the rest normalised
  // lexically: a missing file below a root is allowed (the reader then says
  // it is missing), one outside is refused like any other.
  const fs::path resolved = fs::weakly_canonical(fs::absolute(path, error), error);
  if (error) return refused;
  const std::string p = resolved.lexically_normal().string();
  for (const std::string& root : roots_) {
    if (!storage::IsS3Uri(root) && Within(p, root)) return absl::OkStatus();
  }
  return refused;
}

}  // namespace pstrain::data
