// The ONNX export's structure, checked with ONNX's own checker (libonnx).
// Numerical parity with onnxruntime is tests/tools/onnx_export_test.py.
#include "client/onnx_export.h"

#include <map>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/job_spec.h"
#include "common/model_graph.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "onnx/checker.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A checkpoint of `job_file`'s model (or of a bare model file's) at its
// initial values.
v1::Checkpoint InitialCheckpoint(const std::string& job_file) {
  const std::string path = std::string(PSTRAIN_SOURCE_DIR) + "/" + job_file;
  absl::StatusOr<v1::JobSpec> job = v1::JobSpec();
  if (job_file.find("models/") != std::string::npos) {
    absl::StatusOr<v1::ModelSpec> model = LoadModelSpec(path);
    EXPECT_OK(model);
    *job->mutable_model() = *model;
  } else {
    job = LoadJobSpec(path);
  }
  EXPECT_OK(job);
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(job->model());
  EXPECT_OK(graph);
  v1::Checkpoint ckpt;
  *ckpt.mutable_job() = *job;
  std::vector<std::vector<float>> values = InitialParameterValues(*graph);
  for (size_t p = 0; p < graph->params.size(); ++p) {
    *ckpt.add_parameters() =
        MakeTensorProto(graph->params[p].name, graph->params[p].shape.dims(), values[p].data());
  }
  ckpt.set_step(42);
  return ckpt;
}

std::map<std::string, int> OpCounts(const onnx::ModelProto& model) {
  std::map<std::string, int> counts;
  for (const onnx::NodeProto& node : model.graph().node()) ++counts[node.op_type()];
  return counts;
}

TEST(OnnxExportTest, FashionMnistCnnPassesTheCheckerWithOneNodePerLayer) {
  absl::StatusOr<onnx::ModelProto> model =
      ExportOnnx(InitialCheckpoint("examples/fashion-mnist.json"));
  ASSERT_OK(model);
  EXPECT_NO_THROW(onnx::checker::check_model(*model));
  std::map<std::string, int> ops = OpCounts(*model);
  EXPECT_EQ(ops["Conv"], 2);
  EXPECT_EQ(ops["MaxPool"], 2);
  EXPECT_EQ(ops["Gemm"], 2);
  EXPECT_EQ(ops["Relu"], 3);
  EXPECT_EQ(ops["Flatten"], 1);
  EXPECT_EQ(ops["Softmax"], 1);
  EXPECT_EQ(ops.count("Dropout"), 0u);  // Omitted: the identity at inference.
  // Every parameter is an initializer, by its pstrain name.
  std::vector<std::string> initializers;
  for (const onnx::TensorProto& t : model->graph().initializer()) initializers.push_back(t.name());
  EXPECT_THAT(initializers, ElementsAre("conv1/weight", "conv1/bias", "conv2/weight", "conv2/bias",
                                        "fc1/weight", "fc1/bias", "logits/weight", "logits/bias"));
  ASSERT_EQ(model->graph().output_size(), 2);
  EXPECT_EQ(model->graph().output(0).name(), "logits");
  EXPECT_EQ(model->graph().output(1).name(), "probabilities");
  const auto& in = model->graph().input(0).type().tensor_type().shape();
  ASSERT_EQ(in.dim_size(), 4);
  EXPECT_EQ(in.dim(0).dim_param(), "batch");
  EXPECT_EQ(in.dim(1).dim_value(), 1);
  EXPECT_EQ(in.dim(3).dim_value(), 28);
  EXPECT_EQ(model->opset_import(0).version(), kOnnxOpset);
  EXPECT_EQ(model->model_version(), 42);
  std::map<std::string, std::string> meta;
  for (const auto& entry : model->metadata_props()) meta[entry.key()] = entry.value();
  EXPECT_EQ(meta["pstrain.mean"], "[0.286]");
  EXPECT_EQ(meta["pstrain.std"], "[0.353]");
}

TEST(OnnxExportTest, ResnetSmallExportsBatchNormAndResidualAdds) {
  absl::StatusOr<onnx::ModelProto> model =
      ExportOnnx(InitialCheckpoint("examples/models/resnet-small.json"));
  ASSERT_OK(model);
  EXPECT_NO_THROW(onnx::checker::check_model(*model));
  std::map<std::string, int> ops = OpCounts(*model);
  EXPECT_EQ(ops["Add"], 4);
  EXPECT_GE(ops["BatchNormalization"], 9);
  EXPECT_EQ(ops["AveragePool"], 1);
}

TEST(OnnxExportTest, EveryLayerKindExports) {
  v1::Checkpoint ckpt = InitialCheckpoint("examples/fashion-mnist.json");
  v1::ModelSpec& m = *ckpt.mutable_job()->mutable_model();
  v1::ModelSpec spec;
  const google::protobuf::util::Status parsed = google::protobuf::util::JsonStringToMessage(R"({
    "name": "every-kind", "input_shape": [2, 9, 9], "num_classes": 3, "layers": [
      {"name": "c", "conv2d": {"filters": 4, "kernel_size": 3, "stride": 2, "padding": 1}},
      {"name": "bn", "batch_norm": {"epsilon": 0.001}},
      {"name": "lr", "leaky_relu": {"alpha": 0.2}},
      {"name": "mp", "max_pool": {"pool_size": 3, "stride": 1, "padding": 1}},
      {"name": "ap", "avg_pool": {"pool_size": 3, "stride": 1, "padding": 1}, "inputs": ["lr"]},
      {"name": "t", "tanh": {}, "inputs": ["ap"]},
      {"name": "s", "sigmoid": {}, "inputs": ["mp"]},
      {"name": "sum", "add": {}, "inputs": ["mp", "t", "s"]},
      {"name": "d", "dropout": {"rate": 0.5}},
      {"name": "fc", "dense": {"units": 5, "no_bias": true}},
      {"name": "bn1d", "batch_norm": {}},
      {"name": "r", "relu": {}},
      {"name": "out", "dense": {"units": 3}},
      {"name": "loss", "softmax_cross_entropy": {}}]})",
                                                                                            &spec);
  ASSERT_OK(parsed);
  m = spec;
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(m);
  ASSERT_OK(graph);
  ckpt.clear_parameters();
  std::vector<std::vector<float>> values = InitialParameterValues(*graph);
  for (size_t p = 0; p < graph->params.size(); ++p) {
    *ckpt.add_parameters() =
        MakeTensorProto(graph->params[p].name, graph->params[p].shape.dims(), values[p].data());
  }
  absl::StatusOr<onnx::ModelProto> model = ExportOnnx(ckpt);
  ASSERT_OK(model);
  EXPECT_NO_THROW(onnx::checker::check_model(*model));
  std::map<std::string, int> ops = OpCounts(*model);
  EXPECT_EQ(ops["Sum"], 1);
  EXPECT_EQ(ops["LeakyRelu"], 1);
  EXPECT_EQ(ops["Flatten"], 1);  // Before fc, whose input is [4, 5, 5].
  for (const onnx::NodeProto& node : model->graph().node()) {
    if (node.op_type() == "AveragePool") {
      bool excludes_padding = false;
      for (const auto& a : node.attribute()) {
        if (a.name() == "count_include_pad") excludes_padding = a.i() == 0;
      }
      EXPECT_TRUE(excludes_padding);
    }
    if (node.name() == "fc") {
      EXPECT_EQ(node.input_size(), 2);  // no_bias.
    }
    if (node.name() == "sum") {
      EXPECT_THAT(node.input(), ElementsAre("mp", "t", "s"));
    }
    // The dropout is skipped: fc reads the sum through its flatten.
    if (node.name() == "fc/flatten") {
      EXPECT_THAT(node.input(), ElementsAre("sum"));
    }
  }
}

TEST(OnnxExportTest, AMissingOrMisshapenTensorIsNamed) {
  v1::Checkpoint ckpt = InitialCheckpoint("examples/fashion-mnist.json");
  v1::Checkpoint missing = ckpt;
  missing.mutable_parameters()->DeleteSubrange(2, 1);  // conv2/weight.
  absl::StatusOr<onnx::ModelProto> model = ExportOnnx(missing);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(std::string(model.status().message()), HasSubstr("conv2/weight"));

  v1::Checkpoint misshapen = ckpt;
  *misshapen.mutable_parameters(1) =
      MakeTensorProto("conv1/bias", {3}, std::vector<float>(3).data());
  model = ExportOnnx(misshapen);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(std::string(model.status().message()), HasSubstr("conv1/bias has 3 values"));
}

TEST(OnnxExportTest, AnInvalidModelIsRefusedWithTheValidationMessage) {
  v1::Checkpoint ckpt = InitialCheckpoint("examples/fashion-mnist.json");
  ckpt.mutable_job()->mutable_model()->mutable_layers(0)->mutable_conv2d()->set_filters(0);
  absl::StatusOr<onnx::ModelProto> model = ExportOnnx(ckpt);
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(std::string(model.status().message()), HasSubstr("filters must be > 0"));
}

}  // namespace
}  // namespace pstrain
