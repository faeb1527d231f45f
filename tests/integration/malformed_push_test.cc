// A raw gRPC client sends malformed pushes to a real pstrain-server process
// while a job is running: each gets the right status code with a clear
// message, and the master model's bytes are unchanged.
//
// The job's only worker is paused with SIGSTOP during the attack so that the
// model cannot change for any other reason; it resumes afterwards and the job
// still succeeds.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/rpc/channel.h"
#include "common/rpc/wire.h"
#include "gtest/gtest.h"
#include "pstrain/v1/service.grpc.pb.h"
#include "tests/integration/cluster.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::testing {
namespace {

// One client-streaming Push over the generic API with a completion queue:
// writes every frame, half-closes, reads the reply, returns the status.
grpc::Status RawPush(grpc::GenericStub& stub, const std::vector<grpc::ByteBuffer>& frames) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, kPushMethod, &cq);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](void* expect) {
    return cq.Next(&tag, &ok) && tag == expect && ok;
  };
  call->StartCall(reinterpret_cast<void*>(1));
  bool alive = step(reinterpret_cast<void*>(1));
  for (size_t i = 0; alive && i < frames.size(); ++i) {
    call->Write(frames[i], reinterpret_cast<void*>(2));
    alive = step(reinterpret_cast<void*>(2));
  }
  if (alive) {
    call->WritesDone(reinterpret_cast<void*>(3));
    step(reinterpret_cast<void*>(3));
    grpc::ByteBuffer reply;
    call->Read(&reply, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(5)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

grpc::ByteBuffer Frame(const v1::ChunkHeader& header, const void* data, size_t bytes) {
  grpc::ByteBuffer out;
  EXPECT_OK(EncodeFrame(header, data, bytes, &out, /*copy_payload=*/true));
  return out;
}

std::string ModelBytes(v1::ShardControl::Stub& control, const std::string& job_id) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::ReadChunksRequest request;
  request.set_job_id(job_id);
  auto reader = control.ReadChunks(&ctx, request);
  std::string bytes;
  v1::ChunkValues chunk;
  while (reader->Read(&chunk)) {
    bytes.append(reinterpret_cast<const char*>(chunk.values().data()),
                 chunk.values_size() * sizeof(float));
    for (const auto& slot : chunk.slots()) {
      bytes.append(reinterpret_cast<const char*>(slot.values().data()),
                   slot.values_size() * sizeof(float));
    }
  }
  grpc::Status status = reader->Finish();
  EXPECT_OK(status);
  return bytes;
}

TEST(MalformedPushTest, RejectedWithInvalidArgumentAndTheModelIsUntouched) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  LocalCluster cluster({.shards = 1, .workers = 1, .heartbeat_timeout_ms = 30000});
  ASSERT_TRUE(cluster.Start()) << cluster.Logs();
  std::string dir = absl::StrCat(::testing::TempDir(), "/malformed-", getpid());
  std::filesystem::create_directories(dir);
  std::string job = WriteFashionMnistJob(dir, 6400, 500, 3);
  CommandResult submit = cluster.Cli({"submit", job, "--workers", "1", "--mode", "sync", "--json"});
  ASSERT_EQ(submit.exit_code, 0) << submit.output;
  const std::string job_id = ParseJobStatus(submit.LastLine()).job_id();

  // Wait until training runs, then freeze the worker.
  std::string worker_id;
  absl::Time deadline = absl::Now() + absl::Minutes(3);
  while (absl::Now() < deadline) {
    auto s = ParseJobStatus(cluster.Cli({"status", job_id, "--json"}).LastLine());
    if (s.step() >= 5 && s.workers_size() == 1) {
      worker_id = s.workers(0);
      break;
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_FALSE(worker_id.empty()) << cluster.Logs();
  cluster.worker(0).Kill(SIGSTOP);
  absl::SleepFor(absl::Milliseconds(500));  // Let in-flight pushes land.

  // The test pushes as the frozen worker (its credential, made with the
  // cluster's peer token) and reads the model as a peer server would.
  grpc::GenericStub stub(
      CreateChannel(cluster.coordinator(), cluster.ClientOptions(Role::kWorker, worker_id)));
  auto control = v1::ShardControl::NewStub(
      CreateChannel(cluster.coordinator(), cluster.ClientOptions(Role::kPeer)));
  const std::string before = ModelBytes(*control, job_id);
  ASSERT_FALSE(before.empty());

  v1::ChunkHeader good;
  good.set_job_id(job_id);
  good.set_worker_id(worker_id);
  good.set_generation(1);
  good.set_chunk_id(1);  // conv1/bias: 32 floats.
  good.set_kind(v1::ChunkHeader::KIND_GRADIENT);
  good.set_dtype(v1::DTYPE_F32);
  good.set_num_elements(32);
  good.set_version(0);
  std::vector<float> values(32, 0.01f);

  struct Case {
    const char* what;
    v1::ChunkHeader header;
    std::vector<char> payload;
    grpc::StatusCode code;
  };
  auto bytes_of = [](const std::vector<float>& v) {
    return std::vector<char>(reinterpret_cast<const char*>(v.data()),
                             reinterpret_cast<const char*>(v.data() + v.size()));
  };
  std::vector<Case> cases;
  {
    Case c{"wrong byte count", good, bytes_of(values), grpc::StatusCode::INVALID_ARGUMENT};
    c.payload.resize(c.payload.size() - 4);
    cases.push_back(c);
  }
  {
    Case c{"wrong element count", good, bytes_of(std::vector<float>(31, 0.f)),
           grpc::StatusCode::INVALID_ARGUMENT};
    c.header.set_num_elements(31);
    cases.push_back(c);
  }
  {
    Case c{"wrong dtype", good, bytes_of(values), grpc::StatusCode::INVALID_ARGUMENT};
    c.header.set_dtype(v1::DTYPE_I32);
    cases.push_back(c);
  }
  {
    std::vector<float> nan = values;
    nan[7] = std::numeric_limits<float>::quiet_NaN();
    cases.push_back({"non-finite gradient", good, bytes_of(nan), grpc::StatusCode::INVALID_ARGUMENT});
  }
  {
    Case c{"version from the future", good, bytes_of(values), grpc::StatusCode::INVALID_ARGUMENT};
    c.header.set_version(1000000);
    cases.push_back(c);
  }
  {
    Case c{"chunk out of range", good, bytes_of(values), grpc::StatusCode::INVALID_ARGUMENT};
    c.header.set_chunk_id(100000);
    cases.push_back(c);
  }
  {
    Case c{"unknown job", good, bytes_of(values), grpc::StatusCode::NOT_FOUND};
    c.header.set_job_id("job-999");
    cases.push_back(c);
  }
  // Compressed gradients (common/rpc/gradient_codec.h), validated as
  // strictly as raw F32.
  auto topk = [&](std::vector<uint32_t> indices, std::vector<float> vals) {
    Case c{"", good, {}, grpc::StatusCode::INVALID_ARGUMENT};
    c.header.set_encoding(v1::ChunkHeader::ENCODING_TOPK);
    c.header.set_encoded_count(static_cast<int64_t>(indices.size()));
    c.payload.resize(indices.size() * 8);
    std::memcpy(c.payload.data(), indices.data(), indices.size() * 4);
    std::memcpy(c.payload.data() + indices.size() * 4, vals.data(), vals.size() * 4);
    return c;
  };
  auto sign = [&](float scale, uint8_t last_byte) {
    Case c{"", good, std::vector<char>(4 + 4, 0), grpc::StatusCode::INVALID_ARGUMENT};
    c.header.set_encoding(v1::ChunkHeader::ENCODING_SIGN);
    std::memcpy(c.payload.data(), &scale, 4);
    c.payload[7] = static_cast<char>(last_byte);
    return c;
  };
  {
    Case c = topk({3, 32}, {0.1f, 0.2f});
    c.what = "top-k index beyond the chunk";
    cases.push_back(c);
  }
  {
    Case c = topk({5, 5}, {0.1f, 0.2f});
    c.what = "top-k index repeated";
    cases.push_back(c);
  }
  {
    Case c = topk({1, 2}, {0.1f, std::numeric_limits<float>::infinity()});
    c.what = "top-k value not finite";
    cases.push_back(c);
  }
  {
    Case c = topk({1, 2}, {0.1f, 0.2f});
    c.what = "top-k count beyond the chunk";
    c.header.set_encoded_count(33);
    c.payload.resize(33 * 8);
    cases.push_back(c);
  }
  {
    Case c = topk({1, 2}, {0.1f, 0.2f});
    c.what = "top-k parameters (only gradients may be encoded)";
    c.header.set_kind(v1::ChunkHeader::KIND_PARAMETERS);
    cases.push_back(c);
  }
  {
    Case c = sign(std::numeric_limits<float>::quiet_NaN(), 0);
    c.what = "sign scale not finite";
    cases.push_back(c);
  }
  {
    Case c = sign(-0.5f, 0);
    c.what = "sign scale negative";
    cases.push_back(c);
  }
  {
    Case c = sign(0.5f, 0);
    c.what = "sign payload one byte short";
    c.payload.pop_back();
    cases.push_back(c);
  }
  {
    Case c = sign(0.5f, 0);
    c.what = "unknown encoding";
    c.header.set_encoding(static_cast<v1::ChunkHeader::Encoding>(77));
    cases.push_back(c);
  }
  {
    // 32 elements fill 4 sign bytes exactly; a 31-element chunk claim with
    // the same bytes leaves bit 31 as padding, set here.
    Case c = sign(0.5f, 0x80);
    c.what = "sign padding bit set (and a wrong element count)";
    c.header.set_num_elements(31);
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    grpc::Status status = RawPush(stub, {Frame(c.header, c.payload.data(), c.payload.size())});
    EXPECT_EQ(status.error_code(), c.code) << c.what << ": " << status.error_message();
    EXPECT_FALSE(status.error_message().empty()) << c.what;
  }
  {
    // Oversized stream: a frame far beyond the largest chunk.
    std::vector<char> huge(kMaxFrameBytes + 1024, 0);
    v1::ChunkHeader h = good;
    h.set_num_elements(static_cast<int64_t>(huge.size() / 4));
    grpc::Status status = RawPush(stub, {Frame(h, huge.data(), huge.size())});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  }
  {
    // Garbage that is not a frame at all.
    std::string junk = "\xff\xff\xff\x7fnot a frame";
    grpc::Slice slice(junk);
    grpc::ByteBuffer buffer(&slice, 1);
    grpc::Status status = RawPush(stub, {buffer});
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  }

  EXPECT_EQ(ModelBytes(*control, job_id), before) << "a rejected push changed the model";

  cluster.worker(0).Kill(SIGCONT);
  CommandResult watch = cluster.Cli({"watch", job_id}, absl::Minutes(8));
  EXPECT_EQ(watch.exit_code, 0) << watch.output << cluster.Logs();
}

}  // namespace
}  // namespace pstrain::testing
