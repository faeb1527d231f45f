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
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/checkpoint.h"
#include "common/storage/s3_client.h"
#include "common/data/file_io.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;

constexpr char kPrefix[] = "ckpt-";
constexpr char kSuffix[] = ".ckpt";
constexpr char kManifestSuffix[] = ".manifest";
constexpr char kManifestHeader[] = "pstrain-checkpoint-manifest 1";

// n of "ckpt-<n><suffix>"; 0 for any other name.
int64_t Number(const std::string& name, absl::string_view suffix = kSuffix) {
  if (!absl::StartsWith(name, kPrefix) || !absl::EndsWith(name, suffix)) return 0;
  const std::string digits =
      name.substr(sizeof(kPrefix) - 1, name.size() - (sizeof(kPrefix) - 1) - suffix.size());
  int64_t n = 0;
  return absl::SimpleAtoi(digits, &n) && n > 0 ? n : 0;
}

std::string NumberedName(int64_t n, absl::string_view suffix) {
  return absl::StrFormat("%s%08d%s", kPrefix, n, suffix);
}

// A committed checkpoint's manifest: what the object must be.
struct Manifest {
  std::string object;
  int64_t bytes = -1;
  std::string sha256;
};

std::string EncodeManifest(const Manifest& m) {
  return absl::StrCat(kManifestHeader, "\nobject ", m.object, "\nbytes ", m.bytes, "\nsha256 ",
                      m.sha256, "\n");
}

absl::StatusOr<Manifest> DecodeManifest(const std::string& uri, const std::string& text) {
  Manifest m;
  bool header = false;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    if (line == kManifestHeader) header = true;
    if (absl::ConsumePrefix(&line, "object ")) m.object = std::string(line);
    if (absl::ConsumePrefix(&line, "bytes ")) (void)absl::SimpleAtoi(line, &m.bytes);
    if (absl::ConsumePrefix(&line, "sha256 ")) m.sha256 = std::string(line);
  }
  if (!header || m.object.empty() || m.bytes < 0 || m.sha256.size() != 64) {
    return absl::DataLossError(absl::StrCat(uri, ": not a checkpoint manifest"));
  }
  return m;
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

std::string Checkpointer::RemoteJobDir(const std::string& job_id) const {
  return storage::JoinUri(options_.remote_dir, job_id);
}

absl::StatusOr<std::vector<int64_t>> Checkpointer::RemoteNumbers(const std::string& job_id) const {
  absl::StatusOr<std::vector<storage::ObjectInfo>> objects =
      options_.store->List(RemoteJobDir(job_id));
  std::vector<int64_t> numbers;
  // Nothing there yet (a missing bucket then fails the first write, naming it).
  if (absl::IsNotFound(objects.status())) return numbers;
  if (!objects.ok()) return objects.status();
  for (const storage::ObjectInfo& object : *objects) {
    if (const int64_t n = Number(object.key, kManifestSuffix); n > 0) numbers.push_back(n);
  }
  std::sort(numbers.begin(), numbers.end());
  return numbers;
}

absl::Status Checkpointer::WriteRemote(const std::string& job_id,
                                       const v1::Checkpoint& ckpt) const {
  // The checkpoint file is made locally (the format's writer and reader are
  // file based), then goes up whole; it stays as the local model.ckpt.
  std::error_code ec;
  fs::create_directories(JobDir(job_id), ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create directory ", JobDir(job_id), ": ", ec.message()));
  }
  const std::string tmp = data::TempPathFor(LatestPath(job_id));
  absl::Status status = WriteCheckpointFile(tmp, ckpt);
  absl::StatusOr<std::string> bytes =
      status.ok() ? data::ReadFileBytes(tmp) : absl::StatusOr<std::string>(status);
  absl::StatusOr<std::vector<int64_t>> numbers = RemoteNumbers(job_id);
  if (!bytes.ok() || !numbers.ok()) {
    fs::remove(tmp, ec);
    return !bytes.ok() ? bytes.status() : numbers.status();
  }
  const int64_t next = numbers->empty() ? 1 : numbers->back() + 1;
  const std::string dir = RemoteJobDir(job_id);
  const Manifest manifest{NumberedName(next, kSuffix), static_cast<int64_t>(bytes->size()),
                          storage::Sha256Hex(*bytes)};
  status = options_.store->Write(storage::JoinUri(dir, manifest.object), *bytes);
  // The manifest, last, commits the checkpoint.
  if (status.ok()) {
    status = options_.store->Write(storage::JoinUri(dir, NumberedName(next, kManifestSuffix)),
                                   EncodeManifest(manifest));
  }
  if (!status.ok()) {
    fs::remove(tmp, ec);
    return status;
  }
  PSTRAIN_RETURN_IF_ERROR(data::CommitTemporary(tmp, LatestPath(job_id)));
  // Keep the newest `keep`: manifest first, so that no reader takes a
  // checkpoint whose object is going.
  numbers->push_back(next);
  const int keep = std::max(options_.keep, 1);
  for (size_t i = 0; i + keep < numbers->size(); ++i) {
    const int64_t n = (*numbers)[i];
    absl::Status pruned = options_.store->Delete(storage::JoinUri(dir, NumberedName(n, kManifestSuffix)));
    if (pruned.ok()) pruned = options_.store->Delete(storage::JoinUri(dir, NumberedName(n, kSuffix)));
    if (!pruned.ok()) Log(absl::StrCat(job_id, ": old checkpoint not pruned: ", pruned.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::Checkpoint> Checkpointer::LoadRemote(const std::string& job_id) const {
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<int64_t> numbers, RemoteNumbers(job_id));
  const std::string dir = RemoteJobDir(job_id);
  if (numbers.empty()) {
    return absl::NotFoundError(absl::StrCat(job_id, " has no committed checkpoint in ", dir));
  }
  absl::Status first_error;
  for (auto n = numbers.rbegin(); n != numbers.rend(); ++n) {
    const std::string manifest_uri = storage::JoinUri(dir, NumberedName(*n, kManifestSuffix));
    absl::StatusOr<v1::Checkpoint> ckpt = [&]() -> absl::StatusOr<v1::Checkpoint> {
      PSTRAIN_ASSIGN_OR_RETURN(std::string text,
                               storage::ReadAtMost(*options_.store, manifest_uri, 64 << 10));
      PSTRAIN_ASSIGN_OR_RETURN(Manifest manifest, DecodeManifest(manifest_uri, text));
      const std::string uri = storage::JoinUri(dir, manifest.object);
      // No more than the manifest's size is read (then its SHA-256 checked).
      PSTRAIN_ASSIGN_OR_RETURN(std::string bytes,
                               storage::ReadAtMost(*options_.store, uri, manifest.bytes));
      if (static_cast<int64_t>(bytes.size()) != manifest.bytes ||
          storage::Sha256Hex(bytes) != manifest.sha256) {
        return absl::DataLossError(absl::StrCat(uri, ": ", bytes.size(),
                                                " bytes that do not match its manifest"));
      }
      // Verified against the manifest; the format's own checks follow.
      const std::string tmp = data::TempPathFor(LatestPath(job_id));
      std::error_code ec;
      fs::create_directories(JobDir(job_id), ec);
      PSTRAIN_RETURN_IF_ERROR(data::WriteFileAtomically(tmp, bytes));
      absl::StatusOr<v1::Checkpoint> read = ReadCheckpointFile(tmp);
      fs::remove(tmp, ec);
      return read;
    }();
    if (ckpt.ok()) {
      if (!first_error.ok()) {
        Log(absl::StrCat(job_id, ": using the older checkpoint ", NumberedName(*n, kSuffix)));
      }
      return ckpt;
    }
    if (first_error.ok()) first_error = ckpt.status();
    Log(absl::StrCat(job_id, ": checkpoint ", manifest_uri, " cannot be used: ",
                     ckpt.status().message()));
  }
  return first_error;
}

int Checkpointer::RemoveRemoteOrphans(const std::string& job_id) const {
  const std::string dir = RemoteJobDir(job_id);
  absl::StatusOr<std::vector<storage::ObjectInfo>> objects = options_.store->List(dir);
  if (!objects.ok()) {
    Log(absl::StrCat(job_id, ": cannot list ", dir, ": ", objects.status().message()));
    return 0;
  }
  std::vector<int64_t> committed;
  for (const storage::ObjectInfo& object : *objects) {
    if (const int64_t n = Number(object.key, kManifestSuffix); n > 0) committed.push_back(n);
  }
  int removed = 0;
  for (const storage::ObjectInfo& object : *objects) {
    const int64_t n = Number(object.key, kSuffix);
    if (n == 0 || std::find(committed.begin(), committed.end(), n) != committed.end()) continue;
    const absl::Status deleted = options_.store->Delete(storage::JoinUri(dir, object.key));
    if (deleted.ok()) {
      ++removed;
      Log(absl::StrCat(job_id, ": removed ", storage::JoinUri(dir, object.key),
                       " (a checkpoint whose manifest was never written)"));
    }
  }
  absl::StatusOr<int> aborted = options_.store->AbortIncompleteWrites(dir);
  if (aborted.ok() && *aborted > 0) {
    Log(absl::StrCat(job_id, ": aborted ", *aborted, " unfinished upload(s) under ", dir));
    removed += *aborted;
  }
  return removed;
}

std::vector<std::string> Checkpointer::List(const std::string& job_id) const {
  if (remote()) {
    absl::StatusOr<std::vector<int64_t>> numbers = RemoteNumbers(job_id);
    std::vector<std::string> uris;
    if (!numbers.ok()) return uris;
    for (int64_t n : *numbers) uris.push_back(storage::JoinUri(RemoteJobDir(job_id), NumberedName(n, kSuffix)));
    return uris;
  }
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
  if (remote()) return WriteRemote(job_id, ckpt);
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
  if (remote()) return LoadRemote(job_id);
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
  if (remote()) removed += RemoveRemoteOrphans(job_id);
  return removed;
}

}  // namespace pstrain
