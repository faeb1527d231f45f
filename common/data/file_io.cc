#include "common/data/file_io.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

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

std::string DirectoryOf(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Writes `bytes` to a new file at `tmp_path` and makes it durable. Leaves no
// file behind on failure.
absl::Status WriteDurably(const std::string& tmp_path, const std::string& bytes) {
  // "x": fail if the file exists; "e": close-on-exec.
  std::FILE* file = std::fopen(tmp_path.c_str(), "wbxe");
  if (file == nullptr) return ErrnoError(errno, "cannot create", tmp_path);
  absl::Status status;
  if (std::fwrite(bytes.data(), 1, bytes.size(), file) != bytes.size()) {
    status = ErrnoError(errno, "cannot write", tmp_path);
  } else if (std::fflush(file) != 0) {
    status = ErrnoError(errno, "cannot flush", tmp_path);
  } else if (fsync(fileno(file)) != 0) {
    status = ErrnoError(errno, "cannot fsync", tmp_path);
  }
  if (std::fclose(file) != 0 && status.ok()) status = ErrnoError(errno, "cannot close", tmp_path);
  if (!status.ok()) std::remove(tmp_path.c_str());
  return status;
}

absl::Status SyncDirectory(const std::string& dir) {
  int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "cannot open directory", dir);
  absl::Status status;
  if (fsync(fd) != 0) status = ErrnoError(errno, "cannot fsync directory", dir);
  close(fd);
  return status;
}

}  // namespace

// An absl::Status for a failed system call, keeping the errno's meaning.
absl::Status ErrnoError(int error_number, absl::string_view what, absl::string_view path) {
  std::string message = absl::StrCat(what, " ", path, ": ", std::strerror(error_number));
  switch (error_number) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

std::string TempPathFor(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(path, ".tmp.", static_cast<int64_t>(getpid()), ".",
                      counter.fetch_add(1, std::memory_order_relaxed));
}

// Renames the finished temporary file `tmp_path` over `path` and makes the
// rename durable. Removes the temporary file when the rename fails.
absl::Status CommitTemporary(const std::string& tmp_path, const std::string& path) {
  if (std::rename(tmp_path.c_str(), path.c_str()) != 0) {
    absl::Status status = ErrnoError(errno, "cannot rename into place at", path);
    std::remove(tmp_path.c_str());
    return status;
  }
  absl::Status synced = SyncDirectory(DirectoryOf(path));
  if (!synced.ok()) {
    return absl::Status(synced.code(), absl::StrCat(path,
                                                    " was renamed into place but may not survive "
                                                    "a crash: ",
                                                    synced.message()));
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes) {
  if (path.empty()) return absl::InvalidArgumentError("WriteFileAtomically: empty path");
  const std::string tmp_path = TempPathFor(path);
  PSTRAIN_RETURN_IF_ERROR(WriteDurably(tmp_path, bytes));
  return CommitTemporary(tmp_path, path);
}

absl::StatusOr<std::vector<std::filesystem::directory_entry>> ListDirectory(const std::string& dir) {
  std::vector<std::filesystem::directory_entry> entries;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  for (; !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    entries.push_back(*it);
  }
  if (ec) return ErrnoError(ec.value(), "cannot list", dir);
  return entries;
}

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

std::optional<std::vector<std::string>> SplitCsvLine(absl::string_view line) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') {
        fields.back().push_back('"');
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        fields.back().push_back(c);
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back().push_back(c);
    }
  }
  if (quoted) return std::nullopt;
  return fields;
}

}  // namespace pstrain::data
