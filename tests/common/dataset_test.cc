// Shuffling, sharding, normalisation and augmentation.
#include "common/data/dataset.h"
#include "common/data/load_dataset.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::data {
namespace {

std::vector<int64_t> Sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

TEST(EpochOrderTest, SingleWorkerShuffleIsAPermutation) {
  for (int64_t n : {1, 2, 7, 100, 1000}) {
    std::vector<int64_t> order = EpochOrder(n, /*seed=*/42, /*epoch=*/0, 0, 1, true);
    EXPECT_EQ(Sorted(order), Iota(n)) << "n=" << n;
  }
}

TEST(EpochOrderTest, ShuffleActuallyShuffles) {
  std::vector<int64_t> order = EpochOrder(1000, 1, 0, 0, 1, true);
  EXPECT_NE(order, Iota(1000));
  // A fixed point count far from the expected 1 would mean a broken shuffle.
  int fixed = 0;
  for (int64_t i = 0; i < 1000; ++i) fixed += order[i] == i;
  EXPECT_LT(fixed, 10);
  // The first element takes many values across epochs.
  std::set<int64_t> firsts;
  for (int epoch = 0; epoch < 50; ++epoch) firsts.insert(EpochOrder(1000, 1, epoch, 0, 1, true)[0]);
  EXPECT_GT(firsts.size(), 40u);
}

TEST(EpochOrderTest, ShuffleIsRoughlyUniform) {
  // Where element 0 lands, over many epochs of a 4-element shuffle: each of
  // the 4 positions expects 1000 of 4000; 850..1150 is > 5 sigma wide.
  std::vector<int> position_counts(4, 0);
  for (int epoch = 0; epoch < 4000; ++epoch) {
    std::vector<int64_t> order = EpochOrder(4, 9, epoch, 0, 1, true);
    position_counts[std::find(order.begin(), order.end(), 0) - order.begin()]++;
  }
  for (int p = 0; p < 4; ++p) {
    EXPECT_GT(position_counts[p], 850) << p;
    EXPECT_LT(position_counts[p], 1150) << p;
  }
}

TEST(EpochOrderTest, ShardsAreDisjointCoverAndBalanced) {
  for (int64_t n : {1, 5, 103, 1000}) {
    for (int world : {1, 2, 3, 4, 7}) {
      for (bool shuffle : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " world=" << world << " shuffle=" << shuffle);
        std::vector<int64_t> all;
        int64_t min_size = n, max_size = 0;
        for (int rank = 0; rank < world; ++rank) {
          std::vector<int64_t> shard = EpochOrder(n, 5, 3, rank, world, shuffle);
          EXPECT_EQ(static_cast<int64_t>(shard.size()), ShardSize(n, rank, world));
          min_size = std::min<int64_t>(min_size, shard.size());
          max_size = std::max<int64_t>(max_size, shard.size());
          all.insert(all.end(), shard.begin(), shard.end());
        }
        EXPECT_EQ(Sorted(all), Iota(n));  // Disjoint and covering.
        EXPECT_LE(max_size - min_size, 1);
        // The shards are consecutive slices of the single-worker order.
        EXPECT_EQ(all, EpochOrder(n, 5, 3, 0, 1, shuffle));
      }
    }
  }
}

TEST(EpochOrderTest, WithoutShuffleShardsAreContiguousRanges) {
  EXPECT_THAT(EpochOrder(10, 1, 0, 0, 3, false), ::testing::ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(EpochOrder(10, 1, 0, 1, 3, false), ::testing::ElementsAre(4, 5, 6));
  EXPECT_THAT(EpochOrder(10, 1, 7, 2, 3, false), ::testing::ElementsAre(7, 8, 9));
}

TEST(EpochOrderTest, DeterministicAndSeedAndEpochDependent) {
  EXPECT_EQ(EpochOrder(500, 11, 2, 1, 3, true), EpochOrder(500, 11, 2, 1, 3, true));
  EXPECT_NE(EpochOrder(500, 11, 2, 1, 3, true), EpochOrder(500, 11, 3, 1, 3, true));
  EXPECT_NE(EpochOrder(500, 11, 2, 1, 3, true), EpochOrder(500, 12, 2, 1, 3, true));
  // Different epochs give different shards to the same rank (not just a
  // reordering of the same samples).
  EXPECT_NE(Sorted(EpochOrder(500, 11, 2, 0, 2, true)), Sorted(EpochOrder(500, 11, 3, 0, 2, true)));
}

TEST(EpochOrderTest, InvalidArgumentsGiveEmptyOrders) {
  EXPECT_TRUE(EpochOrder(0, 1, 0, 0, 1, true).empty());
  EXPECT_TRUE(EpochOrder(-5, 1, 0, 0, 1, true).empty());
  EXPECT_TRUE(EpochOrder(10, 1, 0, 0, 0, true).empty());
  EXPECT_TRUE(EpochOrder(10, 1, 0, 3, 3, true).empty());
  EXPECT_TRUE(EpochOrder(10, 1, 0, -1, 3, true).empty());
  // More workers than samples: the last ranks get nothing.
  EXPECT_EQ(EpochOrder(2, 1, 0, 0, 4, true).size(), 1u);
  EXPECT_TRUE(EpochOrder(2, 1, 0, 3, 4, true).empty());
}

// Issue 12 (class-balanced sampling): with classes of 10, 3 and 0 and 1
// samples, every present class appears 10 times per epoch; a class of k
// samples repeats each floor(10 / k) times and 10 mod k of them once more,
// chosen per epoch and the same on every call.
TEST(BalancedEpochTest, EveryPresentClassComesAsOftenAsTheLargest) {
  std::vector<int32_t> labels;
  for (int i = 0; i < 10; ++i) labels.push_back(0);
  for (int i = 0; i < 3; ++i) labels.push_back(1);
  labels.push_back(3);  // Class 2 has no sample.
  EXPECT_EQ(BalancedEpochLength(labels, 4), 30);
  std::set<std::vector<int64_t>> epochs;
  for (int epoch = 0; epoch < 6; ++epoch) {
    const std::vector<int64_t> samples = BalancedEpochSamples(labels, 4, /*seed=*/5, epoch);
    ASSERT_EQ(samples.size(), 30u);
    std::vector<int> per_class(4, 0), per_sample(labels.size(), 0);
    for (int64_t s : samples) {
      ASSERT_GE(s, 0);
      ASSERT_LT(s, static_cast<int64_t>(labels.size()));
      ++per_class[labels[s]];
      ++per_sample[s];
    }
    EXPECT_THAT(per_class, ::testing::ElementsAre(10, 10, 0, 10));
    for (int i = 0; i < 10; ++i) EXPECT_EQ(per_sample[i], 1);
    int fours = 0;
    for (int i = 10; i < 13; ++i) {
      EXPECT_TRUE(per_sample[i] == 3 || per_sample[i] == 4) << i;
      fours += per_sample[i] == 4;
    }
    EXPECT_EQ(fours, 1);  // 10 mod 3 drawn without replacement.
    EXPECT_EQ(per_sample[13], 10);
    EXPECT_EQ(samples, BalancedEpochSamples(labels, 4, 5, epoch));
    epochs.insert(samples);
  }
  EXPECT_GT(epochs.size(), 1u);  // The extra draws change with the epoch.
  // Already balanced: each sample once.
  EXPECT_EQ(Sorted(BalancedEpochSamples({0, 1, 1, 0}, 2, 1, 0)), Iota(4));
  EXPECT_TRUE(BalancedEpochSamples({}, 3, 1, 0).empty());
  EXPECT_EQ(BalancedEpochLength({}, 3), 0);
}

TEST(PreprocessTest, FromSpecReadsAndValidates) {
  pstrain::v1::DatasetSpec spec;
  spec.add_mean(0.5f);
  spec.add_std(0.25f);
  spec.mutable_augmentation()->set_random_flip(true);
  spec.mutable_augmentation()->set_crop_padding(4);
  absl::StatusOr<Preprocess> pre = Preprocess::FromSpec(spec, 3);
  ASSERT_OK(pre);
  EXPECT_THAT(pre->mean, ::testing::ElementsAre(0.5f));
  EXPECT_THAT(pre->std, ::testing::ElementsAre(0.25f));
  EXPECT_TRUE(pre->random_flip);
  EXPECT_EQ(pre->crop_padding, 4);

  spec.add_mean(0.1f);  // Two values for three channels.
  EXPECT_EQ(Preprocess::FromSpec(spec, 3).status().code(), absl::StatusCode::kInvalidArgument);
  spec.add_mean(0.2f);
  EXPECT_OK(Preprocess::FromSpec(spec, 3));

  spec.set_std(0, 0.f);
  EXPECT_EQ(Preprocess::FromSpec(spec, 3).status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_std(0, 1.f);
  spec.mutable_augmentation()->set_crop_padding(-1);
  EXPECT_EQ(Preprocess::FromSpec(spec, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

// Two samples of 2 channels x 2 x 3.
ImageDataset TinyDataset() {
  ImageDataset ds;
  ds.channels = 2;
  ds.height = 2;
  ds.width = 3;
  ds.num_classes = 4;
  ds.pixels = {
      // Sample 0: channel 0, channel 1.
      0, 255, 51, 102, 153, 204,  //
      51, 51, 51, 0, 0, 255,      //
      // Sample 1.
      1, 2, 3, 4, 5, 6,  //
      7, 8, 9, 10, 11, 12,
  };
  ds.labels = {3, 1};
  return ds;
}

TEST(AssembleBatchTest, ScalesAndNormalisesPerChannel) {
  ImageDataset ds = TinyDataset();
  ASSERT_OK(ds.Validate("tiny"));
  Preprocess pre;
  pre.mean = {0.5f, 0.25f};
  pre.std = {0.5f, 0.25f};
  std::vector<int64_t> idx = {1, 0};
  std::vector<float> images(2 * 12);
  std::vector<int32_t> labels(2);
  AssembleBatch(ds, idx, pre, /*augment=*/false, 0, images.data(), labels.data());
  EXPECT_THAT(labels, ::testing::ElementsAre(1, 3));
  const float* s0 = images.data() + 12;  // Sample 0 is second in the batch.
  EXPECT_NEAR(s0[0], -1.f, 1e-6);        // (0 - 0.5) / 0.5
  EXPECT_NEAR(s0[1], 1.f, 1e-6);         // (1 - 0.5) / 0.5
  EXPECT_NEAR(s0[2], -0.6f, 1e-6);       // (0.2 - 0.5) / 0.5
  EXPECT_NEAR(s0[6], -0.2f, 1e-6);       // (0.2 - 0.25) / 0.25
  EXPECT_NEAR(s0[9], -1.f, 1e-6);        // (0 - 0.25) / 0.25
  EXPECT_NEAR(s0[11], 3.f, 1e-6);        // (1 - 0.25) / 0.25
  EXPECT_NEAR(images[0], (1 / 255.f - 0.5f) / 0.5f, 1e-6);

  // No mean/std: plain [0, 1] scaling; one value broadcasts.
  AssembleBatch(ds, idx, Preprocess{}, false, 0, images.data(), labels.data());
  EXPECT_NEAR(images[12 + 1], 1.f, 1e-6);
  EXPECT_NEAR(images[12 + 2], 0.2f, 1e-6);
  Preprocess one;
  one.mean = {0.2f};
  one.std = {2.f};
  AssembleBatch(ds, idx, one, false, 0, images.data(), labels.data());
  EXPECT_NEAR(images[12 + 1], 0.4f, 1e-6);
  EXPECT_NEAR(images[12 + 11], 0.4f, 1e-6);
}

TEST(AssembleBatchTest, AugmentFalseIgnoresFlipAndCrop) {
  ImageDataset ds = TinyDataset();
  Preprocess plain, aug;
  aug.random_flip = true;
  aug.crop_padding = 2;
  std::vector<int64_t> idx = {0, 1};
  std::vector<float> a(24), b(24);
  std::vector<int32_t> labels(2);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    AssembleBatch(ds, idx, plain, false, seed, a.data(), labels.data());
    AssembleBatch(ds, idx, aug, false, seed, b.data(), labels.data());
    EXPECT_EQ(a, b);
  }
}

// A single-channel 3x3 image 1..9.
ImageDataset Grid3x3() {
  ImageDataset ds;
  ds.channels = 1;
  ds.height = 3;
  ds.width = 3;
  ds.num_classes = 1;
  ds.pixels = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  ds.labels = {0};
  return ds;
}

// Pixel values (x 255) of the image at batch position 0.
std::vector<int> AsPixels(const std::vector<float>& images) {
  std::vector<int> out;
  for (float v : images) out.push_back(static_cast<int>(std::lround(v * 255.f)));
  return out;
}

TEST(AssembleBatchTest, FlipMirrorsRowsAboutHalfTheTime) {
  ImageDataset ds = Grid3x3();
  Preprocess pre;
  pre.random_flip = true;
  std::vector<int64_t> idx = {0};
  std::vector<float> out(9);
  int32_t label = 0;
  int flipped = 0;
  const std::vector<int> identity = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<int> mirrored = {3, 2, 1, 6, 5, 4, 9, 8, 7};
  for (uint64_t seed = 0; seed < 400; ++seed) {
    AssembleBatch(ds, idx, pre, true, seed, out.data(), &label);
    std::vector<int> pixels = AsPixels(out);
    ASSERT_TRUE(pixels == identity || pixels == mirrored) << "seed " << seed;
    flipped += pixels == mirrored;
  }
  EXPECT_GT(flipped, 150);
  EXPECT_LT(flipped, 250);
}

TEST(AssembleBatchTest, CropShiftsWithZeroPaddingOverAllOffsets) {
  ImageDataset ds = Grid3x3();
  Preprocess pre;
  pre.crop_padding = 1;
  pre.mean = {0.5f};  // Padding is a black pixel before normalisation.
  pre.std = {0.5f};
  std::vector<int64_t> idx = {0};
  std::vector<float> out(9);
  int32_t label = 0;
  std::set<std::pair<int, int>> seen;
  for (uint64_t seed = 0; seed < 300; ++seed) {
    AssembleBatch(ds, idx, pre, true, seed, out.data(), &label);
    // Undo normalisation: pixel = (x * 0.5 + 0.5) * 255.
    std::vector<int> pixels;
    for (float v : out) pixels.push_back(static_cast<int>(std::lround((v * 0.5f + 0.5f) * 255.f)));
    bool matched = false;
    for (int dy = -1; dy <= 1 && !matched; ++dy) {
      for (int dx = -1; dx <= 1 && !matched; ++dx) {
        std::vector<int> expected(9);
        for (int y = 0; y < 3; ++y) {
          for (int x = 0; x < 3; ++x) {
            const int sy = y + dy, sx = x + dx;
            expected[y * 3 + x] = (sy >= 0 && sy < 3 && sx >= 0 && sx < 3) ? sy * 3 + sx + 1 : 0;
          }
        }
        if (pixels == expected) {
          matched = true;
          seen.insert({dy, dx});
        }
      }
    }
    ASSERT_TRUE(matched) << "seed " << seed << " gave no shift of the image";
  }
  EXPECT_EQ(seen.size(), 9u);  // Every offset in [-1, 1]^2 occurs.
}

TEST(AssembleBatchTest, AugmentationIsDeterministicPerSeedAndPosition) {
  ImageDataset ds = TinyDataset();
  Preprocess pre;
  pre.random_flip = true;
  pre.crop_padding = 1;
  std::vector<int64_t> idx = {0, 0, 0, 0, 0, 0, 0, 0};
  std::vector<float> a(8 * 12), b(8 * 12);
  std::vector<int32_t> labels(8);
  AssembleBatch(ds, idx, pre, true, 77, a.data(), labels.data());
  AssembleBatch(ds, idx, pre, true, 77, b.data(), labels.data());
  EXPECT_EQ(a, b);
  // The same sample at different positions gets independent draws.
  bool positions_differ = false;
  for (int j = 1; j < 8; ++j) {
    positions_differ |= !std::equal(a.begin(), a.begin() + 12, a.begin() + 12 * j);
  }
  EXPECT_TRUE(positions_differ);
  AssembleBatch(ds, idx, pre, true, 78, b.data(), labels.data());
  EXPECT_NE(a, b);
}

TEST(ImageDatasetTest, ValidateAndTruncate) {
  ImageDataset ds = TinyDataset();
  EXPECT_OK(ds.Validate("tiny"));
  EXPECT_EQ(ds.sample_elements(), 12);
  EXPECT_EQ(ds.image(1)[0], 1);
  ds.labels[1] = 4;
  EXPECT_EQ(ds.Validate("tiny").code(), absl::StatusCode::kInvalidArgument);
  ds.labels[1] = 1;
  ds.pixels.pop_back();
  EXPECT_EQ(ds.Validate("tiny").code(), absl::StatusCode::kInvalidArgument);
  ds = TinyDataset();
  ds.Truncate(1);
  EXPECT_EQ(ds.size(), 1);
  EXPECT_EQ(ds.pixels.size(), 12u);
  EXPECT_OK(ds.Validate("tiny"));
  ds.Truncate(0);  // 0 means no limit.
  EXPECT_EQ(ds.size(), 1);
}

TEST(LoadDatasetTest, RejectsUnspecifiedFormatAndEmptyPath) {
  pstrain::v1::DatasetSpec spec;
  EXPECT_EQ(LoadDataset(spec).status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_path("/nonexistent");
  absl::Status status = LoadDataset(spec).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), ::testing::HasSubstr("DATASET_FORMAT_UNSPECIFIED"));
}


TEST(SyntheticDatasetTest, ShapeLabelsAndDeterminism) {
  pstrain::v1::DatasetSpec spec;
  spec.set_format(pstrain::v1::DATASET_FORMAT_SYNTHETIC);
  auto* syn = spec.mutable_synthetic();
  syn->set_channels(3);
  syn->set_height(8);
  syn->set_width(6);
  syn->set_num_classes(5);
  syn->set_train_samples(40);
  syn->set_test_samples(10);
  syn->set_seed(9);
  auto a = LoadDataset(spec);
  ASSERT_OK(a);
  EXPECT_EQ(a->train.size(), 40);
  EXPECT_EQ(a->test.size(), 10);
  EXPECT_EQ(a->train.sample_elements(), 3 * 8 * 6);
  EXPECT_EQ(a->train.num_classes, 5);
  for (int32_t label : a->train.labels) EXPECT_TRUE(label >= 0 && label < 5);
  auto b = LoadDataset(spec);
  ASSERT_OK(b);
  EXPECT_EQ(a->train.pixels, b->train.pixels);
  EXPECT_NE(a->train.pixels, std::vector<uint8_t>(a->train.pixels.size(), a->train.pixels[0]));
  syn->set_num_classes(1);
  EXPECT_EQ(LoadDataset(spec).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain::data
