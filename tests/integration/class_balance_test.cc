// Class-balanced sampling (issue 12) end to end: the standalone engine
// trains fmnist-cnn on a deliberately imbalanced Fashion-MNIST subset with
// and without DatasetSpec.balance = BALANCE_OVERSAMPLE. An integration test
// (it trains two models for about a minute), so it stays out of the unit
// label and of the ThreadSanitizer pass.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "common/data/dataset.h"
#include "common/data/load_dataset.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "worker/standalone.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

const char kFashionMnist[] = "/usr/share/datasets/fashion-mnist";

// Writes `ds` as uncompressed IDX files <dir>/<prefix>-images-idx3-ubyte
// and <prefix>-labels-idx1-ubyte.
void WriteIdx(const data::ImageDataset& ds, const std::string& dir, const std::string& prefix) {
  auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                       static_cast<char>(v >> 8), static_cast<char>(v)};
  };
  const uint32_t n = static_cast<uint32_t>(ds.size());
  std::ofstream images(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary);
  images << be32(0x803) << be32(n) << be32(ds.height) << be32(ds.width);
  images.write(reinterpret_cast<const char*>(ds.pixels.data()),
               static_cast<std::streamsize>(ds.pixels.size()));
  std::ofstream labels(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary);
  labels << be32(0x801) << be32(n);
  for (int32_t label : ds.labels) labels.put(static_cast<char>(label));
}

// Issue 12 (class-balanced sampling): Fashion-MNIST with classes 0-4 cut to
// 5% of their samples. Trained with BALANCE_OVERSAMPLE, macro recall and F1
// on the (balanced) test set beat the same job without it, although the
// unbalanced run gets at least as many steps.
TEST(ClassBalanceTest, OversamplingAnImbalancedSubsetImprovesMacroRecallAndF1) {
  if (!std::filesystem::exists(std::string(kFashionMnist) + "/train-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  pstrain::v1::DatasetSpec source;
  source.set_format(pstrain::v1::DATASET_FORMAT_IDX);
  source.set_path(kFashionMnist);
  source.set_train_limit(6000);
  source.set_test_limit(2000);
  absl::StatusOr<data::DatasetSplits> splits = data::LoadDataset(source);
  ASSERT_OK(splits);
  data::ImageDataset skewed = splits->train;
  skewed.pixels.clear();
  skewed.labels.clear();
  int kept_minor = 0;
  for (int64_t i = 0; i < splits->train.size(); ++i) {
    const int32_t label = splits->train.labels[i];
    if (label < 5 && (kept_minor++ % 20) != 0) continue;  // 5% of classes 0-4.
    const uint8_t* image = splits->train.image(i);
    skewed.pixels.insert(skewed.pixels.end(), image, image + skewed.sample_elements());
    skewed.labels.push_back(label);
  }
  const std::string dir = ::testing::TempDir() + "/imbalanced-fmnist";
  std::filesystem::create_directories(dir);
  WriteIdx(skewed, dir, "train");
  WriteIdx(splits->test, dir, "t10k");
  const int64_t balanced_epoch = data::BalancedEpochLength(skewed.labels, skewed.num_classes);
  ASSERT_GT(balanced_epoch, 3 * skewed.size() / 2);

  auto run = [&](pstrain::v1::Balance balance, int epochs) {
    auto job = LoadJobSpec(std::string(PSTRAIN_SOURCE_DIR) + "/examples/fashion-mnist.json");
    EXPECT_OK(job);
    job->mutable_dataset()->set_path(dir);
    job->mutable_dataset()->set_balance(balance);
    job->mutable_optimizer()->mutable_schedule()->Clear();
    StandaloneOptions options;
    options.device = "cpu";
    options.epochs = epochs;
    std::ostringstream log;
    auto result = RunStandalone(*job, options, log);
    EXPECT_OK(result);
    return result.ok() ? *result : StandaloneResult();
  };
  // Two balanced epochs; the plain run gets as many sample-steps or more.
  const int plain_epochs =
      static_cast<int>((2 * balanced_epoch + skewed.size() - 1) / skewed.size());
  const StandaloneResult balanced = run(pstrain::v1::BALANCE_OVERSAMPLE, 2);
  const StandaloneResult plain = run(pstrain::v1::BALANCE_NONE, plain_epochs);
  EXPECT_GE(plain.steps, balanced.steps);
  std::cout << "imbalanced Fashion-MNIST (" << skewed.size() << " samples, classes 0-4 at 5%): "
            << "macro recall " << plain.test.macro_recall << " -> " << balanced.test.macro_recall
            << ", macro F1 " << plain.test.macro_f1 << " -> " << balanced.test.macro_f1
            << ", accuracy " << plain.test.accuracy << " -> " << balanced.test.accuracy << "\n";
  EXPECT_GT(balanced.test.macro_recall, plain.test.macro_recall + 0.02);
  EXPECT_GT(balanced.test.macro_f1, plain.test.macro_f1 + 0.02);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pstrain
