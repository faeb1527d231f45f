// The state epoch: a random id of one server state directory, made the first
// time server 0 starts on it and kept there. Worker credentials carry it
// (Authorizer::SetStateEpoch), so that a credential issued against one state
// directory is refused by a server started on another one, even with the
// same tokens: worker ids start again at worker-1 in a new state, and a
// stale process must not act as the new worker-1.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::string epoch, LoadOrCreateStateEpoch(state_dir));
//   authorizer->SetStateEpoch(epoch);
//
// Threads: call from one thread at start-up (it writes a file).
#ifndef PSTRAIN_SERVER_STATE_EPOCH_H_
#define PSTRAIN_SERVER_STATE_EPOCH_H_

#include <string>

#include "absl/status/statusor.h"

namespace pstrain {

// The epoch in `state_dir`/state_epoch (32 lowercase hex digits), creating
// the file atomically with a fresh random epoch when it is missing. The
// directory must exist. DATA_LOSS for a file that does not hold 32 hex
// digits (it names the file); file-system errors name the path.
absl::StatusOr<std::string> LoadOrCreateStateEpoch(const std::string& state_dir);

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_STATE_EPOCH_H_
