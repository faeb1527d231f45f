// Job files: JSON in the protobuf JSON mapping of pstrain.v1.JobSpec.
//
//   PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobSpec("examples/fashion-mnist.json"));
//   // job.model() is filled in even when the file used "model_file".
//   PSTRAIN_RETURN_IF_ERROR(ValidateJobSpec(job));
#ifndef PSTRAIN_COMMON_JOB_SPEC_H_
#define PSTRAIN_COMMON_JOB_SPEC_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/model_graph.h"
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
// model graph (BuildModelGraph, or BuildExternalGraph for an external_model),
// epochs, batch size, dataset fields,
// consistency-mode fields. Optimizer fields are checked by
// ValidateOptimizerSpec (kernels/optimizer.h), which the worker and server
// call as well. INVALID_ARGUMENT with a message naming the field; enum
// fields holding a value this build does not know (proto3 keeps them) are
// INVALID_ARGUMENT too, never a silent default.
// An external model's job (JobSpec.external_model) needs no dataset (its
// workers read their own data; a dataset is INVALID_ARGUMENT) and may leave
// the tensors out: its workers declare them before it starts.
// A job that names a command (JobSpec.command) has an external model, and
// its command is checked by ValidateCommandSpec.
absl::Status ValidateJobSpec(const v1::JobSpec& job);

// JobSpec.command's limits (job.proto, CommandSpec): INVALID_ARGUMENT naming
// the argument or variable. Whether a daemon runs it is the daemon's call
// (worker/command_run.h).
absl::Status ValidateCommandSpec(const v1::CommandSpec& command);

// A job that names a command and no model gets an (empty) external model:
// its processes declare the tensors. ParseJobSpec and ApplyJobDefaults call
// it.
void ImplyCommandModel(v1::JobSpec* job);

// The job's model is external and its tensors are known (declared by a
// worker, or in the submitted spec).
bool ExternalModelDeclared(const v1::JobSpec& job);

// True when only workers bound to the job (WorkerInfo.job_id) train it: an
// external model's processes, or a launcher's (JobSpec.bound_workers).
bool JobTakesBoundWorkers(const v1::JobSpec& job);

// OK when `offered` names the same tensors as `declared`, in the same order,
// with the same shapes and trainable flags (the framework string may
// differ); else INVALID_ARGUMENT naming the first difference.
absl::Status CheckSameExternalModel(const v1::ExternalModel& declared,
                                    const v1::ExternalModel& offered);

// The default TOPK ratio (CompressionSpec.topk_ratio 0).
inline constexpr float kDefaultTopKRatio = 0.01f;
// JobSpec.compression or pull_compression (common/rpc/gradient_codec.h):
// INVALID_ARGUMENT, naming `field`, for an unknown method, a topk_ratio
// outside (0, 1] for TOPK, or a non-zero topk_ratio with another method.
// ValidateJobSpec calls it.
absl::Status ValidateCompression(const v1::CompressionSpec& spec,
                                 absl::string_view field = "compression");

// What one job may make a server hold. The server's defaults are flags of
// pstrain-server (docs/ARCHITECTURE.md, "Limits").
struct JobLimits {
  // Parameter values (fp32, running statistics included) over the model.
  int64_t max_parameters = int64_t{1} << 28;  // 268,435,456 (1 GiB of fp32).
  // Bytes of parameters plus the server-side optimizer state (SGD momentum:
  // one copy, Adam/AdamW: two).
  int64_t max_parameter_bytes = int64_t{2} << 30;  // 2 GiB.
  // JobSpec.name and ModelSpec.name.
  int max_name_bytes = 256;
};

// INVALID_ARGUMENT when the job's model exceeds `limits` (the message names
// the limit, the model's figure and the flag that raises it) or a name is
// too long. `graph` is BuildJobGraph(job).
absl::Status CheckJobLimits(const v1::JobSpec& job, const ModelGraph& graph,
                            const JobLimits& limits);

// INVALID_ARGUMENT naming `what` and --max-id-bytes when `id` (a job or
// worker id from a request) is longer than max_id_bytes.
absl::Status CheckIdLength(const char* what, const std::string& id, int64_t max_id_bytes);

// Optimizer-state copies of every trainable parameter the server keeps for
// `optimizer` (0 plain SGD, 1 SGD with momentum, 2 Adam/AdamW).
int OptimizerStateCopies(const v1::OptimizerSpec& optimizer);

// The most test samples the job's dataset can hold, when the spec says it
// (test_limit, a synthetic set's test_samples, CIFAR-10's 10,000); nullopt
// when only the files know.
std::optional<int64_t> TestSetBound(const v1::JobSpec& job);

// Average mode's K when a job leaves averaging_frequency at 0: DL4J's
// default averaging frequency.
inline constexpr int kDefaultAveragingFrequency = 5;

// The gradient compression's min_compress_bytes when a TOPK or ONEBIT job
// leaves it unset: parameters under 256 KiB of F32 go whole. On Fashion-MNIST
// (2 workers, sync, 3 epochs, one run) top-k 1% ended at 0.8959 with it and
// 0.8844 without, uncompressed at 0.8950 (issue 43; docs/BENCHMARKS.md).
inline constexpr int64_t kDefaultMinCompressBytes = 262144;

// The job's consistency mode, CONSISTENCY_UNSPECIFIED read as the default,
// CONSISTENCY_SYNC: the one place that says so. The coordinator's specs
// have it set (ApplyJobDefaults); code that may see a spec as a user or a
// peer wrote it (validation, the shards and workers that take specs over
// the wire) asks here instead of guessing.
v1::ConsistencyMode ConsistencyModeOf(const v1::JobSpec& job);

// Fills the fields whose 0 or absence means "the default": workers (1), mode
// (ConsistencyModeOf), in average mode averaging_frequency
// (kDefaultAveragingFrequency), and with TOPK or ONEBIT gradient compression
// an unset min_compress_bytes (kDefaultMinCompressBytes; an explicit 0 stays
// 0), and a command job's external model (ImplyCommandModel). The coordinator applies it to every submitted job and to every job it
// loads, so the stored spec says what runs and the shards and workers never
// guess.
void ApplyJobDefaults(v1::JobSpec* job);

// Serialises a job back to JSON (for logs and checkpoints).
std::string JobSpecToJson(const v1::JobSpec& job);

// Reads a whole file; NOT_FOUND / error naming the path.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_JOB_SPEC_H_
