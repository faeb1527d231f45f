#include "common/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
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
#include "common/data/file_io.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace pstrain {
namespace {

using data::CommitTemporary;
using data::ErrnoError;
using data::TempPathFor;

static_assert(std::endian::native == std::endian::little,
              "tensor bytes are stored little-endian; add byte swapping for this host");

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

// Format 2 (checkpoint.proto): the kinds of part.
constexpr uint32_t kPartManifest = 1;
constexpr uint32_t kPartTensor = 2;
constexpr uint32_t kPartEnd = 3;
constexpr size_t kMagicBytes = sizeof(kCheckpointPartsMagic) - 1;
constexpr size_t kPartHeaderBytes = 12;  // fixed32 kind, fixed64 length.
// Largest payload a reader accepts: a 64 MiB slice plus the TensorPart's
// name, shape and field tags (a writer with a larger max_part_bytes
// writes files readers refuse: the option is for tests, which make it
// smaller).
constexpr uint64_t kMaxPartPayloadBytes = (uint64_t{64} << 20) + (uint64_t{1} << 20);

void PutLittleEndian(uint64_t value, int bytes, char* out) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
}
uint64_t GetLittleEndian(const char* in, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{static_cast<unsigned char>(in[i])} << (8 * i);
  return value;
}

// Writes format-2 parts to an open file, counting them.
class PartWriter {
 public:
  PartWriter(std::FILE* file, const std::string& path, const CheckpointWriteOptions& options)
      : file_(file), path_(path), options_(options) {}

  absl::Status Write(uint32_t kind, const std::string& payload) {
    char header[kPartHeaderBytes];
    PutLittleEndian(kind, 4, header);
    PutLittleEndian(payload.size(), 8, header + 4);
    uLong crc = crc32_z(0L, Z_NULL, 0);
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(header), sizeof(header));
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(payload.data()), payload.size());
    char trailer[4];
    PutLittleEndian(static_cast<uint32_t>(crc), 4, trailer);
    if (std::fwrite(header, 1, sizeof(header), file_) != sizeof(header) ||
        std::fwrite(payload.data(), 1, payload.size(), file_) != payload.size() ||
        std::fwrite(trailer, 1, sizeof(trailer), file_) != sizeof(trailer)) {
      return ErrnoError(errno, "cannot write", path_);
    }
    if (options_.after_part) {
      if (std::fflush(file_) != 0) return ErrnoError(errno, "cannot flush", path_);
      options_.after_part(parts_);
    }
    ++parts_;
    return absl::OkStatus();
  }

  // Every slice of `t`'s data as one TensorPart each (one empty part for an
  // empty tensor).
  absl::Status WriteTensor(const v1::TensorProto& t) {
    const std::string& data = t.data();
    const size_t step = static_cast<size_t>(std::max<int64_t>(1, options_.max_part_bytes));
    size_t offset = 0;
    do {
      v1::TensorPart part;
      v1::TensorProto* slice = part.mutable_tensor();
      slice->set_name(t.name());
      slice->set_dtype(t.dtype());
      *slice->mutable_shape() = t.shape();
      const size_t n = std::min(step, data.size() - offset);
      slice->set_data(data.data() + offset, n);
      part.set_offset(static_cast<int64_t>(offset));
      std::string payload;
      if (!part.SerializeToString(&payload)) {
        return absl::InternalError(absl::StrCat("cannot serialise a part of ", t.name()));
      }
      PSTRAIN_RETURN_IF_ERROR(Write(kPartTensor, payload));
      offset += n;
    } while (offset < data.size());
    return absl::OkStatus();
  }

  int parts() const { return parts_; }

 private:
  std::FILE* const file_;
  const std::string& path_;
  const CheckpointWriteOptions& options_;
  int parts_ = 0;
};

absl::Status WriteParts(std::FILE* file, const std::string& tmp_path, const v1::Checkpoint& ckpt,
                        const CheckpointWriteOptions& options) {
  if (std::fwrite(kCheckpointPartsMagic, 1, kMagicBytes, file) != kMagicBytes) {
    return ErrnoError(errno, "cannot write", tmp_path);
  }
  PartWriter writer(file, tmp_path, options);
  v1::CheckpointManifest manifest;
  v1::Checkpoint* meta = manifest.mutable_meta();
  *meta->mutable_job() = ckpt.job();
  meta->set_step(ckpt.step());
  meta->set_epoch(ckpt.epoch());
  meta->set_created_unix_ms(ckpt.created_unix_ms());
  *meta->mutable_chunk_versions() = ckpt.chunk_versions();
  manifest.set_parameters(ckpt.parameters_size());
  manifest.set_optimizer_state(ckpt.optimizer_state_size());
  std::string payload;
  if (!manifest.SerializeToString(&payload)) {
    return absl::InternalError(absl::StrCat("cannot serialise the manifest of ", tmp_path));
  }
  PSTRAIN_RETURN_IF_ERROR(writer.Write(kPartManifest, payload));
  for (const auto* list : {&ckpt.parameters(), &ckpt.optimizer_state()}) {
    for (const v1::TensorProto& t : *list) PSTRAIN_RETURN_IF_ERROR(writer.WriteTensor(t));
  }
  std::string end(8, '\0');
  PutLittleEndian(static_cast<uint64_t>(writer.parts()), 8, end.data());
  return writer.Write(kPartEnd, end);
}

// The bytes `t`'s shape and dtype call for (its data is not looked at).
absl::StatusOr<uint64_t> ExpectedDataBytes(const v1::TensorProto& t) {
  v1::TensorProto shape_only;
  shape_only.set_name(t.name());
  shape_only.set_dtype(t.dtype());
  *shape_only.mutable_shape() = t.shape();
  const int width = DTypeWidth(t.dtype());
  if (width == 0) return ValidateTensorProto(shape_only);  // Names the problem.
  uint64_t count = 1;
  for (int64_t d : t.shape()) {
    if (d < 0 || __builtin_mul_overflow(count, static_cast<uint64_t>(d), &count) ||
        count > static_cast<uint64_t>(INT64_MAX)) {
      return ValidateTensorProto(shape_only);
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(count, static_cast<uint64_t>(width), &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name(), "': element count overflows"));
  }
  return bytes;
}

// Reads a format-2 file whose magic has been read from `file`.
absl::StatusOr<v1::Checkpoint> ReadParts(std::FILE* file, const std::string& path) {
  auto loss = [&path](auto&&... what) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", what...));
  };
  v1::Checkpoint ckpt;
  int64_t want_parameters = -1, want_optimizer_state = -1;
  v1::TensorProto* current = nullptr;  // The tensor being assembled.
  uint64_t current_bytes = 0;          // Its full size.
  std::string payload;
  for (uint64_t part = 0;; ++part) {
    char header[kPartHeaderBytes];
    const size_t got = std::fread(header, 1, sizeof(header), file);
    if (got != sizeof(header)) {
      if (std::ferror(file)) return ErrnoError(errno, "cannot read checkpoint", path);
      return loss("incomplete (no end part; the write did not finish or the file was cut)");
    }
    const uint32_t kind = static_cast<uint32_t>(GetLittleEndian(header, 4));
    const uint64_t length = GetLittleEndian(header + 4, 8);
    if (length > kMaxPartPayloadBytes) {
      return loss("part ", part, " claims ", length, " bytes (corrupt file)");
    }
    payload.resize(length);
    char trailer[4];
    if (std::fread(payload.data(), 1, length, file) != length ||
        std::fread(trailer, 1, sizeof(trailer), file) != sizeof(trailer)) {
      if (std::ferror(file)) return ErrnoError(errno, "cannot read checkpoint", path);
      return loss("part ", part, " is cut short (truncated file)");
    }
    uLong crc = crc32_z(0L, Z_NULL, 0);
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(header), sizeof(header));
    crc = crc32_z(crc, reinterpret_cast<const Bytef*>(payload.data()), payload.size());
    if (static_cast<uint32_t>(crc) != static_cast<uint32_t>(GetLittleEndian(trailer, 4))) {
      return loss("checksum mismatch: file is corrupt (part ", part, ")");
    }
    if (part == 0) {
      v1::CheckpointManifest manifest;
      if (kind != kPartManifest || !ParseLarge(payload, &manifest)) {
        return loss("the first part is not a manifest");
      }
      if (manifest.meta().parameters_size() > 0 || manifest.meta().optimizer_state_size() > 0 ||
          manifest.parameters() < 0 || manifest.optimizer_state() < 0) {
        return loss("malformed manifest");
      }
      ckpt = std::move(*manifest.mutable_meta());
      want_parameters = manifest.parameters();
      want_optimizer_state = manifest.optimizer_state();
      continue;
    }
    if (kind == kPartEnd) {
      if (length != 8 || GetLittleEndian(payload.data(), 8) != part) {
        return loss("malformed end part");
      }
      if (current != nullptr && current->data().size() != current_bytes) {
        return loss("tensor '", current->name(), "' is incomplete");
      }
      if (ckpt.parameters_size() != want_parameters ||
          ckpt.optimizer_state_size() != want_optimizer_state) {
        return loss("has ", ckpt.parameters_size(), " + ", ckpt.optimizer_state_size(),
                    " tensors; its manifest says ", want_parameters, " + ", want_optimizer_state);
      }
      if (std::fgetc(file) != EOF) return loss("bytes after the end part");
      return ckpt;
    }
    v1::TensorPart slice;
    if (kind != kPartTensor || !ParseLarge(payload, &slice)) {
      return loss("part ", part, " is not a tensor part");
    }
    v1::TensorProto& t = *slice.mutable_tensor();
    if (slice.offset() == 0) {  // A new tensor.
      if (current != nullptr && current->data().size() != current_bytes) {
        return loss("tensor '", current->name(), "' is incomplete");
      }
      if (ckpt.parameters_size() < want_parameters) {
        current = ckpt.add_parameters();
      } else if (ckpt.optimizer_state_size() < want_optimizer_state) {
        current = ckpt.add_optimizer_state();
      } else {
        return loss("more tensors than its manifest says");
      }
      absl::StatusOr<uint64_t> bytes = ExpectedDataBytes(t);
      if (!bytes.ok()) return loss(bytes.status().message());
      current_bytes = *bytes;
      current->set_name(std::move(*t.mutable_name()));
      current->set_dtype(t.dtype());
      *current->mutable_shape() = t.shape();
    } else if (current == nullptr || t.name() != current->name() ||
               static_cast<uint64_t>(slice.offset()) != current->data().size()) {
      return loss("part ", part, " does not continue the tensor before it");
    }
    if (t.data().size() > current_bytes - current->data().size()) {
      return loss("tensor '", current->name(), "' has more data than its shape");
    }
    current->mutable_data()->append(t.data());
  }
}

}  // namespace

absl::Status WriteCheckpointFile(const std::string& path, const v1::Checkpoint& ckpt,
                                 const CheckpointWriteOptions& options) {
  if (path.empty()) return absl::InvalidArgumentError("WriteCheckpointFile: empty path");
  if (absl::Status valid = ValidateCheckpointTensors(ckpt); !valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("refusing to write checkpoint ", path, ": ", valid.message()));
  }
  if (ckpt.ByteSizeLong() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("refusing to write checkpoint ", path, ": the checkpoint is empty"));
  }
  const std::string tmp_path = TempPathFor(path);
  // "x": fail if the file exists; "e": close-on-exec.
  std::FILE* file = std::fopen(tmp_path.c_str(), "wbxe");
  if (file == nullptr) return ErrnoError(errno, "cannot create", tmp_path);
  absl::Status status = WriteParts(file, tmp_path, ckpt, options);
  if (status.ok() && std::fflush(file) != 0) status = ErrnoError(errno, "cannot flush", tmp_path);
  if (status.ok() && fsync(fileno(file)) != 0) {
    status = ErrnoError(errno, "cannot fsync", tmp_path);
  }
  if (std::fclose(file) != 0 && status.ok()) status = ErrnoError(errno, "cannot close", tmp_path);
  if (!status.ok()) {
    std::remove(tmp_path.c_str());
    return status;
  }
  return CommitTemporary(tmp_path, path);
}

absl::StatusOr<v1::Checkpoint> ReadCheckpointFile(const std::string& path) {
  {
    std::FILE* file = std::fopen(path.c_str(), "rbe");
    if (file == nullptr) return ErrnoError(errno, "cannot open checkpoint", path);
    struct stat info;
    if (fstat(fileno(file), &info) != 0 || !S_ISREG(info.st_mode)) {
      std::fclose(file);
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", path, " is not a regular file"));
    }
    char magic[kMagicBytes];
    if (std::fread(magic, 1, kMagicBytes, file) == kMagicBytes &&
        std::memcmp(magic, kCheckpointPartsMagic, kMagicBytes) == 0) {
      absl::StatusOr<v1::Checkpoint> ckpt = ReadParts(file, path);
      std::fclose(file);
      PSTRAIN_RETURN_IF_ERROR(ckpt.status());
      if (absl::Status valid = ValidateCheckpointTensors(*ckpt); !valid.ok()) {
        return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", valid.message()));
      }
      return ckpt;
    }
    std::fclose(file);
  }

  // Format 1: one envelope.
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
        " (this build reads format-1 envelopes and format-2 parts)"));
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
