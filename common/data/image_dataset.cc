#include "common/data/image_dataset.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pstrain::data {

// ---- ImageDataset -------------------------------------------------------------

absl::Status ImageDataset::Validate(const std::string& what) const {
  if (channels <= 0 || height <= 0 || width <= 0 || num_classes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": bad shape ", channels, "x", height,
                                                   "x", width, " with ", num_classes,
                                                   " classes"));
  }
  if (store == nullptr && pixels.size() != static_cast<size_t>(size() * sample_elements())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", pixels.size(),
                                                   " pixel bytes for ", size(), " samples of ",
                                                   sample_elements()));
  }
  for (int64_t i = 0; i < size(); ++i) {
    if (labels[i] < 0 || labels[i] >= num_classes) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": label ", labels[i], " of sample ", i,
                                                     " is outside [0, ", num_classes, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint8_t>> ImageDataset::CopyPixels() const {
  if (store == nullptr) return pixels;
  std::vector<uint8_t> out(static_cast<size_t>(size() * sample_elements()));
  constexpr int64_t kStep = 4096;  // Samples leased at a time.
  std::vector<int64_t> batch;
  for (int64_t first = 0; first < size(); first += kStep) {
    batch.clear();
    for (int64_t i = first; i < std::min(size(), first + kStep); ++i) batch.push_back(i);
    absl::StatusOr<std::shared_ptr<const void>> lease = Acquire(batch.data(), batch.size());
    if (!lease.ok()) return lease.status();
    for (int64_t i : batch) {
      std::copy(image(i), image(i) + sample_elements(), out.begin() + i * sample_elements());
    }
  }
  return out;
}

void ImageDataset::Truncate(int64_t limit) {
  if (limit <= 0 || limit >= size()) return;
  labels.resize(limit);
  labels.shrink_to_fit();
  if (store != nullptr) return;  // The store keeps what it maps; only `limit` are read.
  pixels.resize(limit * sample_elements());
  pixels.shrink_to_fit();
}

}  // namespace pstrain::data
