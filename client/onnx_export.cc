#include "client/onnx_export.h"

#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/build_info.h"
#include "common/checkpoint.h"
#include "common/data/file_io.h"
#include "common/model_graph.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

// Builds the graph node by node; tensor names are layer names (the model's
// input is "input"), initializers are parameter names ("conv1/weight").
class GraphBuilder {
 public:
  explicit GraphBuilder(onnx::GraphProto* graph) : graph_(graph) {}

  onnx::NodeProto* Node(const std::string& op, const std::string& name,
                        const std::vector<std::string>& inputs, const std::string& output) {
    onnx::NodeProto* node = graph_->add_node();
    node->set_op_type(op);
    node->set_name(name);
    for (const std::string& input : inputs) node->add_input(input);
    node->add_output(output);
    return node;
  }

  static void Ints(onnx::NodeProto* node, const std::string& name, std::vector<int64_t> values) {
    onnx::AttributeProto* attr = node->add_attribute();
    attr->set_name(name);
    attr->set_type(onnx::AttributeProto::INTS);
    for (int64_t v : values) attr->add_ints(v);
  }
  static void Int(onnx::NodeProto* node, const std::string& name, int64_t value) {
    onnx::AttributeProto* attr = node->add_attribute();
    attr->set_name(name);
    attr->set_type(onnx::AttributeProto::INT);
    attr->set_i(value);
  }
  static void Float(onnx::NodeProto* node, const std::string& name, float value) {
    onnx::AttributeProto* attr = node->add_attribute();
    attr->set_name(name);
    attr->set_type(onnx::AttributeProto::FLOAT);
    attr->set_f(value);
  }

  void Initializer(const std::string& name, const Shape& shape, const std::vector<float>& values) {
    onnx::TensorProto* t = graph_->add_initializer();
    t->set_name(name);
    t->set_data_type(onnx::TensorProto::FLOAT);
    for (int64_t d : shape.dims()) t->add_dims(d);
    // raw_data is little-endian, as every machine pstrain runs on.
    t->set_raw_data(
        std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float)));
  }

  // A float tensor of shape [batch, dims...] as a graph input or output.
  static void ValueInfo(onnx::ValueInfoProto* info, const std::string& name, const Shape& shape) {
    info->set_name(name);
    onnx::TypeProto_Tensor* tensor = info->mutable_type()->mutable_tensor_type();
    tensor->set_elem_type(onnx::TensorProto::FLOAT);
    onnx::TensorShapeProto* s = tensor->mutable_shape();
    s->add_dim()->set_dim_param("batch");
    for (int64_t d : shape.dims()) s->add_dim()->set_dim_value(d);
  }

 private:
  onnx::GraphProto* graph_;
};

std::string FloatList(const google::protobuf::RepeatedField<float>& values) {
  return absl::StrCat("[", absl::StrJoin(values, ", "), "]");
}

}  // namespace

absl::StatusOr<onnx::ModelProto> ExportOnnx(const v1::Checkpoint& ckpt) {
  PSTRAIN_ASSIGN_OR_RETURN(const ModelGraph graph, BuildModelGraph(ckpt.job().model()));
  if (graph.logits_layer < 0) {
    return absl::InvalidArgumentError("the model has no softmax_cross_entropy layer: no logits");
  }
  std::map<std::string, const v1::TensorProto*> by_name;
  for (const v1::TensorProto& t : ckpt.parameters()) by_name[t.name()] = &t;

  onnx::ModelProto model;
  model.set_ir_version(kOnnxIrVersion);
  model.set_producer_name("pstrain");
  model.set_producer_version(BuildId());
  model.set_model_version(ckpt.step());
  onnx::OperatorSetIdProto* opset = model.add_opset_import();
  opset->set_domain("");
  opset->set_version(kOnnxOpset);
  const v1::DatasetSpec& data = ckpt.job().dataset();
  model.set_doc_string(absl::StrCat(
      "pstrain model '", graph.name, "' after ", ckpt.step(), " steps (", ckpt.epoch(),
      " epochs). Input: float [batch, ", absl::StrJoin(graph.input_shape.dims(), ", "),
      "], each pixel scaled to [0, 1] then normalised per channel as (x - mean) / std with mean ",
      FloatList(data.mean()), " and std ", FloatList(data.std()),
      " (empty: 0 and 1). Outputs: logits [batch, ", graph.num_classes,
      "] and their softmax, probabilities."));
  auto meta = [&model](const std::string& key, const std::string& value) {
    onnx::StringStringEntryProto* entry = model.add_metadata_props();
    entry->set_key(key);
    entry->set_value(value);
  };
  meta("pstrain.mean", FloatList(data.mean()));
  meta("pstrain.std", FloatList(data.std()));
  meta("pstrain.step", absl::StrCat(ckpt.step()));
  meta("pstrain.epoch", absl::StrCat(ckpt.epoch()));
  meta("pstrain.job", ckpt.job().name());

  onnx::GraphProto* g = model.mutable_graph();
  g->set_name(graph.name.empty() ? "pstrain" : graph.name);
  GraphBuilder b(g);
  GraphBuilder::ValueInfo(g->add_input(), "input", graph.input_shape);

  // The tensor each layer's output is in (a dropout forwards its input's).
  std::vector<std::string> out(graph.layers.size());
  auto input_of = [&](const LayerInfo& layer, size_t i) {
    const int producer = layer.inputs[i];
    return producer < 0 ? std::string("input") : out[producer];
  };
  auto param = [&](const LayerInfo& layer, ParamRole role) -> const ParamInfo* {
    for (int p : layer.params) {
      if (graph.params[p].role == role) return &graph.params[p];
    }
    return nullptr;
  };

  for (const ParamInfo& p : graph.params) {
    auto it = by_name.find(p.name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat("the checkpoint has no tensor ", p.name));
    }
    PSTRAIN_ASSIGN_OR_RETURN(std::vector<float> values, TensorProtoToFloats(*it->second));
    if (static_cast<int64_t>(values.size()) != p.shape.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the checkpoint's ", p.name, " has ", values.size(), " values; the model's ",
                       p.shape.ToString(), " needs ", p.shape.num_elements()));
    }
    b.Initializer(p.name, p.shape, values);
  }

  for (size_t i = 0; i < graph.layers.size(); ++i) {
    const LayerInfo& layer = graph.layers[i];
    const std::string& name = layer.name;
    if (static_cast<int>(i) == graph.loss_layer) continue;
    const std::string x = input_of(layer, 0);
    // The graph's own names ("input", "logits", "probabilities") stay free:
    // a layer named so gets "<name>/out".
    out[i] = name == "input" || name == "logits" || name == "probabilities"
                 ? absl::StrCat(name, "/out")
                 : name;
    const std::string& y = out[i];
    const ParamInfo* weight = param(layer, ParamRole::kWeight);
    const ParamInfo* bias = param(layer, ParamRole::kBias);
    switch (layer.type) {
      case LayerType::kConv2d: {
        const v1::Conv2dLayer& c = layer.spec.conv2d();
        std::vector<std::string> inputs = {x, weight->name};
        if (bias != nullptr) inputs.push_back(bias->name);
        onnx::NodeProto* node = b.Node("Conv", name, inputs, y);
        GraphBuilder::Ints(node, "kernel_shape", {weight->shape[2], weight->shape[3]});
        const int64_t stride = c.stride() == 0 ? 1 : c.stride();
        GraphBuilder::Ints(node, "strides", {stride, stride});
        const int64_t pad = c.padding();
        GraphBuilder::Ints(node, "pads", {pad, pad, pad, pad});
        break;
      }
      case LayerType::kMaxPool:
      case LayerType::kAvgPool: {
        const bool max = layer.type == LayerType::kMaxPool;
        const v1::Pool2dLayer& p = max ? layer.spec.max_pool() : layer.spec.avg_pool();
        onnx::NodeProto* node = b.Node(max ? "MaxPool" : "AveragePool", name, {x}, y);
        const int64_t k = p.pool_size();
        const int64_t stride = p.stride() == 0 ? k : p.stride();
        GraphBuilder::Ints(node, "kernel_shape", {k, k});
        GraphBuilder::Ints(node, "strides", {stride, stride});
        GraphBuilder::Ints(node, "pads", {p.padding(), p.padding(), p.padding(), p.padding()});
        if (!max) GraphBuilder::Int(node, "count_include_pad", 0);
        break;
      }
      case LayerType::kDense: {
        std::string a = x;
        if (layer.input_shapes[0].rank() != 1) {  // Read as [N, features].
          a = absl::StrCat(name, "/flatten");
          GraphBuilder::Int(b.Node("Flatten", a, {x}, a), "axis", 1);
        }
        std::vector<std::string> inputs = {a, weight->name};
        if (bias != nullptr) inputs.push_back(bias->name);
        GraphBuilder::Int(b.Node("Gemm", name, inputs, y), "transB", 1);
        break;
      }
      case LayerType::kRelu:
        b.Node("Relu", name, {x}, y);
        break;
      case LayerType::kLeakyRelu: {
        const float alpha = layer.spec.leaky_relu().alpha();
        GraphBuilder::Float(b.Node("LeakyRelu", name, {x}, y), "alpha",
                            alpha == 0.f ? 0.01f : alpha);
        break;
      }
      case LayerType::kTanh:
        b.Node("Tanh", name, {x}, y);
        break;
      case LayerType::kSigmoid:
        b.Node("Sigmoid", name, {x}, y);
        break;
      case LayerType::kDropout:
        out[i] = x;  // The identity at inference.
        break;
      case LayerType::kBatchNorm: {
        const float epsilon = layer.spec.batch_norm().epsilon();
        onnx::NodeProto* node =
            b.Node("BatchNormalization", name,
                   {x, param(layer, ParamRole::kGamma)->name, param(layer, ParamRole::kBeta)->name,
                    param(layer, ParamRole::kRunningMean)->name,
                    param(layer, ParamRole::kRunningVar)->name},
                   y);
        GraphBuilder::Float(node, "epsilon", epsilon == 0.f ? 1e-5f : epsilon);
        break;
      }
      case LayerType::kFlatten:
        GraphBuilder::Int(b.Node("Flatten", name, {x}, y), "axis", 1);
        break;
      case LayerType::kAdd: {
        std::vector<std::string> inputs;
        for (size_t k = 0; k < layer.inputs.size(); ++k) inputs.push_back(input_of(layer, k));
        b.Node(inputs.size() == 2 ? "Add" : "Sum", name, inputs, y);
        break;
      }
      case LayerType::kSoftmaxCrossEntropy:
        break;  // The loss layer, skipped above.
    }
  }

  b.Node("Identity", "output/logits", {out[graph.logits_layer]}, "logits");
  GraphBuilder::Int(b.Node("Softmax", "output/probabilities", {"logits"}, "probabilities"), "axis",
                    1);
  const Shape classes{graph.num_classes};
  GraphBuilder::ValueInfo(g->add_output(), "logits", classes);
  GraphBuilder::ValueInfo(g->add_output(), "probabilities", classes);

  // Protobuf's own limit on one message; larger models need ONNX's external
  // data, which this export does not write.
  if (model.ByteSizeLong() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ONNX model would be ", model.ByteSizeLong(),
                     " bytes, above protobuf's 2 GiB limit for one file"));
  }
  return model;
}

absl::Status WriteOnnxFile(const onnx::ModelProto& model, const std::string& path) {
  std::string bytes;
  if (!model.SerializeToString(&bytes)) {
    return absl::InternalError("could not serialise the ONNX model");
  }
  return data::WriteFileAtomically(path, bytes);
}

}  // namespace pstrain
