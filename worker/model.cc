#include "worker/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "common/rng.h"
#include "common/status_macros.h"

namespace pstrain {

namespace {

// The max-pool layer that ReLU layer `l` can run fused into, or -1: the
// pool must be the ReLU's only consumer and read nothing else.
int FusablePool(const ModelGraph& g, int l) {
  const LayerInfo& relu = g.layers[l];
  if (relu.type != LayerType::kRelu || relu.consumers.size() != 1) return -1;
  const int pool = relu.consumers[0];
  const LayerInfo& info = g.layers[pool];
  if (info.type != LayerType::kMaxPool || info.inputs.size() != 1) return -1;
  return pool;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const v1::ModelSpec& spec, Backend* backend,
                                                     const ModelOptions& options) {
  if (backend == nullptr) return absl::InvalidArgumentError("Model::Create: null backend");
  if (!backend->SupportsDataType(options.precision)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "precision ", DataTypeName(options.precision),
        " needs a CUDA device with tensor cores for it (fp16: compute capability 7.0+, bf16: "
        "8.0+); ",
        backend->Describe(), " cannot run it (set precision to fp32)"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, BuildModelGraph(spec));
  std::unique_ptr<Model> model(new Model(std::move(graph), backend, options.precision));
  const ModelGraph& g = model->graph_;
  model->channels_last_ = backend->ChannelsLast(options.precision);
  for (const LayerInfo& info : g.layers) {
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer,
                             Layer::Create(info, options.precision, model->channels_last_));
    model->layers_.push_back(std::move(layer));
  }
  model->block_of_.assign(g.layers.size(), -1);
  // Conv -> ReLU -> pool plans are fp32 (the CPU's) and NCHW.
  if (options.fuse_relu_max_pool && options.fuse_conv_relu_pool && !model->reduced() &&
      !model->channels_last_) {
    for (int l = 0; l < static_cast<int>(g.layers.size()); ++l) {
      const LayerInfo& conv = g.layers[l];
      if (conv.type != LayerType::kConv2d || conv.consumers.size() != 1) continue;
      const int relu = conv.consumers[0];
      if (g.layers[relu].inputs.size() != 1) continue;
      const int pool = FusablePool(g, relu);
      if (pool < 0) continue;
      ConvBlock block;
      block.conv = l;
      block.relu = relu;
      block.pool = pool;
      for (int member : {l, relu, pool}) {
        model->block_of_[member] = static_cast<int>(model->blocks_.size());
      }
      model->blocks_.push_back(std::move(block));
    }
  }
  model->fused_with_.assign(g.layers.size(), -1);
  if (options.fuse_relu_max_pool) {
    for (int l = 0; l < static_cast<int>(g.layers.size()); ++l) {
      const int pool = FusablePool(g, l);
      if (pool < 0) continue;
      model->fused_with_[l] = pool;
      model->fused_with_[pool] = l;
    }
  }
  for (const ParamInfo& p : g.params) {
    PSTRAIN_ASSIGN_OR_RETURN(Tensor value, backend->AllocateTensor(p.shape));
    model->params_.push_back(std::move(value));
    if (p.trainable) {
      PSTRAIN_ASSIGN_OR_RETURN(Tensor grad, backend->AllocateTensor(p.shape));
      PSTRAIN_RETURN_IF_ERROR(backend->Fill(grad.data(), 0.f, grad.num_elements()));
      model->grads_.push_back(std::move(grad));
    } else {
      model->grads_.emplace_back();
    }
    // Convolutions and dense layers read reduced-precision copies; batch
    // norm reads its fp32 parameters directly.
    const LayerType owner = g.layers[p.layer].type;
    model->compute_params_.emplace_back();
    model->compute_grads_.emplace_back();
    if (model->reduced() && (owner == LayerType::kConv2d || owner == LayerType::kDense)) {
      PSTRAIN_ASSIGN_OR_RETURN(model->compute_params_.back(),
                               backend->AllocateTensor(p.shape, options.precision));
      if (p.trainable) {
        PSTRAIN_ASSIGN_OR_RETURN(model->compute_grads_.back(),
                                 backend->AllocateTensor(p.shape, options.precision));
      }
    }
  }
  PSTRAIN_ASSIGN_OR_RETURN(model->loss_, backend->AllocateTensor(Shape{1}));
  if (model->dynamic_loss_scaling()) {
    if (!(options.initial_loss_scale >= 1.f) || !std::isfinite(options.initial_loss_scale)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "initial_loss_scale must be finite and >= 1, got ", options.initial_loss_scale));
    }
    model->loss_scale_ = options.initial_loss_scale;
    PSTRAIN_ASSIGN_OR_RETURN(model->overflow_flag_, backend->Allocate(sizeof(int32_t)));
    PSTRAIN_ASSIGN_OR_RETURN(model->overflow_host_, backend->AllocatePinned(sizeof(int32_t)));
    static const int32_t kZeroFlag = 0;
    PSTRAIN_RETURN_IF_ERROR(
        backend->CopyHostToDevice(model->overflow_flag_.data(), &kZeroFlag, sizeof(int32_t)));
    PSTRAIN_RETURN_IF_ERROR(backend->Synchronize());
  }
  return model;
}

absl::Status Model::InitializeParameters() {
  std::vector<std::vector<float>> values = InitialParameterValues(graph_);
  for (int i = 0; i < num_params(); ++i) {
    PSTRAIN_RETURN_IF_ERROR(backend_->CopyHostToDevice(params_[i].data(), values[i].data(),
                                                       values[i].size() * sizeof(float)));
  }
  // `values` dies on return: make the copies complete.
  return backend_->Synchronize();
}

absl::Status Model::PrepareBlocks(int batch) {
  for (ConvBlock& block : blocks_) {
    if (!block.active) continue;
    auto it = block.plans.find(batch);
    if (it == block.plans.end()) {
      const LayerInfo& conv = graph_.layers[block.conv];
      absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> plan =
          backend_->CreateConvReluPool(Conv2dConfigFor(conv, batch), ConvHasBias(conv),
                                       Pool2dConfigFor(graph_.layers[block.pool], batch));
      if (absl::IsUnimplemented(plan.status()) && batch_ == 0) {
        block.active = false;  // Decided before any buffer was laid out.
        continue;
      }
      if (!plan.ok()) {
        return absl::Status(
            plan.status().code(),
            absl::StrCat("layers '", conv.name, "' to '", graph_.layers[block.pool].name,
                         "' as one plan: ", plan.status().message()));
      }
      it = block.plans.emplace(batch, *std::move(plan)).first;
    }
    block.plan = it->second.get();
  }
  return absl::OkStatus();
}

absl::Status Model::PrepareBatch(int batch) {
  if (batch <= 0) return absl::InvalidArgumentError(absl::StrCat("batch must be > 0, got ", batch));
  if (batch != prepared_batch_) PSTRAIN_RETURN_IF_ERROR(PrepareBlocks(batch));
  if (batch > batch_) {
    outputs_.clear();
    d_outputs_.clear();
    scratch_.clear();
    for (size_t l = 0; l < graph_.layers.size(); ++l) {
      const LayerInfo& info = graph_.layers[l];
      const bool inside_block = InBlock(l) && static_cast<int>(l) != blocks_[block_of_[l]].pool;
      if (inside_block || (graph_.layers[l].type == LayerType::kRelu && fused_with_[l] >= 0)) {
        outputs_.emplace_back();  // Nothing reads a fused ReLU's (or block's conv's) output.
        d_outputs_.emplace_back();
        scratch_.emplace_back();
        continue;
      }
      std::vector<int64_t> dims{batch};
      for (int64_t d : info.output_shape.dims()) dims.push_back(d);
      Shape shape = info.output_shape.rank() == 0 ? Shape{1} : Shape(std::move(dims));
      PSTRAIN_ASSIGN_OR_RETURN(Tensor out, backend_->AllocateTensor(shape, precision_));
      PSTRAIN_ASSIGN_OR_RETURN(Tensor dout, backend_->AllocateTensor(shape, precision_));
      outputs_.push_back(std::move(out));
      d_outputs_.push_back(std::move(dout));
      // Producers read by more than one input slot get a buffer for the
      // partial gradients of all but the first consumer.
      if (info.consumers.size() > 1) {
        PSTRAIN_ASSIGN_OR_RETURN(Tensor partial, backend_->AllocateTensor(shape, precision_));
        scratch_.push_back(std::move(partial));
      } else {
        scratch_.emplace_back();
      }
    }
    const int64_t image = graph_.input_shape.num_elements();
    if (reduced() || InputTransposed()) {
      PSTRAIN_ASSIGN_OR_RETURN(input_cast_,
                               backend_->AllocateTensor(Shape{batch, image}, precision_));
    }
    if (reduced() && InputTransposed()) {
      PSTRAIN_ASSIGN_OR_RETURN(input_nchw_,
                               backend_->AllocateTensor(Shape{batch, image}, precision_));
    }
    if (reduced()) {
      PSTRAIN_ASSIGN_OR_RETURN(logits_f32_,
                               backend_->AllocateTensor(Shape{batch, graph_.num_classes}));
    }
    batch_ = batch;
  }
  if (batch != prepared_batch_) {
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (InBlock(static_cast<int>(l))) continue;  // The block's plan does their work.
      PSTRAIN_RETURN_IF_ERROR(layers_[l]->Prepare(backend_, batch));
    }
    prepared_batch_ = batch;
  }
  return absl::OkStatus();
}

absl::Status Model::Forward(const float* images, const int32_t* labels, int batch, bool training,
                            uint64_t seed) {
  if (images == nullptr || labels == nullptr) {
    return absl::InvalidArgumentError("Model::Forward: null images or labels");
  }
  PSTRAIN_RETURN_IF_ERROR(PrepareBatch(batch));
  input_ = images;
  labels_ = labels;
  last_forward_training_ = training;
  // The images in precision_ and, channels last, as [H*W, C] per image.
  const Shape& in = graph_.input_shape;
  const void* images_nchw = images;
  if (reduced()) {
    void* cast = InputTransposed() ? input_nchw_.raw() : input_cast_.raw();
    PSTRAIN_RETURN_IF_ERROR(backend_->Convert(DataType::kF32, images, precision_, cast,
                                              int64_t{batch} * in.num_elements(), 1.f, nullptr));
    images_nchw = cast;
    input_ = input_cast_.raw();
  }
  if (InputTransposed()) {
    PSTRAIN_RETURN_IF_ERROR(backend_->Transpose(precision_, images_nchw, input_cast_.raw(), batch,
                                                in[0], in[1] * in[2]));
    input_ = input_cast_.raw();
  }
  if (reduced()) {
    // The parameters as they are now (an updater may have just replaced
    // them), in precision_.
    for (int p = 0; p < num_params(); ++p) {
      if (compute_params_[p].empty()) continue;
      PSTRAIN_RETURN_IF_ERROR(backend_->Convert(DataType::kF32, params_[p].raw(), precision_,
                                                compute_params_[p].raw(), params_[p].num_elements(),
                                                1.f, nullptr));
    }
  }
  for (int l = 0; l < static_cast<int>(layers_.size()); ++l) {
    const LayerInfo& info = graph_.layers[l];
    if (InBlock(l)) {
      const ConvBlock& block = blocks_[block_of_[l]];
      if (l != block.pool) continue;  // The block runs at its pool.
      const LayerInfo& conv = graph_.layers[block.conv];
      absl::Status status = block.plan->Forward(
          static_cast<const float*>(InputOf(block.conv, 0)), params_[conv.params[0]].data(),
          conv.params.size() > 1 ? params_[conv.params[1]].data() : nullptr, outputs_[l].data(),
          training);
      if (!status.ok()) {
        return absl::Status(status.code(), absl::StrCat("forward of layers '", conv.name, "' to '",
                                                        info.name, "': ", status.message()));
      }
      continue;
    }
    const bool fused = fused_with_[l] >= 0;
    if (fused && info.type == LayerType::kRelu) continue;  // Runs inside its pool.
    ForwardArgs args;
    args.batch = batch;
    for (size_t slot = 0; slot < info.inputs.size(); ++slot) {
      args.inputs.push_back(InputOf(l, static_cast<int>(slot)));
    }
    args.output = l == graph_.loss_layer ? loss_.raw() : outputs_[l].raw();
    for (int p : info.params) args.params.push_back(ComputeParam(p));
    args.training = training;
    args.seed = MixBits(seed, l);
    args.labels = labels;
    args.loss_scale = training ? loss_scale_ : 1.f;
    absl::Status status = fused ? FusedForward(l, args) : layers_[l]->Forward(backend_, args);
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("forward of layer '", info.name, "': ", status.message()));
    }
  }
  if (reduced() && graph_.logits_layer >= 0) {
    PSTRAIN_RETURN_IF_ERROR(backend_->Convert(precision_, outputs_[graph_.logits_layer].raw(),
                                              DataType::kF32, logits_f32_.raw(),
                                              int64_t{batch} * graph_.num_classes, 1.f, nullptr));
  }
  return absl::OkStatus();
}

absl::Status Model::Backward() {
  if (!last_forward_training_ || input_ == nullptr) {
    return absl::FailedPreconditionError("Model::Backward needs a preceding training Forward");
  }
  const int batch = prepared_batch_;
  // written[p]: d_outputs_[p] already holds a (partial) gradient this pass.
  std::vector<bool> written(layers_.size(), false);
  // fp16: callbacks wait for the overflow check at the end.
  std::vector<std::pair<int, std::vector<int>>> deferred;
  for (int l = static_cast<int>(layers_.size()) - 1; l >= 0; --l) {
    const LayerInfo& info = graph_.layers[l];
    const bool in_block = InBlock(l);
    if (in_block && l != blocks_[block_of_[l]].conv) continue;  // The block runs at its conv.
    const bool fused = !in_block && fused_with_[l] >= 0;
    if (fused && info.type == LayerType::kMaxPool) continue;  // Runs with its ReLU.
    BackwardArgs args;
    args.batch = batch;
    for (size_t slot = 0; slot < info.inputs.size(); ++slot) {
      args.inputs.push_back(InputOf(l, static_cast<int>(slot)));
    }
    args.output = l == graph_.loss_layer ? loss_.raw() : outputs_[l].raw();
    args.d_output = d_outputs_[l].raw();
    std::vector<int> accumulate;  // Input slots written to scratch, to add afterwards.
    for (size_t slot = 0; slot < info.inputs.size(); ++slot) {
      int in = info.inputs[slot];
      if (in < 0) {
        args.d_inputs.push_back(nullptr);  // Nobody needs d loss / d images.
      } else if (!written[in]) {
        args.d_inputs.push_back(d_outputs_[in].raw());
        written[in] = true;
      } else {
        args.d_inputs.push_back(scratch_[in].raw());
        accumulate.push_back(static_cast<int>(slot));
      }
    }
    if (accumulate.size() > 1) {  // BuildModelGraph rejects such graphs.
      return absl::InternalError(
          absl::StrCat("layer '", info.name, "' reads one producer more than twice"));
    }
    for (int p : info.params) {
      args.params.push_back(ComputeParam(p));
      args.d_params.push_back(graph_.params[p].trainable ? ComputeGrad(p) : nullptr);
    }
    absl::Status status;
    if (in_block) {  // fp32 only.
      const ConvBlock& block = blocks_[block_of_[l]];
      status = block.plan->Backward(
          static_cast<const float*>(args.inputs[0]), static_cast<const float*>(args.params[0]),
          d_outputs_[block.pool].data(), static_cast<float*>(args.d_inputs[0]),
          static_cast<float*>(args.d_params[0]),
          args.d_params.size() > 1 ? static_cast<float*>(args.d_params[1]) : nullptr);
    } else if (fused) {
      status = FusedBackward(l, args.d_inputs[0]);
    } else {
      status = layers_[l]->Backward(backend_, args);
    }
    if (!status.ok()) {
      return absl::Status(status.code(),
                          absl::StrCat("backward of layer '", info.name, "': ", status.message()));
    }
    for (int slot : accumulate) {
      int in = info.inputs[slot];
      PSTRAIN_RETURN_IF_ERROR(
          backend_->Axpy(precision_, 1.f, scratch_[in].raw(), d_outputs_[in].raw(),
                         batch * graph_.layers[in].output_shape.num_elements()));
    }
    if (reduced()) PSTRAIN_RETURN_IF_ERROR(FinishGradients(l));
    std::vector<int> trainable;
    for (int p : info.params) {
      if (graph_.params[p].trainable) trainable.push_back(p);
    }
    if (gradient_ready_ && !trainable.empty()) {
      if (dynamic_loss_scaling()) {
        deferred.emplace_back(l, std::move(trainable));
      } else {
        gradient_ready_(l, trainable);
      }
    }
  }
  if (dynamic_loss_scaling()) {
    PSTRAIN_RETURN_IF_ERROR(CheckOverflow());
    for (const auto& [layer, params] : deferred) gradient_ready_(layer, params);
  }
  return absl::OkStatus();
}

absl::Status Model::FinishGradients(int l) {
  int32_t* flag = dynamic_loss_scaling() ? static_cast<int32_t*>(overflow_flag_.data()) : nullptr;
  const float unscale = 1.f / loss_scale_;
  for (int p : graph_.layers[l].params) {
    if (!graph_.params[p].trainable) continue;
    const int64_t count = grads_[p].num_elements();
    if (!compute_grads_[p].empty()) {
      PSTRAIN_RETURN_IF_ERROR(backend_->Convert(precision_, compute_grads_[p].raw(), DataType::kF32,
                                                grads_[p].raw(), count, unscale, flag));
    } else if (flag != nullptr) {
      // fp32 gradients (batch norm) of a scaled loss: unscale in place.
      PSTRAIN_RETURN_IF_ERROR(backend_->Convert(DataType::kF32, grads_[p].raw(), DataType::kF32,
                                                grads_[p].raw(), count, unscale, flag));
    }
  }
  return absl::OkStatus();
}

absl::Status Model::CheckOverflow() {
  PSTRAIN_RETURN_IF_ERROR(
      backend_->CopyDeviceToHost(overflow_host_.data(), overflow_flag_.data(), sizeof(int32_t)));
  PSTRAIN_RETURN_IF_ERROR(backend_->Synchronize());
  int32_t overflowed = 0;
  std::memcpy(&overflowed, overflow_host_.data(), sizeof(int32_t));
  last_overflowed_ = overflowed != 0;
  if (!last_overflowed_) {
    if (++steps_since_overflow_ >= kLossScaleGrowthInterval) {
      loss_scale_ = std::min(loss_scale_ * 2.f, std::max(kMaxLossScale, loss_scale_));
      steps_since_overflow_ = 0;
    }
    return absl::OkStatus();
  }
  ++overflowed_steps_;
  steps_since_overflow_ = 0;
  loss_scale_ = std::max(loss_scale_ * 0.5f, 1.f);
  static const int32_t kZeroFlag = 0;
  PSTRAIN_RETURN_IF_ERROR(
      backend_->CopyHostToDevice(overflow_flag_.data(), &kZeroFlag, sizeof(int32_t)));
  for (int p = 0; p < num_params(); ++p) {
    if (!graph_.params[p].trainable) continue;
    PSTRAIN_RETURN_IF_ERROR(backend_->Fill(grads_[p].data(), 0.f, grads_[p].num_elements()));
  }
  return absl::OkStatus();
}

const void* Model::InputOf(int l, int slot) const {
  const int in = graph_.layers[l].inputs[slot];
  return in < 0 ? input_ : outputs_[in].raw();
}

// pool(relu(x)) computed as relu(pool(x)): max-pooling commutes with any
// non-decreasing function, and the ReLU then touches a quarter of the
// elements (for 2x2 windows) and needs no buffer of its own.
absl::Status Model::FusedForward(int pool, const ForwardArgs& pool_args) {
  const int relu = fused_with_[pool];
  ForwardArgs args = pool_args;
  args.inputs = {InputOf(relu, 0)};
  PSTRAIN_RETURN_IF_ERROR(layers_[pool]->Forward(backend_, args));
  const int64_t count = args.batch * graph_.layers[pool].output_shape.num_elements();
  return backend_->ActivationForward(precision_, Activation::kRelu, 0.f, args.output, args.output,
                                     count);
}

// The gradient w.r.t. the fused ReLU's input: the pooled output y (already
// ReLU-ed) masks dy in place (y > 0 exactly where the unfused ReLU passes
// the gradient of the window's winner), then the pool routes the masked dy
// to each window's winner in x, which for y > 0 is the element equal to y.
absl::Status Model::FusedBackward(int relu, void* d_relu_input) {
  if (d_relu_input == nullptr) return absl::OkStatus();
  const int pool = fused_with_[relu];
  const void* y = outputs_[pool].raw();
  void* dy = d_outputs_[pool].raw();
  const int64_t count = prepared_batch_ * graph_.layers[pool].output_shape.num_elements();
  PSTRAIN_RETURN_IF_ERROR(
      backend_->ActivationBackward(precision_, Activation::kRelu, 0.f, y, y, dy, dy, count));
  BackwardArgs args;
  args.batch = prepared_batch_;
  args.inputs = {InputOf(relu, 0)};
  args.output = y;
  args.d_output = dy;
  args.d_inputs = {d_relu_input};
  return layers_[pool]->Backward(backend_, args);
}

const float* Model::logits() const {
  if (graph_.logits_layer < 0 || outputs_.empty()) return nullptr;
  return reduced() ? logits_f32_.data() : outputs_[graph_.logits_layer].data();
}

int Model::FindParam(const std::string& name) const {
  for (int i = 0; i < num_params(); ++i) {
    if (graph_.params[i].name == name) return i;
  }
  return -1;
}

absl::Status Model::ExportParameters(std::vector<v1::TensorProto>* out) {
  out->clear();
  std::vector<std::vector<float>> host(num_params());
  for (int i = 0; i < num_params(); ++i) {
    host[i].resize(params_[i].num_elements());
    PSTRAIN_RETURN_IF_ERROR(
        backend_->CopyDeviceToHost(host[i].data(), params_[i].data(), params_[i].bytes()));
  }
  PSTRAIN_RETURN_IF_ERROR(backend_->Synchronize());
  for (int i = 0; i < num_params(); ++i) {
    out->push_back(MakeTensorProto(graph_.params[i].name, graph_.params[i].shape.dims(),
                                   host[i].data()));
  }
  return absl::OkStatus();
}

absl::Status Model::ImportParameters(const std::vector<v1::TensorProto>& tensors) {
  std::map<std::string, const v1::TensorProto*> by_name;
  for (const v1::TensorProto& t : tensors) {
    if (!by_name.emplace(t.name(), &t).second) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate tensor '", t.name(), "'"));
    }
  }
  std::vector<std::vector<float>> host(num_params());
  for (int i = 0; i < num_params(); ++i) {
    const ParamInfo& p = graph_.params[i];
    auto it = by_name.find(p.name);
    if (it == by_name.end()) {
      return absl::InvalidArgumentError(absl::StrCat("missing parameter '", p.name, "'"));
    }
    const v1::TensorProto& t = *it->second;
    if (std::vector<int64_t>(t.shape().begin(), t.shape().end()) != p.shape.dims()) {
      Shape got(std::vector<int64_t>(t.shape().begin(), t.shape().end()));
      return absl::InvalidArgumentError(absl::StrCat("parameter '", p.name, "' has shape ",
                                                     got.ToString(), ", the model expects ",
                                                     p.shape.ToString()));
    }
    PSTRAIN_ASSIGN_OR_RETURN(host[i], TensorProtoToFloats(t));
    by_name.erase(it);
  }
  if (!by_name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", by_name.begin()->first, "' is not a parameter of this model"));
  }
  for (int i = 0; i < num_params(); ++i) {
    PSTRAIN_RETURN_IF_ERROR(
        backend_->CopyHostToDevice(params_[i].data(), host[i].data(), params_[i].bytes()));
  }
  return backend_->Synchronize();
}

}  // namespace pstrain
