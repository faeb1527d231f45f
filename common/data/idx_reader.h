// Reader for the IDX format of MNIST and Fashion-MNIST (raw or gzip).
//
//   PSTRAIN_ASSIGN_OR_RETURN(data::ImageDataset train,
//       data::ReadIdxPair("/data/train-images-idx3-ubyte.gz",
//                         "/data/train-labels-idx1-ubyte.gz"));
//   // train.channels == 1, train.height == train.width == 28
//
// Free functions without shared state; thread-safe.
#ifndef PSTRAIN_COMMON_DATA_IDX_READER_H_
#define PSTRAIN_COMMON_DATA_IDX_READER_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/data/image_dataset.h"

namespace pstrain::data {

// IDX magic numbers (big-endian in the file): unsigned bytes, 3 and 1 dims.
inline constexpr uint32_t kIdxImagesMagic = 0x00000803;
inline constexpr uint32_t kIdxLabelsMagic = 0x00000801;

// Reads an images file (magic 0x803: count, rows, cols, then pixels) and a
// labels file (magic 0x801: count, then one byte per label), each raw or
// gzip. Checks the magic numbers, non-zero dimensions, equal counts, that each
// file holds exactly the bytes its header promises (a short file is DATA_LOSS
// naming the file and the byte offset where the data ran out) and that every
// label is below `max_classes`. The result has one channel and
// num_classes = max(label) + 1, but at least 10.
absl::StatusOr<ImageDataset> ReadIdxPair(const std::string& images_path,
                                         const std::string& labels_path, int max_classes = 10);

// Both splits from `dir`: {train,t10k}-{images-idx3,labels-idx1}-ubyte, each
// either raw or with a .gz suffix.
absl::StatusOr<DatasetSplits> LoadIdxDataset(const std::string& dir);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_IDX_READER_H_
