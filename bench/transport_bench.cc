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
//   with --tls_certs=DIR (deploy/local/make-certs.sh DIR), also:
//   pstrain TLS      the pipelined pstrain variant as a cluster runs it: TLS
//                    with a client certificate required (mTLS), the worker
//                    token and the worker credential on every call, checked
//                    by the server;
//   plain gRPC TLS   the protobuf reference over the same TLS.
//
//   transport_bench [--model_mb=100] [--reps=7] [--tune_malloc=true] [--tls_certs=DIR]
//                   [--connections=1]
//
// Runs the variants round-robin (one warm-up each, then --reps rounds) so that
// load from other processes hits them alike; prints medians and ratios. See docs/BENCHMARKS.md "##
// Transport".
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
#include "common/rpc/security.h"
#include "common/status_macros.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "worker/ps_client.h"

ABSL_FLAG(int, model_mb, 100, "Model size in MB (10^6 bytes) of fp32 values");
ABSL_FLAG(int, reps, 7, "Timed repetitions per variant (median reported)");
ABSL_FLAG(int, connections, 1,
          "pstrain variants: connections for pushes, and as many for pulls "
          "(PsClient::Options::connections_per_shard)");
ABSL_FLAG(std::string, tls_certs, "",
          "Directory made by deploy/local/make-certs.sh: adds the TLS variants (empty: none)");
ABSL_FLAG(int, only, -1,
          "Run only the variant at this index of the table (0: push then pull, 1: pipelined, "
          "...) --reps times and print its median, for a profiler; -1: all, interleaved");
ABSL_FLAG(bool, tune_malloc, true,
          "Raise glibc's mmap/trim thresholds as the daemons do (TuneAllocatorForLargeMessages)");

namespace pstrain {
namespace {

constexpr char kJob[] = "bench";
constexpr char kWorker[] = "w0";
constexpr size_t kRefChunkBytes = size_t{1} << 20;

// One chunk of a reference stream: a protobuf ModelChunk whose `bytes` field
// holds the data (the plain-gRPC variant), or a raw slice pointing at it.
void EncodeReferenceChunk(bool proto, const char* data, size_t offset, size_t n, size_t total,
                          grpc::ByteBuffer* out) {
  if (proto) {
    v1::ModelChunk chunk;
    chunk.set_data(data + offset, n);
    chunk.set_offset(static_cast<int64_t>(offset));
    chunk.set_total_bytes(static_cast<int64_t>(total));
    bool own = false;
    out->Clear();
    (void)grpc::SerializationTraits<v1::ModelChunk>::Serialize(chunk, out, &own);
  } else {
    grpc::Slice slice(data + offset, n, grpc::Slice::STATIC_SLICE);
    *out = grpc::ByteBuffer(&slice, 1);
  }
}
constexpr char kPushProto[] = "/bench.Reference/PushProto";
constexpr char kPullProto[] = "/bench.Reference/PullProto";
constexpr char kPushRaw[] = "/bench.Reference/PushRaw";
constexpr char kPullRaw[] = "/bench.Reference/PullRaw";

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// One variant: a name and a round (push + pull of the model); false on error.
struct Variant {
  Variant(std::string name, std::function<bool()> round)
      : name(std::move(name)), round(std::move(round)) {}
  std::string name;
  std::function<bool()> round;
  std::vector<double> seconds;
  bool failed = false;
};

// Warms every variant up once, then runs them round-robin `reps` times, so
// that load from other processes on the machine hits all of them alike.
void TimeInterleaved(int reps, std::vector<Variant>* variants) {
  for (Variant& v : *variants) v.failed = !v.round();
  for (int i = 0; i < reps; ++i) {
    for (Variant& v : *variants) {
      if (v.failed) continue;
      const absl::Time start = absl::Now();
      v.failed = !v.round();
      v.seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    }
  }
}

// TLS for a variant: server credentials, the server's authorizer and the
// client's channel options (null members: plaintext, no tokens).
struct Security {
  std::shared_ptr<grpc::ServerCredentials> server = grpc::InsecureServerCredentials();
  std::shared_ptr<Authorizer> authorizer;
  ChannelOptions channel;
};

// mTLS and tokens from a make-certs.sh directory; the client is a worker
// (its certificate, token and the credential of `worker_id`).
absl::StatusOr<Security> SecurityFrom(const std::string& dir, const std::string& worker_id) {
  Security security;
  TlsOptions server_tls;
  server_tls.cert_file = dir + "/server.pem";
  server_tls.key_file = dir + "/server-key.pem";
  server_tls.ca_file = dir + "/ca.pem";
  server_tls.require_client_cert = true;
  PSTRAIN_ASSIGN_OR_RETURN(security.server, ServerCredentialsFor(server_tls));
  PSTRAIN_ASSIGN_OR_RETURN(security.authorizer, Authorizer::FromTokenFile(dir + "/tokens"));
  TlsOptions client_tls;
  client_tls.cert_file = dir + "/worker.pem";
  client_tls.key_file = dir + "/worker-key.pem";
  client_tls.ca_file = dir + "/ca.pem";
  PSTRAIN_ASSIGN_OR_RETURN(security.channel.credentials, ChannelCredentialsFor(client_tls));
  auto identity = std::make_shared<CallIdentity>();
  PSTRAIN_ASSIGN_OR_RETURN(identity->token, ReadTokenFile(dir + "/worker.token"));
  identity->set_worker_credential(security.authorizer->IssueWorkerCredential(worker_id));
  security.channel.identity = std::move(identity);
  return security;
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

// A ParameterShard behind ShardServices on 127.0.0.1, and a PsClient.
class PstrainBench {
  static ShardServices::Options ServicesOptions(bool tune_allocator,
                                                std::shared_ptr<Authorizer> authorizer) {
    ShardServices::Options options;
    options.tune_allocator = tune_allocator;
    options.authorizer = std::move(authorizer);
    return options;
  }

 public:
  // `tune_allocator`: see ShardServices::Options.
  PstrainBench(bool tune_allocator, Security security)
      : security_(std::move(security)),
        services_(&shard_, ServicesOptions(tune_allocator, security_.authorizer)) {}

  absl::Status Start(int n) {
    const v1::JobSpec job = SquareModelJob(n);
    PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph, BuildModelGraph(job.model()));
    PSTRAIN_ASSIGN_OR_RETURN(plan_, PlanChunks(graph, 1, kDefaultChunkBytes));
    ShardJobConfig config;
    config.job_id = kJob;
    config.spec = job;
    config.members = {kWorker};
    config.chunk_bytes = kDefaultChunkBytes;  // The plan above: 1 MiB chunks, no tapered ends.
    std::vector<v1::ChunkValues> initial;
    for (const ChunkInfo& c : plan_.chunks) {
      v1::ChunkValues v;
      v.set_chunk_id(c.id);
      v.mutable_values()->Resize(static_cast<int>(c.count), 0.0f);
      initial.push_back(std::move(v));
    }
    PSTRAIN_RETURN_IF_ERROR(shard_.ConfigureJob(config, initial));
    initial.clear();

    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", security_.server, &port);
    services_.Register(&builder);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) return absl::InternalError("server did not start");

    PsClient::Options options;
    options.shard_addresses = {"127.0.0.1:" + std::to_string(port)};
    options.job_id = kJob;
    options.worker_id = kWorker;
    options.generation = 1;
    options.channel = security_.channel;
    options.connections_per_shard = absl::GetFlag(FLAGS_connections);
    options.pace_pushes = false;  // As the worker in average mode: shards pace sync jobs only.
    PSTRAIN_ASSIGN_OR_RETURN(client_, PsClient::Create(options, plan_));

    // The worker's model: one flat buffer, chunks point into it.
    params_.resize(static_cast<size_t>(graph.trainable_params + graph.non_trainable_params));
    pulled_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) params_[i] = static_cast<float>(i % 1000) * 1e-3f;
    std::vector<int64_t> base(graph.params.size());
    for (size_t p = 1; p < graph.params.size(); ++p) {
      base[p] = base[p - 1] + graph.params[p - 1].shape.num_elements();
    }
    for (const ChunkInfo& c : plan_.chunks) {
      refs_.push_back({c.id, params_.data() + base[c.param] + c.offset});
      dests_.push_back({c.id, pulled_.data() + base[c.param] + c.offset});
    }
    return absl::OkStatus();
  }
  ~PstrainBench() {
    if (server_ != nullptr) server_->Shutdown(DeadlineFromNow(absl::Seconds(5)));
  }

  // Push round r, wait, then pull round r + 1.
  bool Sequential() {
    Poison();
    auto push = client_->Push(v1::ChunkHeader::KIND_PARAMETERS, round_, 0, refs_);
    if (!Check(push->Wait())) return false;
    auto pull = client_->Pull(v1::ChunkHeader::KIND_PARAMETERS, round_ + 1, 0, dests_);
    ++round_;
    return Check(pull->Wait()) && Verify();
  }
  // The pull of round r + 1 is issued with the push of round r: each chunk
  // comes back as soon as its push has been applied.
  bool Pipelined() {
    Poison();
    auto pull = client_->Pull(v1::ChunkHeader::KIND_PARAMETERS, round_ + 1, 0, dests_);
    auto push = client_->Push(v1::ChunkHeader::KIND_PARAMETERS, round_, 0, refs_);
    const bool pushed = Check(push->Wait());  // Both waits run, whatever the first says.
    const bool pulled = Check(pull->Wait());
    ++round_;
    return pushed && pulled && Verify();
  }

  int64_t model_bytes() const { return static_cast<int64_t>(params_.size() * sizeof(float)); }
  size_t chunks() const { return plan_.chunks.size(); }

 private:
  bool Check(const absl::Status& s) {
    if (!s.ok()) std::fprintf(stderr, "pstrain: %s\n", std::string(s.message()).c_str());
    return s.ok();
  }
  // Spot check (a full compare would add a pass over 100 MB to the timing).
  // Poison() first sets the values it reads to what no pull writes, so that
  // a pull that wrote nothing fails; clearing all 100 MB instead cost 5 ms a
  // round, which no reference variant pays (they flip one byte).
  static constexpr size_t kVerifyStride = 4099;
  void Poison() {
    for (size_t i = 0; i < pulled_.size(); i += kVerifyStride) pulled_[i] = -1.0f;
    pulled_.back() = -1.0f;
  }
  bool Verify() const {
    for (size_t i = 0; i < params_.size(); i += kVerifyStride) {
      if (pulled_[i] != params_[i]) {
        std::fprintf(stderr, "pstrain: pulled value %zu differs\n", i);
        return false;
      }
    }
    return pulled_.back() == params_.back();
  }

  ChunkPlan plan_;
  ParameterShard shard_{{.shard_index = 0}};
  const Security security_;
  ShardServices services_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<PsClient> client_;
  std::vector<float> params_, pulled_;
  std::vector<PsClient::ChunkRef> refs_;
  std::vector<PsClient::ChunkDest> dests_;
  int64_t round_ = 0;
};

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
      EncodeReferenceChunk(proto_, store_, offset_, n, bytes_, &buffer_);
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
    EncodeReferenceChunk(proto_, src_, offset_, n, bytes_, &buffer_);
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

// The reference service on its own server, and a generic client.
class ReferenceBench {
 public:
  ReferenceBench(size_t bytes, Security security)
      : security_(std::move(security)), service_(bytes), src_(bytes), dst_(bytes) {
    for (size_t i = 0; i < bytes; ++i) src_[i] = static_cast<char>(i * 131);
  }
  bool Start() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", security_.server, &port);
    ConfigureServerBuilder(&builder);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) return false;
    stub_ = std::make_unique<grpc::GenericStub>(
        CreateChannel("127.0.0.1:" + std::to_string(port), security_.channel));
    return true;
  }
  ~ReferenceBench() {
    if (server_ != nullptr) server_->Shutdown(DeadlineFromNow(absl::Seconds(5)));
  }

  bool Proto() { return Round(kPushProto, kPullProto); }
  bool Raw() { return Round(kPushRaw, kPullRaw); }

 private:
  bool Round(const char* push, const char* pull) {
    dst_[0] = static_cast<char>(~src_[0]);
    return ReferenceCall::Run(stub_.get(), push, src_.data(), nullptr, src_.size()) &&
           ReferenceCall::Run(stub_.get(), pull, nullptr, dst_.data(), dst_.size()) &&
           dst_[0] == src_[0] && dst_.back() == src_.back();
  }

  const Security security_;
  ReferenceService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::GenericStub> stub_;
  std::vector<char> src_, dst_;
};

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

// A 127.0.0.1 connection to an echo thread: each round sends the model
// bytes and receives them back.
class TcpBench {
 public:
  explicit TcpBench(size_t bytes) : bytes_(bytes), src_(bytes, 2), dst_(bytes, 0) {}
  bool Start() {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (listener_ < 0 || bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listener_, 1) != 0 ||
        getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return false;
    }
    echo_ = std::thread([this] {
      const int fd = accept(listener_, nullptr, nullptr);
      if (fd < 0) return;
      std::vector<char> store(bytes_, 1);
      while (RecvAll(fd, store.data(), bytes_) && SendAll(fd, store.data(), bytes_)) {
      }
      close(fd);
    });
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    return fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~TcpBench() {
    if (fd_ >= 0) close(fd_);  // Ends the echo loop.
    if (echo_.joinable()) echo_.join();
    if (listener_ >= 0) close(listener_);
  }
  bool Round() { return SendAll(fd_, src_.data(), bytes_) && RecvAll(fd_, dst_.data(), bytes_); }

 private:
  const size_t bytes_;
  std::vector<char> src_, dst_;
  int listener_ = -1, fd_ = -1;
  std::thread echo_;
};

// ---------------------------------------------------------------------------

int Main() {
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  if (absl::GetFlag(FLAGS_tune_malloc)) TuneAllocatorForLargeMessages();
  // n*n + n floats closest to model_mb * 10^6 bytes from below.
  int n = 1;
  while (4.0 * (double(n + 1) * (n + 1) + n + 1) <= absl::GetFlag(FLAGS_model_mb) * 1e6) ++n;

  PstrainBench ps(absl::GetFlag(FLAGS_tune_malloc), Security());
  if (absl::Status s = ps.Start(n); !s.ok()) {
    std::fprintf(stderr, "pstrain setup failed: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const size_t bytes = static_cast<size_t>(ps.model_bytes());
  ReferenceBench ref(bytes, Security());
  TcpBench tcp(bytes);
  if (!ref.Start() || !tcp.Start()) {
    std::fprintf(stderr, "reference setup failed\n");
    return 1;
  }
  // The TLS variants, when certificates are given.
  std::unique_ptr<PstrainBench> ps_tls;
  std::unique_ptr<ReferenceBench> ref_tls;
  if (const std::string certs = absl::GetFlag(FLAGS_tls_certs); !certs.empty()) {
    absl::StatusOr<Security> security = SecurityFrom(certs, kWorker);
    if (!security.ok()) {
      std::fprintf(stderr, "--tls_certs: %s\n", std::string(security.status().message()).c_str());
      return 1;
    }
    ps_tls = std::make_unique<PstrainBench>(absl::GetFlag(FLAGS_tune_malloc), *security);
    ref_tls = std::make_unique<ReferenceBench>(bytes, *security);
    if (absl::Status s = ps_tls->Start(n); !s.ok() || !ref_tls->Start()) {
      std::fprintf(stderr, "TLS setup failed: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  std::vector<Variant> variants = {
      {"pstrain PsClient, push then pull", [&] { return ps.Sequential(); }},
      {"pstrain PsClient, push + pull pipelined", [&] { return ps.Pipelined(); }},
      {"plain gRPC, protobuf bytes stream + stream", [&] { return ref.Proto(); }},
      {"gRPC raw ByteBuffer stream + stream", [&] { return ref.Raw(); }},
      {"raw TCP send + receive", [&] { return tcp.Round(); }},
  };
  if (ps_tls != nullptr) {
    variants.emplace_back("pstrain pipelined, TLS + mTLS + tokens",
                          [&] { return ps_tls->Pipelined(); });
    variants.emplace_back("plain gRPC protobuf, TLS + mTLS", [&] { return ref_tls->Proto(); });
  }
  if (const int only = absl::GetFlag(FLAGS_only); only >= 0) {
    if (only >= static_cast<int>(variants.size())) {
      std::fprintf(stderr, "--only=%d: there are %zu variants\n", only, variants.size());
      return 2;
    }
    std::vector<Variant> one = {variants[only]};
    TimeInterleaved(reps, &one);
    if (one[0].failed) return 1;
    std::printf("%-44s %9.1f ms %12.3f GB/s (alone, median of %d)\n", one[0].name.c_str(),
                Median(one[0].seconds) * 1e3, bytes / Median(one[0].seconds) / 1e9, reps);
    return 0;
  }
  TimeInterleaved(reps, &variants);

  std::printf(
      "model: %.2f MB (%zu floats) in %zu chunks of <= 1 MiB, 1 shard, loopback; "
      "median of %d interleaved rounds; malloc %s\n",
      bytes / 1e6, bytes / 4, ps.chunks(), reps,
      absl::GetFlag(FLAGS_tune_malloc) ? "tuned" : "default");
  std::printf("%-44s %12s %12s %9s %9s\n", "variant (push + pull of the model)", "round trip",
              "model GB/s", "/ proto", "/ TCP");
  // "/ proto" compares with plain gRPC over the same transport: plaintext
  // for the plaintext variants, TLS for the TLS ones.
  std::vector<double> median(variants.size(), -1);
  for (size_t i = 0; i < variants.size(); ++i) {
    if (!variants[i].failed) median[i] = Median(variants[i].seconds);
  }
  const double tcp_s = median[4];
  bool ok = true;
  for (size_t i = 0; i < variants.size(); ++i) {
    const double proto_s = i >= 5 ? median.back() : median[2];
    if (median[i] <= 0) {
      std::printf("%-44s %12s\n", variants[i].name.c_str(), "FAILED");
      ok = false;
      continue;
    }
    std::printf("%-44s %9.1f ms %12.3f %8.2fx %8.2fx\n", variants[i].name.c_str(), median[i] * 1e3,
                bytes / median[i] / 1e9, proto_s > 0 ? proto_s / median[i] : 0.0,
                tcp_s > 0 ? tcp_s / median[i] : 0.0);
  }
  if (ps_tls != nullptr && median[1] > 0 && median[5] > 0) {
    std::printf(
        "TLS + mTLS + tokens cost: pstrain pipelined throughput %.2fx of plaintext (%.0f%% "
        "less)\n",
        median[1] / median[5], 100.0 * (1.0 - median[1] / median[5]));
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Main();
}
