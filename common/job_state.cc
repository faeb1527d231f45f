#include "common/job_state.h"

#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace pstrain {

std::string JobStateName(v1::JobState state) {
  absl::string_view name = v1::JobState_Name(state);
  absl::ConsumePrefix(&name, "JOB_STATE_");
  return name.empty() ? "UNKNOWN" : std::string(name);
}

bool IsTerminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

}  // namespace pstrain
