// transport_bench: one push plus one pull of a whole model between a worker
// and a parameter server on loopback, reported as model bytes / round trip,
// beside references measured in the same run:
//
//   pstrain          PsClient -> ShardServices -> ParameterShard (1 shard,
//                    1 MiB chunks), average mode with one member and K = 1:
//                    the push of round r completes the round (the server
//                    publishes the pushed values; no optimizer math), the
//                    pull asks for round r+1. "push, then pull" waits for the
//                    push before pulling; "pipelined" issues both at once, so
//                    chunk k is pulled while chunk k+1.. are still pushed.
//   plain gRPC       a client stream of 1 MiB protobuf `bytes` messages
//                    (pstrain.v1.ModelChunk), then a server stream of the
//                    same back: what a service written with protobuf
//                    messages does. The server copies into / out of a flat
//                    store, the client out of / into flat model buffers.
//   gRPC raw         the same two streams with raw ByteBuffer slices that
//                    point at the buffers (one copy on each receive).
//   raw TCP          send the model bytes over a 127.0.0.1 socket, receive
//                    them back (one recv copy each way).
//
//   transport_bench [--model_mb=100] [--reps=7] [--tune_malloc=true]
//
// Prints the median over --reps rounds (after one warm-up) for each, and the
// ratios. See docs/BENCHMARKS.md "## Transport".
#include <arpa/inet.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "common/rpc/channel.h"
#include "common/status_macros.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "worker/ps_client.h"

ABSL_FLAG(int, model_mb, 100, "Model size in MB (10^6 bytes) of fp32 values");
ABSL_FLAG(int, reps, 7, "Timed repetitions per variant (median reported)");
ABSL_FLAG(bool, tune_malloc, true,
          "Raise glibc's mmap/trim thresholds as the daemons do (TuneAllocatorForLargeMessages)");

namespace pstrain {
namespace {

constexpr char kJob[] = "bench";
constexpr char kWorker[] = "w0";
constexpr size_t kRefChunkBytes = size_t{1} << 20;
constexpr char kPushProto[] = "/bench.Reference/PushProto";
constexpr char kPullProto[] = "/bench.Reference/PullProto";
constexpr char kPushRaw[] = "/bench.Reference/PushRaw";
constexpr char kPullRaw[] = "/bench.Reference/PullRaw";

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Runs `round` once to warm up, then `reps` times; the median seconds.
double TimeRounds(int reps, const std::function<bool()>& round) {
  if (!round()) return -1;
  std::vector<double> seconds;
  for (int i = 0; i < reps; ++i) {
    const absl::Time start = absl::Now();
    if (!round()) return -1;
    seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  return Median(seconds);
}

// ---------------------------------------------------------------------------
// pstrain: PsClient against ShardServices.
// ---------------------------------------------------------------------------

// input [n] -> dense n -> loss: n*n + n parameters (n = 5000: 100.02 MB).
v1::JobSpec SquareModelJob(int n) {
  v1::JobSpec job;
  job.set_name("transport-bench");
  v1::ModelSpec* model = job.mutable_model();
  model->set_name("square");
  model->add_input_shape(n);
  model->set_num_classes(n);
  v1::LayerSpec* fc = model->add_layers();
  fc->set_name("fc");
  fc->mutable_dense()->set_units(n);
  model->add_layers()->set_name("loss");
  model->mutable_layers(1)->mutable_softmax_cross_entropy();
  job.mutable_dataset()->set_format(v1::DATASET_FORMAT_SYNTHETIC);
  job.mutable_optimizer()->set_type(v1::OPTIMIZER_SGD);
  job.mutable_optimizer()->set_learning_rate(0.1f);
  job.set_epochs(1);
  job.set_batch_size(1);
  job.set_mode(v1::CONSISTENCY_AVERAGE);
  job.set_averaging_frequency(1);
  return job;
}

struct PstrainResult {
  double sequential_s = -1, pipelined_s = -1;
  int64_t model_bytes = 0;
  size_t chunks = 0;
};

absl::StatusOr<PstrainResult> RunPstrain(int n, int reps) {
  const v1::JobSpec job = SquareModelJob(n);
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, BuildModelGraph(job.model()));
  PSTRAIN_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(graph, 1, kDefaultChunkBytes));
  ParameterShard shard({.shard_index = 0});
  ShardJobConfig config;
  config.job_id = kJob;
  config.spec = job;
  config.members = {kWorker};
  std::vector<v1::ChunkValues> initial;
  for (const ChunkInfo& c : plan.chunks) {
    v1::ChunkValues v;
    v.set_chunk_id(c.id);
    v.mutable_values()->Resize(static_cast<int>(c.count), 0.0f);
    initial.push_back(std::move(v));
  }
  PSTRAIN_RETURN_IF_ERROR(shard.ConfigureJob(config, initial));
  initial.clear();

  ShardServices services(&shard);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  services.Register(&builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) return absl::InternalError("server did not start");

  PsClient::Options options;
  options.shard_addresses = {"127.0.0.1:" + std::to_string(port)};
  options.job_id = kJob;
  options.worker_id = kWorker;
  options.generation = 1;
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<PsClient> client, PsClient::Create(options, plan));

  // The worker's model: one flat buffer, chunks point into it.
  std::vector<float> params(static_cast<size_t>(graph.trainable_params + graph.non_trainable_params));
  std::vector<float> pulled(params.size());
  for (size_t i = 0; i < params.size(); ++i) params[i] = static_cast<float>(i % 1000) * 1e-3f;
  std::vector<int64_t> param_base(graph.params.size());
  for (size_t p = 1; p < graph.params.size(); ++p) {
    param_base[p] = param_base[p - 1] + graph.params[p - 1].shape.num_elements();
  }
  std::vector<PsClient::ChunkRef> refs;
  std::vector<PsClient::ChunkDest> dests;
  for (const ChunkInfo& c : plan.chunks) {
    refs.push_back({c.id, params.data() + param_base[c.param] + c.offset});
    dests.push_back({c.id, pulled.data() + param_base[c.param] + c.offset});
  }

  int64_t round = 0;
  absl::Status failure;
  auto check = [&](const absl::Status& s) {
    if (!s.ok() && failure.ok()) failure = s;
    return s.ok();
  };
  auto sequential = [&] {
    auto push = client->Push(v1::ChunkHeader::KIND_PARAMETERS, round, 0, refs);
    if (!check(push->Wait())) return false;
    auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, round + 1, 0, dests);
    if (!check(pull->Wait())) return false;
    ++round;
    return true;
  };
  auto pipelined = [&] {
    auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, round + 1, 0, dests);
    auto push = client->Push(v1::ChunkHeader::KIND_PARAMETERS, round, 0, refs);
    const bool ok = check(push->Wait()) & check(pull->Wait());
    ++round;
    return ok;
  };
  PstrainResult result;
  result.model_bytes = static_cast<int64_t>(params.size() * sizeof(float));
  result.chunks = plan.chunks.size();
  result.sequential_s = TimeRounds(reps, sequential);
  PSTRAIN_RETURN_IF_ERROR(failure);
  result.pipelined_s = TimeRounds(reps, pipelined);
  PSTRAIN_RETURN_IF_ERROR(failure);
  if (pulled != params) return absl::InternalError("pulled model differs from the pushed one");
  server->Shutdown(DeadlineFromNow(absl::Seconds(5)));
  return result;
}

// ---------------------------------------------------------------------------
// References over plain gRPC: protobuf `bytes` messages, and raw slices.
// ---------------------------------------------------------------------------

bool IsProto(const std::string& method) { return method == kPushProto || method == kPullProto; }

// Server side: push methods copy into `store`, pull methods stream it back.
class ReferenceService final : public grpc::CallbackGenericService {
 public:
  explicit ReferenceService(size_t bytes) : store_(bytes, 1) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    if (ctx->method() == kPushProto || ctx->method() == kPushRaw) {
      return new PushReactor(store_.data(), IsProto(ctx->method()));
    }
    return new PullReactor(store_.data(), store_.size(), IsProto(ctx->method()));
  }

 private:
  class PushReactor final : public grpc::ServerGenericBidiReactor {
   public:
    PushReactor(char* store, bool proto) : store_(store), proto_(proto) { StartRead(&buffer_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      if (proto_) {
        v1::ModelChunk chunk;
        grpc::Status s = grpc::SerializationTraits<v1::ModelChunk>::Deserialize(&buffer_, &chunk);
        if (!s.ok()) {
          Finish(s);
          return;
        }
        std::memcpy(store_ + chunk.offset(), chunk.data().data(), chunk.data().size());
      } else {
        std::vector<grpc::Slice> slices;
        (void)buffer_.Dump(&slices);
        for (const grpc::Slice& s : slices) {
          std::memcpy(store_ + offset_, s.begin(), s.size());
          offset_ += s.size();
        }
      }
      StartRead(&buffer_);
    }
    void OnDone() override { delete this; }

   private:
    char* const store_;
    const bool proto_;
    size_t offset_ = 0;
    grpc::ByteBuffer buffer_;
  };

  class PullReactor final : public grpc::ServerGenericBidiReactor {
   public:
    PullReactor(const char* store, size_t bytes, bool proto)
        : store_(store), bytes_(bytes), proto_(proto) {
      StartRead(&request_);
    }
    void OnReadDone(bool ok) override {
      if (ok) WriteNext();
    }
    void OnWriteDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
        return;
      }
      WriteNext();
    }
    void OnDone() override { delete this; }

   private:
    void WriteNext() {
      if (offset_ >= bytes_) {
        Finish(grpc::Status::OK);
        return;
      }
      const size_t n = std::min(kRefChunkBytes, bytes_ - offset_);
      if (proto_) {
        v1::ModelChunk chunk;
        chunk.set_data(store_ + offset_, n);
        chunk.set_offset(static_cast<int64_t>(offset_));
        chunk.set_total_bytes(static_cast<int64_t>(bytes_));
        bool own = false;
        buffer_.Clear();
        (void)grpc::SerializationTraits<v1::ModelChunk>::Serialize(chunk, &buffer_, &own);
      } else {
        grpc::Slice slice(store_ + offset_, n, grpc::Slice::STATIC_SLICE);
        buffer_ = grpc::ByteBuffer(&slice, 1);
      }
      offset_ += n;
      StartWrite(&buffer_);
    }

    const char* const store_;
    const size_t bytes_;
    const bool proto_;
    size_t offset_ = 0;
    grpc::ByteBuffer request_, buffer_;
  };

  std::vector<char> store_;
};

// Client side of one reference stream; Run blocks until the call ends.
class ReferenceCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Push: streams `src` in 1 MiB messages. Pull: receives into `dst`.
  static bool Run(grpc::GenericStub* stub, const std::string& method, const char* src, char* dst,
                  size_t bytes) {
    ReferenceCall call(method, src, dst, bytes);
    call.ctx_.set_deadline(DeadlineFromNow(absl::Seconds(120)));
    stub->PrepareBidiStreamingCall(&call.ctx_, method, grpc::StubOptions(), &call);
    if (dst != nullptr) {
      grpc::Slice empty;
      call.buffer_ = grpc::ByteBuffer(&empty, 1);
      call.StartWriteLast(&call.buffer_, grpc::WriteOptions());
      call.StartRead(&call.reply_);
    } else {
      call.WriteNext();
    }
    call.StartCall();
    call.done_.WaitForNotification();
    if (!call.status_.ok()) {
      std::fprintf(stderr, "%s: %s\n", method.c_str(), call.status_.error_message().c_str());
    }
    return call.status_.ok() && (dst == nullptr || call.offset_ == bytes);
  }

  void OnWriteDone(bool ok) override {
    if (ok && dst_ == nullptr) WriteNext();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (proto_) {
      v1::ModelChunk chunk;
      if (!grpc::SerializationTraits<v1::ModelChunk>::Deserialize(&reply_, &chunk).ok()) return;
      std::memcpy(dst_ + chunk.offset(), chunk.data().data(), chunk.data().size());
      offset_ += chunk.data().size();
    } else {
      std::vector<grpc::Slice> slices;
      (void)reply_.Dump(&slices);
      for (const grpc::Slice& s : slices) {
        std::memcpy(dst_ + offset_, s.begin(), s.size());
        offset_ += s.size();
      }
    }
    StartRead(&reply_);
  }
  void OnDone(const grpc::Status& status) override {
    status_ = status;
    done_.Notify();
  }

 private:
  ReferenceCall(const std::string& method, const char* src, char* dst, size_t bytes)
      : proto_(IsProto(method)), src_(src), dst_(dst), bytes_(bytes) {}

  void WriteNext() {
    if (offset_ >= bytes_) {
      StartWritesDone();
      return;
    }
    const size_t n = std::min(kRefChunkBytes, bytes_ - offset_);
    if (proto_) {
      v1::ModelChunk chunk;
      chunk.set_data(src_ + offset_, n);
      chunk.set_offset(static_cast<int64_t>(offset_));
      chunk.set_total_bytes(static_cast<int64_t>(bytes_));
      bool own = false;
      buffer_.Clear();
      (void)grpc::SerializationTraits<v1::ModelChunk>::Serialize(chunk, &buffer_, &own);
    } else {
      grpc::Slice slice(src_ + offset_, n, grpc::Slice::STATIC_SLICE);
      buffer_ = grpc::ByteBuffer(&slice, 1);
    }
    offset_ += n;
    StartWrite(&buffer_);
  }

  const bool proto_;
  const char* const src_;
  char* const dst_;
  const size_t bytes_;
  size_t offset_ = 0;
  grpc::ClientContext ctx_;
  grpc::ByteBuffer buffer_, reply_;
  grpc::Status status_;
  absl::Notification done_;
};

struct ReferenceResult {
  double proto_s = -1, raw_s = -1;
};

ReferenceResult RunGrpcReferences(size_t bytes, int reps) {
  ReferenceService service(bytes);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  ConfigureServerBuilder(&builder);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ReferenceResult result;
  if (server == nullptr) return result;
  auto channel = CreateChannel("127.0.0.1:" + std::to_string(port));
  grpc::GenericStub stub(channel);
  std::vector<char> src(bytes), dst(bytes);
  for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<char>(i * 131);
  auto round = [&](const char* push, const char* pull) {
    return ReferenceCall::Run(&stub, push, src.data(), nullptr, bytes) &&
           ReferenceCall::Run(&stub, pull, nullptr, dst.data(), bytes);
  };
  result.proto_s = TimeRounds(reps, [&] { return round(kPushProto, kPullProto); });
  if (dst != src) result.proto_s = -1;
  std::fill(dst.begin(), dst.end(), 0);
  result.raw_s = TimeRounds(reps, [&] { return round(kPushRaw, kPullRaw); });
  if (dst != src) result.raw_s = -1;
  server->Shutdown(DeadlineFromNow(absl::Seconds(5)));
  return result;
}

// ---------------------------------------------------------------------------
// Raw TCP over 127.0.0.1.
// ---------------------------------------------------------------------------

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = send(fd, p, n, 0);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool RecvAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = recv(fd, p, n, 0);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

double RunTcp(size_t bytes, int reps) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 1) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(listener);
    return -1;
  }
  // Echo server: receive the model, send it back, once per round.
  std::thread echo([&] {
    const int fd = accept(listener, nullptr, nullptr);
    if (fd < 0) return;
    std::vector<char> store(bytes, 1);
    for (int i = 0; i < reps + 1; ++i) {
      if (!RecvAll(fd, store.data(), bytes) || !SendAll(fd, store.data(), bytes)) break;
    }
    close(fd);
  });
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  double seconds = -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    std::vector<char> src(bytes, 2), dst(bytes, 0);
    seconds = TimeRounds(reps, [&] {
      return SendAll(fd, src.data(), bytes) && RecvAll(fd, dst.data(), bytes);
    });
  }
  close(fd);
  echo.join();
  close(listener);
  return seconds;
}

// ---------------------------------------------------------------------------

int Main() {
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  if (absl::GetFlag(FLAGS_tune_malloc)) TuneAllocatorForLargeMessages();
  // n*n + n floats closest to model_mb * 10^6 bytes.
  int n = 1;
  while (4.0 * (double(n + 1) * (n + 1) + n + 1) <= absl::GetFlag(FLAGS_model_mb) * 1e6) ++n;

  absl::StatusOr<PstrainResult> ps = RunPstrain(n, reps);
  if (!ps.ok()) {
    std::fprintf(stderr, "pstrain transport failed: %s\n", std::string(ps.status().message()).c_str());
    return 1;
  }
  const size_t bytes = static_cast<size_t>(ps->model_bytes);
  const ReferenceResult ref = RunGrpcReferences(bytes, reps);
  const double tcp_s = RunTcp(bytes, reps);

  std::printf("model: %.2f MB (%zu floats) in %zu chunks of <= 1 MiB, 1 shard, loopback; "
              "median of %d rounds; malloc %s\n",
              bytes / 1e6, bytes / 4, ps->chunks, reps,
              absl::GetFlag(FLAGS_tune_malloc) ? "tuned" : "default");
  std::printf("%-44s %12s %14s %10s %10s\n", "variant (push + pull of the model)", "round trip",
              "model GB/s", "/ proto", "/ TCP");
  auto row = [&](const char* name, double s) {
    if (s <= 0) {
      std::printf("%-44s %12s\n", name, "FAILED");
      return;
    }
    const double gbps = bytes / s / 1e9;
    std::printf("%-44s %9.1f ms %14.3f %9.2fx %9.2fx\n", name, s * 1e3, gbps,
                ref.proto_s > 0 ? ref.proto_s / s : 0.0, tcp_s > 0 ? tcp_s / s : 0.0);
  };
  row("pstrain PsClient, push then pull", ps->sequential_s);
  row("pstrain PsClient, push + pull pipelined", ps->pipelined_s);
  row("plain gRPC, protobuf bytes stream + stream", ref.proto_s);
  row("gRPC raw ByteBuffer stream + stream", ref.raw_s);
  row("raw TCP send + receive", tcp_s);
  const bool ok = ps->sequential_s > 0 && ps->pipelined_s > 0 && ref.proto_s > 0 &&
                  ref.raw_s > 0 && tcp_s > 0;
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Main();
}
