#include "common/model_graph.h"

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

v1::ModelSpec Parse(const std::string& json) {
  v1::ModelSpec spec;
  auto status = google::protobuf::util::JsonStringToMessage(json, &spec);
  EXPECT_OK(status);
  return spec;
}

std::string Error(const std::string& json) {
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(Parse(json));
  EXPECT_FALSE(graph.ok());
  EXPECT_EQ(graph.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(graph.status().message());
}

TEST(ModelGraphTest, FmnistCnnShapesAndParameterCounts) {
  auto model = LoadModelSpec(std::string(PSTRAIN_SOURCE_DIR) + "/examples/models/fmnist-cnn.json");
  ASSERT_OK(model);
  auto graph = BuildModelGraph(*model);
  ASSERT_OK(graph);
  EXPECT_EQ(graph->layers[0].output_shape, (Shape{32, 28, 28}));
  EXPECT_EQ(graph->layers[2].output_shape, (Shape{32, 14, 14}));
  EXPECT_EQ(graph->layers[5].output_shape, (Shape{64, 7, 7}));
  EXPECT_EQ(graph->layers[6].output_shape, (Shape{3136}));
  // 832 + 51264 + 3212288 + 10250, as Keras reports for this model.
  EXPECT_EQ(graph->trainable_params, 3274634);
  EXPECT_EQ(graph->non_trainable_params, 0);
  EXPECT_EQ(graph->params[0].name, "conv1/weight");
  EXPECT_EQ(graph->params[0].shape, (Shape{32, 1, 5, 5}));
  EXPECT_EQ(graph->loss_layer, 11);
  EXPECT_EQ(graph->logits_layer, 10);
}

TEST(ModelGraphTest, ResnetSmallIsAValidResidualGraph) {
  for (const char* name : {"resnet-small.json", "resnet-small-64.json"}) {
    auto model = LoadModelSpec(std::string(PSTRAIN_SOURCE_DIR) + "/examples/models/" + name);
    ASSERT_OK(model);
    auto graph = BuildModelGraph(*model);
    ASSERT_OK(graph);
    int adds = 0;
    for (const auto& layer : graph->layers) adds += layer.type == LayerType::kAdd;
    EXPECT_GE(adds, 3) << name;
    EXPECT_GT(graph->non_trainable_params, 0);  // Batch-norm running statistics.
  }
}

TEST(ModelGraphTest, SummaryListsEveryLayerAndTotal) {
  auto graph = BuildModelGraph(Parse(R"({"name":"m","input_shape":[4],"num_classes":3,"layers":[
      {"name":"fc","dense":{"units":3}},{"name":"loss","softmax_cross_entropy":{}}]})"));
  ASSERT_OK(graph);
  std::string table = FormatModelSummary(*graph);
  EXPECT_THAT(table, HasSubstr("fc (dense)"));
  EXPECT_THAT(table, HasSubstr("(None, 3)"));
  EXPECT_THAT(table, HasSubstr("Total params: 15"));
}

TEST(ModelGraphTest, AddShapeMismatchNamesLayerAndBothShapes) {
  std::string e = Error(R"({"input_shape":[3,8,8],"num_classes":2,"layers":[
      {"name":"a","conv2d":{"filters":4,"kernel_size":3,"padding":1}},
      {"name":"b","conv2d":{"filters":8,"kernel_size":3,"padding":1},"inputs":["input"]},
      {"name":"sum","add":{},"inputs":["a","b"]},
      {"name":"f","flatten":{}},{"name":"fc","dense":{"units":2}},
      {"name":"loss","softmax_cross_entropy":{}}]})");
  EXPECT_THAT(e, HasSubstr("layer 'sum' (add)"));
  EXPECT_THAT(e, HasSubstr("[8, 8, 8]"));
  EXPECT_THAT(e, HasSubstr("[4, 8, 8]"));
}

TEST(ModelGraphTest, LogitsMustMatchNumClasses) {
  std::string e = Error(R"({"input_shape":[4],"num_classes":10,"layers":[
      {"name":"fc","dense":{"units":20}},{"name":"loss","softmax_cross_entropy":{}}]})");
  EXPECT_THAT(e, HasSubstr("layer 'loss' (softmax_cross_entropy)"));
  EXPECT_THAT(e, HasSubstr("[20]"));
  EXPECT_THAT(e, HasSubstr("num_classes is 10"));
}

TEST(ModelGraphTest, RejectsInvalidSpecsWithMessages) {
  struct Case {
    const char* json;
    const char* message;
  } cases[] = {
      {R"({"input_shape":[1,4,4],"num_classes":2,"layers":[{"name":"c","conv2d":{"filters":2,"kernel_size":7}},{"name":"f","flatten":{}},{"name":"d","dense":{"units":2}},{"name":"l","softmax_cross_entropy":{}}]})",
       "layer 'c' (conv2d): kernel 7x7 with padding 0 does not fit input [1, 4, 4]"},
      {R"({"input_shape":[1,4,4],"num_classes":2,"layers":[{"name":"c","conv2d":{"filters":0,"kernel_size":3}},{"name":"l","softmax_cross_entropy":{}}]})",
       "filters must be > 0"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d","dense":{"units":2}},{"name":"d","dense":{"units":2}},{"name":"l","softmax_cross_entropy":{}}]})",
       "duplicate layer name 'd'"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d","dense":{"units":2},"inputs":["nope"]},{"name":"l","softmax_cross_entropy":{}}]})",
       "input 'nope' is not an earlier layer"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d","dense":{"units":2}}]})",
       "the last layer must be softmax_cross_entropy"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d","dense":{"units":2}},{"name":"x","relu":{}},{"name":"l","softmax_cross_entropy":{},"inputs":["d"]}]})",
       "layer 'x' (relu): its output is never used"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d","dense":{"units":2}},{"name":"p","dropout":{"rate":1.5}},{"name":"l","softmax_cross_entropy":{}}]})",
       "layer 'p' (dropout): rate must be in [0, 1)"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d","dense":{"units":2}},{"name":"p","max_pool":{"pool_size":2}},{"name":"l","softmax_cross_entropy":{}}]})",
       "layer 'p' (max_pool): needs a [C, H, W] input"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d","dense":{"units":2}},{"name":"a","add":{}},{"name":"l","softmax_cross_entropy":{}}]})",
       "layer 'a' (add): needs at least two inputs"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"bad name","dense":{"units":2}},{"name":"l","softmax_cross_entropy":{}}]})",
       "invalid name 'bad name'"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d"},{"name":"l","softmax_cross_entropy":{}}]})",
       "layer 'd': no layer type set"},
      {R"({"input_shape":[0,4,4],"num_classes":2,"layers":[{"name":"l","softmax_cross_entropy":{}}]})",
       "input_shape entries must be > 0"},
      {R"({"input_shape":[4],"num_classes":1,"layers":[{"name":"l","softmax_cross_entropy":{}}]})",
       "num_classes must be >= 2"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[]})", "model has no layers"},
      {R"({"input_shape":[4],"num_classes":2,"layers":[{"name":"d","dense":{"units":2}},{"name":"a","add":{},"inputs":["d","d","d"]},{"name":"l","softmax_cross_entropy":{}}]})",
       "layer 'a' (add): reads input 'd' more than twice"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(Error(c.json), HasSubstr(c.message)) << c.json;
  }
}

// Regression (issue 8): an int64-overflowing dense fan-in passed validation
// (the weight's element count wrapped around) and crashed the server later.
TEST(ModelGraphTest, ShapeArithmeticThatOverflowsIsRejected) {
  EXPECT_THAT(Error(R"({"input_shape": [2000000000, 2000000000, 2000000000], "num_classes": 2,
      "layers": [{"name": "flat", "flatten": {}}, {"name": "fc", "dense": {"units": 2}},
                 {"name": "loss", "softmax_cross_entropy": {}}]})"),
              HasSubstr("model.input_shape [2000000000, 2000000000, 2000000000] has more than"));
  // 1e6 x 1e6 activations are fine per se; a dense layer of 2^31-1 units
  // reading them would need 2^31 * 1e12 weights (overflows int64).
  EXPECT_THAT(Error(R"({"input_shape": [1, 1000000, 1000000], "num_classes": 2,
      "layers": [{"name": "flat", "flatten": {}}, {"name": "fc1", "dense": {"units": 2147483647}},
                 {"name": "fc2", "dense": {"units": 2}},
                 {"name": "loss", "softmax_cross_entropy": {}}]})"),
              HasSubstr("layer 'fc1' (dense): weight [2147483647, 1000000000000] has more than "
                        "1099511627776 elements"));
  EXPECT_THAT(Error(R"({"input_shape": [2000000000, 1, 1], "num_classes": 2,
      "layers": [{"name": "c", "conv2d": {"filters": 2000000000, "kernel_size": 1}},
                 {"name": "flat", "flatten": {}}, {"name": "fc", "dense": {"units": 2}},
                 {"name": "loss", "softmax_cross_entropy": {}}]})"),
              HasSubstr("layer 'c' (conv2d): weight [2000000000, 2000000000, 1, 1] has more than"));
}

// An external model (v1::ExternalModel, a PyTorch module's tensors).
v1::ExternalModel External(std::initializer_list<std::pair<const char*, std::vector<int64_t>>> ts,
                           int buffers_from = 1 << 30) {
  v1::ExternalModel model;
  model.set_framework("torch");
  int i = 0;
  for (const auto& [name, shape] : ts) {
    v1::ExternalTensor* t = model.add_tensors();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
    t->set_trainable(i++ < buffers_from);
  }
  return model;
}

TEST(ExternalGraphTest, TensorsBecomeParamsInTheDeclaredOrder) {
  absl::StatusOr<ModelGraph> graph =
      BuildExternalGraph(External({{"encoder.layers.0.self_attn.in_proj_weight", {48, 16}},
                                   {"encoder.layers.0.self_attn.in_proj_bias", {48}},
                                   {"bn.running_var", {16}},
                                   {"bn.num_batches_tracked", {}}},
                                  /*buffers_from=*/2));
  ASSERT_OK(graph);
  ASSERT_EQ(graph->params.size(), 4u);
  EXPECT_TRUE(graph->layers.empty());
  EXPECT_EQ(graph->name, "torch");
  EXPECT_EQ(graph->params[0].name, "encoder.layers.0.self_attn.in_proj_weight");
  EXPECT_EQ(graph->params[0].shape, Shape({48, 16}));
  EXPECT_TRUE(graph->params[0].trainable);
  EXPECT_EQ(graph->params[0].layer, -1);
  EXPECT_FALSE(graph->params[2].trainable);
  EXPECT_EQ(graph->params[2].role, ParamRole::kRunningMean);
  EXPECT_EQ(graph->params[3].shape.num_elements(), 1);  // A scalar.
  EXPECT_EQ(graph->trainable_params, 48 * 16 + 48);
  EXPECT_EQ(graph->non_trainable_params, 17);
}

TEST(ExternalGraphTest, BadDeclarationsAreRefusedNamingTheTensor) {
  auto error = [](const v1::ExternalModel& model) {
    absl::StatusOr<ModelGraph> graph = BuildExternalGraph(model);
    EXPECT_EQ(graph.status().code(), absl::StatusCode::kInvalidArgument) << graph.status();
    return std::string(graph.status().message());
  };
  EXPECT_THAT(error(v1::ExternalModel()), HasSubstr("declares no tensors"));
  EXPECT_THAT(error(External({{"w", {3}}, {"w", {3}}})), HasSubstr("tensor 'w' twice"));
  EXPECT_THAT(error(External({{"fc.weight", {3, 0}}})),
              HasSubstr("tensor 'fc.weight': dimensions must be > 0, got 0"));
  EXPECT_THAT(error(External({{"", {3}}})), HasSubstr("tensor #0 has invalid name ''"));
  EXPECT_THAT(error(External({{"a b", {3}}})), HasSubstr("invalid name 'a b'"));
  EXPECT_THAT(error(External({{"huge", {int64_t{1} << 30, int64_t{1} << 30}}})),
              HasSubstr("tensor 'huge' [1073741824, 1073741824] takes the model above"));
  EXPECT_THAT(error(External({{"a", {int64_t{1} << 39}}, {"b", {int64_t{1} << 39}}, {"c", {1}}})),
              HasSubstr("tensor 'c' [1] takes the model above"));
  v1::ExternalModel many;
  for (int i = 0; i <= kMaxExternalTensors; ++i) {
    v1::ExternalTensor* t = many.add_tensors();
    t->set_name(absl::StrCat("t", i));
    t->add_shape(1);
  }
  EXPECT_THAT(error(many), HasSubstr("more than 100000"));
}

TEST(ExternalGraphTest, AJobsGraphIsItsExternalModelWhenItHasOne) {
  v1::JobSpec job;
  job.mutable_model()->set_name("ignored-without-layers");
  *job.mutable_external_model() = External({{"w", {2, 3}}});
  absl::StatusOr<ModelGraph> graph = BuildJobGraph(job);
  ASSERT_OK(graph);
  ASSERT_EQ(graph->params.size(), 1u);
  EXPECT_EQ(graph->params[0].name, "w");
  job.clear_external_model();
  EXPECT_EQ(BuildJobGraph(job).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain
