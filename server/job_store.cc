#include "server/job_store.h"

#include <algorithm>
#include <filesystem>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "common/data/file_io.h"
#include "common/job_spec.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;

// "job-12" -> 12; 0 for any other name.
int64_t JobNumber(const std::string& id) {
  int64_t n = 0;
  if (!absl::StartsWith(id, "job-") || !absl::SimpleAtoi(id.substr(4), &n)) return 0;
  return n;
}

absl::Status MakeDirs(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create directory ", dir.string(), ": ", ec.message()));
  }
  return absl::OkStatus();
}

}  // namespace

std::string JobStore::JobDir(const std::string& job_id) const {
  return (fs::path(state_dir_) / "jobs" / job_id).string();
}

absl::StatusOr<std::vector<v1::JobStatus>> JobStore::LoadJobs() const {
  std::vector<v1::JobStatus> jobs;
  if (state_dir_.empty()) return jobs;
  const fs::path jobs_dir = fs::path(state_dir_) / "jobs";
  PSTRAIN_RETURN_IF_ERROR(MakeDirs(jobs_dir));
  absl::StatusOr<std::vector<fs::directory_entry>> entries = data::ListDirectory(jobs_dir.string());
  if (!entries.ok()) return absl::InternalError(entries.status().message());
  std::vector<std::pair<int64_t, std::string>> found;
  for (const fs::directory_entry& entry : *entries) {
    const std::string id = entry.path().filename().string();
    const int64_t n = JobNumber(id);
    std::error_code ec;
    if (n <= 0 || !fs::exists(entry.path() / "status.pb", ec)) continue;
    found.emplace_back(n, id);
  }
  std::sort(found.begin(), found.end());
  for (const auto& [n, id] : found) {
    const std::string path = (fs::path(JobDir(id)) / "status.pb").string();
    PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
    v1::JobStatus& status = jobs.emplace_back();
    if (!status.ParseFromString(bytes) || status.job_id() != id) {
      return absl::DataLossError(absl::StrCat("corrupt job status ", path));
    }
  }
  return jobs;
}

absl::Status JobStore::SaveJob(const v1::JobStatus& status) const {
  if (state_dir_.empty()) return absl::OkStatus();
  const fs::path dir = JobDir(status.job_id());
  PSTRAIN_RETURN_IF_ERROR(MakeDirs(dir));
  return data::WriteFileAtomically((dir / "status.pb").string(), status.SerializeAsString());
}

absl::StatusOr<v1::JobHistory> JobStore::LoadHistory(const std::string& job_id) const {
  v1::JobHistory history;
  history.set_job_id(job_id);
  if (state_dir_.empty()) return history;
  const fs::path path = fs::path(JobDir(job_id)) / "history.pb";
  std::error_code ec;
  if (!fs::exists(path, ec)) return history;
  PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path.string()));
  if (!history.ParseFromString(bytes) || history.job_id() != job_id) {
    return absl::DataLossError(absl::StrCat("corrupt job history ", path.string()));
  }
  return history;
}

absl::Status JobStore::SaveHistory(const v1::JobHistory& history) const {
  if (state_dir_.empty()) return absl::OkStatus();
  const fs::path dir = JobDir(history.job_id());
  PSTRAIN_RETURN_IF_ERROR(MakeDirs(dir));
  return data::WriteFileAtomically((dir / "history.pb").string(), history.SerializeAsString());
}

absl::StatusOr<int64_t> JobStore::LoadNextWorkerId() const {
  if (state_dir_.empty()) return 1;
  const std::string path = (fs::path(state_dir_) / "next_worker_id").string();
  std::error_code ec;
  if (!fs::exists(path, ec)) return 1;
  PSTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  int64_t next = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &next) || next < 1) {
    return absl::DataLossError(absl::StrCat("corrupt worker id counter ", path));
  }
  return next;
}

absl::Status JobStore::SaveNextWorkerId(int64_t next) const {
  if (state_dir_.empty()) return absl::OkStatus();
  PSTRAIN_RETURN_IF_ERROR(MakeDirs(state_dir_));
  return data::WriteFileAtomically((fs::path(state_dir_) / "next_worker_id").string(),
                             absl::StrCat(next, "\n"));
}

}  // namespace pstrain
