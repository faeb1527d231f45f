#include "common/data/packed_format.h"

#include <zlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>

#include "absl/synchronization/mutex.h"
#include "common/data/dataset.h"
#include "common/data/epoch_work.h"
#include "common/data/load_dataset.h"
#include "common/storage/storage.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::data {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::StatusIs;
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
    EXPECT_EQ(*b->CopyPixels(), *a->CopyPixels());
  }
}

// pstrain.spark's writers: each partition's task writes its shards at the
// places a counting pass gave them (in any order), the driver the labels.
TEST_F(PackedFormatTest, ShardsWrittenAtTheirPlacesReadAsOneSplit) {
  std::unique_ptr<storage::Storage> store = storage::NewLocalStorage();
  fs::create_directories(dir_);
  const PackedSplitWriter::Shape shape{3, 4, 5, 6};
  const int64_t sample = 3 * 4 * 5;
  auto shard = [&](const char* split, int begin, int end, ShardPlace place) {
    const ImageDataset& ds = std::string(split) == "train" ? splits_.train : splits_.test;
    return WritePackedShard(
        *store, dir_.string(), split, shape, place,
        absl::MakeConstSpan(ds.labels).subspan(begin, end - begin),
        absl::MakeConstSpan(ds.pixels).subspan(begin * sample, (end - begin) * sample));
  };
  // Partitions of 10 and 13 train rows, shards of at most 8: 2 + 2 shards.
  ASSERT_OK(shard("train", 18, 23, {.index = 3, .count = 4, .first_sample = 18}));
  ASSERT_OK(shard("train", 0, 8, {.index = 0, .count = 4, .first_sample = 0}));
  ASSERT_OK(shard("train", 10, 18, {.index = 2, .count = 4, .first_sample = 10}));
  ASSERT_OK(shard("train", 8, 10, {.index = 1, .count = 4, .first_sample = 8}));
  ASSERT_OK(shard("test", 0, 7, {.index = 0, .count = 1, .first_sample = 0}));
  ASSERT_OK(WritePackedLabels(*store, dir_.string(), "train", splits_.train.labels, 6));
  ASSERT_OK(WritePackedLabels(*store, dir_.string(), "test", splits_.test.labels, 6));
  absl::StatusOr<DatasetSplits> read = LoadPackedDataset(dir_.string());
  ASSERT_OK(read);
  EXPECT_EQ(read->train.labels, splits_.train.labels);
  EXPECT_EQ(*read->train.CopyPixels(), *splits_.train.CopyPixels());
  EXPECT_EQ(*read->test.CopyPixels(), *splits_.test.CopyPixels());
  absl::StatusOr<ImageDataset> streamed =
      LoadPackedSplit(dir_.string(), "train", *store, {.stream = true});
  ASSERT_OK(streamed);
  EXPECT_EQ(streamed->labels, splits_.train.labels);

  // A place or a label that does not fit is refused before anything is written.
  EXPECT_THAT(shard("train", 0, 8, {.index = 4, .count = 4, .first_sample = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a shard's place")));
  EXPECT_THAT(WritePackedShard(*store, dir_.string(), "train", shape,
                               {.index = 0, .count = 1, .first_sample = 0}, {0, 1},
                               absl::MakeConstSpan(splits_.train.pixels).subspan(0, sample)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pixel bytes")));
  std::vector<int32_t> bad = {6};
  EXPECT_THAT(WritePackedShard(*store, dir_.string(), "train", shape,
                               {.index = 0, .count = 1, .first_sample = 40}, bad,
                               absl::MakeConstSpan(splits_.train.pixels).subspan(0, sample)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("sample 40: label 6")));
  EXPECT_THAT(WritePackedLabels(*store, dir_.string(), "train", bad, 6),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("label 6 outside")));
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
  EXPECT_TRUE(*read->train.CopyPixels() == *original->train.CopyPixels());
  EXPECT_TRUE(read->train.labels == original->train.labels);
  EXPECT_TRUE(*read->test.CopyPixels() == *original->test.CopyPixels());
  EXPECT_TRUE(read->test.labels == original->test.labels);
}

// Local files read as a store would be: counts the bytes of ranged reads,
// and can flip a byte of a record's next `damaged_reads` reads (a link
// that damages bytes on the way).
class CountingStorage final : public storage::Storage {
 public:
  absl::StatusOr<storage::ObjectInfo> Stat(const std::string& uri) override {
    return local_->Stat(uri);
  }
  absl::StatusOr<std::string> Read(const std::string& uri) override {
    absl::StatusOr<std::string> bytes = local_->Read(uri);
    if (bytes.ok()) Count(static_cast<int64_t>(bytes->size()), true);
    return bytes;
  }
  absl::StatusOr<std::string> ReadRange(const std::string& uri, int64_t offset,
                                        int64_t length) override {
    {
      absl::MutexLock lock(&mu_);
      ++range_reads_;
      auto released = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !hold_; };
      mu_.Await(absl::Condition(&released));
      if (failures_left_ > 0) {
        --failures_left_;
        return absl::UnavailableError(absl::StrCat("S3 GET ", uri,
                                                   ": 503 SlowDown (gave up "
                                                   "after 8 attempts)"));
      }
    }
    absl::StatusOr<std::string> bytes = local_->ReadRange(uri, offset, length);
    if (!bytes.ok()) return bytes;
    Count(length, false);
    absl::MutexLock lock(&mu_);
    if (damage_at_ >= offset && damage_at_ < offset + length && damaged_reads_ > 0 &&
        uri == damage_uri_) {
      --damaged_reads_;
      (*bytes)[damage_at_ - offset] ^= 0x5a;
    }
    return bytes;
  }
  absl::StatusOr<std::vector<storage::ObjectInfo>> List(const std::string& dir) override {
    return local_->List(dir);
  }
  absl::StatusOr<std::vector<storage::ObjectInfo>> ListRecursive(const std::string& dir) override {
    return local_->ListRecursive(dir);
  }
  absl::Status Write(const std::string& uri, const std::string& bytes) override {
    return local_->Write(uri, bytes);
  }
  absl::Status Delete(const std::string& uri) override { return local_->Delete(uri); }
  absl::StatusOr<int> AbortIncompleteWrites(const std::string& dir) override { return 0; }

  void Damage(const std::string& uri, int64_t at, int reads) {
    absl::MutexLock lock(&mu_);
    damage_uri_ = uri;
    damage_at_ = at;
    damaged_reads_ = reads;
  }
  int64_t range_bytes() {
    absl::MutexLock lock(&mu_);
    return range_bytes_;
  }
  int range_reads() {
    absl::MutexLock lock(&mu_);
    return range_reads_;
  }
  // The next `n` ranged reads fail as a store's spent retries do.
  void Fail(int n) {
    absl::MutexLock lock(&mu_);
    failures_left_ = n;
  }
  // Ranged reads wait (a store that stopped answering) until Release().
  void Hold() {
    absl::MutexLock lock(&mu_);
    hold_ = true;
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    hold_ = false;
  }

 private:
  void Count(int64_t bytes, bool whole) {
    absl::MutexLock lock(&mu_);
    if (!whole) range_bytes_ += bytes;
  }
  std::unique_ptr<storage::Storage> local_ = storage::NewLocalStorage();
  absl::Mutex mu_;
  int64_t range_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::string damage_uri_ ABSL_GUARDED_BY(mu_);
  int64_t damage_at_ ABSL_GUARDED_BY(mu_) = -1;
  int damaged_reads_ ABSL_GUARDED_BY(mu_) = 0;
  int range_reads_ ABSL_GUARDED_BY(mu_) = 0;
  int failures_left_ ABSL_GUARDED_BY(mu_) = 0;
  bool hold_ ABSL_GUARDED_BY(mu_) = false;
};

// 3x32x32 images: 2,723 records of 3,080 bytes make an 8 MiB chunk, so
// 18,000 samples in 4 shards of 4,500 are 8 chunks.
class StreamedSplitTest : public PackedFormatTest {
 protected:
  void SetUp() override {
    PackedFormatTest::SetUp();
    splits_.train = Make(18000, 3, 32, 32, 10, 3);
    splits_.test = Make(500, 3, 32, 32, 10, 4);
    PackOptions options;
    options.records_per_shard = 4500;
    ASSERT_OK(WritePackedDataset(splits_, dir_.string(), options).status());
  }
  PackedReadOptions Streamed(int64_t window_bytes) const {
    PackedReadOptions options;
    options.stream = true;
    options.window_bytes = window_bytes;
    return options;
  }
  static constexpr int64_t kRecord = 3 * 32 * 32 + 8;
};

TEST_F(StreamedSplitTest, OpeningReadsHeadersAndLabelsThenTheSamplesAreTheWholeReadsOnes) {
  CountingStorage store;
  ASSERT_OK_AND_ASSIGN(ImageDataset streamed,
                       LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)));
  EXPECT_EQ(store.range_bytes(), 4 * kPackedHeaderBytes);  // No record read yet.
  ASSERT_NE(streamed.store, nullptr);
  const SampleStore::Chunks* chunks = streamed.store->chunks();
  ASSERT_NE(chunks, nullptr);
  // Each shard: 4,500 records = chunks of 2,723 and 1,777.
  EXPECT_THAT(chunks->starts,
              ::testing::ElementsAre(0, 2723, 4500, 7223, 9000, 11723, 13500, 16223));
  EXPECT_EQ(chunks->window_chunks, 1);
  EXPECT_EQ(streamed.labels, splits_.train.labels);
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> pixels, streamed.CopyPixels());
  EXPECT_TRUE(pixels == splits_.train.pixels);
  EXPECT_EQ(store.range_bytes(), 4 * kPackedHeaderBytes + 18000 * kRecord);  // Each chunk once.
}

TEST_F(StreamedSplitTest, EachWorkerOfAnEpochReadsAboutItsShareOfTheChunks) {
  for (int64_t window_chunks : {1, 2}) {
    int64_t total = 0;
    std::multiset<int64_t> trained;
    for (int rank = 0; rank < 2; ++rank) {
      CountingStorage store;  // One worker's.
      ASSERT_OK_AND_ASSIGN(ImageDataset ds, LoadPackedSplit(dir_.string(), "train", store,
                                                            Streamed(window_chunks * (8 << 20))));
      ASSERT_EQ(ds.store->chunks()->window_chunks, window_chunks);
      const std::vector<int64_t> order = TrainingOrder(ds, ds.size(), false, 7, 2);
      const WorkRange share = BaseRange(ds.size(), 2, rank, 2);
      std::vector<int64_t> mine(order.begin() + share.begin, order.begin() + share.end);
      ds.store->Plan(mine);
      for (size_t b = 0; b < mine.size(); b += 64) {
        const size_t n = std::min<size_t>(64, mine.size() - b);
        ASSERT_OK_AND_ASSIGN(std::shared_ptr<const void> lease, ds.Acquire(&mine[b], n));
        for (size_t k = b; k < b + n; ++k) {
          ASSERT_EQ(0, std::memcmp(ds.image(mine[k]), splits_.train.pixels.data() + mine[k] * 3072,
                                   3072));
        }
      }
      trained.insert(mine.begin(), mine.end());
      const int64_t read = store.range_bytes() - 4 * kPackedHeaderBytes;
      // Its share is half the samples; it reads their chunks, the window it
      // shares with the other worker at most twice: not the whole split.
      EXPECT_LE(read, (9000 + window_chunks * 2723) * kRecord) << rank << ", " << window_chunks;
      EXPECT_LT(read, 18000 * kRecord) << "rank " << rank << ", window " << window_chunks;
      total += read;
    }
    EXPECT_EQ(trained.size(), 18000u);
    for (int64_t i = 0; i < 18000; ++i) ASSERT_EQ(trained.count(i), 1u) << i;
    EXPECT_LE(total, (18000 + window_chunks * 2723) * kRecord);
  }
}

TEST_F(StreamedSplitTest, ASplitInOneWindowIsShuffledAsALocalOne) {
  CountingStorage store;
  ASSERT_OK_AND_ASSIGN(ImageDataset streamed,
                       LoadPackedSplit(dir_.string(), "train", store, Streamed(256 << 20)));
  ASSERT_OK_AND_ASSIGN(ImageDataset local, LoadPackedSplit(dir_.string(), "train"));
  EXPECT_EQ(local.store->chunks(), nullptr);
  EXPECT_EQ(TrainingOrder(streamed, 18000, false, 5, 1), TrainingOrder(local, 18000, false, 5, 1));
  EXPECT_EQ(TrainingOrder(streamed, 18000, false, 5, 1), EpochOrder(18000, 5, 1, 0, 1, true));
}

TEST_F(StreamedSplitTest, ABalancedEpochOfAStreamedSplitKeepsItsSamplesInChunkOrder) {
  CountingStorage store;
  ASSERT_OK_AND_ASSIGN(ImageDataset ds,
                       LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)));
  const int64_t length = BalancedEpochLength(ds.labels, ds.num_classes);
  std::vector<int64_t> order = TrainingOrder(ds, length, /*balance=*/true, 3, 1);
  std::vector<int64_t> balanced = BalancedEpochSamples(ds.labels, ds.num_classes, 3, 1);
  std::sort(order.begin(), order.end());
  std::sort(balanced.begin(), balanced.end());
  EXPECT_EQ(order, balanced);  // The same oversampled epoch, in another order.
  // One chunk a window: the first window's samples all come from one chunk.
  order = TrainingOrder(ds, length, true, 3, 1);
  const std::vector<int64_t>& starts = ds.store->chunks()->starts;
  auto chunk_of = [&](int64_t i) {
    return std::upper_bound(starts.begin(), starts.end(), i) - starts.begin() - 1;
  };
  for (int k = 1; k < 1000; ++k) ASSERT_EQ(chunk_of(order[k]), chunk_of(order[0])) << k;
}

TEST_F(StreamedSplitTest, ADamagedRecordIsReadAgainAndOneDamagedEveryTimeIsNamed) {
  const std::string shard = File("train", 1, 4);
  const int64_t record = 100;  // Sample 4,600.
  const int64_t at = kPackedHeaderBytes + record * kRecord + 17;
  std::vector<int64_t> sample = {4600};
  {
    CountingStorage store;
    ASSERT_OK_AND_ASSIGN(ImageDataset ds,
                         LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)));
    store.Damage(shard, at, 1);
    ASSERT_OK_AND_ASSIGN(std::shared_ptr<const void> lease, ds.Acquire(sample.data(), 1));
    EXPECT_EQ(0, std::memcmp(ds.image(4600), splits_.train.pixels.data() + 4600 * 3072, 3072));
  }
  CountingStorage store;
  ASSERT_OK_AND_ASSIGN(ImageDataset ds,
                       LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)));
  store.Damage(shard, at, 1000);
  EXPECT_THAT(ds.Acquire(sample.data(), 1).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(PackedShardName("train", 1, 4) + ": record 100 (sample 4600): "
                                                                  "checksum mismatch")));
}

TEST_F(StreamedSplitTest, ALabelsObjectOfAnotherPackingIsCaughtAndWithoutOneTheSplitIsReadWhole) {
  // Another packing's labels: the header agrees, one label differs.
  std::vector<int32_t> labels = splits_.train.labels;
  labels[5000] = (labels[5000] + 1) % 10;
  splits_.train.labels = labels;
  const std::string other = (dir_ / "other").string();
  PackOptions options;
  options.records_per_shard = 4500;
  ASSERT_OK(WritePackedDataset(splits_, other, options).status());
  fs::copy_file(fs::path(other) / "train.labels", dir_ / "train.labels",
                fs::copy_options::overwrite_existing);
  CountingStorage store;
  ASSERT_OK_AND_ASSIGN(ImageDataset ds,
                       LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)));
  std::vector<int64_t> sample = {5000};
  EXPECT_THAT(ds.Acquire(sample.data(), 1).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("sample 5000) has label")));

  fs::remove(dir_ / "train.labels");
  ASSERT_OK_AND_ASSIGN(ImageDataset whole,
                       LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)));
  EXPECT_EQ(whole.store->chunks(), nullptr);
}

TEST_F(StreamedSplitTest, AFetchThatSpentTheStoresRetriesIsTheErrorUntilTheNextPlan) {
  CountingStorage store;
  ASSERT_OK_AND_ASSIGN(ImageDataset ds,
                       LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)));
  std::vector<int64_t> samples = {10, 20};  // One chunk.
  const int before = store.range_reads();
  store.Fail(1);
  EXPECT_THAT(ds.Acquire(samples.data(), 2).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("gave up after 8 attempts")));
  // Not another round of the store's retries for the same chunk...
  EXPECT_THAT(ds.Acquire(samples.data(), 2).status(),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("503 SlowDown")));
  EXPECT_EQ(store.range_reads(), before + 1);
  // ...until a new plan: then it is read.
  ds.store->Plan({});
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<const void> lease, ds.Acquire(samples.data(), 2));
  EXPECT_EQ(0, std::memcmp(ds.image(20), splits_.train.pixels.data() + 20 * 3072, 3072));
}

TEST_F(StreamedSplitTest, AReaderWaitingOnAStoppedStoreIsToldWhatItWaitsFor) {
  CountingStorage store;
  ASSERT_OK_AND_ASSIGN(ImageDataset ds,
                       LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)));
  EXPECT_EQ(ds.store->Pending(), "");
  store.Hold();
  ds.store->Plan({4600});  // Shard 1's first chunk: records 0-2722.
  for (int i = 0; i < 500 && ds.store->Pending().empty(); ++i)
    absl::SleepFor(absl::Milliseconds(10));
  EXPECT_THAT(ds.store->Pending(),
              HasSubstr(PackedShardName("train", 1, 4) + " bytes 64-8386903 from its store for"));
  store.Release();
  std::vector<int64_t> sample = {4600};
  ASSERT_OK(ds.Acquire(sample.data(), 1).status());
  EXPECT_EQ(ds.store->Pending(), "");
}

TEST_F(StreamedSplitTest, ALabelsObjectOfTheWrongSizeIsRefusedUnread) {
  Write((dir_ / "train.labels").string(), Read((dir_ / "train.labels").string()) + "extra");
  CountingStorage store;
  EXPECT_THAT(LoadPackedSplit(dir_.string(), "train", store, Streamed(8 << 20)).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("train.labels: 72037 bytes, more than the 72032")));
}

TEST(ChunkedEpochOrderTest, APermutationWhoseWindowsHoldWholeChunks) {
  SampleStore::Chunks chunks;
  chunks.starts = {0, 100, 200, 300, 400, 500};
  chunks.window_chunks = 2;
  std::vector<int64_t> samples(600);
  for (int64_t i = 0; i < 600; ++i) samples[i] = i;
  const std::vector<int64_t> order = ChunkedEpochOrder(samples, chunks, 9, 3);
  EXPECT_EQ(order, ChunkedEpochOrder(samples, chunks, 9, 3));
  EXPECT_NE(order, ChunkedEpochOrder(samples, chunks, 9, 4));
  std::vector<int64_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, samples);
  for (int w = 0; w < 3; ++w) {  // Each window: two whole chunks, shuffled.
    std::set<int64_t> chunk_ids;
    for (int k = 0; k < 200; ++k) chunk_ids.insert(order[w * 200 + k] / 100);
    EXPECT_EQ(chunk_ids.size(), 2u) << "window " << w;
    EXPECT_FALSE(std::is_sorted(order.begin() + w * 200, order.begin() + w * 200 + 200));
  }
}

}  // namespace
}  // namespace pstrain::data
