// ServerOptimizer: the optimizer that sync, async and ssp modes run on the
// server: the engine's Optimizer (kernels/optimizer.h) on a one-thread CPU
// backend (the server shares the cores with workers), one parameter per
// trainable chunk.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<ServerOptimizer> opt,
//                            ServerOptimizer::Create(spec, "ConfigureJob(j): "));
//   opt->AddChunk(chunk, initial);         // Configuration, chunk by chunk.
//   opt->Apply(chunk, gradient);           // Under chunk.mu.
//
// Threads: Create and AddChunk come first, from one thread. Then Apply and
// ReadSlots may run on any threads at once for different chunks: a chunk's
// optimizer state is its own (ShardChunk::optimizer_state, touched only
// under its mu), and the one-thread CPU backend's update ops and host copies
// keep no state of their own (kernels/cpu/cpu_backend.h). No lock of its
// own, so no lock serialises a job's updates.
#ifndef PSTRAIN_SERVER_AGGREGATION_SERVER_OPTIMIZER_H_
#define PSTRAIN_SERVER_AGGREGATION_SERVER_OPTIMIZER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/service.pb.h"
#include "server/shard_chunk.h"

namespace pstrain {

class ServerOptimizer {
 public:
  // `where` prefixes configuration errors ("ConfigureJob(j): ").
  static absl::StatusOr<std::unique_ptr<ServerOptimizer>> Create(const v1::OptimizerSpec& spec,
                                                                 std::string where);

  // Adds a trainable chunk as a parameter (ShardChunk::optimizer_index and
  // optimizer_state), its state from `initial`'s slots when it has any.
  absl::Status AddChunk(ShardChunk& chunk, const v1::ChunkValues& initial)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  // Waits for the copies of AddChunk.
  absl::Status Synchronize() { return backend_->Synchronize(); }

  // One optimizer step of the chunk's values with `gradient` (chunk.count
  // floats) at step chunk.version; copy-on-write (Writable).
  absl::Status Apply(ShardChunk& chunk, const float* gradient)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);
  // Appends the chunk's state slots, named.
  absl::Status ReadSlots(const ShardChunk& chunk, v1::ChunkValues* out)
      ABSL_SHARED_LOCKS_REQUIRED(chunk.mu);

 private:
  ServerOptimizer(std::vector<std::string> slot_names, std::string where)
      : slot_names_(std::move(slot_names)), where_(std::move(where)) {}

  // Constant after Create.
  const std::vector<std::string> slot_names_;
  const std::string where_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Optimizer> optimizer_;  // Declared after backend_: destroyed first.
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_AGGREGATION_SERVER_OPTIMIZER_H_
