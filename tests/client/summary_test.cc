#include "client/summary.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

TEST(SummaryTest, JobFileGivesKerasStyleTable) {
  auto table = SummarizeJobFile(std::string(PSTRAIN_SOURCE_DIR) + "/examples/fashion-mnist.json");
  ASSERT_OK(table);
  EXPECT_THAT(*table, HasSubstr("conv2 (conv2d)"));
  EXPECT_THAT(*table, HasSubstr("(None, 64, 14, 14)"));
  EXPECT_THAT(*table, HasSubstr("3212288"));
  EXPECT_THAT(*table, HasSubstr("Total params: 3274634"));
}

TEST(SummaryTest, BareModelFileWorksToo) {
  auto table =
      SummarizeJobFile(std::string(PSTRAIN_SOURCE_DIR) + "/examples/models/resnet-small.json");
  ASSERT_OK(table);
  EXPECT_THAT(*table, HasSubstr("block2_add (add)"));
}

// Regression: a bare model whose JSON held the string "model" anywhere (here
// its name) was read as a job and failed with "layers: Cannot find field".
TEST(SummaryTest, ABareModelNamedModelIsStillABareModel) {
  std::string path = ::testing::TempDir() + "/model_named_model.json";
  std::ofstream(path) << R"({"name": "model", "input_shape": [1, 8, 8], "num_classes": 10,
      "layers": [{"name": "f", "flatten": {}}, {"name": "fc", "dense": {"units": 10}},
      {"name": "loss", "softmax_cross_entropy": {}}]})";
  auto table = SummarizeJobFile(path);
  ASSERT_OK(table);
  EXPECT_THAT(*table, HasSubstr("Total params: 650"));
  std::remove(path.c_str());
}

TEST(SummaryTest, AnExternalModelIsListedTensorByTensor) {
  std::string path = ::testing::TempDir() + "/external_model.json";
  std::ofstream(path) << R"({"external_model": {"framework": "torch", "tensors": [
      {"name": "rnn.weight_ih_l0", "shape": [512, 28], "trainable": true},
      {"name": "bn.running_mean", "shape": [128]}]},
      "dataset": {"format": "DATASET_FORMAT_SYNTHETIC"}, "epochs": 1, "batch_size": 8})";
  auto table = SummarizeJobFile(path);
  ASSERT_OK(table);
  EXPECT_THAT(*table, HasSubstr("External model: \"torch\" (2 tensors)"));
  EXPECT_THAT(*table, HasSubstr("rnn.weight_ih_l0  [512, 28]"));
  EXPECT_THAT(*table, HasSubstr("no (buffer)"));
  EXPECT_THAT(*table, HasSubstr("Total params: 14464"));
  EXPECT_THAT(*table, HasSubstr("Non-trainable params: 128"));
  std::ofstream(path) << R"({"external_model": {"tensors": [{"name": "w", "shape": [0]}]}})";
  table = SummarizeJobFile(path);
  EXPECT_THAT(table.status(), pstrain::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                                         HasSubstr("tensor 'w': dimensions")));
  std::remove(path.c_str());
}

TEST(SummaryTest, InvalidModelNamesFileAndLayer) {
  std::string path = ::testing::TempDir() + "/bad_model.json";
  std::ofstream(path) << R"({"model": {"input_shape": [1, 8, 8], "num_classes": 10, "layers": [
      {"name": "f", "flatten": {}}, {"name": "fc", "dense": {"units": 7}},
      {"name": "loss", "softmax_cross_entropy": {}}]}})";
  auto table = SummarizeJobFile(path);
  ASSERT_FALSE(table.ok());
  EXPECT_THAT(std::string(table.status().message()), HasSubstr(path));
  EXPECT_THAT(std::string(table.status().message()), HasSubstr("layer 'loss'"));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pstrain
