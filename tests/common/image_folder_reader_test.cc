#include "common/data/image_folder_reader.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "common/data/dataset.h"
#include "common/data/load_dataset.h"
#include "common/data/image_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/data_test_util.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::data {
namespace {

using ::pstrain::data::testing::TempDir;
using ::pstrain::data::testing::WriteFile;
using ::testing::HasSubstr;

DecodedImage Solid(int width, int height, std::vector<uint8_t> color) {
  DecodedImage image;
  image.width = width;
  image.height = height;
  image.channels = static_cast<int>(color.size());
  for (int i = 0; i < width * height; ++i) {
    image.pixels.insert(image.pixels.end(), color.begin(), color.end());
  }
  return image;
}

std::string Png(const DecodedImage& image) {
  absl::StatusOr<std::string> bytes = EncodePng(image);
  EXPECT_OK(bytes);
  return bytes.ok() ? *bytes : std::string();
}

std::string Jpeg(const DecodedImage& image) {
  absl::StatusOr<std::string> bytes = EncodeJpeg(image, 95);
  EXPECT_OK(bytes);
  return bytes.ok() ? *bytes : std::string();
}

// A 2x2 RGB image with four distinct pixels.
DecodedImage Quad() {
  DecodedImage image;
  image.width = 2;
  image.height = 2;
  image.channels = 3;
  image.pixels = {10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120};
  return image;
}

// A 4x4 gray ramp: pixel k = 17 * k.
DecodedImage Ramp() {
  DecodedImage image;
  image.width = 4;
  image.height = 4;
  image.channels = 1;
  for (int k = 0; k < 16; ++k) image.pixels.push_back(static_cast<uint8_t>(17 * k));
  return image;
}

// train/cat: a.png (Quad), b.jpg (solid orange); train/dog: c.png (Ramp),
// d.jpeg (solid gray), README.txt; test/dog: e.png (Quad).
void WriteSmallTree(const TempDir& dir) {
  WriteFile(dir.Path("train/cat/a.png"), Png(Quad()));
  WriteFile(dir.Path("train/cat/b.jpg"), Jpeg(Solid(8, 8, {200, 100, 50})));
  WriteFile(dir.Path("train/dog/c.png"), Png(Ramp()));
  WriteFile(dir.Path("train/dog/d.JPEG"), Jpeg(Solid(8, 8, {120})));
  WriteFile(dir.Path("train/dog/README.txt"), "not an image");
  WriteFile(dir.Path("test/dog/e.png"), Png(Quad()));
}

ImageFolderOptions Options4x4(int threads = 1) {
  ImageFolderOptions options;
  options.height = 4;
  options.width = 4;
  options.channels = 3;
  options.threads = threads;
  return options;
}

TEST(ImageCodecTest, PngRoundTripIsExact) {
  for (const DecodedImage& image : {Quad(), Ramp()}) {
    absl::StatusOr<DecodedImage> decoded = DecodeImage(Png(image), "mem.png");
    ASSERT_OK(decoded);
    EXPECT_EQ(decoded->width, image.width);
    EXPECT_EQ(decoded->height, image.height);
    EXPECT_EQ(decoded->channels, image.channels);
    EXPECT_EQ(decoded->pixels, image.pixels);
  }
}

TEST(ImageCodecTest, JpegRoundTripIsClose) {
  absl::StatusOr<DecodedImage> decoded = DecodeImage(Jpeg(Solid(16, 8, {200, 100, 50})), "m");
  ASSERT_OK(decoded);
  EXPECT_EQ(decoded->width, 16);
  EXPECT_EQ(decoded->height, 8);
  ASSERT_EQ(decoded->channels, 3);
  for (size_t i = 0; i < decoded->pixels.size(); i += 3) {
    EXPECT_NEAR(decoded->pixels[i], 200, 4);
    EXPECT_NEAR(decoded->pixels[i + 1], 100, 4);
    EXPECT_NEAR(decoded->pixels[i + 2], 50, 4);
  }
  absl::StatusOr<DecodedImage> gray = DecodeImage(Jpeg(Solid(8, 8, {77})), "g");
  ASSERT_OK(gray);
  EXPECT_EQ(gray->channels, 1);
  EXPECT_NEAR(gray->pixels[0], 77, 2);
}

// Found by jpeg_fuzzer: the size check came after jpeg_start_decompress,
// which for a progressive image allocates every coefficient of the whole
// image, so a header claiming 65496 x 65350 made libjpeg allocate 12.8 GB
// before the check could refuse it. Now the header is checked first.
TEST(ImageCodecTest, AHugeJpegHeaderIsRefusedBeforeLibjpegAllocatesForIt) {
  std::string jpeg = Jpeg(Solid(16, 8, {200, 100, 50}));
  const size_t sof = jpeg.find("\xff\xc0");
  ASSERT_NE(sof, std::string::npos);
  jpeg[sof + 1] = '\xc2';  // Progressive.
  // Precision at sof + 4, then height and width, big-endian.
  jpeg[sof + 5] = '\xff';
  jpeg[sof + 6] = '\xd8';
  jpeg[sof + 7] = '\xff';
  jpeg[sof + 8] = '\x46';
  absl::StatusOr<DecodedImage> decoded = DecodeImage(jpeg, "huge.jpg");
  ASSERT_FALSE(decoded.ok());
  EXPECT_THAT(std::string(decoded.status().message()), HasSubstr("dimensions out of range"));
}

TEST(ImageCodecTest, ResizeIsNearestNeighbour) {
  // Upscale 2x2 -> 4x4: each source pixel becomes a 2x2 block.
  std::vector<uint8_t> out(3 * 16);
  ResizeToChw(Quad(), 3, 4, 4, out.data());
  const int expected_red[16] = {10, 10, 40, 40, 10, 10, 40, 40, 70, 70, 100, 100, 70, 70, 100, 100};
  for (int k = 0; k < 16; ++k) {
    EXPECT_EQ(out[k], expected_red[k]) << k;
    EXPECT_EQ(out[16 + k], expected_red[k] + 10) << k;
    EXPECT_EQ(out[32 + k], expected_red[k] + 20) << k;
  }
  // Downscale the 4x4 ramp to 2x2: centres land on source (1,1), (1,3), (3,1), (3,3).
  std::vector<uint8_t> small(4);
  ResizeToChw(Ramp(), 1, 2, 2, small.data());
  EXPECT_THAT(small, ::testing::ElementsAre(17 * 5, 17 * 7, 17 * 13, 17 * 15));
  // RGB -> gray uses the BT.601 luma.
  std::vector<uint8_t> gray(1);
  ResizeToChw(Solid(1, 1, {200, 100, 50}), 1, 1, 1, gray.data());
  EXPECT_EQ(gray[0], (299 * 200 + 587 * 100 + 114 * 50 + 500) / 1000);
}

TEST(ImageFolderReaderTest, ReadsJpegAndPngWithSortedClasses) {
  TempDir dir;
  WriteSmallTree(dir);
  absl::StatusOr<DatasetSplits> splits = LoadImageFolderDataset(dir.path(), Options4x4());
  ASSERT_OK(splits);
  const ImageDataset& train = splits->train;
  ASSERT_EQ(train.size(), 4);
  EXPECT_EQ(train.channels, 3);
  EXPECT_EQ(train.height, 4);
  EXPECT_EQ(train.width, 4);
  EXPECT_EQ(train.num_classes, 2);
  EXPECT_THAT(train.labels, ::testing::ElementsAre(0, 0, 1, 1));

  // a.png upscaled: top-left block is (10, 20, 30), bottom-right (100, 110, 120).
  const uint8_t* a = train.image(0);
  EXPECT_EQ(a[0], 10);
  EXPECT_EQ(a[16], 20);
  EXPECT_EQ(a[32], 30);
  EXPECT_EQ(a[15], 100);
  EXPECT_EQ(a[47], 120);
  // b.jpg: solid orange, JPEG-close.
  const uint8_t* b = train.image(1);
  for (int k = 0; k < 16; ++k) {
    EXPECT_NEAR(b[k], 200, 4);
    EXPECT_NEAR(b[16 + k], 100, 4);
    EXPECT_NEAR(b[32 + k], 50, 4);
  }
  // c.png: gray ramp replicated into three channels.
  const uint8_t* c = train.image(2);
  for (int k = 0; k < 16; ++k) {
    EXPECT_EQ(c[k], 17 * k);
    EXPECT_EQ(c[16 + k], 17 * k);
    EXPECT_EQ(c[32 + k], 17 * k);
  }
  // d.JPEG (upper-case extension): gray, replicated.
  EXPECT_NEAR(train.image(3)[0], 120, 2);
  EXPECT_NEAR(train.image(3)[47], 120, 2);

  ASSERT_EQ(splits->test.size(), 1);
  EXPECT_EQ(splits->test.labels[0], 1);  // "dog" keeps its training index.
  EXPECT_EQ(splits->test.num_classes, 2);
}

TEST(ImageFolderReaderTest, ThreadCountDoesNotChangeTheResult) {
  TempDir dir;
  for (int i = 0; i < 24; ++i) {
    const std::string cls = i % 3 == 0 ? "a" : (i % 3 == 1 ? "b" : "c");
    DecodedImage image = Solid(5 + i % 4, 3 + i % 5, {static_cast<uint8_t>(i * 10), 7, 9});
    image.pixels[0] = static_cast<uint8_t>(255 - i);
    const std::string name = "train/" + cls + "/img" + std::to_string(100 + i);
    WriteFile(dir.Path(name + (i % 2 ? ".png" : ".jpg")), i % 2 ? Png(image) : Jpeg(image));
  }
  WriteFile(dir.Path("test/a/x.png"), Png(Quad()));
  absl::StatusOr<DatasetSplits> one = LoadImageFolderDataset(dir.path(), Options4x4(1));
  absl::StatusOr<DatasetSplits> three = LoadImageFolderDataset(dir.path(), Options4x4(3));
  ASSERT_OK(one);
  ASSERT_OK(three);
  EXPECT_EQ(one->train.size(), 24);
  EXPECT_EQ(one->train.num_classes, 3);
  EXPECT_EQ(one->train.pixels, three->train.pixels);
  EXPECT_EQ(one->train.labels, three->train.labels);
}

TEST(ImageFolderReaderTest, TruncatedJpegIsAnErrorNamingTheFile) {
  TempDir dir;
  WriteSmallTree(dir);
  std::string jpeg = Jpeg(Solid(32, 32, {1, 2, 3}));
  WriteFile(dir.Path("train/cat/broken.jpg"), jpeg.substr(0, jpeg.size() / 2));
  absl::StatusOr<DatasetSplits> splits = LoadImageFolderDataset(dir.path(), Options4x4(2));
  ASSERT_FALSE(splits.ok());
  EXPECT_EQ(splits.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(splits.status().message(), HasSubstr(dir.Path("train/cat/broken.jpg")));
}

TEST(ImageFolderReaderTest, GarbageJpegIsAnErrorNamingTheFile) {
  TempDir dir;
  WriteSmallTree(dir);
  WriteFile(dir.Path("train/dog/zz.jpg"), std::string("\xFF\xD8\xFF", 3) + std::string(200, 'x'));
  absl::StatusOr<DatasetSplits> splits = LoadImageFolderDataset(dir.path(), Options4x4());
  ASSERT_FALSE(splits.ok());
  EXPECT_THAT(splits.status().message(), HasSubstr(dir.Path("train/dog/zz.jpg")));
  EXPECT_THAT(splits.status().message(), HasSubstr("corrupt JPEG"));
}

TEST(ImageFolderReaderTest, CorruptPngIsAnErrorNamingTheFile) {
  TempDir dir;
  WriteSmallTree(dir);
  std::string png = Png(Solid(16, 16, {5, 6, 7}));
  WriteFile(dir.Path("test/dog/cut.png"), png.substr(0, png.size() - 20));
  absl::StatusOr<DatasetSplits> splits = LoadImageFolderDataset(dir.path(), Options4x4());
  ASSERT_FALSE(splits.ok());
  EXPECT_THAT(splits.status().message(), HasSubstr(dir.Path("test/dog/cut.png")));
}

TEST(ImageFolderReaderTest, NonImageBytesWithImageExtensionIsAnError) {
  TempDir dir;
  WriteSmallTree(dir);
  WriteFile(dir.Path("train/cat/text.png"), "hello, not a png");
  absl::StatusOr<DatasetSplits> splits = LoadImageFolderDataset(dir.path(), Options4x4());
  ASSERT_FALSE(splits.ok());
  EXPECT_THAT(splits.status().message(), HasSubstr(dir.Path("train/cat/text.png")));
}

TEST(ImageFolderReaderTest, TestClassUnknownToTrainingIsAnError) {
  TempDir dir;
  WriteSmallTree(dir);
  WriteFile(dir.Path("test/bird/x.png"), Png(Quad()));
  absl::StatusOr<DatasetSplits> splits = LoadImageFolderDataset(dir.path(), Options4x4());
  ASSERT_FALSE(splits.ok());
  EXPECT_THAT(splits.status().message(), HasSubstr("bird"));
}

TEST(ImageFolderReaderTest, MissingDirectoriesAndSizesAreErrors) {
  TempDir dir;
  EXPECT_EQ(LoadImageFolderDataset(dir.path(), Options4x4()).status().code(),
            absl::StatusCode::kNotFound);
  WriteSmallTree(dir);
  ImageFolderOptions no_size = Options4x4();
  no_size.height = 0;
  EXPECT_EQ(LoadImageFolderDataset(dir.path(), no_size).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ImageFolderReaderTest, LoadDatasetUsesSpecSizeAndThreads) {
  TempDir dir;
  WriteSmallTree(dir);
  pstrain::v1::DatasetSpec spec;
  spec.set_format(pstrain::v1::DATASET_FORMAT_IMAGE_FOLDER);
  spec.set_path(dir.path());
  EXPECT_EQ(LoadDataset(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_image_height(6);
  spec.set_image_width(3);
  spec.set_loader_threads(2);
  absl::StatusOr<DatasetSplits> splits = LoadDataset(spec);
  ASSERT_OK(splits);
  EXPECT_EQ(splits->train.height, 6);
  EXPECT_EQ(splits->train.width, 3);
  EXPECT_EQ(splits->train.channels, 3);
  EXPECT_EQ(splits->train.pixels.size(), 4u * 3 * 6 * 3);
}

}  // namespace
}  // namespace pstrain::data
