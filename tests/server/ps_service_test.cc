// ShardServices over real gRPC servers on 127.0.0.1 (port 0), driven by a raw
// generic client so that every malformed frame can be sent: each must get its
// gRPC code and leave the shard's values byte-identical.
#include "server/ps_service.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "common/rpc/channel.h"
#include "common/rpc/gradient_codec.h"
#include "common/rpc/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "server/parameter_shard.h"
#include "tests/testing/raw_call.h"
#include "tests/testing/shard_fixtures.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

constexpr char kJob[] = "job-1";
constexpr char kWorkerA[] = "worker-a";
constexpr char kWorkerB[] = "worker-b";
constexpr int64_t kChunkBytes = 256;  // 64 floats: fc1/weight spans 10 chunks.

// input [64] -> dense 10 -> softmax cross-entropy: 650 parameters.
v1::JobSpec TinyJob(v1::ConsistencyMode mode) {
  return ::pstrain::testing::DenseJob("tiny", 64, 10, 7, mode);
}

using ::pstrain::testing::InitialChunks;
using ::pstrain::testing::RawCall;

grpc::ByteBuffer Frame(const v1::ChunkHeader& header, const std::vector<float>& values) {
  grpc::ByteBuffer out;
  EXPECT_OK(EncodeFrame(header, values.data(), values.size() * 4, &out, true));
  return out;
}

// One ParameterShard + ShardServices + gRPC server per shard (the pacing
// tests count on a lead of two frames, the default).
class ShardServer {
 public:
  explicit ShardServer(int index, ShardServices::Options options = {})
      : shard_({.shard_index = index}), services_(&shard_, options) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    services_.Register(&builder);
    server_ = builder.BuildAndStart();
    channel_ = CreateChannel(address());
    stub_ = std::make_unique<grpc::GenericStub>(channel_);
    control_ = v1::ShardControl::NewStub(channel_);
  }
  ~ShardServer() { server_->Shutdown(DeadlineFromNow(absl::Seconds(5))); }

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  ParameterShard& shard() { return shard_; }
  grpc::GenericStub* stub() { return stub_.get(); }
  v1::ShardControl::Stub* control() { return control_.get(); }
  bool started() const { return server_ != nullptr && port_ != 0; }

 private:
  ParameterShard shard_;
  ShardServices services_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
  std::unique_ptr<v1::ShardControl::Stub> control_;
};

class PsServiceTest : public ::testing::Test {
 protected:
  // Two shards; the job is configured on each through ShardControl.
  void StartJob(v1::ConsistencyMode mode, std::vector<std::string> members = {kWorkerA}) {
    servers_.clear();
    spec_ = TinyJob(mode);
    *spec_.mutable_pull_compression() = pull_compression_;
    auto graph = BuildModelGraph(spec_.model());
    ASSERT_OK(graph);
    graph_ = *graph;
    auto plan = PlanChunks(graph_, 2, kChunkBytes);
    ASSERT_OK(plan);
    plan_ = *plan;
    for (int s = 0; s < 2; ++s) {
      servers_.push_back(std::make_unique<ShardServer>(s, service_options_));
      ASSERT_TRUE(servers_.back()->started());
      v1::ConfigureJobRequest request;
      request.set_job_id(kJob);
      *request.mutable_spec() = spec_;
      request.set_num_shards(2);
      request.set_chunk_bytes(kChunkBytes);
      request.set_shard_index(s);
      for (const std::string& m : members) request.add_members(m);
      request.set_generation(1);
      for (v1::ChunkValues& c : InitialChunks(graph_, plan_, s)) *request.add_chunks() = c;
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
      v1::ConfigureJobResponse response;
      grpc::Status status = servers_.back()->control()->ConfigureJob(&ctx, request, &response);
      ASSERT_OK(status);
    }
  }

  // Every chunk of shard s as read back through ShardControl.ReadChunks.
  std::vector<std::string> Snapshot(int s) {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    v1::ReadChunksRequest request;
    request.set_job_id(kJob);
    auto reader = servers_[s]->control()->ReadChunks(&ctx, request);
    std::vector<std::string> out;
    v1::ChunkValues c;
    while (reader->Read(&c)) out.push_back(c.SerializeAsString());
    EXPECT_OK(reader->Finish());
    return out;
  }

  v1::ChunkHeader PushHeader(int chunk_id) const {
    v1::ChunkHeader h;
    h.set_job_id(kJob);
    h.set_worker_id(kWorkerA);
    h.set_generation(1);
    h.set_chunk_id(chunk_id);
    h.set_version(0);
    h.set_kind(v1::ChunkHeader::KIND_GRADIENT);
    h.set_dtype(v1::DTYPE_F32);
    h.set_num_elements(plan_.chunks[chunk_id].count);
    return h;
  }

  std::vector<float> Ones(int chunk_id) const {
    return std::vector<float>(plan_.chunks[chunk_id].count, 1.0f);
  }

  int FirstChunkOf(int shard) const { return plan_.by_shard[shard].front(); }

  grpc::Status Push(int shard, std::vector<grpc::ByteBuffer> frames,
                    std::vector<grpc::ByteBuffer>* replies = nullptr) {
    return RawCall::Run(servers_[shard]->stub(), kPushMethod, std::move(frames), replies);
  }

  // The request frame's header of a pull of `ids` at min_version.
  v1::ChunkHeader PullHeader(const std::vector<int>& ids, int64_t min_version) const {
    v1::ChunkHeader h;
    h.set_job_id(kJob);
    h.set_worker_id(kWorkerA);
    h.set_generation(1);
    h.set_version(min_version);
    h.set_kind(v1::ChunkHeader::KIND_PARAMETERS);
    for (int id : ids) h.add_chunk_ids(id);
    return h;
  }

  // Pulls `ids` of `shard` at min_version; returns the values by chunk.
  grpc::Status Pull(int shard, std::vector<int> ids, int64_t min_version,
                    std::vector<std::vector<float>>* values, std::vector<int64_t>* versions,
                    absl::Duration timeout = absl::Seconds(10)) {
    const v1::ChunkHeader h = PullHeader(ids, min_version);
    std::vector<grpc::ByteBuffer> replies;
    grpc::Status status =
        RawCall::Run(servers_[shard]->stub(), kPullMethod, {Frame(h, {})}, &replies, timeout);
    for (const grpc::ByteBuffer& r : replies) {
      v1::ChunkHeader header;
      PayloadView payload;
      EXPECT_OK(DecodeFrame(r, &header, &payload));
      std::vector<float> v(header.num_elements());
      payload.CopyTo(v.data());
      if (values != nullptr) values->push_back(std::move(v));
      if (versions != nullptr) versions->push_back(header.version());
    }
    return status;
  }

  // Sends `frames` to `shard` and expects `code` with `message` in the text,
  // and both shards byte-identical afterwards.
  void ExpectRejected(int shard, std::vector<grpc::ByteBuffer> frames, grpc::StatusCode code,
                      const std::string& message) {
    const std::vector<std::string> before0 = Snapshot(0), before1 = Snapshot(1);
    grpc::Status status = Push(shard, std::move(frames));
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(message));
    EXPECT_EQ(Snapshot(0), before0);
    EXPECT_EQ(Snapshot(1), before1);
  }

  ShardServices::Options service_options_;  // For the servers StartJob makes.
  v1::CompressionSpec pull_compression_;    // For the jobs StartJob makes.
  v1::JobSpec spec_;
  ModelGraph graph_;
  ChunkPlan plan_;
  std::vector<std::unique_ptr<ShardServer>> servers_;
};

TEST_F(PsServiceTest, SyncPushThenPullIsBitExact) {
  StartJob(v1::CONSISTENCY_SYNC);
  const std::vector<std::vector<float>> initial = InitialParameterValues(graph_);
  for (int s = 0; s < 2; ++s) {
    std::vector<grpc::ByteBuffer> frames;
    std::vector<std::vector<float>> grads;
    for (int id : plan_.by_shard[s]) {
      std::vector<float> g(plan_.chunks[id].count);
      for (size_t i = 0; i < g.size(); ++i) g[i] = 0.001f * static_cast<float>(i + id) - 0.03f;
      frames.push_back(Frame(PushHeader(id), g));
      grads.push_back(std::move(g));
    }
    std::vector<grpc::ByteBuffer> replies;
    grpc::Status status = Push(s, std::move(frames), &replies);
    ASSERT_OK(status);
    ASSERT_EQ(replies.size(), 1u);
    v1::ChunkHeader reply;
    PayloadView payload;
    ASSERT_OK(DecodeFrame(replies[0], &reply, &payload));
    EXPECT_EQ(reply.version(), 1);

    std::vector<std::vector<float>> values;
    std::vector<int64_t> versions;
    status = Pull(s, {}, 1, &values, &versions);
    ASSERT_OK(status);
    ASSERT_EQ(values.size(), plan_.by_shard[s].size());
    for (size_t k = 0; k < values.size(); ++k) {
      const ChunkInfo& c = plan_.chunks[plan_.by_shard[s][k]];
      EXPECT_EQ(versions[k], 1);
      for (int64_t i = 0; i < c.count; ++i) {
        const float expected = initial[c.param][c.offset + i] - 0.5f * grads[k][i];
        ASSERT_EQ(values[k][i], expected) << "chunk " << c.id << " element " << i;
      }
    }
  }
}

// Splits a push's replies into credit frames and the final reply.
void SplitReplies(const std::vector<grpc::ByteBuffer>& replies, std::vector<int64_t>* credits,
                  std::vector<v1::ChunkHeader>* finals) {
  for (const grpc::ByteBuffer& r : replies) {
    v1::ChunkHeader header;
    PayloadView payload;
    ASSERT_OK(DecodeFrame(r, &header, &payload));
    if (header.credit() > 0) {
      credits->push_back(header.credit());
    } else {
      finals->push_back(header);
    }
  }
}

TEST_F(PsServiceTest, APacedPushIsNeverCreditedMoreThanTheLeadPastTheSlowestMember) {
  StartJob(v1::CONSISTENCY_SYNC, {kWorkerA, kWorkerB});
  std::vector<grpc::ByteBuffer> frames;
  for (int id : plan_.by_shard[0]) {
    v1::ChunkHeader h = PushHeader(id);
    h.set_paced(true);
    frames.push_back(Frame(h, Ones(id)));
  }
  ASSERT_GT(frames.size(), 3u);
  // This raw client sends every frame whatever the credits say: the shard
  // applies them all (credits pace, they do not police), but while worker-b
  // has pushed nothing it never allows more than the lead (2) in all.
  std::vector<grpc::ByteBuffer> replies;
  ASSERT_OK(Push(0, std::move(frames), &replies));
  std::vector<int64_t> credits;
  std::vector<v1::ChunkHeader> finals;
  SplitReplies(replies, &credits, &finals);
  ASSERT_FALSE(credits.empty());
  for (int64_t c : credits) EXPECT_LE(c, 2);
  ASSERT_EQ(finals.size(), 1u);
  EXPECT_EQ(finals[0].version(), 0);  // The step waits for worker-b.

  // worker-b, one frame, not paced: only the reply, as before pacing.
  v1::ChunkHeader b = PushHeader(FirstChunkOf(0));
  b.set_worker_id(kWorkerB);
  replies.clear();
  ASSERT_OK(Push(0, {Frame(b, Ones(FirstChunkOf(0)))}, &replies));
  credits.clear();
  finals.clear();
  SplitReplies(replies, &credits, &finals);
  EXPECT_TRUE(credits.empty());
  EXPECT_EQ(finals.size(), 1u);
}

// A step's second push call starts when its member is already the lead
// ahead: its stream still gets a credit (of the frames applied so far), so
// that the client stops sending; before, it got none and sent freely.
TEST_F(PsServiceTest, APushStreamThatStartsWhenItsMemberIsAheadIsCreditedWhatItHasSent) {
  StartJob(v1::CONSISTENCY_SYNC, {kWorkerA, kWorkerB});
  const std::vector<int>& ids = plan_.by_shard[0];
  ASSERT_GE(ids.size(), 4u);
  auto paced_frames = [&](size_t from, size_t to) {
    std::vector<grpc::ByteBuffer> frames;
    for (size_t k = from; k < to; ++k) {
      v1::ChunkHeader h = PushHeader(ids[k]);
      h.set_paced(true);
      frames.push_back(Frame(h, Ones(ids[k])));
    }
    return frames;
  };
  // First call: two frames, the whole lead (2) while worker-b has pushed nothing.
  std::vector<grpc::ByteBuffer> replies;
  ASSERT_OK(Push(0, paced_frames(0, 2), &replies));
  // Second call: worker-a is at the lead when its first frame is applied.
  replies.clear();
  ASSERT_OK(Push(0, paced_frames(2, 4), &replies));
  std::vector<int64_t> credits;
  std::vector<v1::ChunkHeader> finals;
  SplitReplies(replies, &credits, &finals);
  EXPECT_EQ(credits, std::vector<int64_t>({1}));
  ASSERT_EQ(finals.size(), 1u);
}

// A paced client sends its first frame and then waits for a credit: a shard
// that does not pace the job (async here; sync with --push-pacing-lead 0)
// must still send one, for every frame the stream may carry, or the push
// would wait for it until its deadline.
TEST_F(PsServiceTest, AShardThatDoesNotPaceTheJobCreditsAPacedStreamWithEveryFrame) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const std::vector<int>& ids = plan_.by_shard[0];
  ASSERT_GE(ids.size(), 2u);
  std::vector<grpc::ByteBuffer> frames;
  for (int id : ids) {
    v1::ChunkHeader h = PushHeader(id);
    h.set_paced(true);
    frames.push_back(Frame(h, Ones(id)));
  }
  std::vector<grpc::ByteBuffer> replies;
  ASSERT_OK(Push(0, std::move(frames), &replies));
  std::vector<int64_t> credits;
  std::vector<v1::ChunkHeader> finals;
  SplitReplies(replies, &credits, &finals);
  ASSERT_EQ(credits.size(), 1u);
  EXPECT_GE(credits[0], static_cast<int64_t>(ids.size()));
  ASSERT_EQ(finals.size(), 1u);
}

TEST_F(PsServiceTest, PullRepliesInRequestOrder) {
  StartJob(v1::CONSISTENCY_ASYNC);
  std::vector<int> ids = plan_.by_shard[1];
  std::reverse(ids.begin(), ids.end());
  std::vector<std::vector<float>> values;
  ASSERT_OK(Pull(1, ids, 0, &values, nullptr));
  const std::vector<std::vector<float>> initial = InitialParameterValues(graph_);
  ASSERT_EQ(values.size(), ids.size());
  for (size_t k = 0; k < ids.size(); ++k) {
    const ChunkInfo& c = plan_.chunks[ids[k]];
    EXPECT_EQ(values[k], std::vector<float>(initial[c.param].begin() + c.offset,
                                            initial[c.param].begin() + c.offset + c.count));
  }
}

TEST_F(PsServiceTest, HalfPrecisionGradientsAreWidened) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  const ChunkInfo& c = plan_.chunks[id];
  for (v1::DType dtype : {v1::DTYPE_F16, v1::DTYPE_BF16}) {
    std::vector<float> before;
    {
      std::vector<std::vector<float>> values;
      ASSERT_OK(Pull(0, {id}, 0, &values, nullptr));
      before = values[0];
    }
    std::vector<float> grad(c.count, 0.25f);
    std::vector<char> half(c.count * 2);
    ASSERT_OK(ConvertFromF32(dtype, grad.data(), c.count, half.data()));
    v1::ChunkHeader h = PushHeader(id);
    h.set_dtype(dtype);
    grpc::ByteBuffer frame;
    ASSERT_OK(EncodeFrame(h, half.data(), half.size(), &frame, true));
    grpc::Status status = Push(0, {frame});
    ASSERT_OK(status);
    std::vector<std::vector<float>> after;
    ASSERT_OK(Pull(0, {id}, 0, &after, nullptr));
    for (int64_t i = 0; i < c.count; ++i) ASSERT_EQ(after[0][i], before[i] - 0.125f);
  }
}

TEST_F(PsServiceTest, WrongByteCountIsInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  std::vector<float> short_payload(plan_.chunks[id].count - 1, 1.0f);
  ExpectRejected(0, {Frame(PushHeader(id), short_payload)}, grpc::StatusCode::INVALID_ARGUMENT,
                 "bytes");
  // Consistent header and payload, but not the plan's count.
  v1::ChunkHeader h = PushHeader(id);
  h.set_num_elements(plan_.chunks[id].count - 1);
  ExpectRejected(0, {Frame(h, short_payload)}, grpc::StatusCode::INVALID_ARGUMENT, "holds");
}

TEST_F(PsServiceTest, WrongDtypeIsInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  v1::ChunkHeader h = PushHeader(id);
  h.set_dtype(v1::DTYPE_I32);
  ExpectRejected(0, {Frame(h, Ones(id))}, grpc::StatusCode::INVALID_ARGUMENT, "dtype");
  // Half precision only for gradients.
  StartJob(v1::CONSISTENCY_AVERAGE);
  h = PushHeader(id);
  h.set_kind(v1::ChunkHeader::KIND_PARAMETERS);
  h.set_dtype(v1::DTYPE_F16);
  std::vector<uint16_t> half(plan_.chunks[id].count, 0x3c00);
  grpc::ByteBuffer frame;
  ASSERT_OK(EncodeFrame(h, half.data(), half.size() * 2, &frame, true));
  ExpectRejected(0, {frame}, grpc::StatusCode::INVALID_ARGUMENT, "only accepted for gradients");
}

TEST_F(PsServiceTest, NonFiniteIsInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  std::vector<float> g = Ones(id);
  g[3] = std::nanf("");
  ExpectRejected(0, {Frame(PushHeader(id), g)}, grpc::StatusCode::INVALID_ARGUMENT, "not finite");
  g[3] = INFINITY;
  ExpectRejected(0, {Frame(PushHeader(id), g)}, grpc::StatusCode::INVALID_ARGUMENT, "not finite");
}

TEST_F(PsServiceTest, UnknownJobIsNotFound) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  v1::ChunkHeader h = PushHeader(id);
  h.set_job_id("job-404");
  ExpectRejected(0, {Frame(h, Ones(id))}, grpc::StatusCode::NOT_FOUND, "job-404");
}

TEST_F(PsServiceTest, UnknownWorkerIsRejected) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  v1::ChunkHeader h = PushHeader(id);
  h.set_worker_id("worker-404");
  ExpectRejected(0, {Frame(h, Ones(id))}, grpc::StatusCode::FAILED_PRECONDITION, "worker-404");
}

TEST_F(PsServiceTest, VersionFromTheFutureIsInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  v1::ChunkHeader h = PushHeader(id);
  h.set_version(5);
  ExpectRejected(0, {Frame(h, Ones(id))}, grpc::StatusCode::INVALID_ARGUMENT, "ahead");
}

TEST_F(PsServiceTest, ChunkNotOwnedIsInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(1);  // Sent to shard 0.
  ExpectRejected(0, {Frame(PushHeader(id), Ones(id))}, grpc::StatusCode::INVALID_ARGUMENT,
                 "owned by shard 1");
  v1::ChunkHeader h = PushHeader(FirstChunkOf(0));
  h.set_chunk_id(static_cast<int>(plan_.chunks.size()));
  ExpectRejected(0, {Frame(h, Ones(FirstChunkOf(0)))}, grpc::StatusCode::INVALID_ARGUMENT,
                 "out of range");
}

TEST_F(PsServiceTest, StaleGenerationIsAborted) {
  StartJob(v1::CONSISTENCY_ASYNC, {kWorkerA, kWorkerB});
  // worker-a leaves and joins again at generation 3: its generation-1
  // pushes are from before it left.
  ASSERT_OK(servers_[0]->shard().SetMembers(kJob, {kWorkerB}, 2));
  ASSERT_OK(servers_[0]->shard().SetMembers(kJob, {kWorkerA, kWorkerB}, 3));
  const int id = FirstChunkOf(0);
  ExpectRejected(0, {Frame(PushHeader(id), Ones(id))}, grpc::StatusCode::ABORTED, "generation");
}

TEST_F(PsServiceTest, AMemberThatStaysPushesWithTheGenerationItJoinedAt) {
  StartJob(v1::CONSISTENCY_ASYNC, {kWorkerA, kWorkerB});
  // worker-b is lost; worker-a has not heard of generation 2 yet.
  v1::SetMembersResponse response;
  ASSERT_OK(servers_[0]->shard().SetMembers(kJob, {kWorkerA}, 2, &response));
  const int id = FirstChunkOf(0);
  grpc::Status status = Push(0, {Frame(PushHeader(id), Ones(id))});
  EXPECT_OK(status);
  // The removed member's steps: it pushed nothing.
  ASSERT_EQ(response.removed_size(), 1);
  EXPECT_EQ(response.removed(0).worker_id(), kWorkerB);
  EXPECT_EQ(response.removed(0).steps(), 0);
}

TEST_F(PsServiceTest, SetMembersReportsTheStepsEveryChunkHoldsOfARemovedMember) {
  StartJob(v1::CONSISTENCY_ASYNC, {kWorkerA, kWorkerB});
  // worker-b's step 7 reached every chunk of shard 0, its step 9 only the first.
  for (int clock : {7, 9}) {
    for (int id : plan_.by_shard[0]) {
      if (clock == 9 && id != FirstChunkOf(0)) continue;
      v1::ChunkHeader h = PushHeader(id);
      h.set_worker_id(kWorkerB);
      h.set_worker_clock(clock);
      grpc::Status status = Push(0, {Frame(h, Ones(id))});
      ASSERT_OK(status);
    }
  }
  v1::SetMembersResponse response;
  ASSERT_OK(servers_[0]->shard().SetMembers(kJob, {kWorkerA}, 2, &response));
  ASSERT_EQ(response.removed_size(), 1);
  EXPECT_EQ(response.removed(0).steps(), 7);
}

TEST_F(PsServiceTest, OversizedFrameIsInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  v1::ChunkHeader h = PushHeader(id);
  const int64_t count = (kMaxFrameBytes / 4) + 1;
  h.set_num_elements(count);
  ExpectRejected(0, {Frame(h, std::vector<float>(count, 1.0f))}, grpc::StatusCode::INVALID_ARGUMENT,
                 "oversized stream");
}

TEST_F(PsServiceTest, TooManyFramesIsInvalidArgumentAndLaterFramesAreNotApplied) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const int id = FirstChunkOf(0);
  const int64_t cap = static_cast<int64_t>(plan_.by_shard[0].size()) * 3 + 1;
  std::vector<grpc::ByteBuffer> frames;
  for (int64_t i = 0; i < cap + 2; ++i) frames.push_back(Frame(PushHeader(id), Ones(id)));
  const int64_t pushes_before = servers_[0]->shard().stats().pushes;
  grpc::Status status = Push(0, std::move(frames));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("oversized stream"));
  EXPECT_EQ(servers_[0]->shard().stats().pushes - pushes_before, cap);
}

TEST_F(PsServiceTest, GarbageFramesAreInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const unsigned char too_short[2] = {1, 2};
  const unsigned char huge_header[8] = {0xff, 0xff, 0xff, 0x7f, 1, 2, 3, 4};
  const unsigned char bad_header[8] = {4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff};
  for (auto [bytes, size, message] :
       {std::tuple<const unsigned char*, size_t, const char*>{too_short, 2, "shorter"},
        {huge_header, 8, "header_size"},
        {bad_header, 8, "not a valid ChunkHeader"}}) {
    grpc::Slice slice(bytes, size);
    ExpectRejected(0, {grpc::ByteBuffer(&slice, 1)}, grpc::StatusCode::INVALID_ARGUMENT, message);
  }
}

TEST_F(PsServiceTest, FramesBeforeABadOneAreAppliedNothingAfter) {
  StartJob(v1::CONSISTENCY_ASYNC);
  const std::vector<int>& ids = plan_.by_shard[0];
  ASSERT_GE(ids.size(), 3u);
  std::vector<float> nan = Ones(ids[1]);
  nan[0] = std::nanf("");
  std::vector<std::vector<float>> before;
  ASSERT_OK(Pull(0, ids, 0, &before, nullptr));
  grpc::Status status =
      Push(0, {Frame(PushHeader(ids[0]), Ones(ids[0])), Frame(PushHeader(ids[1]), nan),
               Frame(PushHeader(ids[2]), Ones(ids[2]))});
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  std::vector<std::vector<float>> after;
  ASSERT_OK(Pull(0, ids, 0, &after, nullptr));
  EXPECT_NE(after[0], before[0]);
  EXPECT_EQ(after[1], before[1]);
  EXPECT_EQ(after[2], before[2]);
}

TEST_F(PsServiceTest, PullThatCannotBeSatisfiedEndsAtItsDeadline) {
  StartJob(v1::CONSISTENCY_SYNC);
  const absl::Time start = absl::Now();
  std::vector<std::vector<float>> values;
  grpc::Status status = Pull(0, {FirstChunkOf(0)}, 100, &values, nullptr, absl::Milliseconds(500));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_TRUE(values.empty());
  EXPECT_GE(took, absl::Milliseconds(450));
  EXPECT_LT(took, absl::Seconds(3));
}

TEST_F(PsServiceTest, BlockedPullIsReleasedByTheLastPushOfTheStep) {
  StartJob(v1::CONSISTENCY_SYNC, {kWorkerA, kWorkerB});
  const int id = FirstChunkOf(0);
  std::vector<std::vector<float>> values;
  grpc::Status pull_status;
  std::atomic<bool> pull_done{false};
  std::thread puller([&] {
    pull_status = Pull(0, {id}, 1, &values, nullptr);
    pull_done = true;
  });
  // The first of two pushes: the step is not complete, so nothing was applied
  // (a state, not a timing: version 1 cannot exist yet) and the pull for
  // version 1 has not been answered.
  ASSERT_OK(Push(0, {Frame(PushHeader(id), Ones(id))}));
  EXPECT_EQ(servers_[0]->shard().stats().applied_updates, 0);
  EXPECT_FALSE(pull_done);
  v1::ChunkHeader h = PushHeader(id);
  h.set_worker_id(kWorkerB);
  ASSERT_OK(Push(0, {Frame(h, Ones(id))}));
  puller.join();
  ASSERT_OK(pull_status);
  ASSERT_EQ(values.size(), 1u);
  EXPECT_EQ(servers_[0]->shard().stats().applied_updates, 1);
}

TEST_F(PsServiceTest, PullOfAChunkNotOwnedIsInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  grpc::Status status = Pull(0, {FirstChunkOf(1)}, 0, nullptr, nullptr);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  status = Pull(0, {static_cast<int>(plan_.chunks.size()) + 3}, 0, nullptr, nullptr);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(PsServiceTest, UnknownMethodIsUnimplemented) {
  StartJob(v1::CONSISTENCY_ASYNC);
  grpc::Status status =
      RawCall::Run(servers_[0]->stub(), "/pstrain.v1.ParameterService/Nope", {}, nullptr);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST_F(PsServiceTest, ConfigureJobForAnotherShardIsInvalidArgument) {
  StartJob(v1::CONSISTENCY_ASYNC);
  v1::ConfigureJobRequest request;
  request.set_job_id("job-2");
  *request.mutable_spec() = spec_;
  request.set_num_shards(2);
  request.set_chunk_bytes(kChunkBytes);
  request.set_shard_index(1);  // Sent to shard 0.
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
  v1::ConfigureJobResponse response;
  grpc::Status status = servers_[0]->control()->ConfigureJob(&ctx, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(PsServiceTest, SetMembersListJobsAndDropJobThroughShardControl) {
  StartJob(v1::CONSISTENCY_ASYNC);
  auto list_jobs = [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    v1::ListShardJobsResponse response;
    EXPECT_OK(servers_[0]->control()->ListJobs(&ctx, v1::ListShardJobsRequest(), &response));
    return std::vector<std::string>(response.job_ids().begin(), response.job_ids().end());
  };
  EXPECT_EQ(list_jobs(), std::vector<std::string>{kJob});
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    v1::SetMembersRequest request;
    request.set_job_id(kJob);
    request.add_members(kWorkerB);
    request.set_generation(2);
    v1::SetMembersResponse response;
    ASSERT_OK(servers_[0]->control()->SetMembers(&ctx, request, &response));
  }
  const int id = FirstChunkOf(0);
  v1::ChunkHeader h = PushHeader(id);
  h.set_worker_id(kWorkerB);
  h.set_generation(2);
  EXPECT_OK(Push(0, {Frame(h, Ones(id))}));
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    v1::DropJobRequest request;
    request.set_job_id(kJob);
    v1::DropJobResponse response;
    ASSERT_OK(servers_[0]->control()->DropJob(&ctx, request, &response));
  }
  EXPECT_EQ(Push(0, {Frame(h, Ones(id))}).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(list_jobs().empty());
}

// Regression (issue 8): 300 pulls waiting for a version that never comes
// took every thread of the 256-thread pool, and pushes and pulls of ready
// versions were no longer served. Here with a pool of 4 threads and 12
// parked pulls; a 13th waiting pull is refused.
TEST_F(PsServiceTest, PullsWaitingForAVersionThatNeverComesDoNotStarvePushesOrReadyPulls) {
  constexpr int kParked = 12;
  service_options_.max_threads = 4;
  service_options_.max_waiting_pulls = kParked;
  StartJob(v1::CONSISTENCY_SYNC, {kWorkerA, kWorkerB});
  const int id = FirstChunkOf(0);
  std::vector<grpc::Status> parked(kParked);
  std::vector<std::thread> pullers;
  for (int i = 0; i < kParked; ++i) {
    pullers.emplace_back(
        [&, i] { parked[i] = Pull(0, {id}, 1000, nullptr, nullptr, absl::Seconds(60)); });
  }
  // Once all of them wait, one more waiting pull is RESOURCE_EXHAUSTED (until
  // then it waits and ends at its deadline; bounded by 30 tries).
  grpc::Status extra;
  for (int i = 0; i < 30 && extra.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED; ++i) {
    extra = Pull(0, {id}, 1000, nullptr, nullptr, absl::Seconds(2));
  }
  EXPECT_EQ(extra.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << extra.error_message();
  EXPECT_THAT(extra.error_message(), HasSubstr("--max-waiting-pulls"));

  // A pull of the version that is there, and a step's pushes, each within a
  // generous deadline.
  std::vector<std::vector<float>> values;
  grpc::Status ready = Pull(0, {id}, 0, &values, nullptr, absl::Seconds(10));
  EXPECT_OK(ready);
  EXPECT_EQ(values.size(), 1u);
  grpc::Status pushed = RawCall::Run(servers_[0]->stub(), kPushMethod,
                                     {Frame(PushHeader(id), Ones(id))}, nullptr, absl::Seconds(10));
  EXPECT_OK(pushed);
  v1::ChunkHeader b = PushHeader(id);
  b.set_worker_id(kWorkerB);
  pushed = RawCall::Run(servers_[0]->stub(), kPushMethod, {Frame(b, Ones(id))}, nullptr,
                        absl::Seconds(10));
  EXPECT_OK(pushed);
  std::vector<int64_t> versions;
  ready = Pull(0, {id}, 1, nullptr, &versions, absl::Seconds(10));
  EXPECT_OK(ready);
  EXPECT_EQ(versions, std::vector<int64_t>{1});

  servers_.clear();  // Releases the parked pulls.
  for (std::thread& t : pullers) t.join();
  for (const grpc::Status& s : parked) EXPECT_FALSE(s.ok());
}

// Regression (issue 8): ShardControl took messages of any size.
TEST_F(PsServiceTest, OversizedShardControlRequestsAreResourceExhausted) {
  service_options_.max_control_message_bytes = 1 << 20;
  service_options_.max_receive_message_bytes = 8 << 20;
  StartJob(v1::CONSISTENCY_SYNC);
  for (int megabytes : {2, 16}) {
    v1::SetMembersRequest request;
    request.set_job_id(kJob);
    request.add_members(std::string(megabytes << 20, 'w'));
    request.set_generation(2);
    v1::SetMembersResponse response;
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineFromNow(absl::Seconds(10)));
    grpc::Status status = servers_[0]->control()->SetMembers(&ctx, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  }
  // Still serving, and the job is unchanged.
  std::vector<std::vector<float>> values;
  grpc::Status pulled = Pull(0, {FirstChunkOf(0)}, 0, &values, nullptr);
  EXPECT_OK(pulled);
}

TEST_F(PsServiceTest, ShutdownReleasesABlockedPull) {
  StartJob(v1::CONSISTENCY_SYNC);
  grpc::Status status;
  std::thread puller(
      [&] { status = Pull(0, {FirstChunkOf(0)}, 100, nullptr, nullptr, absl::Seconds(60)); });
  // The pull is parked in the shard, waiting for version 100.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (servers_[0]->shard().stats().waiting_pulls == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(servers_[0]->shard().stats().waiting_pulls, 1);
  const absl::Time start = absl::Now();
  servers_.clear();  // Shuts both servers down.
  puller.join();
  EXPECT_FALSE(status.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// Pull compression over the wire: a client that offers the version it
// holds gets F16 deltas (half the bytes) that rebuild, bit for bit, what a
// client holding nothing gets whole; a request whose held versions do not
// match its chunks is refused.
TEST_F(PsServiceTest, PullCompressionSendsDeltasThatRebuildTheValues) {
  pull_compression_.set_method(v1::CompressionSpec::COMPRESSION_FP16);
  StartJob(v1::CONSISTENCY_SYNC);
  const int id = FirstChunkOf(0);
  const int64_t n = plan_.chunks[id].count;
  // One pull request of chunk `id` at `min_version`, offering `held` of `epoch`.
  auto pull = [&](int64_t min_version, std::vector<int64_t> held, uint64_t epoch,
                  std::vector<grpc::ByteBuffer>* replies) {
    v1::ChunkHeader h = PullHeader({id}, min_version);
    for (int64_t v : held) h.add_held_versions(v);
    h.set_held_epoch(epoch);
    return RawCall::Run(servers_[0]->stub(), kPullMethod, {Frame(h, {})}, replies);
  };
  std::vector<grpc::ByteBuffer> replies;
  ASSERT_OK(pull(0, {}, 0, &replies));
  ASSERT_EQ(replies.size(), 1u);
  v1::ChunkHeader header;
  PayloadView payload;
  ASSERT_OK(DecodeFrame(replies[0], &header, &payload));
  EXPECT_FALSE(header.delta());
  const uint64_t epoch = header.values_epoch();
  ASSERT_NE(epoch, 0u);
  std::vector<float> held(static_cast<size_t>(n));
  payload.CopyTo(held.data());

  std::vector<float> g(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[i] = 0.01f * static_cast<float>(i % 13) - 0.05f;
  ASSERT_OK(Push(0, {Frame(PushHeader(id), g)}));

  replies.clear();
  ASSERT_OK(pull(1, {0}, epoch, &replies));
  ASSERT_EQ(replies.size(), 1u);
  PayloadView delta;
  ASSERT_OK(DecodeFrame(replies[0], &header, &delta));
  EXPECT_TRUE(header.delta());
  EXPECT_EQ(header.version(), 1);
  EXPECT_EQ(header.dtype(), v1::DTYPE_F16);
  EXPECT_EQ(delta.size(), static_cast<size_t>(n) * 2);
  std::vector<uint8_t> bytes(delta.size());
  delta.CopyTo(bytes.data());
  std::vector<float> scratch;
  ASSERT_OK(AddEncodedDelta(header, bytes.data(), bytes.size(), absl::MakeSpan(held), &scratch));

  std::vector<std::vector<float>> whole;
  ASSERT_OK(Pull(0, {id}, 1, &whole, nullptr));
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_EQ(std::memcmp(whole[0].data(), held.data(), held.size() * 4), 0);
  // The F16 change is close to the F32 update (SGD lr 0.5).
  for (int64_t i = 0; i < n; ++i) {
    const ChunkInfo& c = plan_.chunks[id];
    EXPECT_NEAR(held[i], InitialParameterValues(graph_)[c.param][c.offset + i] - 0.5f * g[i],
                1e-4f);
  }

  // Malformed requests.
  EXPECT_EQ(pull(1, {0, 0}, epoch, nullptr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(pull(1, {-2}, epoch, nullptr).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A stale epoch gets the values whole.
  replies.clear();
  ASSERT_OK(pull(1, {0}, epoch + 1, &replies));
  ASSERT_OK(DecodeFrame(replies[0], &header, &payload));
  EXPECT_FALSE(header.delta());
  EXPECT_EQ(payload.size(), static_cast<size_t>(n) * 4);
}

}  // namespace
}  // namespace pstrain
