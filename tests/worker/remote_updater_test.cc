// RemoteUpdater against an in-memory parameter server (a PsClient fake that
// implements the shard semantics of server/parameter_shard.h for one job):
// the sync step is the mean of the workers' gradients, async applies each
// push, average mode replaces the parameters by the mean every K steps, and
// an ABORTED push leads to a resync instead of a failure.
#include "worker/remote_updater.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/chunking.h"
#include "common/model_graph.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "worker/model.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

constexpr float kLearningRate = 0.5f;

// The server side of one job with `members` workers, all chunks in memory.
class FakeServer {
 public:
  FakeServer(v1::ConsistencyMode mode, const ModelGraph& graph, ChunkPlan plan, int members)
      : mode_(mode), plan_(std::move(plan)), members_(members) {
    const auto initial = InitialParameterValues(graph);
    for (const ChunkInfo& c : plan_.chunks) {
      Chunk chunk;
      chunk.trainable = graph.params[c.param].trainable;
      chunk.values.assign(initial[c.param].begin() + c.offset,
                          initial[c.param].begin() + c.offset + c.count);
      chunk.state.assign(c.count, 0.f);
      chunks_.push_back(std::move(chunk));
    }
  }

  absl::Status Push(v1::ChunkHeader::Kind kind, int64_t version, int slot,
                    const std::vector<PsClient::ChunkRef>& refs) {
    absl::MutexLock lock(&mu_);
    if (reject_next_push_) {
      reject_next_push_ = false;
      return absl::AbortedError("stale generation");
    }
    ++pushes_[kind];
    for (const auto& ref : refs) {
      Chunk& chunk = chunks_[ref.chunk_id];
      const int64_t n = plan_.chunks[ref.chunk_id].count;
      std::vector<float> values(ref.values, ref.values + n);
      if (version > chunk.version) return absl::InvalidArgumentError("version from the future");
      if (mode_ == v1::CONSISTENCY_ASYNC || mode_ == v1::CONSISTENCY_SSP) {
        if (kind == v1::ChunkHeader::KIND_GRADIENT) {
          for (int64_t i = 0; i < n; ++i) chunk.values[i] -= kLearningRate * values[i];
        } else {
          chunk.values = values;
        }
        ++chunk.version;
        continue;
      }
      if (version < chunk.version) return absl::AbortedError("past version");
      if (kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE) {
        Accumulate(chunk.pending_state, values);
        continue;
      }
      Accumulate(chunk.pending, values);
      if (++chunk.pushed < members_) continue;
      // Barrier complete: apply the mean once.
      for (int64_t i = 0; i < n; ++i) {
        const float mean = chunk.pending[i] / members_;
        if (mode_ == v1::CONSISTENCY_SYNC && kind == v1::ChunkHeader::KIND_GRADIENT) {
          chunk.values[i] -= kLearningRate * mean;
        } else {
          chunk.values[i] = mean;
        }
      }
      if (!chunk.pending_state.empty()) {
        for (int64_t i = 0; i < n; ++i) chunk.state[i] = chunk.pending_state[i] / members_;
      }
      chunk.pending.clear();
      chunk.pending_state.clear();
      chunk.pushed = 0;
      ++chunk.version;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Pull(v1::ChunkHeader::Kind kind, int64_t min_version, int slot,
                               const std::vector<PsClient::ChunkDest>& dests) {
    absl::MutexLock lock(&mu_);
    int64_t lowest = INT64_MAX;
    for (const auto& dest : dests) {
      const Chunk* chunk = &chunks_[dest.chunk_id];
      std::pair<const Chunk*, int64_t> wanted(chunk, min_version);
      if (!mu_.AwaitWithTimeout(
              absl::Condition(
                  +[](std::pair<const Chunk*, int64_t>* arg) {
                    return arg->first->version >= arg->second;
                  },
                  &wanted),
              absl::Seconds(20))) {
        return absl::DeadlineExceededError("pull timed out");
      }
      const std::vector<float>& src =
          kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE ? chunk->state : chunk->values;
      std::copy(src.begin(), src.end(), dest.values);
      lowest = std::min(lowest, chunk->version);
    }
    ++pulls_;
    return lowest;
  }

  void RejectNextPush() {
    absl::MutexLock lock(&mu_);
    reject_next_push_ = true;
  }
  std::vector<float> Values(int chunk) {
    absl::MutexLock lock(&mu_);
    return chunks_[chunk].values;
  }
  int64_t Version(int chunk) {
    absl::MutexLock lock(&mu_);
    return chunks_[chunk].version;
  }
  int Pushes(v1::ChunkHeader::Kind kind) {
    absl::MutexLock lock(&mu_);
    return pushes_[kind];
  }
  const ChunkPlan& plan() const { return plan_; }

 private:
  struct Chunk {
    bool trainable = true;
    std::vector<float> values, state, pending, pending_state;
    int pushed = 0;
    int64_t version = 0;
  };
  static void Accumulate(std::vector<float>& sum, const std::vector<float>& values) {
    if (sum.empty()) sum.assign(values.size(), 0.f);
    for (size_t i = 0; i < values.size(); ++i) sum[i] += values[i];
  }

  const v1::ConsistencyMode mode_;
  const ChunkPlan plan_;
  const int members_;
  absl::Mutex mu_;
  std::vector<Chunk> chunks_;
  std::map<int, int> pushes_;
  int pulls_ = 0;
  bool reject_next_push_ = false;
};

// What the updater did, in order ("push", "wait push", "pull", "cancel pull").
class EventLog {
 public:
  void Add(const std::string& event) {
    absl::MutexLock lock(&mu_);
    events_.push_back(event);
  }
  std::vector<std::string> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(events_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> events_;
};

// A push applied at once; Done() says false until waited on when `held`
// (a push still in flight on a slow network).
class DoneOp final : public PendingOp {
 public:
  explicit DoneOp(absl::Status status, EventLog* log = nullptr, bool held = false)
      : status_(std::move(status)), log_(log), held_(held) {}
  absl::Status Wait() override {
    if (log_ != nullptr) log_->Add("wait push");
    held_ = false;
    return status_;
  }
  int64_t version() const override { return 0; }
  bool Done() const override { return !held_; }

 private:
  absl::Status status_;
  EventLog* log_;
  std::atomic<bool> held_;
};

// Pull ops run when waited on: the values are read at Wait(), as late as a
// real pull could deliver them.
class LazyPullOp final : public PendingOp {
 public:
  LazyPullOp(FakeServer* server, v1::ChunkHeader::Kind kind, int64_t min_version, int slot,
             std::vector<PsClient::ChunkDest> dests)
      : server_(server), kind_(kind), min_version_(min_version), slot_(slot),
        dests_(std::move(dests)) {}
  absl::Status Wait() override {
    if (cancelled_) return absl::CancelledError("pull cancelled");
    absl::StatusOr<int64_t> v = server_->Pull(kind_, min_version_, slot_, dests_);
    if (!v.ok()) return v.status();
    version_ = *v;
    return absl::OkStatus();
  }
  int64_t version() const override { return version_; }
  void Cancel() override { cancelled_ = true; }

 private:
  bool cancelled_ = false;
  FakeServer* server_;
  v1::ChunkHeader::Kind kind_;
  int64_t min_version_;
  int slot_;
  std::vector<PsClient::ChunkDest> dests_;
  int64_t version_ = 0;
};

class FakePsClient final : public PsClient {
 public:
  explicit FakePsClient(FakeServer* server) : server_(server) {}
  std::unique_ptr<PendingOp> Push(v1::ChunkHeader::Kind kind, int64_t version, int worker_clock,
                                  std::vector<ChunkRef> chunks, int slot) override {
    last_push_clock = worker_clock;
    log.Add("push");
    {
      absl::MutexLock lock(&chunks_mu);
      for (const ChunkRef& c : chunks) pushed_chunks.push_back(c.chunk_id);
    }
    return std::make_unique<DoneOp>(server_->Push(kind, version, slot, chunks), &log,
                                    hold_pushes.load());
  }
  std::unique_ptr<PendingOp> Pull(v1::ChunkHeader::Kind kind, int64_t min_version, int worker_clock,
                                  std::vector<ChunkDest> chunks, int slot, bool master) override {
    last_pull_clock = worker_clock;
    log.Add("pull");
    {
      absl::MutexLock lock(&chunks_mu);
      for (const ChunkDest& c : chunks) pulled_chunks.push_back(c.chunk_id);
    }
    return std::make_unique<LazyPullOp>(server_, kind, min_version, slot, std::move(chunks));
  }
  void SetGeneration(int64_t generation) override {}
  const ChunkPlan& plan() const override { return server_->plan(); }
  uint64_t incarnation() const override { return 1; }

  int last_push_clock = -1, last_pull_clock = -1;
  EventLog log;
  std::atomic<bool> hold_pushes{false};  // Pushes stay in flight until waited on.
  // The chunk ids of every Push and of every Pull, in call order.
  std::vector<int> PushedChunks() {
    absl::MutexLock lock(&chunks_mu);
    return pushed_chunks;
  }
  std::vector<int> TakePulledChunks() {
    absl::MutexLock lock(&chunks_mu);
    return std::exchange(pulled_chunks, {});
  }
  absl::Mutex chunks_mu;
  std::vector<int> pushed_chunks ABSL_GUARDED_BY(chunks_mu);
  std::vector<int> pulled_chunks ABSL_GUARDED_BY(chunks_mu);

 private:
  FakeServer* server_;
};

// dense(6) -> batch_norm -> relu -> dense(3) -> softmax cross-entropy on [4]
// inputs: trainable weights, biases, gamma/beta, and running statistics.
v1::ModelSpec TinyModel() {
  v1::ModelSpec spec;
  spec.set_name("tiny");
  spec.add_input_shape(4);
  spec.set_num_classes(3);
  spec.set_init_seed(7);
  auto* fc1 = spec.add_layers();
  fc1->set_name("fc1");
  fc1->mutable_dense()->set_units(6);
  auto* bn = spec.add_layers();
  bn->set_name("bn1");
  bn->mutable_batch_norm();
  auto* relu = spec.add_layers();
  relu->set_name("relu1");
  relu->mutable_relu();
  auto* fc2 = spec.add_layers();
  fc2->set_name("fc2");
  fc2->mutable_dense()->set_units(3);
  auto* loss = spec.add_layers();
  loss->set_name("loss");
  loss->mutable_softmax_cross_entropy();
  return spec;
}

v1::OptimizerSpec Sgd(float momentum = 0) {
  v1::OptimizerSpec spec;
  spec.set_type(v1::OPTIMIZER_SGD);
  spec.set_learning_rate(kLearningRate);
  spec.set_momentum(momentum);
  return spec;
}

// One simulated worker: a model on its own CPU backend and a batch of data.
struct Worker {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<FakePsClient> client;
  std::unique_ptr<RemoteUpdater> updater;
  Tensor images, labels;
  int batch = 8;

  static std::unique_ptr<Worker> Make(FakeServer* server, RemoteUpdaterOptions options,
                                      uint32_t data_seed) {
    auto w = std::make_unique<Worker>();
    w->backend = CreateCpuBackend();
    w->model = *Model::Create(TinyModel(), w->backend.get());
    EXPECT_OK(w->model->InitializeParameters());
    w->client = std::make_unique<FakePsClient>(server);
    auto updater = RemoteUpdater::Create(options, w->model.get(), w->client.get());
    EXPECT_OK(updater);
    w->updater = *std::move(updater);
    w->model->SetGradientReadyCallback([u = w->updater.get()](int layer,
                                                              absl::Span<const int> params) {
      u->OnGradientsReady(0, layer, params);
    });
    w->images = *w->backend->AllocateTensor(Shape{w->batch, 4});
    w->labels = *w->backend->AllocateTensor(Shape{w->batch});
    std::mt19937 rng(data_seed);
    std::uniform_real_distribution<float> pixel(-1.f, 1.f);
    for (int i = 0; i < w->batch * 4; ++i) w->images.data()[i] = pixel(rng);
    int32_t* labels = reinterpret_cast<int32_t*>(w->labels.data());
    for (int i = 0; i < w->batch; ++i) labels[i] = static_cast<int32_t>(rng() % 3);
    return w;
  }

  // Forward and backward only (the updater's BeforeStep ran before).
  absl::Status Compute(int64_t step) {
    const int32_t* labels = reinterpret_cast<const int32_t*>(this->labels.data());
    absl::Status s = model->Forward(images.data(), labels, batch, true, step);
    if (!s.ok()) return s;
    return model->Backward();
  }

  std::vector<float> Param(int i) {
    const Tensor& t = model->param(i);
    return std::vector<float>(t.data(), t.data() + t.num_elements());
  }
  std::vector<float> Grad(int i) {
    const Tensor& t = model->grad(i);
    return std::vector<float>(t.data(), t.data() + t.num_elements());
  }
};

ModelGraph TinyGraph() { return *BuildModelGraph(TinyModel()); }

// Small chunks (16 floats), two shards: parameters span several chunks.
ChunkPlan TinyPlan() { return *PlanChunks(TinyGraph(), 2, 64); }

RemoteUpdaterOptions Options(v1::ConsistencyMode mode, int rank) {
  RemoteUpdaterOptions options;
  options.mode = mode;
  options.rank = rank;
  options.optimizer = Sgd();
  options.min_push_bytes = 32;  // Several pushes per step.
  return options;
}

void ExpectNear(const std::vector<float>& actual, const std::vector<float>& expected,
                const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], 1e-5) << what << "[" << i << "]";
  }
}

TEST(RemoteUpdaterTest, SyncStepAppliesTheMeanOfTwoWorkersGradients) {
  const ModelGraph graph = TinyGraph();
  FakeServer server(v1::CONSISTENCY_SYNC, graph, TinyPlan(), 2);
  auto a = Worker::Make(&server, Options(v1::CONSISTENCY_SYNC, 0), 1);
  auto b = Worker::Make(&server, Options(v1::CONSISTENCY_SYNC, 1), 2);
  const auto initial = InitialParameterValues(graph);

  std::vector<std::vector<float>> grads_a, grads_b, stats_a, stats_b;
  auto run = [&](Worker* w, std::vector<std::vector<float>>* grads,
                 std::vector<std::vector<float>>* stats, absl::Status* result) {
    *result = w->updater->Start();
    if (!result->ok()) return;
    *result = w->updater->BeforeStep(0, *w->model);
    if (!result->ok()) return;
    *result = w->Compute(0);
    if (!result->ok()) return;
    for (int i = 0; i < w->model->num_params(); ++i) {
      grads->push_back(graph.params[i].trainable ? w->Grad(i) : std::vector<float>());
      stats->push_back(graph.params[i].trainable ? std::vector<float>() : w->Param(i));
    }
    *result = w->updater->ApplyUpdate(0, *w->model);
    if (!result->ok()) return;
    *result = w->updater->BeforeStep(1, *w->model);  // Waits for version 1.
  };
  absl::Status status_a, status_b;
  std::thread ta(run, a.get(), &grads_a, &stats_a, &status_a);
  std::thread tb(run, b.get(), &grads_b, &stats_b, &status_b);
  ta.join();
  tb.join();
  ASSERT_OK(status_a);
  ASSERT_OK(status_b);

  for (int i = 0; i < static_cast<int>(graph.params.size()); ++i) {
    std::vector<float> expected(initial[i].size());
    for (size_t k = 0; k < expected.size(); ++k) {
      expected[k] = graph.params[i].trainable
                        ? initial[i][k] - kLearningRate * (grads_a[i][k] + grads_b[i][k]) / 2
                        : (stats_a[i][k] + stats_b[i][k]) / 2;
    }
    ExpectNear(a->Param(i), expected, "worker a " + graph.params[i].name);
    ExpectNear(b->Param(i), expected, "worker b " + graph.params[i].name);
  }
  // The two workers computed different gradients: the mean is not either one.
  EXPECT_NE(grads_a[0], grads_b[0]);
  EXPECT_EQ(a->updater->version(), 1);
  EXPECT_EQ(b->updater->version(), 1);
  EXPECT_GT(server.Pushes(v1::ChunkHeader::KIND_GRADIENT), 2);  // Pushed per layer group.
  EXPECT_GT(server.Pushes(v1::ChunkHeader::KIND_PARAMETERS), 0);
}

TEST(RemoteUpdaterTest, AsyncAppliesEachPushAndSsPassesItsClock) {
  for (v1::ConsistencyMode mode : {v1::CONSISTENCY_ASYNC, v1::CONSISTENCY_SSP}) {
    const ModelGraph graph = TinyGraph();
    FakeServer server(mode, graph, TinyPlan(), 1);
    auto w = Worker::Make(&server, Options(mode, 0), 3);
    ASSERT_OK(w->updater->Start());
    for (int64_t step = 0; step < 3; ++step) {
      ASSERT_OK(w->updater->BeforeStep(step, *w->model));
      std::vector<std::vector<float>> before, grads;
      ASSERT_OK(w->Compute(step));
      for (int i = 0; i < w->model->num_params(); ++i) {
        before.push_back(w->Param(i));
        grads.push_back(graph.params[i].trainable ? w->Grad(i) : std::vector<float>());
      }
      ASSERT_OK(w->updater->ApplyUpdate(step, *w->model));
      EXPECT_EQ(w->client->last_push_clock, step + 1);
      EXPECT_EQ(w->client->last_pull_clock, step + 1);
      ASSERT_OK(w->updater->BeforeStep(step + 1, *w->model));
      for (int i = 0; i < w->model->num_params(); ++i) {
        if (!graph.params[i].trainable) {
          ExpectNear(w->Param(i), before[i], graph.params[i].name);  // Last write: rank 0's.
          continue;
        }
        std::vector<float> expected = before[i];
        for (size_t k = 0; k < expected.size(); ++k) expected[k] -= kLearningRate * grads[i][k];
        ExpectNear(w->Param(i), expected, graph.params[i].name);
      }
      EXPECT_EQ(w->updater->version(), step + 1);
    }
  }
}

TEST(RemoteUpdaterTest, AsyncRunningStatisticsArePushedByRankZeroOnly) {
  const ModelGraph graph = TinyGraph();
  FakeServer server(v1::CONSISTENCY_ASYNC, graph, TinyPlan(), 1);
  auto w = Worker::Make(&server, Options(v1::CONSISTENCY_ASYNC, 1), 3);
  ASSERT_OK(w->updater->Start());
  ASSERT_OK(w->updater->BeforeStep(0, *w->model));
  ASSERT_OK(w->Compute(0));
  ASSERT_OK(w->updater->ApplyUpdate(0, *w->model));
  EXPECT_EQ(server.Pushes(v1::ChunkHeader::KIND_PARAMETERS), 0);
  EXPECT_GT(server.Pushes(v1::ChunkHeader::KIND_GRADIENT), 0);
  w->updater->SetRank(0);
  ASSERT_OK(w->updater->BeforeStep(1, *w->model));
  ASSERT_OK(w->Compute(1));
  ASSERT_OK(w->updater->ApplyUpdate(1, *w->model));
  EXPECT_GT(server.Pushes(v1::ChunkHeader::KIND_PARAMETERS), 0);
}

TEST(RemoteUpdaterTest, AverageModeReplacesParametersByTheMeanEveryKSteps) {
  const ModelGraph graph = TinyGraph();
  FakeServer server(v1::CONSISTENCY_AVERAGE, graph, TinyPlan(), 2);
  RemoteUpdaterOptions options = Options(v1::CONSISTENCY_AVERAGE, 0);
  options.averaging_frequency = 2;
  options.average_optimizer_state = true;
  options.optimizer = Sgd(/*momentum=*/0.9f);
  auto a = Worker::Make(&server, options, 4);
  options.rank = 1;
  auto b = Worker::Make(&server, options, 5);

  // Parameters each worker holds just before its ApplyUpdate of step 1 (the
  // second local step, which ends with the round) and right after it.
  std::vector<std::vector<float>> after_round_a, after_round_b;
  auto run = [&](Worker* w, std::vector<std::vector<float>>* after_round, absl::Status* result) {
    *result = w->updater->Start();
    for (int64_t step = 0; result->ok() && step < 3; ++step) {
      *result = w->updater->BeforeStep(step, *w->model);
      if (result->ok()) *result = w->Compute(step);
      if (result->ok()) *result = w->updater->ApplyUpdate(step, *w->model);
      if (step == 1) {
        for (int i = 0; i < w->model->num_params(); ++i) after_round->push_back(w->Param(i));
      }
    }
    if (result->ok()) *result = w->updater->Finish();  // One step left over: a last round.
  };
  absl::Status status_a, status_b;
  std::thread ta(run, a.get(), &after_round_a, &status_a);
  std::thread tb(run, b.get(), &after_round_b, &status_b);
  ta.join();
  tb.join();
  ASSERT_OK(status_a);
  ASSERT_OK(status_b);

  const auto initial = InitialParameterValues(graph);
  const ChunkPlan& plan = server.plan();
  for (int i = 0; i < static_cast<int>(graph.params.size()); ++i) {
    // After round 1 both workers hold the same (averaged) values, and they
    // moved away from the initial ones: local steps happened.
    ExpectNear(after_round_a[i], after_round_b[i], graph.params[i].name);
    if (graph.params[i].trainable) {
      EXPECT_NE(after_round_a[i], initial[i]) << graph.params[i].name;
    }
    // After Finish, the model is the server's round-2 mean.
    std::vector<float> server_values;
    for (int c : plan.by_param[i]) {
      EXPECT_EQ(server.Version(c), 2) << "chunk " << c;
      auto v = server.Values(c);
      server_values.insert(server_values.end(), v.begin(), v.end());
    }
    ExpectNear(a->Param(i), server_values, "a final " + graph.params[i].name);
    ExpectNear(b->Param(i), server_values, "b final " + graph.params[i].name);
  }
  EXPECT_GT(server.Pushes(v1::ChunkHeader::KIND_OPTIMIZER_STATE), 0);
  EXPECT_EQ(server.Pushes(v1::ChunkHeader::KIND_GRADIENT), 0);
}

TEST(RemoteUpdaterTest, AbortedPushIsDroppedAndTheNextStepResyncs) {
  const ModelGraph graph = TinyGraph();
  FakeServer server(v1::CONSISTENCY_SYNC, graph, TinyPlan(), 1);
  auto w = Worker::Make(&server, Options(v1::CONSISTENCY_SYNC, 0), 6);
  ASSERT_OK(w->updater->Start());
  ASSERT_OK(w->updater->BeforeStep(0, *w->model));
  ASSERT_OK(w->Compute(0));
  server.RejectNextPush();  // The first push of step 0 (its first chunks).
  ASSERT_OK(w->updater->ApplyUpdate(0, *w->model));
  // Some chunks moved to version 1, the rejected ones stayed at 0.
  ASSERT_OK(w->updater->BeforeStep(1, *w->model));
  EXPECT_EQ(w->updater->resyncs(), 1);
  EXPECT_EQ(w->updater->version(), 0);
  for (int i = 0; i < w->model->num_params(); ++i) {
    std::vector<float> server_values;
    for (int c : server.plan().by_param[i]) {
      auto v = server.Values(c);
      server_values.insert(server_values.end(), v.begin(), v.end());
    }
    ExpectNear(w->Param(i), server_values, graph.params[i].name);
  }
  // Training goes on: the next step brings every chunk to a common version.
  ASSERT_OK(w->Compute(1));
  ASSERT_OK(w->updater->ApplyUpdate(1, *w->model));
  ASSERT_OK(w->updater->BeforeStep(2, *w->model));
  EXPECT_EQ(w->updater->resyncs(), 1);
  for (const ChunkInfo& c : server.plan().chunks) {
    EXPECT_GE(server.Version(c.id), 1) << "chunk " << c.id;
  }
}

// Issue 11 (a step's round trips): in sync mode the pull of version t+1
// goes out with step t's pushes instead of after their answers (the shard
// holds it until the step is applied); async and ssp pull after the
// answers, to read their own update.
TEST(RemoteUpdaterTest, SyncPullsGoOutWithThePushesAsyncAfterTheirAnswers) {
  for (v1::ConsistencyMode mode : {v1::CONSISTENCY_SYNC, v1::CONSISTENCY_ASYNC}) {
    FakeServer server(mode, TinyGraph(), TinyPlan(), 1);
    auto w = Worker::Make(&server, Options(mode, 0), 4);
    ASSERT_OK(w->updater->Start());
    ASSERT_OK(w->updater->BeforeStep(0, *w->model));
    ASSERT_OK(w->Compute(0));
    w->client->log.Take();
    ASSERT_OK(w->updater->ApplyUpdate(0, *w->model));
    const std::vector<std::string> events = w->client->log.Take();
    const auto first_wait = std::find(events.begin(), events.end(), "wait push");
    const auto pull = std::find(events.begin(), events.end(), "pull");
    ASSERT_NE(first_wait, events.end());
    ASSERT_NE(pull, events.end());
    if (mode == v1::CONSISTENCY_SYNC) {
      EXPECT_LT(pull, first_wait) << absl::StrJoin(events, ", ");
    } else {
      EXPECT_EQ(std::find(pull, events.end(), "wait push"), events.end())
          << absl::StrJoin(events, ", ");
    }
    // Either way the next step starts from the applied update.
    ASSERT_OK(w->updater->BeforeStep(1, *w->model));
    EXPECT_EQ(w->updater->version(), 1);
    EXPECT_EQ(w->updater->resyncs(), 0);
  }
}

// A shard answers a pull's chunks in request order, each once its barrier is
// complete, so the pull that goes out with a sync step's pushes asks for the
// chunks in the order they were pushed: backward's layer order, then running
// statistics. In forward order it would wait for the first layer's chunks,
// pushed last, before sending any.
TEST(RemoteUpdaterTest, SyncPullAsksForChunksInTheOrderTheyWerePushed) {
  FakeServer server(v1::CONSISTENCY_SYNC, TinyGraph(), TinyPlan(), 1);
  auto w = Worker::Make(&server, Options(v1::CONSISTENCY_SYNC, 0), 5);
  ASSERT_OK(w->updater->Start());
  ASSERT_OK(w->updater->BeforeStep(0, *w->model));
  w->client->TakePulledChunks();  // BeforeStep's first pull.
  ASSERT_OK(w->Compute(0));
  ASSERT_OK(w->updater->ApplyUpdate(0, *w->model));
  const std::vector<int> pushed = w->client->PushedChunks();
  const std::vector<int> pulled = w->client->TakePulledChunks();
  ASSERT_EQ(pushed.size(), TinyPlan().chunks.size());
  EXPECT_EQ(pulled, pushed) << "pushed " << absl::StrJoin(pushed, ",") << "; pulled "
                            << absl::StrJoin(pulled, ",");
  // fc2's weights (the last layer's) first.
  EXPECT_EQ(TinyPlan().chunks[pulled.front()].param, TinyGraph().layers[3].params[0]);
}

// Where the network is the bottleneck a push is still in flight when the
// next layers' gradients are ready: they then go as one push at the end of
// backward instead of one each, which would share the connections side by
// side and deliver every layer's chunks late. The chunks and their order do
// not change.
TEST(RemoteUpdaterTest, GradientsReadyWhileAPushIsInFlightGoAsOnePush) {
  std::vector<int> pushed_each_step[2];
  int gradient_pushes[2] = {0, 0};
  for (bool held : {false, true}) {
    FakeServer server(v1::CONSISTENCY_SYNC, TinyGraph(), TinyPlan(), 1);
    auto w = Worker::Make(&server, Options(v1::CONSISTENCY_SYNC, 0), 6);
    w->client->hold_pushes = held;
    ASSERT_OK(w->updater->Start());
    ASSERT_OK(w->updater->BeforeStep(0, *w->model));
    ASSERT_OK(w->Compute(0));
    ASSERT_OK(w->updater->ApplyUpdate(0, *w->model));
    ASSERT_OK(w->updater->BeforeStep(1, *w->model));
    EXPECT_EQ(w->updater->version(), 1);
    pushed_each_step[held] = w->client->PushedChunks();
    gradient_pushes[held] = server.Pushes(v1::ChunkHeader::KIND_GRADIENT);
  }
  // fc2, bn1 and fc1 each reach min_push_bytes: three pushes; held, fc2's
  // goes at once and bn1's and fc1's wait for the end of backward.
  EXPECT_EQ(gradient_pushes[false], 3);
  EXPECT_EQ(gradient_pushes[true], 2);
  EXPECT_EQ(pushed_each_step[true], pushed_each_step[false]);
}

TEST(RemoteUpdaterTest, CancelStopsAtTheNextStep) {
  FakeServer server(v1::CONSISTENCY_SYNC, TinyGraph(), TinyPlan(), 1);
  auto w = Worker::Make(&server, Options(v1::CONSISTENCY_SYNC, 0), 7);
  ASSERT_OK(w->updater->Start());
  w->updater->Cancel();
  absl::Status status = w->updater->BeforeStep(0, *w->model);
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
}

TEST(RemoteUpdaterTest, RejectsAPlanOfAnotherModel) {
  v1::ModelSpec other = TinyModel();
  other.mutable_layers()->erase(other.mutable_layers()->begin() + 1);  // No batch norm.
  FakeServer server(v1::CONSISTENCY_SYNC, *BuildModelGraph(other),
                    *PlanChunks(*BuildModelGraph(other), 1), 1);
  auto backend = CreateCpuBackend();
  auto model = *Model::Create(TinyModel(), backend.get());
  FakePsClient client(&server);
  auto updater = RemoteUpdater::Create(Options(v1::CONSISTENCY_SYNC, 0), model.get(), &client);
  EXPECT_TRUE(absl::IsInvalidArgument(updater.status())) << updater.status();
}

}  // namespace
}  // namespace pstrain
