#include "common/data/packed_format.h"

#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "common/data/dataset.h"
#include "common/data/load_dataset.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::data {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

ImageDataset Make(int n, int channels, int height, int width, int classes, int salt) {
  ImageDataset ds;
  ds.channels = channels;
  ds.height = height;
  ds.width = width;
  ds.num_classes = classes;
  for (int i = 0; i < n; ++i) {
    ds.labels.push_back((i * 7 + salt) % classes);
    for (int j = 0; j < channels * height * width; ++j) {
      ds.pixels.push_back(static_cast<uint8_t>(i * 31 + j * 3 + salt));
    }
  }
  return ds;
}

class PackedFormatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ =
        fs::path(::testing::TempDir()) /
        ("packed-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    splits_.train = Make(23, 3, 4, 5, 6, 1);
    splits_.test = Make(7, 3, 4, 5, 6, 2);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string File(const std::string& split, int index, int count) const {
    return (dir_ / PackedShardName(split, index, count)).string();
  }
  std::string Read(const std::string& path) const {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  void Write(const std::string& path, const std::string& bytes) const {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  }

  fs::path dir_;
  DatasetSplits splits_;
};

TEST_F(PackedFormatTest, RoundTripsEverySampleInOrderAcrossShards) {
  absl::StatusOr<PackSummary> summary =
      WritePackedDataset(splits_, dir_.string(), {.records_per_shard = 5});
  ASSERT_OK(summary);
  EXPECT_EQ(summary->train_shards, 5);  // 23 records, 5 per shard.
  EXPECT_EQ(summary->test_shards, 2);
  EXPECT_EQ(summary->train_samples, 23);
  EXPECT_TRUE(fs::exists(File("train", 4, 5)));
  absl::StatusOr<DatasetSplits> read = LoadPackedDataset(dir_.string());
  ASSERT_OK(read);
  for (auto [a, b] : {std::pair{&splits_.train, &read->train}, {&splits_.test, &read->test}}) {
    EXPECT_EQ(b->channels, 3);
    EXPECT_EQ(b->height, 4);
    EXPECT_EQ(b->width, 5);
    EXPECT_EQ(b->num_classes, 6);
    EXPECT_EQ(b->labels, a->labels);
    EXPECT_EQ(b->CopyPixels(), a->CopyPixels());
  }
}

TEST_F(PackedFormatTest, LoadDatasetReadsThePackedFormatWithTheLimits) {
  ASSERT_OK(WritePackedDataset(splits_, dir_.string(), {}));
  v1::DatasetSpec spec;
  spec.set_format(v1::DATASET_FORMAT_PACKED);
  spec.set_path(dir_.string());
  spec.set_train_limit(10);
  absl::StatusOr<DatasetSplits> read = LoadDataset(spec);
  ASSERT_OK(read);
  EXPECT_EQ(read->train.size(), 10);
  EXPECT_EQ(read->test.size(), 7);
  EXPECT_EQ(read->train.labels[9], splits_.train.labels[9]);
}

TEST_F(PackedFormatTest, ACorruptRecordIsNamedByFileAndRecord) {
  ASSERT_OK(WritePackedDataset(splits_, dir_.string(), {.records_per_shard = 10}));
  const std::string path = File("train", 1, 3);
  std::string bytes = Read(path);
  const size_t record = 3 * 4 * 5 + 8;
  bytes[kPackedHeaderBytes + 4 * record + 10] ^= 0x01;  // Record 4 of shard 1: sample 14.
  Write(path, bytes);
  absl::StatusOr<ImageDataset> read = LoadPackedSplit(dir_.string(), "train");
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(read.status().message()),
              HasSubstr("train-00001-of-00003.pspack: record 4 (sample 14): checksum mismatch"));
}

TEST_F(PackedFormatTest, TruncatedPaddedOrForeignFilesAreRefused) {
  ASSERT_OK(WritePackedDataset(splits_, dir_.string(), {}));
  const std::string path = File("test", 0, 1);
  const std::string good = Read(path);
  Write(path, good.substr(0, good.size() - 3));
  absl::StatusOr<ImageDataset> read = LoadPackedSplit(dir_.string(), "test");
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("truncated or with trailing bytes"));
  Write(path, good + "x");
  EXPECT_FALSE(LoadPackedSplit(dir_.string(), "test").ok());
  Write(path, good.substr(0, 10));
  read = LoadPackedSplit(dir_.string(), "test");
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("shorter than the 64-byte header"));
  std::string bad_magic = good;
  bad_magic[0] = 'X';
  Write(path, bad_magic);
  read = LoadPackedSplit(dir_.string(), "test");
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("bad magic"));
  std::string bad_header = good;
  bad_header[12] = 9;  // Channels, without fixing the header's CRC.
  Write(path, bad_header);
  read = LoadPackedSplit(dir_.string(), "test");
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("header checksum mismatch"));
}

TEST_F(PackedFormatTest, AHostileHeaderWithAGoodChecksumIsBounded) {
  ASSERT_OK(WritePackedDataset(splits_, dir_.string(), {}));
  const std::string path = File("test", 0, 1);
  std::string bytes = Read(path);
  // Claim 2^40 records and restamp the header CRC: the size check refuses
  // it before anything is allocated.
  const uint64_t records = uint64_t{1} << 40;
  std::memcpy(bytes.data() + 32, &records, sizeof(records));
  const uint32_t crc =
      static_cast<uint32_t>(crc32_z(0L, reinterpret_cast<const Bytef*>(bytes.data()), 60));
  std::memcpy(bytes.data() + 60, &crc, sizeof(crc));
  Write(path, bytes);
  absl::StatusOr<ImageDataset> read = LoadPackedSplit(dir_.string(), "test");
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("1099511627776 records"));
}

TEST_F(PackedFormatTest, AMissingShardOrMixedPackingsAreNamed) {
  ASSERT_OK(WritePackedDataset(splits_, dir_.string(), {.records_per_shard = 10}));
  fs::remove(File("train", 1, 3));
  absl::StatusOr<ImageDataset> read = LoadPackedSplit(dir_.string(), "train");
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(read.status().message()),
              HasSubstr("train-00001-of-00003.pspack is missing"));
  fs::copy_file(File("test", 0, 1), File("train", 1, 2));
  read = LoadPackedSplit(dir_.string(), "train");
  EXPECT_THAT(std::string(read.status().message()), HasSubstr("two packings"));
  EXPECT_EQ(LoadPackedSplit((dir_ / "nothing").string(), "train").status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(PackedFormatTest, RepackingWithAnotherShardCountReplacesTheOldShards) {
  ASSERT_OK(WritePackedDataset(splits_, dir_.string(), {.records_per_shard = 5}));
  ASSERT_OK(WritePackedDataset(splits_, dir_.string(), {.records_per_shard = 100}));
  EXPECT_FALSE(fs::exists(File("train", 0, 5)));
  absl::StatusOr<ImageDataset> read = LoadPackedSplit(dir_.string(), "train");
  ASSERT_OK(read);
  EXPECT_EQ(read->labels, splits_.train.labels);
}

TEST_F(PackedFormatTest, ALabelOutsideTheClassesIsNamed) {
  splits_.test.num_classes = 6;
  ASSERT_OK(WritePackedDataset(splits_, dir_.string(), {}));
  const std::string path = File("test", 0, 1);
  std::string bytes = Read(path);
  const size_t record = 3 * 4 * 5 + 8;
  const size_t at = kPackedHeaderBytes + 2 * record;
  const int32_t label = 6;
  std::memcpy(bytes.data() + at, &label, sizeof(label));
  const uint32_t crc = static_cast<uint32_t>(
      crc32_z(0L, reinterpret_cast<const Bytef*>(bytes.data() + at), record - 4));
  std::memcpy(bytes.data() + at + record - 4, &crc, sizeof(crc));
  Write(path, bytes);
  absl::StatusOr<ImageDataset> read = LoadPackedSplit(dir_.string(), "test");
  ASSERT_FALSE(read.ok());
  EXPECT_THAT(std::string(read.status().message()),
              HasSubstr("record 2 (sample 2): label 6 outside [0, 6)"));
}

// The packed copy of Fashion-MNIST is the same dataset, byte for byte, so
// that a job trains on exactly what it trained on before: same order, same
// batches, same augmentation.
TEST_F(PackedFormatTest, PackedFashionMnistIsTheIdxDatasetByteForByte) {
  const std::string source = "/usr/share/datasets/fashion-mnist";
  if (!fs::exists(source)) GTEST_SKIP() << source << " is missing (dataset-fashion-mnist)";
  v1::DatasetSpec idx;
  idx.set_format(v1::DATASET_FORMAT_IDX);
  idx.set_path(source);
  absl::StatusOr<DatasetSplits> original = LoadDataset(idx);
  ASSERT_OK(original);
  ASSERT_OK(WritePackedDataset(*original, dir_.string(), {.records_per_shard = 25000}));
  v1::DatasetSpec packed;
  packed.set_format(v1::DATASET_FORMAT_PACKED);
  packed.set_path(dir_.string());
  absl::StatusOr<DatasetSplits> read = LoadDataset(packed);
  ASSERT_OK(read);
  EXPECT_EQ(read->train.size(), 60000);
  EXPECT_EQ(read->test.size(), 10000);
  EXPECT_EQ(read->train.num_classes, 10);
  EXPECT_TRUE(read->train.CopyPixels() == original->train.CopyPixels());
  EXPECT_TRUE(read->train.labels == original->train.labels);
  EXPECT_TRUE(read->test.CopyPixels() == original->test.CopyPixels());
  EXPECT_TRUE(read->test.labels == original->test.labels);
}

}  // namespace
}  // namespace pstrain::data
