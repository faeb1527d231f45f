// The in-memory image dataset every reader produces: the leaf of common/data.
// Readers (idx_reader, cifar_reader, image_folder_reader, packed_format)
// depend on this header alone; load_dataset.h dispatches over them, and
// dataset.h orders, shards and batches what they load.
//
//   data::ImageDataset ds;
//   ds.channels = 1; ds.height = 28; ds.width = 28; ds.num_classes = 10;
//   ... fill ds.pixels (CHW per sample) and ds.labels ...
//   PSTRAIN_RETURN_IF_ERROR(ds.Validate("my reader"));
#ifndef PSTRAIN_COMMON_DATA_IMAGE_DATASET_H_
#define PSTRAIN_COMMON_DATA_IMAGE_DATASET_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pstrain::data {

// Where a dataset's pixels live when they are not in ImageDataset::pixels:
// packed shards mapped from disk (packed_format.cc), which the kernel pages
// in and out, so that a dataset larger than memory can be trained on.
// image(i) stays valid while the store lives; concurrent calls are fine.
class SampleStore {
 public:
  virtual ~SampleStore() = default;
  // The CHW pixels of sample i, in [0, the store's samples).
  virtual const uint8_t* image(int64_t i) const = 0;
};

// A decoded image dataset. A value type (copies share `store`);
// thread-compatible (concurrent readers are fine once it is built).
struct ImageDataset {
  int channels = 0, height = 0, width = 0, num_classes = 0;
  // size() * channels * height * width bytes; each sample is CHW. Empty
  // when `store` holds the pixels.
  std::vector<uint8_t> pixels;
  // One label per sample, each in [0, num_classes).
  std::vector<int32_t> labels;
  // Set: the pixels are there (at least size() samples), not in `pixels`.
  std::shared_ptr<const SampleStore> store;

  int64_t size() const { return static_cast<int64_t>(labels.size()); }
  int64_t sample_elements() const {
    return static_cast<int64_t>(channels) * height * width;
  }
  // The CHW pixels of sample i; i must be in [0, size()).
  const uint8_t* image(int64_t i) const {
    return store != nullptr ? store->image(i) : pixels.data() + i * sample_elements();
  }

  // OK when the fields agree with each other: positive dimensions, pixel
  // count matching the label count, every label in [0, num_classes).
  // `what` names the dataset in the error (e.g. a file or "train split").
  absl::Status Validate(const std::string& what) const;
  // Keeps only the first `limit` samples (no-op when limit <= 0 or >= size()).
  void Truncate(int64_t limit);
  // Every sample's pixels, one after another (a copy, wherever they live).
  std::vector<uint8_t> CopyPixels() const;
};

struct DatasetSplits {
  ImageDataset train;
  ImageDataset test;
  // Class c's name when the dataset has names (a BSON dump's categories, a
  // packed dataset's classes.csv); empty otherwise.
  std::vector<std::string> class_names;
};

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_IMAGE_DATASET_H_
