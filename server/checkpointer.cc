#include "server/checkpointer.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint.h"
#include "common/data/file_io.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;

constexpr char kPrefix[] = "ckpt-";
constexpr char kSuffix[] = ".ckpt";

// n of "ckpt-<n>.ckpt"; 0 for any other name.
int64_t Number(const std::string& name) {
  if (!absl::StartsWith(name, kPrefix) || !absl::EndsWith(name, kSuffix)) return 0;
  const std::string digits =
      name.substr(sizeof(kPrefix) - 1, name.size() - (sizeof(kPrefix) - 1) - (sizeof(kSuffix) - 1));
  int64_t n = 0;
  return absl::SimpleAtoi(digits, &n) && n > 0 ? n : 0;
}

// Points `link_path` at `target`: a hard link made under a temporary name
// and renamed over `link_path` (atomic); a copy where the file system has no
// hard links.
absl::Status ReplaceWithLink(const std::string& target, const std::string& link_path,
                             const v1::Checkpoint& ckpt) {
  const std::string tmp = absl::StrCat(link_path, ".tmp.link.", getpid());
  std::error_code ec;
  fs::remove(tmp, ec);
  if (::link(target.c_str(), tmp.c_str()) == 0) {
    if (std::rename(tmp.c_str(), link_path.c_str()) == 0) return absl::OkStatus();
    const int error = errno;
    fs::remove(tmp, ec);
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp, " to ", link_path, ": ", std::strerror(error)));
  }
  return WriteCheckpointFile(link_path, ckpt);  // No hard links here: a copy.
}

}  // namespace

Checkpointer::Checkpointer(Options options) : options_(std::move(options)) {}

void Checkpointer::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::cerr << "pstrain-server: " << line << std::endl;
  }
}

std::string Checkpointer::JobDir(const std::string& job_id) const {
  return (fs::path(options_.state_dir) / "jobs" / job_id).string();
}

std::string Checkpointer::LatestPath(const std::string& job_id) const {
  return (fs::path(JobDir(job_id)) / "model.ckpt").string();
}

bool Checkpointer::HasCheckpoint(const std::string& job_id) const {
  if (options_.state_dir.empty()) return false;
  std::error_code ec;
  return fs::exists(LatestPath(job_id), ec) || !List(job_id).empty();
}

std::vector<std::string> Checkpointer::List(const std::string& job_id) const {
  std::vector<std::pair<int64_t, std::string>> found;
  const fs::path dir = fs::path(JobDir(job_id)) / "checkpoints";
  // A missing or unreadable directory holds no checkpoint to use.
  absl::StatusOr<std::vector<fs::directory_entry>> entries = data::ListDirectory(dir.string());
  if (!entries.ok()) return {};
  for (const fs::directory_entry& entry : *entries) {
    const int64_t n = Number(entry.path().filename().string());
    if (n > 0) found.emplace_back(n, entry.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> paths;
  for (auto& [n, path] : found) paths.push_back(std::move(path));
  return paths;
}

absl::Status Checkpointer::Write(const std::string& job_id, const v1::Checkpoint& ckpt) const {
  if (options_.state_dir.empty()) return absl::OkStatus();
  const fs::path dir = fs::path(JobDir(job_id)) / "checkpoints";
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create directory ", dir.string(), ": ", ec.message()));
  }
  const std::vector<std::string> existing = List(job_id);
  const int64_t next =
      existing.empty() ? 1 : Number(fs::path(existing.back()).filename().string()) + 1;
  const std::string path = (dir / absl::StrFormat("%s%08d%s", kPrefix, next, kSuffix)).string();
  PSTRAIN_RETURN_IF_ERROR(WriteCheckpointFile(path, ckpt));
  PSTRAIN_RETURN_IF_ERROR(ReplaceWithLink(path, LatestPath(job_id), ckpt));
  // Keep the newest `keep`: the one just written is among them.
  std::vector<std::string> all = List(job_id);
  const int keep = std::max(options_.keep, 1);
  for (size_t i = 0; i + keep < all.size(); ++i) fs::remove(all[i], ec);
  return absl::OkStatus();
}

absl::StatusOr<v1::Checkpoint> Checkpointer::LoadLatest(const std::string& job_id) const {
  std::vector<std::string> candidates = List(job_id);
  std::reverse(candidates.begin(), candidates.end());  // Newest first.
  // model.ckpt alone: a state directory from before numbered checkpoints.
  if (candidates.empty()) candidates.push_back(LatestPath(job_id));
  absl::Status first_error;
  for (const std::string& path : candidates) {
    absl::StatusOr<v1::Checkpoint> ckpt = ReadCheckpointFile(path);
    if (ckpt.ok()) {
      if (!first_error.ok()) {
        Log(absl::StrCat(job_id, ": using the older checkpoint ", path));
      }
      return ckpt;
    }
    if (first_error.ok()) first_error = ckpt.status();
    Log(absl::StrCat(job_id, ": checkpoint ", path, " cannot be read: ", ckpt.status().message()));
  }
  return first_error;
}

int Checkpointer::RemoveOrphans(const std::string& job_id) const {
  if (options_.state_dir.empty()) return 0;
  int removed = 0;
  std::error_code ec;
  for (const fs::path& dir : {fs::path(JobDir(job_id)), fs::path(JobDir(job_id)) / "checkpoints"}) {
    absl::StatusOr<std::vector<fs::directory_entry>> entries = data::ListDirectory(dir.string());
    if (!entries.ok()) continue;  // No directory: nothing was left there.
    for (const fs::directory_entry& entry : *entries) {
      if (entry.path().filename().string().find(".tmp.") == std::string::npos) continue;
      if (fs::remove(entry.path(), ec)) {
        ++removed;
        Log(absl::StrCat(job_id, ": removed ", entry.path().string(),
                         " (left by a write that did not finish)"));
      }
    }
  }
  return removed;
}

}  // namespace pstrain
