// Layers: the runtime twin of each LayerType, running on a Backend.
//
// Adding a layer type:
//  1. add it to the LayerSpec oneof in proto/pstrain/v1/job.proto and to
//     LayerType + AnalyseLayer() in common/model_graph.cc (shapes, params);
//  2. write a Layer subclass in worker/layers.cc and register it in
//     LayerFactories() at the bottom of that file;
//  3. add it to the gradient checks in tests/worker/layers_test.cc.
//
// A Layer holds no parameters: the Model owns every tensor (activations,
// gradients, parameters) and passes device pointers in. A Layer may own
// per-batch-size state (plans, saved statistics, masks).
//
// Threads: used from the trainer's thread only, like the Backend.
#ifndef PSTRAIN_WORKER_LAYERS_H_
#define PSTRAIN_WORKER_LAYERS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_graph.h"
#include "kernels/backend.h"

namespace pstrain {

// Activations, and the parameters of convolutions and dense layers, hold
// the layer's dtype() elements; batch-norm parameters and the loss are fp32.
struct ForwardArgs {
  int batch = 0;
  std::vector<const void*> inputs;  // One per LayerInfo::inputs, [batch, input_shape].
  void* output = nullptr;           // [batch, output_shape]; the loss: an fp32 device scalar.
  std::vector<void*> params;        // One per LayerInfo::params.
  bool training = false;
  uint64_t seed = 0;                // Per step and layer (dropout).
  const int32_t* labels = nullptr;  // Loss layer only: [batch] device labels.
  float loss_scale = 1.f;           // Loss layer only: the gradient it hands back is scaled.
};

struct BackwardArgs {
  int batch = 0;
  std::vector<const void*> inputs;
  const void* output = nullptr;
  const void* d_output = nullptr;  // Gradient w.r.t. the output; unused by the loss.
  std::vector<void*> d_inputs;     // Overwritten; nullptr where not needed (model input).
  std::vector<void*> params;
  std::vector<void*> d_params;  // Overwritten; nullptr for non-trainable params.
};

class Layer {
 public:
  virtual ~Layer() = default;

  // Creates the layer for `info`, computing in `dtype` (ForwardArgs); fails
  // for unknown types. `channels_last` (Backend::ChannelsLast): every
  // [C, H, W] activation, the model's input included, is held as [H, W, C];
  // flatten and dense layers put such inputs back in [C, H, W] order, so
  // the parameters mean the same either way.
  static absl::StatusOr<std::unique_ptr<Layer>> Create(const LayerInfo& info,
                                                       DataType dtype = DataType::kF32,
                                                       bool channels_last = false);

  // (Re)creates per-batch-size state. Called before the first Forward at a
  // given batch size.
  virtual absl::Status Prepare(Backend* backend, int batch) { return absl::OkStatus(); }
  virtual absl::Status Forward(Backend* backend, const ForwardArgs& args) = 0;
  // Requires a preceding Forward(training = true) at the same batch size.
  virtual absl::Status Backward(Backend* backend, const BackwardArgs& args) = 0;

 protected:
  explicit Layer(const LayerInfo& info) : info_(info) {}
  const LayerInfo& info() const { return info_; }
  DataType dtype() const { return dtype_; }
  bool channels_last() const { return channels_last_; }
  // The plan layout of input `i`: kNHWC for a [C, H, W] input of a
  // channels-last layer.
  TensorLayout input_layout(int i = 0) const {
    return channels_last_ && info_.input_shapes[i].rank() == 3 ? TensorLayout::kNHWC
                                                               : TensorLayout::kNCHW;
  }
  // Whether input `i` is a channels-last [C, H, W] with more than one
  // position, whose memory order differs from [C, H, W]'s.
  bool input_transposed(int i = 0) const {
    const Shape& in = info_.input_shapes[i];
    return input_layout(i) == TensorLayout::kNHWC && in[1] * in[2] > 1;
  }
  size_t element_bytes() const { return DataTypeBytes(dtype_); }
  int64_t in_per_sample(int i = 0) const { return info_.input_shapes[i].num_elements(); }
  int64_t out_per_sample() const { return info_.output_shape.num_elements(); }

 private:
  const LayerInfo info_;  // Constant after construction.
  DataType dtype_ = DataType::kF32;  // Set once by Create.
  bool channels_last_ = false;       // Set once by Create.
};

// The plan configurations of a conv2d or pool layer at `batch` samples, as
// the layers build them (the model uses them for fused plans).
Conv2dConfig Conv2dConfigFor(const LayerInfo& info, int batch, DataType dtype = DataType::kF32);
bool ConvHasBias(const LayerInfo& info);
Pool2dConfig Pool2dConfigFor(const LayerInfo& info, int batch, DataType dtype = DataType::kF32);

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_LAYERS_H_
