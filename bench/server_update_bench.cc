// server_update_bench: how fast one parameter-server shard applies a job's
// updates, beside the machine's memory bandwidth measured in the same run.
//
//   update   ParameterShard (no gRPC) holding one job of --model_mb of
//            parameters (a dense layer) in 1 MiB chunks, async mode (each
//            push applied on arrival), SGD with momentum. --threads pushers,
//            each owning every T-th chunk (sharded by chunk), push one
//            gradient per chunk per round, from a gradient buffer as large
//            as the model (so it comes from memory, not cache). An update
//            must read the gradient, the weights and the velocity and write
//            the weights and the velocity: 20 bytes per parameter, the
//            traffic counted here (the shard's finite check reads the
//            gradient once more, mostly from cache).
//   AXPY     y += a * x over buffers of the same size, split the same way
//            over the same number of threads: 12 bytes per element, the
//            bandwidth a read-modify-write loop reaches on this machine.
//
//   server_update_bench [--model_mb=128] [--threads=1,2] [--reps=7]
//                       [--pull_codecs=none,fp16,onebit] [--tune_malloc=false]
//
// The allocator is tuned as pstrain-server tunes it (large buffers come
// back to the heap, not to the kernel) unless --tune_malloc=false.
//
// --pull_codecs: instead of async, a sync job with one member (every push
// completes its step) per codec, "none" without pull compression and the
// others with JobSpec.pull_compression: each step then also publishes the
// chunk's delta (master - published, encoded, added back). What that costs
// the update shows against "none" in the same run.
//
// Rounds alternate between the two (one warm-up each), so that load from
// other processes hits both alike; prints per thread count the medians, the
// update's traffic as a fraction of AXPY's, and the update rate against the
// bound the AXPY bandwidth allows. See docs/BENCHMARKS.md "## Server update".
#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "common/rpc/channel.h"
#include "server/parameter_shard.h"
#include "tests/testing/shard_fixtures.h"

ABSL_FLAG(int, model_mb, 128, "Model size in MiB of F32 parameters");
ABSL_FLAG(bool, tune_malloc, true,
          "Raise glibc's mmap/trim thresholds as pstrain-server does "
          "(TuneAllocatorForLargeMessages), so that the chunks' buffers are reused");
ABSL_FLAG(std::string, threads, "1,2", "Comma-separated pusher (and AXPY) thread counts");
ABSL_FLAG(int, reps, 7, "Measured rounds per variant (after one warm-up)");
ABSL_FLAG(int, pace_lead, 2,
          "Sync variants: ParameterShard::Options::pace_lead_frames (pstrain-server "
          "--push-pacing-lead; 0 = no pacing)");
ABSL_FLAG(std::string, pull_codecs, "",
          "Comma-separated pull codecs (none, fp16, bf16, topk, onebit) to run as sync jobs "
          "instead of the async one");

namespace pstrain {
namespace {

constexpr char kJob[] = "bench";
constexpr int64_t kChunkBytes = int64_t{1} << 20;
constexpr double kUpdateBytesPerParam = 20;  // Read g, w, v; write w, v.
constexpr double kAxpyBytesPerElement = 12;  // Read x, y; write y.

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs fn(t) on `threads` threads and returns the wall time in seconds.
template <typename Fn>
double TimeOnThreads(int threads, Fn fn) {
  const absl::Time start = absl::Now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([&fn, t] { fn(t); });
  for (std::thread& th : pool) th.join();
  return absl::ToDoubleSeconds(absl::Now() - start);
}

class UpdateBench {
 public:
  // `pull_codec` null: the async job; else a sync job with that pull
  // compression (COMPRESSION_NONE: none) and one member.
  UpdateBench(int64_t model_mb, int threads, const v1::CompressionSpec* pull_codec = nullptr)
      : threads_(threads), sync_(pull_codec != nullptr) {
    // input [features] -> dense 1024: features * 1024 + 1024 parameters.
    const int features = static_cast<int>(model_mb * (int64_t{1} << 20) / 4 / 1024);
    spec_ = ::pstrain::testing::DenseJob(
        kJob, features, 1024, 1, sync_ ? v1::CONSISTENCY_SYNC : v1::CONSISTENCY_ASYNC);
    if (sync_) *spec_.mutable_pull_compression() = *pull_codec;
    spec_.mutable_optimizer()->set_learning_rate(1e-6f);
    spec_.mutable_optimizer()->set_momentum(0.9f);
    graph_ = *BuildModelGraph(spec_.model());
    plan_ = *PlanChunks(graph_, 1, kChunkBytes);
    shard_ = std::make_unique<ParameterShard>(ParameterShard::Options{
        .shard_index = 0, .pace_lead_frames = absl::GetFlag(FLAGS_pace_lead)});
    ShardJobConfig config;
    config.job_id = kJob;
    config.spec = spec_;
    config.num_shards = 1;
    config.chunk_bytes = kChunkBytes;
    for (int t = 0; t < (sync_ ? 1 : threads); ++t) config.members.push_back(absl::StrCat("w", t));
    config.generation = 1;
    absl::Status configured =
        shard_->ConfigureJob(config, ::pstrain::testing::InitialChunks(graph_, plan_, 0));
    if (!configured.ok()) {
      std::fprintf(stderr, "ConfigureJob: %s\n", std::string(configured.message()).c_str());
      std::exit(1);
    }
    for (const ChunkInfo& c : plan_.chunks) parameters_ += c.count;
    gradient_.assign(static_cast<size_t>(parameters_), 1e-3f);
    for (const ChunkInfo& c : plan_.chunks) {
      offsets_.push_back(offset_end_);
      offset_end_ += c.count;
    }
  }

  int64_t parameters() const { return parameters_; }

  // One round: every chunk updated once. Seconds.
  double Round() {
    const double seconds = TimeOnThreads(threads_, [this](int t) {
      PushArgs args;
      args.job_id = kJob;
      args.worker_id = sync_ ? "w0" : absl::StrCat("w", t);
      args.generation = 1;
      args.kind = v1::ChunkHeader::KIND_GRADIENT;
      for (size_t c = static_cast<size_t>(t); c < plan_.chunks.size();
           c += static_cast<size_t>(threads_)) {
        args.chunk_id = static_cast<int>(c);
        // Async: any past version is accepted (staleness). Sync: the chunk's
        // own, the number of rounds so far.
        args.version = sync_ ? round_ : 0;
        absl::StatusOr<int64_t> v = shard_->Push(
            args, absl::MakeConstSpan(gradient_.data() + offsets_[c], plan_.chunks[c].count));
        if (!v.ok()) {
          std::fprintf(stderr, "Push: %s\n", std::string(v.status().message()).c_str());
          std::exit(1);
        }
      }
    });
    ++round_;
    return seconds;
  }

 private:
  const int threads_;
  const bool sync_;
  int64_t round_ = 0;
  v1::JobSpec spec_;
  ModelGraph graph_;
  ChunkPlan plan_;
  std::unique_ptr<ParameterShard> shard_;
  int64_t parameters_ = 0;
  std::vector<float> gradient_;
  std::vector<int64_t> offsets_;
  int64_t offset_end_ = 0;
};

class AxpyBench {
 public:
  AxpyBench(int64_t elements, int threads)
      : threads_(threads), x_(static_cast<size_t>(elements), 1e-3f), y_(x_.size(), 0.5f) {}

  double Round() {
    const int64_t n = static_cast<int64_t>(x_.size());
    return TimeOnThreads(threads_, [this, n](int t) {
      // The same sharding as the shard's chunks: 1 MiB slices, every T-th.
      constexpr int64_t kSlice = kChunkBytes / 4;
      const float a = 0.999f;
      float* y = y_.data();
      const float* x = x_.data();
      for (int64_t begin = t * kSlice; begin < n; begin += threads_ * kSlice) {
        const int64_t end = std::min(n, begin + kSlice);
        for (int64_t i = begin; i < end; ++i) y[i] += a * x[i];
      }
    });
  }

 private:
  const int threads_;
  std::vector<float> x_, y_;
};

int Main() {
  const int64_t model_mb = absl::GetFlag(FLAGS_model_mb);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  std::vector<int> thread_counts;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_threads), ',')) {
    int t = 0;
    if (!absl::SimpleAtoi(part, &t) || t < 1) {
      std::fprintf(stderr, "--threads: bad count '%s'\n", std::string(part).c_str());
      return 2;
    }
    thread_counts.push_back(t);
  }
  // The variants: the async job, or a sync job per pull codec.
  std::vector<std::pair<std::string, std::optional<v1::CompressionSpec>>> variants;
  const std::string codecs = absl::GetFlag(FLAGS_pull_codecs);
  if (codecs.empty()) variants.push_back({"async", std::nullopt});
  for (absl::string_view name : absl::StrSplit(codecs, ',', absl::SkipEmpty())) {
    v1::CompressionSpec spec;
    const std::string method = absl::StrCat("COMPRESSION_", absl::AsciiStrToUpper(name));
    v1::CompressionSpec::Method value;
    if (!v1::CompressionSpec::Method_Parse(method, &value)) {
      std::fprintf(stderr, "--pull_codecs: unknown codec '%s'\n", std::string(name).c_str());
      return 2;
    }
    spec.set_method(value);
    variants.push_back({absl::StrCat("sync pull ", name), spec});
  }
  std::printf(
      "server_update_bench: %lld MiB model, 1 MiB chunks, SGD momentum, "
      "%d rounds per variant (medians), %u hardware threads\n",
      static_cast<long long>(model_mb), reps, std::thread::hardware_concurrency());
  std::printf("%-16s %-8s %-16s %-22s %-10s %-26s %s\n", "job", "threads", "update Mparam/s",
              "update GB/s (20 B/p)", "AXPY GB/s", "bound Mparam/s (AXPY/20 B)", "update/bound");
  for (const auto& [label, pull_codec] : variants) for (int threads : thread_counts) {
    UpdateBench update(model_mb, threads, pull_codec ? &*pull_codec : nullptr);
    AxpyBench axpy(update.parameters(), threads);
    update.Round();  // Warm-up: faults the pages in.
    axpy.Round();
    std::vector<double> update_s, axpy_s;
    for (int r = 0; r < reps; ++r) {
      update_s.push_back(update.Round());
      axpy_s.push_back(axpy.Round());
    }
    const double params = static_cast<double>(update.parameters());
    const double update_rate = params / Median(update_s);
    const double update_gbs = update_rate * kUpdateBytesPerParam / 1e9;
    const double axpy_gbs = params * kAxpyBytesPerElement / Median(axpy_s) / 1e9;
    const double bound = axpy_gbs * 1e9 / kUpdateBytesPerParam;
    std::printf("%-16s %-8d %-16.1f %-22.2f %-10.2f %-26.1f %.0f%%\n", label.c_str(), threads,
                update_rate / 1e6, update_gbs, axpy_gbs, bound / 1e6, 100 * update_rate / bound);
  }
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_tune_malloc)) pstrain::TuneAllocatorForLargeMessages();
  return pstrain::Main();
}
