// ParameterShard: see parameter_shard.h for the contract.
//
// Layout of the state, from coarse to fine:
//  * ParameterShard::mu_ guards the job map and the stats; it is held only for
//    a lookup or a counter update, never while waiting or computing.
//  * JobState::mu_ guards the membership (who may push, which generation) and the
//    ssp clocks. JobState::control_mu_ serialises SetMembers and Drop, which update
//    the job and then every chunk.
//    (ParameterShard::Job is a JobState; the logic lives in JobState.)
//  * Chunk::mu guards one chunk's version, published snapshot and barrier.
//    Pushes to different chunks run in parallel; a Pull waits on its chunk's
//    mutex (absl::Mutex::AwaitWithDeadline), so an update wakes only the
//    pulls of that chunk. The push that completes a sync/average barrier is
//    folded straight into the mean; with one member the optimizer reads the
//    pushed values directly. Every chunk holds its own pointer to the (shared,
//    immutable) Membership, replaced under Chunk::mu by SetMembers, so that a
//    push's membership check and the barrier it joins see the same set.
//  * The optimizer takes no lock of its own: a chunk's optimizer state is its
//    own Optimizer parameter, touched only under that chunk's mu, and the
//    one-thread CPU backend's update ops and host copies keep no state of
//    their own (kernels/cpu/cpu_backend.h), so updates of different chunks
//    of one job run on as many threads as push them (no lock serialises a
//    job). Lock order: JobState::control_mu_, then JobState::mu_, then
//    Chunk::mu; ParameterShard::mu_ is a leaf.
//
// Published values are std::shared_ptr<std::vector<float>> handed out as
// shared_ptr<const ...>. An update writes in place when the shard holds the
// only reference (no pull is still sending the old bytes), else it copies the
// snapshot first (copy-on-write); readers never see a buffer change.
#include "server/parameter_shard.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/optimizer.h"

namespace pstrain {
namespace {

using Kind = v1::ChunkHeader::Kind;

std::string KindName(Kind kind) {
  return v1::ChunkHeader::Kind_IsValid(kind) ? v1::ChunkHeader::Kind_Name(kind)
                                             : absl::StrCat("kind ", static_cast<int>(kind));
}

std::string ModeName(v1::ConsistencyMode mode) {
  switch (mode) {
    case v1::CONSISTENCY_ASYNC:
      return "async";
    case v1::CONSISTENCY_SSP:
      return "ssp";
    case v1::CONSISTENCY_AVERAGE:
      return "average";
    default:
      return "sync";
  }
}

// The optimizer-state slots of one trainable parameter, named as in
// Optimizer::StateTensors() and v1::OptimizerSlot.
std::vector<std::string> SlotNames(const v1::OptimizerSpec& spec) {
  if (spec.type() == v1::OPTIMIZER_ADAM || spec.type() == v1::OPTIMIZER_ADAMW) {
    return {"adam_m", "adam_v"};
  }
  if (spec.type() == v1::OPTIMIZER_SGD && spec.momentum() > 0.f) return {"momentum"};
  return {};
}

// Who takes part in a job. Immutable once published; replaced whole.
struct Membership {
  std::set<std::string> members;
  int64_t generation = 0;
  // The generation at which each member joined: a member that stays keeps
  // pushing with the generation it knows until its next assignment.
  std::map<std::string, int64_t> joined;
  bool dropped = false;

  bool Has(const std::string& worker_id) const { return members.count(worker_id) > 0; }
};

// The sum of the values the members pushed for one barrier (one version of a
// chunk's parameters, gradient or one optimizer slot).
struct Accumulator {
  std::vector<float> sum;
  std::set<std::string> contributors;

  void Add(const std::string& worker_id, absl::Span<const float> values) {
    if (contributors.empty()) {
      sum.assign(values.begin(), values.end());  // Reuses the capacity.
    } else {
      float* out = sum.data();
      const float* in = values.data();
      const size_t n = values.size();
      for (size_t i = 0; i < n; ++i) out[i] += in[i];
    }
    contributors.insert(worker_id);
  }
};

// True when adding `values` to `sum` element-wise would turn two finite
// floats into an infinity (|a + b| > FLT_MAX). One branch-free pass.
bool SumOverflows(const std::vector<float>& sum, absl::Span<const float> values) {
  const float* a = sum.data();
  const float* b = values.data();
  const size_t n = std::min(sum.size(), values.size());
  constexpr float kMax = std::numeric_limits<float>::max();
  bool any = false;
  for (size_t i = 0; i < n; ++i) {
    any |= std::fabs(a[i] + b[i]) > kMax && std::fabs(a[i]) <= kMax && std::fabs(b[i]) <= kMax;
  }
  return any;
}

// A push that has been validated but not yet added to `target`: the push
// that may complete a barrier is folded into the mean directly (one pass
// fewer over the chunk, and none at all with a single member).
struct Contribution {
  const Accumulator* target = nullptr;
  const std::string* worker_id = nullptr;
  absl::Span<const float> values;

  bool Targets(const Accumulator& acc) const { return target == &acc; }
};

// True when every member has contributed to `acc` (counting `extra`).
// Removed members' contributions stay in the sum: they were computed from
// the right version.
bool Covers(const Accumulator& acc, const Membership& membership, const Contribution* extra) {
  const bool counts_extra = extra != nullptr && extra->Targets(acc);
  if (acc.contributors.empty() && !counts_extra) return false;
  for (const std::string& m : membership.members) {
    if (acc.contributors.count(m) == 0 && !(counts_extra && *extra->worker_id == m)) return false;
  }
  return true;
}

// The mean of `acc`'s contributions and `extra` (when it targets `acc`):
// either extra's own values (the only contribution) or acc->sum, overwritten
// with the mean. Exact division, so that the mean of two pushes is
// bit-identical to (a + b) / 2 whatever order they came in. Clears the
// contributors.
const float* TakeMean(Accumulator* acc, const Contribution* extra) {
  const bool counts_extra = extra != nullptr && extra->Targets(*acc);
  const size_t contributors = acc->contributors.size() + (counts_extra ? 1 : 0);
  acc->contributors.clear();
  if (counts_extra && contributors == 1) return extra->values.data();
  float* sum = acc->sum.data();
  const size_t n = acc->sum.size();
  const float divisor = static_cast<float>(contributors);
  if (counts_extra) {
    const float* in = extra->values.data();
    for (size_t i = 0; i < n; ++i) sum[i] = (sum[i] + in[i]) / divisor;
  } else if (contributors > 1) {
    for (size_t i = 0; i < n; ++i) sum[i] /= divisor;
  }
  return sum;
}

// Counters one call contributes to ShardStats.
struct Outcome {
  int64_t applied_updates = 0;
  // How long each barrier this call completed waited for its last member.
  absl::InlinedVector<absl::Duration, 1> barrier_waits;
  int64_t staleness = -1;  // Recorded for async/ssp gradients.
  bool duplicate = false;  // Acknowledged, not applied.
};

// The updates of one member applied to one chunk (exactly-once pushes):
// its current incarnation and the last update_seq per push target
// ([0]: values, i.e. gradient or parameters; [1 + s]: optimizer slot s).
struct AppliedUpdates {
  uint64_t incarnation = 0;
  std::vector<int64_t> last_seq;
};

// Index of the push target of `args` in AppliedUpdates::last_seq.
size_t TargetIndex(const PushArgs& args) {
  return args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE ? 1 + static_cast<size_t>(args.slot)
                                                            : 0;
}

struct Chunk {
  // Constant after configuration.
  int id = 0;
  int64_t count = 0;
  bool trainable = true;
  std::string param_name;
  int optimizer_index = -1;              // sync/async/ssp trainable chunks.
  std::vector<Tensor*> optimizer_state;  // Its slots in the optimizer (Job::optimizer_mu).

  absl::Mutex mu;
  std::shared_ptr<const Membership> membership ABSL_GUARDED_BY(mu);
  int64_t version ABSL_GUARDED_BY(mu) = 0;
  std::shared_ptr<std::vector<float>> values ABSL_GUARDED_BY(mu);
  // Average mode: the published optimizer slots (empty in other modes, where
  // the optimizer owns them).
  std::vector<std::shared_ptr<std::vector<float>>> slots ABSL_GUARDED_BY(mu);
  // Barriers (sync and average modes).
  Accumulator values_barrier ABSL_GUARDED_BY(mu);
  std::vector<Accumulator> slot_barriers ABSL_GUARDED_BY(mu);
  // When the open barrier's first push arrived (InfiniteFuture: none yet).
  absl::Time barrier_opened ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  // Exactly-once records, one per member that pushed with an update id.
  std::map<std::string, AppliedUpdates> applied ABSL_GUARDED_BY(mu);
  // Trainable chunks: the highest worker_clock accepted from each member
  // for the chunk's values (its steps here; SetMembers reports a removed
  // member's).
  std::map<std::string, int64_t> member_clock ABSL_GUARDED_BY(mu);
  // Pull compression (sync mode, trainable chunks not sent whole; constant
  // after configuration): `published` holds what the workers hold, `delta`
  // the encoded change of it from version - 1 to version (null when this
  // version was not reached by a step here, or could not be encoded).
  bool compress_pulls = false;
  std::shared_ptr<std::vector<float>> published ABSL_GUARDED_BY(mu);
  std::shared_ptr<const EncodedGradient> delta ABSL_GUARDED_BY(mu);
  // A consistent cut (ReadChunks at a version): the version wanted, and the
  // chunk as it was when it reached it (filled by the update that does).
  int64_t capture_version ABSL_GUARDED_BY(mu) = -1;
  std::optional<v1::ChunkValues> captured ABSL_GUARDED_BY(mu);

  // True when `args` (with an update id) was applied already.
  bool AlreadyApplied(const PushArgs& args) const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    auto it = applied.find(args.worker_id);
    if (it == applied.end() || it->second.incarnation != args.incarnation) return false;
    const size_t target = TargetIndex(args);
    return target < it->second.last_seq.size() && args.update_seq <= it->second.last_seq[target];
  }
  void RecordApplied(const PushArgs& args) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    AppliedUpdates& record = applied[args.worker_id];
    if (record.incarnation != args.incarnation) record = AppliedUpdates{args.incarnation, {}};
    const size_t target = TargetIndex(args);
    if (record.last_seq.size() <= target) record.last_seq.resize(target + 1, -1);
    record.last_seq[target] = std::max(record.last_seq[target], args.update_seq);
  }
};

// Makes `*snapshot` writable: in place when nobody else holds it, else a copy
// replaces it.
std::vector<float>* Writable(std::shared_ptr<std::vector<float>>* snapshot) {
  if (snapshot->use_count() == 1) {
    // Pairs with the release decrement of the last reader's reference, so its
    // reads happen before our writes.
    std::atomic_thread_fence(std::memory_order_acquire);
    return snapshot->get();
  }
  *snapshot = std::make_shared<std::vector<float>>(**snapshot);
  return snapshot->get();
}

// Publishes `fresh` as the new snapshot and hands the old buffer back for
// reuse when nobody else holds it.
void Publish(std::shared_ptr<std::vector<float>>* snapshot, std::vector<float>* fresh) {
  auto next = std::make_shared<std::vector<float>>(std::move(*fresh));
  fresh->clear();
  if (*snapshot != nullptr && snapshot->use_count() == 1) {
    std::atomic_thread_fence(std::memory_order_acquire);
    *fresh = std::move(**snapshot);
  }
  *snapshot = std::move(next);
}

// The per-job state. Thread-safe; see the lock notes at the top of the file.
class JobState {
 public:
  JobState() = default;
  JobState(const JobState&) = delete;
  JobState& operator=(const JobState&) = delete;

  absl::Status Init(const ShardJobConfig& config, const std::vector<v1::ChunkValues>& initial,
                    const ParameterShard::Options& options);
  // The barriers that the removal of members completed.
  absl::StatusOr<Outcome> SetMembers(const std::vector<std::string>& members, int64_t generation,
                                     v1::SetMembersResponse* response);
  void Drop();
  absl::StatusOr<int64_t> Push(const PushArgs& args, absl::Span<const float> values,
                               const ParameterShard::Options& options, Outcome* outcome);
  absl::StatusOr<PulledChunk> Pull(const PullArgs& args, absl::Time deadline);
  absl::StatusOr<std::vector<v1::ChunkValues>> ReadChunks(
      const ParameterShard::ReadOptions& options, absl::Time deadline);
  const ChunkPlan& plan() const { return plan_; }

  // Push pacing (ParameterShard::WatchPace, PaceSlack).
  bool WatchPace(std::weak_ptr<PaceWatcher> watcher);
  int64_t PaceSlack(const std::string& worker_id, int64_t version) const;

 private:
  bool barrier_mode() const {
    return mode_ == v1::CONSISTENCY_SYNC || mode_ == v1::CONSISTENCY_AVERAGE;
  }
  bool averages_state(const Chunk& chunk) const {
    return mode_ == v1::CONSISTENCY_AVERAGE && average_optimizer_state_ && chunk.trainable &&
           !slot_names_.empty();
  }
  std::string Describe(const Chunk& chunk) const {
    return absl::StrCat("chunk ", chunk.id, " (", chunk.param_name, ") of job ", job_id_);
  }

  absl::StatusOr<Chunk*> FindChunk(int chunk_id) const;
  absl::Status CheckPushKind(const Chunk& chunk, const PushArgs& args) const;
  absl::Status CheckCaller(const Membership& membership, const std::string& worker_id,
                           int64_t generation) const;
  absl::Status PushToBarrier(Chunk& chunk, const PushArgs& args, absl::Span<const float> values,
                             Outcome* outcome) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  absl::Status ApplyOnArrival(Chunk& chunk, const PushArgs& args, absl::Span<const float> values,
                              int64_t max_version_lead, Outcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  // True when every member has pushed every part of the chunk's barrier
  // (counting `extra`, which may be null).
  bool BarrierReady(const Chunk& chunk, const Contribution* extra) const
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu);
  // Applies or publishes the mean and advances the version; BarrierReady
  // must hold.
  absl::Status CompleteBarrier(Chunk& chunk, const Contribution* extra, Outcome* outcome)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  absl::Status ApplyGradient(Chunk& chunk, const float* gradient)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  // Pull compression: moves the published values towards the master values
  // by what pull_compression_ encodes of their difference, and keeps that
  // encoding as the chunk's delta.
  void PublishDelta(Chunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  absl::Status AwaitClock(const PullArgs& args, absl::Time deadline);
  // The chunk's values, version and optimizer slots as they are now.
  absl::StatusOr<v1::ChunkValues> Snapshot(const Chunk& chunk) ABSL_SHARED_LOCKS_REQUIRED(chunk.mu);
  // Takes the chunk's snapshot when it has just reached a wanted cut.
  absl::Status CaptureIfWanted(Chunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  int64_t MinClock() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Counts a member's accepted push of `version` and, when the slowest
  // member moved on, tells the watchers (after releasing pace_mu_).
  void CountPace(const std::string& worker_id, int64_t version, const Membership& membership);
  // Recomputes the slowest member's count for `membership`; true if it grew.
  bool UpdatePaceMin(const Membership& membership) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pace_mu_);
  // The lead for pushes of `version`.
  int64_t PaceLead(int64_t version) const ABSL_SHARED_LOCKS_REQUIRED(pace_mu_);
  // The live watchers (the expired ones are forgotten).
  std::vector<std::shared_ptr<PaceWatcher>> LiveWatchers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pace_mu_);

  // Constant after Init.
  std::string job_id_;
  v1::ConsistencyMode mode_ = v1::CONSISTENCY_SYNC;
  int staleness_ = 0;
  bool average_optimizer_state_ = false;
  v1::CompressionSpec pull_compression_;
  uint64_t values_epoch_ = 0;  // Non-zero; new with every configuration.
  ChunkPlan plan_;
  std::function<absl::Time()> clock_;  // Constant after Init.
  // Sync jobs: Options::pace_lead_frames (kAutoPaceLead: pace_tuner_ sets
  // the lead); 0: not paced.
  int pace_lead_ = 0;
  std::function<void(const std::string&)> log_;
  std::vector<int> local_index_;  // Chunk id -> index in chunks_, or -1.
  std::vector<std::string> slot_names_;
  std::unique_ptr<Backend> backend_;      // sync/async/ssp only.
  std::unique_ptr<Optimizer> optimizer_;  // Declared after backend_: destroyed first.
  std::vector<std::unique_ptr<Chunk>> chunks_;

  absl::Mutex control_mu_;    // Serialises SetMembers and Drop.

  // Push pacing: the frames each member pushed for pace_version_ (the
  // newest version pushed here; a member pushes version t + 1 only after
  // pulling every chunk at t + 1, so older versions are done).
  mutable absl::Mutex pace_mu_;
  int64_t pace_version_ ABSL_GUARDED_BY(pace_mu_) = -1;
  absl::Time pace_version_started_ ABSL_GUARDED_BY(pace_mu_);          // Its first push here.
  std::optional<PaceLeadTuner> pace_tuner_ ABSL_GUARDED_BY(pace_mu_);  // kAutoPaceLead.
  std::map<std::string, int64_t> pace_frames_ ABSL_GUARDED_BY(pace_mu_);
  int64_t pace_min_ ABSL_GUARDED_BY(pace_mu_) = 0;  // The slowest member's frames.
  std::vector<std::weak_ptr<PaceWatcher>> pace_watchers_ ABSL_GUARDED_BY(pace_mu_);

  mutable absl::Mutex mu_;
  std::shared_ptr<const Membership> membership_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> clocks_ ABSL_GUARDED_BY(mu_);  // ssp: per member.
};

absl::Status JobState::Init(const ShardJobConfig& config,
                            const std::vector<v1::ChunkValues>& initial,
                            const ParameterShard::Options& options) {
  const JobLimits& limits = options.job_limits;
  const int shard_index = options.shard_index;
  if (config.job_id.empty()) return absl::InvalidArgumentError("ConfigureJob: empty job_id");
  job_id_ = config.job_id;
  clock_ = options.clock;
  const std::string where = absl::StrCat("ConfigureJob(", job_id_, "): ");
  if (absl::Status s = ValidateJobSpec(config.spec); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, s.message()));
  }
  if (absl::Status s = ValidateOptimizerSpec(config.spec.optimizer()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, s.message()));
  }
  if (config.num_shards < 1 || shard_index < 0 || shard_index >= config.num_shards) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, "shard index ", shard_index,
                     " is outside [0, num_shards = ", config.num_shards, ")"));
  }
  for (const std::string& w : config.members) {
    if (w.empty()) return absl::InvalidArgumentError(absl::StrCat(where, "empty worker id"));
  }
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(config.spec.model());
  if (!graph.ok()) return absl::InvalidArgumentError(absl::StrCat(where, graph.status().message()));
  if (absl::Status s = CheckJobLimits(config.spec, *graph, limits); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, s.message()));
  }
  absl::StatusOr<ChunkPlan> plan = PlanChunks(*graph, config.num_shards, config.chunk_bytes);
  if (!plan.ok()) return absl::InvalidArgumentError(absl::StrCat(where, plan.status().message()));
  plan_ = *std::move(plan);

  mode_ = ConsistencyModeOf(config.spec);
  pace_lead_ = mode_ == v1::CONSISTENCY_SYNC ? options.pace_lead_frames : 0;
  if (pace_lead_ == ParameterShard::kAutoPaceLead) {
    absl::MutexLock lock(&pace_mu_);
    pace_tuner_.emplace(options.pace_tuner);
  } else {
    pace_lead_ = std::max(pace_lead_, 0);
  }
  log_ = options.log;
  staleness_ = config.spec.staleness();
  average_optimizer_state_ = config.spec.average_optimizer_state();
  slot_names_ = SlotNames(config.spec.optimizer());
  pull_compression_ = config.spec.pull_compression();
  {
    absl::BitGen bits;
    while (values_epoch_ == 0) values_epoch_ = absl::Uniform<uint64_t>(bits);
  }
  const std::vector<bool> pulled_whole = ChunksSentWhole(pull_compression_, plan_);

  // Check the initial values against the plan before allocating anything.
  const std::vector<int>& owned = plan_.by_shard[shard_index];
  if (initial.size() != owned.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "shard ", shard_index, " owns ",
                                                   owned.size(), " chunks, got initial values for ",
                                                   initial.size()));
  }
  for (size_t i = 0; i < owned.size(); ++i) {
    const ChunkInfo& info = plan_.chunks[owned[i]];
    const v1::ChunkValues& given = initial[i];
    const bool trainable = graph->params[info.param].trainable;
    const std::string chunk =
        absl::StrCat("chunk ", info.id, " (", graph->params[info.param].name, ")");
    if (given.chunk_id() != info.id) {
      return absl::InvalidArgumentError(absl::StrCat(where, "initial value ", i, " is for chunk ",
                                                     given.chunk_id(), ", expected chunk ", info.id,
                                                     " (plan order)"));
    }
    if (given.values_size() != info.count) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, chunk, " holds ", info.count, " values, got ", given.values_size()));
    }
    if (given.version() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, chunk, " has negative version ", given.version()));
    }
    if (given.slots_size() == 0) continue;
    if (!trainable || given.slots_size() != static_cast<int>(slot_names_.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, chunk, " got ", given.slots_size(), " optimizer slots, expected ",
          trainable ? slot_names_.size() : 0, " (", absl::StrJoin(slot_names_, ", "), ")"));
    }
    for (int s = 0; s < given.slots_size(); ++s) {
      if (given.slots(s).name() != slot_names_[s] || given.slots(s).values_size() != info.count) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, chunk, " slot ", s, " is '", given.slots(s).name(), "' with ",
                         given.slots(s).values_size(), " values, expected '", slot_names_[s],
                         "' with ", info.count));
      }
    }
  }

  if (mode_ != v1::CONSISTENCY_AVERAGE) {
    CpuBackendOptions backend_options;
    backend_options.num_threads = 1;  // The server shares the cores with workers.
    backend_ = CreateCpuBackend(backend_options);
    PSTRAIN_ASSIGN_OR_RETURN(optimizer_,
                             Optimizer::Create(config.spec.optimizer(), backend_.get()));
  }

  auto membership = std::make_shared<Membership>();
  membership->members.insert(config.members.begin(), config.members.end());
  membership->generation = config.generation;
  for (const std::string& w : config.members) membership->joined[w] = config.generation;

  local_index_.assign(plan_.chunks.size(), -1);
  for (size_t i = 0; i < owned.size(); ++i) {
    const ChunkInfo& info = plan_.chunks[owned[i]];
    const v1::ChunkValues& given = initial[i];
    auto chunk = std::make_unique<Chunk>();
    chunk->id = info.id;
    chunk->count = info.count;
    chunk->trainable = graph->params[info.param].trainable;
    chunk->param_name = graph->params[info.param].name;
    absl::MutexLock lock(&chunk->mu);
    chunk->membership = membership;
    chunk->version = given.version();
    chunk->values =
        std::make_shared<std::vector<float>>(given.values().begin(), given.values().end());
    chunk->compress_pulls = mode_ == v1::CONSISTENCY_SYNC && chunk->trainable &&
                            pull_compression_.method() != v1::CompressionSpec::COMPRESSION_NONE &&
                            !pulled_whole[info.id];
    if (chunk->compress_pulls) {
      chunk->published = std::make_shared<std::vector<float>>(*chunk->values);
    }
    if (chunk->trainable && optimizer_ != nullptr) {
      const std::string name = absl::StrCat("chunk", info.id);
      PSTRAIN_ASSIGN_OR_RETURN(chunk->optimizer_index, optimizer_->AddParameter(name, info.count));
      for (const std::string& slot : slot_names_) {
        for (auto& [state_name, tensor] : optimizer_->StateTensors()) {
          if (state_name == absl::StrCat(name, "/", slot)) chunk->optimizer_state.push_back(tensor);
        }
      }
      if (chunk->optimizer_state.size() != slot_names_.size()) {
        return absl::InternalError(absl::StrCat(where, "optimizer has ",
                                                chunk->optimizer_state.size(), " state slots for ",
                                                name, ", expected ", slot_names_.size()));
      }
      for (int s = 0; s < given.slots_size(); ++s) {
        PSTRAIN_RETURN_IF_ERROR(backend_->CopyHostToDevice(chunk->optimizer_state[s]->data(),
                                                           given.slots(s).values().data(),
                                                           info.count * sizeof(float)));
      }
    }
    if (chunk->trainable && mode_ == v1::CONSISTENCY_AVERAGE &&
        (averages_state(*chunk) || given.slots_size() > 0)) {
      for (size_t s = 0; s < slot_names_.size(); ++s) {
        if (given.slots_size() > 0) {
          const auto& src = given.slots(static_cast<int>(s)).values();
          chunk->slots.push_back(std::make_shared<std::vector<float>>(src.begin(), src.end()));
        } else {
          chunk->slots.push_back(std::make_shared<std::vector<float>>(info.count, 0.f));
        }
      }
      if (averages_state(*chunk)) chunk->slot_barriers.resize(slot_names_.size());
    }
    local_index_[info.id] = static_cast<int>(chunks_.size());
    chunks_.push_back(std::move(chunk));
  }
  if (backend_ != nullptr) PSTRAIN_RETURN_IF_ERROR(backend_->Synchronize());

  absl::MutexLock lock(&mu_);
  membership_ = membership;
  for (const std::string& w : membership->members) clocks_[w] = 0;
  return absl::OkStatus();
}

absl::StatusOr<Chunk*> JobState::FindChunk(int chunk_id) const {
  if (chunk_id < 0 || chunk_id >= static_cast<int>(plan_.chunks.size())) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", chunk_id, " is out of range: job ",
                                                   job_id_, " has ", plan_.chunks.size(),
                                                   " chunks"));
  }
  const int index = local_index_[chunk_id];
  if (index < 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", chunk_id, " of job ", job_id_,
                                                   " is owned by shard ",
                                                   plan_.chunks[chunk_id].shard, ", not this one"));
  }
  return chunks_[index].get();
}

absl::Status JobState::CheckPushKind(const Chunk& chunk, const PushArgs& args) const {
  Kind expected = v1::ChunkHeader::KIND_PARAMETERS;
  if (chunk.trainable && mode_ != v1::CONSISTENCY_AVERAGE)
    expected = v1::ChunkHeader::KIND_GRADIENT;
  if (args.kind == expected) return absl::OkStatus();
  if (args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE && averages_state(chunk)) {
    if (args.slot < 0 || args.slot >= static_cast<int>(slot_names_.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer-state slot ", args.slot, " is out of range for ", Describe(chunk), ": it has ",
          slot_names_.size(), " (", absl::StrJoin(slot_names_, ", "), ")"));
    }
    return absl::OkStatus();
  }
  std::string allowed = KindName(expected);
  if (averages_state(chunk)) absl::StrAppend(&allowed, " or KIND_OPTIMIZER_STATE");
  return absl::InvalidArgumentError(absl::StrCat(Describe(chunk), " takes ", allowed, " pushes in ",
                                                 ModeName(mode_), " mode, got ",
                                                 KindName(args.kind)));
}

absl::Status JobState::CheckCaller(const Membership& membership, const std::string& worker_id,
                                   int64_t generation) const {
  if (membership.dropped) return absl::NotFoundError(absl::StrCat("unknown job ", job_id_));
  if (!membership.Has(worker_id)) {
    if (generation != membership.generation) {
      return absl::AbortedError(absl::StrCat("generation ", generation, " of job ", job_id_,
                                             " is not current: the job is at generation ",
                                             membership.generation, "; get a new assignment"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", worker_id, " is not a member of job ", job_id_));
  }
  // A member that stayed through a membership change may still carry the
  // generation it joined with (its new assignment is on its way): its
  // updates are valid, and dropping them would lose samples.
  auto joined = membership.joined.find(worker_id);
  const int64_t since = joined == membership.joined.end() ? membership.generation : joined->second;
  if (generation < since || generation > membership.generation) {
    return absl::AbortedError(absl::StrCat(
        "generation ", generation, " of job ", job_id_, " is not current for worker ", worker_id,
        ": the job is at generation ", membership.generation, "; get a new assignment"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> JobState::Push(const PushArgs& args, absl::Span<const float> values,
                                       const ParameterShard::Options& options, Outcome* outcome) {
  // Stateless checks first, outside any lock.
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(args.chunk_id));
  PSTRAIN_RETURN_IF_ERROR(CheckPushKind(*chunk, args));
  if (static_cast<int64_t>(values.size()) != chunk->count) {
    return absl::InvalidArgumentError(
        absl::StrCat(Describe(*chunk), " holds ", chunk->count, " values, got ", values.size()));
  }
  if (options.reject_non_finite) {
    if (const int64_t bad = FirstNonFiniteIndex(values.data(), static_cast<int64_t>(values.size()));
        bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("value ", bad, " of the push to ",
                                                     Describe(*chunk), " is not finite (",
                                                     values[bad], ")"));
    }
  }
  if (args.version < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative version ", args.version));
  }

  const bool has_update_id = args.incarnation != 0;
  if (has_update_id && args.update_seq < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative update_seq ", args.update_seq));
  }
  int64_t version;
  std::shared_ptr<const Membership> paced_by;  // Set when this push counts for pacing.
  {
    absl::MutexLock lock(&chunk->mu);
    PSTRAIN_RETURN_IF_ERROR(CheckCaller(*chunk->membership, args.worker_id, args.generation));
    if (has_update_id && chunk->AlreadyApplied(args)) {
      outcome->duplicate = true;
    } else if (barrier_mode()) {
      PSTRAIN_RETURN_IF_ERROR(PushToBarrier(*chunk, args, values, outcome));
      if (pace_lead_ != 0 && !outcome->duplicate) paced_by = chunk->membership;
    } else {
      PSTRAIN_RETURN_IF_ERROR(
          ApplyOnArrival(*chunk, args, values, options.max_version_lead, outcome));
    }
    if (has_update_id) chunk->RecordApplied(args);
    if (chunk->trainable && TargetIndex(args) == 0) {
      int64_t& clock = chunk->member_clock[args.worker_id];
      clock = std::max<int64_t>(clock, args.worker_clock);
    }
    version = chunk->version;
  }
  if (paced_by != nullptr) CountPace(args.worker_id, args.version, *paced_by);
  if (mode_ == v1::CONSISTENCY_SSP) {
    // After the update is visible, so that a pull released by this clock sees it.
    absl::MutexLock lock(&mu_);
    if (membership_->Has(args.worker_id)) {
      int64_t& clock = clocks_[args.worker_id];
      clock = std::max<int64_t>(clock, args.worker_clock);
    }
  }
  return version;
}

absl::Status JobState::PushToBarrier(Chunk& chunk, const PushArgs& args,
                                     absl::Span<const float> values, Outcome* outcome) {
  if (args.version > chunk.version) {
    return absl::InvalidArgumentError(absl::StrCat("version ", args.version,
                                                   " is ahead of the server's ", chunk.version,
                                                   " (", Describe(chunk), ")"));
  }
  if (args.version < chunk.version) {
    return absl::AbortedError(absl::StrCat("version ", args.version, " is stale: ", Describe(chunk),
                                           " is at version ", chunk.version));
  }
  Accumulator& barrier = args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE
                             ? chunk.slot_barriers[args.slot]
                             : chunk.values_barrier;
  if (barrier.contributors.count(args.worker_id) > 0) {
    if (args.incarnation != 0) {
      // A newer update of a member for a barrier it is already in (it
      // resynchronised after a failed step): its first contribution stands.
      outcome->duplicate = true;
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "duplicate push: worker ", args.worker_id, " already pushed ", KindName(args.kind),
        args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE ? absl::StrCat(" slot ", args.slot) : "",
        " for version ", args.version, " of ", Describe(chunk)));
  }
  // The mean is (sum + values) / n: refuse a push whose addition would
  // overflow to Inf (two finite gradients of 3e38 averaged to -Inf), before
  // anything is written.
  if (!barrier.contributors.empty() && SumOverflows(barrier.sum, values)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the push of ", KindName(args.kind), " to ", Describe(chunk), " by worker ", args.worker_id,
        " overflows float when added to the other members' values for version ", args.version,
        "; values this large cannot be averaged"));
  }
  if (chunk.barrier_opened == absl::InfiniteFuture()) chunk.barrier_opened = clock_();
  const Contribution contribution{&barrier, &args.worker_id, values};
  if (BarrierReady(chunk, &contribution)) return CompleteBarrier(chunk, &contribution, outcome);
  barrier.Add(args.worker_id, values);
  return absl::OkStatus();
}

bool JobState::BarrierReady(const Chunk& chunk, const Contribution* extra) const {
  const Membership& membership = *chunk.membership;
  if (membership.dropped || !Covers(chunk.values_barrier, membership, extra)) return false;
  for (const Accumulator& slot : chunk.slot_barriers) {
    if (!Covers(slot, membership, extra)) return false;
  }
  return true;
}

absl::Status JobState::CompleteBarrier(Chunk& chunk, const Contribution* extra, Outcome* outcome) {
  // Publishes the mean held by `acc` (or extra's values) as `*snapshot`.
  auto publish_mean = [extra](Accumulator* acc, std::shared_ptr<std::vector<float>>* snapshot) {
    const float* mean = TakeMean(acc, extra);
    if (mean != acc->sum.data()) acc->sum.assign(extra->values.begin(), extra->values.end());
    Publish(snapshot, &acc->sum);
  };
  absl::Status status = absl::OkStatus();
  if (mode_ == v1::CONSISTENCY_SYNC && chunk.trainable) {
    status = ApplyGradient(chunk, TakeMean(&chunk.values_barrier, extra));
  } else {
    publish_mean(&chunk.values_barrier, &chunk.values);  // The mean becomes the parameters.
  }
  for (size_t s = 0; s < chunk.slot_barriers.size(); ++s) {
    publish_mean(&chunk.slot_barriers[s], &chunk.slots[s]);
  }
  PSTRAIN_RETURN_IF_ERROR(status);
  ++chunk.version;
  ++outcome->applied_updates;
  if (chunk.barrier_opened != absl::InfiniteFuture()) {
    outcome->barrier_waits.push_back(clock_() - chunk.barrier_opened);
    chunk.barrier_opened = absl::InfiniteFuture();
  }
  if (chunk.compress_pulls) PublishDelta(chunk);
  return CaptureIfWanted(chunk);
}

void JobState::PublishDelta(Chunk& chunk) {
  chunk.delta.reset();
  const std::vector<float>& master = *chunk.values;
  std::vector<float>& published = *Writable(&chunk.published);
  const size_t n = master.size();
  thread_local std::vector<float> difference, decoded;
  difference.resize(n);
  for (size_t i = 0; i < n; ++i) difference[i] = master[i] - published[i];
  auto delta = std::make_shared<EncodedGradient>();
  absl::Status status =
      EncodeWithoutFeedback(pull_compression_, absl::MakeSpan(difference), delta.get());
  if (status.ok()) {
    v1::ChunkHeader header;
    header.set_chunk_id(chunk.id);
    header.set_num_elements(static_cast<int64_t>(n));
    header.set_dtype(delta->dtype);
    header.set_encoding(delta->encoding);
    header.set_encoded_count(delta->encoded_count);
    status = AddEncodedDelta(header, delta->bytes.data(), delta->bytes.size(),
                             absl::MakeSpan(published), &decoded);
  }
  if (!status.ok()) {
    // A difference beyond float's range: this step the workers take the
    // values whole (no delta), and they are the master's.
    std::copy(master.begin(), master.end(), published.begin());
    return;
  }
  chunk.delta = std::move(delta);
}

absl::Status JobState::ApplyGradient(Chunk& chunk, const float* gradient) {
  std::vector<float>* target = Writable(&chunk.values);
  return optimizer_->Apply(chunk.optimizer_index, target->data(), gradient, chunk.version);
}

absl::Status JobState::ApplyOnArrival(Chunk& chunk, const PushArgs& args,
                                      absl::Span<const float> values, int64_t max_version_lead,
                                      Outcome* outcome) {
  if (args.version > chunk.version + max_version_lead) {
    return absl::InvalidArgumentError(absl::StrCat("version ", args.version,
                                                   " is ahead of the server's ", chunk.version,
                                                   " (", Describe(chunk), ")"));
  }
  if (chunk.trainable) {
    outcome->staleness = std::max<int64_t>(chunk.version - args.version, 0);
    PSTRAIN_RETURN_IF_ERROR(ApplyGradient(chunk, values.data()));
  } else {
    // Running statistics: the last write wins.
    std::vector<float>* target = Writable(&chunk.values);
    std::copy(values.begin(), values.end(), target->begin());
  }
  ++chunk.version;
  ++outcome->applied_updates;
  return absl::OkStatus();
}

bool JobState::WatchPace(std::weak_ptr<PaceWatcher> watcher) {
  if (pace_lead_ == 0) return false;
  absl::MutexLock lock(&pace_mu_);
  std::erase_if(pace_watchers_, [](const std::weak_ptr<PaceWatcher>& w) { return w.expired(); });
  pace_watchers_.push_back(std::move(watcher));
  return true;
}

int64_t JobState::PaceSlack(const std::string& worker_id, int64_t version) const {
  constexpr int64_t kUnpaced = int64_t{1} << 40;
  if (pace_lead_ == 0) return kUnpaced;
  absl::MutexLock lock(&pace_mu_);
  if (version < pace_version_) return kUnpaced;  // A retry of a step already done.
  const int64_t lead = PaceLead(version);
  if (version > pace_version_) return lead;  // The first to push it.
  auto it = pace_frames_.find(worker_id);
  const int64_t own = it == pace_frames_.end() ? 0 : it->second;
  return std::max<int64_t>(0, pace_min_ + lead - own);
}

int64_t JobState::PaceLead(int64_t version) const {
  return pace_tuner_.has_value() ? pace_tuner_->LeadFor(version) : pace_lead_;
}

void JobState::CountPace(const std::string& worker_id, int64_t version,
                         const Membership& membership) {
  std::vector<std::shared_ptr<PaceWatcher>> wake;
  std::string chosen;  // What the lead tuner chose, to log.
  {
    absl::MutexLock lock(&pace_mu_);
    if (version < pace_version_) return;
    if (version > pace_version_) {
      // A new step: the one before took from its first push here to now.
      const absl::Time now = clock_();
      if (pace_tuner_.has_value() && pace_version_ >= 0 && version == pace_version_ + 1) {
        const int before = pace_tuner_->chosen();
        const bool first = pace_tuner_->trial_summary().empty();  // No trial has ended.
        if (pace_tuner_->StepTook(pace_version_, now - pace_version_started_)) {
          if (first || pace_tuner_->chosen() != before) {
            chosen = absl::StrCat("job ", job_id_, ": push pacing lead ", pace_tuner_->chosen(),
                                  " from version ", version, " (median step time with ",
                                  pace_tuner_->trial_summary(), ")");
          }
        }
      }
      pace_version_ = version;
      pace_version_started_ = now;
      pace_frames_.clear();
      pace_min_ = 0;
    }
    ++pace_frames_[worker_id];
    if (UpdatePaceMin(membership)) wake = LiveWatchers();
  }
  if (!chosen.empty() && log_) log_(chosen);
  for (const std::shared_ptr<PaceWatcher>& w : wake) w->AllowanceChanged();
}

bool JobState::UpdatePaceMin(const Membership& membership) {
  int64_t slowest = INT64_MAX;
  for (const std::string& m : membership.members) {
    auto it = pace_frames_.find(m);
    slowest = std::min<int64_t>(slowest, it == pace_frames_.end() ? 0 : it->second);
  }
  if (slowest == INT64_MAX || slowest <= pace_min_) return false;
  pace_min_ = slowest;
  return true;
}

std::vector<std::shared_ptr<PaceWatcher>> JobState::LiveWatchers() {
  std::vector<std::shared_ptr<PaceWatcher>> live;
  std::erase_if(pace_watchers_, [&live](const std::weak_ptr<PaceWatcher>& w) {
    std::shared_ptr<PaceWatcher> locked = w.lock();
    if (locked == nullptr) return true;
    live.push_back(std::move(locked));
    return false;
  });
  return live;
}

int64_t JobState::MinClock() const {
  int64_t slowest = INT64_MAX;
  for (const std::string& w : membership_->members) {
    auto it = clocks_.find(w);
    slowest = std::min<int64_t>(slowest, it == clocks_.end() ? 0 : it->second);
  }
  return slowest;
}

absl::Status JobState::AwaitClock(const PullArgs& args, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  const int64_t needed = static_cast<int64_t>(args.worker_clock) - staleness_;
  auto released = [&]() {
    mu_.AssertReaderHeld();
    return membership_->dropped || !membership_->Has(args.worker_id) || MinClock() >= needed;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&released), deadline)) {
    return absl::DeadlineExceededError(
        absl::StrCat("ssp: worker ", args.worker_id, " at clock ", args.worker_clock,
                     " waited for the slowest member of job ", job_id_, " (clock ", MinClock(),
                     ") to reach ", needed, " until the deadline"));
  }
  if (membership_->dropped)
    return absl::AbortedError(absl::StrCat("job ", job_id_, " was dropped"));
  if (!membership_->Has(args.worker_id)) {
    return absl::AbortedError(
        absl::StrCat("worker ", args.worker_id, " was removed from job ", job_id_));
  }
  return absl::OkStatus();
}

absl::StatusOr<PulledChunk> JobState::Pull(const PullArgs& args, absl::Time deadline) {
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(args.chunk_id));
  const bool wants_state = args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE;
  if (wants_state) {
    if (!averages_state(*chunk)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer state of ", Describe(*chunk),
          " is pulled only in average mode with average_optimizer_state and an optimizer "
          "that has state (read it with ReadChunks otherwise)"));
    }
    if (args.slot < 0 || args.slot >= static_cast<int>(slot_names_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer-state slot ", args.slot,
                                                     " is out of range for ", Describe(*chunk),
                                                     ": it has ", slot_names_.size()));
    }
  } else if (args.kind != v1::ChunkHeader::KIND_PARAMETERS &&
             args.kind != v1::ChunkHeader::KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull of ", Describe(*chunk), " asks for ", KindName(args.kind),
                     "; pulls take KIND_PARAMETERS or KIND_OPTIMIZER_STATE"));
  }
  if (args.min_version < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative min_version ", args.min_version));
  }
  // The caller is checked once, on entry: a member whose pull was admitted
  // keeps waiting across a generation change and fails only if it is removed
  // or the job is dropped.
  {
    absl::MutexLock lock(&mu_);
    PSTRAIN_RETURN_IF_ERROR(CheckCaller(*membership_, args.worker_id, args.generation));
  }
  if (mode_ == v1::CONSISTENCY_SSP) PSTRAIN_RETURN_IF_ERROR(AwaitClock(args, deadline));

  absl::MutexLock lock(&chunk->mu);
  auto ready = [&]() {
    chunk->mu.AssertReaderHeld();
    const Membership& m = *chunk->membership;
    return m.dropped || !m.Has(args.worker_id) || chunk->version >= args.min_version;
  };
  if (!chunk->mu.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(Describe(*chunk), " is at version ",
                                                    chunk->version, "; version ", args.min_version,
                                                    " was not reached before the deadline"));
  }
  if (chunk->membership->dropped) {
    return absl::AbortedError(absl::StrCat("job ", job_id_, " was dropped"));
  }
  if (!chunk->membership->Has(args.worker_id)) {
    return absl::AbortedError(
        absl::StrCat("worker ", args.worker_id, " was removed from job ", job_id_));
  }
  PulledChunk out;
  out.version = chunk->version;
  if (wants_state) {
    out.values = chunk->slots[args.slot];
  } else if (chunk->compress_pulls && !args.master) {
    out.values = chunk->published;
    out.values_epoch = values_epoch_;
    if (chunk->delta != nullptr && args.held_epoch == values_epoch_ && args.held_version >= 0 &&
        args.held_version + 1 == chunk->version) {
      out.delta = chunk->delta;
    }
  } else {
    out.values = chunk->values;
  }
  return out;
}

absl::StatusOr<Outcome> JobState::SetMembers(const std::vector<std::string>& members,
                                             int64_t generation, v1::SetMembersResponse* response) {
  for (const std::string& w : members) {
    if (w.empty()) return absl::InvalidArgumentError("SetMembers: empty worker id");
  }
  absl::MutexLock control(&control_mu_);
  auto next = std::make_shared<Membership>();
  next->members.insert(members.begin(), members.end());
  next->generation = generation;
  std::vector<std::string> removed;
  {
    absl::MutexLock lock(&mu_);
    if (membership_->dropped) return absl::NotFoundError(absl::StrCat("unknown job ", job_id_));
    if (generation < membership_->generation) {
      return absl::InvalidArgumentError(
          absl::StrCat("SetMembers: generation ", generation, " is older than job ", job_id_,
                       "'s current generation ", membership_->generation));
    }
    // A member that joins starts at the slowest clock of those that stay, so
    // that it does not hold the others back (it pulls current parameters).
    std::map<std::string, int64_t> clocks;
    int64_t slowest = INT64_MAX;
    for (const std::string& w : next->members) {
      if (auto it = clocks_.find(w); it != clocks_.end()) {
        clocks[w] = it->second;
        slowest = std::min(slowest, it->second);
      }
    }
    for (const std::string& w : next->members) {
      if (clocks.count(w) == 0) clocks[w] = slowest == INT64_MAX ? 0 : slowest;
    }
    clocks_ = std::move(clocks);
    for (const std::string& w : next->members) {
      auto it = membership_->joined.find(w);
      next->joined[w] =
          it != membership_->joined.end() && membership_->Has(w) ? it->second : generation;
    }
    for (const std::string& w : membership_->members) {
      if (!next->Has(w)) removed.push_back(w);
    }
    membership_ = next;
  }
  // Steps of each removed member held here: the lowest, over the trainable
  // chunks, of the highest clock accepted from it.
  std::vector<int64_t> removed_steps(removed.size(), INT64_MAX);
  bool any_trainable = false;
  // Every chunk adopts the new set and re-checks its barrier: a removed
  // member no longer holds a sync step back.
  Outcome outcome;
  absl::Status first_error = absl::OkStatus();
  for (const std::unique_ptr<Chunk>& chunk : chunks_) {
    absl::MutexLock lock(&chunk->mu);
    chunk->membership = next;
    if (chunk->trainable) {
      any_trainable = true;
      for (size_t i = 0; i < removed.size(); ++i) {
        auto it = chunk->member_clock.find(removed[i]);
        removed_steps[i] =
            std::min(removed_steps[i], it == chunk->member_clock.end() ? 0 : it->second);
      }
    }
    std::erase_if(chunk->applied, [&next](const auto& entry) { return !next->Has(entry.first); });
    std::erase_if(chunk->member_clock,
                  [&next](const auto& entry) { return !next->Has(entry.first); });
    if (barrier_mode() && BarrierReady(*chunk, nullptr)) {
      first_error.Update(CompleteBarrier(*chunk, nullptr, &outcome));
    }
  }
  // A removed member no longer holds pushes back either.
  std::vector<std::shared_ptr<PaceWatcher>> wake;
  {
    absl::MutexLock lock(&pace_mu_);
    if (UpdatePaceMin(*next)) wake = LiveWatchers();
  }
  for (const std::shared_ptr<PaceWatcher>& w : wake) w->AllowanceChanged();
  PSTRAIN_RETURN_IF_ERROR(first_error);
  if (response != nullptr && any_trainable) {
    for (size_t i = 0; i < removed.size(); ++i) {
      v1::MemberSteps* steps = response->add_removed();
      steps->set_worker_id(removed[i]);
      steps->set_steps(removed_steps[i]);
    }
  }
  return outcome;
}

void JobState::Drop() {
  absl::MutexLock control(&control_mu_);
  std::shared_ptr<const Membership> dropped;
  {
    absl::MutexLock lock(&mu_);
    auto copy = std::make_shared<Membership>(*membership_);
    copy->dropped = true;
    dropped = copy;
    membership_ = dropped;
  }
  for (const std::unique_ptr<Chunk>& chunk : chunks_) {
    absl::MutexLock lock(&chunk->mu);
    chunk->membership = dropped;
  }
}

absl::StatusOr<v1::ChunkValues> JobState::Snapshot(const Chunk& chunk) {
  v1::ChunkValues values;
  values.set_chunk_id(chunk.id);
  values.set_version(chunk.version);
  values.mutable_values()->Assign(chunk.values->begin(), chunk.values->end());
  if (!chunk.trainable) return values;
  if (mode_ == v1::CONSISTENCY_AVERAGE) {
    // Slots exist only where they are real (averaged, or given at
    // configuration): without average_optimizer_state every worker keeps
    // its own state and the server has none to save.
    for (size_t s = 0; s < chunk.slots.size(); ++s) {
      v1::OptimizerSlot* slot = values.add_slots();
      slot->set_name(slot_names_[s]);
      slot->mutable_values()->Assign(chunk.slots[s]->begin(), chunk.slots[s]->end());
    }
    return values;
  }
  for (size_t s = 0; s < chunk.optimizer_state.size(); ++s) {
    v1::OptimizerSlot* slot = values.add_slots();
    slot->set_name(slot_names_[s]);
    slot->mutable_values()->Resize(static_cast<int>(chunk.count), 0.f);
    PSTRAIN_RETURN_IF_ERROR(backend_->CopyDeviceToHost(slot->mutable_values()->mutable_data(),
                                                       chunk.optimizer_state[s]->data(),
                                                       chunk.count * sizeof(float)));
  }
  PSTRAIN_RETURN_IF_ERROR(backend_->Synchronize());
  return values;
}

absl::Status JobState::CaptureIfWanted(Chunk& chunk) {
  if (chunk.capture_version != chunk.version) return absl::OkStatus();
  PSTRAIN_ASSIGN_OR_RETURN(v1::ChunkValues values, Snapshot(chunk));
  chunk.captured = std::move(values);
  chunk.capture_version = -1;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::ChunkValues>> JobState::ReadChunks(
    const ParameterShard::ReadOptions& options, absl::Time deadline) {
  std::vector<v1::ChunkValues> out(chunks_.size());
  if (options.versions_only || options.at_version <= 0) {
    for (size_t i = 0; i < chunks_.size(); ++i) {
      Chunk& chunk = *chunks_[i];
      absl::MutexLock lock(&chunk.mu);
      if (options.versions_only) {
        out[i].set_chunk_id(chunk.id);
        out[i].set_version(chunk.version);
      } else {
        PSTRAIN_ASSIGN_OR_RETURN(out[i], Snapshot(chunk));
      }
    }
    return out;
  }
  if (!barrier_mode()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id_, " runs in ", ModeName(mode_),
                     " mode: its chunks have no common version to cut at (read them as they are)"));
  }
  const int64_t version = options.at_version;
  auto past = [&](const Chunk& chunk) {
    chunk.mu.AssertReaderHeld();
    return absl::FailedPreconditionError(absl::StrCat(Describe(chunk), " is at version ",
                                                      chunk.version, ", past the cut at ", version,
                                                      "; cut at a later version"));
  };
  // Phase 1: every chunk at the version is taken now; the others are asked
  // to capture themselves when an update brings them there.
  std::vector<size_t> waiting;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    Chunk& chunk = *chunks_[i];
    absl::MutexLock lock(&chunk.mu);
    chunk.captured.reset();
    chunk.capture_version = -1;
    if (chunk.version > version) return past(chunk);
    if (chunk.version == version) {
      PSTRAIN_ASSIGN_OR_RETURN(out[i], Snapshot(chunk));
    } else {
      chunk.capture_version = version;
      waiting.push_back(i);
    }
  }
  // Phase 2: wait for the captures.
  for (size_t i : waiting) {
    Chunk& chunk = *chunks_[i];
    absl::MutexLock lock(&chunk.mu);
    auto done = [&chunk]() ABSL_SHARED_LOCKS_REQUIRED(chunk.mu) {
      return chunk.captured.has_value() || chunk.version > chunk.capture_version ||
             chunk.capture_version < 0 || chunk.membership->dropped;
    };
    if (!chunk.mu.AwaitWithDeadline(absl::Condition(&done), deadline)) {
      chunk.capture_version = -1;
      return absl::DeadlineExceededError(absl::StrCat(Describe(chunk), " is at version ",
                                                      chunk.version, "; the cut at version ",
                                                      version, " was not reached in time"));
    }
    if (chunk.membership->dropped)
      return absl::NotFoundError(absl::StrCat("unknown job ", job_id_));
    if (!chunk.captured.has_value()) return past(chunk);  // Another cut replaced this one.
    out[i] = *std::move(chunk.captured);
    chunk.captured.reset();
  }
  return out;
}

}  // namespace

struct ParameterShard::Job : JobState {};

ParameterShard::ParameterShard(Options options) : options_(std::move(options)) {
  stats_.staleness_counts.assign(std::max(options_.staleness_buckets, 1), 0);
  stats_.barrier_wait_counts.assign(std::size(kBarrierWaitBounds) + 1, 0);
}

void ParameterShard::RecordBarrierWaits(absl::Span<const absl::Duration> waits) {
  for (const absl::Duration wait : waits) {
    const double seconds = absl::ToDoubleSeconds(wait);
    const auto* bound =
        std::lower_bound(std::begin(kBarrierWaitBounds), std::end(kBarrierWaitBounds), seconds);
    ++stats_.barrier_wait_counts[bound - std::begin(kBarrierWaitBounds)];
    stats_.barrier_wait_seconds += seconds;
  }
}

ParameterShard::~ParameterShard() = default;

absl::Status ParameterShard::ConfigureJob(const ShardJobConfig& config,
                                          const std::vector<v1::ChunkValues>& chunks) {
  auto job = std::make_shared<Job>();
  PSTRAIN_RETURN_IF_ERROR(CheckId("job id", config.job_id));
  for (const std::string& id : config.members) PSTRAIN_RETURN_IF_ERROR(CheckId("worker id", id));
  PSTRAIN_RETURN_IF_ERROR(job->Init(config, chunks, options_));
  std::shared_ptr<Job> replaced;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Job>& slot = jobs_[config.job_id];
    replaced = std::move(slot);
    slot = std::move(job);
  }
  if (replaced != nullptr) replaced->Drop();  // Its blocked pulls fail with ABORTED.
  return absl::OkStatus();
}

absl::Status ParameterShard::CheckId(const char* what, const std::string& id) const {
  return CheckIdLength(what, id, options_.max_id_bytes);
}

absl::Status ParameterShard::SetMembers(const std::string& job_id,
                                        const std::vector<std::string>& members, int64_t generation,
                                        v1::SetMembersResponse* response) {
  for (const std::string& id : members) PSTRAIN_RETURN_IF_ERROR(CheckId("worker id", id));
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  PSTRAIN_ASSIGN_OR_RETURN(Outcome outcome, job->SetMembers(members, generation, response));
  absl::MutexLock lock(&mu_);
  stats_.applied_updates += outcome.applied_updates;
  RecordBarrierWaits(outcome.barrier_waits);
  return absl::OkStatus();
}

absl::Status ParameterShard::DropJob(const std::string& job_id) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("unknown job ", job_id));
    job = std::move(it->second);
    jobs_.erase(it);
    stats_.model_version_by_job.erase(job_id);
  }
  job->Drop();
  return absl::OkStatus();
}

std::vector<std::string> ParameterShard::JobIds() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  ids.reserve(jobs_.size());
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

absl::StatusOr<int64_t> ParameterShard::Push(const PushArgs& args, absl::Span<const float> values) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(args.job_id);
    if (it == jobs_.end()) {
      ++stats_.rejected_pushes;
      return absl::NotFoundError(absl::StrCat("unknown job ", args.job_id));
    }
    job = it->second;
  }
  Outcome outcome;
  absl::StatusOr<int64_t> version = job->Push(args, values, options_, &outcome);
  absl::MutexLock lock(&mu_);
  stats_.applied_updates += outcome.applied_updates;
  RecordBarrierWaits(outcome.barrier_waits);
  if (!version.ok()) {
    ++stats_.rejected_pushes;
    return version;
  }
  if (outcome.duplicate) ++stats_.duplicate_pushes;
  ++stats_.pushes;
  const int64_t represented = static_cast<int64_t>(values.size() * sizeof(float));
  stats_.push_bytes += args.payload_bytes >= 0 ? args.payload_bytes : represented;
  stats_.push_represented_bytes += represented;
  if (jobs_.count(args.job_id) != 0) {
    int64_t& model_version = stats_.model_version_by_job[args.job_id];
    model_version = std::max(model_version, *version);
  }
  if (outcome.staleness >= 0) {
    const int64_t last = static_cast<int64_t>(stats_.staleness_counts.size()) - 1;
    ++stats_.staleness_counts[std::min(outcome.staleness, last)];
  }
  return version;
}

absl::StatusOr<PulledChunk> ParameterShard::Pull(const PullArgs& args, absl::Time deadline) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(args.job_id));
  PSTRAIN_ASSIGN_OR_RETURN(PulledChunk pulled, job->Pull(args, deadline));
  absl::MutexLock lock(&mu_);
  ++stats_.pulls;
  const int64_t represented = static_cast<int64_t>(pulled.values->size() * sizeof(float));
  stats_.pull_bytes +=
      pulled.delta != nullptr ? static_cast<int64_t>(pulled.delta->bytes.size()) : represented;
  stats_.pull_represented_bytes += represented;
  if (jobs_.count(args.job_id) != 0) {
    int64_t& model_version = stats_.model_version_by_job[args.job_id];
    model_version = std::max(model_version, pulled.version);
  }
  return pulled;
}

absl::StatusOr<std::vector<v1::ChunkValues>> ParameterShard::ReadChunks(const std::string& job_id,
                                                                        ReadOptions options,
                                                                        absl::Time deadline) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  return job->ReadChunks(options, deadline);
}

absl::StatusOr<std::shared_ptr<ParameterShard::Job>> ParameterShard::FindJob(
    const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("unknown job ", job_id));
  return it->second;
}

absl::StatusOr<bool> ParameterShard::WatchPace(const std::string& job_id,
                                               std::weak_ptr<PaceWatcher> watcher) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  return job->WatchPace(std::move(watcher));
}

absl::StatusOr<int64_t> ParameterShard::PaceSlack(const std::string& job_id,
                                                  const std::string& worker_id,
                                                  int64_t version) const {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  return job->PaceSlack(worker_id, version);
}

absl::StatusOr<ChunkPlan> ParameterShard::Plan(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("unknown job ", job_id));
  return it->second->plan();
}

ShardStats ParameterShard::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace pstrain
