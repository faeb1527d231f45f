#include "common/data/packed_format.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/data/file_io.h"
#include "common/status_macros.h"
#include "common/storage/storage.h"

namespace pstrain::data {
namespace {

uint32_t Crc(const void* data, size_t n) {
  return static_cast<uint32_t>(crc32_z(0L, static_cast<const Bytef*>(data), n));
}

template <typename T>
void Put(std::string& out, size_t at, T value) {
  std::memcpy(out.data() + at, &value, sizeof(T));  // Little-endian hosts only.
}
template <typename T>
T Get(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

struct Header {
  uint32_t channels = 0, height = 0, width = 0, num_classes = 0, record_bytes = 0;
  uint64_t records = 0;
  uint32_t shard_index = 0, shard_count = 0;
  uint64_t first_sample = 0;
};

// The header of a shard of `records` samples of `shape`, at its place.
Header ShardHeader(const PackedSplitWriter::Shape& shape, int64_t records, int64_t index,
                   int64_t count, int64_t first_sample) {
  Header h;
  h.channels = static_cast<uint32_t>(shape.channels);
  h.height = static_cast<uint32_t>(shape.height);
  h.width = static_cast<uint32_t>(shape.width);
  h.num_classes = static_cast<uint32_t>(shape.num_classes);
  h.record_bytes = static_cast<uint32_t>(int64_t{shape.channels} * shape.height * shape.width + 8);
  h.records = static_cast<uint64_t>(records);
  h.shard_index = static_cast<uint32_t>(index);
  h.shard_count = static_cast<uint32_t>(count);
  h.first_sample = static_cast<uint64_t>(first_sample);
  return h;
}

std::string EncodeHeader(const Header& h) {
  std::string out(kPackedHeaderBytes, '\0');
  std::memcpy(out.data(), kPackedMagic, sizeof(kPackedMagic));
  Put<uint32_t>(out, 8, kPackedFormatVersion);
  Put<uint32_t>(out, 12, h.channels);
  Put<uint32_t>(out, 16, h.height);
  Put<uint32_t>(out, 20, h.width);
  Put<uint32_t>(out, 24, h.num_classes);
  Put<uint32_t>(out, 28, h.record_bytes);
  Put<uint64_t>(out, 32, h.records);
  Put<uint32_t>(out, 40, h.shard_index);
  Put<uint32_t>(out, 44, h.shard_count);
  Put<uint64_t>(out, 48, h.first_sample);
  Put<uint32_t>(out, 60, Crc(out.data(), 60));
  return out;
}

// A split's labels in one object, written after its shards, so that a
// split in a store is streamed without reading every record first
// ("train.labels"), little-endian:
//    0 char[8] "PSTRLBL1"   8 u32 version (1)   12 u32 num_classes
//   16 u64 count           24 u32 CRC-32 of the labels
//   28 u32 CRC-32 of bytes 0..27
//   32 count x i32 labels, in sample order
constexpr char kLabelsMagic[8] = {'P', 'S', 'T', 'R', 'L', 'B', 'L', '1'};
constexpr int64_t kLabelsHeaderBytes = 32;
// classes.csv: a line of at most ~300 bytes for each of up to
// kPackedMaxClasses classes.
constexpr int64_t kMaxClassesCsvBytes = int64_t{320} * kPackedMaxClasses;

std::string LabelsObjectName(const std::string& split) { return split + ".labels"; }

std::string EncodeLabels(const std::vector<int32_t>& labels, int num_classes) {
  const size_t body = labels.size() * sizeof(int32_t);
  std::string out(kLabelsHeaderBytes + body, '\0');
  std::memcpy(out.data(), kLabelsMagic, sizeof(kLabelsMagic));
  Put<uint32_t>(out, 8, 1);
  Put<uint32_t>(out, 12, static_cast<uint32_t>(num_classes));
  Put<uint64_t>(out, 16, labels.size());
  if (body > 0) std::memcpy(out.data() + kLabelsHeaderBytes, labels.data(), body);
  Put<uint32_t>(out, 24, Crc(out.data() + kLabelsHeaderBytes, body));
  Put<uint32_t>(out, 28, Crc(out.data(), 28));
  return out;
}

absl::StatusOr<std::vector<int32_t>> DecodeLabels(const std::string& uri, const std::string& bytes,
                                                  uint32_t num_classes, uint64_t expected) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  if (bytes.size() < static_cast<size_t>(kLabelsHeaderBytes) ||
      std::memcmp(p, kLabelsMagic, sizeof(kLabelsMagic)) != 0 || Get<uint32_t>(p + 8) != 1 ||
      Get<uint32_t>(p + 28) != Crc(p, 28)) {
    return absl::DataLossError(absl::StrCat(uri, ": not a pstrain labels object (bad header)"));
  }
  const uint64_t count = Get<uint64_t>(p + 16);
  if (Get<uint32_t>(p + 12) != num_classes || count != expected ||
      bytes.size() != kLabelsHeaderBytes + count * sizeof(int32_t)) {
    return absl::DataLossError(absl::StrCat(uri, ": ", count, " labels of ", Get<uint32_t>(p + 12),
                                            " classes in ", bytes.size(),
                                            " bytes; the shards hold ", expected, " samples of ",
                                            num_classes, " classes (pack it again)"));
  }
  if (Get<uint32_t>(p + 24) != Crc(p + kLabelsHeaderBytes, count * sizeof(int32_t))) {
    return absl::DataLossError(absl::StrCat(uri, ": labels checksum mismatch"));
  }
  std::vector<int32_t> labels(count);
  if (count > 0) std::memcpy(labels.data(), p + kLabelsHeaderBytes, count * sizeof(int32_t));
  for (uint64_t i = 0; i < count; ++i) {
    if (labels[i] < 0 || static_cast<uint32_t>(labels[i]) >= num_classes) {
      return absl::DataLossError(absl::StrCat(uri, ": label ", labels[i], " of sample ", i,
                                              " outside [0, ", num_classes, ")"));
    }
  }
  return labels;
}

// A shard's bytes: a read-only mapping of a local file (unmapped on
// destruction), or the bytes of an object read from a store.
class MappedFile {
 public:
  static MappedFile Own(std::string bytes) {
    MappedFile file;
    file.owned_ = std::move(bytes);
    file.data_ = reinterpret_cast<const uint8_t*>(file.owned_.data());
    file.size_ = file.owned_.size();
    return file;
  }
  static absl::StatusOr<MappedFile> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      const int e = errno;
      const std::string message = absl::StrCat(path, ": ", std::strerror(e));
      return e == ENOENT ? absl::NotFoundError(message) : absl::PermissionDeniedError(message);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::DataLossError(absl::StrCat(path, ": not a regular file"));
    }
    MappedFile file;
    file.size_ = static_cast<size_t>(st.st_size);
    if (file.size_ > 0) {
      void* p = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        return absl::InternalError(absl::StrCat(path, ": mmap: ", std::strerror(e)));
      }
      ::madvise(p, file.size_, MADV_SEQUENTIAL);
      file.data_ = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
    return file;
  }
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept
      : data_(o.data_), size_(o.size_), owned_(std::move(o.owned_)) {
    if (!owned_.empty()) data_ = reinterpret_cast<const uint8_t*>(owned_.data());
    o.data_ = nullptr;
    o.size_ = 0;
  }
  MappedFile& operator=(MappedFile&&) = delete;
  ~MappedFile() {
    if (data_ != nullptr && owned_.empty()) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool owned() const { return !owned_.empty(); }
  // Overwrites bytes of an owned copy (a record fetched again).
  void Patch(size_t offset, const std::string& bytes) {
    std::memcpy(owned_.data() + offset, bytes.data(), bytes.size());
  }
  // A mapping read through once (the checksums): its pages leave this
  // process (the page cache keeps them while memory allows) and later reads
  // come in any order.
  void ReleasePages() const {
    if (owned_.empty() && data_ != nullptr) {
      ::madvise(const_cast<uint8_t*>(data_), size_, MADV_DONTNEED);
      ::madvise(const_cast<uint8_t*>(data_), size_, MADV_RANDOM);
    }
  }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string owned_;  // Non-empty: the bytes are here, not mapped.
};

// A split's pixels where its shards are: mapped files (or objects' bytes),
// sample i in the shard whose first sample is the largest <= i.
class ShardSamples final : public SampleStore {
 public:
  ShardSamples(std::vector<MappedFile> shards, std::vector<int64_t> first, int64_t record_bytes)
      : shards_(std::move(shards)), first_(std::move(first)), record_bytes_(record_bytes) {}
  const uint8_t* image(int64_t i) const override {
    const size_t s =
        static_cast<size_t>(std::upper_bound(first_.begin(), first_.end(), i) - first_.begin()) - 1;
    return shards_[s].data() + kPackedHeaderBytes + (i - first_[s]) * record_bytes_ + 4;
  }

 private:
  const std::vector<MappedFile> shards_;
  const std::vector<int64_t> first_;  // Ascending; first_[0] == 0.
  const int64_t record_bytes_;
};

// The header at `p` of a shard of `file_size` bytes (at least the header's
// bytes are at p).
absl::StatusOr<Header> DecodeHeaderBytes(const std::string& path, const uint8_t* p,
                                         uint64_t file_size) {
  if (std::memcmp(p, kPackedMagic, sizeof(kPackedMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not a pstrain packed shard (bad magic)"));
  }
  if (Get<uint32_t>(p + 60) != Crc(p, 60)) {
    return absl::DataLossError(absl::StrCat(path, ": header checksum mismatch"));
  }
  if (const uint32_t version = Get<uint32_t>(p + 8); version != kPackedFormatVersion) {
    return absl::DataLossError(absl::StrCat(path, ": format version ", version,
                                            ", this build reads ", kPackedFormatVersion));
  }
  Header h;
  h.channels = Get<uint32_t>(p + 12);
  h.height = Get<uint32_t>(p + 16);
  h.width = Get<uint32_t>(p + 20);
  h.num_classes = Get<uint32_t>(p + 24);
  h.record_bytes = Get<uint32_t>(p + 28);
  h.records = Get<uint64_t>(p + 32);
  h.shard_index = Get<uint32_t>(p + 40);
  h.shard_count = Get<uint32_t>(p + 44);
  h.first_sample = Get<uint64_t>(p + 48);
  const uint64_t sample = uint64_t{h.channels} * h.height * h.width;  // < 2^96: checked below.
  if (h.channels == 0 || h.height == 0 || h.width == 0 || h.channels > 4096 ||
      h.height > (1u << 20) || h.width > (1u << 20) ||
      sample > static_cast<uint64_t>(kPackedMaxSampleBytes)) {
    return absl::DataLossError(absl::StrCat(path, ": image shape ", h.channels, "x", h.height, "x",
                                            h.width, " is empty or above ", kPackedMaxSampleBytes,
                                            " bytes"));
  }
  if (h.num_classes < 1 || h.num_classes > kPackedMaxClasses) {
    return absl::DataLossError(absl::StrCat(path, ": num_classes ", h.num_classes,
                                            " is outside [1, ", kPackedMaxClasses, "]"));
  }
  if (h.record_bytes != sample + 8) {
    return absl::DataLossError(absl::StrCat(path, ": record size ", h.record_bytes, " is not ",
                                            sample + 8, " for ", h.channels, "x", h.height, "x",
                                            h.width, " images"));
  }
  if (h.shard_count == 0 || h.shard_count > kPackedMaxShards || h.shard_index >= h.shard_count) {
    return absl::DataLossError(absl::StrCat(path, ": shard ", h.shard_index, " of ", h.shard_count,
                                            " is not a valid shard number"));
  }
  const uint64_t body = file_size - kPackedHeaderBytes;
  if (h.records > body / h.record_bytes || body != h.records * h.record_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", file_size, " bytes, but its header has ",
                                            h.records, " records of ", h.record_bytes,
                                            " bytes (truncated or with trailing bytes)"));
  }
  return h;
}

absl::StatusOr<Header> DecodeHeader(const std::string& path, const MappedFile& file) {
  if (file.size() < static_cast<size_t>(kPackedHeaderBytes)) {
    return absl::DataLossError(absl::StrCat(path, ": ", file.size(), " bytes, shorter than the ",
                                            kPackedHeaderBytes, "-byte header"));
  }
  return DecodeHeaderBytes(path, file.data(), file.size());
}

// The shard files of `split` in `dir`, by index (key: the full URI; size);
// NOT_FOUND when none.
absl::StatusOr<std::vector<storage::ObjectInfo>> ShardFiles(storage::Storage& store,
                                                            const std::string& dir,
                                                            const std::string& split) {
  absl::StatusOr<std::vector<storage::ObjectInfo>> entries = store.List(dir);
  if (!entries.ok()) {
    return absl::Status(entries.status().code(),
                        absl::StrCat("packed dataset ", dir, ": ", entries.status().message()));
  }
  std::map<int, storage::ObjectInfo> by_index;
  int count = -1;
  for (const storage::ObjectInfo& entry : *entries) {
    const std::string& name = entry.key;
    const std::string prefix = split + "-";
    if (name.rfind(prefix, 0) != 0 || name.size() < prefix.size() + 5 + 4 + 5 + 7 ||
        name.substr(name.size() - 7) != kPackedSuffix) {
      continue;
    }
    // split-NNNNN-of-MMMMM.pspack
    const std::string middle = name.substr(prefix.size(), name.size() - prefix.size() - 7);
    const size_t of = middle.find("-of-");
    int index = 0, total = 0;
    if (of == std::string::npos || !absl::SimpleAtoi(middle.substr(0, of), &index) ||
        !absl::SimpleAtoi(middle.substr(of + 4), &total) || total <= 0 || index < 0 ||
        index >= total || total > kPackedMaxShards) {
      continue;
    }
    if (count >= 0 && total != count) {
      return absl::DataLossError(absl::StrCat("packed dataset ", dir, ": ", split,
                                              " shards of two packings (of ", count, " and of ",
                                              total, "); pack it again"));
    }
    count = total;
    by_index[index] = {storage::JoinUri(dir, name), entry.size, entry.etag};
  }
  if (count < 0) {
    return absl::NotFoundError(absl::StrCat("packed dataset ", dir, ": no ", split, "-*-of-*",
                                            kPackedSuffix, " files (made by `pstrain prepare`)"));
  }
  std::vector<storage::ObjectInfo> files;
  for (int i = 0; i < count; ++i) {
    auto found = by_index.find(i);
    if (found == by_index.end()) {
      return absl::NotFoundError(absl::StrCat("packed dataset ", dir, ": ",
                                              PackedShardName(split, i, count), " is missing"));
    }
    files.push_back(found->second);
  }
  return files;
}

}  // namespace

std::string PackedShardName(const std::string& split, int index, int count) {
  return absl::StrFormat("%s-%05d-of-%05d%s", split, index, count, kPackedSuffix);
}

namespace {

// Removes the shards of an older packing of `split` in `dir` whose count is
// not `shards` (they would mix with the new ones), and the split's labels.
absl::Status RemoveOtherPackings(storage::Storage& store, const std::string& dir,
                                 const std::string& split, int64_t shards) {
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<storage::ObjectInfo> entries, store.List(dir));
  for (const storage::ObjectInfo& entry : entries) {
    const std::string& name = entry.key;
    // The labels object is written after the shards: until then a reader
    // finds none and checks every record. (Only what is there is deleted:
    // a writer may be allowed to put objects and not to delete them.)
    if ((name.rfind(split + "-", 0) == 0 && name.size() > 7 &&
         name.substr(name.size() - 7) == kPackedSuffix &&
         name.find(absl::StrFormat("-of-%05d", shards)) == std::string::npos) ||
        name == LabelsObjectName(split)) {
      PSTRAIN_RETURN_IF_ERROR(store.Delete(storage::JoinUri(dir, name)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---- PackedSplitWriter -------------------------------------------------------------

absl::StatusOr<std::unique_ptr<PackedSplitWriter>> PackedSplitWriter::Create(
    storage::Storage& store, const std::string& dir, const std::string& split,
    const Shape& shape, int64_t expected_samples, const PackOptions& options) {
  const int64_t sample = int64_t{shape.channels} * shape.height * shape.width;
  if (shape.channels <= 0 || shape.height <= 0 || shape.width <= 0 || shape.num_classes < 1 ||
      sample > kPackedMaxSampleBytes || shape.num_classes > kPackedMaxClasses ||
      expected_samples < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        split, ": cannot pack ", shape.channels, "x", shape.height, "x", shape.width, " images of ",
        shape.num_classes, " classes (", expected_samples, " samples)"));
  }
  const int64_t record = sample + 8;
  const int64_t per_shard = options.records_per_shard > 0
                                ? options.records_per_shard
                                : std::max<int64_t>(1, (int64_t{256} << 20) / record);
  const int64_t shards = std::max<int64_t>(1, (expected_samples + per_shard - 1) / per_shard);
  if (shards > kPackedMaxShards) {
    return absl::InvalidArgumentError(
        absl::StrCat(split, ": ", shards, " shards is above ", kPackedMaxShards));
  }
  if (!storage::IsS3Uri(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return absl::PermissionDeniedError(absl::StrCat(dir, ": ", ec.message()));
  }
  PSTRAIN_RETURN_IF_ERROR(RemoveOtherPackings(store, dir, split, shards));
  return std::unique_ptr<PackedSplitWriter>(
      new PackedSplitWriter(store, dir, split, shape, per_shard, shards));
}

PackedSplitWriter::PackedSplitWriter(storage::Storage& store, std::string dir, std::string split,
                                     Shape shape, int64_t per_shard, int64_t shards)
    : store_(store),
      dir_(std::move(dir)),
      split_(std::move(split)),
      shape_(shape),
      per_shard_(per_shard),
      shards_(shards),
      record_bytes_(int64_t{shape.channels} * shape.height * shape.width + 8),
      buffer_(kPackedHeaderBytes, '\0') {
  // One shard's bytes, once: growing by doubling would hold up to twice that.
  buffer_.reserve(static_cast<size_t>(kPackedHeaderBytes + per_shard_ * record_bytes_));
}

absl::Status PackedSplitWriter::Append(int32_t label, const uint8_t* pixels) {
  if (label < 0 || label >= shape_.num_classes) {
    return absl::InvalidArgumentError(absl::StrCat(split_, ": label ", label, " outside [0, ",
                                                   shape_.num_classes, ")"));
  }
  if (in_buffer_ == per_shard_) PSTRAIN_RETURN_IF_ERROR(Flush());
  if (shard_ >= shards_) {
    return absl::InvalidArgumentError(
        absl::StrCat(split_, ": more samples than the ", shards_ * per_shard_, " expected"));
  }
  const int64_t sample = record_bytes_ - 8;
  const size_t at = buffer_.size();
  buffer_.resize(at + record_bytes_);
  Put<int32_t>(buffer_, at, label);
  std::memcpy(buffer_.data() + at + 4, pixels, sample);
  Put<uint32_t>(buffer_, at + 4 + sample, Crc(buffer_.data() + at, 4 + sample));
  ++in_buffer_;
  ++samples_;
  labels_.push_back(label);
  return absl::OkStatus();
}

absl::Status PackedSplitWriter::Flush() {
  const std::string header =
      EncodeHeader(ShardHeader(shape_, in_buffer_, shard_, shards_, samples_ - in_buffer_));
  std::memcpy(buffer_.data(), header.data(), header.size());
  PSTRAIN_RETURN_IF_ERROR(store_.Write(
      storage::JoinUri(dir_, PackedShardName(split_, static_cast<int>(shard_),
                                             static_cast<int>(shards_))),
      buffer_));
  bytes_ += static_cast<int64_t>(buffer_.size());
  buffer_.resize(kPackedHeaderBytes);  // Keeps the capacity.
  in_buffer_ = 0;
  ++shard_;
  return absl::OkStatus();
}

absl::Status WritePackedShard(storage::Storage& store, const std::string& dir,
                              const std::string& split, const PackedSplitWriter::Shape& shape,
                              const ShardPlace& place, absl::Span<const int32_t> labels,
                              absl::Span<const uint8_t> pixels) {
  if (shape.channels <= 0 || shape.height <= 0 || shape.width <= 0 ||
      int64_t{shape.channels} * shape.height * shape.width > kPackedMaxSampleBytes ||
      shape.num_classes <= 0 || shape.num_classes > kPackedMaxClasses) {
    return absl::InvalidArgumentError(
        absl::StrCat(split, ": a sample of ", shape.channels, "x", shape.height, "x", shape.width,
                     " in ", shape.num_classes, " classes is outside what a packed shard holds"));
  }
  if (place.count <= 0 || place.count > kPackedMaxShards || place.index < 0 ||
      place.index >= place.count || place.first_sample < 0) {
    return absl::InvalidArgumentError(absl::StrCat(split, ": shard ", place.index, " of ",
                                                   place.count, " from sample ", place.first_sample,
                                                   " is not a shard's place"));
  }
  const int64_t sample = int64_t{shape.channels} * shape.height * shape.width;
  if (static_cast<int64_t>(pixels.size()) != static_cast<int64_t>(labels.size()) * sample) {
    return absl::InvalidArgumentError(absl::StrCat(split, ": ", labels.size(), " labels need ",
                                                   labels.size() * sample, " pixel bytes, got ",
                                                   pixels.size()));
  }
  const int64_t record_bytes = sample + 8;
  std::string bytes(static_cast<size_t>(kPackedHeaderBytes + record_bytes * labels.size()), '\0');
  for (size_t r = 0; r < labels.size(); ++r) {
    if (labels[r] < 0 || labels[r] >= shape.num_classes) {
      return absl::InvalidArgumentError(absl::StrCat(split, ": sample ", place.first_sample + r,
                                                     ": label ", labels[r], " outside [0, ",
                                                     shape.num_classes, ")"));
    }
    const size_t at = static_cast<size_t>(kPackedHeaderBytes + record_bytes * r);
    Put<int32_t>(bytes, at, labels[r]);
    std::memcpy(bytes.data() + at + 4, pixels.data() + r * sample, static_cast<size_t>(sample));
    Put<uint32_t>(bytes, at + 4 + sample, Crc(bytes.data() + at, 4 + sample));
  }
  const std::string header = EncodeHeader(ShardHeader(
      shape, static_cast<int64_t>(labels.size()), place.index, place.count, place.first_sample));
  std::memcpy(bytes.data(), header.data(), header.size());
  return store.Write(storage::JoinUri(dir, PackedShardName(split, place.index, place.count)),
                     bytes);
}

absl::Status WritePackedLabels(storage::Storage& store, const std::string& dir,
                               const std::string& split, const std::vector<int32_t>& labels,
                               int num_classes) {
  if (num_classes <= 0 || num_classes > kPackedMaxClasses) {
    return absl::InvalidArgumentError(
        absl::StrCat(split, ": ", num_classes, " classes is outside what a packing holds"));
  }
  for (size_t i = 0; i < labels.size(); ++i) {
    if (labels[i] < 0 || labels[i] >= num_classes) {
      return absl::InvalidArgumentError(absl::StrCat(split, ": sample ", i, ": label ", labels[i],
                                                     " outside [0, ", num_classes, ")"));
    }
  }
  return store.Write(storage::JoinUri(dir, LabelsObjectName(split)),
                     EncodeLabels(labels, num_classes));
}

absl::StatusOr<PackSummary> PackedSplitWriter::Finish() {
  while (shard_ < shards_) PSTRAIN_RETURN_IF_ERROR(Flush());
  const std::string labels = EncodeLabels(labels_, shape_.num_classes);
  PSTRAIN_RETURN_IF_ERROR(store_.Write(storage::JoinUri(dir_, LabelsObjectName(split_)), labels));
  bytes_ += static_cast<int64_t>(labels.size());
  PackSummary summary;
  summary.train_samples = samples_;
  summary.train_shards = static_cast<int>(shards_);
  summary.bytes = bytes_;
  return summary;
}

absl::StatusOr<PackSummary> WritePackedDataset(const DatasetSplits& splits, const std::string& dir,
                                               const PackOptions& options) {
  std::unique_ptr<storage::Storage> local = storage::NewLocalStorage();
  return WritePackedDataset(splits, dir, options, *local);
}

absl::StatusOr<PackSummary> WritePackedDataset(const DatasetSplits& splits, const std::string& dir,
                                               const PackOptions& options,
                                               storage::Storage& store) {
  if (!storage::IsS3Uri(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return absl::PermissionDeniedError(absl::StrCat(dir, ": ", ec.message()));
  }
  PackSummary summary;
  for (const auto& [split, ds] :
       {std::pair<std::string, const ImageDataset*>{"train", &splits.train},
        std::pair<std::string, const ImageDataset*>{"test", &splits.test}}) {
    PSTRAIN_RETURN_IF_ERROR(ds->Validate(absl::StrCat(split, " split")));
    const int64_t sample = ds->sample_elements();
    if (sample > kPackedMaxSampleBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(split, " images of ", sample, " bytes are above ", kPackedMaxSampleBytes));
    }
    const int64_t record = sample + 8;
    int64_t per_shard = options.records_per_shard > 0
                            ? options.records_per_shard
                            : std::max<int64_t>(1, (int64_t{256} << 20) / record);
    const int64_t n = ds->size();
    const int64_t shards = std::max<int64_t>(1, (n + per_shard - 1) / per_shard);
    if (shards > kPackedMaxShards) {
      return absl::InvalidArgumentError(
          absl::StrCat(split, ": ", shards, " shards is above ", kPackedMaxShards));
    }
    PSTRAIN_RETURN_IF_ERROR(RemoveOtherPackings(store, dir, split, shards));
    for (int64_t s = 0; s < shards; ++s) {
      const int64_t first = s * per_shard;
      const int64_t count = std::min(per_shard, n - first);
      Header h;
      h.channels = ds->channels;
      h.height = ds->height;
      h.width = ds->width;
      h.num_classes = ds->num_classes;
      h.record_bytes = static_cast<uint32_t>(record);
      h.records = static_cast<uint64_t>(std::max<int64_t>(0, count));
      h.shard_index = static_cast<uint32_t>(s);
      h.shard_count = static_cast<uint32_t>(shards);
      h.first_sample = static_cast<uint64_t>(first);
      std::string bytes = EncodeHeader(h);
      bytes.resize(kPackedHeaderBytes + h.records * record);
      std::vector<int64_t> samples(static_cast<size_t>(std::max<int64_t>(0, count)));
      for (int64_t r = 0; r < count; ++r) samples[r] = first + r;
      // A source streamed from a store is fetched here (and its errors end
      // the packing); one in memory leases nothing.
      PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<const void> lease,
                               ds->Acquire(samples.data(), samples.size()));
      for (int64_t r = 0; r < count; ++r) {
        const size_t at = kPackedHeaderBytes + r * record;
        Put<int32_t>(bytes, at, ds->labels[first + r]);
        std::memcpy(bytes.data() + at + 4, ds->image(first + r), sample);
        Put<uint32_t>(bytes, at + 4 + sample, Crc(bytes.data() + at, 4 + sample));
      }
      const std::string path = storage::JoinUri(dir, PackedShardName(split, s, shards));
      PSTRAIN_RETURN_IF_ERROR(store.Write(path, bytes));
      summary.bytes += static_cast<int64_t>(bytes.size());
    }
    const std::string labels = EncodeLabels(ds->labels, ds->num_classes);
    PSTRAIN_RETURN_IF_ERROR(store.Write(storage::JoinUri(dir, LabelsObjectName(split)), labels));
    summary.bytes += static_cast<int64_t>(labels.size());
    (split == "train" ? summary.train_samples : summary.test_samples) = n;
    (split == "train" ? summary.train_shards : summary.test_shards) = static_cast<int>(shards);
  }
  return summary;
}

namespace {

// Reads of a shard (or of one record) from a store before a checksum
// failure is final.
constexpr int kStoreShardReads = 3;

// A shard's bytes: mapped when local; read whole from a store otherwise.
absl::StatusOr<MappedFile> OpenShard(storage::Storage& store, const std::string& uri) {
  if (!storage::IsS3Uri(uri)) return MappedFile::Open(uri);
  PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, store.Read(uri));
  return MappedFile::Own(std::move(bytes));
}

// Appends shard `f` of `shard_count` to `ds` (its header checked against the
// split's first and against `next_sample`), every record's checksum and label
// checked. On error `ds` may hold part of the shard.
//
// `refetch`, when set, reads bytes [offset, offset + length) of the shard
// again: a record whose checksum fails is fetched again (up to
// kStoreShardReads times) before its DATA_LOSS is final.
using Refetch = std::function<absl::StatusOr<std::string>(int64_t offset, int64_t length)>;
// Checks header `h` of shard `f` of `shard_count` against the split's first
// shard (which sets ds's shape) and against `next_sample`.
absl::Status CheckShardHeader(const std::string& path, const Header& h, size_t f,
                              size_t shard_count, uint64_t next_sample, ImageDataset& ds) {
  if (h.shard_index != f || h.shard_count != shard_count) {
    return absl::DataLossError(
        absl::StrCat(path, ": its header says shard ", h.shard_index, " of ", h.shard_count));
  }
  if (f == 0) {
    ds.channels = static_cast<int>(h.channels);
    ds.height = static_cast<int>(h.height);
    ds.width = static_cast<int>(h.width);
    ds.num_classes = static_cast<int>(h.num_classes);
  } else if (static_cast<int>(h.channels) != ds.channels ||
             static_cast<int>(h.height) != ds.height || static_cast<int>(h.width) != ds.width ||
             static_cast<int>(h.num_classes) != ds.num_classes) {
    return absl::DataLossError(absl::StrCat(path, ": ", h.channels, "x", h.height, "x", h.width,
                                            " images of ", h.num_classes,
                                            " classes, unlike the split's first shard"));
  }
  if (h.first_sample != next_sample) {
    return absl::DataLossError(absl::StrCat(path, ": starts at sample ", h.first_sample,
                                            ", the shards before it end at ", next_sample));
  }
  return absl::OkStatus();
}

absl::Status AppendShard(const std::string& path, MappedFile& file, size_t f, size_t shard_count,
                         uint64_t next_sample, ImageDataset& ds, const Refetch& refetch) {
  PSTRAIN_ASSIGN_OR_RETURN(Header h, DecodeHeader(path, file));
  PSTRAIN_RETURN_IF_ERROR(CheckShardHeader(path, h, f, shard_count, next_sample, ds));
  const size_t sample = ds.sample_elements();
  ds.labels.reserve(ds.labels.size() + h.records);
  const uint8_t* p = file.data() + kPackedHeaderBytes;
  std::string again;  // A record fetched again after its checksum failed.
  for (uint64_t r = 0; r < h.records; ++r, p += h.record_bytes) {
    const uint8_t* record = p;
    for (int read = 1; Get<uint32_t>(record + 4 + sample) != Crc(record, 4 + sample); ++read) {
      if (!refetch || read == kStoreShardReads) {
        return absl::DataLossError(absl::StrCat(path, ": record ", r, " (sample ",
                                                h.first_sample + r, "): checksum mismatch"));
      }
      PSTRAIN_ASSIGN_OR_RETURN(again, refetch(kPackedHeaderBytes + r * h.record_bytes,
                                              h.record_bytes));
      if (again.size() != h.record_bytes) {
        return absl::DataLossError(absl::StrCat(path, ": record ", r, " read again is ",
                                                again.size(), " bytes"));
      }
      record = reinterpret_cast<const uint8_t*>(again.data());
    }
    if (record != p) file.Patch(static_cast<size_t>(p - file.data()), again);  // Owned bytes.
    const int32_t label = Get<int32_t>(record);
    if (label < 0 || static_cast<uint32_t>(label) >= h.num_classes) {
      return absl::DataLossError(absl::StrCat(path, ": record ", r, " (sample ",
                                              h.first_sample + r, "): label ", label,
                                              " outside [0, ", h.num_classes, ")"));
    }
    ds.labels.push_back(label);
  }
  return absl::OkStatus();
}

// ---- Streaming a split from a store -----------------------------------------

// Records read together: about this many bytes of one shard (one ranged
// GET; the S3 client's range size: a store's cost per request is then a
// small part of each read).
constexpr int64_t kStreamChunkBytes = int64_t{8} << 20;
// Ranged reads in flight ahead of the trainer.
constexpr int kReadAheadThreads = 4;

struct StreamShard {
  std::string uri;
  std::string etag;   // The version listed at open; every read is held to it.
  int64_t first = 0;  // The split's index of its first record.
  int64_t records = 0;
};

// A split's pixels in a store, fetched in chunks (consecutive records of one
// shard) as Acquire and the plan need them, every record's checksum and
// label checked as it arrives. What is held: the chunks planned ahead up to
// `budget_` bytes, plus the chunks a lease or the rest of the plan still
// needs; a chunk that neither needs goes first (least recently used).
class StreamedShards final : public SampleStore {
 public:
  StreamedShards(storage::Storage& store, std::vector<StreamShard> shards, int64_t record_bytes,
                 std::vector<int32_t> labels, int64_t window_bytes)
      : store_(store),
        shards_(std::move(shards)),
        record_bytes_(record_bytes),
        labels_(std::move(labels)) {
    const int64_t chunk_records = std::max<int64_t>(1, kStreamChunkBytes / record_bytes_);
    for (size_t s = 0; s < shards_.size(); ++s) {
      for (int64_t r = 0; r < shards_[s].records; r += chunk_records) {
        chunks_.starts.push_back(shards_[s].first + r);
        chunk_shard_.push_back(s);
        chunk_record_.push_back(r);
        chunk_records_.push_back(std::min(chunk_records, shards_[s].records - r));
      }
    }
    const int64_t chunk_bytes = chunk_records * record_bytes_;
    chunks_.window_chunks = std::max<int64_t>(1, window_bytes / chunk_bytes);
    budget_ = (2 * chunks_.window_chunks + 2 * kReadAheadThreads) * chunk_bytes;
    const size_t n = chunks_.starts.size();
    resident_.resize(n);
    failed_.assign(n, absl::OkStatus());
    fetch_started_.assign(n, absl::InfinitePast());
    fetching_.assign(n, 0);
    uses_.assign(n, 0);
    last_used_.assign(n, 0);
  }

  ~StreamedShards() override {
    {
      absl::MutexLock lock(&mu_);
      shutdown_ = true;
      cv_.SignalAll();
    }
    for (std::thread& t : threads_) t.join();
  }

  const uint8_t* image(int64_t i) const override {
    const size_t c = ChunkOf(i);
    std::shared_ptr<const std::string> bytes;
    {
      absl::MutexLock lock(&mu_);
      bytes = resident_[c];
    }
    if (bytes == nullptr) {
      // Every reader takes a lease first (AssembleBatch's caller,
      // CopyPixels, the packer): this is a bug, not a bad input.
      std::fprintf(stderr, "internal error: sample %lld of %s read outside a lease\n",
                   static_cast<long long>(i), shards_[chunk_shard_[c]].uri.c_str());
      std::abort();
    }
    return reinterpret_cast<const uint8_t*>(bytes->data()) +
           (i - chunks_.starts[c]) * record_bytes_ + 4;
  }

  const Chunks* chunks() const override { return &chunks_; }

  std::string Pending() const override {
    absl::MutexLock lock(&mu_);
    size_t oldest = fetching_.size();
    for (size_t c = 0; c < fetching_.size(); ++c) {
      if (fetching_[c] &&
          (oldest == fetching_.size() || fetch_started_[c] < fetch_started_[oldest])) {
        oldest = c;
      }
    }
    if (oldest == fetching_.size()) return "";
    const int64_t offset = kPackedHeaderBytes + chunk_record_[oldest] * record_bytes_;
    return absl::StrFormat("reading %s bytes %d-%d from its store for %.0f s",
                           shards_[chunk_shard_[oldest]].uri, offset,
                           offset + ChunkBytes(oldest) - 1,
                           absl::ToDoubleSeconds(absl::Now() - fetch_started_[oldest]));
  }

  void Plan(const std::vector<int64_t>& samples) const override {
    absl::MutexLock lock(&mu_);
    std::fill(uses_.begin(), uses_.end(), 0);
    std::fill(failed_.begin(), failed_.end(), absl::OkStatus());  // A new plan tries again.
    plan_.clear();
    next_planned_ = 0;
    for (int64_t i : samples) {
      if (i < 0 || i >= static_cast<int64_t>(labels_.size())) continue;
      const size_t c = ChunkOf(i);
      if (uses_[c]++ == 0) plan_.push_back(c);
    }
    while (threads_.size() < kReadAheadThreads) threads_.emplace_back([this] { ReadAhead(); });
    cv_.SignalAll();
  }

  absl::StatusOr<std::shared_ptr<const void>> Acquire(const int64_t* samples,
                                                      size_t count) const override {
    std::vector<size_t> wanted;
    wanted.reserve(count);
    for (size_t k = 0; k < count; ++k) {
      if (samples[k] < 0 || samples[k] >= static_cast<int64_t>(labels_.size())) {
        return absl::OutOfRangeError(absl::StrCat("sample ", samples[k], " is outside the ",
                                                  labels_.size(), " of the split"));
      }
      wanted.push_back(ChunkOf(samples[k]));
    }
    auto lease = std::make_shared<std::vector<std::shared_ptr<const std::string>>>();
    std::vector<size_t> distinct = wanted;
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    for (size_t c : distinct) {
      PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<const std::string> bytes, Resident(c));
      lease->push_back(std::move(bytes));
    }
    absl::MutexLock lock(&mu_);
    ++tick_;
    for (size_t c : wanted) {
      if (uses_[c] > 0) --uses_[c];
      last_used_[c] = tick_;
    }
    EvictLocked();
    cv_.SignalAll();  // Room for the read-ahead.
    return std::shared_ptr<const void>(std::move(lease));
  }

 private:
  size_t ChunkOf(int64_t i) const {
    return static_cast<size_t>(std::upper_bound(chunks_.starts.begin(), chunks_.starts.end(), i) -
                               chunks_.starts.begin()) -
           1;
  }
  int64_t ChunkBytes(size_t c) const { return chunk_records_[c] * record_bytes_; }

  // Chunk c, fetched now unless it is here or on its way.
  absl::StatusOr<std::shared_ptr<const std::string>> Resident(size_t c) const {
    {
      absl::MutexLock lock(&mu_);
      while (fetching_[c]) cv_.Wait(&mu_);  // Bounded by that fetch's deadlines.
      if (resident_[c] != nullptr) return resident_[c];
      // A fetch of this plan failed with the store's retries spent: its
      // error, not another round of them.
      if (!failed_[c].ok()) return failed_[c];
      fetching_[c] = 1;
      fetch_started_[c] = absl::Now();
      inflight_bytes_ += ChunkBytes(c);
    }
    absl::StatusOr<std::string> bytes = Fetch(c);
    absl::MutexLock lock(&mu_);
    return Arrived(c, std::move(bytes));
  }

  // Records a fetch of chunk c that ended (under mu_).
  absl::StatusOr<std::shared_ptr<const std::string>> Arrived(
      size_t c, absl::StatusOr<std::string> bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    fetching_[c] = 0;
    inflight_bytes_ -= ChunkBytes(c);
    cv_.SignalAll();
    if (!bytes.ok()) {
      failed_[c] = bytes.status();
      return bytes.status();
    }
    auto shared = std::make_shared<const std::string>(*std::move(bytes));
    resident_[c] = shared;
    resident_bytes_ += ChunkBytes(c);
    last_used_[c] = ++tick_;
    return shared;
  }

  // Drops chunks nobody needs (no lease, no use left in the plan), least
  // recently used first, while over the budget.
  void EvictLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (resident_bytes_ + inflight_bytes_ > budget_) {
      size_t victim = resident_.size();
      for (size_t c = 0; c < resident_.size(); ++c) {
        if (resident_[c] != nullptr && uses_[c] == 0 && resident_[c].use_count() == 1 &&
            (victim == resident_.size() || last_used_[c] < last_used_[victim])) {
          victim = c;
        }
      }
      if (victim == resident_.size()) return;
      resident_[victim].reset();
      resident_bytes_ -= ChunkBytes(victim);
    }
  }

  // A read-ahead thread: the plan's chunks in order of first use, while the
  // bytes held stay within the budget. A failed fetch is left for Acquire,
  // which fetches again and returns the error.
  void ReadAhead() const {
    for (;;) {
      size_t c = 0;
      {
        absl::MutexLock lock(&mu_);
        for (;;) {
          if (shutdown_) return;
          if (next_planned_ < plan_.size()) {
            EvictLocked();
            if (resident_bytes_ + inflight_bytes_ + ChunkBytes(plan_[next_planned_]) <= budget_) {
              break;
            }
          }
          cv_.Wait(&mu_);
        }
        c = plan_[next_planned_++];
        if (fetching_[c] || resident_[c] != nullptr || uses_[c] == 0 || !failed_[c].ok()) {
          continue;
        }
        fetching_[c] = 1;
        fetch_started_[c] = absl::Now();
        inflight_bytes_ += ChunkBytes(c);
      }
      absl::StatusOr<std::string> bytes = Fetch(c);
      absl::MutexLock lock(&mu_);
      Arrived(c, std::move(bytes)).IgnoreError();
    }
  }

  // Chunk c's records from the store, each checked: a record whose CRC-32
  // fails is read again (up to kStoreShardReads reads); its label must be
  // the labels object's.
  absl::StatusOr<std::string> Fetch(size_t c) const {
    const StreamShard& shard = shards_[chunk_shard_[c]];
    const int64_t offset = kPackedHeaderBytes + chunk_record_[c] * record_bytes_;
    const int64_t length = ChunkBytes(c);
    PSTRAIN_ASSIGN_OR_RETURN(std::string bytes,
                             store_.ReadRangeOfVersion(shard.uri, offset, length, shard.etag));
    if (static_cast<int64_t>(bytes.size()) != length) {
      return absl::DataLossError(absl::StrCat(shard.uri, ": ", bytes.size(), " bytes at ", offset,
                                              ", ", length, " asked for"));
    }
    const int64_t sample = record_bytes_ - 8;
    for (int64_t k = 0; k < chunk_records_[c]; ++k) {
      auto* record = reinterpret_cast<uint8_t*>(bytes.data()) + k * record_bytes_;
      const int64_t r = chunk_record_[c] + k;
      for (int read = 1; Get<uint32_t>(record + 4 + sample) != Crc(record, 4 + sample); ++read) {
        if (read == kStoreShardReads) {
          return absl::DataLossError(absl::StrCat(shard.uri, ": record ", r, " (sample ",
                                                  shard.first + r, "): checksum mismatch"));
        }
        PSTRAIN_ASSIGN_OR_RETURN(
            std::string again,
            store_.ReadRangeOfVersion(shard.uri, kPackedHeaderBytes + r * record_bytes_,
                                      record_bytes_, shard.etag));
        if (static_cast<int64_t>(again.size()) != record_bytes_) {
          return absl::DataLossError(
              absl::StrCat(shard.uri, ": record ", r, " read again is ", again.size(), " bytes"));
        }
        std::memcpy(record, again.data(), again.size());
      }
      const int32_t label = Get<int32_t>(record);
      if (label != labels_[static_cast<size_t>(shard.first + r)]) {
        return absl::DataLossError(absl::StrCat(
            shard.uri, ": record ", r, " (sample ", shard.first + r, ") has label ", label,
            ", the split's labels object ", labels_[static_cast<size_t>(shard.first + r)],
            " (objects of two packings; pack it again)"));
      }
    }
    return bytes;
  }

  storage::Storage& store_;
  const std::vector<StreamShard> shards_;
  const int64_t record_bytes_;
  const std::vector<int32_t> labels_;
  // Chunk c: records [chunk_record_[c], + chunk_records_[c]) of shard
  // chunk_shard_[c], samples from chunks_.starts[c]. Constant.
  Chunks chunks_;
  std::vector<size_t> chunk_shard_;
  std::vector<int64_t> chunk_record_, chunk_records_;
  int64_t budget_ = 0;

  mutable absl::Mutex mu_;
  mutable absl::CondVar cv_;
  mutable std::vector<std::shared_ptr<const std::string>> resident_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<char> fetching_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<absl::Time> fetch_started_ ABSL_GUARDED_BY(mu_);
  // A fetch of the current plan that failed after the store's retries.
  mutable std::vector<absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  mutable std::vector<int64_t> uses_ ABSL_GUARDED_BY(mu_);  // Left in the plan.
  mutable std::vector<uint64_t> last_used_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  mutable int64_t resident_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  mutable int64_t inflight_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  mutable std::vector<size_t> plan_ ABSL_GUARDED_BY(mu_);  // Chunks by first use.
  mutable size_t next_planned_ ABSL_GUARDED_BY(mu_) = 0;
  mutable bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  mutable std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

// The split streamed: the shards' headers (a 64-byte read each, checked as
// a whole read checks them) and the labels object; no record is read yet.
// NOT_FOUND when the packing has no labels object.
absl::StatusOr<ImageDataset> OpenStreamedSplit(const std::string& dir, const std::string& split,
                                               const std::vector<storage::ObjectInfo>& files,
                                               storage::Storage& store,
                                               const PackedReadOptions& options) {
  const std::string labels_uri = storage::JoinUri(dir, LabelsObjectName(split));
  ImageDataset ds;
  std::vector<StreamShard> shards;
  uint64_t next_sample = 0;
  for (size_t f = 0; f < files.size(); ++f) {
    const std::string& uri = files[f].key;
    absl::StatusOr<Header> h;
    for (int read = 1; read <= kStoreShardReads; ++read) {
      if (files[f].size < kPackedHeaderBytes) {
        return absl::DataLossError(absl::StrCat(uri, ": ", files[f].size,
                                                " bytes, shorter than the ", kPackedHeaderBytes,
                                                "-byte header"));
      }
      PSTRAIN_ASSIGN_OR_RETURN(std::string header,
                               store.ReadRangeOfVersion(uri, 0, kPackedHeaderBytes, files[f].etag));
      if (header.size() != static_cast<size_t>(kPackedHeaderBytes)) {
        return absl::DataLossError(absl::StrCat(uri, ": short header read"));
      }
      h = DecodeHeaderBytes(uri, reinterpret_cast<const uint8_t*>(header.data()),
                            static_cast<uint64_t>(files[f].size));
      if (!absl::IsDataLoss(h.status())) break;
    }
    PSTRAIN_RETURN_IF_ERROR(h.status());
    PSTRAIN_RETURN_IF_ERROR(CheckShardHeader(uri, *h, f, files.size(), next_sample, ds));
    shards.push_back(
        {uri, files[f].etag, static_cast<int64_t>(next_sample), static_cast<int64_t>(h->records)});
    next_sample += h->records;
  }
  // The labels of exactly the samples the shards hold, and no more bytes
  // (NOT_FOUND for a packing without them: the caller reads it whole).
  PSTRAIN_ASSIGN_OR_RETURN(
      std::string labels_bytes,
      storage::ReadAtMost(store, labels_uri,
                          kLabelsHeaderBytes + static_cast<int64_t>(next_sample) * 4));
  PSTRAIN_ASSIGN_OR_RETURN(
      std::vector<int32_t> labels,
      DecodeLabels(labels_uri, labels_bytes, static_cast<uint32_t>(ds.num_classes), next_sample));
  ds.labels = labels;
  ds.store = std::make_shared<StreamedShards>(store, std::move(shards), ds.sample_elements() + 8,
                                              std::move(labels), options.window_bytes);
  return ds;
}

}  // namespace

absl::StatusOr<ImageDataset> LoadPackedSplit(const std::string& dir, const std::string& split) {
  std::unique_ptr<storage::Storage> local = storage::NewLocalStorage();
  return LoadPackedSplit(dir, split, *local);
}

absl::StatusOr<ImageDataset> LoadPackedSplit(const std::string& dir, const std::string& split,
                                             storage::Storage& store) {
  return LoadPackedSplit(dir, split, store, PackedReadOptions{});
}

absl::StatusOr<ImageDataset> LoadPackedSplit(const std::string& dir, const std::string& split,
                                             storage::Storage& store,
                                             const PackedReadOptions& options) {
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<storage::ObjectInfo> files, ShardFiles(store, dir, split));
  if (options.stream) {
    absl::StatusOr<ImageDataset> streamed = OpenStreamedSplit(dir, split, files, store, options);
    // A packing without a labels object (cut short, or older) is read whole.
    if (!absl::IsNotFound(streamed.status())) return streamed;
  }
  ImageDataset ds;
  uint64_t next_sample = 0;
  std::vector<MappedFile> shards;
  std::vector<int64_t> first;
  for (size_t f = 0; f < files.size(); ++f) {
    const std::string& path = files[f].key;
    const size_t labels_before = ds.labels.size();
    // Bytes from a store can be damaged on the way: a record that fails its
    // checksum is fetched again, and a shard whose header fails is read
    // again whole (every record is checked, so no damaged byte reaches
    // training). A local file is what it is.
    const bool remote = storage::IsS3Uri(path);
    Refetch refetch;
    if (remote) {
      refetch = [&store, &path](int64_t offset, int64_t length) {
        return store.ReadRange(path, offset, length);
      };
    }
    absl::Status status;
    for (int read = 1; read <= (remote ? kStoreShardReads : 1); ++read) {
      ds.labels.resize(labels_before);
      PSTRAIN_ASSIGN_OR_RETURN(MappedFile file, OpenShard(store, path));
      status = AppendShard(path, file, f, files.size(), next_sample, ds, refetch);
      if (status.ok()) {
        file.ReleasePages();
        first.push_back(static_cast<int64_t>(next_sample));
        shards.push_back(std::move(file));
      }
      if (!absl::IsDataLoss(status)) break;
    }
    PSTRAIN_RETURN_IF_ERROR(status);
    next_sample += ds.labels.size() - labels_before;
  }
  // The pixels stay where they are: mapped (the kernel pages them in and
  // out, so a split larger than memory trains) or, from a store, the
  // objects' bytes as read.
  ds.store = std::make_shared<ShardSamples>(std::move(shards), std::move(first),
                                            int64_t{ds.sample_elements()} + 8);
  return ds;
}

absl::StatusOr<DatasetSplits> LoadPackedDataset(const std::string& dir) {
  std::unique_ptr<storage::Storage> local = storage::NewLocalStorage();
  return LoadPackedDataset(dir, *local);
}

absl::StatusOr<DatasetSplits> LoadPackedDataset(const std::string& dir, storage::Storage& store) {
  return LoadPackedDataset(dir, store, PackedReadOptions{});
}

absl::StatusOr<DatasetSplits> LoadPackedDataset(const std::string& dir, storage::Storage& store,
                                                const PackedReadOptions& options) {
  DatasetSplits splits;
  PSTRAIN_ASSIGN_OR_RETURN(splits.train, LoadPackedSplit(dir, "train", store, options));
  PSTRAIN_ASSIGN_OR_RETURN(splits.test, LoadPackedSplit(dir, "test", store, options));
  // classes.csv ("class,category_id,name"), when the packing wrote one.
  absl::StatusOr<std::string> classes =
      storage::ReadAtMost(store, storage::JoinUri(dir, "classes.csv"), kMaxClassesCsvBytes);
  if (absl::IsNotFound(classes.status())) return splits;
  if (!classes.ok()) return classes.status();
  std::vector<std::string> names;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*classes, '\n', absl::SkipEmpty())) {
    if (++line_number == 1) continue;  // The header.
    std::optional<std::vector<std::string>> fields = SplitCsvLine(line);
    int c = -1;
    if (!fields.has_value() || fields->size() != 3 || !absl::SimpleAtoi((*fields)[0], &c) ||
        c != static_cast<int>(names.size())) {
      return absl::DataLossError(absl::StrCat(storage::JoinUri(dir, "classes.csv"), ":",
                                              line_number, ": expected class,category_id,name "
                                              "with classes in order"));
    }
    names.push_back((*fields)[2].empty() ? (*fields)[1] : (*fields)[2]);
  }
  if (static_cast<int>(names.size()) == std::max(splits.train.num_classes,
                                                 splits.test.num_classes)) {
    splits.class_names = std::move(names);
  }
  return splits;
}

}  // namespace pstrain::data
