// Finite-difference gradient checks for every layer type, on the CPU backend.
//
// Each case wraps the layer under test between layers with parameters
// (conv2d or dense before, dense after), so that both the layer's parameter
// gradients and its backward-data pass are exercised: a wrong d(input) shows
// up as a wrong gradient of the parameters upstream.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/rng.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/model.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

struct GradCase {
  std::string name;
  std::string model_json;
};

v1::ModelSpec ParseModel(const std::string& json) {
  v1::ModelSpec spec;
  auto status = google::protobuf::util::JsonStringToMessage(json, &spec);
  EXPECT_OK(status) << status.ToString() << "\n" << json;
  return spec;
}

// Image input [2, 6, 6]: conv (params) -> LAYER -> flatten -> dense -> loss.
std::string ImageModel(const std::string& layer_json) {
  return R"({"name":"g","input_shape":[2,6,6],"num_classes":3,"init_seed":3,"layers":[
    {"name":"conv","conv2d":{"filters":4,"kernel_size":3,"padding":1}},)" +
         layer_json + R"(,
    {"name":"flat","flatten":{}},
    {"name":"fc","dense":{"units":3}},
    {"name":"loss","softmax_cross_entropy":{}}]})";
}

// Vector input [5]: dense (params) -> LAYER -> dense -> loss.
std::string VectorModel(const std::string& layer_json) {
  return R"({"name":"g","input_shape":[5],"num_classes":3,"init_seed":5,"layers":[
    {"name":"fc0","dense":{"units":6}},)" +
         layer_json + R"(,
    {"name":"fc","dense":{"units":3}},
    {"name":"loss","softmax_cross_entropy":{}}]})";
}

std::vector<GradCase> Cases() {
  return {
      {"conv2d_stride2_pad1",
       ImageModel(R"({"name":"t","conv2d":{"filters":3,"kernel_size":3,"stride":2,"padding":1}})")},
      {"conv2d_nonsquare_nobias",
       ImageModel(
           R"({"name":"t","conv2d":{"filters":3,"kernel_h":3,"kernel_w":1,"no_bias":true}})")},
      {"max_pool", ImageModel(R"({"name":"t","max_pool":{"pool_size":2}})")},
      {"max_pool_overlap_pad",
       ImageModel(R"({"name":"t","max_pool":{"pool_size":3,"stride":2,"padding":1}})")},
      {"avg_pool", ImageModel(R"({"name":"t","avg_pool":{"pool_size":2}})")},
      {"avg_pool_pad",
       ImageModel(R"({"name":"t","avg_pool":{"pool_size":3,"stride":2,"padding":1}})")},
      {"relu", ImageModel(R"({"name":"t","relu":{}})")},
      {"leaky_relu", ImageModel(R"({"name":"t","leaky_relu":{"alpha":0.1}})")},
      {"tanh", ImageModel(R"({"name":"t","tanh":{}})")},
      {"sigmoid", ImageModel(R"({"name":"t","sigmoid":{}})")},
      {"dropout", ImageModel(R"({"name":"t","dropout":{"rate":0.3}})")},
      {"batch_norm_spatial", ImageModel(R"({"name":"t","batch_norm":{}})")},
      {"batch_norm_vector", VectorModel(R"({"name":"t","batch_norm":{}})")},
      {"dense", VectorModel(R"({"name":"t","dense":{"units":4}})")},
      {"dense_nobias_tanh",
       VectorModel(R"({"name":"t","dense":{"units":4,"no_bias":true}},{"name":"t2","tanh":{}})")},
      // ReLU then max-pool runs fused (worker/model.h).
      {"relu_then_max_pool",
       ImageModel(R"({"name":"t","relu":{}},{"name":"t2","max_pool":{"pool_size":2}})")},
      {"relu_then_max_pool_overlap_pad",
       ImageModel(
           R"({"name":"t","relu":{}},{"name":"t2","max_pool":{"pool_size":3,"stride":2,"padding":1}})")},
      {"flatten_then_dense",
       ImageModel(
           R"({"name":"t","relu":{}},{"name":"t2","flatten":{}},{"name":"t3","dense":{"units":5}})")},
      // Residual: conv -> (a: conv) + (skip: conv output) -> add; conv output
      // has two consumers, so gradient accumulation is exercised too.
      {"add_residual",
       ImageModel(R"({"name":"a","conv2d":{"filters":4,"kernel_size":3,"padding":1}},
                                      {"name":"t","add":{},"inputs":["a","conv"]})")},
      {"add_three_inputs", ImageModel(R"({"name":"a","relu":{},"inputs":["conv"]},
                                          {"name":"b","tanh":{},"inputs":["conv"]},
                                          {"name":"t","add":{},"inputs":["a","b","conv"]})")},
  };
}

class LayerGradientTest : public ::testing::TestWithParam<GradCase> {};

// Mean loss of one forward pass in training mode with a fixed dropout seed.
double Loss(Model& model, Backend& backend, const Tensor& x, const DeviceBuffer& labels, int batch) {
  absl::Status s = model.Forward(x.data(), static_cast<const int32_t*>(labels.data()), batch, true, 99);
  EXPECT_OK(s);
  float loss = 0;
  EXPECT_OK(backend.CopyDeviceToHost(&loss, model.loss(), sizeof(float)));
  EXPECT_OK(backend.Synchronize());
  return loss;
}

TEST_P(LayerGradientTest, MatchesFiniteDifferences) {
  const GradCase& c = GetParam();
  std::unique_ptr<Backend> backend = CreateCpuBackend();
  auto model_or = Model::Create(ParseModel(c.model_json), backend.get());
  ASSERT_OK(model_or);
  Model& model = **model_or;
  ASSERT_OK(model.InitializeParameters());

  const int batch = 4;
  const Shape& in = model.graph().input_shape;
  std::vector<float> host_x(batch * in.num_elements());
  for (size_t i = 0; i < host_x.size(); ++i) host_x[i] = 2.f * UniformFloat(11, i) - 1.f;
  std::vector<int32_t> host_labels = {0, 2, 1, 2};
  auto x = backend->AllocateTensor(Shape{batch, in.num_elements()});
  ASSERT_OK(x);
  auto labels = backend->Allocate(batch * sizeof(int32_t));
  ASSERT_OK(labels);
  ASSERT_OK(backend->CopyHostToDevice(x->data(), host_x.data(), x->bytes()));
  ASSERT_OK(backend->CopyHostToDevice(labels->data(), host_labels.data(), batch * 4));

  // Perturb parameters away from exact zeros (zero biases put ReLU kinks and
  // max-pool ties right where finite differences probe).
  for (int p = 0; p < model.num_params(); ++p) {
    if (!model.param_info(p).trainable) continue;
    Tensor& t = model.param(p);
    std::vector<float> v(t.num_elements());
    ASSERT_OK(backend->CopyDeviceToHost(v.data(), t.data(), t.bytes()));
    for (size_t i = 0; i < v.size(); ++i) v[i] += 0.2f * (UniformFloat(77 + p, i) - 0.5f);
    ASSERT_OK(backend->CopyHostToDevice(t.data(), v.data(), t.bytes()));
  }

  std::vector<int> ready_layers;
  model.SetGradientReadyCallback([&](int layer, absl::Span<const int>) { ready_layers.push_back(layer); });
  Loss(model, *backend, *x, *labels, batch);
  ASSERT_OK(model.Backward());
  // The callback fires in backward order, once per layer with parameters.
  for (size_t i = 1; i < ready_layers.size(); ++i) EXPECT_GT(ready_layers[i - 1], ready_layers[i]);

  const double eps = 2e-4;  // Small: a larger step crosses ReLU kinks and max-pool ties.
  int checked = 0;
  for (int p = 0; p < model.num_params(); ++p) {
    const ParamInfo& info = model.param_info(p);
    if (!info.trainable) continue;
    Tensor& t = model.param(p);
    std::vector<float> grad(t.num_elements()), value(t.num_elements());
    ASSERT_OK(backend->CopyDeviceToHost(grad.data(), model.grad(p).data(), t.bytes()));
    ASSERT_OK(backend->CopyDeviceToHost(value.data(), t.data(), t.bytes()));
    // Probe a spread of entries of every parameter tensor.
    const int64_t n = t.num_elements();
    const int64_t stride = std::max<int64_t>(1, n / 12);
    for (int64_t i = 0; i < n; i += stride) {
      const float original = value[i];
      auto loss_at = [&](float v) {
        float tmp = v;
        EXPECT_OK(backend->CopyHostToDevice(t.data() + i, &tmp, sizeof(float)));
        return Loss(model, *backend, *x, *labels, batch);
      };
      const double plus = loss_at(original + static_cast<float>(eps));
      const double minus = loss_at(original - static_cast<float>(eps));
      loss_at(original);
      const double numeric = (plus - minus) / (2 * eps);
      const double analytic = grad[i];
      const double tolerance = 3e-3 + 2e-2 * std::max(std::abs(numeric), std::abs(analytic));
      EXPECT_NEAR(analytic, numeric, tolerance)
          << c.name << ": " << info.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 10);
}

INSTANTIATE_TEST_SUITE_P(AllLayers, LayerGradientTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

// Loss, logits and every gradient of one training step, read back.
struct StepResult {
  float loss = 0;
  std::vector<float> logits;
  std::vector<std::vector<float>> grads;
};

StepResult RunStep(const std::string& json, bool fuse, const std::vector<float>& host_x,
                   const std::vector<int32_t>& host_labels) {
  StepResult result;
  std::unique_ptr<Backend> backend = CreateCpuBackend();
  ModelOptions options;
  options.fuse_relu_max_pool = fuse;
  auto model_or = Model::Create(ParseModel(json), backend.get(), options);
  EXPECT_OK(model_or);
  if (!model_or.ok()) return result;
  Model& model = **model_or;
  EXPECT_OK(model.InitializeParameters());
  const int batch = static_cast<int>(host_labels.size());
  auto x = backend->AllocateTensor(Shape{static_cast<int64_t>(host_x.size())});
  auto labels = backend->Allocate(host_labels.size() * sizeof(int32_t));
  EXPECT_OK(x);
  EXPECT_OK(labels);
  EXPECT_OK(backend->CopyHostToDevice(x->data(), host_x.data(), x->bytes()));
  EXPECT_OK(backend
                  ->CopyHostToDevice(labels->data(), host_labels.data(),
                                     host_labels.size() * sizeof(int32_t)));
  EXPECT_OK(model
                  .Forward(x->data(), static_cast<const int32_t*>(labels->data()), batch,
                           /*training=*/true, /*seed=*/7));
  EXPECT_OK(model.Backward());
  EXPECT_OK(backend->CopyDeviceToHost(&result.loss, model.loss(), sizeof(float)));
  result.logits.resize(batch * model.graph().num_classes);
  EXPECT_OK(backend
                  ->CopyDeviceToHost(result.logits.data(), model.logits(),
                                     result.logits.size() * sizeof(float)));
  for (int p = 0; p < model.num_params(); ++p) {
    if (!model.param_info(p).trainable) continue;
    std::vector<float> g(model.grad(p).num_elements());
    EXPECT_OK(backend->CopyDeviceToHost(g.data(), model.grad(p).data(), model.grad(p).bytes()));
    result.grads.push_back(std::move(g));
  }
  EXPECT_OK(backend->Synchronize());
  return result;
}

// The fused ReLU -> max-pool path, and the conv -> ReLU -> max-pool plan
// where the backend has one, must give what the layers give one by one,
// bit for bit, including windows whose maximum is negative or exactly zero
// and windows with ties (inputs on a coarse grid with many zeros).
TEST(ModelFusionTest, ReluMaxPoolFusedMatchesLayerByLayerBitForBit) {
  const std::vector<std::string> models = {
      // Two conv -> ReLU -> max-pool blocks (the CPU runs each as one plan),
      // the second without bias and reading the first's output.
      R"({"name":"g","input_shape":[2,8,8],"num_classes":3,"init_seed":3,"layers":[
        {"name":"c1","conv2d":{"filters":4,"kernel_size":3,"padding":1}}, {"name":"r1","relu":{}},
        {"name":"p1","max_pool":{"pool_size":2}},
        {"name":"c2","conv2d":{"filters":5,"kernel_size":3,"padding":1,"no_bias":true}},
        {"name":"r2","relu":{}}, {"name":"p2","max_pool":{"pool_size":2}},
        {"name":"flat","flatten":{}}, {"name":"fc","dense":{"units":3}},
        {"name":"loss","softmax_cross_entropy":{}}]})",
      ImageModel(R"({"name":"t","relu":{}},{"name":"t2","max_pool":{"pool_size":3}})"),
      ImageModel(R"({"name":"t","relu":{}},{"name":"t2","max_pool":{"pool_size":2}})"),
      ImageModel(
          R"({"name":"t","relu":{}},{"name":"t2","max_pool":{"pool_size":3,"stride":2,"padding":1}})"),
      // The ReLU reads the model input: nothing needs its input gradient.
      R"({"name":"g","input_shape":[2,6,6],"num_classes":3,"init_seed":3,"layers":[
        {"name":"r","relu":{}}, {"name":"p","max_pool":{"pool_size":2}},
        {"name":"conv","conv2d":{"filters":4,"kernel_size":3,"padding":1}},
        {"name":"flat","flatten":{}}, {"name":"fc","dense":{"units":3}},
        {"name":"loss","softmax_cross_entropy":{}}]})",
      // A ReLU read by a pool and by an add is not fused; the pool after the
      // add's ReLU is.
      R"({"name":"g","input_shape":[2,6,6],"num_classes":3,"init_seed":3,"layers":[
        {"name":"conv","conv2d":{"filters":4,"kernel_size":3,"padding":1}},
        {"name":"r","relu":{}}, {"name":"c2","conv2d":{"filters":4,"kernel_size":3,"padding":1}},
        {"name":"sum","add":{},"inputs":["c2","r"]}, {"name":"r2","relu":{}},
        {"name":"p","max_pool":{"pool_size":2}},
        {"name":"flat","flatten":{}}, {"name":"fc","dense":{"units":3}},
        {"name":"loss","softmax_cross_entropy":{}}]})",
  };
  const int batch = 4;
  std::vector<float> host_x(batch * 2 * 8 * 8);  // Models read [2, 6, 6] or [2, 8, 8].
  for (size_t i = 0; i < host_x.size(); ++i) {
    host_x[i] = std::round(4.f * UniformFloat(21, i) - 2.5f) / 2.f;  // -1.5 .. 1, many ties.
  }
  const std::vector<int32_t> labels = {0, 2, 1, 2};
  for (const std::string& json : models) {
    SCOPED_TRACE(json);
    const StepResult fused = RunStep(json, true, host_x, labels);
    const StepResult plain = RunStep(json, false, host_x, labels);
    EXPECT_EQ(std::memcmp(&fused.loss, &plain.loss, sizeof(float)), 0)
        << fused.loss << " vs " << plain.loss;
    EXPECT_EQ(fused.logits, plain.logits);
    ASSERT_EQ(fused.grads.size(), plain.grads.size());
    for (size_t p = 0; p < fused.grads.size(); ++p) {
      ASSERT_EQ(fused.grads[p].size(), plain.grads[p].size());
      EXPECT_EQ(std::memcmp(fused.grads[p].data(), plain.grads[p].data(),
                            fused.grads[p].size() * sizeof(float)),
                0)
          << "gradient " << p;
    }
  }
}

// Channels last (Backend::ChannelsLast): flatten and dense layers read a
// [C, H, W] input held as [H, W, C], put it in [C, H, W] order, and hand its
// gradient back in the held order, so that a model means the same either
// way. Checked on the CPU backend (its Transpose), against the same layers
// reading the [C, H, W] input directly.
std::vector<float> HwcOf(const std::vector<float>& chw, int batch, int c, int hw) {
  std::vector<float> out(chw.size());
  for (int b = 0; b < batch; ++b)
    for (int ch = 0; ch < c; ++ch)
      for (int i = 0; i < hw; ++i) out[(b * hw + i) * c + ch] = chw[(b * c + ch) * hw + i];
  return out;
}

TEST(ChannelsLastLayersTest, FlattenAndDenseReadChannelsLastInputsAsNchw) {
  std::unique_ptr<Backend> backend = CreateCpuBackend();
  const int batch = 2, c = 3, hw = 20, in = c * hw, units = 6;
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(ParseModel(
      R"({"name":"g","input_shape":[3,4,5],"num_classes":6,"layers":[
        {"name":"fc","dense":{"units":6}},
        {"name":"loss","softmax_cross_entropy":{}}]})"));
  ASSERT_OK(graph);
  absl::StatusOr<ModelGraph> flat_graph = BuildModelGraph(ParseModel(
      R"({"name":"g","input_shape":[3,4,5],"num_classes":60,"layers":[
        {"name":"flat","flatten":{}},
        {"name":"loss","softmax_cross_entropy":{}}]})"));
  ASSERT_OK(flat_graph);

  std::vector<float> x(batch * in), w(units * in), bias(units), dy(batch * units),
      dflat(batch * in);
  for (size_t i = 0; i < x.size(); ++i) x[i] = UniformFloat(1, i) - 0.5f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = UniformFloat(2, i) - 0.5f;
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = UniformFloat(3, i);
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = UniformFloat(4, i) - 0.5f;
  for (size_t i = 0; i < dflat.size(); ++i) dflat[i] = UniformFloat(5, i) - 0.5f;
  auto upload = [&](const std::vector<float>& v) {
    absl::StatusOr<Tensor> t = backend->AllocateTensor(Shape{static_cast<int64_t>(v.size())});
    EXPECT_OK(t);
    EXPECT_OK(backend->CopyHostToDevice(t->data(), v.data(), t->bytes()));
    return *std::move(t);
  };
  auto download = [&](const Tensor& t) {
    std::vector<float> v(t.num_elements());
    EXPECT_OK(backend->CopyDeviceToHost(v.data(), t.data(), t.bytes()));
    return v;
  };

  // Per layout: the dense layer's output, dW, dbias and d(input) (in the
  // held order), and the flatten layer's output and d(input).
  std::vector<float> results[2][5];
  for (bool channels_last : {false, true}) {
    const std::vector<float> held = channels_last ? HwcOf(x, batch, c, hw) : x;
    Tensor tx = upload(held), tw = upload(w), tb = upload(bias), tdy = upload(dy);
    Tensor ty = upload(std::vector<float>(batch * units)), tdw = upload(w), tdb = upload(bias);
    Tensor tdx = upload(std::vector<float>(batch * in));
    absl::StatusOr<std::unique_ptr<Layer>> dense =
        Layer::Create(graph->layers[0], DataType::kF32, channels_last);
    ASSERT_OK(dense);
    ASSERT_OK((*dense)->Prepare(backend.get(), batch));
    ForwardArgs f;
    f.batch = batch;
    f.inputs = {tx.data()};
    f.output = ty.data();
    f.params = {tw.data(), tb.data()};
    f.training = true;
    ASSERT_OK((*dense)->Forward(backend.get(), f));
    BackwardArgs b;
    b.batch = batch;
    b.inputs = {tx.data()};
    b.output = ty.data();
    b.d_output = tdy.data();
    b.d_inputs = {tdx.data()};
    b.params = {tw.data(), tb.data()};
    b.d_params = {tdw.data(), tdb.data()};
    ASSERT_OK((*dense)->Backward(backend.get(), b));
    const int k = channels_last ? 1 : 0;
    results[k][0] = download(ty);
    results[k][1] = download(tdw);
    results[k][2] = download(tdb);
    results[k][3] = download(tdx);

    absl::StatusOr<std::unique_ptr<Layer>> flatten =
        Layer::Create(flat_graph->layers[0], DataType::kF32, channels_last);
    ASSERT_OK(flatten);
    Tensor tflat = upload(std::vector<float>(batch * in)), tdflat = upload(dflat);
    Tensor tdflat_in = upload(std::vector<float>(batch * in));
    ForwardArgs ff;
    ff.batch = batch;
    ff.inputs = {tx.data()};
    ff.output = tflat.data();
    ASSERT_OK((*flatten)->Forward(backend.get(), ff));
    BackwardArgs fb;
    fb.batch = batch;
    fb.inputs = {tx.data()};
    fb.output = tflat.data();
    fb.d_output = tdflat.data();
    fb.d_inputs = {tdflat_in.data()};
    ASSERT_OK((*flatten)->Backward(backend.get(), fb));
    results[k][4] = download(tflat);
    // d(input) in the held order, compared in [C, H, W] order below.
    std::vector<float> dflat_in = download(tdflat_in);
    results[k][3].insert(results[k][3].end(), dflat_in.begin(), dflat_in.end());
  }
  EXPECT_EQ(results[1][0], results[0][0]) << "dense output";
  EXPECT_EQ(results[1][1], results[0][1]) << "dense weight gradient";
  EXPECT_EQ(results[1][2], results[0][2]) << "dense bias gradient";
  EXPECT_EQ(results[1][4], results[0][4]) << "flatten output";
  EXPECT_EQ(results[0][4], x) << "flatten output is the input in [C, H, W] order";
  // Gradients w.r.t. the input: the channels-last ones are the NCHW ones,
  // held as [H, W, C].
  const std::vector<float> nchw_dx(results[0][3].begin(), results[0][3].begin() + batch * in);
  const std::vector<float> nchw_dflat(results[0][3].begin() + batch * in, results[0][3].end());
  const std::vector<float> cl_dx(results[1][3].begin(), results[1][3].begin() + batch * in);
  const std::vector<float> cl_dflat(results[1][3].begin() + batch * in, results[1][3].end());
  EXPECT_EQ(cl_dx, HwcOf(nchw_dx, batch, c, hw)) << "dense input gradient";
  EXPECT_EQ(cl_dflat, HwcOf(nchw_dflat, batch, c, hw)) << "flatten input gradient";
  EXPECT_EQ(nchw_dflat, dflat);
}

}  // namespace
}  // namespace pstrain
