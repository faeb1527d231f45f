#include "worker/data_prefetcher.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/data/dataset.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/common/data_test_util.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using data::testing::CountingDataset;
using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

struct Epoch {
  std::vector<int64_t> ids;          // Sample ids in delivery order.
  std::vector<int> batch_sizes;
};

// Drains one epoch, copying every batch back to the host and decoding the
// sample ids; checks each label against its id.
Epoch Drain(Backend* backend, DataPrefetcher* prefetcher, int epoch) {
  Epoch out;
  EXPECT_OK(prefetcher->StartEpoch(epoch));
  for (int guard = 0; guard < 10000; ++guard) {
    absl::StatusOr<DeviceBatch> batch = prefetcher->Next();
    EXPECT_OK(batch);
    if (!batch.ok() || batch->n == 0) break;
    std::vector<float> images(static_cast<size_t>(batch->n) * 4);
    std::vector<int32_t> labels(batch->n);
    EXPECT_OK(backend->CopyDeviceToHost(images.data(), batch->images,
                                          images.size() * sizeof(float)));
    EXPECT_OK(backend->CopyDeviceToHost(labels.data(), batch->labels,
                                          labels.size() * sizeof(int32_t)));
    EXPECT_OK(backend->Synchronize());
    for (int j = 0; j < batch->n; ++j) {
      const int64_t id = std::lround(images[j * 4] * 255.f);
      for (int k = 1; k < 4; ++k) EXPECT_EQ(std::lround(images[j * 4 + k] * 255.f), id);
      EXPECT_EQ(labels[j], id % 10) << "sample " << id;
      out.ids.push_back(id);
    }
    out.batch_sizes.push_back(batch->n);
  }
  return out;
}

std::vector<int64_t> Sorted(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Runs on every device: "cpu" always, "cuda" when a GPU is visible (pinned
// memory and asynchronous copies are where the buffer recycling matters).
class DataPrefetcherTest : public ::testing::TestWithParam<DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceType::kCuda && !CudaAvailable()) {
      GTEST_SKIP() << "no CUDA device";
    }
    DeviceSpec spec;
    spec.automatic = false;
    spec.type = GetParam();
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(spec);
    ASSERT_OK(backend);
    backend_ = *std::move(backend);
  }

  std::unique_ptr<DataPrefetcher> Make(const data::ImageDataset* ds, PrefetchOptions options) {
    absl::StatusOr<std::unique_ptr<DataPrefetcher>> p =
        DataPrefetcher::Create(backend_.get(), ds, data::Preprocess{}, options);
    EXPECT_OK(p);
    return p.ok() ? *std::move(p) : nullptr;
  }

  std::unique_ptr<Backend> backend_;
};

INSTANTIATE_TEST_SUITE_P(Devices, DataPrefetcherTest,
                         ::testing::Values(DeviceType::kCpu, DeviceType::kCuda),
                         [](const ::testing::TestParamInfo<DeviceType>& info) {
                           return info.param == DeviceType::kCpu ? "cpu" : "cuda";
                         });

// Pools of 1 and 2 buffers too: Next() keeps the copy of the last batch in
// flight only when the pool can spare it (a pool of one cannot).
TEST_P(DataPrefetcherTest, EverySampleOnceAndFollowsEpochOrder) {
  data::ImageDataset ds = CountingDataset(103);
  for (auto [threads, pool] : {std::pair{1, 3}, {3, 3}, {1, 1}, {2, 2}}) {
    SCOPED_TRACE(absl::StrCat(threads, " threads, ", pool, " buffers"));
    PrefetchOptions options;
    options.batch_size = 10;
    options.prefetch_batches = pool;
    options.threads = threads;
    options.seed = 17;
    std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->batches_per_epoch(), 11);
    EXPECT_EQ(p->samples_per_epoch(), 103);
    Epoch e0 = Drain(backend_.get(), p.get(), 0);
    EXPECT_EQ(Sorted(e0.ids), Iota(103));
    EXPECT_EQ(e0.ids, data::EpochOrder(103, 17, 0, 0, 1, true));
    EXPECT_THAT(e0.batch_sizes, ::testing::ElementsAre(10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 3));
    // After the end, Next keeps returning n == 0.
    absl::StatusOr<DeviceBatch> after = p->Next();
    ASSERT_OK(after);
    EXPECT_EQ(after->n, 0);

    Epoch e1 = Drain(backend_.get(), p.get(), 1);
    EXPECT_EQ(Sorted(e1.ids), Iota(103));
    EXPECT_NE(e1.ids, e0.ids);  // The order depends on the epoch.
    EXPECT_EQ(e1.ids, data::EpochOrder(103, 17, 1, 0, 1, true));
    // Replaying an epoch gives the same order.
    EXPECT_EQ(Drain(backend_.get(), p.get(), 0).ids, e0.ids);
  }
}

TEST_P(DataPrefetcherTest, DropLastSkipsThePartialBatch) {
  data::ImageDataset ds = CountingDataset(25);
  PrefetchOptions options;
  options.batch_size = 8;
  options.drop_last = true;
  options.shuffle = false;
  std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->batches_per_epoch(), 3);
  EXPECT_EQ(p->samples_per_epoch(), 25);
  Epoch e = Drain(backend_.get(), p.get(), 0);
  EXPECT_THAT(e.batch_sizes, ::testing::ElementsAre(8, 8, 8));
  EXPECT_EQ(e.ids, Iota(24));
}

TEST_P(DataPrefetcherTest, ShardsAcrossWorldSizeAreDisjointAndCover) {
  data::ImageDataset ds = CountingDataset(50);
  std::vector<int64_t> all;
  for (int rank = 0; rank < 3; ++rank) {
    PrefetchOptions options;
    options.batch_size = 4;
    options.rank = rank;
    options.world_size = 3;
    options.seed = 5;
    options.threads = 2;
    std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->samples_per_epoch(), rank < 2 ? 17 : 16);
    Epoch e = Drain(backend_.get(), p.get(), 2);
    EXPECT_EQ(static_cast<int64_t>(e.ids.size()), p->samples_per_epoch());
    EXPECT_EQ(e.ids, data::EpochOrder(50, 5, 2, rank, 3, true));
    all.insert(all.end(), e.ids.begin(), e.ids.end());
  }
  EXPECT_EQ(Sorted(all), Iota(50));
}

// Issue 12: balanced epochs, sharded over two workers: together they
// deliver the balanced list of the epoch, every class equally often.
TEST_P(DataPrefetcherTest, BalancedEpochsDeliverEveryClassEquallyOftenAcrossShards) {
  data::ImageDataset ds = CountingDataset(40);  // Labels i % 10: 4 each.
  // Skew it: class 0 keeps 4 samples, classes 1..9 keep one each.
  data::ImageDataset skewed = ds;
  skewed.pixels.clear();
  skewed.labels.clear();
  for (int64_t i = 0; i < ds.size(); ++i) {
    if (i % 10 != 0 && i >= 10) continue;
    skewed.pixels.insert(skewed.pixels.end(), ds.image(i), ds.image(i) + 4);
    skewed.labels.push_back(ds.labels[i]);
  }
  ASSERT_EQ(skewed.size(), 13);  // Ids 0..9 and 10, 20, 30 (class 0).
  std::vector<int64_t> all;
  for (int rank = 0; rank < 2; ++rank) {
    PrefetchOptions options;
    options.batch_size = 4;
    options.rank = rank;
    options.world_size = 2;
    options.seed = 3;
    options.balance = true;
    std::unique_ptr<DataPrefetcher> p = Make(&skewed, options);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p->samples_per_epoch(), 20);  // 4 x 10 classes, halved.
    Epoch e = Drain(backend_.get(), p.get(), 1);
    all.insert(all.end(), e.ids.begin(), e.ids.end());
  }
  ASSERT_EQ(all.size(), 40u);
  std::vector<int> per_class(10, 0);
  for (int64_t id : all) ++per_class[id % 10];  // Drain checked each label against its id.
  EXPECT_THAT(per_class, ::testing::Each(4));
  // The same samples as the balanced list of the epoch, position for position.
  const std::vector<int64_t> samples = data::BalancedEpochSamples(skewed.labels, 10, 3, 1);
  std::vector<int64_t> expected;
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t p : data::EpochOrder(40, 3, 1, rank, 2, true)) {
      const int64_t index = samples[static_cast<size_t>(p)];
      expected.push_back(index < 10 ? index : (index - 9) * 10);  // Index -> id.
    }
  }
  EXPECT_EQ(all, expected);
}

TEST_P(DataPrefetcherTest, AugmentationAndNormalisationReachTheDevice) {
  data::ImageDataset ds = CountingDataset(16);
  data::Preprocess pre;
  pre.mean = {0.5f};
  pre.std = {0.5f};
  PrefetchOptions options;
  options.batch_size = 16;
  options.shuffle = false;
  absl::StatusOr<std::unique_ptr<DataPrefetcher>> p =
      DataPrefetcher::Create(backend_.get(), &ds, pre, options);
  ASSERT_OK(p);
  ASSERT_OK((*p)->StartEpoch(0));
  absl::StatusOr<DeviceBatch> batch = (*p)->Next();
  ASSERT_OK(batch);
  ASSERT_EQ(batch->n, 16);
  std::vector<float> images(64);
  ASSERT_OK(backend_->CopyDeviceToHost(images.data(), batch->images, 64 * sizeof(float)));
  ASSERT_OK(backend_->Synchronize());
  std::vector<float> expected(64);
  std::vector<int32_t> labels(16);
  std::vector<int64_t> idx = Iota(16);
  data::AssembleBatch(ds, idx, pre, false, 0, expected.data(), labels.data());
  EXPECT_EQ(images, expected);
}

TEST_P(DataPrefetcherTest, AugmentedBatchesAreReproducibleAndEpochDependent) {
  data::ImageDataset ds;
  ds.channels = 1;
  ds.height = 4;
  ds.width = 4;
  ds.num_classes = 10;
  for (int i = 0; i < 32; ++i) {
    for (int k = 0; k < 16; ++k) ds.pixels.push_back(static_cast<uint8_t>(i * 7 + k * 13));
    ds.labels.push_back(i % 10);
  }
  data::Preprocess pre;
  pre.random_flip = true;
  pre.crop_padding = 1;
  PrefetchOptions options;
  options.batch_size = 32;
  options.augment = true;
  options.shuffle = false;
  options.seed = 3;
  auto first_batch = [&](int epoch) {
    absl::StatusOr<std::unique_ptr<DataPrefetcher>> p =
        DataPrefetcher::Create(backend_.get(), &ds, pre, options);
    EXPECT_OK(p);
    std::vector<float> images(32 * 16);
    if (!p.ok()) return images;
    EXPECT_OK((*p)->StartEpoch(epoch));
    absl::StatusOr<DeviceBatch> batch = (*p)->Next();
    EXPECT_OK(batch);
    if (!batch.ok()) return images;
    EXPECT_OK(backend_->CopyDeviceToHost(images.data(), batch->images,
                                           images.size() * sizeof(float)));
    EXPECT_OK(backend_->Synchronize());
    return images;
  };
  std::vector<float> a = first_batch(0);
  EXPECT_EQ(a, first_batch(0));
  EXPECT_NE(a, first_batch(1));
  std::vector<float> plain(32 * 16);
  std::vector<int32_t> labels(32);
  std::vector<int64_t> idx = Iota(32);
  data::AssembleBatch(ds, idx, pre, false, 0, plain.data(), labels.data());
  EXPECT_NE(a, plain);  // Augmentation did something.
}

TEST_P(DataPrefetcherTest, DestructionMidEpochIsSafe) {
  data::ImageDataset ds = CountingDataset(200);
  for (int taken : {0, 1, 3}) {
    PrefetchOptions options;
    options.batch_size = 4;
    options.prefetch_batches = 2;
    options.threads = 3;
    std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
    ASSERT_NE(p, nullptr);
    ASSERT_OK(p->StartEpoch(0));
    for (int i = 0; i < taken; ++i) {
      absl::StatusOr<DeviceBatch> batch = p->Next();
      ASSERT_OK(batch);
      EXPECT_EQ(batch->n, 4);
    }
    p.reset();  // Threads blocked on a full pool must wake and exit.
  }
  // Destroyed without ever starting an epoch.
  std::unique_ptr<DataPrefetcher> idle = Make(&ds, PrefetchOptions{});
  ASSERT_NE(idle, nullptr);
  idle.reset();
}

TEST_P(DataPrefetcherTest, RestartingAnEpochMidwayStartsOver) {
  data::ImageDataset ds = CountingDataset(60);
  PrefetchOptions options;
  options.batch_size = 5;
  options.prefetch_batches = 4;
  options.threads = 2;
  std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
  ASSERT_NE(p, nullptr);
  ASSERT_OK(p->StartEpoch(0));
  for (int i = 0; i < 3; ++i) { ASSERT_OK(p->Next()); }
  Epoch e = Drain(backend_.get(), p.get(), 4);
  EXPECT_EQ(e.ids, data::EpochOrder(60, 0, 4, 0, 1, true));
}

TEST_P(DataPrefetcherTest, QueueFillsUpToThePoolSize) {
  data::ImageDataset ds = CountingDataset(100);
  PrefetchOptions options;
  options.batch_size = 5;
  options.prefetch_batches = 3;
  options.threads = 2;
  std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->queue_depth(), 0);
  ASSERT_OK(p->StartEpoch(0));
  // Every depth seen while the pool fills: never more than the pool.
  int deepest = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (p->queue_depth() < 3 && absl::Now() < deadline) {
    deepest = std::max(deepest, p->queue_depth());
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_LE(deepest, 3);
  EXPECT_EQ(p->queue_depth(), 3);
  // Taking one leaves its buffer in flight until the next Next().
  ASSERT_OK(p->Next());
  EXPECT_LE(p->queue_depth(), 2);
  // The batch was ready, so the wait Next() reports is the lock's, not a
  // wait on the producers (the SlowAssembly test below checks a real wait is
  // reported). A generous bound for a loaded machine.
  EXPECT_LT(p->last_wait_seconds(), 0.5);
}

TEST_P(DataPrefetcherTest, SlowAssemblyHitsTheDeadlineAndRecovers) {
  // 16 samples of 3x256x256: assembling one batch takes milliseconds, far
  // longer than the 1 ms deadline.
  data::ImageDataset ds;
  ds.channels = 3;
  ds.height = 256;
  ds.width = 256;
  ds.num_classes = 10;
  ds.pixels.assign(16 * ds.sample_elements(), 7);
  ds.labels.assign(16, 1);
  PrefetchOptions options;
  options.batch_size = 16;
  options.next_timeout_ms = 1;
  // On a loaded machine the test thread can lose the CPU for longer than
  // the assembly takes, and then the batch is simply ready: a fresh
  // prefetcher tries again (a local ctest -j2 run failed so on 2026-11-26),
  // and one of five must hit the deadline.
  bool hit_deadline = false;
  for (int attempt = 0; attempt < 5 && !hit_deadline; ++attempt) {
    std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
    ASSERT_NE(p, nullptr);
    ASSERT_OK(p->StartEpoch(0));
    absl::StatusOr<DeviceBatch> batch = p->Next();
    if (batch.ok()) {
      EXPECT_EQ(batch->n, 16);  // Ready in time: the whole batch.
      continue;
    }
    hit_deadline = true;
    EXPECT_EQ(batch.status().code(), absl::StatusCode::kDeadlineExceeded) << batch.status();
    EXPECT_GT(p->last_wait_seconds(), 0.0);
    // The batch is still coming; once it is ready, Next returns it.
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (p->queue_depth() < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    batch = p->Next();
    ASSERT_OK(batch);
    EXPECT_EQ(batch->n, 16);
  }
  EXPECT_TRUE(hit_deadline) << "five batches of 3x256x256 images were each ready within 1 ms";
}

TEST_P(DataPrefetcherTest, EmptyShardEndsImmediately) {
  data::ImageDataset ds = CountingDataset(2);
  PrefetchOptions options;
  options.rank = 3;
  options.world_size = 4;
  std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->batches_per_epoch(), 0);
  ASSERT_OK(p->StartEpoch(0));
  absl::StatusOr<DeviceBatch> batch = p->Next();
  ASSERT_OK(batch);
  EXPECT_EQ(batch->n, 0);
}

TEST_P(DataPrefetcherTest, RejectsBadArgumentsAndNextBeforeStart) {
  data::ImageDataset ds = CountingDataset(10);
  PrefetchOptions options;
  options.batch_size = 0;
  EXPECT_EQ(DataPrefetcher::Create(backend_.get(), &ds, {}, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = PrefetchOptions{};
  options.rank = 2;
  options.world_size = 2;
  EXPECT_EQ(DataPrefetcher::Create(backend_.get(), &ds, {}, options).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DataPrefetcher::Create(nullptr, &ds, {}, PrefetchOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  data::Preprocess bad;
  bad.mean = {0.1f, 0.2f};  // Two values for one channel.
  EXPECT_EQ(DataPrefetcher::Create(backend_.get(), &ds, bad, PrefetchOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Zero pool size and threads mean the defaults.
  options = PrefetchOptions{};
  options.prefetch_batches = 0;
  options.threads = 0;
  std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->Next().status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace

// A store that fetches: pixels from a plain dataset, a plan recorded, and
// one sample whose read always fails (a record damaged in the store).
class FailingStore final : public data::SampleStore {
 public:
  FailingStore(data::ImageDataset source, int64_t bad) : source_(std::move(source)), bad_(bad) {}
  const uint8_t* image(int64_t i) const override { return source_.image(i); }
  void Plan(const std::vector<int64_t>& samples) const override {
    absl::MutexLock lock(&mu_);
    planned_ = samples;
  }
  absl::StatusOr<std::shared_ptr<const void>> Acquire(const int64_t* samples,
                                                      size_t count) const override {
    for (size_t k = 0; k < count; ++k) {
      if (samples[k] == bad_) {
        return absl::DataLossError(absl::StrCat("s3://b/train-00000-of-00001.pspack: record ", bad_,
                                                " (sample ", bad_, "): checksum mismatch"));
      }
    }
    return std::shared_ptr<const void>();
  }
  std::vector<int64_t> planned() const {
    absl::MutexLock lock(&mu_);
    return planned_;
  }

 private:
  const data::ImageDataset source_;
  const int64_t bad_;
  mutable absl::Mutex mu_;
  mutable std::vector<int64_t> planned_ ABSL_GUARDED_BY(mu_);
};

TEST_P(DataPrefetcherTest, AStoresPlanIsTheBatchesAndAFailedReadIsTheBatchsError) {
  data::ImageDataset ds = CountingDataset(40);
  auto store = std::make_shared<FailingStore>(ds, /*bad=*/25);
  ds.store = store;
  PrefetchOptions options;
  options.batch_size = 10;
  options.threads = 2;
  std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
  ASSERT_NE(p, nullptr);
  std::vector<int64_t> samples = Iota(40);
  ASSERT_OK(p->StartSamples(1, samples, {10, 20, 30, 40}));
  EXPECT_EQ(store->planned(), samples);
  for (int b = 0; b < 2; ++b) {
    absl::StatusOr<DeviceBatch> batch = p->Next();
    ASSERT_OK(batch);
    EXPECT_EQ(batch->n, 10);
  }
  EXPECT_THAT(p->Next().status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("record 25 (sample 25)")));
  // A new list without the damaged sample runs.
  ASSERT_OK(p->StartSamples(2, Iota(20), {10, 20}));
  ASSERT_OK(p->Next());
}

// A store that stopped answering: Acquire waits until released.
class StoppedStore final : public data::SampleStore {
 public:
  explicit StoppedStore(data::ImageDataset source) : source_(std::move(source)) {}
  const uint8_t* image(int64_t i) const override { return source_.image(i); }
  std::string Pending() const override {
    return "reading s3://b/train-00000-of-00001.pspack bytes 64-8386903 from its store for 1 s";
  }
  absl::StatusOr<std::shared_ptr<const void>> Acquire(const int64_t*, size_t) const override {
    absl::MutexLock lock(&mu_);
    auto released = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return released_; };
    mu_.Await(absl::Condition(&released));
    return std::shared_ptr<const void>();
  }
  void Release() const {
    absl::MutexLock lock(&mu_);
    released_ = true;
  }

 private:
  const data::ImageDataset source_;
  mutable absl::Mutex mu_;
  mutable bool released_ ABSL_GUARDED_BY(mu_) = false;
};

TEST_P(DataPrefetcherTest, ATimeoutWaitingOnTheStoreSaysWhatItWaitsFor) {
  data::ImageDataset ds = CountingDataset(20);
  auto store = std::make_shared<StoppedStore>(ds);
  ds.store = store;
  PrefetchOptions options;
  options.batch_size = 10;
  options.next_timeout_ms = 50;
  std::unique_ptr<DataPrefetcher> p = Make(&ds, options);
  ASSERT_NE(p, nullptr);
  ASSERT_OK(p->StartSamples(1, Iota(20), {10, 20}));
  EXPECT_THAT(p->Next().status(),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       HasSubstr("not ready within 50 ms (reading s3://b/train-00000-of-00001."
                                 "pspack bytes 64-8386903 from its store")));
  store->Release();
  ASSERT_OK(p->Next());
}

}  // namespace pstrain
