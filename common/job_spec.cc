#include "common/job_spec.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_graph.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;

// `path` relative to the job file's directory; absolute paths and URIs
// (s3://bucket/prefix, file:///x) as they are.
std::string Resolve(const std::string& base_dir, const std::string& path) {
  if (path.empty() || base_dir.empty() || fs::path(path).is_absolute() ||
      path.find("://") != std::string::npos) {
    return path;
  }
  return (fs::path(base_dir) / path).lexically_normal().string();
}

template <typename Message>
absl::Status ParseJson(std::string_view json, const std::string& source, Message* out) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), out, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a valid ",
                                                   Message::descriptor()->full_name(),
                                                   " JSON: ", std::string(status.message())));
  }
  return absl::OkStatus();
}

// The dataset fields of a job whose model is a ModelSpec.
absl::Status ValidateDataset(const v1::DatasetSpec& data) {
  if (data.format() == v1::DATASET_FORMAT_UNSPECIFIED ||
      !v1::DatasetFormat_IsValid(data.format())) {
    return absl::InvalidArgumentError(
        "dataset.format must be one of DATASET_FORMAT_IDX, DATASET_FORMAT_CIFAR10, "
        "DATASET_FORMAT_IMAGE_FOLDER, DATASET_FORMAT_SYNTHETIC, DATASET_FORMAT_PACKED, "
        "DATASET_FORMAT_BSON");
  }
  if (!v1::Balance_IsValid(data.balance())) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.balance ", static_cast<int>(data.balance()),
                     " is not a known Balance (BALANCE_NONE, BALANCE_OVERSAMPLE)"));
  }
  if (data.path().empty() && data.format() != v1::DATASET_FORMAT_SYNTHETIC) {
    return absl::InvalidArgumentError("dataset.path is empty");
  }
  if (data.train_limit() < 0 || data.test_limit() < 0) {
    return absl::InvalidArgumentError("dataset.train_limit and test_limit must be >= 0");
  }
  if (data.prefetch_batches() < 0 || data.prefetch_batches() > 64) {
    return absl::InvalidArgumentError("dataset.prefetch_batches must be in [0, 64]");
  }
  if (data.loader_threads() < 0 || data.loader_threads() > 64) {
    return absl::InvalidArgumentError("dataset.loader_threads must be in [0, 64]");
  }
  if (data.augmentation().crop_padding() < 0) {
    return absl::InvalidArgumentError("dataset.augmentation.crop_padding must be >= 0");
  }
  for (float s : data.std()) {
    if (!(s > 0)) return absl::InvalidArgumentError("dataset.std entries must be > 0");
  }
  if ((data.format() == v1::DATASET_FORMAT_IMAGE_FOLDER ||
       data.format() == v1::DATASET_FORMAT_BSON) &&
      (data.image_height() <= 0 || data.image_width() <= 0 || data.image_height() > 4096 ||
       data.image_width() > 4096)) {
    return absl::InvalidArgumentError(
        "dataset.image_height and image_width must be in [1, 4096] for image folders and BSON");
  }
  if (data.image_channels() != 0 && data.image_channels() != 1 && data.image_channels() != 3) {
    return absl::InvalidArgumentError(absl::StrCat("dataset.image_channels must be 0 (3), 1 or 3, got ",
                                                   data.image_channels()));
  }
  if (data.max_bad_records() < 0) {
    return absl::InvalidArgumentError("dataset.max_bad_records must be >= 0");
  }
  if (data.shuffle_window_mib() < 0 || data.shuffle_window_mib() > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("dataset.shuffle_window_mib must be in [0, 65536] (0: 256), got ",
                     data.shuffle_window_mib()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!fs::exists(path, ec)) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for reading"));
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return buffer.str();
}

absl::StatusOr<v1::ModelSpec> LoadModelSpec(const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  v1::ModelSpec model;
  PSTRAIN_RETURN_IF_ERROR(ParseJson(text, path, &model));
  return model;
}

absl::StatusOr<v1::JobSpec> ParseJobSpec(std::string_view json, const std::string& base_dir,
                                         const std::string& source_name) {
  v1::JobSpec job;
  PSTRAIN_RETURN_IF_ERROR(ParseJson(json, source_name, &job));
  if (!job.model_file().empty()) {
    if (job.has_model() || job.has_external_model()) {
      return absl::InvalidArgumentError(absl::StrCat(
          source_name, ": set one of model, model_file and external_model, not several"));
    }
    std::string model_path = Resolve(base_dir, job.model_file());
    auto model = LoadModelSpec(model_path);
    if (!model.ok()) {
      return absl::Status(model.status().code(),
                          absl::StrCat(source_name, ": model_file: ", model.status().message()));
    }
    *job.mutable_model() = *std::move(model);
    job.clear_model_file();
  }
  if (job.has_dataset() && !job.dataset().path().empty()) {
    job.mutable_dataset()->set_path(Resolve(base_dir, job.dataset().path()));
  }
  ImplyCommandModel(&job);
  return job;
}

absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::string base_dir = fs::path(path).parent_path().string();
  return ParseJobSpec(text, base_dir, path);
}

bool ExternalModelDeclared(const v1::JobSpec& job) {
  return job.has_external_model() && job.external_model().tensors_size() > 0;
}

bool JobTakesBoundWorkers(const v1::JobSpec& job) {
  return job.has_external_model() || job.bound_workers();
}

absl::Status CheckSameExternalModel(const v1::ExternalModel& declared,
                                    const v1::ExternalModel& offered) {
  if (declared.tensors_size() != offered.tensors_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the job's model has ", declared.tensors_size(), " tensors; this one has ",
                     offered.tensors_size(), " (every worker must build the same model)"));
  }
  for (int i = 0; i < declared.tensors_size(); ++i) {
    const v1::ExternalTensor& a = declared.tensors(i);
    const v1::ExternalTensor& b = offered.tensors(i);
    const bool same_shape =
        std::equal(a.shape().begin(), a.shape().end(), b.shape().begin(), b.shape().end());
    if (a.name() != b.name() || !same_shape || a.trainable() != b.trainable()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", i, " of the job's model is '", a.name(), "' [", absl::StrJoin(a.shape(), ", "),
          "]", a.trainable() ? "" : " (buffer)", "; this one declares '", b.name(), "' [",
          absl::StrJoin(b.shape(), ", "), "]", b.trainable() ? "" : " (buffer)",
          " (every worker must build the same model)"));
    }
  }
  return absl::OkStatus();
}

void ImplyCommandModel(v1::JobSpec* job) {
  if (job->has_command() && !job->has_external_model() && !job->has_model() &&
      job->model_file().empty()) {
    job->mutable_external_model();
  }
}

absl::Status ValidateCommandSpec(const v1::CommandSpec& command) {
  constexpr size_t kMaxValue = 4096;
  constexpr int kMaxEntries = 64;
  auto has_nul = [](const std::string& s) { return s.find('\0') != std::string::npos; };
  if (command.argv_size() < 1 || command.argv_size() > kMaxEntries || command.argv(0).empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "command.argv must hold 1 to ", kMaxEntries,
        " arguments with a non-empty program first, got ", command.argv_size(), " argument(s)"));
  }
  for (int i = 0; i < command.argv_size(); ++i) {
    if (command.argv(i).size() > kMaxValue || has_nul(command.argv(i))) {
      return absl::InvalidArgumentError(absl::StrCat("command.argv[", i, "] is over ", kMaxValue,
                                                     " bytes or holds a NUL byte"));
    }
  }
  if (command.env_size() > kMaxEntries) {
    return absl::InvalidArgumentError(absl::StrCat("command.env holds ", command.env_size(),
                                                   " variables; at most ", kMaxEntries));
  }
  for (const auto& [name, value] : command.env()) {
    const bool valid_name =
        !name.empty() && !absl::ascii_isdigit(static_cast<unsigned char>(name[0])) &&
        std::all_of(name.begin(), name.end(), [](char c) {
          return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_';
        });
    if (!valid_name || name.size() > 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("command.env: '", name.substr(0, 64), "' is not a variable name"));
    }
    if (absl::StartsWith(name, "PSTRAIN_")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "command.env: ", name, " is set by the daemon that runs the command; remove it"));
    }
    if (value.size() > kMaxValue || has_nul(value)) {
      return absl::InvalidArgumentError(absl::StrCat("command.env: the value of ", name,
                                                     " is over ", kMaxValue,
                                                     " bytes or holds a NUL byte"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateJobSpec(const v1::JobSpec& job) {
  if (job.bound_workers() && job.has_command()) {
    return absl::InvalidArgumentError(
        "bound_workers: a job that names a command gets its workers from the daemons that run "
        "it; set one of them");
  }
  if (job.has_command()) {
    if (!job.has_external_model()) {
      return absl::InvalidArgumentError(
          "a job that names a command trains the model its processes declare: remove `model` "
          "and `model_file`");
    }
    PSTRAIN_RETURN_IF_ERROR(ValidateCommandSpec(job.command()));
  }
  if (job.has_external_model()) {
    if (job.has_model() || !job.model_file().empty()) {
      return absl::InvalidArgumentError(
          "set one of model, model_file and external_model, not several");
    }
    if (ExternalModelDeclared(job)) {
      PSTRAIN_RETURN_IF_ERROR(BuildExternalGraph(job.external_model()).status());
    }
    if (job.has_dataset()) {
      return absl::InvalidArgumentError(
          "a job whose model is external has no dataset: its workers read their own data "
          "(pstrain.torch's DistributedSampler); remove `dataset`");
    }
  } else {
    if (!job.has_model()) {
      return absl::InvalidArgumentError("job has no model (set model or model_file)");
    }
    absl::StatusOr<ModelGraph> graph = BuildModelGraph(job.model());
    if (!graph.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("model: ", graph.status().message()));
    }
  }
  if (job.epochs() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("epochs must be > 0, got ", job.epochs()));
  }
  if (job.batch_size() <= 0 || job.batch_size() > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size must be in [1, 65536], got ", job.batch_size()));
  }
  if (!job.has_optimizer()) return absl::InvalidArgumentError("job has no optimizer");
  if (!v1::OptimizerType_IsValid(job.optimizer().type())) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.type ", job.optimizer().type(), " is not a known OptimizerType"));
  }
  if (!v1::ConsistencyMode_IsValid(job.mode())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mode ", job.mode(),
        " is not a known ConsistencyMode (CONSISTENCY_SYNC, CONSISTENCY_ASYNC, CONSISTENCY_SSP, "
        "CONSISTENCY_AVERAGE)"));
  }
  if (!job.has_external_model()) PSTRAIN_RETURN_IF_ERROR(ValidateDataset(job.dataset()));
  if (job.has_external_model() && job.precision() != v1::PRECISION_FP32) {
    return absl::InvalidArgumentError(
        "precision is the pstrain engine's; a job whose model is external computes in the "
        "user's framework (e.g. torch.autocast there): leave precision unset");
  }
  if (job.workers() < 0) return absl::InvalidArgumentError("workers must be >= 0");
  if (job.staleness() < 0) return absl::InvalidArgumentError("staleness must be >= 0");
  if (job.averaging_frequency() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("averaging_frequency must be >= 0 (0 = the default, ",
                     kDefaultAveragingFrequency, " local steps), got ", job.averaging_frequency()));
  }
  PSTRAIN_RETURN_IF_ERROR(ValidateCompression(job.compression()));
  if (job.compression().method() != v1::CompressionSpec::COMPRESSION_NONE &&
      job.mode() == v1::CONSISTENCY_AVERAGE) {
    return absl::InvalidArgumentError(
        "compression applies to gradient pushes (CONSISTENCY_SYNC, CONSISTENCY_ASYNC, "
        "CONSISTENCY_SSP); CONSISTENCY_AVERAGE pushes parameters, which travel as F32");
  }
  if (!v1::Precision_IsValid(job.precision())) {
    return absl::InvalidArgumentError(
        absl::StrCat("precision ", job.precision(),
                     " is not a known Precision (PRECISION_FP32, PRECISION_BF16, PRECISION_FP16)"));
  }
  PSTRAIN_RETURN_IF_ERROR(ValidateCompression(job.pull_compression(), "pull_compression"));
  if (job.pull_compression().method() != v1::CompressionSpec::COMPRESSION_NONE &&
      ConsistencyModeOf(job) != v1::CONSISTENCY_SYNC) {
    return absl::InvalidArgumentError(
        "pull_compression applies to CONSISTENCY_SYNC, where every worker pulls every step's "
        "model; in the other modes pulls travel as F32");
  }
  return absl::OkStatus();
}

absl::Status ValidateCompression(const v1::CompressionSpec& spec, absl::string_view field) {
  if (!v1::CompressionSpec::Method_IsValid(spec.method())) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".method ", static_cast<int>(spec.method()),
        " is not a known method (COMPRESSION_NONE, COMPRESSION_FP16, COMPRESSION_BF16, "
        "COMPRESSION_TOPK, COMPRESSION_ONEBIT)"));
  }
  const float ratio = spec.topk_ratio();
  if (spec.method() == v1::CompressionSpec::COMPRESSION_TOPK) {
    if (!(ratio >= 0.0f && ratio <= 1.0f)) {  // NaN fails too.
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".topk_ratio must be in (0, 1] (0 means ", kDefaultTopKRatio, "), got ", ratio));
    }
  } else if (ratio != 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".topk_ratio is only for COMPRESSION_TOPK; method is ",
                     v1::CompressionSpec::Method_Name(spec.method())));
  }
  if (spec.min_compress_bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".min_compress_bytes must be >= 0, got ", spec.min_compress_bytes()));
  }
  if (spec.min_compress_bytes() != 0 && spec.method() != v1::CompressionSpec::COMPRESSION_TOPK &&
      spec.method() != v1::CompressionSpec::COMPRESSION_ONEBIT) {
    return absl::InvalidArgumentError(
        absl::StrCat(field,
                     ".min_compress_bytes is only for COMPRESSION_TOPK and COMPRESSION_ONEBIT; "
                     "method is ",
                     v1::CompressionSpec::Method_Name(spec.method())));
  }
  return absl::OkStatus();
}

absl::Status CheckJobLimits(const v1::JobSpec& job, const ModelGraph& graph,
                            const JobLimits& limits) {
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"name", &job.name()},
        {"model.name", &job.model().name()}}) {
    if (static_cast<int64_t>(value->size()) > limits.max_name_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(field, " has ", value->size(),
                                                     " bytes; at most ", limits.max_name_bytes,
                                                     " are allowed (--max-name-bytes)"));
    }
  }
  // BuildModelGraph keeps every count <= kMaxGraphElements, so none of the
  // products below overflows.
  const int64_t parameters = graph.trainable_params + graph.non_trainable_params;
  if (parameters > limits.max_parameters) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model has ", parameters, " parameters; a job may have at most ",
                     limits.max_parameters, " (--max-job-parameters)"));
  }
  const int64_t bytes =
      (parameters + graph.trainable_params * OptimizerStateCopies(job.optimizer())) *
      static_cast<int64_t>(sizeof(float));
  if (bytes > limits.max_parameter_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model's parameters and optimizer state take ", bytes,
                     " bytes on the servers; a job may take at most ", limits.max_parameter_bytes,
                     " (--max-job-bytes)"));
  }
  return absl::OkStatus();
}

absl::Status CheckIdLength(const char* what, const std::string& id, int64_t max_id_bytes) {
  if (static_cast<int64_t>(id.size()) > max_id_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has ", id.size(), " bytes; ids have at most ", max_id_bytes, " (--max-id-bytes)"));
  }
  return absl::OkStatus();
}

int OptimizerStateCopies(const v1::OptimizerSpec& optimizer) {
  switch (optimizer.type()) {
    case v1::OPTIMIZER_SGD:
      return optimizer.momentum() > 0.f ? 1 : 0;
    case v1::OPTIMIZER_ADAM:
    case v1::OPTIMIZER_ADAMW:
      return 2;
    default:
      return 0;
  }
}

std::optional<int64_t> TestSetBound(const v1::JobSpec& job) {
  const v1::DatasetSpec& data = job.dataset();
  std::optional<int64_t> bound;
  if (data.format() == v1::DATASET_FORMAT_SYNTHETIC && data.synthetic().test_samples() > 0) {
    bound = data.synthetic().test_samples();
  }
  if (data.format() == v1::DATASET_FORMAT_CIFAR10) bound = 10000;  // test_batch.bin.
  if (data.test_limit() > 0) bound = std::min(bound.value_or(data.test_limit()), data.test_limit());
  return bound;
}

v1::ConsistencyMode ConsistencyModeOf(const v1::JobSpec& job) {
  return job.mode() == v1::CONSISTENCY_UNSPECIFIED ? v1::CONSISTENCY_SYNC : job.mode();
}

void ApplyJobDefaults(v1::JobSpec* job) {
  ImplyCommandModel(job);
  if (job->workers() == 0) job->set_workers(1);
  job->set_mode(ConsistencyModeOf(*job));
  if (job->mode() == v1::CONSISTENCY_AVERAGE && job->averaging_frequency() == 0) {
    job->set_averaging_frequency(kDefaultAveragingFrequency);
  }
  const v1::CompressionSpec::Method method = job->compression().method();
  if ((method == v1::CompressionSpec::COMPRESSION_TOPK ||
       method == v1::CompressionSpec::COMPRESSION_ONEBIT) &&
      !job->compression().has_min_compress_bytes()) {
    job->mutable_compression()->set_min_compress_bytes(kDefaultMinCompressBytes);
  }
}

std::string JobSpecToJson(const v1::JobSpec& job) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(job, &out, options);
  return out;
}

}  // namespace pstrain
