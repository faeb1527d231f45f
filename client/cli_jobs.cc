// The job commands: submit, status, report, list, watch, cancel; and the
// job status texts of client/cli.h.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/cli.h"
#include "client/cli_internal.h"
#include "client/report.h"
#include "common/checkpoint.h"
#include "common/data/file_io.h"
#include "common/job_spec.h"
#include "common/job_state.h"
#include "common/metrics.h"
#include "common/status_macros.h"

ABSL_FLAG(std::optional<int>, workers, std::nullopt,
          "Workers to train on (>= 1; default: the job file's)");
ABSL_FLAG(std::string, mode, "",
          "Consistency: sync, async, ssp or average (default: the job file's)");
ABSL_FLAG(std::optional<int>, staleness, std::nullopt,
          "ssp: how many steps the fastest worker may lead the slowest (>= 0)");
ABSL_FLAG(std::optional<int>, averaging_frequency, std::nullopt,
          "average: local steps between parameter averages (>= 1; the job file's default is "
          "5, DL4J's)");
ABSL_FLAG(std::optional<int>, epochs, std::nullopt, "Epochs to train (>= 1)");
ABSL_FLAG(std::string, compression, "",
          "How workers push gradients: none, fp16, bf16, topk[:RATIO] or onebit");
ABSL_FLAG(std::string, pull_compression, "",
          "sync: how servers send the new model to workers, as a delta with error feedback: "
          "none, fp16, bf16, topk[:RATIO] or onebit");
ABSL_FLAG(std::optional<int64_t>, min_compress_bytes, std::nullopt,
          "topk and onebit (pushes, and pulls with --pull-compression topk or onebit): "
          "parameters of fewer F32 bytes travel whole (pushes default to 262144, which keeps "
          "convolution kernels and biases exact; 0 = compress every parameter)");
ABSL_FLAG(std::string, precision, "",
          "Training arithmetic on the workers: fp32, or bf16 / fp16 mixed precision (CUDA "
          "workers only; fp16 with dynamic loss scaling)");
ABSL_FLAG(bool, watch, false, "Follow the job like `pstrain watch` and exit by its end state");
ABSL_FLAG(std::string, report, "", "Also write the job's HTML report to this file");

namespace pstrain {
namespace cli_internal {
namespace {

// --compression (or --pull-compression) none|fp16|bf16|topk[:RATIO]|onebit.
absl::StatusOr<v1::CompressionSpec> ParseCompression(const std::string& value,
                                                     absl::string_view flag = "--compression") {
  static const auto* kMethods = new std::map<std::string, v1::CompressionSpec::Method>{
      {"none", v1::CompressionSpec::COMPRESSION_NONE},
      {"fp16", v1::CompressionSpec::COMPRESSION_FP16},
      {"bf16", v1::CompressionSpec::COMPRESSION_BF16},
      {"topk", v1::CompressionSpec::COMPRESSION_TOPK},
      {"onebit", v1::CompressionSpec::COMPRESSION_ONEBIT}};
  const size_t colon = value.find(':');
  auto it = kMethods->find(value.substr(0, colon));
  v1::CompressionSpec spec;
  if (it == kMethods->end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " must be none, fp16, bf16, topk[:RATIO] or onebit, got '", value, "'"));
  }
  spec.set_method(it->second);
  if (colon != std::string::npos) {
    float ratio = 0;
    if (it->second != v1::CompressionSpec::COMPRESSION_TOPK ||
        !absl::SimpleAtof(value.substr(colon + 1), &ratio) || !(ratio > 0 && ratio <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " topk:RATIO takes a RATIO in (0, 1], got '", value, "'"));
    }
    spec.set_topk_ratio(ratio);
  }
  return spec;
}

// What a progress line reports, without the rates that change with every
// status: the state, the position and who is waited for.
std::string ProgressKey(const v1::JobStatus& s) {
  return absl::StrCat(s.state(), "/", s.epoch(), "/", s.step(), "/", s.reason(), "/",
                      absl::StrJoin(s.stragglers(), ","));
}

}  // namespace

absl::Status ApplyOverrides(const SubmitOverrides& o, v1::JobSpec& job) {
  auto check = [](const char* flag, const std::optional<int>& value, int min_value) {
    if (!value || *value >= min_value) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " must be an integer >= ", min_value, ", got '", *value, "'"));
  };
  PSTRAIN_RETURN_IF_ERROR(check("--workers", o.workers, 1));
  PSTRAIN_RETURN_IF_ERROR(check("--staleness", o.staleness, 0));
  PSTRAIN_RETURN_IF_ERROR(check("--averaging-frequency", o.averaging_frequency, 1));
  PSTRAIN_RETURN_IF_ERROR(check("--epochs", o.epochs, 1));
  if (!o.mode.empty()) {
    static const auto* kModes =
        new std::map<std::string, v1::ConsistencyMode>{{"sync", v1::CONSISTENCY_SYNC},
                                                       {"async", v1::CONSISTENCY_ASYNC},
                                                       {"ssp", v1::CONSISTENCY_SSP},
                                                       {"average", v1::CONSISTENCY_AVERAGE}};
    auto it = kModes->find(o.mode);
    if (it == kModes->end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--mode must be sync, async, ssp or average, got '", o.mode, "'"));
    }
    job.set_mode(it->second);
  }
  if (!o.precision.empty()) {
    static const auto* kPrecisions = new std::map<std::string, v1::Precision>{
        {"fp32", v1::PRECISION_FP32}, {"bf16", v1::PRECISION_BF16}, {"fp16", v1::PRECISION_FP16}};
    auto it = kPrecisions->find(o.precision);
    if (it == kPrecisions->end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--precision must be fp32, bf16 or fp16, got '", o.precision, "'"));
    }
    job.set_precision(it->second);
  }
  if (!o.compression.empty()) {
    PSTRAIN_ASSIGN_OR_RETURN(*job.mutable_compression(), ParseCompression(o.compression));
  }
  if (!o.pull_compression.empty()) {
    PSTRAIN_ASSIGN_OR_RETURN(*job.mutable_pull_compression(),
                             ParseCompression(o.pull_compression, "--pull-compression"));
  }
  if (o.min_compress_bytes) {
    if (*o.min_compress_bytes < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--min-compress-bytes must be an integer >= 0, got '", *o.min_compress_bytes, "'"));
    }
    // For the push codec, and for the pull codec too when it is top-k or
    // 1-bit (the only ones that send small parameters whole).
    auto sparse = [](const v1::CompressionSpec& spec) {
      return spec.method() == v1::CompressionSpec::COMPRESSION_TOPK ||
             spec.method() == v1::CompressionSpec::COMPRESSION_ONEBIT;
    };
    const bool pull = sparse(job.pull_compression());
    if (!pull || sparse(job.compression())) {
      job.mutable_compression()->set_min_compress_bytes(*o.min_compress_bytes);
    }
    if (pull) job.mutable_pull_compression()->set_min_compress_bytes(*o.min_compress_bytes);
  }
  if (o.workers) job.set_workers(*o.workers);
  if (o.staleness) job.set_staleness(*o.staleness);
  if (o.averaging_frequency) job.set_averaging_frequency(*o.averaging_frequency);
  if (o.epochs) job.set_epochs(*o.epochs);
  return absl::OkStatus();
}

// submit ------------------------------------------------------------------------

int Cli::Submit(const std::vector<std::string>& args) {
  static const Command kSubmit = {
      "submit",
      "usage: pstrain submit JOB.json [options]\n"
      "  Validates the job locally, submits it and prints its id. With --watch, follows\n"
      "  it like `pstrain watch` and exits 0 only if it SUCCEEDED. With --json the last\n"
      "  line is the job's JobStatus as JSON.\n"
      "  --compression sets how workers push gradients (sync, async, ssp): fp16 or\n"
      "  bf16 halves the bytes; topk sends the largest RATIO of each chunk (default\n"
      "  0.01) and onebit one sign bit per value, both with error feedback;\n"
      "  their parameters under 256 KiB go whole unless --min-compress-bytes says\n"
      "  otherwise (0 compresses every parameter).\n"
      "  --pull-compression (sync) sets how servers send each step's new model: the\n"
      "  change since the last step, with the same codecs; what a codec leaves out\n"
      "  goes with the next step.\n"
      "  --precision bf16 or fp16 trains in mixed precision on CUDA workers (fp32\n"
      "  master weights and optimizer); a CPU worker fails such a job.\n",
      {&absl::GetFlagReflectionHandle(FLAGS_workers), &absl::GetFlagReflectionHandle(FLAGS_mode),
       &absl::GetFlagReflectionHandle(FLAGS_staleness),
       &absl::GetFlagReflectionHandle(FLAGS_averaging_frequency),
       &absl::GetFlagReflectionHandle(FLAGS_epochs),
       &absl::GetFlagReflectionHandle(FLAGS_compression),
       &absl::GetFlagReflectionHandle(FLAGS_pull_compression),
       &absl::GetFlagReflectionHandle(FLAGS_min_compress_bytes),
       &absl::GetFlagReflectionHandle(FLAGS_precision), &absl::GetFlagReflectionHandle(FLAGS_watch),
       &absl::GetFlagReflectionHandle(FLAGS_json)}};
  SubmitOverrides overrides;
  bool watch = false, json = false;
  Parsed parsed = ParseCommand(kSubmit, args, [&] {
    overrides = {.workers = absl::GetFlag(FLAGS_workers),
                 .staleness = absl::GetFlag(FLAGS_staleness),
                 .averaging_frequency = absl::GetFlag(FLAGS_averaging_frequency),
                 .epochs = absl::GetFlag(FLAGS_epochs),
                 .mode = absl::GetFlag(FLAGS_mode),
                 .compression = absl::GetFlag(FLAGS_compression),
                 .pull_compression = absl::GetFlag(FLAGS_pull_compression),
                 .precision = absl::GetFlag(FLAGS_precision),
                 .min_compress_bytes = absl::GetFlag(FLAGS_min_compress_bytes)};
    watch = absl::GetFlag(FLAGS_watch);
    json = absl::GetFlag(FLAGS_json);
  });
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() != 1) return Usage(kSubmit, "expected exactly one job file");
  const std::string& file = parsed.positional[0];
  absl::StatusOr<v1::JobSpec> job = LoadJobSpec(file);
  if (!job.ok()) {
    err_ << "pstrain submit: error: " << job.status().message() << std::endl;
    return kExitUsage;
  }
  if (absl::Status s = ApplyOverrides(overrides, *job); !s.ok()) {
    return Usage(kSubmit, std::string(s.message()));
  }
  job->clear_model_file();  // LoadJobSpec inlined it.
  if (absl::Status valid = ValidateJobSpec(*job); !valid.ok()) {
    err_ << "pstrain submit: invalid job " << file << ": " << valid.message() << std::endl;
    return kExitUsage;
  }

  v1::SubmitJobRequest request;
  *request.mutable_spec() = *job;
  v1::SubmitJobResponse response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().SubmitJob(&ctx, request, &response);
  if (!rpc.ok()) return ReportRpcError("submit", rpc);
  if (!watch) {
    if (!json) {
      out_ << response.job_id() << std::endl;
      return kExitOk;
    }
    v1::JobStatus status;
    grpc::ClientContext get_ctx;
    Deadline(&get_ctx);
    v1::GetJobRequest get;
    get.set_job_id(response.job_id());
    if (!stub().GetJob(&get_ctx, get, &status).ok()) {
      status.set_job_id(response.job_id());
      status.set_state(v1::JOB_STATE_QUEUED);
    }
    return PrintJson("submit", status);
  }
  out_ << "submitted " << response.job_id() << std::endl;
  absl::StatusOr<v1::JobStatus> final_status = Follow(response.job_id(), false);
  if (!final_status.ok()) {
    err_ << "pstrain submit: lost the job: " << final_status.status().message() << std::endl;
    if (json) {
      v1::JobStatus unknown;
      unknown.set_job_id(response.job_id());
      PrintJson("submit", unknown);
    }
    return kExitFailed;
  }
  if (json && PrintJson("submit", *final_status) != kExitOk) return kExitFailed;
  return final_status->state() == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitFailed;
}

// status ------------------------------------------------------------------------

int Cli::Status(const std::vector<std::string>& args) {
  static const Command kStatus = {
      "status",
      "usage: pstrain status JOB [--json] [--report FILE.html]\n"
      "  Prints the job's state, reason, progress and (once it SUCCEEDED) test metrics;\n"
      "  with --json its JobStatus as JSON. --report also writes the job's HTML report\n"
      "  (see `pstrain report --help`).\n",
      {&absl::GetFlagReflectionHandle(FLAGS_json), &absl::GetFlagReflectionHandle(FLAGS_report)}};
  bool json = false;
  std::string report;
  Parsed parsed = ParseCommand(kStatus, args, [&] {
    json = absl::GetFlag(FLAGS_json);
    report = absl::GetFlag(FLAGS_report);
  });
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() != 1) return Usage(kStatus, "expected one job id");
  v1::GetJobRequest request;
  request.set_job_id(parsed.positional[0]);
  v1::JobStatus status;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().GetJob(&ctx, request, &status);
  if (!rpc.ok()) return ReportRpcError("status", rpc);
  if (!report.empty()) {
    if (const int rc = WriteReport("status", status, report); rc != kExitOk) return rc;
  }
  if (json) return PrintJson("status", status);
  if (IsTerminal(status.state())) {
    out_ << FormatFinalReport(status);
  } else {
    out_ << FormatProgressLine(status, 0) << "\n";
    if (!status.reason().empty()) out_ << "reason: " << status.reason() << "\n";
  }
  out_ << std::flush;
  return kExitOk;
}

// report ------------------------------------------------------------------------

int Cli::Report(const std::vector<std::string>& args) {
  static const Command kReport = {
      "report",
      "usage: pstrain report JOB -o FILE.html\n"
      "  Writes one self-contained HTML page (no script, nothing fetched): the job's\n"
      "  loss, accuracy and throughput over its steps, the confusion matrix as a heat\n"
      "  map with per-class precision, recall and F1 once it SUCCEEDED, its spec and\n"
      "  timing. Works for a running job too.\n",
      {&absl::GetFlagReflectionHandle(FLAGS_output)}};
  std::string path;
  Parsed parsed = ParseCommand(kReport, args, [&] { path = absl::GetFlag(FLAGS_output); });
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() != 1) return Usage(kReport, "expected one job id");
  if (path.empty()) return Usage(kReport, "-o FILE.html is required");
  v1::GetJobRequest request;
  request.set_job_id(parsed.positional[0]);
  v1::JobStatus status;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().GetJob(&ctx, request, &status);
  if (!rpc.ok()) return ReportRpcError("report", rpc);
  const int rc = WriteReport("report", status, path);
  if (rc == kExitOk) {
    out_ << status.job_id() << " " << JobStateName(status.state()) << ": report written to " << path
         << std::endl;
  }
  return rc;
}

int Cli::WriteReport(const std::string& what, const v1::JobStatus& status,
                     const std::string& path) {
  v1::GetJobRequest request;
  request.set_job_id(status.job_id());
  v1::JobHistory history;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().GetJobHistory(&ctx, request, &history);
  if (!rpc.ok()) return ReportRpcError(what, rpc);
  const std::string html = RenderJobReport(status, history, absl::Now());
  if (absl::Status s = data::WriteFileAtomically(path, html); !s.ok()) {
    err_ << "pstrain " << what << ": " << s.message() << std::endl;
    return kExitFailed;
  }
  return kExitOk;
}

// list --------------------------------------------------------------------------

// list --------------------------------------------------------------------------

int Cli::List(const std::vector<std::string>& args) {
  static const Command kList = {
      "list",
      "usage: pstrain list [--json]\n"
      "  Lists every job, newest first; with --json the ListJobsResponse as JSON.\n",
      {&absl::GetFlagReflectionHandle(FLAGS_json)}};
  bool json = false;
  Parsed parsed = ParseCommand(kList, args, [&] { json = absl::GetFlag(FLAGS_json); });
  if (parsed.exit_code) return *parsed.exit_code;
  if (!parsed.positional.empty()) return Usage(kList, "takes no arguments");
  v1::ListJobsResponse response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().ListJobs(&ctx, v1::ListJobsRequest(), &response);
  if (!rpc.ok()) return ReportRpcError("list", rpc);
  if (json) return PrintJson("list", response);
  out_ << absl::StrFormat("%-10s %-20s %-10s %7s %13s %8s %8s  %s\n", "JOB", "NAME", "STATE",
                          "EPOCH", "STEP", "LOSS", "TEST_ACC", "REASON");
  for (const v1::JobStatus& job : response.jobs()) {
    out_ << absl::StrFormat("%-10s %-20s %-10s %3d/%-3d %6d/%-6d %8.4f %8s  %s\n", job.job_id(),
                            job.name(), JobStateName(job.state()), job.epoch(), job.spec().epochs(),
                            job.step(), job.total_steps(), job.loss(),
                            job.state() == v1::JOB_STATE_SUCCEEDED
                                ? absl::StrFormat("%.4f", job.test().accuracy())
                                : "-",
                            job.reason());
  }
  out_ << std::flush;
  return kExitOk;
}

// watch -------------------------------------------------------------------------

absl::StatusOr<v1::JobStatus> Cli::Follow(const std::string& job_id, bool quiet) {
  v1::JobStatus last;
  bool have_last = false;
  absl::Time first_time;
  int64_t first_step = -1;
  absl::Time broken_since = absl::InfiniteFuture();
  absl::Duration backoff = absl::Milliseconds(200);
  std::string last_progress;
  bool drew_progress = false;
  auto finish_progress_line = [&] {
    if (drew_progress && env_.stdout_is_tty) out_ << "\n";
    drew_progress = false;
  };
  for (;;) {
    grpc::ClientContext ctx;
    // The stream lives as long as the job; a generous deadline, renewed at
    // every reconnection, so that no watch outlives a vanished server.
    ctx.set_deadline(DeadlineFromNow(absl::Hours(24)));
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    std::unique_ptr<grpc::ClientReader<v1::JobStatus>> reader = stub().WatchJob(&ctx, request);
    {
      IdleWatchdog watchdog(env_.watch_silence_warning, [this, &job_id] {
        err_ << (env_.stdout_is_tty ? "\n" : "") << "pstrain watch: no update about " << job_id
             << " from " << server_ << " for " << absl::FormatDuration(env_.watch_silence_warning)
             << " (still waiting)" << std::endl;
      });
      v1::JobStatus status;
      while (reader->Read(&status)) {
        watchdog.Kick();
        broken_since = absl::InfiniteFuture();
        backoff = absl::Milliseconds(200);
        const absl::Time now = absl::Now();
        if (first_step < 0 && status.state() == v1::JOB_STATE_RUNNING) {
          first_step = status.step();
          first_time = now;
        }
        double steps_per_sec = 0;
        if (first_step >= 0 && status.step() > first_step) {
          steps_per_sec = (status.step() - first_step) / absl::ToDoubleSeconds(now - first_time);
        }
        last = status;
        have_last = true;
        if (IsTerminal(status.state())) break;
        if (quiet) continue;
        const std::string line = FormatProgressLine(status, steps_per_sec);
        if (env_.stdout_is_tty) {
          out_ << "\r" << line << "\033[K" << std::flush;
          drew_progress = true;
          continue;
        }
        // A log (not a terminal) gets one line per update: each worker's
        // report of the same step arrives as its own status, with a new rate
        // and ETA but the same progress.
        const std::string progress = ProgressKey(status);
        if (progress != last_progress) out_ << line << std::endl;
        last_progress = progress;
      }
    }
    if (have_last && IsTerminal(last.state())) {
      ctx.TryCancel();
      reader->Finish().IgnoreError();
      finish_progress_line();
      if (!quiet) out_ << FormatFinalReport(last) << std::flush;
      return last;
    }
    grpc::Status end = reader->Finish();
    finish_progress_line();
    if (end.error_code() == grpc::StatusCode::NOT_FOUND ||
        end.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
        end.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
        end.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      return absl::Status(static_cast<absl::StatusCode>(end.error_code()), end.error_message());
    }
    // The stream ended early (server restart, network): reconnect.
    const absl::Time now = absl::Now();
    if (broken_since == absl::InfiniteFuture()) {
      broken_since = now;
      err_ << "pstrain watch: connection to " << server_ << " lost ("
           << (end.ok() ? std::string("stream ended") : end.error_message()) << "); reconnecting"
           << std::endl;
    }
    if (now - broken_since > env_.watch_reconnect_limit) {
      return absl::UnavailableError(absl::StrCat("gave up reconnecting to ", server_, " after ",
                                                 absl::FormatDuration(env_.watch_reconnect_limit),
                                                 ": ", end.error_message()));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(5));
  }
}

int Cli::Watch(const std::vector<std::string>& args) {
  static const Command kWatch = {
      "watch",
      "usage: pstrain watch JOB\n"
      "  Follows the job until it ends: a live progress bar on a terminal (one line per\n"
      "  update otherwise), then the final metrics and confusion matrix. Exits 0 only if\n"
      "  the job SUCCEEDED.\n",
      {}};
  Parsed parsed = ParseCommand(kWatch, args, [] {});
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() != 1) return Usage(kWatch, "expected one job id");
  absl::StatusOr<v1::JobStatus> status = Follow(parsed.positional[0], false);
  if (!status.ok()) {
    err_ << "pstrain watch: error: " << status.status().message() << std::endl;
    return kExitFailed;
  }
  return status->state() == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitFailed;
}

// cancel ------------------------------------------------------------------------

int Cli::Cancel(const std::vector<std::string>& args) {
  static const Command kCancel = {
      "cancel",
      "usage: pstrain cancel JOB\n"
      "  Cancels a queued or running job (a finished job is left as it is) and prints\n"
      "  its state.\n",
      {}};
  Parsed parsed = ParseCommand(kCancel, args, [] {});
  if (parsed.exit_code) return *parsed.exit_code;
  if (parsed.positional.size() != 1) return Usage(kCancel, "expected one job id");
  v1::CancelJobRequest request;
  request.set_job_id(parsed.positional[0]);
  v1::CancelJobResponse response;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  grpc::Status rpc = stub().CancelJob(&ctx, request, &response);
  if (!rpc.ok()) return ReportRpcError("cancel", rpc);
  out_ << response.status().job_id() << " " << JobStateName(response.status().state());
  if (!response.status().reason().empty()) out_ << ": " << response.status().reason();
  out_ << std::endl;
  return kExitOk;
}

}  // namespace cli_internal

// The status texts of client/cli.h ---------------------------------------------------

using cli_internal::FormatDuration;

std::string FormatProgressLine(const v1::JobStatus& s, double steps_per_sec) {
  std::string line = absl::StrCat(s.job_id(), " ", JobStateName(s.state()));
  if (s.state() == v1::JOB_STATE_QUEUED) {
    if (!s.reason().empty()) absl::StrAppend(&line, ": ", s.reason());
    return line;
  }
  const int epochs = s.spec().epochs();
  absl::StrAppend(&line, absl::StrFormat("  epoch %d/%d", std::min(s.epoch() + 1, epochs), epochs));
  if (s.total_steps() > 0) {
    constexpr int kWidth = 20;
    const double fraction =
        std::clamp(static_cast<double>(s.step()) / static_cast<double>(s.total_steps()), 0.0, 1.0);
    const int filled = static_cast<int>(fraction * kWidth);
    absl::StrAppend(&line,
                    absl::StrFormat("  step %d/%d [%s%s] %3d%%", s.step(), s.total_steps(),
                                    std::string(filled, '#'), std::string(kWidth - filled, '-'),
                                    static_cast<int>(fraction * 100)));
  } else {
    absl::StrAppend(&line, absl::StrFormat("  step %d", s.step()));
  }
  absl::StrAppend(&line, absl::StrFormat("  loss %.4f  acc %.4f  %.0f samples/s", s.loss(),
                                         s.train_accuracy(), s.samples_per_sec()));
  if (steps_per_sec > 0 && s.total_steps() > s.step()) {
    absl::StrAppend(&line, "  ETA ", FormatDuration((s.total_steps() - s.step()) / steps_per_sec));
  }
  if (s.stragglers_size() > 0) {
    absl::StrAppend(&line, "  waiting for ", absl::StrJoin(s.stragglers(), ", "));
  }
  return line;
}

std::string FormatFinalReport(const v1::JobStatus& s) {
  std::string report = absl::StrCat(s.job_id(), " ", JobStateName(s.state()));
  if (!s.reason().empty()) absl::StrAppend(&report, ": ", s.reason());
  absl::StrAppend(&report, absl::StrFormat("\n  epochs %d, steps %d, final loss %.4f, train "
                                           "accuracy %.4f, workers lost %d\n",
                                           s.epoch(), s.step(), s.loss(), s.train_accuracy(),
                                           s.workers_lost()));
  if (s.epoch_samples_size() > 0) {
    std::vector<std::string> counts;
    for (const v1::EpochSamples& e : s.epoch_samples()) {
      counts.push_back(e.expected() > 0 ? absl::StrCat(e.samples(), "/", e.expected())
                                        : absl::StrCat(e.samples()));
    }
    absl::StrAppend(&report, "  samples trained per epoch: ", absl::StrJoin(counts, ", "), "\n");
  }
  if (s.runs() > 1) {
    absl::StrAppend(&report,
                    absl::StrFormat("  resumed %d time%s from a checkpoint, %d steps "
                                    "trained again\n",
                                    s.runs() - 1, s.runs() == 2 ? "" : "s", s.steps_lost()));
  }
  if (s.state() == v1::JOB_STATE_SUCCEEDED && s.has_test()) {
    const v1::EvalMetrics& t = s.test();
    absl::StrAppend(
        &report,
        absl::StrFormat("test: accuracy %.4f  loss %.4f  precision %.4f  recall "
                        "%.4f  f1 %.4f  (%d samples)\n",
                        t.accuracy(), t.loss(), t.precision(), t.recall(), t.f1(), t.samples()),
        FormatConfusionMatrix(MetricsFromProto(t)));
  }
  return report;
}

}  // namespace pstrain
