// pstrain-worker: trains a job on this machine.
//
//   pstrain-worker --standalone examples/fashion-mnist.json --device cpu
//   pstrain-worker --evaluate model.ckpt --data /usr/share/datasets/fashion-mnist
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "worker/standalone.h"

ABSL_FLAG(std::string, standalone, "", "Train the job in this JSON file on this machine, no server");
ABSL_FLAG(std::string, evaluate, "", "Evaluate this checkpoint on the test split and exit");
ABSL_FLAG(std::string, data, "", "With --evaluate: dataset directory (default: the checkpoint's)");
ABSL_FLAG(std::string, device, "auto", "auto | cpu | cuda | cuda:N");
ABSL_FLAG(int, epochs, 0, "Override the job's epochs (0 = keep)");
ABSL_FLAG(int, batch, 0, "Override the job's batch size (0 = keep)");
ABSL_FLAG(int64_t, limit, 0, "Train on only the first N samples (0 = all)");
ABSL_FLAG(std::string, checkpoint, "",
          "Where to save the final checkpoint (default: <job name>.ckpt; 'none' to skip)");

namespace {

int Fail(const absl::Status& status) {
  std::cerr << "pstrain-worker: error: " << status.message() << std::endl;
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trains pstrain jobs.\n"
      "  pstrain-worker --standalone JOB.json [--epochs N] [--batch B] [--limit SAMPLES] "
      "[--device auto|cpu|cuda[:N]] [--checkpoint FILE]\n"
      "  pstrain-worker --evaluate CKPT [--data DIR] [--device D]");
  absl::ParseCommandLine(argc, argv);

  if (!absl::GetFlag(FLAGS_evaluate).empty()) {
    std::string device;
    auto metrics = pstrain::EvaluateCheckpoint(absl::GetFlag(FLAGS_evaluate),
                                               absl::GetFlag(FLAGS_data),
                                               absl::GetFlag(FLAGS_device), &device);
    if (!metrics.ok()) return Fail(metrics.status());
    std::cout << pstrain::FormatConfusionMatrix(*metrics);
    std::cout << absl::StrFormat(
                     "{\"test_accuracy\": %.6f, \"test_loss\": %.6f, \"precision\": %.6f, "
                     "\"recall\": %.6f, \"f1\": %.6f, \"test_samples\": %d, \"device\": \"%s\"}",
                     metrics->accuracy, metrics->loss, metrics->macro_precision,
                     metrics->macro_recall, metrics->macro_f1, metrics->samples, device)
              << std::endl;
    return 0;
  }

  const std::string job_path = absl::GetFlag(FLAGS_standalone);
  if (job_path.empty()) {
    std::cerr << "pstrain-worker: nothing to do: pass --standalone JOB.json or --evaluate CKPT "
                 "(see --help)"
              << std::endl;
    return 2;
  }
  auto job = pstrain::LoadJobSpec(job_path);
  if (!job.ok()) return Fail(job.status());

  pstrain::StandaloneOptions options;
  options.device = absl::GetFlag(FLAGS_device);
  options.epochs = absl::GetFlag(FLAGS_epochs);
  options.batch_size = absl::GetFlag(FLAGS_batch);
  options.limit = absl::GetFlag(FLAGS_limit);
  options.checkpoint_path = absl::GetFlag(FLAGS_checkpoint);
  if (options.checkpoint_path.empty()) {
    options.checkpoint_path = (job->name().empty() ? std::string("model") : job->name()) + ".ckpt";
  } else if (options.checkpoint_path == "none") {
    options.checkpoint_path.clear();
  }
  auto result = pstrain::RunStandalone(*job, options, std::cout);
  if (!result.ok()) return Fail(result.status());
  std::cout << pstrain::StandaloneResultJson(*result) << std::endl;
  return 0;
}
