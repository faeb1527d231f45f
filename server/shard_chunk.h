// The store's unit: one chunk of one job held by a ParameterShard, with its
// version, its published values and the records every consistency mode
// keeps about it. ShardJob (server/shard_job.cc) owns a job's chunks;
// the aggregation policies (server/aggregation/) read and advance them.
//
//   ShardChunk& chunk = ...;              // Found by the store.
//   absl::MutexLock lock(&chunk.mu);
//   policy.Push(chunk, args, values, &outcome);  // May advance chunk.version.
//
// Copy-on-write snapshots: published values are
// std::shared_ptr<std::vector<float>> handed out as shared_ptr<const ...>. An
// update writes in place (Writable) when the chunk holds the only reference
// (no pull is still sending the old bytes), else it copies the snapshot
// first; readers never see a buffer change.
//
// Threads: every field below `mu` is guarded by it; the fields above it are
// constant once the store has configured the chunk (ParameterShard's
// ConfigureJob), before any push or pull can find it.
#ifndef PSTRAIN_SERVER_SHARD_CHUNK_H_
#define PSTRAIN_SERVER_SHARD_CHUNK_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/rpc/gradient_codec.h"
#include "kernels/backend.h"
#include "pstrain/v1/service.pb.h"
#include "server/shard_calls.h"

namespace pstrain {

// "KIND_GRADIENT", or "kind 42" for a kind the proto does not name.
std::string KindName(v1::ChunkHeader::Kind kind);

// Who takes part in a job. Immutable once published; replaced whole.
struct ShardMembership {
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
struct BarrierSum {
  std::vector<float> sum;
  std::set<std::string> contributors;

  void Add(const std::string& worker_id, absl::Span<const float> values);
};

// Counters one call contributes to ShardStats.
struct PushOutcome {
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
size_t TargetIndex(const PushArgs& args);

struct ShardChunk {
  // Constant after configuration.
  int id = 0;
  int64_t count = 0;
  bool trainable = true;
  std::string param_name;
  // The server's optimizer (sync, async and ssp trainable chunks; see
  // server/aggregation/server_optimizer.h): the chunk's parameter index and
  // its state slots there, touched only under `mu`.
  int optimizer_index = -1;
  std::vector<Tensor*> optimizer_state;
  // Pull compression (sync mode, trainable chunks not sent whole).
  bool compress_pulls = false;

  absl::Mutex mu;
  std::shared_ptr<const ShardMembership> membership ABSL_GUARDED_BY(mu);
  int64_t version ABSL_GUARDED_BY(mu) = 0;
  std::shared_ptr<std::vector<float>> values ABSL_GUARDED_BY(mu);
  // Average mode: the published optimizer slots (empty in other modes, where
  // the optimizer owns them).
  std::vector<std::shared_ptr<std::vector<float>>> slots ABSL_GUARDED_BY(mu);
  // Barriers (sync and average modes).
  BarrierSum values_barrier ABSL_GUARDED_BY(mu);
  std::vector<BarrierSum> slot_barriers ABSL_GUARDED_BY(mu);
  // When the open barrier's first push arrived (InfiniteFuture: none yet).
  absl::Time barrier_opened ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
  // Exactly-once records, one per member that pushed with an update id.
  std::map<std::string, AppliedUpdates> applied ABSL_GUARDED_BY(mu);
  // Trainable chunks: the highest worker_clock accepted from each member
  // for the chunk's values (its steps here; SetMembers reports a removed
  // member's).
  std::map<std::string, int64_t> member_clock ABSL_GUARDED_BY(mu);
  // Pull compression: `published` holds what the workers hold, `delta` the
  // encoded change of it from version - 1 to version (null when this version
  // was not reached by a step here, or could not be encoded).
  std::shared_ptr<std::vector<float>> published ABSL_GUARDED_BY(mu);
  std::shared_ptr<const EncodedGradient> delta ABSL_GUARDED_BY(mu);
  // A consistent cut (ReadChunks at a version): the version wanted, and the
  // chunk as it was when it reached it (filled by the update that does).
  int64_t capture_version ABSL_GUARDED_BY(mu) = -1;
  std::optional<v1::ChunkValues> captured ABSL_GUARDED_BY(mu);

  // "chunk 3 (fc/weight) of job j", for error messages.
  std::string Describe(const std::string& job_id) const;
  // True when `args` (with an update id) was applied already.
  bool AlreadyApplied(const PushArgs& args) const ABSL_SHARED_LOCKS_REQUIRED(mu);
  void RecordApplied(const PushArgs& args) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

// Makes `*snapshot` writable: in place when nobody else holds it, else a copy
// replaces it.
std::vector<float>* Writable(std::shared_ptr<std::vector<float>>* snapshot);

// Publishes `fresh` as the new snapshot and hands the old buffer back for
// reuse when nobody else holds it.
void Publish(std::shared_ptr<std::vector<float>>* snapshot, std::vector<float>* fresh);

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_SHARD_CHUNK_H_
