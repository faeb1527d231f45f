// cpu_ops_bench: times every op of one fmnist-cnn training step (batch 64,
// SGD with momentum) on the CPU backend and prints the median ms per op, the
// step time and the implied samples/s. The same step runs with the plain and
// the blocked convolution layouts in the same process, so the layouts are
// compared under the same machine load; the PyTorch 1.13 figure (845
// samples/s, 2 threads, same model) is quoted for the ratio, not measured.
// Each conv -> ReLU -> max-pool runs as the model runs it on the CPU, as one
// ConvReluPoolPlan; the last variant runs the blocked layout layer by layer
// with separate backward passes (the step before these fusions), so they are
// measured against it in the same run.
//
//   build-cpu/bin/cpu_ops_bench [--reps=N] [--threads=T]
//       [--layout=auto|plain|blocked|blocked-unfused|all]
//       [--gemm=measured|matmul|sgemm]   (CpuBackendOptions::gemm; default measured)
//       [--width=measured|256|512]       (CpuBackendOptions::vector_width; default measured)
//
// Medians are what the machine delivered; the min column is the op's cost
// when nothing competed for the cores. The OpenMP wait policy in effect is
// printed because it decides how the step behaves on a shared machine (see
// kernels/cpu/cpu_backend.h).
//
// The model: [64,1,28,28] -> conv5x5x32 p2 -> relu -> maxpool2 -> conv5x5x64 p2
// -> relu -> maxpool2 -> dense 3136x1024 -> relu -> dropout -> dense 1024x10
// -> softmax cross-entropy.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace pstrain {
namespace {

constexpr double kPytorchSamplesPerSec = 845.0;
constexpr int kBatch = 64;

struct Flags {
  int reps = 30;
  int threads = 0;
  std::string layout = "all";
  CpuGemmChoice gemm = CpuGemmChoice::kMeasured;
  std::string gemm_name = "measured";
  CpuConvAlgorithm conv = CpuConvAlgorithm::kAuto;
  std::string conv_name = "auto";
  CpuVectorWidth width = CpuVectorWidth::kMeasured;
  std::string width_name = "measured";
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--reps=", 0) == 0) {
      flags.reps = std::max(1, std::atoi(arg.c_str() + 7));
    } else if (arg.rfind("--threads=", 0) == 0) {
      flags.threads = std::atoi(arg.c_str() + 10);
    } else if (arg.rfind("--layout=", 0) == 0) {
      flags.layout = arg.substr(9);
    } else if (arg == "--gemm=measured" || arg == "--gemm=matmul" || arg == "--gemm=sgemm") {
      flags.gemm_name = arg.substr(7);
      flags.gemm = flags.gemm_name == "matmul"  ? CpuGemmChoice::kMatmul
                   : flags.gemm_name == "sgemm" ? CpuGemmChoice::kSgemm
                                                : CpuGemmChoice::kMeasured;
    } else if (arg == "--conv=auto" || arg == "--conv=direct") {
      flags.conv_name = arg.substr(7);
      flags.conv =
          flags.conv_name == "direct" ? CpuConvAlgorithm::kDirect : CpuConvAlgorithm::kAuto;
    } else if (arg == "--width=measured" || arg == "--width=256" || arg == "--width=512") {
      flags.width_name = arg.substr(8);
      flags.width = flags.width_name == "256"   ? CpuVectorWidth::k256
                    : flags.width_name == "512" ? CpuVectorWidth::k512
                                                : CpuVectorWidth::kMeasured;
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--reps=N] [--threads=T] "
          "[--layout=auto|plain|blocked|blocked-unfused|all] [--gemm=measured|matmul|sgemm] "
          "[--conv=auto|direct] [--width=measured|256|512]\n",
          argv[0]);
      std::exit(2);
    }
  }
  return flags;
}

// Aborts the benchmark (a tool, not a daemon) with the failing op's status.
void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) {
    std::fprintf(stderr, "%s failed: %s\n", what, status.ToString().c_str());
    std::exit(1);
  }
}

double MedianMs(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// The fastest repetition: what the op costs when nothing else competes for
// the cores (the median is what a loaded machine delivers).
double MinMs(const std::vector<double>& samples) {
  return *std::min_element(samples.begin(), samples.end());
}

// Device tensors of the model, filled with small random values.
class Model {
 public:
  explicit Model(Backend* backend) : backend_(backend), gen_(42) {}

  float* Alloc(int64_t count, float scale) {
    absl::StatusOr<Tensor> t = backend_->AllocateTensor(Shape{count});
    Check(t.status(), "AllocateTensor");
    std::uniform_real_distribution<float> dist(-scale, scale);
    std::vector<float> host(count);
    for (float& v : host) v = dist(gen_);
    Check(backend_->CopyHostToDevice(t->data(), host.data(), t->bytes()), "copy");
    tensors_.push_back(*std::move(t));
    return tensors_.back().data();
  }

 private:
  Backend* backend_;
  std::mt19937 gen_;
  std::vector<Tensor> tensors_;
};

struct Op {
  std::string name;
  std::function<absl::Status()> run;
};

// Returns the median step time in ms (ops run back to back, as in training).
double RunLayout(CpuConvLayout layout, const char* layout_name, bool fused, const Flags& flags) {
  CpuBackendOptions options;
  options.num_threads = flags.threads;
  options.conv_layout = layout;
  options.gemm = flags.gemm;
  options.conv_algorithm = flags.conv;
  options.vector_width = flags.width;
  std::unique_ptr<Backend> backend = CreateCpuBackend(options);
  Backend* b = backend.get();
  std::printf("\n== %s, conv layout %s, conv + ReLU + max-pool %s, gemm %s, conv %s, width %s ==\n",
              b->Describe().c_str(), layout_name, fused ? "as one plan" : "layer by layer",
              flags.gemm_name.c_str(), flags.conv_name.c_str(), flags.width_name.c_str());

  Model m(b);
  const int64_t n = kBatch;
  float* x = m.Alloc(n * 784, 1.f);
  float* w1 = m.Alloc(32 * 25, 0.2f);
  float* b1 = m.Alloc(32, 0.1f);
  float* c1 = m.Alloc(n * 32 * 784, 0);
  float* r1 = m.Alloc(n * 32 * 784, 0);
  float* p1 = m.Alloc(n * 32 * 196, 0);
  float* w2 = m.Alloc(64 * 32 * 25, 0.05f);
  float* b2 = m.Alloc(64, 0.1f);
  float* c2 = m.Alloc(n * 64 * 196, 0);
  float* r2 = m.Alloc(n * 64 * 196, 0);
  float* p2 = m.Alloc(n * 3136, 0);
  float* w3 = m.Alloc(1024 * 3136, 0.02f);
  float* b3 = m.Alloc(1024, 0.1f);
  float* h3 = m.Alloc(n * 1024, 0);
  float* r3 = m.Alloc(n * 1024, 0);
  float* d3 = m.Alloc(n * 1024, 0);
  float* mask = m.Alloc(n * 1024, 0);
  float* w4 = m.Alloc(10 * 1024, 0.05f);
  float* b4 = m.Alloc(10, 0.1f);
  float* logits = m.Alloc(n * 10, 0);
  float* loss = m.Alloc(1, 0);
  float* dlogits = m.Alloc(n * 10, 0);
  // Gradients.
  float* dw4 = m.Alloc(10 * 1024, 0);
  float* db4 = m.Alloc(10, 0);
  float* dd3 = m.Alloc(n * 1024, 0);
  float* dr3 = m.Alloc(n * 1024, 0);
  float* dh3 = m.Alloc(n * 1024, 0);
  float* dw3 = m.Alloc(1024 * 3136, 0);
  float* db3 = m.Alloc(1024, 0);
  float* dp2 = m.Alloc(n * 3136, 0);
  float* dr2 = m.Alloc(n * 64 * 196, 0);
  float* dc2 = m.Alloc(n * 64 * 196, 0);
  float* dw2 = m.Alloc(64 * 32 * 25, 0);
  float* db2 = m.Alloc(64, 0);
  float* dp1 = m.Alloc(n * 32 * 196, 0);
  float* dr1 = m.Alloc(n * 32 * 784, 0);
  float* dc1 = m.Alloc(n * 32 * 784, 0);
  float* dw1 = m.Alloc(32 * 25, 0);
  float* db1 = m.Alloc(32, 0);
  // One velocity buffer per parameter.
  struct Param {
    float* p;
    float* g;
    float* v;
    int64_t count;
  };
  std::vector<Param> params = {{w1, dw1, m.Alloc(800, 0), 800},
                               {b1, db1, m.Alloc(32, 0), 32},
                               {w2, dw2, m.Alloc(51200, 0), 51200},
                               {b2, db2, m.Alloc(64, 0), 64},
                               {w3, dw3, m.Alloc(1024 * 3136, 0), 1024 * 3136},
                               {b3, db3, m.Alloc(1024, 0), 1024},
                               {w4, dw4, m.Alloc(10240, 0), 10240},
                               {b4, db4, m.Alloc(10, 0), 10}};
  absl::StatusOr<DeviceBuffer> labels_buf = b->Allocate(n * sizeof(int32_t));
  Check(labels_buf.status(), "Allocate labels");
  auto* labels = static_cast<int32_t*>(labels_buf->data());
  for (int i = 0; i < n; ++i) labels[i] = i % 10;

  Conv2dConfig conv1{.n = kBatch, .c = 1, .h = 28, .w = 28, .filters = 32, .kernel_h = 5,
                     .kernel_w = 5, .stride_h = 1, .stride_w = 1, .pad_h = 2, .pad_w = 2};
  Conv2dConfig conv2{.n = kBatch, .c = 32, .h = 14, .w = 14, .filters = 64, .kernel_h = 5,
                     .kernel_w = 5, .stride_h = 1, .stride_w = 1, .pad_h = 2, .pad_w = 2};
  Pool2dConfig pool1{.mode = PoolMode::kMax, .n = kBatch, .c = 32, .h = 28, .w = 28};
  Pool2dConfig pool2{.mode = PoolMode::kMax, .n = kBatch, .c = 64, .h = 14, .w = 14};
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> conv1_plan = b->CreateConv2d(conv1);
  absl::StatusOr<std::unique_ptr<Conv2dPlan>> conv2_plan = b->CreateConv2d(conv2);
  absl::StatusOr<std::unique_ptr<Pool2dPlan>> pool1_plan = b->CreatePool2d(pool1);
  absl::StatusOr<std::unique_ptr<Pool2dPlan>> pool2_plan = b->CreatePool2d(pool2);
  Check(conv1_plan.status(), "conv1 plan");
  Check(conv2_plan.status(), "conv2 plan");
  Check(pool1_plan.status(), "pool1 plan");
  Check(pool2_plan.status(), "pool2 plan");
  Conv2dPlan* k1 = conv1_plan->get();
  Conv2dPlan* k2 = conv2_plan->get();
  Pool2dPlan* q1 = pool1_plan->get();
  Pool2dPlan* q2 = pool2_plan->get();
  const Activation relu = Activation::kRelu;
  SgdHyper sgd;
  sgd.learning_rate = 0.01f;
  sgd.momentum = 0.9f;

  // The fused variant runs each conv -> ReLU -> max-pool as the model runs
  // it on the CPU: one ConvReluPoolPlan (the convolution's output stays in
  // oneDNN's blocked layout). The layer-by-layer variant runs the step as it
  // ran before: a plan per op, separate ReLUs, separate conv backward passes.
  absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> block1_plan =
      b->CreateConvReluPool(conv1, /*with_bias=*/true, pool1);
  absl::StatusOr<std::unique_ptr<ConvReluPoolPlan>> block2_plan =
      b->CreateConvReluPool(conv2, /*with_bias=*/true, pool2);
  if (fused && (!block1_plan.ok() || !block2_plan.ok())) {
    std::printf("  (no conv + ReLU + pool plans on this backend: %s)\n",
                (block1_plan.ok() ? block2_plan : block1_plan).status().ToString().c_str());
    return 0;
  }
  ConvReluPoolPlan* block1 = block1_plan.ok() ? block1_plan->get() : nullptr;
  ConvReluPoolPlan* block2 = block2_plan.ok() ? block2_plan->get() : nullptr;
  enum Only { kBoth, kFused, kUnfused };
  struct TaggedOp {
    Only only;
    Op op;
  };
  std::vector<TaggedOp> tagged = {
      {kFused, {"conv1+relu+pool1 forward", [&] { return block1->Forward(x, w1, b1, p1, true); }}},
      {kUnfused, {"conv1 forward", [&] { return k1->Forward(x, w1, b1, c1); }}},
      {kUnfused,
       {"relu1 forward", [&] { return b->ActivationForward(relu, 0, c1, r1, n * 32 * 784); }}},
      {kUnfused, {"pool1 forward", [&] { return q1->Forward(r1, p1, true); }}},
      {kFused, {"conv2+relu+pool2 forward", [&] { return block2->Forward(p1, w2, b2, p2, true); }}},
      {kUnfused, {"conv2 forward", [&] { return k2->Forward(p1, w2, b2, c2); }}},
      {kUnfused,
       {"relu2 forward", [&] { return b->ActivationForward(relu, 0, c2, r2, n * 64 * 196); }}},
      {kUnfused, {"pool2 forward", [&] { return q2->Forward(r2, p2, true); }}},
      {kBoth,
       {"fc1 gemm forward", [&] { return b->Gemm(false, true, n, 1024, 3136, 1, p2, w3, 0, h3); }}},
      {kBoth, {"fc1 bias", [&] { return b->AddBias(h3, b3, n, 1024, 1); }}},
      {kBoth, {"relu3 forward", [&] { return b->ActivationForward(relu, 0, h3, r3, n * 1024); }}},
      {kBoth,
       {"dropout forward", [&] { return b->DropoutForward(r3, d3, mask, n * 1024, 0.5f, 7); }}},
      {kBoth,
       {"fc2 gemm forward",
        [&] { return b->Gemm(false, true, n, 10, 1024, 1, d3, w4, 0, logits); }}},
      {kBoth, {"fc2 bias", [&] { return b->AddBias(logits, b4, n, 10, 1); }}},
      {kBoth,
       {"softmax xent",
        [&] { return b->SoftmaxCrossEntropy(logits, labels, n, 10, loss, dlogits, nullptr); }}},
      {kBoth,
       {"fc2 dW", [&] { return b->Gemm(true, false, 10, 1024, n, 1, dlogits, d3, 0, dw4); }}},
      {kBoth, {"fc2 db", [&] { return b->BiasGrad(dlogits, db4, n, 10, 1); }}},
      {kBoth,
       {"fc2 dx", [&] { return b->Gemm(false, false, n, 1024, 10, 1, dlogits, w4, 0, dd3); }}},
      {kBoth, {"dropout backward", [&] { return b->Multiply(dd3, mask, dr3, n * 1024); }}},
      {kBoth,
       {"relu3 backward",
        [&] { return b->ActivationBackward(relu, 0, h3, r3, dr3, dh3, n * 1024); }}},
      {kBoth, {"fc1 dW", [&] { return b->Gemm(true, false, 1024, 3136, n, 1, dh3, p2, 0, dw3); }}},
      {kBoth, {"fc1 db", [&] { return b->BiasGrad(dh3, db3, n, 1024, 1); }}},
      {kBoth, {"fc1 dx", [&] { return b->Gemm(false, false, n, 3136, 1024, 1, dh3, w3, 0, dp2); }}},
      {kFused,
       {"conv2+relu+pool2 backward", [&] { return block2->Backward(p1, w2, dp2, dp1, dw2, db2); }}},
      {kUnfused, {"pool2 backward", [&] { return q2->Backward(r2, p2, dp2, dr2); }}},
      {kUnfused,
       {"relu2 backward",
        [&] { return b->ActivationBackward(relu, 0, c2, r2, dr2, dc2, n * 64 * 196); }}},
      {kUnfused, {"conv2 backward filter", [&] { return k2->BackwardFilter(p1, dc2, dw2, db2); }}},
      {kUnfused, {"conv2 backward data", [&] { return k2->BackwardData(dc2, w2, dp1); }}},
      {kFused,
       {"conv1+relu+pool1 backward",
        [&] { return block1->Backward(x, w1, dp1, nullptr, dw1, db1); }}},
      {kUnfused, {"pool1 backward", [&] { return q1->Backward(r1, p1, dp1, dr1); }}},
      {kUnfused,
       {"relu1 backward",
        [&] { return b->ActivationBackward(relu, 0, c1, r1, dr1, dc1, n * 32 * 784); }}},
      {kUnfused, {"conv1 backward filter", [&] { return k1->BackwardFilter(x, dc1, dw1, db1); }}},
      {kBoth,
       {"sgd momentum (all params)",
        [&] {
          for (const Param& p : params) {
            absl::Status s = b->SgdUpdate(p.p, p.g, p.v, p.count, sgd);
            if (!s.ok()) return s;
          }
          return absl::OkStatus();
        }}},
  };
  std::vector<Op> ops;
  for (TaggedOp& t : tagged) {
    if (t.only == kBoth || (t.only == kFused) == fused) ops.push_back(std::move(t.op));
  }

  using Clock = std::chrono::steady_clock;
  // Warm up (first calls JIT-compile and fault pages in), then time whole
  // steps, recording each op's time inside the step.
  for (int i = 0; i < 3; ++i) {
    for (Op& op : ops) Check(op.run(), op.name.c_str());
  }
  std::vector<std::vector<double>> per_op(ops.size());
  std::vector<double> steps;
  for (int rep = 0; rep < flags.reps; ++rep) {
    auto step_start = Clock::now();
    for (size_t i = 0; i < ops.size(); ++i) {
      auto start = Clock::now();
      Check(ops[i].run(), ops[i].name.c_str());
      per_op[i].push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    }
    steps.push_back(std::chrono::duration<double, std::milli>(Clock::now() - step_start).count());
  }
  double sum_medians = 0, sum_mins = 0;
  std::printf("  %-28s %9s %9s\n", "op", "median ms", "min ms");
  for (size_t i = 0; i < ops.size(); ++i) {
    const double ms = MedianMs(per_op[i]), min_ms = MinMs(per_op[i]);
    sum_medians += ms;
    sum_mins += min_ms;
    std::printf("  %-28s %9.3f %9.3f\n", ops[i].name.c_str(), ms, min_ms);
  }
  const double step_ms = MedianMs(steps);
  const double samples_per_sec = kBatch * 1000.0 / step_ms;
  std::printf("  %-28s %9.3f %9.3f\n", "sum over ops", sum_medians, sum_mins);
  std::printf("  %-28s %9.3f %9.3f\n", "whole step", step_ms, MinMs(steps));
  std::printf("  median step -> %.0f samples/s = %.2fx PyTorch 1.13 (%.0f samples/s, quoted); "
              "fastest step -> %.0f samples/s\n",
              samples_per_sec, samples_per_sec / kPytorchSamplesPerSec, kPytorchSamplesPerSec,
              kBatch * 1000.0 / MinMs(steps));
  return step_ms;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  using pstrain::CpuConvLayout;
  pstrain::Flags flags = pstrain::ParseFlags(argc, argv);
  struct Variant {
    const char* name;
    CpuConvLayout layout;
    bool fused;
  };
  const Variant variants[] = {{"auto", CpuConvLayout::kAuto, true},
                              {"plain", CpuConvLayout::kPlain, true},
                              {"blocked", CpuConvLayout::kBlocked, true},
                              {"blocked-unfused", CpuConvLayout::kBlocked, false}};
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  std::printf("OMP_WAIT_POLICY=%s GOMP_SPINCOUNT=%s\n", policy ? policy : "(unset)",
              spin ? spin : "(unset)");
  std::vector<std::pair<const char*, double>> results;
  for (const Variant& v : variants) {
    if (flags.layout != "all" && flags.layout != v.name) continue;
    results.push_back({v.name, pstrain::RunLayout(v.layout, v.name, v.fused, flags)});
  }
  if (results.empty()) {
    std::fprintf(stderr, "unknown --layout=%s\n", flags.layout.c_str());
    return 2;
  }
  std::printf("\nsummary (median step, batch 64):\n");
  for (const auto& [name, ms] : results) {
    std::printf("  %-16s %8.3f ms  %6.0f samples/s  %.2fx PyTorch\n", name, ms,
                pstrain::kBatch * 1000.0 / ms, pstrain::kBatch * 1000.0 / ms / 845.0);
  }
  return 0;
}
