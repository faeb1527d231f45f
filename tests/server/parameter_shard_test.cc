// Tests for server/parameter_shard.{h,cc}: the semantics of every consistency
// mode with exact numbers (references computed with the same Optimizer on the
// same CPU backend configuration), the server-side optimizer state, every
// validation error with the model checked byte for byte, multi-shard plans,
// and a multi-threaded sync run.
#include "server/parameter_shard.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "common/rpc/gradient_codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optimizer.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::pstrain::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr absl::Duration kLongWait = absl::Seconds(20);

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

// input [4] -> fc (dense 3) -> bn (batch norm) -> logits (dense 2) -> loss.
// Trainable: fc/weight (12), fc/bias, bn/gamma, bn/beta (3 each), logits/weight
// (6), logits/bias (2). Non-trainable: bn/running_mean, bn/running_var.
v1::ModelSpec TinyModel() {
  v1::ModelSpec model;
  model.set_name("tiny");
  model.add_input_shape(4);
  model.set_num_classes(2);
  model.set_init_seed(7);
  v1::LayerSpec* fc = model.add_layers();
  fc->set_name("fc");
  fc->mutable_dense()->set_units(3);
  v1::LayerSpec* bn = model.add_layers();
  bn->set_name("bn");
  bn->mutable_batch_norm();
  v1::LayerSpec* logits = model.add_layers();
  logits->set_name("logits");
  logits->mutable_dense()->set_units(2);
  model.add_layers()->set_name("loss");
  model.mutable_layers(3)->mutable_softmax_cross_entropy();
  return model;
}

v1::OptimizerSpec Sgd(float lr, float momentum = 0.f) {
  v1::OptimizerSpec spec;
  spec.set_type(v1::OPTIMIZER_SGD);
  spec.set_learning_rate(lr);
  spec.set_momentum(momentum);
  return spec;
}

v1::OptimizerSpec Adam(float lr) {
  v1::OptimizerSpec spec;
  spec.set_type(v1::OPTIMIZER_ADAM);
  spec.set_learning_rate(lr);
  return spec;
}

// A job on the tiny model, with its plan and initial values as the
// coordinator computes them.
struct TestJob {
  ShardJobConfig config;
  ModelGraph graph;
  ChunkPlan plan;
  std::vector<std::vector<float>> params;  // InitialParameterValues.

  // The id of piece `piece` of parameter `name`.
  int ChunkOf(const std::string& name, int piece = 0) const {
    for (size_t p = 0; p < graph.params.size(); ++p) {
      if (graph.params[p].name == name) return plan.by_param[p].at(piece);
    }
    ADD_FAILURE() << "no parameter " << name;
    return -1;
  }
  int64_t Count(int chunk) const { return plan.chunks.at(chunk).count; }
  std::vector<float> Initial(int chunk) const {
    const ChunkInfo& c = plan.chunks.at(chunk);
    const std::vector<float>& p = params[c.param];
    return std::vector<float>(p.begin() + c.offset, p.begin() + c.offset + c.count);
  }
  std::vector<v1::ChunkValues> InitialChunks(int shard) const {
    std::vector<v1::ChunkValues> out;
    for (int id : plan.by_shard.at(shard)) {
      v1::ChunkValues& v = out.emplace_back();
      v.set_chunk_id(id);
      std::vector<float> init = Initial(id);
      v.mutable_values()->Assign(init.begin(), init.end());
    }
    return out;
  }
  PushArgs Args(const std::string& worker, int chunk, int64_t version,
                v1::ChunkHeader::Kind kind = v1::ChunkHeader::KIND_GRADIENT) const {
    PushArgs args;
    args.job_id = config.job_id;
    args.worker_id = worker;
    args.generation = config.generation;
    args.chunk_id = chunk;
    args.version = version;
    args.kind = kind;
    return args;
  }
  PullArgs PullOf(const std::string& worker, int chunk, int64_t min_version) const {
    PullArgs args;
    args.job_id = config.job_id;
    args.worker_id = worker;
    args.generation = config.generation;
    args.chunk_id = chunk;
    args.min_version = min_version;
    return args;
  }
};

TestJob MakeJob(v1::ConsistencyMode mode, const v1::OptimizerSpec& optimizer,
                std::vector<std::string> members, int num_shards = 1,
                int64_t chunk_bytes = kDefaultChunkBytes) {
  TestJob job;
  job.config.job_id = "job-1";
  v1::JobSpec& spec = job.config.spec;
  *spec.mutable_model() = TinyModel();
  spec.mutable_dataset()->set_format(v1::DATASET_FORMAT_SYNTHETIC);
  *spec.mutable_optimizer() = optimizer;
  spec.set_epochs(1);
  spec.set_batch_size(8);
  spec.set_mode(mode);
  if (mode == v1::CONSISTENCY_AVERAGE) spec.set_averaging_frequency(5);
  job.config.num_shards = num_shards;
  job.config.chunk_bytes = chunk_bytes;
  job.config.members = std::move(members);
  job.config.generation = 1;
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(spec.model());
  EXPECT_OK(graph);
  job.graph = *graph;
  absl::StatusOr<ChunkPlan> plan = PlanChunks(job.graph, num_shards, chunk_bytes);
  EXPECT_OK(plan);
  job.plan = *plan;
  job.params = InitialParameterValues(job.graph);
  return job;
}

std::vector<float> Ramp(int64_t n, float start, float step) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = start + step * static_cast<float>(i);
  return v;
}

std::vector<float> Values(const PulledChunk& pulled) { return *pulled.values; }

bool BitIdentical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Everything ReadChunks reports (values, versions, optimizer slots) as bytes.
std::string ModelBytes(ParameterShard& shard, const std::string& job_id) {
  absl::StatusOr<std::vector<v1::ChunkValues>> chunks = shard.ReadChunks(job_id);
  EXPECT_OK(chunks);
  std::string out;
  if (!chunks.ok()) return out;
  for (const v1::ChunkValues& c : *chunks) out += c.SerializeAsString();
  return out;
}

// The server's update computed independently: one Optimizer on a one-thread
// CPU backend, as the shard uses.
class ReferenceOptimizer {
 public:
  ReferenceOptimizer(const v1::OptimizerSpec& spec, int64_t count) : count_(count) {
    CpuBackendOptions options;
    options.num_threads = 1;
    backend_ = CreateCpuBackend(options);
    auto opt = Optimizer::Create(spec, backend_.get());
    EXPECT_OK(opt);
    optimizer_ = *std::move(opt);
    EXPECT_OK(optimizer_->AddParameter("p", count));
  }
  // param -= update(grad) at iteration `step`.
  void Apply(std::vector<float>& param, const std::vector<float>& grad, int64_t step) {
    ASSERT_OK(optimizer_->Apply(0, param.data(), grad.data(), step));
  }
  std::vector<float> State(int slot) {
    Tensor* t = optimizer_->StateTensors().at(slot).second;
    return std::vector<float>(t->data(), t->data() + count_);
  }

 private:
  int64_t count_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Optimizer> optimizer_;
};

std::vector<float> Mean(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = (a[i] + b[i]) / 2.f;
  return out;
}

// True once `shard` counts `n` calls waiting in `gauge` (admitted, their
// caller checked, and parked for a version, a barrier or a clock), within
// kLongWait: the positive condition a test waits for before it checks that a
// pull is still held.
bool AwaitWaiting(const ParameterShard& shard, int64_t n,
                  int64_t ShardStats::*gauge = &ShardStats::waiting_pulls) {
  const absl::Time deadline = absl::Now() + kLongWait;
  while (shard.stats().*gauge != n) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

// Runs Pull on a thread so that a test can check that it blocks.
class AsyncPull {
 public:
  AsyncPull(ParameterShard& shard, PullArgs args, absl::Duration timeout = kLongWait) {
    thread_ = std::thread([this, &shard, args, timeout] {
      absl::StatusOr<PulledChunk> result = shard.Pull(args, absl::Now() + timeout);
      std::lock_guard<std::mutex> lock(mu_);
      result_ = std::move(result);
      done_ = true;
      cv_.notify_all();
    });
  }
  ~AsyncPull() {
    if (thread_.joinable()) thread_.join();
  }
  // True once the pull has returned.
  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  absl::StatusOr<PulledChunk> Get() {
    thread_.join();
    return result_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  absl::StatusOr<PulledChunk> result_ = absl::UnknownError("not run");
  std::thread thread_;
};

// ---------------------------------------------------------------------------
// Exactly-once pushes (update ids)
// ---------------------------------------------------------------------------

// `args` with an update id.
PushArgs WithId(PushArgs args, uint64_t incarnation, int64_t update_seq) {
  args.incarnation = incarnation;
  args.update_seq = update_seq;
  return args;
}

struct ModeCase {
  v1::ConsistencyMode mode;
  v1::ChunkHeader::Kind kind;
};

class ExactlyOnceTest : public ::testing::TestWithParam<ModeCase> {};

// Every mode: the same update delivered three times (a client retry after a
// cut stream) changes the model exactly as one delivery does, and the
// repeats are acknowledged with the chunk's version.
TEST_P(ExactlyOnceTest, ARepeatedUpdateIsAppliedOnce) {
  const ModeCase mode = GetParam();
  auto run = [&](int deliveries, ShardStats* stats) {
    TestJob job = MakeJob(mode.mode, Sgd(0.25f, 0.5f), {"worker-a", "worker-b"});
    ParameterShard shard({});
    EXPECT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
    const int chunk = job.ChunkOf("fc/weight");
    const std::vector<float> ga = Ramp(job.Count(chunk), 0.5f, 0.125f);
    const std::vector<float> gb = Ramp(job.Count(chunk), -1.f, 0.25f);
    for (int d = 0; d < deliveries; ++d) {
      absl::StatusOr<int64_t> v =
          shard.Push(WithId(job.Args("worker-a", chunk, 0, mode.kind), 77, 1), ga);
      EXPECT_OK(v.status());
    }
    for (int d = 0; d < deliveries; ++d) {
      absl::StatusOr<int64_t> v =
          shard.Push(WithId(job.Args("worker-b", chunk, 0, mode.kind), 88, 1), gb);
      EXPECT_OK(v.status());
      if (v.ok() && mode.mode != v1::CONSISTENCY_ASYNC && mode.mode != v1::CONSISTENCY_SSP) {
        EXPECT_EQ(*v, 1);  // The barrier completed once; a repeat sees its version.
      }
    }
    *stats = shard.stats();
    return ModelBytes(shard, job.config.job_id);
  };
  ShardStats once, thrice;
  const std::string expected = run(1, &once);
  EXPECT_EQ(run(3, &thrice), expected);
  EXPECT_EQ(thrice.applied_updates, once.applied_updates);
  EXPECT_EQ(thrice.duplicate_pushes, 4);
  EXPECT_EQ(once.duplicate_pushes, 0);
  EXPECT_EQ(thrice.rejected_pushes, 0);
}

INSTANTIATE_TEST_SUITE_P(
    AllModes, ExactlyOnceTest,
    ::testing::Values(ModeCase{v1::CONSISTENCY_SYNC, v1::ChunkHeader::KIND_GRADIENT},
                      ModeCase{v1::CONSISTENCY_ASYNC, v1::ChunkHeader::KIND_GRADIENT},
                      ModeCase{v1::CONSISTENCY_SSP, v1::ChunkHeader::KIND_GRADIENT},
                      ModeCase{v1::CONSISTENCY_AVERAGE, v1::ChunkHeader::KIND_PARAMETERS}),
    [](const ::testing::TestParamInfo<ModeCase>& info) {
      const std::string name = v1::ConsistencyMode_Name(info.param.mode);  // CONSISTENCY_SYNC
      return name.substr(name.find('_') + 1);
    });

// A retry that arrives after the sync step it belonged to completed (the
// version moved on) is acknowledged, not refused as stale.
TEST(ExactlyOnceSyncTest, ARetryAfterTheStepCompletedIsAcknowledged) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  ASSERT_OK(shard.Push(WithId(job.Args("worker-a", chunk, 0), 5, 1), {1.f, 2.f, 3.f}).status());
  ASSERT_EQ(*shard.Push(WithId(job.Args("worker-b", chunk, 0), 6, 1), {3.f, 2.f, 1.f}), 1);
  const std::string after_step = ModelBytes(shard, job.config.job_id);
  absl::StatusOr<int64_t> retry =
      shard.Push(WithId(job.Args("worker-a", chunk, 0), 5, 1), {1.f, 2.f, 3.f});
  ASSERT_OK(retry.status());
  EXPECT_EQ(*retry, 1);
  EXPECT_EQ(ModelBytes(shard, job.config.job_id), after_step);
  // Without an update id the same late push is stale, as before.
  EXPECT_THAT(shard.Push(job.Args("worker-a", chunk, 0), {1.f, 2.f, 3.f}).status(),
              StatusIs(absl::StatusCode::kAborted, HasSubstr("stale")));
}

// Regression (issue 9): a worker that resynchronised after a failed step
// pushed its new gradient for the barrier it had already joined, got
// INVALID_ARGUMENT "duplicate push", and the job failed. With update ids its
// first gradient for that version stands and the newer one is acknowledged.
TEST(ExactlyOnceSyncTest, ANewerUpdateForABarrierAlreadyJoinedIsAcknowledged) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  const std::vector<float> ga = {1.f, 2.f, 3.f}, gb = {3.f, 2.f, 1.f};
  ASSERT_OK(shard.Push(WithId(job.Args("worker-a", chunk, 0), 5, 1), ga).status());
  ASSERT_OK(shard.Push(WithId(job.Args("worker-a", chunk, 0), 5, 2), {9.f, 9.f, 9.f}).status());
  ASSERT_EQ(*shard.Push(WithId(job.Args("worker-b", chunk, 0), 6, 1), gb), 1);
  std::vector<float> expected = job.Initial(chunk);
  ReferenceOptimizer reference(Sgd(0.1f), 3);
  reference.Apply(expected, Mean(ga, gb), 0);
  absl::StatusOr<PulledChunk> pulled = shard.Pull(job.PullOf("worker-a", chunk, 1), absl::Now());
  ASSERT_OK(pulled.status());
  EXPECT_TRUE(BitIdentical(Values(*pulled), expected));
  EXPECT_EQ(shard.stats().duplicate_pushes, 1);
  EXPECT_EQ(shard.stats().rejected_pushes, 0);
}

// A new incarnation of a member (a new run of the worker) starts its own
// sequence: its update 1 is not mistaken for the old incarnation's.
TEST(ExactlyOnceAsyncTest, ANewIncarnationIsNotADuplicate) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.5f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  ASSERT_EQ(*shard.Push(WithId(job.Args("worker-a", chunk, 0), 1, 7), {1.f, 1.f, 1.f}), 1);
  ASSERT_EQ(*shard.Push(WithId(job.Args("worker-a", chunk, 1), 2, 1), {1.f, 1.f, 1.f}), 2);
  ASSERT_EQ(*shard.Push(WithId(job.Args("worker-a", chunk, 2), 2, 1), {1.f, 1.f, 1.f}), 2);
  EXPECT_EQ(shard.stats().applied_updates, 2);
  EXPECT_EQ(shard.stats().duplicate_pushes, 1);
  // A negative sequence number is refused.
  EXPECT_THAT(shard.Push(WithId(job.Args("worker-a", chunk, 2), 2, -1), {1.f, 1.f, 1.f}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("update_seq")));
}

// The records are bounded by the member set: a member removed and added
// back starts afresh.
TEST(ExactlyOnceAsyncTest, SetMembersForgetsTheRecordsOfFormerMembers) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.5f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  ASSERT_EQ(*shard.Push(WithId(job.Args("worker-b", chunk, 0), 3, 4), {1.f, 1.f, 1.f}), 1);
  ASSERT_OK(shard.SetMembers(job.config.job_id, {"worker-a"}, 2));
  ASSERT_OK(shard.SetMembers(job.config.job_id, {"worker-a", "worker-b"}, 3));
  PushArgs again = WithId(job.Args("worker-b", chunk, 1), 3, 4);
  again.generation = 3;
  ASSERT_EQ(*shard.Push(again, {1.f, 1.f, 1.f}), 2);
  EXPECT_EQ(shard.stats().duplicate_pushes, 0);
}

// ---------------------------------------------------------------------------
// Consistent cuts (checkpoints at one model version)
// ---------------------------------------------------------------------------

// The chunk `id` of a ReadChunks result.
const v1::ChunkValues* FindChunk(const std::vector<v1::ChunkValues>& chunks, int id) {
  for (const v1::ChunkValues& c : chunks) {
    if (c.chunk_id() == id) return &c;
  }
  return nullptr;
}

// Issue 9: a checkpoint read chunk by chunk while training went on mixed
// versions. A cut at version 1 returns every chunk as it was at version 1:
// a chunk already there now, a chunk still below it when an update brings
// it there, and never a later state.
TEST(ParameterShardCutTest, ACutReturnsEveryChunkAsItWasAtTheVersion) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.5f, 0.9f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int a = job.ChunkOf("fc/bias"), b = job.ChunkOf("logits/bias");
  // Every chunk but b reaches version 1.
  auto push = [&](int chunk, int64_t version, float value) {
    const v1::ChunkHeader::Kind kind = job.graph.params[job.plan.chunks[chunk].param].trainable
                                           ? v1::ChunkHeader::KIND_GRADIENT
                                           : v1::ChunkHeader::KIND_PARAMETERS;
    return shard.Push(job.Args("worker-a", chunk, version, kind),
                      std::vector<float>(job.Count(chunk), value));
  };
  for (int c : job.plan.by_shard[0]) {
    if (c != b) {
      ASSERT_EQ(*push(c, 0, 1.f), 1);
    }
  }
  ASSERT_OK_AND_ASSIGN(std::vector<v1::ChunkValues> a_at_1, shard.ReadChunks(job.config.job_id));
  std::vector<v1::ChunkValues> cut;
  absl::Status cut_status;
  std::thread reader([&] {
    absl::StatusOr<std::vector<v1::ChunkValues>> r =
        shard.ReadChunks(job.config.job_id, {.at_version = 1}, absl::Now() + kLongWait);
    cut_status = r.status();
    if (r.ok()) cut = *std::move(r);
  });
  // The cut waits for chunk b.
  ASSERT_TRUE(AwaitWaiting(shard, 1, &ShardStats::waiting_cuts));
  // Chunk b reaches version 1 (captured then); then both move on to 2.
  ASSERT_EQ(*push(b, 0, 2.f), 1);
  ASSERT_OK_AND_ASSIGN(std::vector<v1::ChunkValues> b_at_1, shard.ReadChunks(job.config.job_id));
  reader.join();
  ASSERT_OK(cut_status);
  for (int c : job.plan.by_shard[0]) ASSERT_EQ(*push(c, 1, 3.f), 2);
  for (const v1::ChunkValues& c : cut) {
    EXPECT_EQ(c.version(), 1) << "chunk " << c.chunk_id();
    if (c.chunk_id() != a && c.chunk_id() != b) continue;
    const v1::ChunkValues* expected = FindChunk(c.chunk_id() == a ? a_at_1 : b_at_1, c.chunk_id());
    ASSERT_NE(expected, nullptr);
    EXPECT_EQ(c.SerializeAsString(), expected->SerializeAsString()) << "chunk " << c.chunk_id();
    EXPECT_EQ(c.slots_size(), 1);  // The momentum as it was at version 1.
  }
}

TEST(ParameterShardCutTest, ACutOfAVersionAlreadyPassedOrNeverReachedFails) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.5f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int a = job.ChunkOf("fc/bias");
  ASSERT_EQ(*shard.Push(job.Args("worker-a", a, 0), {1.f, 1.f, 1.f}), 1);
  ASSERT_EQ(*shard.Push(job.Args("worker-a", a, 1), {1.f, 1.f, 1.f}), 2);
  EXPECT_THAT(shard.ReadChunks(job.config.job_id, {.at_version = 1}, absl::Now()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("past the cut")));
  EXPECT_THAT(
      shard.ReadChunks(job.config.job_id, {.at_version = 3}, absl::Now() + absl::Milliseconds(30))
          .status(),
      StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("not reached")));
  // Versions only: ids and versions, no values.
  ASSERT_OK_AND_ASSIGN(std::vector<v1::ChunkValues> versions,
                       shard.ReadChunks(job.config.job_id, {.versions_only = true}));
  const v1::ChunkValues* va = FindChunk(versions, a);
  ASSERT_NE(va, nullptr);
  EXPECT_EQ(va->version(), 2);
  EXPECT_EQ(va->values_size(), 0);
}

TEST(ParameterShardCutTest, AsyncJobsHaveNoCommonVersionToCutAt) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.5f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  EXPECT_THAT(shard.ReadChunks(job.config.job_id, {.at_version = 1}, absl::Now()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("async")));
}

// Issue 9: average mode without state averaging wrote all-zero optimizer
// slots into checkpoints. The server holds no state then, and reports none.
TEST(ParameterShardAverageTest, NoOptimizerStateIsInventedWithoutStateAveraging) {
  TestJob job = MakeJob(v1::CONSISTENCY_AVERAGE, Sgd(0.1f, 0.9f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  ASSERT_OK_AND_ASSIGN(std::vector<v1::ChunkValues> read, shard.ReadChunks(job.config.job_id));
  for (const v1::ChunkValues& c : read) EXPECT_EQ(c.slots_size(), 0) << "chunk " << c.chunk_id();
}

// ---------------------------------------------------------------------------
// sync
// ---------------------------------------------------------------------------

TEST(ParameterShardSyncTest, AppliesTheExactMeanOnceBothWorkersPushed) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  const std::vector<float> p0 = job.Initial(chunk);
  const std::vector<float> ga = Ramp(job.Count(chunk), 0.37f, 0.113f);
  const std::vector<float> gb = Ramp(job.Count(chunk), -1.91f, 0.271f);

  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0), ga), 0);
  // One of two pushed: version 0 unchanged, a pull for 1 times out.
  absl::StatusOr<PulledChunk> v0 = shard.Pull(job.PullOf("worker-a", chunk, 0), absl::Now());
  ASSERT_OK(v0);
  EXPECT_EQ(v0->version, 0);
  EXPECT_TRUE(BitIdentical(Values(*v0), p0));
  absl::StatusOr<PulledChunk> early =
      shard.Pull(job.PullOf("worker-a", chunk, 1), absl::Now() + absl::Milliseconds(30));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded) << early.status();
  EXPECT_EQ(shard.stats().applied_updates, 0);

  AsyncPull waiting(shard, job.PullOf("worker-a", chunk, 1));
  ASSERT_TRUE(AwaitWaiting(shard, 1));
  EXPECT_FALSE(waiting.done());
  ASSERT_EQ(*shard.Push(job.Args("worker-b", chunk, 0), gb), 1);
  absl::StatusOr<PulledChunk> v1 = waiting.Get();
  ASSERT_OK(v1);
  EXPECT_EQ(shard.stats().waiting_pulls, 0);  // A gauge: the released pull left it.
  EXPECT_EQ(v1->version, 1);

  std::vector<float> expected = p0;
  ReferenceOptimizer reference(Sgd(0.1f), job.Count(chunk));
  reference.Apply(expected, Mean(ga, gb), /*step=*/0);
  EXPECT_TRUE(BitIdentical(Values(*v1), expected));
  for (size_t i = 0; i < p0.size(); ++i) {
    EXPECT_NEAR((*v1->values)[i], p0[i] - 0.1f * (ga[i] + gb[i]) / 2.f, 1e-6f) << i;
  }
  // The snapshot v0 still holds the old values: pulls return immutable data.
  EXPECT_TRUE(BitIdentical(Values(*v0), p0));
  EXPECT_EQ(shard.stats().applied_updates, 1);
  EXPECT_EQ(shard.stats().pushes, 2);
}

TEST(ParameterShardSyncTest, ThreeWorkersAverageInArrivalOrderWithExactDivision) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"w1", "w2", "w3"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  const int64_t n = job.Count(chunk);
  const std::vector<float> g1 = Ramp(n, 0.1f, 0.7f), g2 = Ramp(n, 1.3f, -0.9f),
                           g3 = Ramp(n, -0.2f, 0.31f);
  ASSERT_EQ(*shard.Push(job.Args("w2", chunk, 0), g2), 0);
  ASSERT_EQ(*shard.Push(job.Args("w3", chunk, 0), g3), 0);
  ASSERT_EQ(*shard.Push(job.Args("w1", chunk, 0), g1), 1);
  std::vector<float> mean(n);
  for (int64_t i = 0; i < n; ++i) mean[i] = ((g2[i] + g3[i]) + g1[i]) / 3.f;
  std::vector<float> expected = job.Initial(chunk);
  ReferenceOptimizer reference(Sgd(0.1f), n);
  reference.Apply(expected, mean, 0);
  absl::StatusOr<PulledChunk> pulled = shard.Pull(job.PullOf("w1", chunk, 1), absl::Now());
  ASSERT_OK(pulled);
  EXPECT_TRUE(BitIdentical(Values(*pulled), expected));
}

TEST(ParameterShardSyncTest, NonTrainableChunksTakeTheMeanOfTheMembers) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("bn/running_mean");
  const std::vector<float> a = {1.f, 2.f, 3.f}, b = {0.5f, -2.f, 10.f};
  EXPECT_EQ(shard.Push(job.Args("worker-a", chunk, 0), a).status().code(),
            absl::StatusCode::kInvalidArgument);  // A gradient for running stats.
  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0, v1::ChunkHeader::KIND_PARAMETERS), a), 0);
  ASSERT_EQ(*shard.Push(job.Args("worker-b", chunk, 0, v1::ChunkHeader::KIND_PARAMETERS), b), 1);
  absl::StatusOr<PulledChunk> pulled = shard.Pull(job.PullOf("worker-b", chunk, 1), absl::Now());
  ASSERT_OK(pulled);
  EXPECT_THAT(Values(*pulled), ElementsAreArray({0.75f, 0.f, 6.5f}));
}

TEST(ParameterShardSyncTest, DroppingAMemberCompletesThePendingStep) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("logits/weight");
  const std::vector<float> ga = Ramp(job.Count(chunk), 0.5f, 0.25f);
  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0), ga), 0);

  AsyncPull survivor(shard, job.PullOf("worker-a", chunk, 1));
  AsyncPull dead(shard, job.PullOf("worker-b", chunk, 1));
  ASSERT_TRUE(AwaitWaiting(shard, 2));
  EXPECT_FALSE(survivor.done());
  EXPECT_FALSE(dead.done());
  ASSERT_OK(shard.SetMembers(job.config.job_id, {"worker-a"}, 2));

  absl::StatusOr<PulledChunk> after = survivor.Get();
  ASSERT_OK(after);
  EXPECT_EQ(after->version, 1);
  std::vector<float> expected = job.Initial(chunk);
  ReferenceOptimizer reference(Sgd(0.1f), job.Count(chunk));
  reference.Apply(expected, ga, 0);  // The mean over the one remaining pusher.
  EXPECT_TRUE(BitIdentical(Values(*after), expected));

  absl::StatusOr<PulledChunk> removed = dead.Get();
  EXPECT_EQ(removed.status().code(), absl::StatusCode::kAborted) << removed.status();
  EXPECT_THAT(removed.status().message(), HasSubstr("worker-b was removed from job job-1"));

  // The removed worker's next push: stale generation, then not a member.
  PushArgs old_generation = job.Args("worker-b", chunk, 1);
  EXPECT_EQ(shard.Push(old_generation, ga).status().code(), absl::StatusCode::kAborted);
  PushArgs new_generation = old_generation;
  new_generation.generation = 2;
  absl::Status not_member = shard.Push(new_generation, ga).status();
  EXPECT_EQ(not_member.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(not_member.message(), HasSubstr("worker worker-b is not a member of job job-1"));

  // The survivor alone drives the next step.
  PushArgs next = job.Args("worker-a", chunk, 1);
  next.generation = 2;
  EXPECT_EQ(*shard.Push(next, ga), 2);
}

// The bucket of ShardStats::barrier_wait_counts that holds `seconds`.
size_t BarrierWaitBucket(double seconds) {
  return std::lower_bound(std::begin(kBarrierWaitBounds), std::end(kBarrierWaitBounds), seconds) -
         std::begin(kBarrierWaitBounds);
}

// A shard whose barrier waits are timed by `*now`.
std::unique_ptr<ParameterShard> ShardOnClock(const absl::Time* now) {
  ParameterShard::Options options;
  options.clock = [now] { return *now; };
  return std::make_unique<ParameterShard>(options);
}

TEST(ParameterShardSyncTest, BarrierWaitsRunFromTheFirstMembersPushToTheLast) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b", "worker-c"});
  absl::Time now = absl::UnixEpoch();
  std::unique_ptr<ParameterShard> owned = ShardOnClock(&now);
  ParameterShard& shard = *owned;
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("logits/weight");
  const std::vector<float> g = Ramp(job.Count(chunk), 0.5f, 0.25f);

  // Step 0: b 100 ms after a, c 200 ms after b: the barrier waited 300 ms.
  ASSERT_OK(shard.Push(job.Args("worker-a", chunk, 0), g));
  now += absl::Milliseconds(100);
  ASSERT_OK(shard.Push(job.Args("worker-b", chunk, 0), g));
  EXPECT_EQ(shard.stats().barrier_wait_seconds, 0);  // Still open.
  now += absl::Milliseconds(200);
  ASSERT_EQ(*shard.Push(job.Args("worker-c", chunk, 0), g), 1);
  // Step 1: c is never heard from again; removing it 3 s after a's push
  // completes the barrier, which therefore waited 3 s.
  now += absl::Seconds(10);  // Between steps: not a wait.
  ASSERT_OK(shard.Push(job.Args("worker-a", chunk, 1), g));
  ASSERT_OK(shard.Push(job.Args("worker-b", chunk, 1), g));
  now += absl::Seconds(3);
  ASSERT_OK(shard.SetMembers(job.config.job_id, {"worker-a", "worker-b"}, 2));

  const ShardStats stats = shard.stats();
  std::vector<int64_t> expected(std::size(kBarrierWaitBounds) + 1, 0);
  ++expected[BarrierWaitBucket(0.3)];  // (0.2, 0.5]
  ++expected[BarrierWaitBucket(3.0)];  // (2, 5]
  EXPECT_EQ(stats.barrier_wait_counts, expected);
  EXPECT_DOUBLE_EQ(stats.barrier_wait_seconds, 3.3);
}

TEST(ParameterShardSyncTest, ASingleMembersBarriersDoNotWait) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  absl::Time now = absl::UnixEpoch();
  std::unique_ptr<ParameterShard> owned = ShardOnClock(&now);
  ParameterShard& shard = *owned;
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("logits/weight");
  for (int64_t step = 0; step < 3; ++step) {
    now += absl::Seconds(1);
    ASSERT_OK(shard.Push(job.Args("worker-a", chunk, step), Ramp(job.Count(chunk), 1, 0)));
  }
  EXPECT_EQ(shard.stats().barrier_wait_counts[0], 3);
  EXPECT_EQ(shard.stats().barrier_wait_seconds, 0);
}

TEST(ParameterShardAsyncTest, AsyncPushesOpenNoBarrier) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("logits/weight");
  ASSERT_OK(shard.Push(job.Args("worker-a", chunk, 0), Ramp(job.Count(chunk), 1, 0)));
  ASSERT_OK(shard.Push(job.Args("worker-b", chunk, 0), Ramp(job.Count(chunk), 1, 0)));
  EXPECT_EQ(shard.stats().barrier_wait_counts,
            std::vector<int64_t>(std::size(kBarrierWaitBounds) + 1, 0));
}

// Counts AllowanceChanged calls.
class CountingWatcher final : public PaceWatcher {
 public:
  void AllowanceChanged() override { ++calls; }
  std::atomic<int> calls{0};
};

TEST(ParameterShardPacingTest, AMemberMayRunTheLeadAheadOfTheSlowestAndIsToldWhenItMovesOn) {
  // fc/weight in 6 chunks of 2 floats: frames enough to run ahead.
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b", "worker-c"},
                        /*num_shards=*/1, /*chunk_bytes=*/8);
  ParameterShard shard({.pace_lead_frames = 2});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  auto watcher = std::make_shared<CountingWatcher>();
  ASSERT_OK_AND_ASSIGN(const bool paced, shard.WatchPace(job.config.job_id, watcher));
  ASSERT_TRUE(paced);
  auto push = [&](const std::string& worker, int piece) {
    const int chunk = job.ChunkOf("fc/weight", piece);
    ASSERT_OK(shard.Push(job.Args(worker, chunk, 0), Ramp(job.Count(chunk), 1, 0)));
  };
  auto slack = [&](const std::string& worker) {
    return *shard.PaceSlack(job.config.job_id, worker, /*version=*/0);
  };
  EXPECT_EQ(slack("worker-a"), 2);  // Nobody has pushed: the lead.
  push("worker-a", 0);
  push("worker-a", 1);
  EXPECT_EQ(slack("worker-a"), 0);  // Two ahead of b and c.
  EXPECT_EQ(slack("worker-b"), 2);
  push("worker-b", 0);
  EXPECT_EQ(watcher->calls.load(), 0);  // c, the slowest, has not moved.
  push("worker-c", 0);
  EXPECT_EQ(watcher->calls.load(), 1);  // Now all have pushed one.
  EXPECT_EQ(slack("worker-a"), 1);
  EXPECT_EQ(slack("worker-c"), 2);
  // Removing the two slow members leaves a alone: it is the slowest.
  ASSERT_OK(shard.SetMembers(job.config.job_id, {"worker-a"}, 2));
  EXPECT_EQ(watcher->calls.load(), 2);
  EXPECT_EQ(slack("worker-a"), 2);
  // A version past is not held back (a retry of a finished step).
  EXPECT_GT(*shard.PaceSlack(job.config.job_id, "worker-a", -1), 1000);
  // A watcher that is gone is forgotten, not called.
  watcher.reset();
  push("worker-a", 2);
}

TEST(ParameterShardPacingTest, OnlySyncJobsWithALeadArePaced) {
  TestJob async_job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(async_job.config, async_job.InitialChunks(0)));
  ASSERT_OK_AND_ASSIGN(const bool async_paced,
                       shard.WatchPace("job-1", std::make_shared<CountingWatcher>()));
  EXPECT_FALSE(async_paced);
  EXPECT_GT(*shard.PaceSlack("job-1", "worker-a", 0), 1000);

  TestJob sync_job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard unpaced({.pace_lead_frames = 0});
  ASSERT_OK(unpaced.ConfigureJob(sync_job.config, sync_job.InitialChunks(0)));
  ASSERT_OK_AND_ASSIGN(const bool without_lead,
                       unpaced.WatchPace("job-1", std::make_shared<CountingWatcher>()));
  EXPECT_FALSE(without_lead);
  EXPECT_EQ(shard.WatchPace("no-such-job", std::make_shared<CountingWatcher>()).status().code(),
            absl::StatusCode::kNotFound);
}

// Runs `steps` sync steps of a two-member job on a shard with the automatic
// lead, each taking `lead_1_ms` or `lead_2_ms` on the shard's clock by the
// lead the shard gives the step. Returns each step's lead.
std::vector<int64_t> RunTunedSteps(int steps, int lead_1_ms, int lead_2_ms,
                                   std::vector<std::string>* log) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  absl::Time now = absl::UnixEpoch();
  ParameterShard::Options options;
  options.pace_lead_frames = ParameterShard::kAutoPaceLead;
  options.clock = [&now] { return now; };
  options.log = [log](const std::string& line) { log->push_back(line); };
  ParameterShard shard(options);
  EXPECT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("logits/weight");
  const std::vector<float> g = Ramp(job.Count(chunk), 0.5f, 0.25f);
  std::vector<int64_t> leads;
  for (int64_t v = 0; v < steps; ++v) {
    // As a push stream asks, after its frame: b has pushed nothing of v,
    // so its slack is the step's lead.
    EXPECT_OK(shard.Push(job.Args("worker-a", chunk, v), g).status());
    const int64_t lead = *shard.PaceSlack(job.config.job_id, "worker-b", v);
    leads.push_back(lead);
    now += absl::Milliseconds(lead == 1 ? lead_1_ms : lead_2_ms);
    EXPECT_OK(shard.Push(job.Args("worker-b", chunk, v), g).status());
  }
  return leads;
}

TEST(ParameterShardPacingTest, AnAutomaticLeadTriesOneAndTwoInTurnAndKeepsTheFaster) {
  std::vector<std::string> log;
  // Lead 1 makes steps shorter (links the bottleneck): 2 until the trial of
  // versions 2-17 ends, then 1.
  EXPECT_THAT(RunTunedSteps(20, 100, 120, &log),
              ElementsAre(2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1));
  ASSERT_EQ(log.size(), 1u);
  EXPECT_THAT(log[0], HasSubstr("job-1: push pacing lead 1 from version 18"));
  EXPECT_THAT(log[0], HasSubstr("lead 1: 100.0 ms, lead 2: 120.0 ms; chose 1"));

  // Lead 2 makes them shorter (cores the bottleneck): it stays.
  log.clear();
  EXPECT_THAT(RunTunedSteps(20, 130, 100, &log),
              ElementsAre(2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2));
  ASSERT_EQ(log.size(), 1u);
  EXPECT_THAT(log[0], HasSubstr("chose 2"));
}

TEST(ParameterShardSyncTest, RejectsADuplicatePushWithoutChangingTheSum) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  const std::vector<float> ga = {1.f, 2.f, 3.f}, gb = {3.f, 2.f, 1.f};
  ASSERT_OK(shard.Push(job.Args("worker-a", chunk, 0), ga));
  absl::Status duplicate =
      shard.Push(job.Args("worker-a", chunk, 0), {100.f, 100.f, 100.f}).status();
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(duplicate.message(), HasSubstr("duplicate push"));
  ASSERT_EQ(*shard.Push(job.Args("worker-b", chunk, 0), gb), 1);
  std::vector<float> expected = job.Initial(chunk);
  ReferenceOptimizer reference(Sgd(0.1f), 3);
  reference.Apply(expected, Mean(ga, gb), 0);
  absl::StatusOr<PulledChunk> pulled = shard.Pull(job.PullOf("worker-a", chunk, 1), absl::Now());
  ASSERT_OK(pulled);
  EXPECT_TRUE(BitIdentical(Values(*pulled), expected));
  EXPECT_EQ(shard.stats().rejected_pushes, 1);
}

// Regression (issue 8): two finite gradients of 3e38 averaged to -Inf inside
// the model, because the sum overflowed before the division. The push that
// would overflow is refused before anything is written, whether it is added
// to the sum (three members) or folded into the mean (two), in sync and in
// average mode.
TEST(ParameterShardSyncTest, GradientsWhoseSumOverflowsAreRejectedAndTheModelIsUntouched) {
  for (v1::ConsistencyMode mode : {v1::CONSISTENCY_SYNC, v1::CONSISTENCY_AVERAGE}) {
    for (int members : {2, 3}) {
      SCOPED_TRACE(absl::StrCat(v1::ConsistencyMode_Name(mode), ", ", members, " members"));
      std::vector<std::string> ids = {"worker-a", "worker-b", "worker-c"};
      ids.resize(members);
      TestJob job = MakeJob(mode, Sgd(0.1f), ids);
      ParameterShard shard({});
      ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
      const std::string before = ModelBytes(shard, job.config.job_id);
      const int chunk = job.ChunkOf("fc/bias");
      const auto kind = mode == v1::CONSISTENCY_AVERAGE ? v1::ChunkHeader::KIND_PARAMETERS
                                                        : v1::ChunkHeader::KIND_GRADIENT;
      const std::vector<float> big(job.Count(chunk), -3e38f);
      ASSERT_OK(shard.Push(job.Args("worker-a", chunk, 0, kind), big));
      EXPECT_THAT(shard.Push(job.Args("worker-b", chunk, 0, kind), big),
                  StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("overflows float")));
      EXPECT_EQ(ModelBytes(shard, job.config.job_id), before);
      // The barrier still holds worker-a's values alone: finite pushes
      // complete it with the exact mean.
      std::vector<float> small(job.Count(chunk), 1e38f);
      ASSERT_OK(shard.Push(job.Args("worker-b", chunk, 0, kind), small));
      if (members == 3) {
        ASSERT_OK(shard.Push(job.Args("worker-c", chunk, 0, kind), small));
      }
      ASSERT_OK_AND_ASSIGN(PulledChunk pulled,
                           shard.Pull(job.PullOf("worker-a", chunk, 1), absl::Now()));
      for (float v : Values(pulled)) EXPECT_TRUE(std::isfinite(v)) << v;
    }
  }
}

// ---------------------------------------------------------------------------
// async
// ---------------------------------------------------------------------------

TEST(ParameterShardAsyncTest, AppliesEveryPushOnArrivalAndRecordsStaleness) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.1f, 0.9f), {"worker-a", "worker-b"});
  ParameterShard shard({.staleness_buckets = 8});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  std::vector<float> expected = job.Initial(chunk);
  ReferenceOptimizer reference(Sgd(0.1f, 0.9f), job.Count(chunk));

  for (int step = 0; step < 3; ++step) {
    const std::vector<float> g = Ramp(job.Count(chunk), 0.1f * (step + 1), 0.05f);
    ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, step), g), step + 1);
    reference.Apply(expected, g, step);
    absl::StatusOr<PulledChunk> pulled =
        shard.Pull(job.PullOf("worker-b", chunk, step + 1), absl::Now());
    ASSERT_OK(pulled);
    EXPECT_TRUE(BitIdentical(Values(*pulled), expected)) << "after push " << step;
  }
  // worker-b's gradient was computed from version 0; the server is at 3.
  const std::vector<float> stale = Ramp(job.Count(chunk), -0.3f, 0.02f);
  ASSERT_EQ(*shard.Push(job.Args("worker-b", chunk, 0), stale), 4);
  reference.Apply(expected, stale, 3);  // Step = the version it was applied to.
  absl::StatusOr<PulledChunk> pulled = shard.Pull(job.PullOf("worker-a", chunk, 4), absl::Now());
  ASSERT_OK(pulled);
  EXPECT_EQ(pulled->version, 4);
  EXPECT_TRUE(BitIdentical(Values(*pulled), expected));

  const ShardStats stats = shard.stats();
  ASSERT_EQ(stats.staleness_counts.size(), 8u);
  EXPECT_EQ(stats.staleness_counts[0], 3);
  EXPECT_EQ(stats.staleness_counts[3], 1);
  EXPECT_EQ(stats.applied_updates, 4);
}

TEST(ParameterShardAsyncTest, StalenessBeyondTheLastBucketLandsInIt) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard shard({.staleness_buckets = 2});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  for (int i = 0; i < 5; ++i) {
    ASSERT_OK(shard.Push(job.Args("worker-a", chunk, 0), {1.f, 1.f, 1.f}));
  }
  // Staleness 0, 1, 2, 3, 4 -> buckets [0] = 1, [>=1] = 4.
  EXPECT_THAT(shard.stats().staleness_counts, ElementsAreArray({1, 4}));
}

TEST(ParameterShardAsyncTest, RunningStatisticsTakeTheLastWrite) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.1f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("bn/running_var");
  const auto kParams = v1::ChunkHeader::KIND_PARAMETERS;
  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0, kParams), {1.f, 2.f, 3.f}), 1);
  ASSERT_EQ(*shard.Push(job.Args("worker-b", chunk, 0, kParams), {4.f, 5.f, 6.f}), 2);
  absl::StatusOr<PulledChunk> pulled = shard.Pull(job.PullOf("worker-a", chunk, 2), absl::Now());
  ASSERT_OK(pulled);
  EXPECT_THAT(Values(*pulled), ElementsAreArray({4.f, 5.f, 6.f}));
}

// ---------------------------------------------------------------------------
// ssp
// ---------------------------------------------------------------------------

TEST(ParameterShardSspTest, PullWaitsForTheSlowestMemberWithinTheBound) {
  TestJob job = MakeJob(v1::CONSISTENCY_SSP, Sgd(0.1f), {"worker-a", "worker-b"});
  job.config.spec.set_staleness(1);
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  auto push = [&](const std::string& worker, int clock) {
    PushArgs args = job.Args(worker, chunk, 0);
    args.worker_clock = clock;
    return shard.Push(args, {0.01f, 0.02f, 0.03f});
  };
  for (int clock = 1; clock <= 3; ++clock) {
    ASSERT_OK(push("worker-a", clock));
  }
  ASSERT_OK(push("worker-b", 1));

  PullArgs at_clock_3 = job.PullOf("worker-a", chunk, 0);
  at_clock_3.worker_clock = 3;
  // Slowest clock 1 < 3 - 1: blocked; the deadline path reports the clocks.
  absl::StatusOr<PulledChunk> timed_out =
      shard.Pull(at_clock_3, absl::Now() + absl::Milliseconds(30));
  EXPECT_EQ(timed_out.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(timed_out.status().message(), HasSubstr("(clock 1) to reach 2"));
  // Clock 2 is within the bound already.
  PullArgs at_clock_2 = at_clock_3;
  at_clock_2.worker_clock = 2;
  EXPECT_OK(shard.Pull(at_clock_2, absl::Now()));

  AsyncPull waiting(shard, at_clock_3);
  ASSERT_TRUE(AwaitWaiting(shard, 1));
  EXPECT_FALSE(waiting.done());
  ASSERT_OK(push("worker-b", 2));
  absl::StatusOr<PulledChunk> released = waiting.Get();
  ASSERT_OK(released);
  EXPECT_EQ(released->version, 5);  // Async updates: every push applied.
}

TEST(ParameterShardSspTest, RemovingTheSlowestMemberReleasesTheWaiters) {
  TestJob job = MakeJob(v1::CONSISTENCY_SSP, Sgd(0.1f), {"worker-a", "worker-b"});
  job.config.spec.set_staleness(0);
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  PushArgs args = job.Args("worker-a", chunk, 0);
  args.worker_clock = 1;
  ASSERT_OK(shard.Push(args, {1.f, 1.f, 1.f}));
  PullArgs pull = job.PullOf("worker-a", chunk, 1);
  pull.worker_clock = 1;
  AsyncPull waiting(shard, pull);
  ASSERT_TRUE(AwaitWaiting(shard, 1));
  EXPECT_FALSE(waiting.done());
  ASSERT_OK(shard.SetMembers(job.config.job_id, {"worker-a"}, 2));
  // The pull carried generation 1 but was admitted before the change; a
  // remaining member's blocked pull completes.
  EXPECT_OK(waiting.Get());
}

// ---------------------------------------------------------------------------
// average
// ---------------------------------------------------------------------------

TEST(ParameterShardAverageTest, AveragesParametersAndOptimizerStateWhenAsked) {
  TestJob job = MakeJob(v1::CONSISTENCY_AVERAGE, Sgd(0.1f, 0.9f), {"worker-a", "worker-b"});
  job.config.spec.set_average_optimizer_state(true);
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  const int64_t n = job.Count(chunk);
  const auto kParams = v1::ChunkHeader::KIND_PARAMETERS;
  const auto kState = v1::ChunkHeader::KIND_OPTIMIZER_STATE;
  const std::vector<float> pa = Ramp(n, 0.3f, 0.1f), pb = Ramp(n, -0.7f, 0.33f);
  const std::vector<float> ma = Ramp(n, 0.01f, 0.002f), mb = Ramp(n, 0.5f, -0.07f);

  EXPECT_EQ(shard.Push(job.Args("worker-a", chunk, 0), pa).status().code(),
            absl::StatusCode::kInvalidArgument);  // No gradients in average mode.
  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0, kParams), pa), 0);
  ASSERT_EQ(*shard.Push(job.Args("worker-b", chunk, 0, kParams), pb), 0);
  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0, kState), ma), 0);
  // Round 0 still waits for worker-b's momentum.
  EXPECT_EQ(shard.Pull(job.PullOf("worker-a", chunk, 1), absl::Now()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  PushArgs bad_slot = job.Args("worker-b", chunk, 0, kState);
  bad_slot.slot = 1;
  EXPECT_EQ(shard.Push(bad_slot, mb).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(*shard.Push(job.Args("worker-b", chunk, 0, kState), mb), 1);

  absl::StatusOr<PulledChunk> params = shard.Pull(job.PullOf("worker-a", chunk, 1), absl::Now());
  ASSERT_OK(params);
  EXPECT_EQ(params->version, 1);
  EXPECT_TRUE(BitIdentical(Values(*params), Mean(pa, pb)));
  PullArgs state_pull = job.PullOf("worker-b", chunk, 1);
  state_pull.kind = kState;
  absl::StatusOr<PulledChunk> state = shard.Pull(state_pull, absl::Now());
  ASSERT_OK(state);
  EXPECT_TRUE(BitIdentical(Values(*state), Mean(ma, mb)));

  absl::StatusOr<std::vector<v1::ChunkValues>> read = shard.ReadChunks(job.config.job_id);
  ASSERT_OK(read);
  for (const v1::ChunkValues& c : *read) {
    if (c.chunk_id() != chunk) continue;
    EXPECT_EQ(c.version(), 1);
    ASSERT_EQ(c.slots_size(), 1);
    EXPECT_EQ(c.slots(0).name(), "momentum");
    EXPECT_TRUE(
        BitIdentical({c.slots(0).values().begin(), c.slots(0).values().end()}, Mean(ma, mb)));
  }
  // Round 1 works the same way; a round-0 push is now stale.
  EXPECT_EQ(shard.Push(job.Args("worker-a", chunk, 0, kParams), pa).status().code(),
            absl::StatusCode::kAborted);
}

TEST(ParameterShardAverageTest, ARoundCompletesWhenTheMissingMemberIsRemoved) {
  TestJob job = MakeJob(v1::CONSISTENCY_AVERAGE, Adam(0.01f), {"worker-a", "worker-b"});
  job.config.spec.set_average_optimizer_state(true);
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  const auto kParams = v1::ChunkHeader::KIND_PARAMETERS;
  const auto kState = v1::ChunkHeader::KIND_OPTIMIZER_STATE;
  const std::vector<float> pa = {1.f, 2.f, 3.f}, ma = {0.1f, 0.2f, 0.3f}, va = {4.f, 5.f, 6.f};
  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0, kParams), pa), 0);
  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0, kState), ma), 0);
  PushArgs second_slot = job.Args("worker-a", chunk, 0, kState);
  second_slot.slot = 1;
  ASSERT_EQ(*shard.Push(second_slot, va), 0);
  ASSERT_OK(shard.SetMembers(job.config.job_id, {"worker-a"}, 2));

  absl::StatusOr<std::vector<v1::ChunkValues>> read = shard.ReadChunks(job.config.job_id);
  ASSERT_OK(read);
  int seen = 0;
  for (const v1::ChunkValues& c : *read) {
    if (c.chunk_id() != chunk) {
      EXPECT_EQ(c.version(), 0) << "chunk " << c.chunk_id() << " had no pushes";
      continue;
    }
    ++seen;
    EXPECT_EQ(c.version(), 1);
    EXPECT_THAT(c.values(), ElementsAreArray(pa));
    ASSERT_EQ(c.slots_size(), 2);
    EXPECT_THAT(c.slots(0).values(), ElementsAreArray(ma));
    EXPECT_THAT(c.slots(1).values(), ElementsAreArray(va));
  }
  EXPECT_EQ(seen, 1);
  // The next round with the single member completes on its last push.
  PushArgs next = job.Args("worker-a", chunk, 1, kParams);
  next.generation = 2;
  ASSERT_EQ(*shard.Push(next, {7.f, 8.f, 9.f}), 1);
  next.kind = kState;
  ASSERT_EQ(*shard.Push(next, {0.f, 0.f, 0.f}), 1);
  next.slot = 1;
  ASSERT_EQ(*shard.Push(next, {1.f, 1.f, 1.f}), 2);
  PullArgs pull = job.PullOf("worker-a", chunk, 2);
  pull.generation = 2;
  absl::StatusOr<PulledChunk> params = shard.Pull(pull, absl::Now());
  ASSERT_OK(params);
  EXPECT_THAT(Values(*params), ElementsAreArray({7.f, 8.f, 9.f}));
  pull.kind = kState;
  pull.slot = 1;
  absl::StatusOr<PulledChunk> state = shard.Pull(pull, absl::Now());
  ASSERT_OK(state);
  EXPECT_THAT(Values(*state), ElementsAreArray({1.f, 1.f, 1.f}));
}

TEST(ParameterShardAverageTest, LeavesOptimizerStateAloneWhenNotAsked) {
  TestJob job = MakeJob(v1::CONSISTENCY_AVERAGE, Adam(0.01f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  const int chunk = job.ChunkOf("fc/bias");
  std::vector<v1::ChunkValues> initial = job.InitialChunks(0);
  for (v1::ChunkValues& c : initial) {
    if (c.chunk_id() != chunk) continue;
    for (const char* name : {"adam_m", "adam_v"}) {
      v1::OptimizerSlot* slot = c.add_slots();
      slot->set_name(name);
      for (int i = 0; i < 3; ++i) slot->add_values(0.25f * (i + 1));
    }
  }
  ASSERT_OK(shard.ConfigureJob(job.config, initial));
  const auto kParams = v1::ChunkHeader::KIND_PARAMETERS;
  const auto kState = v1::ChunkHeader::KIND_OPTIMIZER_STATE;
  absl::Status state_push =
      shard.Push(job.Args("worker-a", chunk, 0, kState), {9.f, 9.f, 9.f}).status();
  EXPECT_EQ(state_push.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(state_push.message(), HasSubstr("takes KIND_PARAMETERS pushes in average mode"));
  ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, 0, kParams), {1.f, 2.f, 3.f}), 0);
  ASSERT_EQ(*shard.Push(job.Args("worker-b", chunk, 0, kParams), {3.f, 4.f, 5.f}), 1);

  absl::StatusOr<std::vector<v1::ChunkValues>> read = shard.ReadChunks(job.config.job_id);
  ASSERT_OK(read);
  bool found = false;
  for (const v1::ChunkValues& c : *read) {
    if (c.chunk_id() != chunk) continue;
    found = true;
    EXPECT_THAT(c.values(), ElementsAreArray({2.f, 3.f, 4.f}));
    ASSERT_EQ(c.slots_size(), 2);
    EXPECT_EQ(c.slots(0).name(), "adam_m");
    EXPECT_EQ(c.slots(1).name(), "adam_v");
    for (int s = 0; s < 2; ++s) {
      EXPECT_THAT(c.slots(s).values(), ElementsAreArray({0.25f, 0.5f, 0.75f}));
    }
  }
  EXPECT_TRUE(found);
}

// ---------------------------------------------------------------------------
// Server-side optimizer state
// ---------------------------------------------------------------------------

TEST(ParameterShardOptimizerTest, MomentumStatePersistsAcrossStepsAndIsReadBack) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.05f, 0.9f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("logits/weight");
  std::vector<float> expected = job.Initial(chunk);
  ReferenceOptimizer reference(Sgd(0.05f, 0.9f), job.Count(chunk));
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> g = Ramp(job.Count(chunk), 0.2f - step, 0.15f);
    ASSERT_EQ(*shard.Push(job.Args("worker-a", chunk, step), g), step + 1);
    reference.Apply(expected, g, step);
  }
  absl::StatusOr<std::vector<v1::ChunkValues>> read = shard.ReadChunks(job.config.job_id);
  ASSERT_OK(read);
  int seen = 0;
  for (const v1::ChunkValues& c : *read) {
    const bool trainable = job.graph.params[job.plan.chunks[c.chunk_id()].param].trainable;
    EXPECT_EQ(c.slots_size(), trainable ? 1 : 0) << c.chunk_id();
    if (c.chunk_id() != chunk) continue;
    ++seen;
    EXPECT_EQ(c.version(), 3);
    EXPECT_TRUE(BitIdentical({c.values().begin(), c.values().end()}, expected));
    ASSERT_EQ(c.slots_size(), 1);
    EXPECT_EQ(c.slots(0).name(), "momentum");
    EXPECT_TRUE(
        BitIdentical({c.slots(0).values().begin(), c.slots(0).values().end()}, reference.State(0)));
  }
  EXPECT_EQ(seen, 1);
}

TEST(ParameterShardOptimizerTest, AdamMomentsAndBiasCorrectionFollowTheVersion) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Adam(0.01f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  std::vector<float> expected = job.Initial(chunk);
  ReferenceOptimizer reference(Adam(0.01f), job.Count(chunk));
  for (int step = 0; step < 4; ++step) {
    const std::vector<float> g = Ramp(job.Count(chunk), 0.3f * (step - 1), -0.04f);
    ASSERT_OK(shard.Push(job.Args("worker-a", chunk, step), g));
    reference.Apply(expected, g, step);
  }
  absl::StatusOr<std::vector<v1::ChunkValues>> read = shard.ReadChunks(job.config.job_id);
  ASSERT_OK(read);
  for (const v1::ChunkValues& c : *read) {
    if (c.chunk_id() != chunk) continue;
    EXPECT_TRUE(BitIdentical({c.values().begin(), c.values().end()}, expected));
    ASSERT_EQ(c.slots_size(), 2);
    EXPECT_EQ(c.slots(0).name(), "adam_m");
    EXPECT_EQ(c.slots(1).name(), "adam_v");
    EXPECT_TRUE(
        BitIdentical({c.slots(0).values().begin(), c.slots(0).values().end()}, reference.State(0)));
    EXPECT_TRUE(
        BitIdentical({c.slots(1).values().begin(), c.slots(1).values().end()}, reference.State(1)));
  }
}

TEST(ParameterShardOptimizerTest, ResumesFromCheckpointedVersionAndState) {
  // A checkpoint read from one shard configures another: same next update.
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.05f, 0.9f), {"worker-a"});
  ParameterShard first({});
  ASSERT_OK(first.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  const std::vector<float> g = Ramp(job.Count(chunk), 0.5f, 0.1f);
  ASSERT_OK(first.Push(job.Args("worker-a", chunk, 0), g));
  absl::StatusOr<std::vector<v1::ChunkValues>> checkpoint = first.ReadChunks(job.config.job_id);
  ASSERT_OK(checkpoint);

  ParameterShard second({});
  ASSERT_OK(second.ConfigureJob(job.config, *checkpoint));
  EXPECT_EQ(ModelBytes(first, job.config.job_id), ModelBytes(second, job.config.job_id));
  ASSERT_EQ(*first.Push(job.Args("worker-a", chunk, 1), g), 2);
  ASSERT_EQ(*second.Push(job.Args("worker-a", chunk, 1), g), 2);
  EXPECT_EQ(ModelBytes(first, job.config.job_id), ModelBytes(second, job.config.job_id));
}

// ---------------------------------------------------------------------------
// Validation: each rejected push leaves the model byte-identical.
// ---------------------------------------------------------------------------

struct RejectCase {
  std::string label;
  PushArgs args;
  std::vector<float> values;
  absl::StatusCode code;
  std::string message;  // Expected substring.
};

TEST(ParameterShardValidationTest, RejectedPushesLeaveTheModelUntouched) {
  // An async job advanced to version 5, so that "the future" is measurable.
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.1f, 0.9f), {"worker-a", "worker-b"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  const int64_t n = job.Count(chunk);
  const std::vector<float> good = Ramp(n, 0.1f, 0.01f);
  for (int v = 0; v < 5; ++v) {
    ASSERT_OK(shard.Push(job.Args("worker-a", chunk, v), good));
  }

  std::vector<float> nan_at_5 = good;
  nan_at_5[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> inf_at_0 = good;
  inf_at_0[0] = -std::numeric_limits<float>::infinity();
  const int stats_chunk = job.ChunkOf("bn/running_mean");

  std::vector<RejectCase> cases;
  auto add = [&](std::string label, PushArgs args, std::vector<float> values, absl::StatusCode code,
                 std::string message) {
    cases.push_back(
        {std::move(label), std::move(args), std::move(values), code, std::move(message)});
  };
  PushArgs args = job.Args("worker-a", chunk, 5);
  {
    PushArgs a = args;
    a.job_id = "job-404";
    add("unknown job", a, good, absl::StatusCode::kNotFound, "unknown job job-404");
  }
  {
    PushArgs a = args;
    a.worker_id = "worker-z";
    add("not a member", a, good, absl::StatusCode::kFailedPrecondition,
        "worker worker-z is not a member of job job-1");
  }
  {
    PushArgs a = args;
    a.generation = 0;
    add("stale generation", a, good, absl::StatusCode::kAborted, "generation 0");
  }
  {
    PushArgs a = args;
    a.chunk_id = static_cast<int>(job.plan.chunks.size());
    add("chunk out of range", a, good, absl::StatusCode::kInvalidArgument, "out of range");
    a.chunk_id = -1;
    add("negative chunk", a, good, absl::StatusCode::kInvalidArgument, "out of range");
  }
  add("short payload", args, std::vector<float>(good.begin(), good.end() - 1),
      absl::StatusCode::kInvalidArgument, absl::StrCat("holds ", n, " values, got ", n - 1));
  add("long payload", args, Ramp(n + 1, 0.f, 1.f), absl::StatusCode::kInvalidArgument,
      absl::StrCat("got ", n + 1));
  {
    PushArgs a = args;
    a.kind = v1::ChunkHeader::KIND_PARAMETERS;
    add("parameters in async mode", a, good, absl::StatusCode::kInvalidArgument,
        "takes KIND_GRADIENT pushes in async mode, got KIND_PARAMETERS");
    a.kind = v1::ChunkHeader::KIND_OPTIMIZER_STATE;
    add("optimizer state in async mode", a, good, absl::StatusCode::kInvalidArgument,
        "got KIND_OPTIMIZER_STATE");
    a.kind = v1::ChunkHeader::KIND_UNSPECIFIED;
    add("unspecified kind", a, good, absl::StatusCode::kInvalidArgument, "KIND_UNSPECIFIED");
  }
  {
    PushArgs a = job.Args("worker-a", stats_chunk, 0);
    add("gradient for running statistics", a, {1.f, 2.f, 3.f}, absl::StatusCode::kInvalidArgument,
        "takes KIND_PARAMETERS pushes");
  }
  add("NaN", args, nan_at_5, absl::StatusCode::kInvalidArgument, "value 5 of the push");
  add("infinity", args, inf_at_0, absl::StatusCode::kInvalidArgument, "value 0 of the push");
  {
    PushArgs a = args;
    a.version = 9;
    add("future version", a, good, absl::StatusCode::kInvalidArgument,
        "version 9 is ahead of the server's 5");
    a.version = -1;
    add("negative version", a, good, absl::StatusCode::kInvalidArgument, "negative version");
  }

  const std::string before = ModelBytes(shard, job.config.job_id);
  ASSERT_FALSE(before.empty());
  for (const RejectCase& c : cases) {
    absl::StatusOr<int64_t> result = shard.Push(c.args, c.values);
    EXPECT_EQ(result.status().code(), c.code) << c.label << ": " << result.status();
    EXPECT_THAT(result.status().message(), HasSubstr(c.message)) << c.label;
    EXPECT_EQ(ModelBytes(shard, job.config.job_id), before) << c.label << " changed the model";
  }
  EXPECT_EQ(shard.stats().rejected_pushes, static_cast<int64_t>(cases.size()));
  EXPECT_EQ(shard.stats().pushes, 5);
}

TEST(ParameterShardValidationTest, SyncRejectsStaleAndFutureVersions) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  for (int v = 0; v < 2; ++v) {
    ASSERT_OK(shard.Push(job.Args("worker-a", chunk, v), {1.f, 1.f, 1.f}));
  }
  const std::string before = ModelBytes(shard, job.config.job_id);
  absl::Status stale = shard.Push(job.Args("worker-a", chunk, 1), {1.f, 1.f, 1.f}).status();
  EXPECT_EQ(stale.code(), absl::StatusCode::kAborted) << stale;
  EXPECT_THAT(stale.message(), HasSubstr("version 1 is stale"));
  absl::Status future = shard.Push(job.Args("worker-a", chunk, 3), {1.f, 1.f, 1.f}).status();
  EXPECT_EQ(future.code(), absl::StatusCode::kInvalidArgument) << future;
  EXPECT_THAT(future.message(), HasSubstr("version 3 is ahead of the server's 2"));
  EXPECT_EQ(ModelBytes(shard, job.config.job_id), before);
}

TEST(ParameterShardValidationTest, NonFiniteValuesAreAcceptedWhenAllowed) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard shard({.reject_non_finite = false});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ASSERT_OK(shard.Push(job.Args("worker-a", chunk, 0), {nan, 0.f, 0.f}));
  absl::StatusOr<PulledChunk> pulled = shard.Pull(job.PullOf("worker-a", chunk, 1), absl::Now());
  ASSERT_OK(pulled);
  EXPECT_TRUE(std::isnan((*pulled->values)[0]));
}

TEST(ParameterShardValidationTest, FutureVersionsWithinTheLeadAreAcceptedInAsync) {
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard shard({.max_version_lead = 2});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/bias");
  EXPECT_OK(shard.Push(job.Args("worker-a", chunk, 2), {1.f, 1.f, 1.f}));
  EXPECT_EQ(shard.Push(job.Args("worker-a", chunk, 4), {1.f, 1.f, 1.f}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ParameterShardValidationTest, PullErrors) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  PullArgs args = job.PullOf("worker-a", chunk, 0);
  auto code_of = [&](const PullArgs& a) { return shard.Pull(a, absl::Now()).status().code(); };
  {
    PullArgs a = args;
    a.job_id = "job-404";
    EXPECT_EQ(code_of(a), absl::StatusCode::kNotFound);
  }
  {
    PullArgs a = args;
    a.chunk_id = 1000;
    EXPECT_EQ(code_of(a), absl::StatusCode::kInvalidArgument);
  }
  {
    PullArgs a = args;
    a.worker_id = "worker-z";
    EXPECT_EQ(code_of(a), absl::StatusCode::kFailedPrecondition);
  }
  {
    PullArgs a = args;
    a.generation = 7;
    EXPECT_EQ(code_of(a), absl::StatusCode::kAborted);
  }
  {
    PullArgs a = args;
    a.kind = v1::ChunkHeader::KIND_GRADIENT;
    EXPECT_EQ(code_of(a), absl::StatusCode::kInvalidArgument);
    a.kind = v1::ChunkHeader::KIND_OPTIMIZER_STATE;  // Sync mode: ReadChunks only.
    EXPECT_EQ(code_of(a), absl::StatusCode::kInvalidArgument);
  }
  {
    PullArgs a = args;
    a.min_version = 1;
    absl::Status s = shard.Pull(a, absl::Now() + absl::Milliseconds(20)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
    EXPECT_THAT(s.message(), HasSubstr("is at version 0; version 1 was not reached"));
  }
  EXPECT_EQ(shard.stats().pulls, 0);
  EXPECT_OK(shard.Pull(args, absl::Now()));
  EXPECT_EQ(shard.stats().pulls, 1);
  EXPECT_EQ(shard.stats().pull_bytes, job.Count(chunk) * 4);
}

TEST(ParameterShardValidationTest, DropJobAbortsBlockedPullsAndForgetsTheJob) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  AsyncPull waiting(shard, job.PullOf("worker-a", chunk, 1));
  ASSERT_TRUE(AwaitWaiting(shard, 1));
  EXPECT_FALSE(waiting.done());
  ASSERT_OK(shard.DropJob(job.config.job_id));
  absl::StatusOr<PulledChunk> dropped = waiting.Get();
  EXPECT_EQ(dropped.status().code(), absl::StatusCode::kAborted) << dropped.status();
  EXPECT_EQ(shard.Pull(job.PullOf("worker-a", chunk, 0), absl::Now()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(shard.Push(job.Args("worker-a", chunk, 0), job.Initial(chunk)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(shard.ReadChunks(job.config.job_id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(shard.SetMembers(job.config.job_id, {}, 2).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(shard.DropJob(job.config.job_id).code(), absl::StatusCode::kNotFound);
}

TEST(ParameterShardValidationTest, ReconfiguringAJobAbortsPullsOnTheOldOne) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  AsyncPull waiting(shard, job.PullOf("worker-a", chunk, 1));
  ASSERT_TRUE(AwaitWaiting(shard, 1));
  EXPECT_FALSE(waiting.done());
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  EXPECT_EQ(waiting.Get().status().code(), absl::StatusCode::kAborted);
}

TEST(ParameterShardValidationTest, SetMembersRejectsAnOlderGeneration) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  ASSERT_OK(shard.SetMembers(job.config.job_id, {"worker-a", "worker-b"}, 3));
  EXPECT_EQ(shard.SetMembers(job.config.job_id, {"worker-a"}, 2).code(),
            absl::StatusCode::kInvalidArgument);
  PushArgs args = job.Args("worker-b", job.ChunkOf("fc/bias"), 0);
  args.generation = 3;
  EXPECT_OK(shard.Push(args, {1.f, 1.f, 1.f}));  // The new member is in.
}

// ---------------------------------------------------------------------------
// Multi-shard plans and configuration
// ---------------------------------------------------------------------------

TEST(ParameterShardPlanTest, EachShardOwnsItsChunksAndRejectsTheOthers) {
  // 16-byte chunks: fc/weight becomes 3 chunks; 2 shards share 16 chunks.
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"}, /*num_shards=*/2,
                        /*chunk_bytes=*/16);
  ASSERT_EQ(job.plan.by_shard.size(), 2u);
  ASSERT_FALSE(job.plan.by_shard[0].empty());
  ASSERT_FALSE(job.plan.by_shard[1].empty());
  ParameterShard shard0({.shard_index = 0});
  ParameterShard shard1({.shard_index = 1});
  ASSERT_OK(shard0.ConfigureJob(job.config, job.InitialChunks(0)));
  ASSERT_OK(shard1.ConfigureJob(job.config, job.InitialChunks(1)));

  ParameterShard* shards[2] = {&shard0, &shard1};
  for (const ChunkInfo& c : job.plan.chunks) {
    const bool trainable = job.graph.params[c.param].trainable;
    const auto kind = trainable ? v1::ChunkHeader::KIND_GRADIENT : v1::ChunkHeader::KIND_PARAMETERS;
    const std::vector<float> values(c.count, 0.5f);
    ParameterShard& owner = *shards[c.shard];
    ParameterShard& other = *shards[1 - c.shard];
    absl::Status wrong = other.Push(job.Args("worker-a", c.id, 0, kind), values).status();
    EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument) << c.id;
    EXPECT_THAT(wrong.message(), HasSubstr(absl::StrCat("is owned by shard ", c.shard)));
    EXPECT_EQ(other.Pull(job.PullOf("worker-a", c.id, 0), absl::Now()).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(*owner.Push(job.Args("worker-a", c.id, 0, kind), values), 1) << c.id;
  }
  absl::StatusOr<ChunkPlan> plan = shard1.Plan(job.config.job_id);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->by_shard, job.plan.by_shard);
  absl::StatusOr<std::vector<v1::ChunkValues>> read = shard1.ReadChunks(job.config.job_id);
  ASSERT_OK(read);
  ASSERT_EQ(read->size(), job.plan.by_shard[1].size());
  for (size_t i = 0; i < read->size(); ++i) {
    EXPECT_EQ((*read)[i].chunk_id(), job.plan.by_shard[1][i]);
    EXPECT_EQ((*read)[i].version(), 1);
  }
}

// Regression (issue 8): ShardControl.ConfigureJob took any model and any
// id; the shard holds a job to the same limits as the coordinator.
TEST(ParameterShardPlanTest, ConfigureJobEnforcesTheJobLimitsAndIdLengths) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  ParameterShard::Options options;
  options.job_limits.max_parameters = job.graph.trainable_params - 1;
  ParameterShard limited(options);
  EXPECT_THAT(limited.ConfigureJob(job.config, job.InitialChunks(0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--max-job-parameters")));
  ParameterShard shard({});
  ShardJobConfig long_id = job.config;
  long_id.job_id = std::string(129, 'j');
  EXPECT_THAT(shard.ConfigureJob(long_id, job.InitialChunks(0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--max-id-bytes")));
  ShardJobConfig long_member = job.config;
  long_member.members = {std::string(129, 'w')};
  EXPECT_THAT(shard.ConfigureJob(long_member, job.InitialChunks(0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--max-id-bytes")));
  ShardJobConfig bad_mode = job.config;
  bad_mode.spec.set_mode(static_cast<v1::ConsistencyMode>(42));
  EXPECT_THAT(shard.ConfigureJob(bad_mode, job.InitialChunks(0)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("mode 42")));
}

TEST(ParameterShardPlanTest, ConfigureJobRejectsChunksThatDoNotMatchThePlan) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f, 0.9f), {"worker-a"}, 2, 16);
  ParameterShard shard({.shard_index = 1});
  auto expect_rejected = [&](const ShardJobConfig& config,
                             const std::vector<v1::ChunkValues>& chunks,
                             const std::string& message) {
    absl::Status s = shard.ConfigureJob(config, chunks);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(message));
    EXPECT_EQ(shard.Plan(config.job_id).status().code(), absl::StatusCode::kNotFound);
  };
  {
    std::vector<v1::ChunkValues> chunks = job.InitialChunks(1);
    chunks[0].add_values(1.f);
    expect_rejected(job.config, chunks, absl::StrCat("values, got ", chunks[0].values_size()));
  }
  expect_rejected(job.config, job.InitialChunks(0), "shard 1 owns");
  {
    std::vector<v1::ChunkValues> chunks = job.InitialChunks(1);
    chunks.pop_back();
    expect_rejected(job.config, chunks, "shard 1 owns");
  }
  {
    std::vector<v1::ChunkValues> chunks = job.InitialChunks(1);
    std::swap(chunks[0], chunks[1]);
    expect_rejected(job.config, chunks, "plan order");
  }
  {
    std::vector<v1::ChunkValues> chunks = job.InitialChunks(1);
    v1::OptimizerSlot* slot = chunks[0].add_slots();
    slot->set_name("adam_m");
    slot->mutable_values()->Resize(chunks[0].values_size(), 0.f);
    expect_rejected(job.config, chunks, "expected 'momentum'");
  }
  {
    ShardJobConfig config = job.config;
    config.spec.mutable_optimizer()->set_learning_rate(0.f);
    expect_rejected(config, job.InitialChunks(1), "learning_rate");
  }
  {
    ShardJobConfig config = job.config;
    config.spec.set_epochs(0);
    expect_rejected(config, job.InitialChunks(1), "epochs");
  }
  {
    ShardJobConfig config = job.config;
    config.num_shards = 1;
    expect_rejected(config, job.InitialChunks(1), "shard index 1");
  }
  EXPECT_OK(shard.ConfigureJob(job.config, job.InitialChunks(1)));
}

// ---------------------------------------------------------------------------
// Concurrency
// ---------------------------------------------------------------------------

TEST(ParameterShardConcurrencyTest, FourWorkersInSyncReachTheExpectedVersion) {
  constexpr int kWorkers = 4;
  constexpr int kSteps = 40;
  std::vector<std::string> members;
  for (int w = 0; w < kWorkers; ++w) members.push_back(absl::StrCat("worker-", w));
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.125f), members, 1, /*chunk_bytes=*/16);
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int num_chunks = static_cast<int>(job.plan.chunks.size());

  // Gradients (w + 1) / 4 and running statistics w: sums of exactly
  // representable numbers, so the mean is exact whatever the arrival order.
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      for (int step = 0; step < kSteps && failures == 0; ++step) {
        for (int c = 0; c < num_chunks; ++c) {
          const ChunkInfo& info = job.plan.chunks[c];
          const bool trainable = job.graph.params[info.param].trainable;
          const auto kind =
              trainable ? v1::ChunkHeader::KIND_GRADIENT : v1::ChunkHeader::KIND_PARAMETERS;
          const std::vector<float> values(
              info.count, trainable ? 0.25f * static_cast<float>(w + 1) : static_cast<float>(w));
          if (!shard.Push(job.Args(members[w], c, step, kind), values).ok()) ++failures;
        }
        for (int c = num_chunks - 1; c >= 0; --c) {
          absl::StatusOr<PulledChunk> pulled =
              shard.Pull(job.PullOf(members[w], c, step + 1), absl::Now() + kLongWait);
          if (!pulled.ok() || pulled->version != step + 1) ++failures;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(failures, 0);

  const ShardStats stats = shard.stats();
  EXPECT_EQ(stats.pushes, int64_t{kWorkers} * kSteps * num_chunks);
  EXPECT_EQ(stats.applied_updates, int64_t{kSteps} * num_chunks);
  absl::StatusOr<std::vector<v1::ChunkValues>> read = shard.ReadChunks(job.config.job_id);
  ASSERT_OK(read);
  for (const v1::ChunkValues& c : *read) {
    EXPECT_EQ(c.version(), kSteps);
    const ChunkInfo& info = job.plan.chunks[c.chunk_id()];
    std::vector<float> expected = job.Initial(c.chunk_id());
    if (job.graph.params[info.param].trainable) {
      ReferenceOptimizer reference(Sgd(0.125f), info.count);
      const std::vector<float> mean(info.count, 0.625f);  // (0.25+0.5+0.75+1)/4.
      for (int step = 0; step < kSteps; ++step) reference.Apply(expected, mean, step);
    } else {
      expected.assign(info.count, 1.5f);  // (0+1+2+3)/4.
    }
    EXPECT_TRUE(BitIdentical({c.values().begin(), c.values().end()}, expected)) << c.chunk_id();
  }
}

// No lock serialises a job's updates: pushers that own disjoint chunks apply
// Adam steps in parallel (the optimizer state of each chunk is its own),
// while another thread reads the model and its state (a checkpoint) and
// pulls. The result is bit-identical to applying the same steps serially;
// under ThreadSanitizer (deploy/local/sanitize.sh) any shared state would be
// a reported race.
TEST(ParameterShardConcurrencyTest, PushersOwningDisjointChunksApplyInParallelExactly) {
  constexpr int kPushers = 3;
  constexpr int kSteps = 30;
  std::vector<std::string> members;
  for (int w = 0; w < kPushers; ++w) members.push_back(absl::StrCat("worker-", w));
  TestJob job = MakeJob(v1::CONSISTENCY_ASYNC, Adam(0.01f), members, 1, /*chunk_bytes=*/16);
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int num_chunks = static_cast<int>(job.plan.chunks.size());
  auto gradient = [](int chunk, int step, int64_t n) {
    return Ramp(n, 0.1f * static_cast<float>(chunk % 5) - 0.2f, 0.01f * static_cast<float>(step));
  };
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int w = 0; w < kPushers; ++w) {
    threads.emplace_back([&, w] {
      for (int step = 0; step < kSteps; ++step) {
        for (int c = w; c < num_chunks; c += kPushers) {
          const ChunkInfo& info = job.plan.chunks[c];
          if (!job.graph.params[info.param].trainable) continue;
          if (!shard.Push(job.Args(members[w], c, step), gradient(c, step, info.count)).ok()) {
            ++failures;
          }
        }
      }
    });
  }
  std::thread reader([&] {
    while (!done) {
      if (!shard.ReadChunks(job.config.job_id).ok()) ++failures;
      for (int c = 0; c < num_chunks; ++c) {
        if (!shard.Pull(job.PullOf(members[0], c, 0), absl::Now() + kLongWait).ok()) ++failures;
      }
    }
  });
  for (std::thread& t : threads) t.join();
  done = true;
  reader.join();
  ASSERT_EQ(failures, 0);

  absl::StatusOr<std::vector<v1::ChunkValues>> read = shard.ReadChunks(job.config.job_id);
  ASSERT_OK(read);
  int checked = 0;
  for (const v1::ChunkValues& c : *read) {
    const ChunkInfo& info = job.plan.chunks[c.chunk_id()];
    if (!job.graph.params[info.param].trainable) continue;
    std::vector<float> expected = job.Initial(c.chunk_id());
    ReferenceOptimizer reference(Adam(0.01f), info.count);
    for (int step = 0; step < kSteps; ++step) {
      reference.Apply(expected, gradient(c.chunk_id(), step, info.count), step);
    }
    EXPECT_EQ(c.version(), kSteps);
    EXPECT_TRUE(BitIdentical({c.values().begin(), c.values().end()}, expected)) << c.chunk_id();
    ASSERT_EQ(c.slots_size(), 2);
    EXPECT_TRUE(
        BitIdentical({c.slots(0).values().begin(), c.slots(0).values().end()}, reference.State(0)))
        << c.chunk_id();
    ++checked;
  }
  EXPECT_GT(checked, kPushers);
}

// ---------------------------------------------------------------------------
// Pull compression
// ---------------------------------------------------------------------------

v1::CompressionSpec Codec(v1::CompressionSpec::Method method, float topk_ratio = 0.f) {
  v1::CompressionSpec spec;
  spec.set_method(method);
  spec.set_topk_ratio(topk_ratio);
  return spec;
}

// A worker's copy of one chunk under pull compression, kept as
// RemoteUpdater and PsClient keep it: the values, and the version and epoch
// the shard sent them at.
struct HeldChunk {
  std::vector<float> values;
  int64_t version = -1;
  uint64_t epoch = 0;

  // Pulls `args` offering what is held; true when the reply was a delta.
  bool Pull(ParameterShard& shard, PullArgs args) {
    args.held_version = version;
    args.held_epoch = epoch;
    absl::StatusOr<PulledChunk> pulled = shard.Pull(args, absl::Now() + kLongWait);
    EXPECT_OK(pulled);
    if (!pulled.ok()) return false;
    const bool delta = pulled->delta != nullptr;
    if (delta) {
      const EncodedGradient& d = *pulled->delta;
      v1::ChunkHeader header;
      header.set_num_elements(static_cast<int64_t>(values.size()));
      header.set_dtype(d.dtype);
      header.set_encoding(d.encoding);
      header.set_encoded_count(d.encoded_count);
      std::vector<float> scratch;
      EXPECT_OK(AddEncodedDelta(header, d.bytes.data(), d.bytes.size(), absl::MakeSpan(values),
                                &scratch));
    } else {
      values = *pulled->values;
    }
    version = pulled->version;
    epoch = pulled->values_epoch;
    return delta;
  }
};

// The master values of chunk `chunk` (ReadChunks, as checkpoints read them).
std::vector<float> MasterValues(ParameterShard& shard, const TestJob& job, int chunk) {
  absl::StatusOr<std::vector<v1::ChunkValues>> chunks = shard.ReadChunks(job.config.job_id);
  EXPECT_OK(chunks);
  if (!chunks.ok()) return {};
  for (const v1::ChunkValues& c : *chunks) {
    if (c.chunk_id() == chunk) return std::vector<float>(c.values().begin(), c.values().end());
  }
  ADD_FAILURE() << "no chunk " << chunk;
  return {};
}

float MaxGap(const std::vector<float>& a, const std::vector<float>& b) {
  float gap = 0;
  for (size_t i = 0; i < a.size(); ++i) gap = std::max(gap, std::fabs(a[i] - b[i]));
  return gap;
}

class PullCompressionTest : public ::testing::TestWithParam<v1::CompressionSpec::Method> {
 protected:
  v1::CompressionSpec Spec() const {
    return Codec(GetParam(), GetParam() == v1::CompressionSpec::COMPRESSION_TOPK ? 0.25f : 0.f);
  }
};

// Every step a worker that holds the previous version gets a delta, and what
// it adds up to is, bit for bit, what a worker pulling the values whole gets
// (the published values). The published values trail the master by what the
// codec has not carried yet; once the gradients stop, error feedback carries
// the rest.
TEST_P(PullCompressionTest, DeltasRebuildThePublishedValuesBitForBitAndCatchUpWithTheMaster) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.05f, 0.9f), {"worker-a", "worker-b"});
  *job.config.spec.mutable_pull_compression() = Spec();
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  const int64_t n = job.Count(chunk);

  HeldChunk worker;
  EXPECT_FALSE(worker.Pull(shard, job.PullOf("worker-a", chunk, 0)));  // Nothing held yet.
  EXPECT_NE(worker.epoch, 0u);
  EXPECT_TRUE(BitIdentical(worker.values, job.Initial(chunk)));
  const ShardStats before = shard.stats();
  int64_t deltas = 0;
  float gap_when_gradients_stop = 0;
  constexpr int kSteps = 40, kStepsWithGradients = 10;
  for (int step = 0; step < kSteps; ++step) {
    std::vector<float> ga(n, 0.f), gb(n, 0.f);
    if (step < kStepsWithGradients) {
      ga = Ramp(n, 0.3f - 0.07f * step, 0.113f);
      gb = Ramp(n, -1.1f + 0.05f * step, 0.171f);
    }
    ASSERT_OK(shard.Push(job.Args("worker-a", chunk, step), ga));
    ASSERT_OK(shard.Push(job.Args("worker-b", chunk, step), gb));
    deltas += worker.Pull(shard, job.PullOf("worker-a", chunk, step + 1)) ? 1 : 0;
    EXPECT_EQ(worker.version, step + 1);
    // A worker that holds nothing gets the published values whole.
    HeldChunk fresh;
    EXPECT_FALSE(fresh.Pull(shard, job.PullOf("worker-b", chunk, step + 1)));
    ASSERT_TRUE(BitIdentical(worker.values, fresh.values)) << "step " << step;
    if (step == kStepsWithGradients - 1) {
      gap_when_gradients_stop = MaxGap(worker.values, MasterValues(shard, job, chunk));
    }
  }
  EXPECT_EQ(deltas, kSteps);
  const ShardStats after = shard.stats();
  const int64_t sent = after.pull_bytes - before.pull_bytes;
  const int64_t represented = after.pull_represented_bytes - before.pull_represented_bytes;
  // Half the pulls (the fresh ones) went whole; the deltas are smaller.
  EXPECT_LT(sent, represented);
  EXPECT_EQ(represented, 2 * kSteps * n * 4);

  // A pull of the master (a run's end) gets what checkpoints hold, whole.
  PullArgs master = job.PullOf("worker-a", chunk, kSteps);
  master.master = true;
  master.held_version = kSteps - 1;
  master.held_epoch = worker.epoch;
  absl::StatusOr<PulledChunk> pulled_master = shard.Pull(master, absl::Now());
  ASSERT_OK(pulled_master);
  EXPECT_EQ(pulled_master->delta, nullptr);
  EXPECT_EQ(pulled_master->values_epoch, 0u);
  EXPECT_TRUE(BitIdentical(*pulled_master->values, MasterValues(shard, job, chunk)));

  // Momentum keeps moving the master after the gradients stop; the
  // published values follow it.
  const float gap = MaxGap(worker.values, MasterValues(shard, job, chunk));
  // How far behind the master the published values may still be, as a
  // share of the gap when the gradients stopped: the half-precision codecs
  // round each step's change, top-k sends a quarter of the elements a step,
  // 1-bit one magnitude for all.
  float share = 0.5f;
  switch (GetParam()) {
    case v1::CompressionSpec::COMPRESSION_FP16:
    case v1::CompressionSpec::COMPRESSION_BF16:
    case v1::CompressionSpec::COMPRESSION_TOPK:
      share = 0.1f;
      break;
    default:
      break;
  }
  EXPECT_GT(gap_when_gradients_stop, 0.f);
  EXPECT_LT(gap, share * gap_when_gradients_stop)
      << "at the end of the gradients: " << gap_when_gradients_stop;
}

INSTANTIATE_TEST_SUITE_P(Codecs, PullCompressionTest,
                         ::testing::Values(v1::CompressionSpec::COMPRESSION_FP16,
                                           v1::CompressionSpec::COMPRESSION_BF16,
                                           v1::CompressionSpec::COMPRESSION_TOPK,
                                           v1::CompressionSpec::COMPRESSION_ONEBIT),
                         [](const ::testing::TestParamInfo<v1::CompressionSpec::Method>& info) {
                           return v1::CompressionSpec::Method_Name(info.param);
                         });

TEST(PullCompressionShardTest, ADeltaGoesOnlyToAWorkerHoldingThePreviousVersionOfThisEpoch) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  *job.config.spec.mutable_pull_compression() = Codec(v1::CompressionSpec::COMPRESSION_FP16);
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  const int chunk = job.ChunkOf("fc/weight");
  const int64_t n = job.Count(chunk);
  HeldChunk at0;
  at0.Pull(shard, job.PullOf("worker-a", chunk, 0));
  for (int step = 0; step < 2; ++step) {
    ASSERT_OK(shard.Push(job.Args("worker-a", chunk, step), Ramp(n, 0.5f, 0.1f)));
  }
  // At version 2: a worker at version 0 (two steps behind) gets the values.
  HeldChunk behind = at0;
  EXPECT_FALSE(behind.Pull(shard, job.PullOf("worker-a", chunk, 2)));
  EXPECT_EQ(behind.version, 2);
  // One holding version 1 of another epoch (a shard that restarted) too.
  HeldChunk at1;
  at1.Pull(shard, job.PullOf("worker-a", chunk, 1));
  ASSERT_EQ(at1.version, 2);  // Already there: version 1 is gone.
  HeldChunk other_epoch = at1;
  other_epoch.version = 1;
  other_epoch.epoch ^= 1;
  EXPECT_FALSE(other_epoch.Pull(shard, job.PullOf("worker-a", chunk, 2)));
  EXPECT_TRUE(BitIdentical(other_epoch.values, behind.values));

  // Reconfiguring the job (a restarted shard resuming from a checkpoint)
  // draws a new epoch: what workers held before is not a base any more.
  const uint64_t old_epoch = at1.epoch;
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  HeldChunk after_restart = at1;
  after_restart.version = -1;  // Any version: the job restarted at 0.
  EXPECT_FALSE(after_restart.Pull(shard, job.PullOf("worker-a", chunk, 0)));
  EXPECT_NE(after_restart.epoch, old_epoch);
  EXPECT_TRUE(BitIdentical(after_restart.values, job.Initial(chunk)));
  at1.version = 0;  // Claims version 0 of the old epoch.
  ASSERT_OK(shard.Push(job.Args("worker-a", chunk, 0), Ramp(n, 0.5f, 0.1f)));
  EXPECT_FALSE(at1.Pull(shard, job.PullOf("worker-a", chunk, 1)));
}

TEST(PullCompressionShardTest, RunningStatisticsAndSmallParametersTravelWhole) {
  TestJob job = MakeJob(v1::CONSISTENCY_SYNC, Sgd(0.1f), {"worker-a"});
  v1::CompressionSpec codec = Codec(v1::CompressionSpec::COMPRESSION_ONEBIT);
  codec.set_min_compress_bytes(13 * 4);  // fc/weight (12 values) and every smaller one.
  *job.config.spec.mutable_pull_compression() = codec;
  ParameterShard shard({});
  ASSERT_OK(shard.ConfigureJob(job.config, job.InitialChunks(0)));
  for (const char* name : {"bn/running_mean", "fc/weight", "logits/bias"}) {
    HeldChunk held;
    held.Pull(shard, job.PullOf("worker-a", job.ChunkOf(name), 0));
    EXPECT_EQ(held.epoch, 0u) << name;
  }
}

TEST(PullCompressionShardTest, OnlySyncJobsCompressPulls) {
  for (v1::ConsistencyMode mode :
       {v1::CONSISTENCY_ASYNC, v1::CONSISTENCY_SSP, v1::CONSISTENCY_AVERAGE}) {
    TestJob job = MakeJob(mode, Sgd(0.1f), {"worker-a"});
    *job.config.spec.mutable_pull_compression() = Codec(v1::CompressionSpec::COMPRESSION_FP16);
    ParameterShard shard({});
    EXPECT_THAT(shard.ConfigureJob(job.config, job.InitialChunks(0)),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pull_compression")))
        << v1::ConsistencyMode_Name(mode);
  }
}

// ---------------------------------------------------------------------------
// External models: a framework's named tensors (v1::ExternalModel)
// ---------------------------------------------------------------------------

// A PyTorch-like module's tensors, in the order named_parameters() and
// named_buffers() list them; the initial values stand for rank 0's.
TestJob MakeExternalJob(v1::ConsistencyMode mode, const v1::OptimizerSpec& optimizer,
                        std::vector<std::string> members, int num_shards) {
  TestJob job;
  job.config.job_id = "torch-job";
  v1::JobSpec& spec = job.config.spec;
  v1::ExternalModel* model = spec.mutable_external_model();
  model->set_framework("torch");
  auto add = [model](const std::string& name, std::vector<int64_t> shape, bool trainable) {
    v1::ExternalTensor* t = model->add_tensors();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
    t->set_trainable(trainable);
  };
  add("embedding.weight", {50, 8}, true);
  add("lstm.weight_ih_l0", {32, 8}, true);
  add("lstm.bias_ih_l0", {32}, true);
  add("head.weight", {10, 8}, true);
  add("norm.running_mean", {8}, false);
  add("norm.num_batches_tracked", {}, false);
  *spec.mutable_optimizer() = optimizer;
  spec.set_epochs(1);
  spec.set_batch_size(8);
  spec.set_mode(mode);
  job.config.num_shards = num_shards;
  job.config.chunk_bytes = 256;  // 64 floats: the larger tensors span chunks and shards.
  job.config.members = std::move(members);
  job.config.generation = 1;
  absl::StatusOr<ModelGraph> graph = BuildJobGraph(spec);
  EXPECT_OK(graph);
  job.graph = *graph;
  absl::StatusOr<ChunkPlan> plan = PlanChunks(job.graph, num_shards, job.config.chunk_bytes);
  EXPECT_OK(plan);
  job.plan = *plan;
  for (size_t p = 0; p < job.graph.params.size(); ++p) {
    job.params.push_back(
        Ramp(job.graph.params[p].shape.num_elements(), 0.01f * static_cast<float>(p + 1), -0.003f));
  }
  return job;
}

TEST(ParameterShardExternalModelTest, TwoShardsHoldAFrameworksTensorsAndApplyOneSyncStep) {
  TestJob job = MakeExternalJob(v1::CONSISTENCY_SYNC, Sgd(0.05f, 0.9f), {"w1", "w2"}, 2);
  ASSERT_EQ(job.graph.params.size(), 6u);
  EXPECT_EQ(job.graph.trainable_params, 50 * 8 + 32 * 8 + 32 + 10 * 8);
  EXPECT_EQ(job.graph.non_trainable_params, 8 + 1);
  ASSERT_GT(job.plan.by_param[0].size(), 1u);  // embedding.weight is cut.
  ParameterShard shard0({.shard_index = 0});
  ParameterShard shard1({.shard_index = 1});
  ParameterShard* shards[] = {&shard0, &shard1};
  for (int s = 0; s < 2; ++s) {
    ASSERT_FALSE(job.plan.by_shard[s].empty()) << "shard " << s;
    ASSERT_OK(shards[s]->ConfigureJob(job.config, job.InitialChunks(s)));
  }
  // Both members push every chunk: gradients for parameters, values for
  // buffers; each chunk then holds version 1.
  for (const ChunkInfo& chunk : job.plan.chunks) {
    const bool trainable = job.graph.params[chunk.param].trainable;
    const auto kind = trainable ? v1::ChunkHeader::KIND_GRADIENT : v1::ChunkHeader::KIND_PARAMETERS;
    const std::vector<float> a = Ramp(chunk.count, 0.5f + chunk.id, 0.25f);
    const std::vector<float> b = Ramp(chunk.count, -1.5f, 0.125f * (chunk.id + 1));
    ParameterShard& shard = *shards[chunk.shard];
    ASSERT_EQ(*shard.Push(job.Args("w1", chunk.id, 0, kind), a), 0);
    ASSERT_EQ(*shard.Push(job.Args("w2", chunk.id, 0, kind), b), 1);
    absl::StatusOr<PulledChunk> pulled = shard.Pull(job.PullOf("w1", chunk.id, 1), absl::Now());
    ASSERT_OK(pulled);
    std::vector<float> expected = job.Initial(chunk.id);
    if (trainable) {
      ReferenceOptimizer reference(Sgd(0.05f, 0.9f), chunk.count);
      reference.Apply(expected, Mean(a, b), /*step=*/0);
    } else {
      expected = Mean(a, b);
    }
    EXPECT_TRUE(BitIdentical(Values(*pulled), expected))
        << job.graph.params[chunk.param].name << " chunk " << chunk.id;
  }
  // The shards' reads name the tensors' chunks only: the same plan.
  for (int s = 0; s < 2; ++s) {
    absl::StatusOr<std::vector<v1::ChunkValues>> read = shards[s]->ReadChunks(job.config.job_id);
    ASSERT_OK(read);
    ASSERT_EQ(read->size(), job.plan.by_shard[s].size());
    for (const v1::ChunkValues& c : *read) EXPECT_EQ(c.version(), 1) << c.chunk_id();
  }
}

TEST(ParameterShardExternalModelTest, InitialValuesMustMatchTheDeclaredShapes) {
  TestJob job = MakeExternalJob(v1::CONSISTENCY_ASYNC, Adam(1e-3f), {"w1"}, 1);
  std::vector<v1::ChunkValues> initial = job.InitialChunks(0);
  initial.back().add_values(1.f);  // num_batches_tracked is a scalar: one value.
  ParameterShard shard({});
  EXPECT_THAT(shard.ConfigureJob(job.config, initial),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("(norm.num_batches_tracked) holds 1 values, got 2")));
  v1::ExternalTensor* twice = job.config.spec.mutable_external_model()->add_tensors();
  twice->set_name("head.weight");
  twice->add_shape(3);
  EXPECT_THAT(shard.ConfigureJob(job.config, job.InitialChunks(0)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("declares tensor 'head.weight' twice")));
}

}  // namespace
}  // namespace pstrain
