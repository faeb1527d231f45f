#include "common/data/idx_reader.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/data/file_io.h"
#include "common/status_macros.h"

namespace pstrain::data {
namespace {

// Largest accepted rows/cols; far above any IDX image set, and it keeps
// rows * cols * count from overflowing.
constexpr uint32_t kMaxIdxSide = 1 << 15;

uint32_t ReadBigEndian32(const std::string& bytes, size_t offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data()) + offset;
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Checks the header of `file` (header_bytes long, magic first) and that the
// file is exactly header_bytes + payload_bytes long.
absl::Status CheckLength(const std::string& path, const FileContents& file, uint64_t header_bytes,
                         uint64_t payload_bytes) {
  uint64_t expected = header_bytes + payload_bytes;
  if (file.bytes.size() < expected) {
    return TruncatedError(path, file, expected, file.bytes.size());
  }
  if (file.bytes.size() > expected) {
    return absl::DataLossError(absl::StrCat(path, ": ", file.bytes.size() - expected,
                                            " unexpected trailing bytes after byte offset ",
                                            expected));
  }
  return absl::OkStatus();
}

absl::Status CheckMagic(const std::string& path, const FileContents& file, uint32_t want,
                        uint64_t header_bytes) {
  if (file.bytes.size() < header_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": truncated IDX header: ", header_bytes,
                                            " bytes expected, data ends at ",
                                            file.gzip ? "decompressed " : "", "byte offset ",
                                            file.bytes.size()));
  }
  uint32_t magic = ReadBigEndian32(file.bytes, 0);
  if (magic != want) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: bad IDX magic 0x%08x at byte offset 0, expected 0x%08x", path, magic, want));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ImageDataset> ReadIdxPair(const std::string& images_path,
                                         const std::string& labels_path, int max_classes) {
  if (max_classes <= 0 || max_classes > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReadIdxPair: max_classes must be in [1, 256], got ", max_classes));
  }
  // Images: magic, count, rows, cols, then count*rows*cols bytes.
  PSTRAIN_ASSIGN_OR_RETURN(FileContents images, ReadFileContents(images_path));
  constexpr uint64_t kImagesHeader = 16;
  PSTRAIN_RETURN_IF_ERROR(CheckMagic(images_path, images, kIdxImagesMagic, kImagesHeader));
  uint32_t image_count = ReadBigEndian32(images.bytes, 4);
  uint32_t rows = ReadBigEndian32(images.bytes, 8);
  uint32_t cols = ReadBigEndian32(images.bytes, 12);
  if (rows == 0 || cols == 0 || rows > kMaxIdxSide || cols > kMaxIdxSide) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": bad image size ", rows, "x",
                                                   cols, " in the header (byte offset 8)"));
  }
  uint64_t image_bytes = uint64_t{rows} * cols;
  PSTRAIN_RETURN_IF_ERROR(
      CheckLength(images_path, images, kImagesHeader, image_bytes * image_count));

  // Labels: magic, count, then count bytes.
  PSTRAIN_ASSIGN_OR_RETURN(FileContents labels, ReadFileContents(labels_path));
  constexpr uint64_t kLabelsHeader = 8;
  PSTRAIN_RETURN_IF_ERROR(CheckMagic(labels_path, labels, kIdxLabelsMagic, kLabelsHeader));
  uint32_t label_count = ReadBigEndian32(labels.bytes, 4);
  if (label_count != image_count) {
    return absl::InvalidArgumentError(absl::StrCat("label count ", label_count, " in ",
                                                   labels_path, " does not match image count ",
                                                   image_count, " in ", images_path));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckLength(labels_path, labels, kLabelsHeader, label_count));

  ImageDataset ds;
  ds.channels = 1;
  ds.height = static_cast<int>(rows);
  ds.width = static_cast<int>(cols);
  ds.labels.resize(label_count);
  int max_label = -1;
  for (uint32_t i = 0; i < label_count; ++i) {
    int label = static_cast<unsigned char>(labels.bytes[kLabelsHeader + i]);
    if (label >= max_classes) {
      return absl::InvalidArgumentError(
          absl::StrCat(labels_path, ": label ", label, " at byte offset ", kLabelsHeader + i,
                       " is not below the class count ", max_classes));
    }
    ds.labels[i] = label;
    max_label = std::max(max_label, label);
  }
  ds.num_classes = std::max(10, max_label + 1);
  ds.pixels.assign(images.bytes.begin() + kImagesHeader, images.bytes.end());
  return ds;
}

absl::StatusOr<DatasetSplits> LoadIdxDataset(const std::string& dir) {
  DatasetSplits splits;
  for (bool train : {true, false}) {
    const char* prefix = train ? "train" : "t10k";
    PSTRAIN_ASSIGN_OR_RETURN(std::string images,
                             ResolveMaybeGz(dir, absl::StrCat(prefix, "-images-idx3-ubyte")));
    PSTRAIN_ASSIGN_OR_RETURN(std::string labels,
                             ResolveMaybeGz(dir, absl::StrCat(prefix, "-labels-idx1-ubyte")));
    PSTRAIN_ASSIGN_OR_RETURN(ImageDataset ds, ReadIdxPair(images, labels));
    (train ? splits.train : splits.test) = std::move(ds);
  }
  return splits;
}

}  // namespace pstrain::data
