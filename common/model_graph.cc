#include "common/model_graph.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/rng.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

using v1::LayerSpec;

absl::StatusOr<LayerType> TypeOf(const LayerSpec& layer) {
  switch (layer.kind_case()) {
    case LayerSpec::kConv2D:
      return LayerType::kConv2d;
    case LayerSpec::kMaxPool:
      return LayerType::kMaxPool;
    case LayerSpec::kAvgPool:
      return LayerType::kAvgPool;
    case LayerSpec::kDense:
      return LayerType::kDense;
    case LayerSpec::kRelu:
      return LayerType::kRelu;
    case LayerSpec::kLeakyRelu:
      return LayerType::kLeakyRelu;
    case LayerSpec::kTanh:
      return LayerType::kTanh;
    case LayerSpec::kSigmoid:
      return LayerType::kSigmoid;
    case LayerSpec::kDropout:
      return LayerType::kDropout;
    case LayerSpec::kBatchNorm:
      return LayerType::kBatchNorm;
    case LayerSpec::kFlatten:
      return LayerType::kFlatten;
    case LayerSpec::kAdd:
      return LayerType::kAdd;
    case LayerSpec::kSoftmaxCrossEntropy:
      return LayerType::kSoftmaxCrossEntropy;
    case LayerSpec::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "layer '", layer.name(),
      "': no layer type set (expected one of conv2d, max_pool, avg_pool, dense, relu, "
      "leaky_relu, tanh, sigmoid, dropout, batch_norm, flatten, add, softmax_cross_entropy)"));
}

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) {
      return false;
    }
  }
  return true;
}

// Builds "layer 'conv1' (conv2d): <message>".
class LayerError {
 public:
  LayerError(const std::string& name, LayerType type)
      : prefix_(absl::StrCat("layer '", name, "' (", LayerTypeName(type), "): ")) {}
  template <typename... Args>
  absl::Status operator()(const Args&... args) const {
    return absl::InvalidArgumentError(absl::StrCat(prefix_, args...));
  }

 private:
  std::string prefix_;
};

// INVALID_ARGUMENT unless `shape` has at most kMaxGraphElements elements
// (checked arithmetic: the product may overflow int64_t).
absl::Status CheckTensorSize(const LayerError& error, const char* what, const Shape& shape) {
  std::optional<int64_t> n = shape.CheckedNumElements();
  if (!n || *n > kMaxGraphElements) {
    return error(what, " ", shape.ToString(), " has more than ", kMaxGraphElements, " elements");
  }
  return absl::OkStatus();
}

// Output side of a convolution or pooling window, or -1 if it does not fit.
int64_t WindowOutput(int64_t in, int64_t window, int64_t stride, int64_t pad) {
  int64_t span = in + 2 * pad - window;
  if (span < 0) return -1;
  return span / stride + 1;
}

void AddParam(ModelGraph& graph, LayerInfo& layer, int layer_index, const char* role_name,
              ParamRole role, Shape shape, bool trainable, int64_t fan_in = 0,
              int64_t fan_out = 0) {
  ParamInfo p;
  p.name = absl::StrCat(layer.name, "/", role_name);
  p.shape = std::move(shape);
  p.role = role;
  p.trainable = trainable;
  p.layer = layer_index;
  p.fan_in = fan_in;
  p.fan_out = fan_out;
  layer.params.push_back(static_cast<int>(graph.params.size()));
  layer.param_count += p.shape.num_elements();
  if (trainable) {
    graph.trainable_params += p.shape.num_elements();
  } else {
    graph.non_trainable_params += p.shape.num_elements();
  }
  graph.params.push_back(std::move(p));
}

// Infers the output shape and parameters of `layer` (inputs already resolved).
absl::Status AnalyseLayer(ModelGraph& graph, int index) {
  LayerInfo& layer = graph.layers[index];
  const LayerSpec& spec = layer.spec;
  LayerError error(layer.name, layer.type);
  const Shape& in = layer.input_shapes[0];

  if (layer.type != LayerType::kAdd && layer.inputs.size() != 1) {
    return error("takes exactly one input, got ", layer.inputs.size());
  }
  switch (layer.type) {
    case LayerType::kConv2d: {
      const v1::Conv2dLayer& c = spec.conv2d();
      if (in.rank() != 3) return error("needs a [C, H, W] input, got ", in.ToString());
      int64_t kh = c.kernel_h() > 0 ? c.kernel_h() : c.kernel_size();
      int64_t kw = c.kernel_w() > 0 ? c.kernel_w() : c.kernel_size();
      int64_t stride = c.stride() == 0 ? 1 : c.stride();
      if (c.filters() <= 0) return error("filters must be > 0, got ", c.filters());
      if (kh <= 0 || kw <= 0) return error("kernel_size must be > 0, got ", kh, "x", kw);
      if (c.kernel_h() < 0 || c.kernel_w() < 0) return error("kernel_h/kernel_w must be >= 0");
      if (stride < 0) return error("stride must be >= 1, got ", c.stride());
      if (c.padding() < 0) return error("padding must be >= 0, got ", c.padding());
      int64_t oh = WindowOutput(in[1], kh, stride, c.padding());
      int64_t ow = WindowOutput(in[2], kw, stride, c.padding());
      if (oh <= 0 || ow <= 0) {
        return error("kernel ", kh, "x", kw, " with padding ", c.padding(), " does not fit input ",
                     in.ToString());
      }
      layer.output_shape = Shape{c.filters(), oh, ow};
      PSTRAIN_RETURN_IF_ERROR(CheckTensorSize(error, "weight", Shape{c.filters(), in[0], kh, kw}));
      int64_t fan_in = in[0] * kh * kw;
      int64_t fan_out = c.filters() * kh * kw;
      AddParam(graph, layer, index, "weight", ParamRole::kWeight, Shape{c.filters(), in[0], kh, kw},
               true, fan_in, fan_out);
      if (!c.no_bias())
        AddParam(graph, layer, index, "bias", ParamRole::kBias, Shape{c.filters()}, true);
      return absl::OkStatus();
    }
    case LayerType::kMaxPool:
    case LayerType::kAvgPool: {
      const v1::Pool2dLayer& p =
          layer.type == LayerType::kMaxPool ? spec.max_pool() : spec.avg_pool();
      if (in.rank() != 3) return error("needs a [C, H, W] input, got ", in.ToString());
      if (p.pool_size() <= 0) return error("pool_size must be > 0, got ", p.pool_size());
      int64_t stride = p.stride() == 0 ? p.pool_size() : p.stride();
      if (stride < 0) return error("stride must be >= 1, got ", p.stride());
      if (p.padding() < 0 || p.padding() >= p.pool_size()) {
        return error("padding must be in [0, pool_size), got ", p.padding());
      }
      int64_t oh = WindowOutput(in[1], p.pool_size(), stride, p.padding());
      int64_t ow = WindowOutput(in[2], p.pool_size(), stride, p.padding());
      if (oh <= 0 || ow <= 0) {
        return error("window ", p.pool_size(), " does not fit input ", in.ToString());
      }
      layer.output_shape = Shape{in[0], oh, ow};
      return absl::OkStatus();
    }
    case LayerType::kDense: {
      const v1::DenseLayer& d = spec.dense();
      if (d.units() <= 0) return error("units must be > 0, got ", d.units());
      int64_t features = in.num_elements();  // <= kMaxGraphElements (checked before).
      layer.output_shape = Shape{d.units()};
      PSTRAIN_RETURN_IF_ERROR(CheckTensorSize(error, "weight", Shape{d.units(), features}));
      AddParam(graph, layer, index, "weight", ParamRole::kWeight, Shape{d.units(), features}, true,
               features, d.units());
      if (!d.no_bias())
        AddParam(graph, layer, index, "bias", ParamRole::kBias, Shape{d.units()}, true);
      return absl::OkStatus();
    }
    case LayerType::kLeakyRelu:
      if (spec.leaky_relu().alpha() < 0 || !std::isfinite(spec.leaky_relu().alpha())) {
        return error("alpha must be finite and >= 0, got ", spec.leaky_relu().alpha());
      }
      layer.output_shape = in;
      return absl::OkStatus();
    case LayerType::kRelu:
    case LayerType::kTanh:
    case LayerType::kSigmoid:
      layer.output_shape = in;
      return absl::OkStatus();
    case LayerType::kDropout: {
      float rate = spec.dropout().rate();
      if (!(rate >= 0.f && rate < 1.f)) return error("rate must be in [0, 1), got ", rate);
      layer.output_shape = in;
      return absl::OkStatus();
    }
    case LayerType::kBatchNorm: {
      const v1::BatchNormLayer& b = spec.batch_norm();
      if (in.rank() != 3 && in.rank() != 1) {
        return error("needs a [C, H, W] or [F] input, got ", in.ToString());
      }
      if (b.momentum() < 0 || b.momentum() >= 1) {
        return error("momentum must be in (0, 1) (0 means 0.1), got ", b.momentum());
      }
      if (b.epsilon() < 0) return error("epsilon must be > 0 (0 means 1e-5), got ", b.epsilon());
      layer.output_shape = in;
      Shape c{in[0]};
      AddParam(graph, layer, index, "gamma", ParamRole::kGamma, c, true);
      AddParam(graph, layer, index, "beta", ParamRole::kBeta, c, true);
      AddParam(graph, layer, index, "running_mean", ParamRole::kRunningMean, c, false);
      AddParam(graph, layer, index, "running_var", ParamRole::kRunningVar, c, false);
      return absl::OkStatus();
    }
    case LayerType::kFlatten:
      layer.output_shape = Shape{in.num_elements()};
      return absl::OkStatus();
    case LayerType::kAdd: {
      if (layer.inputs.size() < 2) {
        return error("needs at least two inputs, got ", layer.inputs.size());
      }
      for (size_t i = 1; i < layer.input_shapes.size(); ++i) {
        if (layer.input_shapes[i] != in) {
          return error("input '", spec.inputs(static_cast<int>(i)), "' has shape ",
                       layer.input_shapes[i].ToString(), " but input '", spec.inputs(0),
                       "' has shape ", in.ToString());
        }
      }
      layer.output_shape = in;
      return absl::OkStatus();
    }
    case LayerType::kSoftmaxCrossEntropy: {
      if (in.rank() != 1 || in[0] != graph.num_classes) {
        const std::string& producer =
            layer.inputs[0] < 0 ? std::string("input") : graph.layers[layer.inputs[0]].name;
        return error("input '", producer, "' has shape ", in.ToString(), " but num_classes is ",
                     graph.num_classes, " (expected [", graph.num_classes, "])");
      }
      layer.output_shape = Shape{};
      return absl::OkStatus();
    }
  }
  return error("unknown layer type");
}

}  // namespace

const char* LayerTypeName(LayerType type) {
  switch (type) {
    case LayerType::kConv2d:
      return "conv2d";
    case LayerType::kMaxPool:
      return "max_pool";
    case LayerType::kAvgPool:
      return "avg_pool";
    case LayerType::kDense:
      return "dense";
    case LayerType::kRelu:
      return "relu";
    case LayerType::kLeakyRelu:
      return "leaky_relu";
    case LayerType::kTanh:
      return "tanh";
    case LayerType::kSigmoid:
      return "sigmoid";
    case LayerType::kDropout:
      return "dropout";
    case LayerType::kBatchNorm:
      return "batch_norm";
    case LayerType::kFlatten:
      return "flatten";
    case LayerType::kAdd:
      return "add";
    case LayerType::kSoftmaxCrossEntropy:
      return "softmax_cross_entropy";
  }
  return "unknown";
}

namespace {

// An external tensor's name: 1-256 characters of [A-Za-z0-9_.:/-].
bool ValidTensorName(const std::string& name) {
  if (name.empty() || name.size() > 256) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' ||
          c == ':' || c == '/')) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<ModelGraph> BuildExternalGraph(const v1::ExternalModel& model) {
  if (model.tensors_size() == 0) {
    return absl::InvalidArgumentError("external_model declares no tensors");
  }
  if (model.tensors_size() > kMaxExternalTensors) {
    return absl::InvalidArgumentError(absl::StrCat("external_model declares ", model.tensors_size(),
                                                   " tensors, more than ", kMaxExternalTensors));
  }
  ModelGraph graph;
  graph.name = model.framework();
  std::set<std::string> names;
  int64_t total = 0;
  for (int i = 0; i < model.tensors_size(); ++i) {
    const v1::ExternalTensor& t = model.tensors(i);
    if (!ValidTensorName(t.name())) {
      return absl::InvalidArgumentError(absl::StrCat("external_model tensor #", i,
                                                     " has invalid name '", t.name().substr(0, 300),
                                                     "' (1-256 characters of [A-Za-z0-9_.:/-])"));
    }
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("external_model declares tensor '", t.name(), "' twice"));
    }
    std::vector<int64_t> dims(t.shape().begin(), t.shape().end());
    for (int64_t d : dims) {
      if (d <= 0) {
        return absl::InvalidArgumentError(absl::StrCat("external_model tensor '", t.name(),
                                                       "': dimensions must be > 0, got ", d));
      }
    }
    ParamInfo param;
    param.name = t.name();
    param.shape = Shape(std::move(dims));
    param.role = t.trainable() ? ParamRole::kWeight : ParamRole::kRunningMean;
    param.trainable = t.trainable();
    param.layer = -1;
    const std::optional<int64_t> n = param.shape.CheckedNumElements();
    if (!n || *n > kMaxGraphElements - total) {
      return absl::InvalidArgumentError(
          absl::StrCat("external_model tensor '", t.name(), "' ", param.shape.ToString(),
                       " takes the model above ", kMaxGraphElements, " elements"));
    }
    total += *n;
    (t.trainable() ? graph.trainable_params : graph.non_trainable_params) += *n;
    graph.params.push_back(std::move(param));
  }
  return graph;
}

absl::StatusOr<ModelGraph> BuildJobGraph(const v1::JobSpec& job) {
  if (job.has_external_model()) return BuildExternalGraph(job.external_model());
  return BuildModelGraph(job.model());
}

absl::StatusOr<ModelGraph> BuildModelGraph(const v1::ModelSpec& spec) {
  ModelGraph graph;
  graph.name = spec.name();
  graph.init_seed = spec.init_seed();
  if (spec.input_shape_size() != 3 && spec.input_shape_size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model.input_shape must be [C, H, W] or [F], got ", spec.input_shape_size(), " dims"));
  }
  std::vector<int64_t> dims;
  for (int d : spec.input_shape()) {
    if (d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.input_shape entries must be > 0, got ", d));
    }
    dims.push_back(d);
  }
  graph.input_shape = Shape(dims);
  if (std::optional<int64_t> n = graph.input_shape.CheckedNumElements();
      !n || *n > kMaxGraphElements) {
    return absl::InvalidArgumentError(absl::StrCat("model.input_shape ",
                                                   graph.input_shape.ToString(), " has more than ",
                                                   kMaxGraphElements, " elements"));
  }
  if (spec.num_classes() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.num_classes must be >= 2, got ", spec.num_classes()));
  }
  graph.num_classes = spec.num_classes();
  if (spec.layers_size() == 0) return absl::InvalidArgumentError("model has no layers");

  std::map<std::string, int> index_of;
  for (int i = 0; i < spec.layers_size(); ++i) {
    const LayerSpec& ls = spec.layers(i);
    if (!ValidName(ls.name())) {
      return absl::InvalidArgumentError(absl::StrCat("layer #", i, " has invalid name '", ls.name(),
                                                     "' (1-128 characters of [A-Za-z0-9_.-])"));
    }
    if (ls.name() == "input") {
      return absl::InvalidArgumentError("layer name 'input' is reserved for the model input");
    }
    if (index_of.count(ls.name())) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate layer name '", ls.name(), "'"));
    }
    PSTRAIN_ASSIGN_OR_RETURN(LayerType type, TypeOf(ls));
    LayerInfo info;
    info.name = ls.name();
    info.type = type;
    info.spec = ls;
    LayerError error(info.name, type);
    if (ls.inputs_size() == 0) {
      info.inputs.push_back(i - 1);  // -1 for the first layer: the model input.
    } else {
      for (const std::string& in : ls.inputs()) {
        if (in == "input") {
          info.inputs.push_back(-1);
          continue;
        }
        auto it = index_of.find(in);
        if (it == index_of.end()) {
          return error("input '", in,
                       "' is not an earlier layer (layers must be listed in order; use "
                       "'input' for the model input)");
        }
        info.inputs.push_back(it->second);
      }
    }
    for (int producer : info.inputs) {
      if (std::count(info.inputs.begin(), info.inputs.end(), producer) > 2) {
        return error("reads input '",
                     producer < 0 ? std::string("input") : graph.layers[producer].name,
                     "' more than twice (add it in two steps)");
      }
      if (producer >= 0 && graph.layers[producer].type == LayerType::kSoftmaxCrossEntropy) {
        return error("cannot read the output of the loss layer");
      }
      info.input_shapes.push_back(producer < 0 ? graph.input_shape
                                               : graph.layers[producer].output_shape);
    }
    index_of[info.name] = i;
    graph.layers.push_back(std::move(info));
    PSTRAIN_RETURN_IF_ERROR(AnalyseLayer(graph, i));
    PSTRAIN_RETURN_IF_ERROR(CheckTensorSize(error, "output shape", graph.layers[i].output_shape));
    // Every parameter is <= kMaxGraphElements, so this sum cannot overflow.
    if (graph.trainable_params + graph.non_trainable_params > kMaxGraphElements) {
      return error("the model has more than ", kMaxGraphElements, " parameters");
    }
    for (int producer : graph.layers[i].inputs) {
      if (producer >= 0) graph.layers[producer].consumers.push_back(i);
    }
    if (type == LayerType::kSoftmaxCrossEntropy) {
      if (graph.loss_layer >= 0) return error("a model has exactly one loss layer");
      graph.loss_layer = i;
      graph.logits_layer = graph.layers[i].inputs[0];
    }
  }
  if (graph.loss_layer != static_cast<int>(graph.layers.size()) - 1) {
    return absl::InvalidArgumentError(
        "the last layer must be softmax_cross_entropy (the loss), and only the last");
  }
  if (graph.logits_layer < 0) {
    return absl::InvalidArgumentError("softmax_cross_entropy cannot read the model input directly");
  }
  for (int i = 0; i + 1 < static_cast<int>(graph.layers.size()); ++i) {
    if (graph.layers[i].consumers.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer '", graph.layers[i].name, "' (", LayerTypeName(graph.layers[i].type),
                       "): its output is never used; every layer must lead to the loss"));
    }
  }
  return graph;
}

namespace {

uint64_t HashName(const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a.
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::vector<std::vector<float>> InitialParameterValues(const ModelGraph& graph) {
  std::vector<std::vector<float>> values(graph.params.size());
  for (size_t i = 0; i < graph.params.size(); ++i) {
    const ParamInfo& p = graph.params[i];
    std::vector<float>& host = values[i];
    host.resize(p.shape.num_elements());
    switch (p.role) {
      case ParamRole::kWeight: {
        const double limit = std::sqrt(6.0 / static_cast<double>(p.fan_in + p.fan_out));
        // The model's init_seed picks the stream; the name makes every tensor
        // independent of the others and of its position in the spec.
        const uint64_t tensor_seed = MixBits(graph.init_seed, HashName(p.name));
        for (size_t k = 0; k < host.size(); ++k) {
          host[k] = static_cast<float>((2.0 * UniformFloat(tensor_seed, k) - 1.0) * limit);
        }
        break;
      }
      case ParamRole::kGamma:
      case ParamRole::kRunningVar:
        std::fill(host.begin(), host.end(), 1.f);
        break;
      case ParamRole::kBias:
      case ParamRole::kBeta:
      case ParamRole::kRunningMean:
        std::fill(host.begin(), host.end(), 0.f);
        break;
    }
  }
  return values;
}

namespace {

// FormatModelSummary's table of an external model: its tensors, as the
// servers hold them.
std::string TensorTable(const ModelGraph& graph) {
  size_t w0 = 18, w1 = 14;
  for (const ParamInfo& p : graph.params) {
    w0 = std::max(w0, p.name.size() + 2);
    w1 = std::max(w1, p.shape.ToString().size() + 2);
  }
  const size_t w2 = 14;
  auto line = [&](char c) { return std::string(w0 + w1 + w2 + 9, c) + "\n"; };
  std::string out =
      absl::StrCat("External model: \"", graph.name, "\" (", graph.params.size(), " tensors)\n");
  out += line('_');
  out += absl::StrFormat("%-*s%-*s%-*s%s\n", w0, "Tensor", w1, "Shape", w2, "Param #", "Trained");
  out += line('=');
  for (const ParamInfo& p : graph.params) {
    out += absl::StrFormat("%-*s%-*s%-*d%s\n", w0, p.name, w1, p.shape.ToString(), w2,
                           p.shape.num_elements(), p.trainable ? "yes" : "no (buffer)");
  }
  out += line('=');
  return out;
}

// FormatModelSummary's table of a ModelSpec's graph: its layers.
std::string LayerTable(const ModelGraph& graph) {
  struct Row {
    std::string layer, shape, params, inputs;
  };
  std::vector<Row> rows;
  rows.push_back({absl::StrCat("input (input)"),
                  absl::StrCat("(None, ", absl::StrJoin(graph.input_shape.dims(), ", "), ")"), "0",
                  ""});
  for (const LayerInfo& layer : graph.layers) {
    Row row;
    row.layer = absl::StrCat(layer.name, " (", LayerTypeName(layer.type), ")");
    row.shape = layer.output_shape.rank() == 0
                    ? std::string("()")
                    : absl::StrCat("(None, ", absl::StrJoin(layer.output_shape.dims(), ", "), ")");
    row.params = absl::StrCat(layer.param_count);
    std::vector<std::string> names;
    for (int in : layer.inputs) names.push_back(in < 0 ? "input" : graph.layers[in].name);
    row.inputs = absl::StrJoin(names, ", ");
    rows.push_back(std::move(row));
  }
  size_t w0 = 18, w1 = 18, w2 = 10;
  for (const Row& r : rows) {
    w0 = std::max(w0, r.layer.size() + 2);
    w1 = std::max(w1, r.shape.size() + 2);
    w2 = std::max(w2, r.params.size() + 2);
  }
  auto line = [&](char c) { return std::string(w0 + w1 + w2 + 20, c) + "\n"; };
  std::string out = absl::StrCat("Model: \"", graph.name, "\"\n");
  out += line('_');
  out += absl::StrFormat("%-*s%-*s%-*s%s\n", w0, "Layer (type)", w1, "Output Shape", w2, "Param #",
                         "Inputs");
  out += line('=');
  for (size_t i = 0; i < rows.size(); ++i) {
    out += absl::StrFormat("%-*s%-*s%-*s%s\n", w0, rows[i].layer, w1, rows[i].shape, w2,
                           rows[i].params, rows[i].inputs);
    out += line(i + 1 == rows.size() ? '=' : '_');
  }
  return out;
}

}  // namespace

std::string FormatModelSummary(const ModelGraph& graph) {
  std::string out = graph.layers.empty() ? TensorTable(graph) : LayerTable(graph);
  out += absl::StrCat("Total params: ", graph.trainable_params + graph.non_trainable_params, "\n");
  out += absl::StrCat("Trainable params: ", graph.trainable_params, "\n");
  out += absl::StrCat("Non-trainable params: ", graph.non_trainable_params, "\n");
  return out;
}

absl::Status CheckParameterValues(const ModelGraph& graph,
                                  const std::vector<std::vector<float>>& values) {
  if (values.size() != graph.params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the model has ", graph.params.size(), " tensors; values were sent for ", values.size()));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const ParamInfo& p = graph.params[i];
    if (static_cast<int64_t>(values[i].size()) != p.shape.num_elements()) {
      return absl::InvalidArgumentError(absl::StrCat("'", p.name, "' has ", p.shape.num_elements(),
                                                     " values; ", values[i].size(), " were sent"));
    }
    for (size_t j = 0; j < values[i].size(); ++j) {
      if (!std::isfinite(values[i][j])) {
        return absl::InvalidArgumentError(
            absl::StrCat("'", p.name, "' value ", j, " is ", values[i][j], ", not finite"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pstrain
