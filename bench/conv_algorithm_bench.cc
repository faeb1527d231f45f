// conv_algorithm_bench: the CPU backend's 5x5 "same" convolutions through
// Conv2dPlan (forward with bias, backward data, then the weight and bias
// gradients; NCHW in and out, so the layout reorders count on both sides)
// with oneDNN's direct kernels
// (CpuConvAlgorithm::kDirect) beside Winograd's F(4x4, 5x5) where the
// backend picks it (kAuto), in the same run: for each shape, rounds
// alternate between the two plans and medians are printed. Shapes whose
// channels kAuto leaves on the direct kernels print about 1.00x.
//
//   build/bin/conv_algorithm_bench --reps=12
//   build/bin/conv_algorithm_bench --reps=1 --shapes=2x16x8x16   (smoke)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/cpu_backend.h"

ABSL_FLAG(int, reps, 12, "timed rounds of each plan per shape (after one warm-up each)");
ABSL_FLAG(std::string, shapes, "64x32x14x64,32x64x32x64,16x128x16x128,8x256x16x256,4x512x8x512",
          "comma-separated NxCxHxK: batch, input channels, image side, filters");

namespace pstrain {
namespace {

struct ConvShape {
  int n, c, side, filters;
};

std::vector<ConvShape> ParseShapes(const std::string& text) {
  std::vector<ConvShape> shapes;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<std::string> parts = absl::StrSplit(item, 'x');
    ConvShape s;
    if (parts.size() != 4 || !absl::SimpleAtoi(parts[0], &s.n) ||
        !absl::SimpleAtoi(parts[1], &s.c) || !absl::SimpleAtoi(parts[2], &s.side) ||
        !absl::SimpleAtoi(parts[3], &s.filters) || s.n <= 0 || s.c <= 0 || s.side <= 0 ||
        s.filters <= 0) {
      std::fprintf(stderr, "conv_algorithm_bench: bad shape '%.*s' (want NxCxHxK)\n",
                   static_cast<int>(item.size()), item.data());
      std::exit(2);
    }
    shapes.push_back(s);
  }
  return shapes;
}

void Check(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "conv_algorithm_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

double Ms(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  using namespace pstrain;  // NOLINT: a benchmark's main.
  absl::ParseCommandLine(argc, argv);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const CpuConvAlgorithm algorithms[2] = {CpuConvAlgorithm::kDirect, CpuConvAlgorithm::kAuto};
  std::unique_ptr<Backend> backends[2];
  for (int a = 0; a < 2; ++a) {
    CpuBackendOptions options;
    options.conv_algorithm = algorithms[a];
    backends[a] = CreateCpuBackend(options);
  }
  std::printf("%s; 5x5 convolutions, stride 1, padding 2; medians of %d alternating rounds\n",
              backends[0]->Describe().c_str(), reps);
  std::printf("%-22s %12s %12s %7s %12s %12s %7s %12s %12s %7s\n", "N x C x HxW -> K", "fwd direct",
              "fwd auto", "ratio", "bwd-d direct", "bwd-d auto", "ratio", "bwd-w direct",
              "bwd-w auto", "ratio");
  for (const ConvShape& s : ParseShapes(absl::GetFlag(FLAGS_shapes))) {
    Conv2dConfig c;
    c.n = s.n;
    c.c = s.c;
    c.h = c.w = s.side;
    c.filters = s.filters;
    c.kernel_h = c.kernel_w = 5;
    c.pad_h = c.pad_w = 2;
    std::mt19937 gen(1);
    std::normal_distribution<float> normal;
    std::vector<float> x(static_cast<size_t>(c.n) * c.c * c.h * c.w);
    std::vector<float> w(static_cast<size_t>(c.filters) * c.c * 25), bias(c.filters);
    std::vector<float> y(static_cast<size_t>(c.n) * c.filters * c.h * c.w), dx(x.size());
    std::vector<float> dw(w.size()), dbias(bias.size());
    for (float& v : x) v = normal(gen);
    for (float& v : w) v = 0.05f * normal(gen);
    for (float& v : bias) v = normal(gen);
    std::unique_ptr<Conv2dPlan> plans[2];
    for (int a = 0; a < 2; ++a) {
      absl::StatusOr<std::unique_ptr<Conv2dPlan>> plan = backends[a]->CreateConv2d(c);
      Check(plan.status(), "CreateConv2d");
      plans[a] = *std::move(plan);
    }
    std::vector<double> forward[2], backward[2], weights[2];
    for (int round = -1; round < reps; ++round) {  // Round -1 warms up.
      for (int a = 0; a < 2; ++a) {
        const auto t0 = std::chrono::steady_clock::now();
        Check(plans[a]->Forward(x.data(), w.data(), bias.data(), y.data()), "Forward");
        const auto t1 = std::chrono::steady_clock::now();
        Check(plans[a]->BackwardData(y.data(), w.data(), dx.data()), "BackwardData");
        const auto t2 = std::chrono::steady_clock::now();
        Check(plans[a]->BackwardFilter(x.data(), y.data(), dw.data(), dbias.data()),
              "BackwardFilter");
        const auto t3 = std::chrono::steady_clock::now();
        if (round < 0) continue;
        forward[a].push_back(Ms(t1 - t0));
        backward[a].push_back(Ms(t2 - t1));
        weights[a].push_back(Ms(t3 - t2));
      }
    }
    const double f0 = Median(forward[0]), f1 = Median(forward[1]);
    const double b0 = Median(backward[0]), b1 = Median(backward[1]);
    const double w0 = Median(weights[0]), w1 = Median(weights[1]);
    char name[64];
    std::snprintf(name, sizeof(name), "%d x %d x %dx%d -> %d", c.n, c.c, c.h, c.w, c.filters);
    std::printf(
        "%-22s %9.2f ms %9.2f ms %6.2fx %9.2f ms %9.2f ms %6.2fx %9.2f ms %9.2f ms %6.2fx\n", name,
        f0, f1, f0 / f1, b0, b1, b0 / b1, w0, w1, w0 / w1);
  }
  return 0;
}
