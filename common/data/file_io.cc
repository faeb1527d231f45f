#include "common/data/file_io.h"

#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"

namespace pstrain::data {
namespace {

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

// Inflates every gzip member in `in` (RFC 1952 allows concatenation).
absl::StatusOr<std::string> Gunzip(const std::string& path, const std::string& in) {
  std::string out;
  out.reserve(in.size() * 4);
  z_stream zs;
  std::memset(&zs, 0, sizeof(zs));
  if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) {
    return absl::InternalError(absl::StrCat(path, ": inflateInit2 failed"));
  }
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  constexpr size_t kChunk = 1 << 20;
  absl::Status status;
  while (true) {
    size_t old_size = out.size();
    out.resize(old_size + kChunk);
    zs.next_out = reinterpret_cast<Bytef*>(out.data() + old_size);
    zs.avail_out = static_cast<uInt>(kChunk);
    int rc = inflate(&zs, Z_NO_FLUSH);
    out.resize(old_size + kChunk - zs.avail_out);
    if (rc == Z_STREAM_END) {
      if (zs.avail_in == 0) break;
      // Another member follows (or trailing garbage, which inflate rejects).
      if (inflateReset(&zs) != Z_OK) {
        status = absl::DataLossError(absl::StrCat(path, ": corrupt gzip stream after member end"));
        break;
      }
      continue;
    }
    if (rc == Z_OK) continue;
    if (rc == Z_BUF_ERROR && zs.avail_in == 0) {
      status = absl::DataLossError(absl::StrCat(
          path, ": truncated gzip stream: compressed data ends at byte offset ", in.size(),
          " after ", out.size(), " decompressed bytes"));
      break;
    }
    status = absl::DataLossError(absl::StrCat(
        path, ": corrupt gzip stream at compressed byte offset ", zs.total_in, ": ",
        zs.msg != nullptr ? zs.msg : "inflate failed"));
    break;
  }
  inflateEnd(&zs);
  if (!status.ok()) return status;
  return out;
}

}  // namespace

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

absl::StatusOr<std::string> ReadFileBytes(const std::string& path) {
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (f == nullptr) {
    int err = errno;
    std::string message = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(message);
    if (err == EACCES) return absl::PermissionDeniedError(message);
    return absl::UnavailableError(message);
  }
  std::string bytes;
  char buffer[1 << 16];
  while (true) {
    size_t n = std::fread(buffer, 1, sizeof(buffer), f.get());
    bytes.append(buffer, n);
    if (n < sizeof(buffer)) {
      if (std::ferror(f.get())) {
        return absl::DataLossError(
            absl::StrCat(path, ": read error at byte offset ", bytes.size()));
      }
      break;
    }
  }
  return bytes;
}

absl::StatusOr<FileContents> ReadFileContents(const std::string& path) {
  absl::StatusOr<std::string> raw = ReadFileBytes(path);
  if (!raw.ok()) return raw.status();
  FileContents contents;
  if (raw->size() >= 2 && static_cast<unsigned char>((*raw)[0]) == 0x1f &&
      static_cast<unsigned char>((*raw)[1]) == 0x8b) {
    absl::StatusOr<std::string> inflated = Gunzip(path, *raw);
    if (!inflated.ok()) return inflated.status();
    contents.bytes = *std::move(inflated);
    contents.gzip = true;
  } else {
    contents.bytes = *std::move(raw);
  }
  return contents;
}

absl::StatusOr<std::string> ResolveMaybeGz(const std::string& dir, const std::string& name) {
  std::string raw = JoinPath(dir, name);
  std::string gz = raw + ".gz";
  std::error_code ec;
  if (std::filesystem::is_regular_file(raw, ec)) return raw;
  if (std::filesystem::is_regular_file(gz, ec)) return gz;
  return absl::NotFoundError(absl::StrCat("neither ", raw, " nor ", gz, " exists"));
}

absl::Status TruncatedError(const std::string& path, const FileContents& file,
                            uint64_t expected_bytes, uint64_t actual_bytes) {
  return absl::DataLossError(absl::StrCat(
      path, ": truncated: expected ", expected_bytes, " bytes, data ends at ",
      file.gzip ? "decompressed " : "", "byte offset ", actual_bytes));
}

}  // namespace pstrain::data
