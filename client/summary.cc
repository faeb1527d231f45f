#include "client/summary.h"

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/model_graph.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace pstrain {

absl::StatusOr<std::string> SummarizeJobFile(const std::string& path) {
  v1::ModelSpec model;
  PSTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  // A bare model spec has "layers" at the top level; anything else is read
  // as a job (which names what is wrong with it). Only the top-level keys
  // count: a model named "model", or a job whose model has "layers", is
  // still what it is.
  google::protobuf::Struct top;
  const bool bare_model = google::protobuf::util::JsonStringToMessage(text, &top).ok() &&
                          top.fields().contains("layers");
  if (bare_model) {
    PSTRAIN_ASSIGN_OR_RETURN(model, LoadModelSpec(path));
  } else {
    PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobSpec(path));
    model = job.model();
  }
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(model);
  if (!graph.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": model: ", graph.status().message()));
  }
  return FormatModelSummary(*graph);
}

}  // namespace pstrain
