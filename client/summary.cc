#include "client/summary.h"

#include "absl/strings/match.h"
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
  // A job names its model ("model" or "model_file" at the top level); any
  // other JSON is a bare model spec. Only the top-level keys count: a bare
  // model named "model" is still a model. Text that is not JSON goes to the
  // loader its words suggest, which says what is wrong with it.
  google::protobuf::Struct top;
  bool job_file;
  if (google::protobuf::util::JsonStringToMessage(text, &top).ok()) {
    job_file = top.fields().contains("model") || top.fields().contains("model_file") ||
               top.fields().contains("modelFile");
  } else {
    job_file = absl::StrContains(text, "\"model");  // "model", "model_file", "modelFile".
  }
  if (job_file) {
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
