// A model built from a ModelSpec on a Backend: parameters, gradients,
// activations, forward and backward.
//
//   PSTRAIN_ASSIGN_OR_RETURN(auto model, Model::Create(job.model(), backend));
//   PSTRAIN_RETURN_IF_ERROR(model->InitializeParameters());
//   model->SetGradientReadyCallback([&](int layer, absl::Span<const int> params) {
//     ...  // e.g. start pushing these gradients; must not block
//   });
//   PSTRAIN_RETURN_IF_ERROR(model->Forward(images, labels, batch, /*training=*/true, seed));
//   PSTRAIN_RETURN_IF_ERROR(model->Backward());
//   // model->grad(i) now holds d loss / d param(i) for every trainable param.
//
// Parameters are addressed by index (ModelGraph::params order) or by name
// ("conv1/weight"). Between steps, a caller may overwrite param(i) (e.g. with
// weights pulled from a parameter server): the next Forward uses them.
//
// A convolution whose only consumer is a ReLU whose only consumer is a
// max-pool runs as one ConvReluPoolPlan where the backend has one (the CPU:
// the convolution's output never leaves oneDNN's blocked layout); the
// convolution's and the ReLU's outputs then get no buffers. Otherwise, and
// on backends without such plans,
// a ReLU followed by max-pooling runs fused, as the pooling of the ReLU's input
// followed by a ReLU of the (four times smaller) pooled output: the two
// commute, and in backward the pooled output masks the gradient before the
// pooling routes it. Loss, outputs and gradients are bit-identical to the
// layer-by-layer order for finite inputs (a NaN reaching such a ReLU gives 0
// unfused and 0 for its whole window fused; training has diverged either
// way). ModelOptions::fuse_relu_max_pool turns it off.
//
// Mixed precision (ModelOptions::precision bf16 or fp16, on a backend that
// supports it): activations and their gradients are bf16/fp16, and so are
// copies of the convolution and dense parameters, refreshed from the fp32
// param() values at every Forward; convolutions and GEMMs run on tensor
// cores with fp32 accumulation. grad() stays fp32: each layer's reduced-
// precision gradients are converted (and unscaled) into it, so optimizers,
// updaters and the wire see fp32 as ever. Batch norm keeps fp32 scales and
// statistics. fp16 uses dynamic loss scaling: the loss gradient is
// multiplied by loss_scale() (2^16 at first); a step whose gradients
// overflow leaves them zero, reports last_backward_overflowed(), and halves
// the scale; 2000 steps in a row without overflow double it. Deciding that
// needs the whole backward pass, so in fp16 Backward waits for the device
// once at its end and only then fires the gradient callbacks.
//
// Threads: one thread at a time (the Backend's rule). The gradient callback
// runs on that thread, in the middle of Backward.
#ifndef PSTRAIN_WORKER_MODEL_H_
#define PSTRAIN_WORKER_MODEL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/model_graph.h"
#include "kernels/backend.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/tensor.pb.h"
#include "worker/layers.h"

namespace pstrain {

struct ModelOptions {
  // Fuse each ReLU whose only consumer is a max-pool into that pool, and
  // (where the backend can) a convolution into such a pair (see above). Off
  // only to compare against the layer-by-layer order.
  bool fuse_relu_max_pool = true;
  bool fuse_conv_relu_pool = true;
  // Of activations (see above). bf16 and fp16 need a backend whose
  // SupportsDataType accepts them (CUDA); Create fails otherwise.
  DataType precision = DataType::kF32;
  // fp16: the first loss scale (where PyTorch's GradScaler starts too).
  float initial_loss_scale = 65536.f;
};

// The activations' DataType of a job's precision (kF32 for an unknown one;
// ValidateJobSpec refuses those).
inline DataType DataTypeOf(v1::Precision precision) {
  switch (precision) {
    case v1::PRECISION_BF16:
      return DataType::kBF16;
    case v1::PRECISION_FP16:
      return DataType::kF16;
    default:
      return DataType::kF32;
  }
}

// fp16 loss scaling (as PyTorch's GradScaler defaults): clean steps between
// doublings, and the largest scale a doubling reaches.
inline constexpr int64_t kLossScaleGrowthInterval = 2000;
inline constexpr float kMaxLossScale = 16777216.f;  // 2^24.

class Model {
 public:
  // Fires once per layer with trainable parameters, in backward order, as soon
  // as that layer's parameter gradients have been enqueued on the backend
  // (wait on backend->RecordEvent() before reading them from another thread).
  // `params` are indices into graph().params. Must not block.
  using GradientReadyCallback = std::function<void(int layer, absl::Span<const int> params)>;

  // Validates the spec (BuildModelGraph) and allocates every parameter and
  // gradient. Activations are allocated on first use of a batch size.
  static absl::StatusOr<std::unique_ptr<Model>> Create(const v1::ModelSpec& spec, Backend* backend,
                                                       const ModelOptions& options = {});

  // Deterministic initialisation from spec.init_seed: Glorot-uniform weights,
  // zero biases and betas, unit gammas and running variances, zero running
  // means. Identical on every backend.
  absl::Status InitializeParameters();

  // images: device [batch, input_shape] floats; labels: device [batch] int32.
  // `seed` feeds dropout (use a different one every step).
  absl::Status Forward(const float* images, const int32_t* labels, int batch, bool training,
                       uint64_t seed);
  // Gradients of the mean loss of the last training Forward.
  absl::Status Backward();

  void SetGradientReadyCallback(GradientReadyCallback callback) {
    gradient_ready_ = std::move(callback);
  }

  const ModelGraph& graph() const { return graph_; }
  Backend* backend() const { return backend_; }
  int num_params() const { return static_cast<int>(params_.size()); }
  const ParamInfo& param_info(int i) const { return graph_.params[i]; }
  Tensor& param(int i) { return params_[i]; }
  // Empty tensor for non-trainable parameters (running statistics).
  Tensor& grad(int i) { return grads_[i]; }
  // -1 when unknown.
  int FindParam(const std::string& name) const;

  // Device scalar holding the mean loss of the last Forward.
  const float* loss() const { return loss_.data(); }
  // Device [batch, num_classes] fp32 logits of the last Forward.
  const float* logits() const;

  DataType precision() const { return precision_; }
  // The factor the loss gradient is scaled by (1 unless fp16).
  float loss_scale() const { return loss_scale_; }
  // fp16: the last Backward's gradients overflowed; grad() holds zeros and
  // the step should not be applied.
  bool last_backward_overflowed() const { return last_overflowed_; }
  int64_t overflowed_steps() const { return overflowed_steps_; }

  // Host copies of every parameter (running statistics included), named as
  // in the graph. Synchronises the backend.
  absl::Status ExportParameters(std::vector<v1::TensorProto>* out);
  // Replaces parameters from named tensors. Every parameter must be present
  // with its exact shape and dtype f32; extra names are errors. On error no
  // parameter has been modified.
  absl::Status ImportParameters(const std::vector<v1::TensorProto>& tensors);

 private:
  Model(ModelGraph graph, Backend* backend, DataType precision)
      : graph_(std::move(graph)), backend_(backend), precision_(precision) {}
  bool reduced() const { return precision_ != DataType::kF32; }
  // Whether the images are [C, H, W] with more than one position, held
  // channels last.
  bool InputTransposed() const {
    const Shape& in = graph_.input_shape;
    return channels_last_ && in.rank() == 3 && in[1] * in[2] > 1;
  }
  bool dynamic_loss_scaling() const { return precision_ == DataType::kF16; }
  absl::Status PrepareBatch(int batch);
  // Layer l's input slot i: the model input or a producer's output.
  const void* InputOf(int l, int slot) const;
  // What the layers read as parameter p, and write its gradient to.
  void* ComputeParam(int p) {
    return compute_params_[p].empty() ? params_[p].raw() : compute_params_[p].raw();
  }
  void* ComputeGrad(int p) {
    return compute_grads_[p].empty() ? grads_[p].raw() : compute_grads_[p].raw();
  }
  // Reduced precision: converts layer l's parameter gradients into grad(),
  // unscaled.
  absl::Status FinishGradients(int l);
  // fp16: reads the overflow flag (waiting for the device), adjusts the
  // loss scale, and zeroes grad() after an overflow.
  absl::Status CheckOverflow();
  // The fused ReLU -> max-pool pair ending at pool layer `pool`.
  absl::Status FusedForward(int pool, const ForwardArgs& pool_args);
  absl::Status FusedBackward(int relu, void* d_relu_input);
  // Layer l is part of a conv -> ReLU -> max-pool block run as one plan.
  bool InBlock(int l) const { return block_of_[l] >= 0 && blocks_[block_of_[l]].active; }
  // Creates (or finds) each block's plan for `batch`; the first time, a
  // block the backend cannot run as one plan is turned off for good.
  absl::Status PrepareBlocks(int batch);

  // Constant after construction.
  const ModelGraph graph_;
  Backend* const backend_;
  const DataType precision_;

  std::vector<std::unique_ptr<Layer>> layers_;
  // Per layer: for a fused ReLU, the max-pool layer it runs inside; for that
  // pool, the ReLU; -1 elsewhere. A fused ReLU has no activation buffers.
  std::vector<int> fused_with_;
  struct ConvBlock {
    int conv = -1, relu = -1, pool = -1;
    bool active = true;                                      // False once the backend declined it.
    std::map<int, std::unique_ptr<ConvReluPoolPlan>> plans;  // Per batch size.
    ConvReluPoolPlan* plan = nullptr;                        // For prepared_batch_.
  };
  std::vector<ConvBlock> blocks_;
  std::vector<int> block_of_;  // Per layer: its index in blocks_, or -1.
  std::vector<Tensor> params_;
  std::vector<Tensor> grads_;
  // Reduced precision, per parameter of a convolution or dense layer: its
  // precision_ copy and gradient (empty elsewhere).
  std::vector<Tensor> compute_params_;
  std::vector<Tensor> compute_grads_;
  // The batch's images as the layers read them: in precision_ (reduced
  // precision), channels last (InputTransposed), or both; else empty.
  Tensor input_cast_;
  // The backend's Backend::ChannelsLast(precision_): [C, H, W] activations,
  // the input too, are held as [H, W, C]; input_nchw_ holds the images in
  // reduced precision before they are transposed.
  bool channels_last_ = false;
  Tensor input_nchw_;
  Tensor logits_f32_;  // Reduced precision: the logits in fp32.
  // fp16 loss scaling.
  float loss_scale_ = 1.f;
  int64_t steps_since_overflow_ = 0;
  bool last_overflowed_ = false;
  int64_t overflowed_steps_ = 0;
  DeviceBuffer overflow_flag_;     // int32 on the device, set by Convert.
  PinnedBuffer overflow_host_;     // Its copy.
  std::vector<Tensor> outputs_;    // Per layer, [batch, output_shape].
  std::vector<Tensor> d_outputs_;  // Per layer, gradient w.r.t. outputs_.
  std::vector<Tensor> scratch_;    // Per layer with fan-out > 1: partial gradients.
  Tensor loss_;
  int batch_ = 0;                  // Batch size of the allocated activations.
  int prepared_batch_ = 0;
  const void* input_ = nullptr;
  const int32_t* labels_ = nullptr;
  bool last_forward_training_ = false;
  GradientReadyCallback gradient_ready_;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_MODEL_H_
