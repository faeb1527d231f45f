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
  v1::JobSpec job;
  PSTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  // A job names its model ("model", "model_file" or "external_model" at the
  // top level); any other JSON is a bare model spec. Only the top-level keys
  // count: a bare model named "model" is still a model. Text that is not
  // JSON goes to the loader its words suggest, which says what is wrong
  // with it.
  google::protobuf::Struct top;
  bool job_file = false;
  if (google::protobuf::util::JsonStringToMessage(text, &top).ok()) {
    for (const char* key :
         {"model", "model_file", "modelFile", "external_model", "externalModel"}) {
      job_file = job_file || top.fields().contains(key);
    }
  } else {
    for (const char* key : {"\"model", "\"external_model", "\"externalModel"}) {
      job_file = job_file || absl::StrContains(text, key);  // "model" covers model_file too.
    }
  }
  if (job_file) {
    PSTRAIN_ASSIGN_OR_RETURN(job, LoadJobSpec(path));
  } else {
    PSTRAIN_ASSIGN_OR_RETURN(*job.mutable_model(), LoadModelSpec(path));
  }
  absl::StatusOr<ModelGraph> graph = BuildJobGraph(job);
  if (!graph.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, job.has_external_model() ? ": " : ": model: ", graph.status().message()));
  }
  return FormatModelSummary(*graph);
}

}  // namespace pstrain
