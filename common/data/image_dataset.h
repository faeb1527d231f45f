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
#include "absl/status/statusor.h"

namespace pstrain::data {

// Where a dataset's pixels live when they are not in ImageDataset::pixels:
// packed shards mapped from disk (packed_format.cc), which the kernel pages
// in and out, so that a dataset larger than memory can be trained on; or
// packed shards in an object store, fetched in chunks as the epoch needs
// them (StreamedShards).
//
// A store that fetches says which samples come next (Plan), so it reads
// ahead, and gives image(i) only under a lease from Acquire, which fetches
// what is not there yet and returns the fetch's error. Stores that hold
// everything lease nothing. Concurrent calls are fine.
class SampleStore {
 public:
  virtual ~SampleStore() = default;
  // The CHW pixels of sample i, in [0, the store's samples). With a
  // fetching store, valid while a lease from Acquire covering i is held.
  virtual const uint8_t* image(int64_t i) const = 0;

  // Samples [starts[k], starts[k+1]) are read together (the last chunk
  // ends at the store's end); an epoch order keeps them near each other
  // (ChunkedEpochOrder), shuffling within windows of `window_chunks`.
  struct Chunks {
    std::vector<int64_t> starts;
    int64_t window_chunks = 1;
  };
  // Null when any order reads alike (memory, mapped files).
  virtual const Chunks* chunks() const { return nullptr; }

  // The samples the next Acquire calls will ask for, in order (replaces the
  // plan before): fetched ahead within the store's memory bound.
  virtual void Plan(const std::vector<int64_t>& samples) const {}

  // What a reader waiting on the store waits for ("reading s3://... bytes
  // A-B from its store for 40 s"), for a timeout's message; "" when nothing.
  virtual std::string Pending() const { return ""; }

  // Makes image(i) valid for every i in `samples` until the lease is
  // dropped. The error names the object and record that failed to read
  // (DATA_LOSS for a checksum that fails every read; the store's own error
  // once its retries are spent, which later calls return at once until the
  // next Plan).
  virtual absl::StatusOr<std::shared_ptr<const void>> Acquire(const int64_t* samples,
                                                              size_t count) const {
    return std::shared_ptr<const void>();
  }
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
  // From a fetching store, DATA_LOSS or the store's error if a read fails.
  absl::StatusOr<std::vector<uint8_t>> CopyPixels() const;
  // A lease on `count` samples' pixels (SampleStore::Acquire); null when
  // the pixels are in memory.
  absl::StatusOr<std::shared_ptr<const void>> Acquire(const int64_t* samples, size_t count) const {
    if (store == nullptr) return std::shared_ptr<const void>();
    return store->Acquire(samples, count);
  }
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
