// Static analysis of a ModelSpec: validation, shape inference, parameter list
// and a Keras-style summary. Used by the worker to build the model, by the CLI
// (`pstrain summary`) and, later, by the coordinator to reject bad jobs at
// submit time. Knows nothing about devices.
//
//   PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, BuildModelGraph(spec.model()));
//   std::cout << FormatModelSummary(graph);
//   for (const ParamInfo& p : graph.params) ...;   // "conv1/weight" [32, 1, 5, 5]
#ifndef PSTRAIN_COMMON_MODEL_GRAPH_H_
#define PSTRAIN_COMMON_MODEL_GRAPH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/shape.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain {

enum class LayerType {
  kConv2d,
  kMaxPool,
  kAvgPool,
  kDense,
  kRelu,
  kLeakyRelu,
  kTanh,
  kSigmoid,
  kDropout,
  kBatchNorm,
  kFlatten,
  kAdd,
  kSoftmaxCrossEntropy,
};

// "conv2d", "max_pool", ... as spelled in job files.
const char* LayerTypeName(LayerType type);

enum class ParamRole { kWeight, kBias, kGamma, kBeta, kRunningMean, kRunningVar };

struct ParamInfo {
  std::string name;  // "<layer>/<role>", e.g. "conv1/weight".
  Shape shape;
  ParamRole role = ParamRole::kWeight;
  bool trainable = true;  // Running statistics are not trained (no gradient).
  int layer = 0;          // Index into ModelGraph::layers (-1: an external model's).
  // Fan-in and fan-out used by Glorot initialisation (weights only).
  int64_t fan_in = 0, fan_out = 0;
};

// One analysed layer. Shapes exclude the batch dimension.
struct LayerInfo {
  std::string name;
  LayerType type = LayerType::kRelu;
  v1::LayerSpec spec;
  std::vector<int> inputs;  // Producer layer indices; -1 is the model input.
  std::vector<Shape> input_shapes;
  Shape output_shape;          // [] (scalar) for the loss.
  std::vector<int> params;     // Indices into ModelGraph::params.
  int64_t param_count = 0;     // Elements over all params of this layer.
  std::vector<int> consumers;  // Layers that read this layer's output.
};

struct ModelGraph {
  std::string name;
  Shape input_shape;  // Per sample, e.g. [1, 28, 28].
  int num_classes = 0;
  uint64_t init_seed = 0;         // ModelSpec::init_seed.
  std::vector<LayerInfo> layers;  // Topological order (as in the spec).
  std::vector<ParamInfo> params;  // In layer order.
  int64_t trainable_params = 0;
  int64_t non_trainable_params = 0;
  int loss_layer = -1;    // Index of the softmax_cross_entropy layer (last).
  int logits_layer = -1;  // Its input: the [num_classes] logits.
};

// Hard ceiling on the elements of any one tensor (a parameter, or one
// sample's activation) and on a model's parameters in total, so that every
// size derived from a graph (bytes, times a batch of up to 65536) fits in
// int64_t. Jobs are held to much lower, configurable limits (JobLimits in
// common/job_spec.h); this one only makes the shape arithmetic safe.
inline constexpr int64_t kMaxGraphElements = int64_t{1} << 40;

// Validates `spec` and infers every shape. Errors are INVALID_ARGUMENT and
// name the layer, e.g. "layer 'add1' (add): input 'conv3' has shape
// [64, 8, 8] but input 'pool1' has shape [32, 8, 8]". Shape arithmetic is
// overflow-checked: a tensor above kMaxGraphElements is INVALID_ARGUMENT.
absl::StatusOr<ModelGraph> BuildModelGraph(const v1::ModelSpec& spec);

// The most tensors an ExternalModel may declare (a torchvision ResNet-152
// has 934 parameters and buffers).
inline constexpr int kMaxExternalTensors = 100000;

// The graph of a model written in the user's framework (v1::ExternalModel):
// its tensors as params, in the declared order, with no layers, no input
// shape and no classes. ParamInfo::role is kWeight for a trainable tensor and
// kRunningMean for a buffer; layer is -1. INVALID_ARGUMENT naming the tensor
// for an empty model, more than kMaxExternalTensors tensors, a name that is
// empty, too long, of other characters or given twice, a dimension <= 0, or
// a tensor or model above kMaxGraphElements.
absl::StatusOr<ModelGraph> BuildExternalGraph(const v1::ExternalModel& model);

// The graph of a job's model, whichever kind it is: BuildExternalGraph when
// the spec has an external_model, BuildModelGraph of `model` otherwise.
absl::StatusOr<ModelGraph> BuildJobGraph(const v1::JobSpec& job);

// Keras-style table: layer (type), output shape, parameter count, inputs,
// then the totals. An external model's (no layers): tensor, shape,
// parameter count and whether it is trained, then the totals.
std::string FormatModelSummary(const ModelGraph& graph);

// The initial value of every parameter (ModelGraph::params order): Glorot-
// uniform weights drawn from (init_seed, parameter name) with the counter RNG
// of common/rng.h, zero biases, betas and running means, unit gammas and
// running variances. Bit-identical wherever it runs (worker or server).
std::vector<std::vector<float>> InitialParameterValues(const ModelGraph& graph);

// Initial values that a client sent for `graph` (an external model's, as
// its worker declared them): one vector per parameter, each of its
// parameter's size, every value finite. INVALID_ARGUMENT naming the first
// parameter that is not.
absl::Status CheckParameterValues(const ModelGraph& graph,
                                  const std::vector<std::vector<float>>& values);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_MODEL_GRAPH_H_
