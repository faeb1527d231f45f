// codec_bench: what gradient compression costs the worker's push thread
// (GradientEncoder::Encode, error feedback included) and the shard
// (DecodeGradient), per codec, for a dense model cut into 1 MiB chunks,
// beside a memcpy of the same fp32 bytes on the same thread in the same run
// (the memory-bandwidth reference: no codec can beat reading its input).
//
//   build/bin/codec_bench [--model_mb=8] [--reps=15]
//
// Prints, per codec, the median time of one pass over the model and the
// fp32 GB/s it represents; "/ memcpy" is memcpy's time over the codec's.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/chunking.h"
#include "common/rpc/gradient_codec.h"

ABSL_FLAG(int, model_mb, 8, "Model size in MiB of fp32 values");
ABSL_FLAG(int, reps, 15, "Timed passes per codec (median reported)");

namespace pstrain {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

ChunkPlan DensePlan(int64_t elements) {
  constexpr int64_t kChunk = (int64_t{1} << 20) / 4;
  ChunkPlan plan;
  plan.by_param.emplace_back();
  plan.by_shard.emplace_back();
  for (int64_t offset = 0; offset < elements; offset += kChunk) {
    ChunkInfo c;
    c.id = static_cast<int>(plan.chunks.size());
    c.offset = offset;
    c.count = std::min(kChunk, elements - offset);
    plan.by_param[0].push_back(c.id);
    plan.by_shard[0].push_back(c.id);
    plan.chunks.push_back(c);
  }
  plan.shard_bytes.push_back(elements * 4);
  plan.chunk_bytes = kChunk * 4;
  return plan;
}

int Main() {
  const int64_t n = int64_t{absl::GetFlag(FLAGS_model_mb)} << 18;
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const ChunkPlan plan = DensePlan(n);
  std::vector<float> gradient(static_cast<size_t>(n));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1e-3f);
  for (float& g : gradient) g = normal(rng);
  std::vector<float> dense(static_cast<size_t>(n));

  struct Row {
    std::string name;
    double encode_s, decode_s;
    int64_t bytes;
  };
  std::vector<Row> rows;
  // The reference: one memcpy of the fp32 model.
  std::vector<double> copy_s;
  for (int r = 0; r < reps + 1; ++r) {
    const auto start = Clock::now();
    std::memcpy(dense.data(), gradient.data(), gradient.size() * sizeof(float));
    if (r > 0) copy_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  const double memcpy_s = Median(copy_s);

  const std::pair<const char*, v1::CompressionSpec::Method> codecs[] = {
      {"fp16", v1::CompressionSpec::COMPRESSION_FP16},
      {"bf16", v1::CompressionSpec::COMPRESSION_BF16},
      {"topk 1%", v1::CompressionSpec::COMPRESSION_TOPK},
      {"onebit", v1::CompressionSpec::COMPRESSION_ONEBIT}};
  for (const auto& [name, method] : codecs) {
    v1::CompressionSpec spec;
    spec.set_method(method);
    if (method == v1::CompressionSpec::COMPRESSION_TOPK) spec.set_topk_ratio(0.01f);
    GradientEncoder encoder(spec, plan);
    std::vector<EncodedGradient> encoded(plan.chunks.size());
    std::vector<double> enc_s, dec_s;
    for (int r = 0; r < reps + 1; ++r) {  // The first pass allocates the residuals.
      auto start = Clock::now();
      for (const ChunkInfo& c : plan.chunks) {
        absl::Status s = encoder.Encode(
            c.id, absl::MakeConstSpan(gradient.data() + c.offset, c.count), &encoded[c.id]);
        if (!s.ok()) {
          std::fprintf(stderr, "%s: encode failed: %s\n", name, std::string(s.message()).c_str());
          return 1;
        }
      }
      if (r > 0) enc_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      start = Clock::now();
      for (const ChunkInfo& c : plan.chunks) {
        v1::ChunkHeader header;
        header.set_chunk_id(c.id);
        header.set_num_elements(c.count);
        header.set_kind(v1::ChunkHeader::KIND_GRADIENT);
        header.set_dtype(encoded[c.id].dtype);
        header.set_encoding(encoded[c.id].encoding);
        header.set_encoded_count(encoded[c.id].encoded_count);
        absl::Status s =
            DecodeGradient(header, encoded[c.id].bytes.data(), encoded[c.id].bytes.size(),
                           absl::MakeSpan(dense.data() + c.offset, c.count));
        if (!s.ok()) {
          std::fprintf(stderr, "%s: decode failed: %s\n", name, std::string(s.message()).c_str());
          return 1;
        }
      }
      if (r > 0) dec_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
    int64_t bytes = 0;
    for (const EncodedGradient& e : encoded) bytes += static_cast<int64_t>(e.bytes.size());
    rows.push_back({name, Median(enc_s), Median(dec_s), bytes});
  }

  const double model_bytes = static_cast<double>(n) * 4;
  std::printf(
      "model: %.2f MB of fp32 (%lld values) in %zu chunks of <= 1 MiB, 1 thread, "
      "median of %d passes\n",
      model_bytes / 1e6, static_cast<long long>(n), plan.chunks.size(), reps);
  std::printf("memcpy of the model (reference)   %8.2f ms  %6.2f GB/s\n", memcpy_s * 1e3,
              model_bytes / memcpy_s / 1e9);
  std::printf("%-10s %10s %12s %9s %10s %12s %9s %12s\n", "codec", "encode ms", "fp32 GB/s",
              "/ memcpy", "decode ms", "fp32 GB/s", "/ memcpy", "wire bytes");
  for (const Row& row : rows) {
    std::printf("%-10s %10.2f %12.2f %8.2fx %10.2f %12.2f %8.2fx %12lld\n", row.name.c_str(),
                row.encode_s * 1e3, model_bytes / row.encode_s / 1e9, memcpy_s / row.encode_s,
                row.decode_s * 1e3, model_bytes / row.decode_s / 1e9, memcpy_s / row.decode_s,
                static_cast<long long>(row.bytes));
  }
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Main();
}
