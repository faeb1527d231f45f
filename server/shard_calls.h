// The arguments and results of one push or pull of one chunk, as
// ParameterShard (server/parameter_shard.h) takes them and the aggregation
// policies (server/aggregation/) see them: what ps_service decodes from a
// frame, with no model in sight.
#ifndef PSTRAIN_SERVER_SHARD_CALLS_H_
#define PSTRAIN_SERVER_SHARD_CALLS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/rpc/gradient_codec.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

struct PushArgs {
  std::string job_id;
  std::string worker_id;
  int64_t generation = 0;
  int chunk_id = 0;
  int64_t version = 0;
  v1::ChunkHeader::Kind kind = v1::ChunkHeader::KIND_GRADIENT;
  int slot = 0;          // KIND_OPTIMIZER_STATE: index into the chunk's slots.
  int worker_clock = 0;  // Steps this worker has completed (ssp).
  // The update id (ChunkHeader.incarnation, update_seq); incarnation 0: none.
  uint64_t incarnation = 0;
  int64_t update_seq = 0;
  // Bytes of the payload as it travelled (compressed gradients: less than
  // the F32 values it represents); -1: the values' F32 size.
  int64_t payload_bytes = -1;
};

struct PullArgs {
  std::string job_id;
  std::string worker_id;
  int64_t generation = 0;
  int chunk_id = 0;
  int64_t min_version = 0;
  v1::ChunkHeader::Kind kind = v1::ChunkHeader::KIND_PARAMETERS;
  int slot = 0;
  int worker_clock = 0;  // ssp: the requester's clock c.
  // Pull compression: the version of the published values the requester
  // holds (-1: none), from the job's values epoch `held_epoch`.
  int64_t held_version = -1;
  uint64_t held_epoch = 0;
  bool master = false;  // The master values whole, even with pull compression.
};

struct PulledChunk {
  int64_t version = 0;
  // Immutable snapshot; safe to send after the call returns. With pull
  // compression: the published values (what workers hold), not the master.
  std::shared_ptr<const std::vector<float>> values;
  // Pull compression: the encoded change from version - 1 to `version` of
  // the published values, when the requester holds version - 1 of this
  // epoch; else null (send `values`). Immutable.
  std::shared_ptr<const EncodedGradient> delta;
  uint64_t values_epoch = 0;  // 0: the chunk's pulls are not compressed.
};

// Told that a sync job's push pacing allowance may have grown
// (ParameterShard::WatchPace). Called with no shard lock held, on the thread
// of the push or membership change that moved the slowest member on.
class PaceWatcher {
 public:
  virtual ~PaceWatcher() = default;
  virtual void AllowanceChanged() = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_SHARD_CALLS_H_
