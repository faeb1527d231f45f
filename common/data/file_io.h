// Whole-file reads for the dataset readers, with transparent gzip, and the
// durable, atomic whole-file write that checkpoints, job state and exports use.
//
//   PSTRAIN_ASSIGN_OR_RETURN(data::FileContents f, data::ReadFileContents(path));
//   if (f.bytes.size() < 16) return data::TruncatedError(path, f, 16, f.bytes.size());
//
// Free functions without shared state; thread-safe.
#ifndef PSTRAIN_COMMON_DATA_FILE_IO_H_
#define PSTRAIN_COMMON_DATA_FILE_IO_H_

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pstrain::data {

struct FileContents {
  std::string bytes;    // The file's bytes, decompressed when it was gzip.
  bool gzip = false;    // The file started with the gzip magic bytes 1f 8b.
};

// Reads the whole file at `path`. A file that starts with the gzip magic is
// inflated (concatenated members are joined); a truncated or corrupt gzip
// stream is DATA_LOSS naming the file. A missing file is NOT_FOUND.
absl::StatusOr<FileContents> ReadFileContents(const std::string& path);

// Reads the whole file at `path` as is (no decompression).
absl::StatusOr<std::string> ReadFileBytes(const std::string& path);

// `dir`/`name` when that file exists, else `dir`/`name`.gz when that exists
// (the raw file wins when both do); NOT_FOUND naming both otherwise.
absl::StatusOr<std::string> ResolveMaybeGz(const std::string& dir, const std::string& name);

// DATA_LOSS for a file whose header promises `expected_bytes` but whose data
// ends at byte offset `actual_bytes` (offsets are in the decompressed stream
// for gzip files, and the message says so).
absl::Status TruncatedError(const std::string& path, const FileContents& file,
                            uint64_t expected_bytes, uint64_t actual_bytes);

// One CSV line's fields (RFC 4180: quoted fields may hold commas and doubled
// quotes); nullopt for a quote left open.
std::optional<std::vector<std::string>> SplitCsvLine(absl::string_view line);

// `dir`/`name`, without doubling the separator.
std::string JoinPath(const std::string& dir, const std::string& name);

// Writes `bytes` to `path` durably and atomically: a temporary file beside it,
// fsync, rename over `path`, fsync of the directory. On error the temporary
// file is removed and an existing file at `path` is left as it was. Errors
// name the path (NOT_FOUND for a missing directory, PERMISSION_DENIED,
// RESOURCE_EXHAUSTED for a full disk, else INTERNAL).
absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes);

// The two halves of WriteFileAtomically, for writers that stream into the
// temporary file themselves (checkpoints): a fresh temporary path beside
// `path` ("<path>.tmp.<pid>.<n>", n distinguishing writers within one
// process), and the rename of the finished temporary file over `path` with
// the directory's fsync (the temporary file is removed if the rename fails).
std::string TempPathFor(const std::string& path);
absl::Status CommitTemporary(const std::string& tmp_path, const std::string& path);

// The entries of directory `dir`, in the order the file system gives them,
// listed with error codes throughout (the range-for form of
// std::filesystem::directory_iterator throws on an increment error). A
// missing directory is NOT_FOUND, others as ErrnoError; the message is
// "cannot list <dir>: <reason>".
absl::StatusOr<std::vector<std::filesystem::directory_entry>> ListDirectory(const std::string& dir);

// An absl::Status for a failed system call on `path`, keeping the errno's
// meaning: NOT_FOUND, PERMISSION_DENIED, RESOURCE_EXHAUSTED (full disk or
// quota), else INTERNAL. The message is "<what> <path>: <strerror>".
absl::Status ErrnoError(int error_number, absl::string_view what, absl::string_view path);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_FILE_IO_H_
