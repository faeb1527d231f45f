#include "common/data/idx_reader.h"

#include <filesystem>
#include <string>
#include <vector>

#include "common/data/dataset.h"
#include "common/data/load_dataset.h"
#include "common/data/file_io.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/data_test_util.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::data {
namespace {

using ::pstrain::data::testing::Gzip;
using ::pstrain::data::testing::IdxImages;
using ::pstrain::data::testing::IdxLabels;
using ::pstrain::data::testing::ReadWholeFile;
using ::pstrain::data::testing::TempDir;
using ::pstrain::data::testing::WriteFile;
using ::pstrain::data::testing::WriteGzipFile;
using ::testing::HasSubstr;

constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

bool HaveFashionMnist() {
  return std::filesystem::exists(std::string(kFashionMnistDir) + "/train-images-idx3-ubyte.gz");
}

TEST(IdxReaderTest, ReadsRealFashionMnist) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  absl::StatusOr<DatasetSplits> splits = LoadIdxDataset(kFashionMnistDir);
  ASSERT_OK(splits);
  const ImageDataset& train = splits->train;
  const ImageDataset& test = splits->test;
  EXPECT_EQ(train.size(), 60000);
  EXPECT_EQ(test.size(), 10000);
  for (const ImageDataset* ds : {&train, &test}) {
    EXPECT_EQ(ds->channels, 1);
    EXPECT_EQ(ds->height, 28);
    EXPECT_EQ(ds->width, 28);
    EXPECT_EQ(ds->num_classes, 10);
    EXPECT_EQ(ds->pixels.size(), static_cast<size_t>(ds->size()) * 784);
  }
  EXPECT_THAT(std::vector<int32_t>(train.labels.begin(), train.labels.begin() + 10),
              ::testing::ElementsAre(9, 0, 0, 3, 0, 2, 7, 2, 5, 5));
  EXPECT_THAT(std::vector<int32_t>(test.labels.begin(), test.labels.begin() + 10),
              ::testing::ElementsAre(9, 2, 1, 1, 6, 1, 4, 6, 5, 7));
  // Every class appears 6000 times in the training set.
  std::vector<int> counts(10, 0);
  for (int32_t l : train.labels) counts[l]++;
  for (int c = 0; c < 10; ++c) EXPECT_EQ(counts[c], 6000) << "class " << c;
}

TEST(IdxReaderTest, RawCopyOfFashionMnistReadsTheSameAsGzip) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  TempDir dir;
  const std::string gz_images = std::string(kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz";
  const std::string gz_labels = std::string(kFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz";
  absl::StatusOr<FileContents> images = ReadFileContents(gz_images);
  absl::StatusOr<FileContents> labels = ReadFileContents(gz_labels);
  ASSERT_OK(images);
  ASSERT_OK(labels);
  EXPECT_TRUE(images->gzip);
  WriteFile(dir.Path("t10k-images-idx3-ubyte"), images->bytes);
  WriteFile(dir.Path("t10k-labels-idx1-ubyte"), labels->bytes);

  absl::StatusOr<ImageDataset> from_gz = ReadIdxPair(gz_images, gz_labels);
  absl::StatusOr<ImageDataset> from_raw =
      ReadIdxPair(dir.Path("t10k-images-idx3-ubyte"), dir.Path("t10k-labels-idx1-ubyte"));
  ASSERT_OK(from_gz);
  ASSERT_OK(from_raw);
  EXPECT_EQ(from_gz->pixels, from_raw->pixels);
  EXPECT_EQ(from_gz->labels, from_raw->labels);
  EXPECT_EQ(from_raw->size(), 10000);
}

TEST(IdxReaderTest, ReadsSyntheticRawAndGzipIdentically) {
  TempDir dir;
  const std::vector<uint8_t> labels = {3, 1, 4, 1, 5};
  WriteFile(dir.Path("raw-images"), IdxImages(5, 3, 2));
  WriteFile(dir.Path("raw-labels"), IdxLabels(labels));
  WriteGzipFile(dir.Path("gz-images.gz"), IdxImages(5, 3, 2));
  WriteGzipFile(dir.Path("gz-labels.gz"), IdxLabels(labels));

  for (const char* prefix : {"raw", "gz"}) {
    SCOPED_TRACE(prefix);
    const std::string suffix = std::string(prefix) == "gz" ? ".gz" : "";
    absl::StatusOr<ImageDataset> ds =
        ReadIdxPair(dir.Path(std::string(prefix) + "-images" + suffix),
                    dir.Path(std::string(prefix) + "-labels" + suffix));
    ASSERT_OK(ds);
    EXPECT_EQ(ds->size(), 5);
    EXPECT_EQ(ds->channels, 1);
    EXPECT_EQ(ds->height, 3);
    EXPECT_EQ(ds->width, 2);
    EXPECT_EQ(ds->num_classes, 10);
    EXPECT_THAT(ds->labels, ::testing::ElementsAre(3, 1, 4, 1, 5));
    ASSERT_EQ(ds->pixels.size(), 30u);
    for (int i = 0; i < 5; ++i) {
      for (int k = 0; k < 6; ++k) EXPECT_EQ(ds->image(i)[k], (i * 31 + k) % 256);
    }
  }
}

TEST(IdxReaderTest, LoadIdxDatasetAcceptsEitherRawOrGzipName) {
  TempDir dir;
  WriteGzipFile(dir.Path("train-images-idx3-ubyte.gz"), IdxImages(4, 2, 2));
  WriteFile(dir.Path("train-labels-idx1-ubyte"), IdxLabels({0, 1, 2, 3}));
  WriteFile(dir.Path("t10k-images-idx3-ubyte"), IdxImages(2, 2, 2));
  WriteGzipFile(dir.Path("t10k-labels-idx1-ubyte.gz"), IdxLabels({9, 8}));
  absl::StatusOr<DatasetSplits> splits = LoadIdxDataset(dir.path());
  ASSERT_OK(splits);
  EXPECT_EQ(splits->train.size(), 4);
  EXPECT_EQ(splits->test.size(), 2);
  EXPECT_THAT(splits->test.labels, ::testing::ElementsAre(9, 8));
}

TEST(IdxReaderTest, MissingFileNamesBothCandidates) {
  TempDir dir;
  absl::StatusOr<DatasetSplits> splits = LoadIdxDataset(dir.path());
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(splits.status().message(), HasSubstr("train-images-idx3-ubyte.gz"));
}

TEST(IdxReaderTest, TruncatedImagesFileNamesFileAndOffset) {
  TempDir dir;
  std::string images = IdxImages(3, 4, 4);  // 16 + 48 bytes.
  images.resize(16 + 40);
  WriteFile(dir.Path("images"), images);
  WriteFile(dir.Path("labels"), IdxLabels({1, 2, 3}));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ds.status().message(), HasSubstr(dir.Path("images")));
  EXPECT_THAT(ds.status().message(), HasSubstr("byte offset 56"));
  EXPECT_THAT(ds.status().message(), HasSubstr("64"));
}

TEST(IdxReaderTest, TruncatedGzipPayloadReportsDecompressedOffset) {
  TempDir dir;
  // The gzip stream is complete but holds a short IDX file.
  std::string images = IdxImages(3, 4, 4);
  images.resize(20);
  WriteGzipFile(dir.Path("images.gz"), images);
  WriteFile(dir.Path("labels"), IdxLabels({1, 2, 3}));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images.gz"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ds.status().message(), HasSubstr("images.gz"));
  EXPECT_THAT(ds.status().message(), HasSubstr("decompressed byte offset 20"));
}

TEST(IdxReaderTest, CutGzipStreamIsDataLoss) {
  TempDir dir;
  std::string gz = Gzip(IdxImages(50, 8, 8));
  gz.resize(gz.size() / 2);
  WriteFile(dir.Path("images.gz"), gz);
  WriteFile(dir.Path("labels"), IdxLabels(std::vector<uint8_t>(50, 1)));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images.gz"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ds.status().message(), HasSubstr("images.gz"));
  EXPECT_THAT(ds.status().message(), HasSubstr("gzip"));
}

TEST(IdxReaderTest, TruncatedLabelsFile) {
  TempDir dir;
  std::string labels = IdxLabels({1, 2, 3});
  labels.pop_back();
  WriteFile(dir.Path("images"), IdxImages(3, 2, 2));
  WriteFile(dir.Path("labels"), labels);
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ds.status().message(), HasSubstr(dir.Path("labels")));
  EXPECT_THAT(ds.status().message(), HasSubstr("byte offset 10"));
}

TEST(IdxReaderTest, TrailingBytesAreRejected) {
  TempDir dir;
  WriteFile(dir.Path("images"), IdxImages(2, 2, 2) + "xx");
  WriteFile(dir.Path("labels"), IdxLabels({1, 2}));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_THAT(ds.status().message(), HasSubstr("trailing"));
}

TEST(IdxReaderTest, WrongMagicIsRejected) {
  TempDir dir;
  WriteFile(dir.Path("images"), IdxImages(2, 2, 2, /*magic=*/0x00000801));
  WriteFile(dir.Path("labels"), IdxLabels({1, 2}));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ds.status().message(), HasSubstr("magic 0x00000801"));
  EXPECT_THAT(ds.status().message(), HasSubstr(dir.Path("images")));

  WriteFile(dir.Path("images"), IdxImages(2, 2, 2));
  WriteFile(dir.Path("labels"), IdxLabels({1, 2}, /*magic=*/0x00000803));
  ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_THAT(ds.status().message(), HasSubstr(dir.Path("labels")));
  EXPECT_THAT(ds.status().message(), HasSubstr("magic"));
}

TEST(IdxReaderTest, ShortHeaderIsRejected) {
  TempDir dir;
  WriteFile(dir.Path("images"), std::string("\x00\x00\x08", 3));
  WriteFile(dir.Path("labels"), IdxLabels({1}));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ds.status().message(), HasSubstr("byte offset 3"));
}

TEST(IdxReaderTest, ZeroImageSizeIsRejected) {
  TempDir dir;
  WriteFile(dir.Path("images"), IdxImages(2, 0, 5));
  WriteFile(dir.Path("labels"), IdxLabels({1, 2}));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(IdxReaderTest, MismatchedCountsAreRejected) {
  TempDir dir;
  WriteFile(dir.Path("images"), IdxImages(3, 2, 2));
  WriteFile(dir.Path("labels"), IdxLabels({1, 2}));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ds.status().message(), HasSubstr("label count 2"));
  EXPECT_THAT(ds.status().message(), HasSubstr("image count 3"));
}

TEST(IdxReaderTest, LabelOutOfRangeNamesOffset) {
  TempDir dir;
  WriteFile(dir.Path("images"), IdxImages(3, 2, 2));
  WriteFile(dir.Path("labels"), IdxLabels({1, 10, 2}));
  absl::StatusOr<ImageDataset> ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"));
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ds.status().message(), HasSubstr("label 10 at byte offset 9"));

  // A wider class range (e.g. EMNIST) accepts it.
  ds = ReadIdxPair(dir.Path("images"), dir.Path("labels"), /*max_classes=*/47);
  ASSERT_OK(ds);
  EXPECT_EQ(ds->num_classes, 11);
}

TEST(IdxReaderTest, ResolveMaybeGzPrefersRaw) {
  TempDir dir;
  WriteFile(dir.Path("x.gz"), "1");
  absl::StatusOr<std::string> path = ResolveMaybeGz(dir.path(), "x");
  ASSERT_OK(path);
  EXPECT_EQ(*path, dir.Path("x.gz"));
  WriteFile(dir.Path("x"), "1");
  path = ResolveMaybeGz(dir.path(), "x");
  ASSERT_OK(path);
  EXPECT_EQ(*path, dir.Path("x"));
  EXPECT_EQ(ResolveMaybeGz(dir.path(), "y").status().code(), absl::StatusCode::kNotFound);
}

TEST(IdxReaderTest, ReadFileContentsJoinsConcatenatedGzipMembers) {
  TempDir dir;
  WriteFile(dir.Path("two.gz"), Gzip("hello ") + Gzip("world"));
  absl::StatusOr<FileContents> contents = ReadFileContents(dir.Path("two.gz"));
  ASSERT_OK(contents);
  EXPECT_TRUE(contents->gzip);
  EXPECT_EQ(contents->bytes, "hello world");
  EXPECT_EQ(ReadWholeFile(dir.Path("two.gz")).substr(0, 2), "\x1f\x8b");
}

TEST(IdxReaderTest, LoadDatasetAppliesLimits) {
  TempDir dir;
  WriteFile(dir.Path("train-images-idx3-ubyte"), IdxImages(6, 2, 2));
  WriteFile(dir.Path("train-labels-idx1-ubyte"), IdxLabels({0, 1, 2, 3, 4, 5}));
  WriteFile(dir.Path("t10k-images-idx3-ubyte"), IdxImages(3, 2, 2));
  WriteFile(dir.Path("t10k-labels-idx1-ubyte"), IdxLabels({7, 8, 9}));
  pstrain::v1::DatasetSpec spec;
  spec.set_format(pstrain::v1::DATASET_FORMAT_IDX);
  spec.set_path(dir.path());
  spec.set_train_limit(4);
  spec.set_test_limit(100);
  absl::StatusOr<DatasetSplits> splits = LoadDataset(spec);
  ASSERT_OK(splits);
  EXPECT_EQ(splits->train.size(), 4);
  EXPECT_EQ(splits->train.pixels.size(), 16u);
  EXPECT_EQ(splits->test.size(), 3);
  EXPECT_EQ(splits->train.num_classes, 10);

  spec.set_train_limit(-1);
  EXPECT_EQ(LoadDataset(spec).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain::data
