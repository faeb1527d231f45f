// gpu_layers_bench: where a training step's GPU time goes, layer by layer, in
// fp32, bf16 and fp16 (mixed precision) in the same process.
//
// Each layer of the model runs alone, with its real input (the whole network
// runs forward once first), timed over --reps back-to-back calls between two
// device synchronisations: forward (training mode) and backward, in ms per
// call. Beside each layer, the reference measured in the same run: a
// device-to-device copy of its output (what moving those bytes once costs;
// element-wise layers cannot beat it). Then the mixed-precision overhead of a
// step: converting the convolution and dense weights to the reduced type, and
// their gradients back to fp32. The model runs here layer by layer: the
// ReLU -> max-pool fusion of worker/model.h is not applied.
//
//   gpu_layers_bench --model examples/models/resnet-small-64.json --batch 128
//                    [--reps 30] [--dtypes fp32,bf16,fp16] [--cudnn_log_routes]
//
// The CUDA backend's options are pstrain-worker's defaults with the
// documented PSTRAIN_CUDNN_* / PSTRAIN_CUDA_OWN_CONV fallbacks applied (read
// here in main, kernels/cuda_backend_options.h), and --cudnn_log_routes.
//
// Needs a CUDA device (exits 2 without one).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "common/model_graph.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/backend.h"
#include "kernels/cuda_backend_options.h"
#include "worker/layers.h"

ABSL_FLAG(std::string, model, "examples/models/resnet-small-64.json", "ModelSpec JSON file");
ABSL_FLAG(int, batch, 128, "Batch size");
ABSL_FLAG(int, reps, 30, "Timed calls per layer and pass");
ABSL_FLAG(std::string, dtypes, "fp32,bf16,fp16", "Activation types to time, in order");
ABSL_FLAG(bool, cudnn_log_routes, false,
          "Print each bf16/fp16 convolution plan's per-pass times and chosen route to stderr "
          "(also on with PSTRAIN_CUDNN_LOG_ROUTES=1)");

namespace pstrain {
namespace {

using Clock = std::chrono::steady_clock;

struct LayerTimes {
  double forward_ms = 0, backward_ms = 0, copy_ms = 0;
};

struct DtypeResult {
  std::vector<LayerTimes> layers;
  double weights_to_dtype_ms = 0, grads_to_fp32_ms = 0;
};

// Mean ms per call of `fn` over `reps` calls between synchronisations.
absl::StatusOr<double> Time(Backend& backend, int reps, const std::function<absl::Status()>& fn) {
  PSTRAIN_RETURN_IF_ERROR(fn());  // Warm-up (first-call plans, algorithm search).
  PSTRAIN_RETURN_IF_ERROR(backend.Synchronize());
  const Clock::time_point start = Clock::now();
  for (int i = 0; i < reps; ++i) PSTRAIN_RETURN_IF_ERROR(fn());
  PSTRAIN_RETURN_IF_ERROR(backend.Synchronize());
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count() / reps;
}

// A tensor of `count` random values in [-scale, scale] as `dtype`.
absl::StatusOr<Tensor> Random(Backend& backend, int64_t count, DataType dtype, float scale,
                              uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> host(std::max<int64_t>(count, 1));
  for (float& v : host) v = dist(gen);
  PSTRAIN_ASSIGN_OR_RETURN(Tensor f32, backend.AllocateTensor(Shape{count}));
  PSTRAIN_RETURN_IF_ERROR(backend.CopyHostToDevice(f32.raw(), host.data(), f32.bytes()));
  PSTRAIN_ASSIGN_OR_RETURN(Tensor out, backend.AllocateTensor(Shape{count}, dtype));
  PSTRAIN_RETURN_IF_ERROR(
      backend.Convert(DataType::kF32, f32.raw(), dtype, out.raw(), count, 1.f, nullptr));
  PSTRAIN_RETURN_IF_ERROR(backend.Synchronize());
  return out;
}

absl::StatusOr<DtypeResult> RunDtype(Backend& backend, const ModelGraph& g, DataType dtype,
                                     int batch, int reps) {
  DtypeResult result;
  const int n_layers = static_cast<int>(g.layers.size());
  std::vector<std::unique_ptr<Layer>> layers;
  for (const LayerInfo& info : g.layers) {
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer,
                             Layer::Create(info, dtype, backend.ChannelsLast(dtype)));
    PSTRAIN_RETURN_IF_ERROR(layer->Prepare(&backend, batch));
    layers.push_back(std::move(layer));
  }
  // Parameters: reduced type for convolutions and dense layers (what the
  // model's copies hold), fp32 for batch norm; fp32 masters beside them for
  // the conversion figures.
  std::vector<Tensor> params, grads, masters, master_grads;
  uint32_t seed = 1;
  for (const ParamInfo& p : g.params) {
    const LayerType owner = g.layers[p.layer].type;
    const bool reduced = owner == LayerType::kConv2d || owner == LayerType::kDense;
    const DataType t = reduced ? dtype : DataType::kF32;
    const float scale = p.role == ParamRole::kWeight && p.fan_in > 0
                            ? 1.f / std::sqrt(static_cast<float>(p.fan_in))
                            : 0.1f;
    PSTRAIN_ASSIGN_OR_RETURN(Tensor value,
                             Random(backend, p.shape.num_elements(), t, scale, ++seed));
    // Batch norm's variances must be positive.
    if (!reduced) PSTRAIN_RETURN_IF_ERROR(backend.Fill(value.data(), 1.f, value.num_elements()));
    PSTRAIN_ASSIGN_OR_RETURN(Tensor grad, backend.AllocateTensor(p.shape, t));
    params.push_back(std::move(value));
    grads.push_back(std::move(grad));
    if (reduced && dtype != DataType::kF32) {
      PSTRAIN_ASSIGN_OR_RETURN(Tensor m, backend.AllocateTensor(p.shape));
      PSTRAIN_ASSIGN_OR_RETURN(Tensor mg, backend.AllocateTensor(p.shape));
      masters.push_back(std::move(m));
      master_grads.push_back(std::move(mg));
    } else {
      masters.emplace_back();
      master_grads.emplace_back();
    }
  }
  const int64_t in_count = batch * g.input_shape.num_elements();
  PSTRAIN_ASSIGN_OR_RETURN(Tensor input, Random(backend, in_count, dtype, 1.f, 99));
  std::vector<int32_t> host_labels(batch);
  for (int i = 0; i < batch; ++i) host_labels[i] = i % g.num_classes;
  PSTRAIN_ASSIGN_OR_RETURN(DeviceBuffer labels, backend.Allocate(batch * sizeof(int32_t)));
  PSTRAIN_RETURN_IF_ERROR(
      backend.CopyHostToDevice(labels.data(), host_labels.data(), batch * sizeof(int32_t)));
  std::vector<Tensor> outputs, d_outputs, d_scratch;
  for (int l = 0; l < n_layers; ++l) {
    const LayerInfo& info = g.layers[l];
    const bool loss = l == g.loss_layer;
    const int64_t count = loss ? 1 : batch * info.output_shape.num_elements();
    PSTRAIN_ASSIGN_OR_RETURN(Tensor out,
                             backend.AllocateTensor(Shape{count}, loss ? DataType::kF32 : dtype));
    PSTRAIN_ASSIGN_OR_RETURN(Tensor dout, Random(backend, count, dtype, 0.01f, 1000 + l));
    outputs.push_back(std::move(out));
    d_outputs.push_back(std::move(dout));
    // Where this layer's backward writes its input gradients (one buffer
    // per input; the values are not used).
    for (size_t i = 0; i < info.inputs.size(); ++i) {
      const int64_t in = batch * info.input_shapes[i].num_elements();
      PSTRAIN_ASSIGN_OR_RETURN(Tensor s, backend.AllocateTensor(Shape{in}, dtype));
      d_scratch.push_back(std::move(s));
    }
  }
  auto input_of = [&](int l, int slot) -> const void* {
    const int in = g.layers[l].inputs[slot];
    return in < 0 ? input.raw() : outputs[in].raw();
  };
  auto forward_args = [&](int l) {
    ForwardArgs a;
    a.batch = batch;
    for (size_t s = 0; s < g.layers[l].inputs.size(); ++s) a.inputs.push_back(input_of(l, s));
    a.output = outputs[l].raw();
    for (int p : g.layers[l].params) a.params.push_back(params[p].raw());
    a.training = true;
    a.seed = 7;
    a.labels = static_cast<const int32_t*>(labels.data());
    return a;
  };
  // The whole network once, so that every layer's input is what it would be.
  for (int l = 0; l < n_layers; ++l)
    PSTRAIN_RETURN_IF_ERROR(layers[l]->Forward(&backend, forward_args(l)));
  PSTRAIN_RETURN_IF_ERROR(backend.Synchronize());

  size_t scratch_index = 0;
  for (int l = 0; l < n_layers; ++l) {
    const LayerInfo& info = g.layers[l];
    LayerTimes t;
    const ForwardArgs fa = forward_args(l);
    PSTRAIN_ASSIGN_OR_RETURN(t.forward_ms,
                             Time(backend, reps, [&] { return layers[l]->Forward(&backend, fa); }));
    BackwardArgs ba;
    ba.batch = batch;
    ba.inputs = fa.inputs;
    ba.output = outputs[l].raw();
    ba.d_output = d_outputs[l].raw();
    for (size_t s = 0; s < info.inputs.size(); ++s) {
      ba.d_inputs.push_back(info.inputs[s] < 0 ? nullptr : d_scratch[scratch_index].raw());
      ++scratch_index;
    }
    for (int p : info.params) {
      ba.params.push_back(params[p].raw());
      ba.d_params.push_back(g.params[p].trainable ? grads[p].raw() : nullptr);
    }
    PSTRAIN_ASSIGN_OR_RETURN(
        t.backward_ms, Time(backend, reps, [&] { return layers[l]->Backward(&backend, ba); }));
    if (l != g.loss_layer) {
      PSTRAIN_ASSIGN_OR_RETURN(Tensor copy, backend.AllocateTensor(outputs[l].shape(), dtype));
      PSTRAIN_ASSIGN_OR_RETURN(t.copy_ms, Time(backend, reps, [&] {
                                 return backend.CopyDeviceToDevice(copy.raw(), outputs[l].raw(),
                                                                   outputs[l].bytes());
                               }));
    }
    result.layers.push_back(t);
  }
  if (dtype != DataType::kF32) {
    PSTRAIN_ASSIGN_OR_RETURN(result.weights_to_dtype_ms, Time(backend, reps, [&] {
                               for (size_t p = 0; p < masters.size(); ++p) {
                                 if (masters[p].empty()) continue;
                                 PSTRAIN_RETURN_IF_ERROR(backend.Convert(
                                     DataType::kF32, masters[p].raw(), dtype, params[p].raw(),
                                     masters[p].num_elements(), 1.f, nullptr));
                               }
                               return absl::OkStatus();
                             }));
    PSTRAIN_ASSIGN_OR_RETURN(result.grads_to_fp32_ms, Time(backend, reps, [&] {
                               for (size_t p = 0; p < masters.size(); ++p) {
                                 if (masters[p].empty()) continue;
                                 PSTRAIN_RETURN_IF_ERROR(backend.Convert(
                                     dtype, grads[p].raw(), DataType::kF32, master_grads[p].raw(),
                                     masters[p].num_elements(), 1.f, nullptr));
                               }
                               return absl::OkStatus();
                             }));
  }
  return result;
}

int Main() {
  std::ifstream file(absl::GetFlag(FLAGS_model));
  if (!file) {
    std::fprintf(stderr, "gpu_layers_bench: cannot read %s\n", absl::GetFlag(FLAGS_model).c_str());
    return 2;
  }
  std::stringstream text;
  text << file.rdbuf();
  v1::ModelSpec spec;
  if (!google::protobuf::util::JsonStringToMessage(text.str(), &spec).ok()) {
    std::fprintf(stderr, "gpu_layers_bench: %s is not a ModelSpec\n",
                 absl::GetFlag(FLAGS_model).c_str());
    return 2;
  }
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(spec);
  if (!graph.ok()) {
    std::fprintf(stderr, "gpu_layers_bench: %s\n", graph.status().ToString().c_str());
    return 2;
  }
  if (CudaDeviceCount() == 0) {
    std::fprintf(stderr, "gpu_layers_bench: no CUDA device\n");
    return 2;
  }
  DeviceSpec device;
  device.automatic = false;
  device.type = DeviceType::kCuda;
  CudaBackendOptions options = CudaBackendOptionsFromEnvironment(
      [](const char* name) -> const char* { return std::getenv(name); });
  if (absl::GetFlag(FLAGS_cudnn_log_routes)) options.log_conv_routes = true;
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(device, options);
  if (!backend.ok()) {
    std::fprintf(stderr, "gpu_layers_bench: %s\n", backend.status().ToString().c_str());
    return 2;
  }
  const std::map<std::string, DataType> kTypes = {
      {"fp32", DataType::kF32}, {"bf16", DataType::kBF16}, {"fp16", DataType::kF16}};
  std::vector<DataType> dtypes;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ',')) {
    auto it = kTypes.find(std::string(name));
    if (it == kTypes.end()) {
      std::fprintf(stderr, "gpu_layers_bench: unknown dtype '%s'\n", std::string(name).c_str());
      return 2;
    }
    dtypes.push_back(it->second);
  }
  const int batch = absl::GetFlag(FLAGS_batch), reps = absl::GetFlag(FLAGS_reps);
  std::printf("%s, model %s, batch %d, %d reps per figure (ms per call)\n",
              (*backend)->Describe().c_str(), spec.name().c_str(), batch, reps);
  std::vector<DtypeResult> results;
  for (DataType dtype : dtypes) {
    absl::StatusOr<DtypeResult> r = RunDtype(**backend, *graph, dtype, batch, reps);
    if (!r.ok()) {
      std::fprintf(stderr, "gpu_layers_bench: %s: %s\n", DataTypeName(dtype),
                   r.status().ToString().c_str());
      return 1;
    }
    results.push_back(*std::move(r));
  }
  std::printf("%-18s %-12s", "layer", "type");
  for (DataType d : dtypes) {
    std::printf(" | %s fwd  bwd  copy", DataTypeName(d));
  }
  std::printf("\n");
  std::vector<double> total(dtypes.size(), 0), copies(dtypes.size(), 0);
  for (size_t l = 0; l < graph->layers.size(); ++l) {
    std::printf("%-18s %-12s", graph->layers[l].name.c_str(), LayerTypeName(graph->layers[l].type));
    for (size_t d = 0; d < dtypes.size(); ++d) {
      const LayerTimes& t = results[d].layers[l];
      std::printf(" | %7.3f %7.3f %6.3f", t.forward_ms, t.backward_ms, t.copy_ms);
      total[d] += t.forward_ms + t.backward_ms;
      copies[d] += t.copy_ms;
    }
    std::printf("\n");
  }
  for (size_t d = 0; d < dtypes.size(); ++d) {
    const double step = total[d] + results[d].weights_to_dtype_ms + results[d].grads_to_fp32_ms;
    std::printf(
        "%s: layers %.3f ms (forward + backward), weights to %s %.3f ms, gradients to "
        "fp32 %.3f ms, step %.3f ms = %.0f samples/s; output copies %.3f ms",
        DataTypeName(dtypes[d]), total[d], DataTypeName(dtypes[d]), results[d].weights_to_dtype_ms,
        results[d].grads_to_fp32_ms, step, 1000.0 * batch / step, copies[d]);
    if (d > 0) std::printf("; %.2fx the %s step", total[0] / step, DataTypeName(dtypes[0]));
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Main();
}
