#include "worker/layers.h"

#include <functional>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

// Keeps one plan per batch size (training batches plus the last, smaller,
// evaluation batch), so nothing is re-planned in the steady state.
template <typename Plan>
class PlanCache {
 public:
  using Factory = std::function<absl::StatusOr<std::unique_ptr<Plan>>(int batch)>;
  absl::StatusOr<Plan*> Get(int batch, const Factory& make) {
    auto it = plans_.find(batch);
    if (it != plans_.end()) return it->second.get();
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Plan> plan, make(batch));
    Plan* raw = plan.get();
    plans_[batch] = std::move(plan);
    return raw;
  }

 private:
  std::map<int, std::unique_ptr<Plan>> plans_;
};

}  // namespace

Conv2dConfig Conv2dConfigFor(const LayerInfo& info, int batch, DataType dtype) {
  const v1::Conv2dLayer& c = info.spec.conv2d();
  const Shape& in = info.input_shapes[0];
  Conv2dConfig config;
  config.n = batch;
  config.c = static_cast<int>(in[0]);
  config.h = static_cast<int>(in[1]);
  config.w = static_cast<int>(in[2]);
  config.filters = c.filters();
  config.kernel_h = c.kernel_h() > 0 ? c.kernel_h() : c.kernel_size();
  config.kernel_w = c.kernel_w() > 0 ? c.kernel_w() : c.kernel_size();
  config.stride_h = config.stride_w = c.stride() == 0 ? 1 : c.stride();
  config.pad_h = config.pad_w = c.padding();
  config.dtype = dtype;
  return config;
}

bool ConvHasBias(const LayerInfo& info) { return !info.spec.conv2d().no_bias(); }

Pool2dConfig Pool2dConfigFor(const LayerInfo& info, int batch, DataType dtype) {
  const bool max = info.type == LayerType::kMaxPool;
  const v1::Pool2dLayer& p = max ? info.spec.max_pool() : info.spec.avg_pool();
  const Shape& in = info.input_shapes[0];
  Pool2dConfig config;
  config.mode = max ? PoolMode::kMax : PoolMode::kAverage;
  config.n = batch;
  config.c = static_cast<int>(in[0]);
  config.h = static_cast<int>(in[1]);
  config.w = static_cast<int>(in[2]);
  config.window = p.pool_size();
  config.stride = p.stride() == 0 ? p.pool_size() : p.stride();
  config.pad = p.padding();
  config.dtype = dtype;
  return config;
}

namespace {

class Conv2dLayer final : public Layer {
 public:
  explicit Conv2dLayer(const LayerInfo& info)
      : Layer(info), config_(Conv2dConfigFor(info, 0)), has_bias_(ConvHasBias(info)) {}

  absl::Status Prepare(Backend* backend, int batch) override {
    PSTRAIN_ASSIGN_OR_RETURN(plan_, plans_.Get(batch, [&](int n) {
      Conv2dConfig config = config_;
      config.n = n;
      config.dtype = dtype();
      config.layout = input_layout();
      return backend->CreateConv2d(config);
    }));
    return absl::OkStatus();
  }

  absl::Status Forward(Backend*, const ForwardArgs& a) override {
    return plan_->Forward(a.inputs[0], a.params[0], has_bias_ ? a.params[1] : nullptr, a.output);
  }

  absl::Status Backward(Backend*, const BackwardArgs& a) override {
    return plan_->Backward(a.inputs[0], a.d_output, a.params[0], a.d_inputs[0], a.d_params[0],
                           has_bias_ ? a.d_params[1] : nullptr);
  }

 private:
  const Conv2dConfig config_;
  const bool has_bias_;
  PlanCache<Conv2dPlan> plans_;
  Conv2dPlan* plan_ = nullptr;
};

class Pool2dLayer final : public Layer {
 public:
  explicit Pool2dLayer(const LayerInfo& info) : Layer(info), config_(Pool2dConfigFor(info, 0)) {}

  absl::Status Prepare(Backend* backend, int batch) override {
    PSTRAIN_ASSIGN_OR_RETURN(plan_, plans_.Get(batch, [&](int n) {
      Pool2dConfig config = config_;
      config.n = n;
      config.dtype = dtype();
      config.layout = input_layout();
      return backend->CreatePool2d(config);
    }));
    return absl::OkStatus();
  }

  absl::Status Forward(Backend*, const ForwardArgs& a) override {
    return plan_->Forward(a.inputs[0], a.output, a.training);
  }

  absl::Status Backward(Backend*, const BackwardArgs& a) override {
    if (a.d_inputs[0] == nullptr) return absl::OkStatus();
    return plan_->Backward(a.inputs[0], a.output, a.d_output, a.d_inputs[0]);
  }

 private:
  const Pool2dConfig config_;
  PlanCache<Pool2dPlan> plans_;
  Pool2dPlan* plan_ = nullptr;
};

// y[N, units] = x[N, in] * W^T + b, W stored [units, in]. A channels-last
// [C, H, W] input is first put in [C, H, W] order (x_), and its gradient
// back (dx_), so that W means the same as on an NCHW backend.
class DenseLayer final : public Layer {
 public:
  explicit DenseLayer(const LayerInfo& info)
      : Layer(info), units_(info.spec.dense().units()), has_bias_(!info.spec.dense().no_bias()) {}

  absl::Status Prepare(Backend* backend, int batch) override {
    if (input_transposed() && x_.num_elements() != batch * in_per_sample()) {
      PSTRAIN_ASSIGN_OR_RETURN(x_, backend->AllocateTensor(Shape{batch, in_per_sample()}, dtype()));
      PSTRAIN_ASSIGN_OR_RETURN(dx_,
                               backend->AllocateTensor(Shape{batch, in_per_sample()}, dtype()));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    const int64_t in = in_per_sample();
    const void* x = a.inputs[0];
    if (input_transposed()) {
      const Shape& s = info().input_shapes[0];
      PSTRAIN_RETURN_IF_ERROR(backend->Transpose(dtype(), x, x_.raw(), a.batch, s[1] * s[2], s[0]));
      x = x_.raw();
    }
    PSTRAIN_RETURN_IF_ERROR(backend->Gemm(dtype(), false, true, a.batch, units_, in, 1.f, x,
                                          a.params[0], 0.f, a.output));
    if (has_bias_) {
      PSTRAIN_RETURN_IF_ERROR(backend->AddBias(dtype(), a.output, a.params[1], a.batch, units_, 1));
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    const int64_t in = in_per_sample();
    // x_ still holds the reordered input of the preceding Forward.
    const void* x = input_transposed() ? x_.raw() : a.inputs[0];
    // dW[units, in] = dY^T[units, N] * X[N, in].
    PSTRAIN_RETURN_IF_ERROR(backend->Gemm(dtype(), true, false, units_, in, a.batch, 1.f,
                                          a.d_output, x, 0.f, a.d_params[0]));
    if (has_bias_) {
      PSTRAIN_RETURN_IF_ERROR(
          backend->BiasGrad(dtype(), a.d_output, a.d_params[1], a.batch, units_, 1));
    }
    if (a.d_inputs[0] != nullptr) {
      // dX[N, in] = dY[N, units] * W[units, in].
      void* dx = input_transposed() ? dx_.raw() : a.d_inputs[0];
      PSTRAIN_RETURN_IF_ERROR(backend->Gemm(dtype(), false, false, a.batch, in, units_, 1.f,
                                            a.d_output, a.params[0], 0.f, dx));
      if (input_transposed()) {
        const Shape& s = info().input_shapes[0];
        PSTRAIN_RETURN_IF_ERROR(
            backend->Transpose(dtype(), dx, a.d_inputs[0], a.batch, s[0], s[1] * s[2]));
      }
    }
    return absl::OkStatus();
  }

 private:
  const int64_t units_;
  const bool has_bias_;
  Tensor x_, dx_;  // Channels-last [C, H, W] input only.
};

class ActivationLayer final : public Layer {
 public:
  ActivationLayer(const LayerInfo& info, Activation kind, float alpha)
      : Layer(info), kind_(kind), alpha_(alpha) {}

  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    return backend->ActivationForward(dtype(), kind_, alpha_, a.inputs[0], a.output,
                                      a.batch * out_per_sample());
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    if (a.d_inputs[0] == nullptr) return absl::OkStatus();
    return backend->ActivationBackward(dtype(), kind_, alpha_, a.inputs[0], a.output, a.d_output,
                                       a.d_inputs[0], a.batch * out_per_sample());
  }

 private:
  const Activation kind_;
  const float alpha_;
};

class DropoutLayer final : public Layer {
 public:
  explicit DropoutLayer(const LayerInfo& info) : Layer(info), rate_(info.spec.dropout().rate()) {}

  absl::Status Prepare(Backend* backend, int batch) override {
    if (mask_.num_elements() != batch * out_per_sample()) {
      PSTRAIN_ASSIGN_OR_RETURN(mask_,
                               backend->AllocateTensor(Shape{batch, out_per_sample()}, dtype()));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    const int64_t count = a.batch * out_per_sample();
    last_training_ = a.training && rate_ > 0.f;
    if (!last_training_) {
      return backend->CopyDeviceToDevice(a.output, a.inputs[0], count * element_bytes());
    }
    return backend->DropoutForward(dtype(), a.inputs[0], a.output, mask_.raw(), count, rate_,
                                   a.seed);
  }

  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    if (a.d_inputs[0] == nullptr) return absl::OkStatus();
    const int64_t count = a.batch * out_per_sample();
    if (!last_training_) {
      return backend->CopyDeviceToDevice(a.d_inputs[0], a.d_output, count * element_bytes());
    }
    return backend->Multiply(dtype(), a.d_output, mask_.raw(), a.d_inputs[0], count);
  }

 private:
  const float rate_;
  Tensor mask_;
  bool last_training_ = false;
};

class BatchNormLayer final : public Layer {
 public:
  explicit BatchNormLayer(const LayerInfo& info) : Layer(info) {
    const Shape& in = info.input_shapes[0];
    config_.c = static_cast<int>(in[0]);
    config_.spatial = in.rank() == 3 ? static_cast<int>(in[1] * in[2]) : 1;
    const v1::BatchNormLayer& b = info.spec.batch_norm();
    config_.epsilon = b.epsilon() > 0 ? b.epsilon() : 1e-5f;
    config_.momentum = b.momentum() > 0 ? b.momentum() : 0.1f;
  }

  absl::Status Prepare(Backend* backend, int batch) override {
    if (save_mean_.empty()) {
      PSTRAIN_ASSIGN_OR_RETURN(save_mean_, backend->AllocateTensor(Shape{config_.c}));
      PSTRAIN_ASSIGN_OR_RETURN(save_inv_std_, backend->AllocateTensor(Shape{config_.c}));
    }
    PSTRAIN_ASSIGN_OR_RETURN(plan_, plans_.Get(batch, [&](int n) {
      BatchNormConfig config = config_;
      config.n = n;
      config.dtype = dtype();
      config.layout = input_layout();
      return backend->CreateBatchNorm(config);
    }));
    return absl::OkStatus();
  }

  // params (fp32 whatever the layer's dtype): gamma, beta, running_mean,
  // running_var.
  absl::Status Forward(Backend*, const ForwardArgs& a) override {
    const float* gamma = static_cast<const float*>(a.params[0]);
    const float* beta = static_cast<const float*>(a.params[1]);
    float* running_mean = static_cast<float*>(a.params[2]);
    float* running_var = static_cast<float*>(a.params[3]);
    if (a.training) {
      return plan_->ForwardTraining(a.inputs[0], gamma, beta, a.output, running_mean, running_var,
                                    save_mean_.data(), save_inv_std_.data());
    }
    return plan_->ForwardInference(a.inputs[0], gamma, beta, running_mean, running_var, a.output);
  }

  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    // Parameter gradients are needed even when the input needs none.
    void* dx = a.d_inputs[0];
    if (dx == nullptr) {
      if (scratch_.num_elements() != a.batch * out_per_sample()) {
        PSTRAIN_ASSIGN_OR_RETURN(
            scratch_, backend->AllocateTensor(Shape{a.batch, out_per_sample()}, dtype()));
      }
      dx = scratch_.raw();
    }
    return plan_->Backward(a.inputs[0], a.d_output, static_cast<const float*>(a.params[0]),
                           save_mean_.data(), save_inv_std_.data(), dx,
                           static_cast<float*>(a.d_params[0]), static_cast<float*>(a.d_params[1]));
  }

 private:
  BatchNormConfig config_;
  PlanCache<BatchNormPlan> plans_;
  BatchNormPlan* plan_ = nullptr;
  Tensor save_mean_, save_inv_std_, scratch_;
};

// Flatten is a reshape: the bytes are already in the right order, except
// from a channels-last [C, H, W], which is put in [C, H, W] order.
class FlattenLayer final : public Layer {
 public:
  explicit FlattenLayer(const LayerInfo& info) : Layer(info) {}
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    if (input_transposed()) {
      const Shape& s = info().input_shapes[0];
      return backend->Transpose(dtype(), a.inputs[0], a.output, a.batch, s[1] * s[2], s[0]);
    }
    return backend->CopyDeviceToDevice(a.output, a.inputs[0],
                                       a.batch * out_per_sample() * element_bytes());
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    if (a.d_inputs[0] == nullptr) return absl::OkStatus();
    if (input_transposed()) {
      const Shape& s = info().input_shapes[0];
      return backend->Transpose(dtype(), a.d_output, a.d_inputs[0], a.batch, s[0], s[1] * s[2]);
    }
    return backend->CopyDeviceToDevice(a.d_inputs[0], a.d_output,
                                       a.batch * out_per_sample() * element_bytes());
  }
};

class AddLayer final : public Layer {
 public:
  explicit AddLayer(const LayerInfo& info) : Layer(info) {}
  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    const int64_t count = a.batch * out_per_sample();
    PSTRAIN_RETURN_IF_ERROR(backend->Add(dtype(), a.inputs[0], a.inputs[1], a.output, count));
    for (size_t i = 2; i < a.inputs.size(); ++i) {
      PSTRAIN_RETURN_IF_ERROR(backend->Axpy(dtype(), 1.f, a.inputs[i], a.output, count));
    }
    return absl::OkStatus();
  }
  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    const size_t bytes = a.batch * out_per_sample() * element_bytes();
    for (void* dx : a.d_inputs) {
      if (dx != nullptr) PSTRAIN_RETURN_IF_ERROR(backend->CopyDeviceToDevice(dx, a.d_output, bytes));
    }
    return absl::OkStatus();
  }
};

// The output is the mean loss (a device scalar); the gradient w.r.t. the
// logits is computed in the same pass and handed out by Backward.
class SoftmaxCrossEntropyLayer final : public Layer {
 public:
  explicit SoftmaxCrossEntropyLayer(const LayerInfo& info)
      : Layer(info), classes_(info.input_shapes[0][0]) {}

  absl::Status Prepare(Backend* backend, int batch) override {
    if (dlogits_.num_elements() != batch * classes_) {
      PSTRAIN_ASSIGN_OR_RETURN(dlogits_, backend->AllocateTensor(Shape{batch, classes_}, dtype()));
    }
    return absl::OkStatus();
  }

  absl::Status Forward(Backend* backend, const ForwardArgs& a) override {
    if (a.labels == nullptr) return absl::InvalidArgumentError("softmax_cross_entropy: no labels");
    return backend->SoftmaxCrossEntropy(dtype(), a.inputs[0], a.labels, a.batch, classes_,
                                        static_cast<float*>(a.output),
                                        a.training ? dlogits_.raw() : nullptr, a.loss_scale);
  }

  absl::Status Backward(Backend* backend, const BackwardArgs& a) override {
    if (a.d_inputs[0] == nullptr) return absl::OkStatus();
    return backend->CopyDeviceToDevice(a.d_inputs[0], dlogits_.raw(),
                                       a.batch * classes_ * element_bytes());
  }

 private:
  const int64_t classes_;
  Tensor dlogits_;
};

using LayerFactory = std::function<std::unique_ptr<Layer>(const LayerInfo&)>;

const std::map<LayerType, LayerFactory>& LayerFactories() {
  static const auto* factories = new std::map<LayerType, LayerFactory>{
      {LayerType::kConv2d, [](const LayerInfo& i) { return std::make_unique<Conv2dLayer>(i); }},
      {LayerType::kMaxPool, [](const LayerInfo& i) { return std::make_unique<Pool2dLayer>(i); }},
      {LayerType::kAvgPool, [](const LayerInfo& i) { return std::make_unique<Pool2dLayer>(i); }},
      {LayerType::kDense, [](const LayerInfo& i) { return std::make_unique<DenseLayer>(i); }},
      {LayerType::kRelu,
       [](const LayerInfo& i) {
         return std::make_unique<ActivationLayer>(i, Activation::kRelu, 0.f);
       }},
      {LayerType::kLeakyRelu,
       [](const LayerInfo& i) {
         float alpha = i.spec.leaky_relu().alpha() > 0 ? i.spec.leaky_relu().alpha() : 0.01f;
         return std::make_unique<ActivationLayer>(i, Activation::kLeakyRelu, alpha);
       }},
      {LayerType::kTanh,
       [](const LayerInfo& i) {
         return std::make_unique<ActivationLayer>(i, Activation::kTanh, 0.f);
       }},
      {LayerType::kSigmoid,
       [](const LayerInfo& i) {
         return std::make_unique<ActivationLayer>(i, Activation::kSigmoid, 0.f);
       }},
      {LayerType::kDropout, [](const LayerInfo& i) { return std::make_unique<DropoutLayer>(i); }},
      {LayerType::kBatchNorm,
       [](const LayerInfo& i) { return std::make_unique<BatchNormLayer>(i); }},
      {LayerType::kFlatten, [](const LayerInfo& i) { return std::make_unique<FlattenLayer>(i); }},
      {LayerType::kAdd, [](const LayerInfo& i) { return std::make_unique<AddLayer>(i); }},
      {LayerType::kSoftmaxCrossEntropy,
       [](const LayerInfo& i) { return std::make_unique<SoftmaxCrossEntropyLayer>(i); }},
  };
  return *factories;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> Layer::Create(const LayerInfo& info, DataType dtype,
                                                     bool channels_last) {
  auto it = LayerFactories().find(info.type);
  if (it == LayerFactories().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer '", info.name, "': no runtime for type ", LayerTypeName(info.type)));
  }
  std::unique_ptr<Layer> layer = it->second(info);
  layer->dtype_ = dtype;
  layer->channels_last_ = channels_last;
  return layer;
}

}  // namespace pstrain
