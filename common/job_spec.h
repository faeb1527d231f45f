// Job files: JSON in the protobuf JSON mapping of pstrain.v1.JobSpec.
//
//   PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobSpec("examples/fashion-mnist.json"));
//   // job.model() is filled in even when the file used "model_file".
//   PSTRAIN_RETURN_IF_ERROR(ValidateJobSpec(job));
#ifndef PSTRAIN_COMMON_JOB_SPEC_H_
#define PSTRAIN_COMMON_JOB_SPEC_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain {

// Reads and parses a job file and resolves `model_file` (relative paths are
// taken from the job file's directory) into `model`, and a relative
// dataset.path likewise. Unknown fields are errors (a typo must not silently
// fall back to a default). Errors name the file.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);

// The same from text; `base_dir` resolves relative paths ("" = cwd).
absl::StatusOr<v1::JobSpec> ParseJobSpec(std::string_view json, const std::string& base_dir,
                                         const std::string& source_name = "job");

// Reads a ModelSpec JSON file (the model zoo under examples/models/).
absl::StatusOr<v1::ModelSpec> LoadModelSpec(const std::string& path);

// Checks everything that can be checked without the data or a device: the
// model graph (see BuildModelGraph), epochs, batch size, dataset fields,
// consistency-mode fields. Optimizer fields are checked by
// ValidateOptimizerSpec (kernels/optimizer.h), which the worker and server
// call as well. INVALID_ARGUMENT with a message naming the field.
absl::Status ValidateJobSpec(const v1::JobSpec& job);

// Average mode's K when a job leaves averaging_frequency at 0: DL4J's
// default averaging frequency.
inline constexpr int kDefaultAveragingFrequency = 5;

// Fills the fields whose 0 means "the default": workers (1) and, in average
// mode, averaging_frequency (kDefaultAveragingFrequency). The coordinator
// applies it to every submitted job, so the stored spec says what runs.
void ApplyJobDefaults(v1::JobSpec* job);

// Serialises a job back to JSON (for logs and checkpoints).
std::string JobSpecToJson(const v1::JobSpec& job);

// Reads a whole file; NOT_FOUND / error naming the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_JOB_SPEC_H_
