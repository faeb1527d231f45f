#include "common/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace pstrain {
namespace {

static_assert(std::endian::native == std::endian::little,
              "tensor bytes are stored little-endian; add byte swapping for this host");

// An absl::Status for a failed system call, keeping the errno's meaning.
absl::Status ErrnoError(int error_number, absl::string_view what, const std::string& path) {
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

uint32_t Crc32(const std::string& bytes) {
  uLong crc = crc32_z(0L, Z_NULL, 0);
  crc = crc32_z(crc, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size());
  return static_cast<uint32_t>(crc);
}

// Parses `bytes` into `message` without protobuf's default size limit.
bool ParseLarge(const std::string& bytes, google::protobuf::MessageLite* message) {
  if (bytes.size() > static_cast<size_t>(INT_MAX)) return false;
  google::protobuf::io::ArrayInputStream array(bytes.data(), static_cast<int>(bytes.size()));
  google::protobuf::io::CodedInputStream coded(&array);
  coded.SetTotalBytesLimit(INT_MAX);
  return message->ParseFromCodedStream(&coded) && coded.ConsumedEntireMessage();
}

// Validates every tensor of `ckpt` and the uniqueness of their names.
absl::Status ValidateCheckpointTensors(const v1::Checkpoint& ckpt) {
  std::unordered_set<std::string_view> names;
  for (const auto* list : {&ckpt.parameters(), &ckpt.optimizer_state()}) {
    for (const v1::TensorProto& t : *list) {
      PSTRAIN_RETURN_IF_ERROR(ValidateTensorProto(t));
      if (!names.insert(t.name()).second) {
        return absl::InvalidArgumentError(absl::StrCat("duplicate tensor name '", t.name(), "'"));
      }
    }
  }
  return absl::OkStatus();
}

std::string DirectoryOf(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string TempPathFor(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(path, ".tmp.", static_cast<int64_t>(getpid()), ".",
                      counter.fetch_add(1, std::memory_order_relaxed));
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

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rbe");
  if (file == nullptr) return ErrnoError(errno, "cannot open checkpoint", path);
  struct stat info;
  if (fstat(fileno(file), &info) != 0) {
    absl::Status status = ErrnoError(errno, "cannot stat checkpoint", path);
    std::fclose(file);
    return status;
  }
  if (!S_ISREG(info.st_mode)) {
    std::fclose(file);
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", path, " is not a regular file"));
  }
  if (info.st_size > INT_MAX) {
    std::fclose(file);
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", path, " is ", info.st_size, " bytes; at most ", INT_MAX, " are supported"));
  }
  std::string bytes(static_cast<size_t>(info.st_size), '\0');
  size_t read = std::fread(bytes.data(), 1, bytes.size(), file);
  int read_errno = errno;
  bool failed = std::ferror(file) != 0;
  std::fclose(file);
  if (failed) return ErrnoError(read_errno, "cannot read checkpoint", path);
  bytes.resize(read);  // The file may have shrunk since fstat.
  return bytes;
}

}  // namespace

absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes) {
  if (path.empty()) return absl::InvalidArgumentError("WriteFileAtomically: empty path");
  const std::string tmp_path = TempPathFor(path);
  PSTRAIN_RETURN_IF_ERROR(WriteDurably(tmp_path, bytes));
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

absl::Status WriteCheckpointFile(const std::string& path, const v1::Checkpoint& ckpt) {
  if (path.empty()) return absl::InvalidArgumentError("WriteCheckpointFile: empty path");
  if (absl::Status valid = ValidateCheckpointTensors(ckpt); !valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("refusing to write checkpoint ", path, ": ", valid.message()));
  }
  // The envelope adds at most a few dozen bytes to the payload.
  const size_t payload_bytes = ckpt.ByteSizeLong();
  if (payload_bytes == 0) {
    // An all-default Checkpoint serialises to nothing, and a file cut after
    // its format_version would then read back as valid. Refuse it instead.
    return absl::InvalidArgumentError(
        absl::StrCat("refusing to write checkpoint ", path, ": the checkpoint is empty"));
  }
  if (payload_bytes > static_cast<size_t>(INT_MAX) - 64) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, " would be ", payload_bytes,
                                                   " bytes; at most 2 GiB are supported"));
  }

  v1::CheckpointFile envelope;
  envelope.set_format_version(kCheckpointFormatVersion);
  {
    std::string payload;
    if (!ckpt.SerializeToString(&payload)) {
      return absl::InternalError(absl::StrCat("cannot serialise checkpoint ", path));
    }
    envelope.set_crc32(Crc32(payload));
    envelope.set_checkpoint(std::move(payload));
  }
  std::string bytes;
  if (!envelope.SerializeToString(&bytes)) {
    return absl::InternalError(absl::StrCat("cannot serialise checkpoint envelope ", path));
  }
  envelope.Clear();

  return WriteFileAtomically(path, bytes);
}

absl::StatusOr<v1::Checkpoint> ReadCheckpointFile(const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path));

  v1::CheckpointFile envelope;
  if (!ParseLarge(bytes, &envelope)) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path,
                                            ": cannot parse the file envelope (truncated, corrupt "
                                            "or not a pstrain checkpoint)"));
  }
  std::string().swap(bytes);
  if (envelope.format_version() == 0) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", path, ": no format_version (empty file or not a pstrain checkpoint)"));
  }
  if (envelope.format_version() != kCheckpointFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", path, ": unsupported format_version ", envelope.format_version(),
        " (this build reads version ", kCheckpointFormatVersion, ")"));
  }
  if (envelope.checkpoint().empty()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, ": no checkpoint payload (truncated file?)"));
  }
  if (Crc32(envelope.checkpoint()) != envelope.crc32()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, ": checksum mismatch: file is corrupt"));
  }
  v1::Checkpoint ckpt;
  if (!ParseLarge(envelope.checkpoint(), &ckpt)) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, ": cannot parse the checkpoint payload"));
  }
  if (absl::Status valid = ValidateCheckpointTensors(ckpt); !valid.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", valid.message()));
  }
  return ckpt;
}

v1::TensorProto MakeTensorProto(const std::string& name, const std::vector<int64_t>& shape,
                                const float* data) {
  v1::TensorProto t;
  t.set_name(name);
  t.set_dtype(v1::DTYPE_F32);
  // The product is checked: a hostile shape (tests build them) must not
  // overflow, and then there is no data to copy anyway.
  int64_t count = 1;
  bool overflow = false;
  for (int64_t d : shape) {
    t.add_shape(d);
    overflow = overflow || __builtin_mul_overflow(count, d, &count);
  }
  if (!overflow && count > 0 && data != nullptr) {
    t.set_data(reinterpret_cast<const char*>(data), static_cast<size_t>(count) * sizeof(float));
  }
  return t;
}

int DTypeWidth(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
    case v1::DTYPE_I32:
      return 4;
    case v1::DTYPE_F16:
    case v1::DTYPE_BF16:
      return 2;
    case v1::DTYPE_U8:
      return 1;
    default:
      return 0;
  }
}

absl::Status ValidateTensorProto(const v1::TensorProto& t) {
  const int width = DTypeWidth(t.dtype());
  if (width == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name(), "': unknown dtype ", static_cast<int>(t.dtype())));
  }
  uint64_t count = 1;
  for (int i = 0; i < t.shape_size(); ++i) {
    const int64_t d = t.shape(i);
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name(), "': negative dimension ", d, " at axis ", i));
    }
    if (__builtin_mul_overflow(count, static_cast<uint64_t>(d), &count) ||
        count > static_cast<uint64_t>(INT64_MAX)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name(), "': element count overflows"));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, static_cast<uint64_t>(width), &bytes) ||
      bytes != t.data().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name(), "': data has ", t.data().size(), " bytes, shape and ",
                     v1::DType_IsValid(t.dtype()) ? v1::DType_Name(t.dtype()) : "dtype", " need ",
                     count, " x ", width));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> TensorProtoToFloats(const v1::TensorProto& t) {
  PSTRAIN_RETURN_IF_ERROR(ValidateTensorProto(t));
  if (t.dtype() != v1::DTYPE_F32) {
    return absl::UnimplementedError(absl::StrCat("tensor '", t.name(),
                                                 "': only DTYPE_F32 converts to floats, got ",
                                                 v1::DType_Name(t.dtype())));
  }
  std::vector<float> out(t.data().size() / sizeof(float));
  if (!out.empty()) std::memcpy(out.data(), t.data().data(), t.data().size());
  return out;
}

}  // namespace pstrain
