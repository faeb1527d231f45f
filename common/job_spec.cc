#include "common/job_spec.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/model_graph.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"

namespace pstrain {
namespace {

namespace fs = std::filesystem;

std::string Resolve(const std::string& base_dir, const std::string& path) {
  if (path.empty() || base_dir.empty() || fs::path(path).is_absolute()) return path;
  return (fs::path(base_dir) / path).lexically_normal().string();
}

template <typename Message>
absl::Status ParseJson(std::string_view json, const std::string& source, Message* out) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), out, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not a valid ", Message::descriptor()->full_name(), " JSON: ",
                     std::string(status.message())));
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
    if (job.has_model()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_name, ": set either model or model_file, not both"));
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
  return job;
}

absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path) {
  PSTRAIN_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  std::string base_dir = fs::path(path).parent_path().string();
  return ParseJobSpec(text, base_dir, path);
}

absl::Status ValidateJobSpec(const v1::JobSpec& job) {
  if (!job.has_model()) {
    return absl::InvalidArgumentError("job has no model (set model or model_file)");
  }
  absl::StatusOr<ModelGraph> graph = BuildModelGraph(job.model());
  if (!graph.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model: ", graph.status().message()));
  }
  if (job.epochs() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("epochs must be > 0, got ", job.epochs()));
  }
  if (job.batch_size() <= 0 || job.batch_size() > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch_size must be in [1, 65536], got ", job.batch_size()));
  }
  if (!job.has_optimizer()) return absl::InvalidArgumentError("job has no optimizer");
  const v1::DatasetSpec& data = job.dataset();
  if (data.format() == v1::DATASET_FORMAT_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        "dataset.format must be one of DATASET_FORMAT_IDX, DATASET_FORMAT_CIFAR10, "
        "DATASET_FORMAT_IMAGE_FOLDER, DATASET_FORMAT_SYNTHETIC");
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
  if (data.format() == v1::DATASET_FORMAT_IMAGE_FOLDER &&
      (data.image_height() <= 0 || data.image_width() <= 0)) {
    return absl::InvalidArgumentError(
        "dataset.image_height and image_width must be > 0 for image folders");
  }
  if (job.workers() < 0) return absl::InvalidArgumentError("workers must be >= 0");
  if (job.staleness() < 0) return absl::InvalidArgumentError("staleness must be >= 0");
  if (job.averaging_frequency() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "averaging_frequency must be >= 0 (0 = the default, ", kDefaultAveragingFrequency,
        " local steps), got ", job.averaging_frequency()));
  }
  return absl::OkStatus();
}

void ApplyJobDefaults(v1::JobSpec* job) {
  if (job->workers() == 0) job->set_workers(1);
  if (job->mode() == v1::CONSISTENCY_AVERAGE && job->averaging_frequency() == 0) {
    job->set_averaging_frequency(kDefaultAveragingFrequency);
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
