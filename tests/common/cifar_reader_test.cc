#include "common/data/cifar_reader.h"

#include <filesystem>
#include <string>
#include <vector>

#include "common/data/dataset.h"
#include "common/data/load_dataset.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/data_test_util.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::data {
namespace {

using ::pstrain::data::testing::CifarRecords;
using ::pstrain::data::testing::TempDir;
using ::pstrain::data::testing::WriteFile;
using ::testing::HasSubstr;

// Writes data_batch_1..5.bin with `per_batch` records each (labels cycling
// through 0..9) and test_batch.bin with `test_records`.
void WriteCifarDir(const TempDir& dir, int per_batch, int test_records) {
  for (int b = 1; b <= 5; ++b) {
    std::vector<uint8_t> labels;
    for (int r = 0; r < per_batch; ++r) labels.push_back(((b - 1) * per_batch + r) % 10);
    WriteFile(dir.Path("data_batch_" + std::to_string(b) + ".bin"),
              CifarRecords(labels, (b - 1) * per_batch));
  }
  std::vector<uint8_t> test_labels;
  for (int r = 0; r < test_records; ++r) test_labels.push_back(9 - r % 10);
  WriteFile(dir.Path("test_batch.bin"), CifarRecords(test_labels, 1000));
}

TEST(CifarReaderTest, ReadsAllBatchesInOrder) {
  TempDir dir;
  WriteCifarDir(dir, /*per_batch=*/3, /*test_records=*/4);
  absl::StatusOr<DatasetSplits> splits = LoadCifar10Dataset(dir.path());
  ASSERT_OK(splits);
  const ImageDataset& train = splits->train;
  EXPECT_EQ(train.size(), 15);
  EXPECT_EQ(train.channels, 3);
  EXPECT_EQ(train.height, 32);
  EXPECT_EQ(train.width, 32);
  EXPECT_EQ(train.num_classes, 10);
  ASSERT_EQ(train.pixels.size(), 15u * 3072);
  for (int i = 0; i < 15; ++i) {
    EXPECT_EQ(train.labels[i], i % 10) << i;
    // The record is CHW already: byte k of the image is pixel k.
    for (int k : {0, 1, 1023, 1024, 2048, 3071}) {
      EXPECT_EQ(train.image(i)[k], (i * 7 + k) % 251) << "sample " << i << " byte " << k;
    }
  }
  EXPECT_EQ(splits->test.size(), 4);
  EXPECT_THAT(splits->test.labels, ::testing::ElementsAre(9, 8, 7, 6));
  EXPECT_EQ(splits->test.image(2)[5], (1002 * 7 + 5) % 251);
}

TEST(CifarReaderTest, SizeNotMultipleOfRecordNamesFileAndOffset) {
  TempDir dir;
  std::string bytes = CifarRecords({1, 2});
  bytes.resize(bytes.size() - 100);  // Second record cut short.
  WriteFile(dir.Path("bad.bin"), bytes);
  absl::StatusOr<ImageDataset> ds = ReadCifar10Files({dir.Path("bad.bin")});
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ds.status().message(), HasSubstr(dir.Path("bad.bin")));
  EXPECT_THAT(ds.status().message(), HasSubstr("byte offset 3073"));
  EXPECT_THAT(ds.status().message(), HasSubstr("3073-byte record"));
}

TEST(CifarReaderTest, LabelOutOfRangeNamesFileAndOffset) {
  TempDir dir;
  WriteFile(dir.Path("a.bin"), CifarRecords({1, 2}));
  WriteFile(dir.Path("b.bin"), CifarRecords({3, 10, 4}));
  absl::StatusOr<ImageDataset> ds = ReadCifar10Files({dir.Path("a.bin"), dir.Path("b.bin")});
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ds.status().message(), HasSubstr(dir.Path("b.bin")));
  EXPECT_THAT(ds.status().message(), HasSubstr("label 10 at byte offset 3073"));
}

TEST(CifarReaderTest, MissingBatchIsNotFound) {
  TempDir dir;
  WriteCifarDir(dir, 1, 1);
  std::filesystem::remove(dir.Path("data_batch_4.bin"));
  absl::StatusOr<DatasetSplits> splits = LoadCifar10Dataset(dir.path());
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(splits.status().message(), HasSubstr("data_batch_4.bin"));
}

TEST(CifarReaderTest, EmptyFileListIsAnError) {
  EXPECT_EQ(ReadCifar10Files({}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CifarReaderTest, LoadDatasetDispatchesAndLimits) {
  TempDir dir;
  WriteCifarDir(dir, 2, 5);
  pstrain::v1::DatasetSpec spec;
  spec.set_format(pstrain::v1::DATASET_FORMAT_CIFAR10);
  spec.set_path(dir.path());
  spec.set_train_limit(7);
  spec.set_test_limit(2);
  absl::StatusOr<DatasetSplits> splits = LoadDataset(spec);
  ASSERT_OK(splits);
  EXPECT_EQ(splits->train.size(), 7);
  EXPECT_EQ(splits->train.pixels.size(), 7u * 3072);
  EXPECT_EQ(splits->test.size(), 2);
  EXPECT_THAT(splits->test.labels, ::testing::ElementsAre(9, 8));
}

}  // namespace
}  // namespace pstrain::data
