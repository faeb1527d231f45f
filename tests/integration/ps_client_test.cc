// PsClient (worker/) against real ParameterService shards (server/) on
// 127.0.0.1, in one process: round trips through two shards, a sync step
// across two clients, deadlines, unreachable shards and error propagation.
// Lives in tests/integration/ because it needs both the worker and the server
// libraries.
#include "worker/ps_client.h"

#include <arpa/inet.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_callback.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "common/rpc/channel.h"
#include "common/rpc/gradient_codec.h"
#include "common/rpc/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "tests/testing/shard_fixtures.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

// Polls `condition` every millisecond until it holds or `timeout` passes.
bool WaitUntil(const std::function<bool()>& condition, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!condition()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}


constexpr char kJob[] = "job-1";
constexpr int64_t kChunkBytes = 4096;  // 1024 floats.

// input [300] -> dense 50 -> softmax cross-entropy: 15050 parameters, 16 chunks.
v1::JobSpec SmallJob(v1::ConsistencyMode mode) {
  return ::pstrain::testing::DenseJob("small", 300, 50, 11, mode);
}

class Cluster {
 public:
  Cluster(v1::ConsistencyMode mode, int num_shards, std::vector<std::string> members,
          ShardServices::Options service_options = {}, v1::CompressionSpec pull_compression = {}) {
    spec_ = SmallJob(mode);
    *spec_.mutable_pull_compression() = pull_compression;
    graph_ = *BuildModelGraph(spec_.model());
    plan_ = *PlanChunks(graph_, num_shards, kChunkBytes);
    initial_ = InitialParameterValues(graph_);
    for (int s = 0; s < num_shards; ++s) {
      auto shard = std::make_unique<ParameterShard>(ParameterShard::Options{.shard_index = s});
      auto services = std::make_unique<ShardServices>(shard.get(), service_options);
      grpc::ServerBuilder builder;
      int port = 0;
      builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
      services->Register(&builder);
      servers_.push_back(builder.BuildAndStart());
      addresses_.push_back("127.0.0.1:" + std::to_string(port));
      ShardJobConfig config;
      config.job_id = kJob;
      config.spec = spec_;
      config.num_shards = num_shards;
      config.chunk_bytes = kChunkBytes;
      config.members = members;
      config.generation = 1;
      EXPECT_OK(shard->ConfigureJob(config, ::pstrain::testing::InitialChunks(graph_, plan_, s)));
      shards_.push_back(std::move(shard));
      services_.push_back(std::move(services));
    }
  }
  ~Cluster() {
    for (auto& server : servers_) server->Shutdown(DeadlineFromNow(absl::Seconds(5)));
  }

  std::unique_ptr<PsClient> Client(const std::string& worker,
                                   absl::Duration timeout = absl::Seconds(20),
                                   v1::CompressionSpec compression = {}, int connections = 1) {
    PsClient::Options options;
    options.compression = compression;
    options.connections_per_shard = connections;
    options.shard_addresses = addresses_;
    options.job_id = kJob;
    options.worker_id = worker;
    options.generation = 1;
    options.rpc_timeout = timeout;
    auto client = PsClient::Create(options, plan_);
    EXPECT_OK(client);
    return *std::move(client);
  }

  // One buffer per chunk.
  std::vector<std::vector<float>> Buffers(float fill) const {
    std::vector<std::vector<float>> out;
    for (const ChunkInfo& c : plan_.chunks) out.emplace_back(c.count, fill);
    return out;
  }
  std::vector<float> Initial(int id) const {
    const ChunkInfo& c = plan_.chunks[id];
    return std::vector<float>(initial_[c.param].begin() + c.offset,
                              initial_[c.param].begin() + c.offset + c.count);
  }
  const ChunkPlan& plan() const { return plan_; }
  const std::vector<std::string>& addresses() const { return addresses_; }
  ParameterShard& shard(int s) { return *shards_[s]; }
  int num_shards() const { return static_cast<int>(shards_.size()); }

 private:
  v1::JobSpec spec_;
  ModelGraph graph_;
  ChunkPlan plan_;
  std::vector<std::vector<float>> initial_;
  std::vector<std::unique_ptr<ParameterShard>> shards_;
  std::vector<std::unique_ptr<ShardServices>> services_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::string> addresses_;
};

std::vector<PsClient::ChunkRef> Refs(const std::vector<std::vector<float>>& buffers) {
  std::vector<PsClient::ChunkRef> refs;
  for (size_t id = 0; id < buffers.size(); ++id) {
    refs.push_back({static_cast<int>(id), buffers[id].data()});
  }
  return refs;
}

std::vector<PsClient::ChunkDest> Dests(std::vector<std::vector<float>>& buffers) {
  std::vector<PsClient::ChunkDest> dests;
  for (size_t id = 0; id < buffers.size(); ++id) {
    dests.push_back({static_cast<int>(id), buffers[id].data()});
  }
  return dests;
}

// A port that was free a moment ago and has nothing listening on it.
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

TEST(PsClientTest, PullsTheInitialModelFromTwoShards) {
  Cluster cluster(v1::CONSISTENCY_ASYNC, 2, {"w0"});
  ASSERT_GT(cluster.plan().by_shard[0].size(), 0u);
  ASSERT_GT(cluster.plan().by_shard[1].size(), 0u);
  auto client = cluster.Client("w0");
  std::vector<std::vector<float>> pulled = cluster.Buffers(-1.0f);
  auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, Dests(pulled));
  ASSERT_OK(pull->Wait());
  EXPECT_EQ(pull->version(), 0);
  for (size_t id = 0; id < pulled.size(); ++id) EXPECT_EQ(pulled[id], cluster.Initial(id)) << id;
}

TEST(PsClientTest, AveragePushThenPullIsBitExactThroughTwoShards) {
  Cluster cluster(v1::CONSISTENCY_AVERAGE, 2, {"w0"});
  auto client = cluster.Client("w0");
  std::vector<std::vector<float>> params = cluster.Buffers(0.0f);
  for (size_t id = 0; id < params.size(); ++id) {
    for (size_t i = 0; i < params[id].size(); ++i) {
      params[id][i] = 1e-3f * static_cast<float>(i) - 0.7f * static_cast<float>(id) + 1e-7f;
    }
  }
  auto push = client->Push(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, Refs(params));
  ASSERT_OK(push->Wait());
  EXPECT_EQ(push->version(), 1);
  std::vector<std::vector<float>> pulled = cluster.Buffers(0.0f);
  auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 1, 0, Dests(pulled));
  ASSERT_OK(pull->Wait());
  EXPECT_EQ(pull->version(), 1);
  EXPECT_EQ(pulled, params);
}

TEST(PsClientTest, PullIssuedBeforeThePushStreamsAsChunksArrive) {
  Cluster cluster(v1::CONSISTENCY_AVERAGE, 2, {"w0"});
  auto client = cluster.Client("w0");
  std::vector<std::vector<float>> params = cluster.Buffers(2.5f);
  std::vector<std::vector<float>> pulled = cluster.Buffers(0.0f);
  auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 1, 0, Dests(pulled));
  auto push = client->Push(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, Refs(params));
  ASSERT_OK(push->Wait());
  ASSERT_OK(pull->Wait());
  EXPECT_EQ(pulled, params);
}

// One sync step of two clients: both pull version 1, which needs both
// pushes, and get the initial weights minus 0.5 times the mean gradient,
// bit for bit.
void ExpectSyncStepAveragesTheGradients(Cluster& cluster, PsClient& c0, PsClient& c1) {
  std::vector<std::vector<float>> g0 = cluster.Buffers(0.0f), g1 = cluster.Buffers(0.0f);
  for (size_t id = 0; id < g0.size(); ++id) {
    for (size_t i = 0; i < g0[id].size(); ++i) {
      g0[id][i] = 0.01f * static_cast<float>(i % 17) - 0.05f;
      g1[id][i] = -0.003f * static_cast<float>(id + i % 5);
    }
  }
  std::vector<std::vector<float>> p0 = cluster.Buffers(0.0f), p1 = cluster.Buffers(0.0f);
  auto pull0 = c0.Pull(v1::ChunkHeader::KIND_PARAMETERS, 1, 0, Dests(p0));
  auto pull1 = c1.Pull(v1::ChunkHeader::KIND_PARAMETERS, 1, 0, Dests(p1));
  std::thread second(
      [&] { EXPECT_OK(c1.Push(v1::ChunkHeader::KIND_GRADIENT, 0, 1, Refs(g1))->Wait()); });
  ASSERT_OK(c0.Push(v1::ChunkHeader::KIND_GRADIENT, 0, 1, Refs(g0))->Wait());
  second.join();
  ASSERT_OK(pull0->Wait());
  ASSERT_OK(pull1->Wait());
  EXPECT_EQ(pull0->version(), 1);
  for (size_t id = 0; id < p0.size(); ++id) {
    const std::vector<float> w = cluster.Initial(id);
    for (size_t i = 0; i < w.size(); ++i) {
      const float mean = (g0[id][i] + g1[id][i]) * 0.5f;
      ASSERT_EQ(p0[id][i], w[i] - 0.5f * mean) << "chunk " << id << " element " << i;
    }
  }
  EXPECT_EQ(p0, p1);
}

TEST(PsClientTest, SyncStepAcrossTwoClientsAveragesTheGradients) {
  Cluster cluster(v1::CONSISTENCY_SYNC, 2, {"w0", "w1"});
  ExpectSyncStepAveragesTheGradients(cluster, *cluster.Client("w0"), *cluster.Client("w1"));
}

// Established TCP connections on this machine to 127.0.0.1:`port`, IPv4 or
// v4-mapped IPv6 (gRPC's sockets are dual-stack): /proc/net/tcp{,6} rows
// whose remote address is that and whose state is 01.
int EstablishedConnectionsTo(int port) {
  int count = 0;
  for (const auto& [file, host] : {std::pair<const char*, const char*>{"/proc/net/tcp", "0100007F"},
                                   {"/proc/net/tcp6", "0000000000000000FFFF00000100007F"}}) {
    std::ifstream tcp(file);
    std::string line;
    std::getline(tcp, line);  // The header.
    const std::string remote = absl::StrFormat("%s:%04X", host, port);
    while (std::getline(tcp, line)) {
      std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (fields.size() > 3 && fields[2] == remote && fields[3] == "01") ++count;
    }
  }
  return count;
}

// Three connections per shard for pushes and three for pulls: a sync step
// of two workers gives the bits of the step above, and each client really
// holds six connections to each shard.
TEST(PsClientTest, ThreeConnectionsPerShardCarryTheSameSyncStep) {
  Cluster cluster(v1::CONSISTENCY_SYNC, 2, {"w0", "w1"});
  ASSERT_GE(cluster.plan().by_shard[0].size(), 3u);
  ASSERT_GE(cluster.plan().by_shard[1].size(), 3u);
  auto c0 = cluster.Client("w0", absl::Seconds(20), {}, /*connections=*/3);
  auto c1 = cluster.Client("w1", absl::Seconds(20), {}, /*connections=*/3);
  ExpectSyncStepAveragesTheGradients(cluster, *c0, *c1);
  for (const std::string& address : cluster.addresses()) {
    const int port = std::stoi(address.substr(address.rfind(':') + 1));
    EXPECT_EQ(EstablishedConnectionsTo(port), 2 * (3 + 3)) << address;
  }
}

// Pull compression through two shards: a client that keeps what it holds
// (HeldValues) gets 1-bit deltas after its first pull, and what they add up
// to is, bit for bit, what a client holding nothing pulls whole, in about
// a thirtieth of the bytes.
TEST(PsClientTest, CompressedPullsRebuildWhatAWholePullGetsInFewerBytes) {
  v1::CompressionSpec onebit;
  onebit.set_method(v1::CompressionSpec::COMPRESSION_ONEBIT);
  Cluster cluster(v1::CONSISTENCY_SYNC, 2, {"w0"}, {}, onebit);
  auto client = cluster.Client("w0");
  std::vector<std::vector<float>> held_values = cluster.Buffers(0.0f);
  std::vector<PsClient::HeldValues> held(held_values.size());
  auto held_dests = [&] {
    std::vector<PsClient::ChunkDest> dests = Dests(held_values);
    for (PsClient::ChunkDest& d : dests) d.held = &held[d.chunk_id];
    return dests;
  };
  ASSERT_OK(client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, held_dests())->Wait());
  for (const PsClient::HeldValues& h : held) {
    EXPECT_EQ(h.version, 0);
    EXPECT_NE(h.epoch, 0u);
  }
  std::vector<std::vector<float>> g = cluster.Buffers(0.0f);
  int64_t whole_bytes = 0, delta_bytes = 0;
  for (int step = 0; step < 5; ++step) {
    for (size_t id = 0; id < g.size(); ++id) {
      for (size_t i = 0; i < g[id].size(); ++i) {
        g[id][i] = 0.01f * static_cast<float>((i + step) % 17) - 0.05f;
      }
    }
    ASSERT_OK(client->Push(v1::ChunkHeader::KIND_GRADIENT, step, step + 1, Refs(g))->Wait());
    int64_t before = 0;
    for (int s = 0; s < cluster.num_shards(); ++s) before += cluster.shard(s).stats().pull_bytes;
    ASSERT_OK(client->Pull(v1::ChunkHeader::KIND_PARAMETERS, step + 1, step + 1, held_dests())
                    ->Wait());
    int64_t middle = 0;
    for (int s = 0; s < cluster.num_shards(); ++s) middle += cluster.shard(s).stats().pull_bytes;
    std::vector<std::vector<float>> whole = cluster.Buffers(0.0f);
    ASSERT_OK(client->Pull(v1::ChunkHeader::KIND_PARAMETERS, step + 1, step + 1, Dests(whole))
                    ->Wait());
    int64_t after = 0;
    for (int s = 0; s < cluster.num_shards(); ++s) after += cluster.shard(s).stats().pull_bytes;
    delta_bytes += middle - before;
    whole_bytes += after - middle;
    for (size_t id = 0; id < whole.size(); ++id) {
      ASSERT_EQ(held[id].version, step + 1);
      ASSERT_EQ(std::memcmp(whole[id].data(), held_values[id].data(), whole[id].size() * 4), 0)
          << "chunk " << id << " after step " << step;
    }
  }
  // n/8 + 4 bytes a chunk of n: about 31x for these chunks, 18x for the bias.
  EXPECT_GT(whole_bytes, 25 * delta_bytes) << whole_bytes << " against " << delta_bytes;

  // A pull of the master values (a run's end): what checkpoints hold, and
  // no delta base any more.
  ASSERT_OK(client
                  ->Pull(v1::ChunkHeader::KIND_PARAMETERS, 5, 5, held_dests(), 0,
                         /*master=*/true)
                  ->Wait());
  for (int s = 0; s < cluster.num_shards(); ++s) {
    absl::StatusOr<std::vector<v1::ChunkValues>> chunks = cluster.shard(s).ReadChunks(kJob);
    ASSERT_OK(chunks);
    for (const v1::ChunkValues& c : *chunks) {
      EXPECT_EQ(held[c.chunk_id()].version, -1);
      ASSERT_EQ(std::memcmp(c.values().data(), held_values[c.chunk_id()].data(),
                            held_values[c.chunk_id()].size() * 4),
                0)
          << "chunk " << c.chunk_id();
    }
  }
}

// Compressed pushes: the client encodes on its own thread, keeps the
// error-feedback residual across pushes, and the shards apply exactly what
// a reference encoder fed the same gradients decodes to.
TEST(PsClientTest, CompressedAsyncPushesApplyTheDecodedGradientsWithErrorFeedback) {
  for (auto method :
       {v1::CompressionSpec::COMPRESSION_TOPK, v1::CompressionSpec::COMPRESSION_ONEBIT,
        v1::CompressionSpec::COMPRESSION_BF16}) {
    SCOPED_TRACE(v1::CompressionSpec::Method_Name(method));
    Cluster cluster(v1::CONSISTENCY_ASYNC, 2, {"w0"});
    v1::CompressionSpec spec;
    spec.set_method(method);
    if (method == v1::CompressionSpec::COMPRESSION_TOPK) spec.set_topk_ratio(0.05f);
    auto client = cluster.Client("w0", absl::Seconds(20), spec);
    GradientEncoder reference(spec, cluster.plan());
    std::vector<std::vector<float>> expected;
    for (size_t id = 0; id < cluster.plan().chunks.size(); ++id) {
      expected.push_back(cluster.Initial(id));
    }
    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 0.1f);
    for (int step = 0; step < 3; ++step) {
      std::vector<std::vector<float>> g = cluster.Buffers(0.0f);
      for (auto& chunk : g) {
        for (float& v : chunk) v = dist(rng);
      }
      auto push = client->Push(v1::ChunkHeader::KIND_GRADIENT, step, step + 1, Refs(g));
      ASSERT_OK(push->Wait());
      for (size_t id = 0; id < g.size(); ++id) {
        EncodedGradient e;
        ASSERT_OK(reference.Encode(static_cast<int>(id), g[id], &e));
        v1::ChunkHeader h;
        h.set_num_elements(static_cast<int64_t>(g[id].size()));
        h.set_dtype(e.dtype);
        h.set_encoding(e.encoding);
        h.set_encoded_count(e.encoded_count);
        std::vector<float> decoded(g[id].size());
        ASSERT_OK(DecodeGradient(h, e.bytes.data(), e.bytes.size(), absl::MakeSpan(decoded)));
        for (size_t i = 0; i < decoded.size(); ++i) expected[id][i] -= 0.5f * decoded[i];
      }
    }
    std::vector<std::vector<float>> pulled = cluster.Buffers(0.0f);
    auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 3, 0, Dests(pulled));
    ASSERT_OK(pull->Wait());
    for (size_t id = 0; id < pulled.size(); ++id) {
      for (size_t i = 0; i < pulled[id].size(); ++i) {
        ASSERT_FLOAT_EQ(pulled[id][i], expected[id][i]) << "chunk " << id << " element " << i;
      }
    }
  }
}

// A shard stand-in that paces one push by hand: it credits the stream with
// `first_credit` frames before reading any (0: no credit until the test
// says), counts the frames that arrive, raises the credit when the test
// says, and replies version 7.
class HandPacedShard final : public grpc::CallbackGenericService {
 public:
  explicit HandPacedShard(int64_t first_credit) : first_credit_(first_credit) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterCallbackGenericService(this);
    server_ = builder.BuildAndStart();
  }
  ~HandPacedShard() override { server_->Shutdown(DeadlineFromNow(absl::Seconds(5))); }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  int frames() {
    absl::MutexLock lock(&mu_);
    return frames_;
  }
  void Credit(int64_t total) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](HandPacedShard* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(s->mu_) {
          return s->reactor_ == nullptr || !s->reactor_->writing();
        },
        this));
    if (reactor_ != nullptr && !reactor_->replied()) reactor_->Send(total);  // Else it is over.
  }

 private:
  class Reactor final : public grpc::ServerGenericBidiReactor {
   public:
    Reactor(HandPacedShard* owner, int64_t first_credit) : owner_(owner) {
      if (first_credit > 0) {
        Send(first_credit);  // Before the first read: the client learns its credit first.
      } else {
        reading_ = true;
        StartRead(&in_);
      }
    }
    // Under owner_->mu_ (or before the reactor is shared).
    bool writing() const { return writing_; }
    bool replied() const { return replied_; }
    void Send(int64_t credit) {
      writing_ = true;
      v1::ChunkHeader header;
      header.set_credit(credit);
      EXPECT_OK(EncodeFrame(header, nullptr, 0, &credit_));
      StartWrite(&credit_);
    }
    void OnWriteDone(bool) override {
      absl::MutexLock lock(&owner_->mu_);
      writing_ = false;
      if (!reading_) {
        reading_ = true;
        StartRead(&in_);
      }
      if (std::exchange(finish_after_write_, false)) Reply();
    }
    void OnReadDone(bool ok) override {
      absl::MutexLock lock(&owner_->mu_);
      if (ok) {
        ++owner_->frames_;
        StartRead(&in_);
      } else if (writing_) {
        finish_after_write_ = true;
      } else {
        Reply();
      }
    }
    void OnDone() override {
      absl::MutexLock lock(&owner_->mu_);
      owner_->reactor_ = nullptr;
      delete this;
    }

   private:
    void Reply() ABSL_EXCLUSIVE_LOCKS_REQUIRED(owner_->mu_) {
      replied_ = true;
      v1::ChunkHeader header;
      header.set_version(7);
      EXPECT_OK(EncodeFrame(header, nullptr, 0, &reply_));
      StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
    }
    HandPacedShard* const owner_;
    grpc::ByteBuffer in_, credit_, reply_;
    bool reading_ = false;             // Callbacks of one stream: one at a time here.
    bool writing_ = false;             // Guarded by owner_->mu_ once shared.
    bool finish_after_write_ = false;  // Guarded by owner_->mu_.
    bool replied_ = false;             // Guarded by owner_->mu_.
  };

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    absl::MutexLock lock(&mu_);
    reactor_ = new Reactor(this, first_credit_);
    return reactor_;
  }

  const int64_t first_credit_;
  absl::Mutex mu_;
  int frames_ ABSL_GUARDED_BY(mu_) = 0;
  Reactor* reactor_ ABSL_GUARDED_BY(mu_) = nullptr;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// Worker w0's client options for kJob on the one shard at `address`.
PsClient::Options OneShardOptions(const std::string& address) {
  PsClient::Options options;
  options.shard_addresses = {address};
  options.job_id = kJob;
  options.worker_id = "w0";
  options.generation = 1;
  options.rpc_timeout = absl::Seconds(20);
  return options;
}

TEST(PsClientTest, APushSendsNoFrameBeyondTheShardsCredit) {
  // fc1/weight: 1536 x 1024 floats in 24 chunks of 256 KiB (each larger
  // than HTTP/2's first window, so none is sent before the first credit),
  // and fc1/bias: 25 frames for the one shard.
  const v1::JobSpec spec =
      ::pstrain::testing::DenseJob("paced", 1536, 1024, 3, v1::CONSISTENCY_SYNC);
  const ModelGraph graph = *BuildModelGraph(spec.model());
  const ChunkPlan plan = *PlanChunks(graph, 1, 256 << 10);
  const int total = static_cast<int>(plan.chunks.size());
  ASSERT_EQ(total, 25);
  HandPacedShard shard(/*first_credit=*/2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PsClient> client,
                       PsClient::Create(OneShardOptions(shard.address()), plan));
  std::vector<std::vector<float>> gradients;
  for (const ChunkInfo& c : plan.chunks) gradients.emplace_back(c.count, 0.25f);
  std::unique_ptr<PendingOp> push =
      client->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 1, Refs(gradients));
  // The frames the credit allows arrive; the rest are held at the credit.
  ASSERT_TRUE(WaitUntil([&] { return shard.frames() >= 2; }, absl::Seconds(10)));
  EXPECT_LT(shard.frames(), total);
  shard.Credit(total);
  ASSERT_OK(push->Wait());
  EXPECT_EQ(shard.frames(), total);
  EXPECT_EQ(push->version(), 7);
}

// A paced stream carries its first frame and then waits for the shard's
// first credit. Before, it sent freely until that credit came: frames
// smaller than HTTP/2's window all went into the socket at once, and a
// step's second push call was never held back (docs/BENCHMARKS.md, "The
// rest of a push call went out before the shard could pace it").
TEST(PsClientTest, APacedPushSendsOnlyItsFirstFrameBeforeTheShardsFirstCredit) {
  // fc1/weight: 64 x 64 floats in 16 chunks of 1 KiB, and fc1/bias: 17
  // frames for the one shard, all of them within HTTP/2's first window.
  const v1::JobSpec spec = ::pstrain::testing::DenseJob("paced", 64, 64, 3, v1::CONSISTENCY_SYNC);
  const ModelGraph graph = *BuildModelGraph(spec.model());
  const ChunkPlan plan = *PlanChunks(graph, 1, 1 << 10);
  const int total = static_cast<int>(plan.chunks.size());
  ASSERT_EQ(total, 17);
  std::vector<std::vector<float>> gradients;
  for (const ChunkInfo& c : plan.chunks) gradients.emplace_back(c.count, 0.25f);
  {
    HandPacedShard shard(/*first_credit=*/0);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PsClient> client,
                         PsClient::Create(OneShardOptions(shard.address()), plan));
    std::unique_ptr<PendingOp> push =
        client->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 1, Refs(gradients));
    ASSERT_TRUE(WaitUntil([&] { return shard.frames() >= 1; }, absl::Seconds(10)));
    EXPECT_EQ(shard.frames(), 1);  // Only the first, until the first credit.
    shard.Credit(total);
    ASSERT_OK(push->Wait());
    EXPECT_EQ(shard.frames(), total);
  }
  // Not paced (pace_pushes false: async jobs), the client waits for nothing.
  HandPacedShard shard(/*first_credit=*/0);
  PsClient::Options options = OneShardOptions(shard.address());
  options.pace_pushes = false;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PsClient> client, PsClient::Create(options, plan));
  ASSERT_OK(client->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 1, Refs(gradients))->Wait());
  EXPECT_EQ(shard.frames(), total);
}

// Two pushes issued back to back (as a step pushes its layers) reach a
// shard one after the other, each whole, in the order they were issued: a
// shard answers a sync pull's chunks in push order, so chunks of a later
// push that overtook an earlier one's would only wait there.
TEST(PsClientTest, PushesOnAConnectionArriveOneAfterTheOtherInIssueOrder) {
  // fc1/weight: 1536 x 1024 floats in 24 chunks of 256 KiB, each larger
  // than HTTP/2's first window; fc1/bias one more.
  const v1::JobSpec spec =
      ::pstrain::testing::DenseJob("ordered", 1536, 1024, 3, v1::CONSISTENCY_ASYNC);
  const ModelGraph graph = *BuildModelGraph(spec.model());
  const ChunkPlan plan = *PlanChunks(graph, 1, 256 << 10);
  ASSERT_EQ(plan.chunks.size(), 25u);
  absl::Mutex mu;
  std::vector<int64_t> arrivals;  // The update_seq of every frame, as it arrived.
  ShardServices::Options service_options;
  service_options.cut_push_stream = [&](const v1::ChunkHeader& frame, bool applied) {
    if (!applied) {
      absl::MutexLock lock(&mu);
      arrivals.push_back(frame.update_seq());
    }
    return false;
  };
  ParameterShard shard(ParameterShard::Options{.shard_index = 0});
  ShardServices services(&shard, service_options);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  services.Register(&builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ShardJobConfig config;
  config.job_id = kJob;
  config.spec = spec;
  config.num_shards = 1;
  config.chunk_bytes = 256 << 10;
  config.members = {"w0"};
  config.generation = 1;
  ASSERT_OK(shard.ConfigureJob(config, ::pstrain::testing::InitialChunks(graph, plan, 0)));
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<PsClient> client,
      PsClient::Create(OneShardOptions("127.0.0.1:" + std::to_string(port)), plan));
  std::vector<std::vector<float>> gradients;
  for (const ChunkInfo& c : plan.chunks) gradients.emplace_back(c.count, 1e-3f);
  // Three pushes of 8, 8 and 9 chunks, issued without waiting.
  std::vector<PsClient::ChunkRef> refs = Refs(gradients);
  std::vector<std::unique_ptr<PendingOp>> pushes;
  for (auto [from, to] : {std::pair{0, 8}, std::pair{8, 16}, std::pair{16, 25}}) {
    pushes.push_back(
        client->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 1,
                     std::vector<PsClient::ChunkRef>(refs.begin() + from, refs.begin() + to)));
  }
  for (auto& push : pushes) ASSERT_OK(push->Wait());
  absl::MutexLock lock(&mu);
  ASSERT_EQ(arrivals.size(), 25u);
  EXPECT_TRUE(std::is_sorted(arrivals.begin(), arrivals.end())) << absl::StrJoin(arrivals, " ");
  EXPECT_EQ(std::count(arrivals.begin(), arrivals.end(), arrivals.front()), 8);
  EXPECT_EQ(std::count(arrivals.begin(), arrivals.end(), arrivals.back()), 9);
  server->Shutdown(DeadlineFromNow(absl::Seconds(5)));
}

TEST(PsClientTest, PullThatCannotBeSatisfiedFailsAtTheDeadline) {
  Cluster cluster(v1::CONSISTENCY_SYNC, 2, {"w0"});
  auto client = cluster.Client("w0", absl::Milliseconds(500));
  std::vector<std::vector<float>> pulled = cluster.Buffers(0.0f);
  const absl::Time start = absl::Now();
  auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 7, 0, Dests(pulled));
  absl::Status status = pull->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A pull waiting on a version that will not come (its own push was refused)
// is cancelled by the updater: it ends at once, not at its deadline.
TEST(PsClientTest, ACancelledPullEndsAtOnceWithCancelled) {
  Cluster cluster(v1::CONSISTENCY_SYNC, 2, {"w0"});
  auto client = cluster.Client("w0", absl::Seconds(30));
  std::vector<std::vector<float>> pulled = cluster.Buffers(0.0f);
  auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 7, 0, Dests(pulled));
  // Both shards hold it, waiting.
  EXPECT_TRUE(WaitUntil(
      [&] {
        return cluster.shard(0).stats().waiting_pulls > 0 &&
               cluster.shard(1).stats().waiting_pulls > 0;
      },
      absl::Seconds(20)));
  const absl::Time start = absl::Now();
  pull->Cancel();
  absl::Status status = pull->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  pull->Cancel();  // Again, and on an op that ended: nothing happens.
  // The client goes on: a pull that can be served is.
  EXPECT_OK(client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, Dests(pulled))->Wait());
}

// A run that stops (a worker shutting down while the servers are gone too)
// ends every call at once instead of waiting out rpc_timeout on each: a
// SIGTERM'd worker took 2 minutes to exit in the emulated cluster.
TEST(PsClientTest, CancelAllEndsEveryCallAtOnceAndEveryLaterOne) {
  const int port = UnusedPort();
  ASSERT_GT(port, 0);
  Cluster cluster(v1::CONSISTENCY_SYNC, 1, {"w0"});
  PsClient::Options options;
  options.shard_addresses = {"127.0.0.1:" + std::to_string(port)};  // Nobody there.
  options.job_id = kJob;
  options.worker_id = "w0";
  options.rpc_timeout = absl::Seconds(60);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PsClient> gone, PsClient::Create(options, cluster.plan()));
  std::vector<std::vector<float>> g = cluster.Buffers(1.0f);
  std::vector<std::vector<float>> pulled = cluster.Buffers(0.0f);
  auto push = gone->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 0, Refs(g));
  auto pull = gone->Pull(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, Dests(pulled));
  absl::SleepFor(absl::Milliseconds(300));  // Both retrying.
  const absl::Time start = absl::Now();
  gone->CancelAll();
  EXPECT_EQ(push->Wait().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(pull->Wait().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  // Later operations end at once too.
  EXPECT_EQ(gone->Pull(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, Dests(pulled))->Wait().code(),
            absl::StatusCode::kCancelled);

  // Against a live shard: a pull waiting on a version ends at once.
  auto client = cluster.Client("w0", absl::Seconds(30));
  auto waiting = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 9, 0, Dests(pulled));
  EXPECT_TRUE(
      WaitUntil([&] { return cluster.shard(0).stats().waiting_pulls > 0; }, absl::Seconds(20)));
  client->CancelAll();
  EXPECT_EQ(waiting->Wait().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(client->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 0, Refs(g))->Wait().code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(cluster.shard(0).stats().pushes, 0);  // Nothing reached the shard.
}

TEST(PsClientTest, UnreachableShardIsUnavailableWithinTheDeadline) {
  const int port = UnusedPort();
  ASSERT_GT(port, 0);
  Cluster cluster(v1::CONSISTENCY_ASYNC, 1, {"w0"});
  PsClient::Options options;
  options.shard_addresses = {"127.0.0.1:" + std::to_string(port)};
  options.job_id = kJob;
  options.worker_id = "w0";
  options.rpc_timeout = absl::Milliseconds(700);
  auto client = PsClient::Create(options, cluster.plan());
  ASSERT_OK(client);
  std::vector<std::vector<float>> pulled = cluster.Buffers(0.0f);
  const absl::Time start = absl::Now();
  absl::Status status =
      (*client)->Pull(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, Dests(pulled))->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("unreachable"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST(PsClientTest, ShardErrorsReachWaitAndGenerationIsSent) {
  Cluster cluster(v1::CONSISTENCY_ASYNC, 2, {"w0"});
  auto client = cluster.Client("w0");
  std::vector<std::vector<float>> g = cluster.Buffers(1.0f);
  client->SetGeneration(5);
  absl::Status status = client->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 0, Refs(g))->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kAborted) << status;
  ASSERT_OK(cluster.shard(0).SetMembers(kJob, {"w0"}, 5));
  ASSERT_OK(cluster.shard(1).SetMembers(kJob, {"w0"}, 5));
  EXPECT_OK(client->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 0, Refs(g))->Wait());
  g[0][0] = std::numeric_limits<float>::quiet_NaN();
  status = client->Push(v1::ChunkHeader::KIND_GRADIENT, 1, 0, Refs(g))->Wait();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
}

TEST(PsClientTest, BadArgumentsFailWithoutACall) {
  Cluster cluster(v1::CONSISTENCY_ASYNC, 1, {"w0"});
  auto client = cluster.Client("w0");
  std::vector<float> buffer(4);
  EXPECT_EQ(
      client->Push(v1::ChunkHeader::KIND_GRADIENT, 0, 0, {{999, buffer.data()}})->Wait().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, {{0, nullptr}})->Wait().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_OK(client->Pull(v1::ChunkHeader::KIND_PARAMETERS, 0, 0, {})->Wait());
  PsClient::Options options;
  options.shard_addresses = {"127.0.0.1:1", "127.0.0.1:2"};
  EXPECT_EQ(PsClient::Create(options, cluster.plan()).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.shard_addresses = {"127.0.0.1:1"};
  for (int connections : {0, PsClient::kMaxConnectionsPerShard + 1}) {
    options.connections_per_shard = connections;
    EXPECT_EQ(PsClient::Create(options, cluster.plan()).status().code(),
              absl::StatusCode::kInvalidArgument)
        << connections;
  }
}

// --- Exactly-once updates (issue 9) -------------------------------------------

// Cuts push streams at random frames, before or after the frame is applied,
// at most once per frame of an update (so that every update gets through on
// some attempt). Thread-safe.
class RandomStreamCutter {
 public:
  explicit RandomStreamCutter(uint32_t seed, double probability)
      : rng_(seed), probability_(probability) {}
  bool operator()(const v1::ChunkHeader& frame, bool applied) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string key = absl::StrCat(frame.worker_id(), "/", frame.incarnation(), "/",
                                         frame.update_seq(), "/", frame.chunk_id(), "/", applied);
    if (!seen_.insert(key).second) return false;
    if (std::uniform_real_distribution<double>(0, 1)(rng_) >= probability_) return false;
    ++(applied ? cuts_after_apply_ : cuts_before_apply_);
    return true;
  }
  int cuts_before_apply() {
    std::lock_guard<std::mutex> lock(mu_);
    return cuts_before_apply_;
  }
  int cuts_after_apply() {
    std::lock_guard<std::mutex> lock(mu_);
    return cuts_after_apply_;
  }

 private:
  std::mutex mu_;
  std::mt19937 rng_;
  const double probability_;
  std::set<std::string> seen_;
  int cuts_before_apply_ = 0, cuts_after_apply_ = 0;
};

// What a run leaves on the shards: every chunk's values, version and
// optimizer state, and the updates applied.
struct RunResult {
  std::string model;
  int64_t applied_updates = 0;
  int64_t duplicate_pushes = 0;
};

// Two workers train kSteps steps of `mode` through two shards with
// deterministic gradients (sync and average: both push each step, then
// pull the next version; async and ssp: one after the other, so that the
// order of updates is the same in every run).
RunResult RunTwoWorkers(v1::ConsistencyMode mode, RandomStreamCutter* cutter, int connections = 1) {
  constexpr int kSteps = 6;
  ShardServices::Options service_options;
  // Frames of a stream applied in parallel, as pstrain-server does on a
  // multi-core machine: exactly-once must hold when a cut meets frames in
  // flight beside it.
  service_options.max_parallel_frames = 4;
  if (cutter != nullptr) {
    service_options.cut_push_stream = [cutter](const v1::ChunkHeader& frame, bool applied) {
      return (*cutter)(frame, applied);
    };
  }
  Cluster cluster(mode, 2, {"w0", "w1"}, service_options);
  std::unique_ptr<PsClient> clients[2] = {cluster.Client("w0", absl::Seconds(20), {}, connections),
                                          cluster.Client("w1", absl::Seconds(20), {}, connections)};
  const bool barrier = mode == v1::CONSISTENCY_SYNC || mode == v1::CONSISTENCY_AVERAGE;
  const auto kind = mode == v1::CONSISTENCY_AVERAGE ? v1::ChunkHeader::KIND_PARAMETERS
                                                    : v1::ChunkHeader::KIND_GRADIENT;
  auto values_of = [&](int worker, int step) {
    std::vector<std::vector<float>> v = cluster.Buffers(0.0f);
    for (size_t id = 0; id < v.size(); ++id) {
      for (size_t i = 0; i < v[id].size(); ++i) {
        v[id][i] = 0.015625f * static_cast<float>((i * 7 + id * 3 + step * 5 + worker * 11) % 13) -
                   0.09375f;
      }
    }
    return v;
  };
  auto push = [&](int worker, int step) {
    std::vector<std::vector<float>> v = values_of(worker, step);
    absl::Status status =
        clients[worker]->Push(kind, barrier ? step : 0, step + 1, Refs(v))->Wait();
    EXPECT_OK(status) << "worker " << worker << " step " << step << ": " << status;
  };
  for (int step = 0; step < kSteps; ++step) {
    if (barrier) {
      std::thread second([&] { push(1, step); });
      push(0, step);
      second.join();
      std::vector<std::vector<float>> pulled = cluster.Buffers(0.0f);
      EXPECT_OK(
          clients[0]->Pull(v1::ChunkHeader::KIND_PARAMETERS, step + 1, 0, Dests(pulled))->Wait());
    } else {
      push(0, step);
      push(1, step);
    }
  }
  RunResult result;
  for (int s = 0; s < cluster.num_shards(); ++s) {
    absl::StatusOr<std::vector<v1::ChunkValues>> chunks = cluster.shard(s).ReadChunks(kJob);
    EXPECT_OK(chunks.status());
    if (chunks.ok()) {
      for (const v1::ChunkValues& c : *chunks) result.model += c.SerializeAsString();
    }
    result.applied_updates += cluster.shard(s).stats().applied_updates;
    result.duplicate_pushes += cluster.shard(s).stats().duplicate_pushes;
  }
  return result;
}

class ExactlyOnceThroughCutStreamsTest : public ::testing::TestWithParam<v1::ConsistencyMode> {};

TEST_P(ExactlyOnceThroughCutStreamsTest, EveryUpdateIsAppliedOnceAsWithoutFaults) {
  const RunResult clean = RunTwoWorkers(GetParam(), nullptr);
  RandomStreamCutter cutter(/*seed=*/9 + static_cast<uint32_t>(GetParam()), 0.05);
  const RunResult faulty = RunTwoWorkers(GetParam(), &cutter);
  EXPECT_GT(cutter.cuts_before_apply(), 0);
  EXPECT_GT(cutter.cuts_after_apply(), 0);
  EXPECT_EQ(faulty.applied_updates, clean.applied_updates);
  EXPECT_TRUE(faulty.model == clean.model) << "the model differs from the run without faults";
  // Every frame cut after it was applied came again and was acknowledged.
  EXPECT_GE(faulty.duplicate_pushes, cutter.cuts_after_apply());
  EXPECT_EQ(clean.duplicate_pushes, 0);
}

// A push's frames spread over three connections per shard, cut at random:
// the model is bit for bit the one that one connection without faults gives.
TEST(PsClientTest, ThreeConnectionsPerShardThroughCutStreamsGiveTheModelOfOne) {
  const RunResult clean = RunTwoWorkers(v1::CONSISTENCY_SYNC, nullptr);
  RandomStreamCutter cutter(/*seed=*/21, 0.05);
  const RunResult faulty = RunTwoWorkers(v1::CONSISTENCY_SYNC, &cutter, /*connections=*/3);
  EXPECT_GT(cutter.cuts_before_apply() + cutter.cuts_after_apply(), 0);
  EXPECT_EQ(faulty.applied_updates, clean.applied_updates);
  EXPECT_TRUE(faulty.model == clean.model) << "the model differs from one connection's";
}

INSTANTIATE_TEST_SUITE_P(AllModes, ExactlyOnceThroughCutStreamsTest,
                         ::testing::Values(v1::CONSISTENCY_SYNC, v1::CONSISTENCY_ASYNC,
                                           v1::CONSISTENCY_SSP, v1::CONSISTENCY_AVERAGE),
                         [](const ::testing::TestParamInfo<v1::ConsistencyMode>& info) {
                           const std::string name = v1::ConsistencyMode_Name(info.param);
                           return name.substr(name.find('_') + 1);
                         });

}  // namespace
}  // namespace pstrain
