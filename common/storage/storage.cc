#include "common/storage/storage.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/data/file_io.h"
#include "common/status_macros.h"

namespace pstrain::storage {
namespace {

constexpr absl::string_view kS3Scheme = "s3://";
constexpr absl::string_view kFileScheme = "file://";

// A plain path for a local URI, or INVALID_ARGUMENT for another scheme.
absl::StatusOr<std::string> LocalPath(absl::string_view uri) {
  if (absl::ConsumePrefix(&uri, kFileScheme)) return std::string(uri);
  const size_t scheme = uri.find("://");
  if (scheme != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", uri.substr(0, scheme + 3), "\" paths are not supported here (local paths and s3:// are)"));
  }
  return std::string(uri);
}

// ---- Local files ------------------------------------------------------------

class LocalStorage final : public Storage {
 public:
  absl::StatusOr<ObjectInfo> Stat(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(std::string path, LocalPath(uri));
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return data::ErrnoError(errno, "cannot stat", path);
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
    }
    ObjectInfo info;
    info.key = path;
    info.size = st.st_size;
    return info;
  }

  absl::StatusOr<std::string> Read(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(std::string path, LocalPath(uri));
    return data::ReadFileBytes(path);
  }

  absl::StatusOr<std::string> ReadRange(const std::string& uri, int64_t offset,
                                        int64_t length) override {
    PSTRAIN_ASSIGN_OR_RETURN(ObjectInfo info, Stat(uri));
    if (offset < 0 || length < 0 || offset + length > info.size) {
      return absl::OutOfRangeError(absl::StrCat(info.key, ": bytes ", offset, "+", length,
                                                " asked for, the file has ", info.size));
    }
    std::ifstream in(info.key, std::ios::binary);
    std::string bytes(length, '\0');
    if (!in.seekg(offset) || !in.read(bytes.data(), length)) {
      return absl::DataLossError(absl::StrCat(info.key, ": short read at byte ", offset));
    }
    return bytes;
  }

  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& dir) override {
    PSTRAIN_ASSIGN_OR_RETURN(std::string path, LocalPath(dir));
    PSTRAIN_ASSIGN_OR_RETURN(std::vector<std::filesystem::directory_entry> entries,
                             data::ListDirectory(path));
    std::vector<ObjectInfo> out;
    for (const auto& entry : entries) {
      std::error_code ec;
      if (!entry.is_regular_file(ec)) continue;
      ObjectInfo info;
      info.key = entry.path().filename().string();
      info.size = static_cast<int64_t>(entry.file_size(ec));
      out.push_back(std::move(info));
    }
    std::sort(out.begin(), out.end(),
              [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  absl::StatusOr<std::vector<ObjectInfo>> ListRecursive(const std::string& dir) override {
    PSTRAIN_ASSIGN_OR_RETURN(std::string path, LocalPath(dir));
    std::error_code ec;
    if (!std::filesystem::is_directory(path, ec)) {
      return absl::NotFoundError(absl::StrCat("cannot list ", path, ": not a directory"));
    }
    std::vector<ObjectInfo> out;
    std::filesystem::recursive_directory_iterator it(path, ec), end;
    for (; !ec && it != end; it.increment(ec)) {
      if (!it->is_regular_file(ec)) continue;
      ObjectInfo info;
      info.key = std::filesystem::relative(it->path(), path, ec).string();
      info.size = static_cast<int64_t>(it->file_size(ec));
      out.push_back(std::move(info));
    }
    if (ec) return data::ErrnoError(ec.value(), "cannot list", path);
    std::sort(out.begin(), out.end(),
              [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
    return out;
  }

  absl::Status Write(const std::string& uri, const std::string& bytes) override {
    PSTRAIN_ASSIGN_OR_RETURN(std::string path, LocalPath(uri));
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    if (!parent.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(parent, ec);
      if (ec) return data::ErrnoError(ec.value(), "cannot create directory", parent.string());
    }
    return data::WriteFileAtomically(path, bytes);
  }

  absl::Status Delete(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(std::string path, LocalPath(uri));
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return data::ErrnoError(errno, "cannot remove", path);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int> AbortIncompleteWrites(const std::string& dir) override { return 0; }
};

// ---- S3 -----------------------------------------------------------------------

class S3Storage final : public Storage {
 public:
  explicit S3Storage(std::unique_ptr<S3Client> client) : client_(std::move(client)) {}

  absl::StatusOr<ObjectInfo> Stat(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseObject(uri));
    return client_->Head(s3.bucket, s3.key);
  }

  absl::StatusOr<std::string> Read(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseObject(uri));
    PSTRAIN_ASSIGN_OR_RETURN(ObjectInfo info, client_->Head(s3.bucket, s3.key));
    absl::StatusOr<std::string> bytes = client_->Get(s3.bucket, info);
    if (absl::IsAborted(bytes.status()) || absl::IsOutOfRange(bytes.status())) {
      return absl::DataLossError(absl::StrCat(uri, " changed while it was read (",
                                              bytes.status().message(), ")"));
    }
    return bytes;
  }

  absl::StatusOr<std::string> ReadRange(const std::string& uri, int64_t offset,
                                        int64_t length) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseObject(uri));
    if (length == 0) return std::string();
    return client_->GetRange(s3.bucket, s3.key, offset, length);
  }

  absl::StatusOr<std::string> ReadRangeOfVersion(const std::string& uri, int64_t offset,
                                                 int64_t length, const std::string& etag) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseObject(uri));
    if (length == 0) return std::string();
    absl::StatusOr<std::string> bytes = client_->GetRange(s3.bucket, s3.key, offset, length, etag);
    if (absl::IsAborted(bytes.status())) {  // 412: another version is there now.
      return absl::DataLossError(
          absl::StrCat(uri, " changed while it was read (", bytes.status().message(), ")"));
    }
    return bytes;
  }

  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& dir) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseS3Uri(dir));
    std::string prefix = s3.key;
    if (!prefix.empty() && !absl::EndsWith(prefix, "/")) prefix += "/";
    PSTRAIN_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, client_->List(s3.bucket, prefix));
    std::vector<ObjectInfo> out;
    for (ObjectInfo& object : objects) {
      absl::string_view name = object.key;
      absl::ConsumePrefix(&name, prefix);
      if (name.empty() || absl::StrContains(name, '/')) continue;  // Deeper "directories".
      object.key = std::string(name);
      out.push_back(std::move(object));
    }
    return out;
  }

  absl::StatusOr<std::vector<ObjectInfo>> ListRecursive(const std::string& dir) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseS3Uri(dir));
    std::string prefix = s3.key;
    if (!prefix.empty() && !absl::EndsWith(prefix, "/")) prefix += "/";
    PSTRAIN_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, client_->List(s3.bucket, prefix));
    for (ObjectInfo& object : objects) object.key = object.key.substr(prefix.size());
    return objects;
  }

  absl::Status Write(const std::string& uri, const std::string& bytes) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseObject(uri));
    return client_->Put(s3.bucket, s3.key, bytes);
  }

  absl::Status Delete(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseObject(uri));
    return client_->Delete(s3.bucket, s3.key);
  }

  absl::StatusOr<int> AbortIncompleteWrites(const std::string& dir) override {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseS3Uri(dir));
    std::string prefix = s3.key;
    if (!prefix.empty() && !absl::EndsWith(prefix, "/")) prefix += "/";
    return client_->AbortIncompleteUploads(s3.bucket, prefix);
  }

 private:
  static absl::StatusOr<S3Uri> ParseObject(const std::string& uri) {
    PSTRAIN_ASSIGN_OR_RETURN(S3Uri s3, ParseS3Uri(uri));
    if (s3.key.empty() || absl::EndsWith(s3.key, "/")) {
      return absl::InvalidArgumentError(absl::StrCat(uri, " names no object (it needs a key)"));
    }
    return s3;
  }

  const std::unique_ptr<S3Client> client_;
};

// ---- Routing by scheme -------------------------------------------------------------

class RoutingStorage final : public Storage {
 public:
  RoutingStorage(std::unique_ptr<Storage> local, std::unique_ptr<Storage> s3)
      : local_(std::move(local)), s3_(std::move(s3)) {}

  absl::StatusOr<ObjectInfo> Stat(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(uri));
    return s->Stat(uri);
  }
  absl::StatusOr<std::string> Read(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(uri));
    return s->Read(uri);
  }
  absl::StatusOr<std::string> ReadRange(const std::string& uri, int64_t offset,
                                        int64_t length) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(uri));
    return s->ReadRange(uri, offset, length);
  }
  absl::StatusOr<std::string> ReadRangeOfVersion(const std::string& uri, int64_t offset,
                                                 int64_t length, const std::string& etag) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(uri));
    return s->ReadRangeOfVersion(uri, offset, length, etag);
  }
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& dir) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(dir));
    return s->List(dir);
  }
  absl::StatusOr<std::vector<ObjectInfo>> ListRecursive(const std::string& dir) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(dir));
    return s->ListRecursive(dir);
  }
  absl::Status Write(const std::string& uri, const std::string& bytes) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(uri));
    return s->Write(uri, bytes);
  }
  absl::Status Delete(const std::string& uri) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(uri));
    return s->Delete(uri);
  }
  absl::StatusOr<int> AbortIncompleteWrites(const std::string& dir) override {
    PSTRAIN_ASSIGN_OR_RETURN(Storage * s, For(dir));
    return s->AbortIncompleteWrites(dir);
  }

 private:
  absl::StatusOr<Storage*> For(const std::string& uri) {
    if (!IsS3Uri(uri)) return local_.get();
    if (s3_ == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(uri, ": this program was started without S3 settings"));
    }
    return s3_.get();
  }

  const std::unique_ptr<Storage> local_;
  const std::unique_ptr<Storage> s3_;  // Null without S3 settings.
};

bool ValidBucketName(absl::string_view bucket) {
  if (bucket.size() < 3 || bucket.size() > 63) return false;
  for (char c : bucket) {
    if (!(absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '.' || c == '-')) return false;
  }
  return absl::ascii_isalnum(bucket.front()) && absl::ascii_isalnum(bucket.back());
}

}  // namespace

bool IsS3Uri(absl::string_view uri) { return absl::StartsWith(uri, kS3Scheme); }

absl::StatusOr<S3Uri> ParseS3Uri(absl::string_view uri) {
  absl::string_view rest = uri;
  if (!absl::ConsumePrefix(&rest, kS3Scheme)) {
    return absl::InvalidArgumentError(absl::StrCat("\"", uri, "\" is not an s3:// URI"));
  }
  const size_t slash = rest.find('/');
  S3Uri out;
  out.bucket = std::string(rest.substr(0, slash));
  if (slash != absl::string_view::npos) out.key = std::string(rest.substr(slash + 1));
  if (!ValidBucketName(out.bucket)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", uri, "\": bucket name \"", out.bucket,
        "\" is not valid (3 to 63 characters of a-z, 0-9, '.' and '-')"));
  }
  if (out.key.size() > 1024) {
    return absl::InvalidArgumentError(absl::StrCat("\"", uri.substr(0, 80),
                                                   "...\": key longer than 1024 bytes"));
  }
  for (char c : out.key) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("s3://", out.bucket, ": key has a control character"));
    }
  }
  // A trailing '/' (a "directory") is allowed; empty, "." and ".." segments
  // elsewhere are not.
  absl::string_view key = out.key;
  absl::ConsumeSuffix(&key, "/");
  if (!key.empty()) {
    for (absl::string_view segment : absl::StrSplit(key, '/')) {
      if (segment.empty() || segment == "." || segment == "..") {
        return absl::InvalidArgumentError(absl::StrCat(
            "\"", uri, "\": a key may not have empty, \".\" or \"..\" segments"));
      }
    }
  }
  return out;
}

std::string JoinUri(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (absl::EndsWith(dir, "/")) return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

std::unique_ptr<Storage> NewLocalStorage() { return std::make_unique<LocalStorage>(); }

std::unique_ptr<Storage> NewS3Storage(std::unique_ptr<S3Client> client) {
  return std::make_unique<S3Storage>(std::move(client));
}

absl::StatusOr<std::string> ReadAtMost(Storage& store, const std::string& uri, int64_t max_bytes) {
  PSTRAIN_ASSIGN_OR_RETURN(ObjectInfo info, store.Stat(uri));
  if (info.size > max_bytes) {
    return absl::DataLossError(absl::StrCat(uri, ": ", info.size, " bytes, more than the ",
                                            max_bytes, " such a file may have"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, store.Read(uri));
  if (static_cast<int64_t>(bytes.size()) > max_bytes) {  // Replaced since the Stat.
    return absl::DataLossError(absl::StrCat(uri, ": ", bytes.size(), " bytes, more than the ",
                                            max_bytes, " such a file may have"));
  }
  return bytes;
}

absl::StatusOr<std::unique_ptr<Storage>> OpenStorage(const StorageOptions& options) {
  std::unique_ptr<Storage> s3;
  if (options.s3.has_value()) {
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<S3Client> client, S3Client::Create(*options.s3));
    s3 = NewS3Storage(std::move(client));
  }
  return std::unique_ptr<Storage>(new RoutingStorage(NewLocalStorage(), std::move(s3)));
}

}  // namespace pstrain::storage
