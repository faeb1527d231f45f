// The model and data commands: download, export, summary, prepare.
#include <google/protobuf/struct.pb.h>
#include <grpcpp/grpcpp.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/cli_internal.h"
#include "client/onnx_export.h"
#include "client/summary.h"
#include "common/checkpoint.h"
#include "common/data/bson_dataset.h"
#include "common/data/dataset.h"
#include "common/data/file_io.h"
#include "common/data/load_dataset.h"
#include "common/data/packed_format.h"
#include "common/job_spec.h"
#include "common/status_macros.h"
#include "common/storage/s3_flags.h"
#include "common/storage/storage.h"

ABSL_FLAG(std::string, format, "",
          "The source's format: idx, cifar10 or image_folder (instead of JOB.json)");
ABSL_FLAG(std::string, path, "", "The source dataset (with --format)");
ABSL_FLAG(std::string, image_size, "",
          "image_folder: decode and resize every image to HxW, e.g. 64x64");
ABSL_FLAG(std::optional<int64_t>, records_per_shard, std::nullopt,
          "Records per shard (>= 1; default: about 256 MiB per shard)");

namespace pstrain::cli_internal {
namespace {

// The dataset of `prepare --format F --path P [--image-size HxW]`;
// INVALID_ARGUMENT names the bad option.
absl::StatusOr<v1::DatasetSpec> DatasetFromOptions(const std::string& format,
                                                   const std::string& path,
                                                   const std::string& image_size) {
  static const auto* kFormats = new std::map<std::string, v1::DatasetFormat>{
      {"idx", v1::DATASET_FORMAT_IDX},
      {"cifar10", v1::DATASET_FORMAT_CIFAR10},
      {"image_folder", v1::DATASET_FORMAT_IMAGE_FOLDER},
      {"image-folder", v1::DATASET_FORMAT_IMAGE_FOLDER},
      {"bson", v1::DATASET_FORMAT_BSON}};
  auto it = kFormats->find(format);
  if (it == kFormats->end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--format must be idx, cifar10, image_folder or bson, got '", format, "'"));
  }
  v1::DatasetSpec spec;
  spec.set_format(it->second);
  spec.set_path(path);
  if (!image_size.empty()) {
    const size_t x = image_size.find('x');
    int h = 0, w = 0;
    if (x == std::string::npos || !absl::SimpleAtoi(image_size.substr(0, x), &h) ||
        !absl::SimpleAtoi(image_size.substr(x + 1), &w) || h <= 0 || w <= 0 || h > 65536 ||
        w > 65536) {
      return absl::InvalidArgumentError(
          absl::StrCat("--image-size must be HxW, e.g. 64x64, got '", image_size, "'"));
    }
    spec.set_image_height(h);
    spec.set_image_width(w);
  }
  return spec;
}

// Storage for s3:// paths, from the --s3-* flags and the AWS environment;
// retries are told on stderr.
absl::StatusOr<std::unique_ptr<storage::Storage>> OpenCliStorage() {
  PSTRAIN_ASSIGN_OR_RETURN(storage::StorageOptions options,
                           storage::StorageOptionsFromFlags([](const std::string& line) {
                             std::cerr << "pstrain: " << line << std::endl;
                           }));
  return storage::OpenStorage(options);
}

// The --s3-* flags, for the commands that take s3:// paths.
std::vector<const absl::CommandLineFlag*> WithS3Flags(
    std::vector<const absl::CommandLineFlag*> flags) {
  for (const absl::CommandLineFlag* flag :
       {&absl::GetFlagReflectionHandle(FLAGS_s3_endpoint),
        &absl::GetFlagReflectionHandle(FLAGS_s3_region),
        &absl::GetFlagReflectionHandle(FLAGS_s3_credentials),
        &absl::GetFlagReflectionHandle(FLAGS_s3_ca_file),
        &absl::GetFlagReflectionHandle(FLAGS_s3_path_style),
        &absl::GetFlagReflectionHandle(FLAGS_s3_no_verify_tls)}) {
    flags.push_back(flag);
  }
  return flags;
}

// A local file to stand in for an s3:// path while a file-based writer or
// reader works ("<tmp>/pstrain-<what>-XXXXXX"); removed by its destructor.
class ScratchFile {
 public:
  explicit ScratchFile(const std::string& what) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / ("pstrain-" + what + "-XXXXXX")).string();
    const int fd = ::mkstemp(pattern.data());
    if (fd >= 0) {
      ::close(fd);
      path_ = pattern;
    }
  }
  ~ScratchFile() {
    if (!path_.empty()) std::remove(path_.c_str());
  }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Uploads the local file `local` to `uri` (one object, whole or not at all).
absl::Status UploadFile(const std::string& local, const std::string& uri) {
  PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, data::ReadFileBytes(local));
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<storage::Storage> store, OpenCliStorage());
  return store->Write(uri, bytes);
}

// "pstrain WHAT: error: MESSAGE" on `err`; kExitFailed.
int Failed(std::ostream& err, const std::string& what, const std::string& message) {
  err << "pstrain " << what << ": error: " << message << std::endl;
  return kExitFailed;
}

// `text` as a JSON string literal.
std::string JsonString(const std::string& text) {
  google::protobuf::Value value;
  value.set_string_value(text);
  absl::StatusOr<std::string> json = ProtoJson(value);  // A Value always prints.
  return json.ok() ? *json : "\"\"";
}

// prepare's last line: the dataset block of a job that reads `dir`.
std::string UseItAs(const std::string& dir) {
  return absl::StrFormat(
      "use it as: \"dataset\": {\"format\": \"DATASET_FORMAT_PACKED\", \"path\": %s, ...}\n",
      JsonString(dir));
}

}  // namespace

// download ----------------------------------------------------------------------

int Cli::Download(const std::vector<std::string>& args) {
  static const Command kDownload = {
      "download",
      "usage: pstrain download JOB -o FILE|s3://bucket/key\n"
      "  Saves the job's latest checkpoint to FILE (written to FILE.tmp, verified,\n"
      "  then renamed), or uploads it, verified, to an object store (--s3-* flags\n"
      "  and AWS_* variables). Gives up when no data arrives for --timeout-ms.\n",
      WithS3Flags({&absl::GetFlagReflectionHandle(FLAGS_output)})};
  std::string path;
  Parsed parsed = ParseCommand(kDownload, args, [&] { path = absl::GetFlag(FLAGS_output); });
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() != 1 || path.empty()) {
    return Usage(kDownload, "expected a job id and -o FILE");
  }
  v1::Checkpoint ckpt;
  int64_t bytes = 0;
  if (storage::IsS3Uri(path)) {
    ScratchFile local("download");
    if (!local.ok()) return Failed(err_, "download", "cannot make a temporary file");
    const int rc = FetchCheckpoint("download", parsed.positional[0], local.path(), &ckpt, &bytes);
    if (rc != kExitOk) return rc;
    if (absl::Status s = UploadFile(local.path(), path); !s.ok()) {
      return Failed(err_, "download", std::string(s.message()));
    }
  } else {
    const int rc = FetchCheckpoint("download", parsed.positional[0], path, &ckpt, &bytes);
    if (rc != kExitOk) return rc;
  }
  out_ << absl::StrFormat("%s: %d bytes, %d tensors, step %d, epoch %d\n", path, bytes,
                          ckpt.parameters_size(), ckpt.step(), ckpt.epoch())
       << std::flush;
  return kExitOk;
}

int Cli::FetchCheckpoint(const std::string& what, const std::string& job_id,
                         const std::string& path, v1::Checkpoint* ckpt, int64_t* bytes) {
  const std::string tmp = path + ".tmp";
  std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
  if (!file) {
    err_ << "pstrain " << what << ": error: cannot write " << tmp << std::endl;
    return kExitFailed;
  }
  auto fail = [&](const std::string& message) {
    file.close();
    std::remove(tmp.c_str());
    err_ << "pstrain " << what << ": error: " << message << std::endl;
    return kExitFailed;
  };
  v1::DownloadModelRequest request;
  request.set_job_id(job_id);
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineFromNow(absl::Hours(1)));
  bool idle_timeout = false;
  int64_t written = 0, total = -1;
  grpc::Status end;
  {
    IdleWatchdog watchdog(absl::Milliseconds(timeout_ms_), [&ctx, &idle_timeout] {
      idle_timeout = true;
      ctx.TryCancel();
    });
    std::unique_ptr<grpc::ClientReader<v1::ModelChunk>> reader =
        stub().DownloadModel(&ctx, request);
    v1::ModelChunk chunk;
    while (reader->Read(&chunk)) {
      watchdog.Kick();
      if (chunk.offset() != written) {
        ctx.TryCancel();
        reader->Finish().IgnoreError();
        return fail(absl::StrCat("chunk at offset ", chunk.offset(), " after ", written,
                                 " bytes: the stream is out of order"));
      }
      total = chunk.total_bytes();
      file.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
      written += static_cast<int64_t>(chunk.data().size());
    }
    end = reader->Finish();
  }
  if (idle_timeout) {
    return fail(absl::StrCat("no data from ", server_, " for ", timeout_ms_,
                             " ms (see --timeout-ms) [DEADLINE_EXCEEDED]"));
  }
  if (!end.ok()) {
    file.close();
    std::remove(tmp.c_str());
    return ReportRpcError(what, end);
  }
  if (total < 0 || written != total) {
    return fail(absl::StrCat("received ", written, " of ", total, " bytes"));
  }
  file.close();
  if (!file) return fail(absl::StrCat("writing ", tmp, " failed"));
  absl::StatusOr<v1::Checkpoint> read = ReadCheckpointFile(tmp);
  if (!read.ok()) {
    return fail(absl::StrCat("the downloaded checkpoint is invalid: ", read.status().message()));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return fail(absl::StrCat("cannot rename ", tmp, " to ", path, ": ", ec.message()));
  *ckpt = *std::move(read);
  *bytes = written;
  return kExitOk;
}

// workers -----------------------------------------------------------------------
// export ------------------------------------------------------------------------

int Cli::Export(const std::vector<std::string>& args) {
  static const Command kExport = {
      "export",
      "usage: pstrain export CKPT|JOB -o FILE.onnx\n"
      "  Writes the model of a checkpoint file (or of a job's latest checkpoint,\n"
      "  downloaded from the server) as an ONNX inference graph (opset 13): input\n"
      "  'input' [batch, C, H, W] normalised as in training ((pixel/255 - mean) /\n"
      "  std, recorded in the model's metadata), outputs 'logits' and\n"
      "  'probabilities'. Dropout is left out; batch norm uses the running\n"
      "  statistics. CKPT and FILE.onnx may be s3://bucket/key (--s3-* flags and\n"
      "  AWS_* variables).\n",
      WithS3Flags({&absl::GetFlagReflectionHandle(FLAGS_output)}),
      /*dials_server=*/false};  // Not for a checkpoint file: Export checks when it dials.
  std::string path;
  Parsed parsed = ParseCommand(kExport, args, [&] { path = absl::GetFlag(FLAGS_output); });
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() != 1 || path.empty()) {
    return Usage(kExport, "expected a checkpoint file or job id and -o FILE.onnx");
  }
  const std::string& source = parsed.positional[0];
  v1::Checkpoint ckpt;
  std::error_code not_a_file;  // A path that cannot be stat()ed is taken as a job id.
  if (storage::IsS3Uri(source)) {
    ScratchFile local("export");
    absl::StatusOr<v1::Checkpoint> read = [&]() -> absl::StatusOr<v1::Checkpoint> {
      if (!local.ok()) return absl::InternalError("cannot make a temporary file");
      PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<storage::Storage> store, OpenCliStorage());
      PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, store->Read(source));
      PSTRAIN_RETURN_IF_ERROR(data::WriteFileAtomically(local.path(), bytes));
      absl::StatusOr<v1::Checkpoint> ckpt = ReadCheckpointFile(local.path());
      if (!ckpt.ok()) {
        return absl::Status(ckpt.status().code(),
                            absl::StrCat(source, ": ", ckpt.status().message()));
      }
      return ckpt;
    }();
    if (!read.ok()) return Failed(err_, "export", std::string(read.status().message()));
    ckpt = *std::move(read);
  } else if (std::filesystem::is_regular_file(source, not_a_file)) {
    absl::StatusOr<v1::Checkpoint> read = ReadCheckpointFile(source);
    if (!read.ok()) {
      err_ << "pstrain export: error: " << read.status().message() << std::endl;
      return kExitFailed;
    }
    ckpt = *std::move(read);
  } else {
    // A job id: its latest checkpoint, downloaded beside the output.
    if (std::optional<int> rc = CheckChannelOptions()) return *rc;
    const std::string downloaded = path + ".ckpt";
    int64_t bytes = 0;
    const int rc = FetchCheckpoint("export", source, downloaded, &ckpt, &bytes);
    std::remove(downloaded.c_str());
    if (rc != kExitOk) return rc;
  }
  absl::StatusOr<onnx::ModelProto> model = ExportOnnx(ckpt);
  if (!model.ok()) {
    err_ << "pstrain export: error: " << model.status().message() << std::endl;
    return kExitFailed;
  }
  if (storage::IsS3Uri(path)) {
    ScratchFile local("export");
    absl::Status s = local.ok() ? WriteOnnxFile(*model, local.path())
                                : absl::InternalError("cannot make a temporary file");
    if (s.ok()) s = UploadFile(local.path(), path);
    if (!s.ok()) return Failed(err_, "export", std::string(s.message()));
  } else if (absl::Status s = WriteOnnxFile(*model, path); !s.ok()) {
    err_ << "pstrain export: error: " << s.message() << std::endl;
    return kExitFailed;
  }
  out_ << absl::StrFormat("%s: ONNX opset %d, %d nodes, %d initializers, step %d, epoch %d\n", path,
                          kOnnxOpset, model->graph().node_size(), model->graph().initializer_size(),
                          ckpt.step(), ckpt.epoch())
       << std::flush;
  return kExitOk;
}

// A BSON dump streams into the shards record by record (common/data/
// bson_dataset.h PackBsonDataset): memory holds one shard, not the dump.
int Cli::PrepareBson(const v1::DatasetSpec& spec, const std::string& dir,
                     const data::PackOptions& options) {
  if (spec.image_height() <= 0 || spec.image_width() <= 0) {
    err_ << "pstrain prepare: a BSON dump needs --image-size HxW (its pictures are resized)"
         << std::endl;
    return kExitUsage;
  }
  data::BsonDecodeOptions decode;
  decode.channels = spec.image_channels() > 0 ? spec.image_channels() : 3;
  decode.height = spec.image_height();
  decode.width = spec.image_width();
  decode.max_bad_records = spec.max_bad_records();
  absl::StatusOr<std::unique_ptr<storage::Storage>> store =
      storage::IsS3Uri(dir) || storage::IsS3Uri(spec.path()) ? OpenCliStorage()
                                                              : storage::OpenStorage({});
  if (!store.ok()) return Failed(err_, "prepare", std::string(store.status().message()));
  const absl::Time start = absl::Now();
  absl::StatusOr<data::PackSummary> summary =
      data::PackBsonDataset(spec.path(), decode, dir, options, **store);
  if (!summary.ok()) return Failed(err_, "prepare", std::string(summary.status().message()));
  out_ << absl::StrFormat(
              "%s: train %d samples in %d shards, test %d samples in %d shards, %dx%dx%d, "
              "classes in %s, %.1f MB (streamed in %.2f s)\n",
              dir, summary->train_samples, summary->train_shards, summary->test_samples,
              summary->test_shards, decode.channels, decode.height, decode.width,
              storage::JoinUri(dir, "classes.csv"), summary->bytes / 1e6,
              absl::ToDoubleSeconds(absl::Now() - start))
       << UseItAs(dir) << std::flush;
  return kExitOk;
}

// summary -----------------------------------------------------------------------

int Cli::Summary(const std::vector<std::string>& args) {
  static const Command kSummary = {
      "summary",
      "usage: pstrain summary JOB.json\n"
      "  Validates the job's model and prints a table of layer, output shape and\n"
      "  parameter count, plus the totals. Exits 2 if the model is invalid.\n",
      {},
      /*dials_server=*/false};
  Parsed parsed = ParseCommand(kSummary, args, [] {});
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() != 1) return Usage(kSummary, "expected one file");
  absl::StatusOr<std::string> table = SummarizeJobFile(parsed.positional[0]);
  if (!table.ok()) {
    err_ << "pstrain summary: error: " << table.status().message() << std::endl;
    return kExitUsage;
  }
  out_ << *table << std::flush;
  return kExitOk;
}

// prepare -----------------------------------------------------------------------

int Cli::Prepare(const std::vector<std::string>& args) {
  static const Command kPrepare = {
      "prepare",
      "usage: pstrain prepare JOB.json -o DIR [--records-per-shard N]\n"
      "       pstrain prepare --format idx|cifar10|image_folder|bson --path SRC\n"
      "                       [--image-size HxW] -o DIR [--records-per-shard N]\n"
      "  Reads a dataset once (the job file's, or SRC in the given format; image\n"
      "  folders and BSON dumps are decoded and resized to HxW) and writes both\n"
      "  splits to DIR as shards of fixed-shape, decoded uint8 records with a\n"
      "  CRC-32 each. A job then reads them in place, without decoding:\n"
      "  \"dataset\": {\"format\": \"DATASET_FORMAT_PACKED\", \"path\": \"DIR\", ...}\n"
      "  (mean, std, augmentation and balance as before). A BSON dump streams into\n"
      "  the shards one product at a time. DIR, and an image folder's or a BSON\n"
      "  dump's SRC, may be an object-store prefix, s3://bucket/prefix\n"
      "  (--s3-endpoint, --s3-region, --s3-credentials, --s3-ca-file and the AWS_*\n"
      "  environment say how to reach it).\n",
      WithS3Flags({&absl::GetFlagReflectionHandle(FLAGS_output),
                   &absl::GetFlagReflectionHandle(FLAGS_format),
                   &absl::GetFlagReflectionHandle(FLAGS_path),
                   &absl::GetFlagReflectionHandle(FLAGS_image_size),
                   &absl::GetFlagReflectionHandle(FLAGS_records_per_shard)}),
      /*dials_server=*/false};
  std::string dir, format, path, image_size;
  std::optional<int64_t> records_per_shard;
  Parsed parsed = ParseCommand(kPrepare, args, [&] {
    dir = absl::GetFlag(FLAGS_output);
    format = absl::GetFlag(FLAGS_format);
    path = absl::GetFlag(FLAGS_path);
    image_size = absl::GetFlag(FLAGS_image_size);
    records_per_shard = absl::GetFlag(FLAGS_records_per_shard);
  });
  if (parsed.exit_code) return *parsed.exit_code;
  if (dir.empty() || parsed.positional.size() > 1 || parsed.positional.empty() == format.empty()) {
    return Usage(kPrepare, "expected JOB.json or --format and --path, and -o DIR");
  }
  data::PackOptions options;
  if (records_per_shard) {
    if (*records_per_shard < 1) {
      return Usage(kPrepare, "--records-per-shard must be a positive integer");
    }
    options.records_per_shard = *records_per_shard;
  }
  v1::DatasetSpec spec;
  if (!parsed.positional.empty()) {
    absl::StatusOr<v1::JobSpec> job = LoadJobSpec(parsed.positional[0]);
    if (!job.ok()) {
      err_ << "pstrain prepare: " << job.status().message() << std::endl;
      return kExitUsage;
    }
    spec = job->dataset();
  } else {
    absl::StatusOr<v1::DatasetSpec> from_options = DatasetFromOptions(format, path, image_size);
    if (!from_options.ok()) return Usage(kPrepare, std::string(from_options.status().message()));
    spec = *std::move(from_options);
  }
  if (spec.format() == v1::DATASET_FORMAT_PACKED || spec.format() == v1::DATASET_FORMAT_SYNTHETIC) {
    err_ << "pstrain prepare: the dataset is " << v1::DatasetFormat_Name(spec.format())
         << " already; nothing to pack" << std::endl;
    return kExitUsage;
  }
  // Everything is packed: the job's limits apply when it reads the shards.
  spec.clear_train_limit();
  spec.clear_test_limit();
  if (spec.format() == v1::DATASET_FORMAT_BSON) return PrepareBson(spec, dir, options);
  const absl::Time start = absl::Now();
  absl::StatusOr<data::DatasetSplits> splits;
  if (storage::IsS3Uri(spec.path())) {
    absl::StatusOr<std::unique_ptr<storage::Storage>> source = OpenCliStorage();
    if (!source.ok()) return Failed(err_, "prepare", std::string(source.status().message()));
    splits = data::LoadDataset(spec, **source);
  } else {
    splits = data::LoadDataset(spec);
  }
  if (!splits.ok()) {
    err_ << "pstrain prepare: error: " << splits.status().message() << std::endl;
    return kExitFailed;
  }
  const absl::Time loaded = absl::Now();
  absl::StatusOr<data::PackSummary> summary;
  if (storage::IsS3Uri(dir)) {
    absl::StatusOr<std::unique_ptr<storage::Storage>> store = OpenCliStorage();
    if (!store.ok()) {
      err_ << "pstrain prepare: error: " << store.status().message() << std::endl;
      return kExitFailed;
    }
    summary = data::WritePackedDataset(*splits, dir, options, **store);
  } else {
    summary = data::WritePackedDataset(*splits, dir, options);
  }
  if (!summary.ok()) {
    err_ << "pstrain prepare: error: " << summary.status().message() << std::endl;
    return kExitFailed;
  }
  const absl::Time written = absl::Now();
  out_ << absl::StrFormat(
              "%s: train %d samples in %d shards, test %d samples in %d shards, %dx%dx%d, %d "
              "classes, %.1f MB (read and decoded in %.2f s, written in %.2f s)\n",
              dir, summary->train_samples, summary->train_shards, summary->test_samples,
              summary->test_shards, splits->train.channels, splits->train.height,
              splits->train.width, splits->train.num_classes, summary->bytes / 1e6,
              absl::ToDoubleSeconds(loaded - start), absl::ToDoubleSeconds(written - loaded))
       << UseItAs(dir) << std::flush;
  return kExitOk;
}

}  // namespace pstrain::cli_internal
