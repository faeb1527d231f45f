// CheckpointWriter: a checkpoint of a running (or stopped) job, from the
// shards to disk. It reads the job's model from every shard, at one version
// where the mode has one, works out the data position the model was trained
// to, encodes it (server/job_run.h, EncodeCheckpoint) and hands it to the
// Checkpointer (server/checkpointer.h), which keeps the newest files.
//
//   CheckpointWriter writer({.state_dir = dir, .cut_wait = absl::Seconds(5)}, &shards,
//                           &checkpointer);
//   PSTRAIN_ASSIGN_OR_RETURN(ModelSnapshot model, writer.ReadModel(work));
//   PSTRAIN_RETURN_IF_ERROR(writer.Write(work, std::move(model)));
//
// Cuts: in sync and average mode an epoch or interval checkpoint is a
// consistent cut, every chunk at the highest version any chunk had when it
// was due (the others are waited for, up to cut_wait; then the shards'
// DEADLINE_EXCEEDED, and the caller tries again later); in sync mode that
// version is the global step, and the data position follows from it
// (CheckpointPosition). A final or stop checkpoint, and async and ssp, read
// every chunk as it is, each with its version.
//
// Threads: thread-compatible. It talks to shards, so the Coordinator calls
// it from Tick only (Coordinator::tick_mu_).
#ifndef PSTRAIN_SERVER_CHECKPOINT_WRITER_H_
#define PSTRAIN_SERVER_CHECKPOINT_WRITER_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model_graph.h"
#include "pstrain/v1/job.pb.h"
#include "server/checkpointer.h"
#include "server/job_run.h"
#include "server/shard_controller.h"

namespace pstrain {

// A checkpoint Tick decided on under the coordinator's lock, written without it.
struct CheckpointWork {
  enum Kind {
    kEpoch,     // The slowest member completed an epoch.
    kInterval,  // Options::checkpoint_interval passed.
    kFinal,     // Every member finished: the model the job ends with.
    kStop,      // Cancelled: the last model is kept.
  };
  Kind kind = kEpoch;
  std::string job_id;
  v1::JobSpec spec;
  ModelGraph graph;
  DataPosition position;        // The job's, as its members reported it.
  int64_t steps_per_epoch = 0;  // As the members report it; 0 = unknown.
  // sync: the data position of every version up to the newest (the run's
  // planner knows where its epochs' tails shift versions); empty = unknown.
  std::function<std::pair<int, int64_t>(int64_t)> position_of_version;
};

// Whether `work` reads a consistent cut (epoch and interval checkpoints in
// sync and average mode).
bool IsCut(const CheckpointWork& work);

// The data position a checkpoint records: `work.position`, except for a
// sync cut, where the cut's version is the global step: the epoch and the
// steps into its share that version stands for (tails, a lost worker's
// samples, add versions inside an epoch).
DataPosition CheckpointPosition(const CheckpointWork& work, int64_t cut_version);

class CheckpointWriter {
 public:
  struct Options {
    std::string state_dir;  // Empty: the model is read, nothing is written.
    absl::Duration cut_wait = absl::Seconds(5);
    std::function<absl::Time()> clock = [] { return absl::Now(); };
    std::function<void(const std::string&)> log;  // "job-1: checkpoint written (...)"
  };

  // `shards` and `checkpointer` must outlive the writer.
  CheckpointWriter(Options options, ShardController* shards, const Checkpointer* checkpointer);

  // The job's model from every shard (a cut when IsCut). The shards' errors:
  // UNAVAILABLE or NOT_FOUND for a shard down or restarted empty,
  // DEADLINE_EXCEEDED for a cut not reached within cut_wait.
  absl::StatusOr<ModelSnapshot> ReadModel(const CheckpointWork& work) const;
  // Writes `model` (from ReadModel(work)) as the job's newest checkpoint and
  // logs it; OK at once without a state directory. The Checkpointer's error.
  absl::Status Write(const CheckpointWork& work, ModelSnapshot model) const;

 private:
  const Options options_;
  ShardController* const shards_;
  const Checkpointer* const checkpointer_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_CHECKPOINT_WRITER_H_
