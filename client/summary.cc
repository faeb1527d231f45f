#include "client/summary.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/model_graph.h"
#include "common/status_macros.h"

namespace pstrain {

absl::StatusOr<std::string> SummarizeJobFile(const std::string& path) {
  v1::ModelSpec model;
  PSTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  // A job has "model"/"model_file"; a bare model spec has "layers".
  if (absl::StrContains(text, "\"model\"") || absl::StrContains(text, "\"model_file\"") ||
      absl::StrContains(text, "\"modelFile\"")) {
    PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobSpec(path));
    model = job.model();
  } else {
    PSTRAIN_ASSIGN_OR_RETURN(model, LoadModelSpec(path));
  }
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(model);
  if (!graph.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": model: ", graph.status().message()));
  }
  return FormatModelSummary(*graph);
}

}  // namespace pstrain
