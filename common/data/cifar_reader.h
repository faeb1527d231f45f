// Reader for the CIFAR-10 binary version.
//
//   PSTRAIN_ASSIGN_OR_RETURN(data::DatasetSplits splits,
//                            data::LoadCifar10Dataset("/data/cifar-10-batches-bin"));
//   // splits.train.size() == 50000, channels 3, 32x32, 10 classes
//
// Free functions without shared state; thread-safe.
#ifndef PSTRAIN_COMMON_DATA_CIFAR_READER_H_
#define PSTRAIN_COMMON_DATA_CIFAR_READER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/image_dataset.h"

namespace pstrain::data {

inline constexpr int kCifarSide = 32;
inline constexpr int kCifarChannels = 3;
inline constexpr int kCifarClasses = 10;
// One record: a label byte, then 1024 red, 1024 green and 1024 blue bytes
// (row-major), which is already CHW.
inline constexpr int64_t kCifarRecordBytes = 1 + kCifarChannels * kCifarSide * kCifarSide;

// Reads and concatenates CIFAR-10 binary batch files, in the given order.
// Each file's size must be a multiple of 3073 bytes (else DATA_LOSS naming
// the file and the offset of the incomplete record) and every label below 10
// (else INVALID_ARGUMENT naming the file and the label's byte offset).
absl::StatusOr<ImageDataset> ReadCifar10Files(const std::vector<std::string>& paths);

// Train = data_batch_1.bin .. data_batch_5.bin, test = test_batch.bin, in `dir`.
absl::StatusOr<DatasetSplits> LoadCifar10Dataset(const std::string& dir);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_CIFAR_READER_H_
