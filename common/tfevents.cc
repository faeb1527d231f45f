#include "common/tfevents.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "common/data/file_io.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace pstrain {
namespace {

using data::ErrnoError;

using google::protobuf::io::CodedOutputStream;
using google::protobuf::io::StringOutputStream;

// Protobuf wire types.
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

constexpr uint32_t Tag(uint32_t field, uint32_t wire_type) { return (field << 3) | wire_type; }

// tensorflow.Event fields.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5;
// tensorflow.Summary and Summary.Value fields.
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimpleValue = 2;

constexpr char kFileVersion[] = "brain.Event:2";

std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1) ? 0x82f63b78u : 0);
    table[i] = crc;
  }
  return table;
}

void WriteBytesField(CodedOutputStream& out, uint32_t field, absl::string_view bytes) {
  out.WriteTag(Tag(field, kLengthDelimited));
  out.WriteVarint32(static_cast<uint32_t>(bytes.size()));
  out.WriteRaw(bytes.data(), static_cast<int>(bytes.size()));
}

void WriteWallTime(CodedOutputStream& out, double wall_time_sec) {
  out.WriteTag(Tag(kEventWallTime, kFixed64));
  out.WriteLittleEndian64(absl::bit_cast<uint64_t>(wall_time_sec));
}

std::string EncodeValue(const TfScalar& scalar) {
  std::string value;
  {
    StringOutputStream stream(&value);
    CodedOutputStream out(&stream);
    WriteBytesField(out, kValueTag, scalar.tag);
    out.WriteTag(Tag(kValueSimpleValue, kFixed32));
    out.WriteLittleEndian32(absl::bit_cast<uint32_t>(static_cast<float>(scalar.value)));
  }
  return value;
}

std::string LocalHostname() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

double ToUnixSecondsDouble(absl::Time t) { return absl::ToDoubleSeconds(t - absl::UnixEpoch()); }

}  // namespace

uint32_t Crc32c(absl::string_view data) {
  static const std::array<uint32_t, 256> kTable = MakeCrc32cTable();
  uint32_t crc = 0xffffffffu;
  for (unsigned char byte : data) crc = kTable[(crc ^ byte) & 0xff] ^ (crc >> 8);
  return crc ^ 0xffffffffu;
}

uint32_t MaskCrc32c(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

std::string FrameTfRecord(absl::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  auto append_le = [&record](uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) record.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  append_le(data.size(), 8);
  append_le(MaskCrc32c(Crc32c(absl::string_view(record.data(), 8))), 4);
  record.append(data.data(), data.size());
  append_le(MaskCrc32c(Crc32c(data)), 4);
  return record;
}

std::string EncodeFileVersionEvent(double wall_time_sec) {
  std::string event;
  {
    StringOutputStream stream(&event);
    CodedOutputStream out(&stream);
    WriteWallTime(out, wall_time_sec);
    WriteBytesField(out, kEventFileVersion, kFileVersion);
  }
  return event;
}

std::string EncodeScalarsEvent(double wall_time_sec, int64_t step,
                               absl::Span<const TfScalar> scalars) {
  std::string summary;
  {
    StringOutputStream stream(&summary);
    CodedOutputStream out(&stream);
    for (const TfScalar& scalar : scalars) WriteBytesField(out, kSummaryValue, EncodeValue(scalar));
  }
  std::string event;
  {
    StringOutputStream stream(&event);
    CodedOutputStream out(&stream);
    WriteWallTime(out, wall_time_sec);
    out.WriteTag(Tag(kEventStep, kVarint));
    out.WriteVarint64(static_cast<uint64_t>(step));
    WriteBytesField(out, kEventSummary, summary);
  }
  return event;
}

absl::StatusOr<std::unique_ptr<TfEventsWriter>> TfEventsWriter::Create(const std::string& dir,
                                                                       Options options) {
  if (dir.empty()) return absl::InvalidArgumentError("tensorboard: empty log directory");
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) return ErrnoError(error.value(), "tensorboard: cannot create directory", dir);

  const absl::Time now = options.now == absl::InfinitePast() ? absl::Now() : options.now;
  const std::string hostname = options.hostname.empty() ? LocalHostname() : options.hostname;
  const std::string base =
      absl::StrCat((std::filesystem::path(dir) / "events.out.tfevents.").string(),
                   absl::ToUnixSeconds(now), ".", hostname);
  // O_EXCL: a writer never truncates another one's file.
  std::string path = base;
  int fd = -1;
  for (int suffix = 1; suffix <= 1000; ++suffix) {
    fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST) break;
    path = absl::StrCat(base, ".", suffix);
  }
  if (fd < 0) return ErrnoError(errno, "tensorboard: cannot create", path);
  std::FILE* file = fdopen(fd, "wb");
  if (file == nullptr) {
    const int fdopen_errno = errno;
    close(fd);
    return ErrnoError(fdopen_errno, "tensorboard: cannot open", path);
  }
  std::unique_ptr<TfEventsWriter> writer(new TfEventsWriter(std::move(path), file));
  if (absl::Status status = writer->Append(EncodeFileVersionEvent(ToUnixSecondsDouble(now)));
      !status.ok()) {
    return status;
  }
  if (absl::Status status = writer->Flush(); !status.ok()) return status;
  return writer;
}

TfEventsWriter::~TfEventsWriter() { Close().IgnoreError(); }

absl::Status TfEventsWriter::Append(absl::string_view event) {
  if (file_ == nullptr) return absl::FailedPreconditionError("tensorboard: writer is closed");
  const std::string record = FrameTfRecord(event);
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) {
    return ErrnoError(errno, "tensorboard: cannot write", path_);
  }
  return absl::OkStatus();
}

absl::Status TfEventsWriter::WriteScalars(int64_t step, absl::Span<const TfScalar> scalars,
                                          absl::Time wall_time) {
  if (scalars.empty()) return absl::InvalidArgumentError("tensorboard: no scalars to write");
  for (const TfScalar& scalar : scalars) {
    if (scalar.tag.empty()) return absl::InvalidArgumentError("tensorboard: a scalar has no tag");
  }
  if (wall_time == absl::InfinitePast()) wall_time = absl::Now();
  return Append(EncodeScalarsEvent(ToUnixSecondsDouble(wall_time), step, scalars));
}

absl::Status TfEventsWriter::Flush() {
  if (file_ == nullptr) return absl::FailedPreconditionError("tensorboard: writer is closed");
  if (std::fflush(file_) != 0) return ErrnoError(errno, "tensorboard: cannot flush", path_);
  return absl::OkStatus();
}

absl::Status TfEventsWriter::Close() {
  if (file_ == nullptr) return absl::OkStatus();
  absl::Status status = Flush();
  if (std::fclose(file_) != 0 && status.ok()) {
    status = ErrnoError(errno, "tensorboard: cannot close", path_);
  }
  file_ = nullptr;
  return status;
}

}  // namespace pstrain
