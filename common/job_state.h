// The words for a job's state (v1::JobState), one home for the server and
// the client: its short name and whether it can still change.
//
//   JobStateName(v1::JOB_STATE_RUNNING);  // "RUNNING"
//   IsTerminal(v1::JOB_STATE_CANCELLED);  // true: the job never changes again
//
// Pure functions; any thread.
#ifndef PSTRAIN_COMMON_JOB_STATE_H_
#define PSTRAIN_COMMON_JOB_STATE_H_

#include <string>

#include "pstrain/v1/service.pb.h"

namespace pstrain {

// "SUCCEEDED", "RUNNING", ... (the enum name without its "JOB_STATE_"
// prefix); "UNKNOWN" for a value the enum does not define.
std::string JobStateName(v1::JobState state);

// SUCCEEDED, FAILED and CANCELLED: the job is over and its status final.
bool IsTerminal(v1::JobState state);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_JOB_STATE_H_
