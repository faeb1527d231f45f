// Whole-file reads for the dataset readers, with transparent gzip.
//
//   PSTRAIN_ASSIGN_OR_RETURN(data::FileContents f, data::ReadFileContents(path));
//   if (f.bytes.size() < 16) return data::TruncatedError(path, f, 16, f.bytes.size());
//
// Free functions without shared state; thread-safe.
#ifndef PSTRAIN_COMMON_DATA_FILE_IO_H_
#define PSTRAIN_COMMON_DATA_FILE_IO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

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

// `dir`/`name`, without doubling the separator.
std::string JoinPath(const std::string& dir, const std::string& name);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_FILE_IO_H_
