#include "common/data/cifar_reader.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/data/file_io.h"
#include "common/status_macros.h"

namespace pstrain::data {

absl::StatusOr<ImageDataset> ReadCifar10Files(const std::vector<std::string>& paths) {
  if (paths.empty()) return absl::InvalidArgumentError("ReadCifar10Files: no files given");
  ImageDataset ds;
  ds.channels = kCifarChannels;
  ds.height = kCifarSide;
  ds.width = kCifarSide;
  ds.num_classes = kCifarClasses;
  const int64_t image_bytes = kCifarRecordBytes - 1;
  for (const std::string& path : paths) {
    PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, ReadFileBytes(path));
    const int64_t size = static_cast<int64_t>(bytes.size());
    if (size % kCifarRecordBytes != 0) {
      int64_t last_record = size / kCifarRecordBytes * kCifarRecordBytes;
      return absl::DataLossError(absl::StrCat(
          path, ": size ", size, " is not a multiple of the ", kCifarRecordBytes,
          "-byte record: incomplete record at byte offset ", last_record,
          ", data ends at byte offset ", size));
    }
    const int64_t records = size / kCifarRecordBytes;
    const int64_t first = ds.size();
    ds.labels.resize(first + records);
    ds.pixels.resize((first + records) * image_bytes);
    for (int64_t r = 0; r < records; ++r) {
      const int64_t offset = r * kCifarRecordBytes;
      int label = static_cast<unsigned char>(bytes[offset]);
      if (label >= kCifarClasses) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": label ", label,
                                                       " at byte offset ", offset,
                                                       " is not below ", kCifarClasses));
      }
      ds.labels[first + r] = label;
      std::memcpy(ds.pixels.data() + (first + r) * image_bytes, bytes.data() + offset + 1,
                  image_bytes);
    }
  }
  return ds;
}

absl::StatusOr<DatasetSplits> LoadCifar10Dataset(const std::string& dir) {
  std::vector<std::string> train_files;
  for (int i = 1; i <= 5; ++i) {
    train_files.push_back(JoinPath(dir, absl::StrCat("data_batch_", i, ".bin")));
  }
  DatasetSplits splits;
  PSTRAIN_ASSIGN_OR_RETURN(splits.train, ReadCifar10Files(train_files));
  PSTRAIN_ASSIGN_OR_RETURN(splits.test, ReadCifar10Files({JoinPath(dir, "test_batch.bin")}));
  return splits;
}

}  // namespace pstrain::data
