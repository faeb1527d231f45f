// ShardJob: see shard_job.h for the contract and the lock order.
#include "server/shard_job.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/status_macros.h"
#include "kernels/optimizer.h"

namespace pstrain {
namespace {

using Kind = v1::ChunkHeader::Kind;

}  // namespace

absl::Status ShardJob::Init(const ShardJobConfig& config,
                            const std::vector<v1::ChunkValues>& initial,
                            const ParameterShard::Options& options) {
  const int shard_index = options.shard_index;
  if (config.job_id.empty()) return absl::InvalidArgumentError("ConfigureJob: empty job_id");
  job_id_ = config.job_id;
  const std::string where = absl::StrCat("ConfigureJob(", job_id_, "): ");
  PSTRAIN_ASSIGN_OR_RETURN(ModelGraph graph,
                           PlanJob(config, options.job_limits, shard_index, where));
  slot_names_ = OptimizerSlotNames(config.spec.optimizer());
  PSTRAIN_RETURN_IF_ERROR(CheckInitialValues(graph, initial, shard_index, where));
  PSTRAIN_ASSIGN_OR_RETURN(policy_, CreateAggregationPolicy(PolicyConfig(config, options, plan_)));

  auto membership = std::make_shared<ShardMembership>();
  membership->members.insert(config.members.begin(), config.members.end());
  membership->generation = config.generation;
  for (const std::string& w : config.members) membership->joined[w] = config.generation;
  PSTRAIN_RETURN_IF_ERROR(AddChunks(graph, initial, shard_index, membership));
  PSTRAIN_RETURN_IF_ERROR(policy_->FinishConfiguration());

  policy_->AdoptMembership(membership);
  absl::MutexLock lock(&mu_);
  membership_ = std::move(membership);
  return absl::OkStatus();
}

absl::StatusOr<ModelGraph> ShardJob::PlanJob(const ShardJobConfig& config, const JobLimits& limits,
                                             int shard_index, const std::string& where) {
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
  absl::StatusOr<ModelGraph> graph = BuildJobGraph(config.spec);
  if (!graph.ok()) return absl::InvalidArgumentError(absl::StrCat(where, graph.status().message()));
  if (absl::Status s = CheckJobLimits(config.spec, *graph, limits); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, s.message()));
  }
  absl::StatusOr<ChunkPlan> plan = PlanChunks(*graph, config.num_shards, config.chunk_bytes);
  if (!plan.ok()) return absl::InvalidArgumentError(absl::StrCat(where, plan.status().message()));
  plan_ = *std::move(plan);
  return graph;
}

absl::Status ShardJob::CheckInitialValues(const ModelGraph& graph,
                                          const std::vector<v1::ChunkValues>& initial,
                                          int shard_index, const std::string& where) const {
  const std::vector<int>& owned = plan_.by_shard[shard_index];
  if (initial.size() != owned.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, "shard ", shard_index, " owns ",
                                                   owned.size(), " chunks, got initial values for ",
                                                   initial.size()));
  }
  for (size_t i = 0; i < owned.size(); ++i) {
    const ChunkInfo& info = plan_.chunks[owned[i]];
    const v1::ChunkValues& given = initial[i];
    const bool trainable = graph.params[info.param].trainable;
    const std::string chunk =
        absl::StrCat("chunk ", info.id, " (", graph.params[info.param].name, ")");
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
  return absl::OkStatus();
}

AggregationConfig ShardJob::PolicyConfig(const ShardJobConfig& config,
                                         const ParameterShard::Options& options,
                                         const ChunkPlan& plan) {
  AggregationConfig policy;
  policy.job_id = config.job_id;
  policy.mode = ConsistencyModeOf(config.spec);
  policy.optimizer = config.spec.optimizer();
  policy.staleness = config.spec.staleness();
  policy.average_optimizer_state = config.spec.average_optimizer_state();
  policy.max_version_lead = options.max_version_lead;
  policy.pull_compression = config.spec.pull_compression();
  policy.chunks_sent_whole = ChunksSentWhole(policy.pull_compression, plan);
  policy.pace_lead_frames = options.pace_lead_frames;
  policy.pace_tuner = options.pace_tuner;
  policy.log = options.log;
  policy.clock = options.clock;
  return policy;
}

absl::Status ShardJob::AddChunks(const ModelGraph& graph,
                                 const std::vector<v1::ChunkValues>& initial, int shard_index,
                                 std::shared_ptr<const ShardMembership> membership) {
  const std::vector<int>& owned = plan_.by_shard[shard_index];
  local_index_.assign(plan_.chunks.size(), -1);
  for (size_t i = 0; i < owned.size(); ++i) {
    const ChunkInfo& info = plan_.chunks[owned[i]];
    const v1::ChunkValues& given = initial[i];
    auto chunk = std::make_unique<ShardChunk>();
    chunk->id = info.id;
    chunk->count = info.count;
    chunk->trainable = graph.params[info.param].trainable;
    chunk->param_name = graph.params[info.param].name;
    absl::MutexLock lock(&chunk->mu);
    chunk->membership = membership;
    chunk->version = given.version();
    chunk->values =
        std::make_shared<std::vector<float>>(given.values().begin(), given.values().end());
    PSTRAIN_RETURN_IF_ERROR(policy_->AddChunk(*chunk, given));
    local_index_[info.id] = static_cast<int>(chunks_.size());
    chunks_.push_back(std::move(chunk));
  }
  return absl::OkStatus();
}

absl::StatusOr<ShardChunk*> ShardJob::FindChunk(int chunk_id) const {
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

absl::Status ShardJob::CheckPushKind(const ShardChunk& chunk, const PushArgs& args) const {
  const Kind expected = policy_->PushKind(chunk);
  if (args.kind == expected) return absl::OkStatus();
  const bool exchanges_state = policy_->ExchangesState(chunk);
  if (args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE && exchanges_state) {
    if (args.slot < 0 || args.slot >= static_cast<int>(slot_names_.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer-state slot ", args.slot, " is out of range for ", Describe(chunk), ": it has ",
          slot_names_.size(), " (", absl::StrJoin(slot_names_, ", "), ")"));
    }
    return absl::OkStatus();
  }
  std::string allowed = KindName(expected);
  if (exchanges_state) absl::StrAppend(&allowed, " or KIND_OPTIMIZER_STATE");
  return absl::InvalidArgumentError(absl::StrCat(Describe(chunk), " takes ", allowed, " pushes in ",
                                                 policy_->name(), " mode, got ",
                                                 KindName(args.kind)));
}

absl::Status ShardJob::CheckPushValues(const ShardChunk& chunk, const PushArgs& args,
                                       absl::Span<const float> values,
                                       bool reject_non_finite) const {
  if (static_cast<int64_t>(values.size()) != chunk.count) {
    return absl::InvalidArgumentError(
        absl::StrCat(Describe(chunk), " holds ", chunk.count, " values, got ", values.size()));
  }
  if (reject_non_finite) {
    if (const int64_t bad = FirstNonFiniteIndex(values.data(), static_cast<int64_t>(values.size()));
        bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("value ", bad, " of the push to ",
                                                     Describe(chunk), " is not finite (",
                                                     values[bad], ")"));
    }
  }
  if (args.version < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative version ", args.version));
  }
  if (args.incarnation != 0 && args.update_seq < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative update_seq ", args.update_seq));
  }
  return absl::OkStatus();
}

absl::Status ShardJob::CheckCaller(const ShardMembership& membership, const std::string& worker_id,
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

absl::StatusOr<int64_t> ShardJob::Push(const PushArgs& args, absl::Span<const float> values,
                                       bool reject_non_finite, PushOutcome* outcome) {
  // Stateless checks first, outside any lock.
  PSTRAIN_ASSIGN_OR_RETURN(ShardChunk * chunk, FindChunk(args.chunk_id));
  PSTRAIN_RETURN_IF_ERROR(CheckPushKind(*chunk, args));
  PSTRAIN_RETURN_IF_ERROR(CheckPushValues(*chunk, args, values, reject_non_finite));
  const bool has_update_id = args.incarnation != 0;
  int64_t version;
  std::shared_ptr<const ShardMembership> membership;
  {
    absl::MutexLock lock(&chunk->mu);
    PSTRAIN_RETURN_IF_ERROR(CheckCaller(*chunk->membership, args.worker_id, args.generation));
    if (has_update_id && chunk->AlreadyApplied(args)) {
      outcome->duplicate = true;
    } else {
      PSTRAIN_RETURN_IF_ERROR(policy_->Push(*chunk, args, values, outcome));
      PSTRAIN_RETURN_IF_ERROR(CaptureIfWanted(*chunk));
    }
    if (has_update_id) chunk->RecordApplied(args);
    if (chunk->trainable && TargetIndex(args) == 0) {
      int64_t& clock = chunk->member_clock[args.worker_id];
      clock = std::max<int64_t>(clock, args.worker_clock);
    }
    version = chunk->version;
    membership = chunk->membership;
  }
  policy_->Pushed(args, *membership, outcome->duplicate);
  return version;
}

absl::Status ShardJob::CheckPullKind(const ShardChunk& chunk, const PullArgs& args) const {
  if (args.kind == v1::ChunkHeader::KIND_OPTIMIZER_STATE) {
    if (!policy_->ExchangesState(chunk)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer state of ", Describe(chunk),
          " is pulled only in average mode with average_optimizer_state and an optimizer "
          "that has state (read it with ReadChunks otherwise)"));
    }
    if (args.slot < 0 || args.slot >= static_cast<int>(slot_names_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("optimizer-state slot ", args.slot,
                                                     " is out of range for ", Describe(chunk),
                                                     ": it has ", slot_names_.size()));
    }
  } else if (args.kind != v1::ChunkHeader::KIND_PARAMETERS &&
             args.kind != v1::ChunkHeader::KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat("pull of ", Describe(chunk), " asks for ", KindName(args.kind),
                     "; pulls take KIND_PARAMETERS or KIND_OPTIMIZER_STATE"));
  }
  if (args.min_version < 0) {
    return absl::InvalidArgumentError(absl::StrCat("negative min_version ", args.min_version));
  }
  return absl::OkStatus();
}

absl::StatusOr<PulledChunk> ShardJob::Pull(const PullArgs& args, absl::Time deadline) {
  PSTRAIN_ASSIGN_OR_RETURN(ShardChunk * chunk, FindChunk(args.chunk_id));
  PSTRAIN_RETURN_IF_ERROR(CheckPullKind(*chunk, args));
  // The caller is checked once, on entry: a member whose pull was admitted
  // keeps waiting across a generation change and fails only if it is removed
  // or the job is dropped.
  {
    absl::MutexLock lock(&mu_);
    PSTRAIN_RETURN_IF_ERROR(CheckCaller(*membership_, args.worker_id, args.generation));
  }
  const Waiting waiting(waiting_pulls_);
  PSTRAIN_RETURN_IF_ERROR(policy_->AwaitPull(args, deadline));

  absl::MutexLock lock(&chunk->mu);
  auto ready = [&]() {
    chunk->mu.AssertReaderHeld();
    const ShardMembership& m = *chunk->membership;
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
  return policy_->Pulled(*chunk, args);
}

absl::StatusOr<PushOutcome> ShardJob::SetMembers(const std::vector<std::string>& members,
                                                 int64_t generation,
                                                 v1::SetMembersResponse* response) {
  for (const std::string& w : members) {
    if (w.empty()) return absl::InvalidArgumentError("SetMembers: empty worker id");
  }
  absl::MutexLock control(&control_mu_);
  auto next = std::make_shared<ShardMembership>();
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
  policy_->AdoptMembership(next);
  // Steps of each removed member held here: the lowest, over the trainable
  // chunks, of the highest clock accepted from it.
  std::vector<int64_t> removed_steps(removed.size(), INT64_MAX);
  bool any_trainable = false;
  // Every chunk adopts the new set, and the policy completes what the
  // removed members held back (a pending sync step).
  PushOutcome outcome;
  absl::Status first_error = absl::OkStatus();
  for (const std::unique_ptr<ShardChunk>& chunk : chunks_) {
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
    absl::Status adopted = policy_->ChunkAdopted(*chunk, &outcome);
    if (adopted.ok()) adopted = CaptureIfWanted(*chunk);
    first_error.Update(adopted);
  }
  // A removed member no longer holds pushes back either.
  policy_->MembershipAdopted(*next);
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

void ShardJob::Drop() {
  absl::MutexLock control(&control_mu_);
  std::shared_ptr<const ShardMembership> dropped;
  {
    absl::MutexLock lock(&mu_);
    auto copy = std::make_shared<ShardMembership>(*membership_);
    copy->dropped = true;
    dropped = copy;
    membership_ = dropped;
  }
  policy_->AdoptMembership(dropped);
  for (const std::unique_ptr<ShardChunk>& chunk : chunks_) {
    absl::MutexLock lock(&chunk->mu);
    chunk->membership = dropped;
  }
}

absl::StatusOr<v1::ChunkValues> ShardJob::Snapshot(const ShardChunk& chunk) {
  v1::ChunkValues values;
  values.set_chunk_id(chunk.id);
  values.set_version(chunk.version);
  values.mutable_values()->Assign(chunk.values->begin(), chunk.values->end());
  if (!chunk.trainable) return values;
  PSTRAIN_RETURN_IF_ERROR(policy_->ReadSlots(chunk, &values));
  return values;
}

absl::Status ShardJob::CaptureIfWanted(ShardChunk& chunk) {
  if (chunk.capture_version != chunk.version) return absl::OkStatus();
  PSTRAIN_ASSIGN_OR_RETURN(v1::ChunkValues values, Snapshot(chunk));
  chunk.captured = std::move(values);
  chunk.capture_version = -1;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::ChunkValues>> ShardJob::ReadChunks(
    const ParameterShard::ReadOptions& options, absl::Time deadline) {
  if (options.versions_only || options.at_version <= 0) {
    std::vector<v1::ChunkValues> out(chunks_.size());
    for (size_t i = 0; i < chunks_.size(); ++i) {
      ShardChunk& chunk = *chunks_[i];
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
  if (!policy_->HasCommonVersions()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id_, " runs in ", policy_->name(),
                     " mode: its chunks have no common version to cut at (read them as they are)"));
  }
  return ReadCut(options.at_version, deadline);
}

absl::StatusOr<std::vector<v1::ChunkValues>> ShardJob::ReadCut(int64_t version,
                                                               absl::Time deadline) {
  std::vector<v1::ChunkValues> out(chunks_.size());
  auto past = [&](const ShardChunk& chunk) {
    chunk.mu.AssertReaderHeld();
    return absl::FailedPreconditionError(absl::StrCat(Describe(chunk), " is at version ",
                                                      chunk.version, ", past the cut at ", version,
                                                      "; cut at a later version"));
  };
  // Phase 1: every chunk at the version is taken now; the others are asked
  // to capture themselves when an update brings them there.
  std::vector<size_t> waiting;
  for (size_t i = 0; i < chunks_.size(); ++i) {
    ShardChunk& chunk = *chunks_[i];
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
  // Phase 2: wait for the captures (counted while any is awaited).
  if (waiting.empty()) return out;
  const Waiting counted(waiting_cuts_);
  for (size_t i : waiting) {
    ShardChunk& chunk = *chunks_[i];
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

}  // namespace pstrain
