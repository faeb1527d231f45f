// `pstrain summary JOB.json`: a Keras-style table of the job's model.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::string table, SummarizeJobFile("examples/fashion-mnist.json"));
#ifndef PSTRAIN_CLIENT_SUMMARY_H_
#define PSTRAIN_CLIENT_SUMMARY_H_

#include <string>

#include "absl/status/statusor.h"

namespace pstrain {

// Loads the job (or a bare model spec: a file with "layers" at the top),
// validates its model and returns the summary table. Errors name the file
// and, for model errors, the layer.
absl::StatusOr<std::string> SummarizeJobFile(const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_CLIENT_SUMMARY_H_
