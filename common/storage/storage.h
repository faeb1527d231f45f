// Storage: the one interface through which datasets and packed shards are
// read and written, named by URI: a local path ("/data/fmnist",
// "file:///data/fmnist") or an object-store prefix ("s3://bucket/prefix").
// Readers above it never open files themselves.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, OpenStorage(options));
//   PSTRAIN_ASSIGN_OR_RETURN(std::vector<ObjectInfo> shards, storage->List("s3://data/fmnist"));
//   PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, storage->Read("s3://data/fmnist/train-00000-of-00002.pspack"));
//
// To add a scheme: implement Storage for it, then route its prefix in
// RoutingStorage (storage.cc).
//
// Errors keep the codes of the layer below: NOT_FOUND for a missing file,
// object or bucket, PERMISSION_DENIED, DATA_LOSS for an object that changed
// size under a read, UNAVAILABLE when a store stayed unreachable through its
// retries. Messages name the URI, never a credential.
//
// Threads: every implementation is thread-safe.
#ifndef PSTRAIN_COMMON_STORAGE_STORAGE_H_
#define PSTRAIN_COMMON_STORAGE_STORAGE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/storage/s3_client.h"

namespace pstrain::storage {

// "s3://bucket/key" split; key may be empty ("s3://bucket").
struct S3Uri {
  std::string bucket;
  std::string key;
};

// True for "s3://…".
bool IsS3Uri(absl::string_view uri);

// Parses "s3://bucket[/key]". INVALID_ARGUMENT for an empty or malformed
// bucket name (S3's rules: 3-63 of [a-z0-9.-]), a key with "." or ".."
// segments, "//" or control characters: such keys name different objects
// on different stores, and the allow-list compares prefixes.
absl::StatusOr<S3Uri> ParseS3Uri(absl::string_view uri);

// `dir` + "/" + `name` for either kind of URI, without doubling the '/'.
std::string JoinUri(absl::string_view dir, absl::string_view name);

class Storage {
 public:
  virtual ~Storage() = default;

  // Size (and ETag for objects) of the file or object at `uri`.
  virtual absl::StatusOr<ObjectInfo> Stat(const std::string& uri) = 0;

  // The whole file or object. For objects: ranged GETs held to the ETag of
  // a first HEAD, the total checked against its size.
  virtual absl::StatusOr<std::string> Read(const std::string& uri) = 0;

  // Bytes [offset, offset + length). OUT_OF_RANGE past the end.
  virtual absl::StatusOr<std::string> ReadRange(const std::string& uri, int64_t offset,
                                                int64_t length) = 0;

  // The same, held to the version `etag` that Stat or List gave (If-Match):
  // DATA_LOSS ("changed while it was read") when the store holds another
  // version now. Files have no versions: the plain ReadRange.
  virtual absl::StatusOr<std::string> ReadRangeOfVersion(const std::string& uri, int64_t offset,
                                                         int64_t length, const std::string& etag) {
    return ReadRange(uri, offset, length);
  }

  // The entries directly inside `dir` (a directory or a key prefix read as
  // one), names relative to it, sorted. A missing directory is NOT_FOUND; a
  // prefix with no object under it is an empty list for objects (S3 has no
  // directories) but a missing bucket is NOT_FOUND.
  virtual absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& dir) = 0;

  // Every file or object below `dir` at any depth, names relative to it
  // ("train/coat/0001.png"), sorted. NOT_FOUND as List.
  virtual absl::StatusOr<std::vector<ObjectInfo>> ListRecursive(const std::string& dir) = 0;

  // Writes the whole file or object atomically: a reader sees the old
  // content or the new, never part (a local file is written beside and
  // renamed; an object is one PUT or one completed multipart upload).
  // Local parents are created.
  virtual absl::Status Write(const std::string& uri, const std::string& bytes) = 0;

  // Removes the file or object; a missing one is OK.
  virtual absl::Status Delete(const std::string& uri) = 0;

  // Cleans up writes under `dir` that a killed writer never finished and
  // that no listing shows (S3's multipart uploads); how many. Local files
  // have none (their temporary files are listed like any file).
  virtual absl::StatusOr<int> AbortIncompleteWrites(const std::string& dir) = 0;
};

// Local files only: any URI that is not a plain path or file:// is
// INVALID_ARGUMENT naming the scheme.
std::unique_ptr<Storage> NewLocalStorage();

// Objects in S3 through `client` (which the storage owns).
std::unique_ptr<Storage> NewS3Storage(std::unique_ptr<S3Client> client);

struct StorageOptions {
  // The S3 client for s3:// URIs; unset: s3:// URIs are FAILED_PRECONDITION
  // ("this program has no S3 settings").
  std::optional<S3ClientOptions> s3;
};

// Local paths and, when options.s3 is set, s3:// URIs.
absl::StatusOr<std::unique_ptr<Storage>> OpenStorage(const StorageOptions& options);

// store.Read(uri) for a file that is small by nature (a CSV of class names,
// a manifest, a labels object): its size is checked first, and one above
// `max_bytes` is DATA_LOSS naming it, not an allocation of what a damaged
// or hostile store claims.
absl::StatusOr<std::string> ReadAtMost(Storage& store, const std::string& uri, int64_t max_bytes);

}  // namespace pstrain::storage

#endif  // PSTRAIN_COMMON_STORAGE_STORAGE_H_
