// Packed datasets (DATASET_FORMAT_PACKED): what `pstrain prepare` writes once
// so that every later job reads decoded pixels with a copy instead of
// decoding JPEG/PNG or inflating gzip again. The directory may be local or
// an object-store prefix (s3://bucket/prefix, through storage::Storage).
//
//   PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits splits, data::LoadDataset(job.dataset()));
//   PSTRAIN_ASSIGN_OR_RETURN(data::PackSummary s,
//                            data::WritePackedDataset(splits, "/data/fmnist-packed", {}));
//   ...
//   PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits again,
//                            data::LoadPackedDataset("/data/fmnist-packed"));
//
// A directory holds each split in shards, train-00000-of-00006.pspack ...
// and test-00000-of-00001.pspack. A shard file, little-endian:
//
//   header, 64 bytes:
//     0  char[8]  magic "PSTRPAK1"
//     8  u32      format version (1)
//    12  u32      channels     16 u32 height     20 u32 width
//    24  u32      num_classes  28 u32 record bytes (4 + C*H*W + 4)
//    32  u64      records in this shard
//    40  u32      shard index  44 u32 shard count
//    48  u64      index of the shard's first sample in its split
//    56  u32      0 (reserved)
//    60  u32      CRC-32 (zlib) of bytes 0..59
//   then `records` records of `record bytes` each:
//     i32 label, C*H*W pixels (uint8, CHW), u32 CRC-32 of the label and pixels.
//
// The file's size must be exactly 64 + records x record bytes. Records have
// a fixed size, so record r of a shard is at a known offset and an error can
// name it: "train-00002-of-00006.pspack: record 17 (sample 20017): checksum
// mismatch". Samples keep their order, so shuffling, sharding over workers,
// class balancing and augmentation are those of the source format.
//
// Threads: free functions without shared state; thread-safe.
#ifndef PSTRAIN_COMMON_DATA_PACKED_FORMAT_H_
#define PSTRAIN_COMMON_DATA_PACKED_FORMAT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/data/image_dataset.h"

namespace pstrain::storage {
class Storage;
}  // namespace pstrain::storage

namespace pstrain::data {

inline constexpr char kPackedMagic[8] = {'P', 'S', 'T', 'R', 'P', 'A', 'K', '1'};
inline constexpr uint32_t kPackedFormatVersion = 1;
inline constexpr int64_t kPackedHeaderBytes = 64;
inline constexpr char kPackedSuffix[] = ".pspack";
// Bounds a header may claim (a hostile or corrupt file asks for no more).
inline constexpr int64_t kPackedMaxSampleBytes = int64_t{64} << 20;  // One image.
inline constexpr int64_t kPackedMaxClasses = 1 << 20;
inline constexpr int64_t kPackedMaxShards = 100000;

struct PackOptions {
  // Records per shard file; 0 picks enough records for about 256 MiB.
  int64_t records_per_shard = 0;
};

struct PackSummary {
  int64_t train_samples = 0, test_samples = 0;
  int train_shards = 0, test_shards = 0;
  int64_t bytes = 0;  // Written, over every file.
};

// "train-00002-of-00006.pspack".
std::string PackedShardName(const std::string& split, int index, int count);

// Writes one split's shards as samples arrive, holding one shard in memory
// (for sources larger than memory: `pstrain prepare --format bson`).
//
//   PSTRAIN_ASSIGN_OR_RETURN(auto writer, PackedSplitWriter::Create(store, "/out", "train",
//                                             shape, expected, {}));
//   for (...) PSTRAIN_RETURN_IF_ERROR(writer->Append(label, pixels));
//   PSTRAIN_ASSIGN_OR_RETURN(PackSummary written, writer->Finish());
//
// `expected_samples` fixes the shard count; fewer may arrive (damaged
// source records skipped): the last shards then hold fewer records, or none.
// Shards of an older packing of the split with another count are removed
// at Create. Not thread-safe.
class PackedSplitWriter {
 public:
  struct Shape {
    int channels = 0, height = 0, width = 0, num_classes = 0;
  };
  static absl::StatusOr<std::unique_ptr<PackedSplitWriter>> Create(
      storage::Storage& store, const std::string& dir, const std::string& split,
      const Shape& shape, int64_t expected_samples, const PackOptions& options);

  // One sample: its label (in [0, num_classes)) and C*H*W pixels.
  // INVALID_ARGUMENT for a bad label or one sample more than expected.
  absl::Status Append(int32_t label, const uint8_t* pixels);

  // Writes what is buffered and the empty shards left; the split's samples,
  // shards and bytes (in train_* fields).
  absl::StatusOr<PackSummary> Finish();

 private:
  PackedSplitWriter(storage::Storage& store, std::string dir, std::string split, Shape shape,
                    int64_t per_shard, int64_t shards);
  absl::Status Flush();

  storage::Storage& store_;
  const std::string dir_, split_;
  const Shape shape_;
  const int64_t per_shard_, shards_, record_bytes_;
  std::string buffer_;       // The shard being filled, header space included.
  int64_t in_buffer_ = 0;    // Records in buffer_.
  int64_t shard_ = 0;        // Index of the shard being filled.
  int64_t samples_ = 0;      // Appended in all.
  std::vector<int32_t> labels_;  // Every label appended (the labels object).
  int64_t bytes_ = 0;        // Written in all.
};

// One shard of a split whose place the caller knows: a Spark task packing
// its partition (pstrain.spark.prepare, through pstrain._native), where
// every task writes its own shards and the driver the labels object.
//
//   PSTRAIN_RETURN_IF_ERROR(WritePackedShard(store, "s3://b/ds", "train", shape,
//                                            {.index = 2, .count = 6, .first_sample = 2000},
//                                            labels, pixels));
//   ...  // every shard of the split, then:
//   PSTRAIN_RETURN_IF_ERROR(WritePackedLabels(store, "s3://b/ds", "train", all_labels, 10));
//
// `pixels` holds labels.size() samples of C*H*W bytes, in order. The shard
// is one Write: whole or not at all (a retried task writes the same bytes
// again). INVALID_ARGUMENT for a bad shape, place or label.
struct ShardPlace {
  int index = 0, count = 0;  // Of the split's shards.
  int64_t first_sample = 0;  // Of its first record in the split.
};
absl::Status WritePackedShard(storage::Storage& store, const std::string& dir,
                              const std::string& split, const PackedSplitWriter::Shape& shape,
                              const ShardPlace& place, absl::Span<const int32_t> labels,
                              absl::Span<const uint8_t> pixels);
// The split's labels object ("train.labels"), written after its shards: a
// packing with one is streamed from a store (PackedReadOptions::stream).
absl::Status WritePackedLabels(storage::Storage& store, const std::string& dir,
                               const std::string& split, const std::vector<int32_t>& labels,
                               int num_classes);

// Writes both splits of `splits` into `dir` (created if missing; shard
// files already there for a split are replaced, and shards of an older
// packing with another count are removed). Each file is written atomically.
absl::StatusOr<PackSummary> WritePackedDataset(const DatasetSplits& splits, const std::string& dir,
                                               const PackOptions& options);
// The same into any URI `store` takes ("s3://bucket/prefix": each shard one
// object, written whole or not at all).
absl::StatusOr<PackSummary> WritePackedDataset(const DatasetSplits& splits, const std::string& dir,
                                               const PackOptions& options,
                                               storage::Storage& store);

// Reads one split ("train" or "test") of a packed directory: every shard
// present, headers that agree, each record's checksum and label checked.
// The labels are copied; the pixels are not: local shards stay mapped (read
// once for the checksums, then their pages are given back, so a split
// larger than memory trains), objects' bytes stay as read (ImageDataset::
// store).
// Errors are DATA_LOSS (or NOT_FOUND for a missing directory or shard) and
// name the file, and the record for a bad one.
absl::StatusOr<ImageDataset> LoadPackedSplit(const std::string& dir, const std::string& split);
// The same from any URI `store` takes. From an object store, a record that
// fails its checksum is fetched again (a ranged read, up to 3 reads), and a
// shard whose header fails is read again whole (up to 3 times), before the
// DATA_LOSS is final: no damaged byte reaches training.
absl::StatusOr<ImageDataset> LoadPackedSplit(const std::string& dir, const std::string& split,
                                             storage::Storage& store);

struct PackedReadOptions {
  // Streams the split from `store` instead of reading it whole: only the
  // shards' headers and the split's labels object ("train.labels", written
  // after the shards) are read now; the records come in chunks of about 4
  // MiB as epochs need them (ImageDataset::store: Plan, Acquire), each
  // record's checksum and label checked as it arrives. A packing without a
  // labels object is read whole. For objects in a store, where reading a
  // worker's share beats reading everything.
  bool stream = false;
  // A streamed split's shuffle window (SampleStore::Chunks::window_chunks):
  // its epochs shuffle chunks, then samples within windows of this many
  // bytes (ChunkedEpochOrder). It holds about twice this in memory.
  int64_t window_bytes = int64_t{256} << 20;
};
absl::StatusOr<ImageDataset> LoadPackedSplit(const std::string& dir, const std::string& split,
                                             storage::Storage& store,
                                             const PackedReadOptions& options);

// Both splits; the test split gets the train split's num_classes when larger.
absl::StatusOr<DatasetSplits> LoadPackedDataset(const std::string& dir);
absl::StatusOr<DatasetSplits> LoadPackedDataset(const std::string& dir, storage::Storage& store);
absl::StatusOr<DatasetSplits> LoadPackedDataset(const std::string& dir, storage::Storage& store,
                                                const PackedReadOptions& options);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_PACKED_FORMAT_H_
