// pstrain-worker: trains a job on this machine, or serves a coordinator.
//
//   pstrain-worker --standalone examples/fashion-mnist.json --device cpu
//   pstrain-worker --evaluate model.ckpt --data /usr/share/datasets/fashion-mnist
//   pstrain-worker --server 127.0.0.1:7070 --metrics-port 9101 --device cpu --threads 1
//   pstrain-worker --standalone job.json --device cuda --cudnn-transforms fft,winograd
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/daemon_util.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "common/metrics_http.h"
#include "common/rpc/channel.h"
#include "common/rpc/health.h"
#include "common/rpc/security_flags.h"
#include "common/status_macros.h"
#include "common/storage/s3_flags.h"
#include "kernels/backend_loader.h"
#include "kernels/cuda_backend_options.h"
#include "prometheus/registry.h"
#include "worker/daemon.h"
#include "worker/gpu_monitor.h"
#include "worker/ps_client.h"
#include "worker/standalone.h"

ABSL_DECLARE_FLAG(std::string, token_file);  // common/rpc/security_flags.cc

ABSL_FLAG(std::string, standalone, "",
          "Train the job in this JSON file on this machine, no server");
ABSL_FLAG(std::string, evaluate, "", "Evaluate this checkpoint on the test split and exit");
ABSL_FLAG(std::string, data, "", "With --evaluate: dataset directory (default: the checkpoint's)");
ABSL_FLAG(std::string, device, "auto",
          "auto | cpu | cuda | cuda:N. auto trains on CUDA device 0 when the CUDA module "
          "(libpstrain_cuda.so beside this binary in ../lib/pstrain/, or --cuda-module) "
          "loads and a GPU is visible, else on the CPU; cuda fails with the reason when either "
          "is missing (--version shows what was found)");
ABSL_FLAG(std::string, cuda_module, "",
          "Load the CUDA module from this file instead of looking beside the binary "
          "(\"\" = look there). Not given: $PSTRAIN_CUDA_MODULE");

// The CUDA backend's settings (kernels/cuda_backend_options.h). Each one not
// given on the command line takes its environment variable's value, if set
// (SeedCudaFlagsFromEnvironment), else the default shown.
ABSL_FLAG(std::string, cudnn_transforms, "fft",
          "CUDA fp32 convolutions: the cuDNN algorithms on transformed tiles that may compete: "
          "none | fft | winograd | fft,winograd. FFT ones agree with the CPU backend to 1e-4; "
          "Winograd ones put results about 5e-3 away (PyTorch's choice: resnet-small 1.09x "
          "faster on an H200). Not given: $PSTRAIN_CUDNN_TRANSFORMS");
ABSL_FLAG(std::string, cudnn_fp32_route, "measured",
          "CUDA bf16/fp16 convolutions: run a pass in fp32 between conversions where that "
          "measures faster (measured), never, or always (its parity tests). Not given: "
          "$PSTRAIN_CUDNN_FP32_ROUTE (0 = never, always)");
ABSL_FLAG(std::string, cuda_own_conv, "measured",
          "CUDA bf16/fp16 channels-last convolutions with channels and filters multiples of 16: "
          "run a pass with pstrain's own kernels where that measures fastest (measured), never, "
          "or wherever they apply (always, their parity tests). Not given: "
          "$PSTRAIN_CUDA_OWN_CONV (0 = never, always)");
ABSL_FLAG(bool, cudnn_log_routes, false,
          "CUDA bf16/fp16: print each convolution plan's per-pass times and chosen route to "
          "stderr. Not given: $PSTRAIN_CUDNN_LOG_ROUTES (1 = on)");
ABSL_FLAG(bool, cudnn_batch_norm, false,
          "CUDA: cuDNN's batch norm instead of pstrain's kernels (NCHW only), for comparison. "
          "Not given: $PSTRAIN_CUDNN_BATCHNORM (1 = on)");
ABSL_FLAG(bool, cudnn_concurrent_backward, true,
          "CUDA: run a convolution's backward-filter pass on a side stream while its "
          "backward-data pass runs (same results). Not given: "
          "$PSTRAIN_CUDNN_CONCURRENT_BACKWARD (0 = off)");
ABSL_FLAG(bool, cuda_channels_last, true,
          "CUDA bf16/fp16: activations channels last (NHWC), as cuDNN's tensor-core "
          "convolutions want them; false keeps NCHW. Not given: $PSTRAIN_CUDNN_NHWC (0 = off)");
ABSL_FLAG(int, epochs, 0, "Override the job's epochs (0 = keep)");
ABSL_FLAG(int, batch, 0, "Override the job's batch size (0 = keep)");
ABSL_FLAG(std::string, precision, "",
          "Override the job's precision: fp32, bf16 or fp16 (mixed precision, CUDA only)");
ABSL_FLAG(int64_t, limit, 0,
          "Train (--standalone) or evaluate (--evaluate) only the first N samples (0 = all)");
ABSL_FLAG(std::string, logits_out, "",
          "With --evaluate: write the logits of the evaluated test samples, in order, to this "
          "float32 .npy file [N, classes]");
ABSL_FLAG(std::string, inputs_out, "",
          "With --evaluate: write the model inputs (preprocessed) of the evaluated test samples "
          "to this float32 .npy file [N, C, H, W]");
ABSL_FLAG(std::string, checkpoint, "",
          "Where to save the final checkpoint (default: <job name>.ckpt; 'none' to skip)");
ABSL_FLAG(std::string, tensorboard_dir, "",
          "Write TensorBoard scalars (loss, accuracy, samples/s) under this directory; "
          "daemon mode: DIR/<job id>/worker-<rank> (\"\" = none)");
ABSL_FLAG(std::string, server, "",
          "Daemon mode: the coordinator (pstrain-server 0) at HOST:PORT; register, take "
          "assignments and train them until SIGINT/SIGTERM");
ABSL_FLAG(std::string, job, "",
          "Daemon mode: bound to this job (one submitted with bound_workers): train it "
          "only, and exit once it has ended");
ABSL_FLAG(int, metrics_port, 0,
          "Serve Prometheus /metrics on METRICS_HOST:PORT while the daemon (or a --standalone "
          "run: the per-GPU gauges) runs (0 = off)");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "Address /metrics binds to");
ABSL_FLAG(int, health_port, 0,
          "Daemon mode: serve gRPC health (grpc.health.v1.Health, only, in plaintext) on "
          "HEALTH_HOST:PORT (0 = off). Service \"\" is SERVING while the process runs; "
          "\"pstrain-worker\" is SERVING while the coordinator is reachable (readiness)");
ABSL_FLAG(std::string, health_host, "127.0.0.1", "Daemon mode: address the health service binds to");
ABSL_FLAG(std::vector<std::string>, data_root, {},
          "Daemon mode: directories jobs may read datasets from, comma-separated; may be given "
          "more than once. A job whose dataset resolves elsewhere fails before any file is read. "
          "Default: /usr/share/datasets when it exists. --data-root=/ allows every path");
ABSL_FLAG(std::vector<std::string>, command_root, {},
          "Daemon mode: directories whose programs a submitted job's command may run "
          "(JobSpec.command), comma-separated; may be given more than once. A command whose "
          "program is not an executable file under one of them is refused and its job fails "
          "(docs/SECURITY.md). Default: none, and this worker runs no commands");
ABSL_FLAG(double, command_stop_grace_s, 10,
          "Daemon mode: seconds a job's command has to exit after its job ended before its "
          "process group gets SIGTERM, and again before SIGKILL");
ABSL_FLAG(int, threads, 0,
          "CPU backend: OpenMP threads for compute (0 = all cores); leave a core to the "
          "network and data threads on small machines");

ABSL_FLAG(int, connections_per_shard, 1,
          "Daemon mode: TCP connections to each parameter-server shard for pushes, and as "
          "many for pulls (1-16); a push or pull spreads its chunks over them. With TLS, "
          "each connection seals and opens on one core at a time: raise it where the link "
          "is faster than one core's TLS (about 0.5-1 GB/s)");

ABSL_FLAG(int, bench_only_fixed_compute_ms, 0,
          "BENCH ONLY, daemon mode: every training step after the first sleeps this many "
          "milliseconds instead of running forward/backward and pushes the first step's "
          "gradients again, so that a benchmark on a small machine measures the network "
          "(bench/cluster_emulation.sh). Jobs trained so do not learn. 0 = off. No job spec "
          "can set it");

namespace {

// The worker's readiness service name in grpc.health.v1.Health.
constexpr char kWorkerHealthService[] = "pstrain-worker";

// A log line of the worker's own (S3 settings, S3 retries), on stderr.
void WorkerLog(const std::string& line) { std::cerr << "pstrain-worker: " << line << std::endl; }

int Fail(const absl::Status& status) {
  std::cerr << "pstrain-worker: error: " << status.message() << std::endl;
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

// Every value of a list flag given more than once (absl keeps only the last
// of a repeated flag), by its name with dashes: nullopt when never given.
std::map<std::string, std::vector<std::string>> g_repeated;
void CollectRepeated(int argc, char** argv, const std::string& name) {
  std::string underscored = name;
  std::replace(underscored.begin(), underscored.end(), '-', '_');
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    std::string value;
    bool found = false;
    for (const std::string& n : {name, underscored}) {
      if (absl::StartsWith(arg, absl::StrCat("--", n, "="))) {
        value = arg.substr(n.size() + 3);
        found = true;
      } else if (arg == absl::StrCat("--", n) && i + 1 < argc) {
        value = argv[++i];
        found = true;
      }
      if (found) break;
    }
    if (!found) continue;
    std::vector<std::string>& values = g_repeated[name];
    for (absl::string_view v : absl::StrSplit(value, ',', absl::SkipEmpty())) values.emplace_back(v);
  }
}
std::vector<std::string> DataRoots() {
  if (auto it = g_repeated.find("data-root"); it != g_repeated.end()) return it->second;
  std::error_code error;
  if (std::filesystem::is_directory("/usr/share/datasets", error)) return {"/usr/share/datasets"};
  return {};
}

const char* Environment(const char* name) { return std::getenv(name); }

// The documented environment fallbacks of the CUDA flags become their values
// before the command line is parsed, so that a flag given there wins over
// its variable, and the variable over the default (--help shows both).
void SeedCudaFlagsFromEnvironment() {
  if (const char* module = Environment(pstrain::kCudaModuleEnvVar); module != nullptr) {
    absl::SetFlag(&FLAGS_cuda_module, std::string(module));
  }
  const pstrain::CudaBackendOptions env = pstrain::CudaBackendOptionsFromEnvironment(&Environment);
  absl::SetFlag(&FLAGS_cudnn_transforms, pstrain::CudnnTransformsName(env));
  absl::SetFlag(&FLAGS_cudnn_fp32_route, std::string(pstrain::CudaRoutePolicyName(env.fp32_route)));
  absl::SetFlag(&FLAGS_cuda_own_conv, std::string(pstrain::CudaRoutePolicyName(env.own_conv)));
  absl::SetFlag(&FLAGS_cudnn_log_routes, env.log_conv_routes);
  absl::SetFlag(&FLAGS_cudnn_batch_norm, env.cudnn_batch_norm);
  absl::SetFlag(&FLAGS_cudnn_concurrent_backward, env.concurrent_conv_backward);
  absl::SetFlag(&FLAGS_cuda_channels_last, env.channels_last);
}

// The CUDA module's path and the CUDA backend's options, from the flags.
absl::StatusOr<pstrain::CudaModuleOptions> CudaModuleOptionsFromFlags() {
  pstrain::CudaModuleOptions options;
  options.path = absl::GetFlag(FLAGS_cuda_module);
  pstrain::CudaBackendOptions& cuda = options.backend;
  PSTRAIN_RETURN_IF_ERROR(
      pstrain::ParseCudnnTransforms(absl::GetFlag(FLAGS_cudnn_transforms), &cuda));
  PSTRAIN_ASSIGN_OR_RETURN(
      cuda.fp32_route,
      pstrain::ParseCudaRoutePolicy(absl::GetFlag(FLAGS_cudnn_fp32_route), "--cudnn-fp32-route"));
  PSTRAIN_ASSIGN_OR_RETURN(
      cuda.own_conv,
      pstrain::ParseCudaRoutePolicy(absl::GetFlag(FLAGS_cuda_own_conv), "--cuda-own-conv"));
  cuda.log_conv_routes = absl::GetFlag(FLAGS_cudnn_log_routes);
  cuda.cudnn_batch_norm = absl::GetFlag(FLAGS_cudnn_batch_norm);
  cuda.concurrent_conv_backward = absl::GetFlag(FLAGS_cudnn_concurrent_backward);
  cuda.channels_last = absl::GetFlag(FLAGS_cuda_channels_last);
  return options;
}

// Gives the process's CUDA module look-up its options; before anything asks
// for a backend or a device count.
absl::Status ConfigureCudaFromFlags() {
  PSTRAIN_ASSIGN_OR_RETURN(pstrain::CudaModuleOptions options, CudaModuleOptionsFromFlags());
  return pstrain::ConfigureCudaModule(std::move(options));
}

bool DaemonMode(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--server") == 0 || std::strncmp(argv[i], "--server=", 9) == 0) {
      return true;
    }
  }
  return false;
}

// /metrics of this process (--metrics-port), with the per-GPU gauges.
struct WorkerMetrics {
  std::shared_ptr<prometheus::Registry> registry;  // Outlives the two below.
  std::unique_ptr<pstrain::GpuMetricsExporter> gpu;
  std::unique_ptr<pstrain::MetricsHttpServer> server;
  std::string address;  // HOST:PORT it listens on.
};

// Serves `registry` on --metrics-host:--metrics-port: HTTPS with --tls-cert
// (and scrapers' certificates checked against --tls-ca with
// --require-client-cert), plain HTTP only on loopback (or --insecure). Per-GPU gauges through NVML,
// loaded at run time: without a driver they say "no GPU"
// (pstrain_worker_gpus 0, pstrain_worker_gpu_available 0).
absl::Status StartWorkerMetrics(const pstrain::DaemonSecurity& security,
                                const std::shared_ptr<prometheus::Registry>& registry,
                                WorkerMetrics* metrics) {
  metrics->registry = registry;
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  metrics->gpu = std::make_unique<pstrain::GpuMetricsExporter>(pstrain::GpuMonitor::Open(),
                                                               registry.get(), absl::Seconds(1));
  if (!metrics->gpu->monitor().available()) {
    std::cerr << "pstrain-worker: no GPU metrics: " << metrics->gpu->monitor().unavailable_reason()
              << std::endl;
  }
  const std::string metrics_host = absl::GetFlag(FLAGS_metrics_host);
  std::optional<pstrain::MetricsTls> tls;
  if (!security.tls.cert_file.empty()) {
    // --require-client-cert: scrapers need a certificate of the cluster CA.
    tls = pstrain::MetricsTls{
        security.tls.cert_file, security.tls.key_file,
        security.tls.require_client_cert ? security.tls.ca_file : std::string()};
  } else {
    std::string warning;
    PSTRAIN_RETURN_IF_ERROR(pstrain::CheckListenPolicy(
        "--metrics-host", metrics_host + ":" + std::to_string(metrics_port),
        /*tls_enabled=*/false, /*tokens_enabled=*/true, security.insecure, &warning));
    if (!warning.empty()) std::cerr << warning << std::endl;
  }
  PSTRAIN_ASSIGN_OR_RETURN(
      metrics->server,
      pstrain::MetricsHttpServer::Start(
          metrics_host, metrics_port, pstrain::PrometheusTextOf(registry), tls ? &*tls : nullptr));
  metrics->address = metrics_host + ":" + std::to_string(metrics->server->port());
  std::cout << "metrics on " << (tls ? "https://" : "http://") << metrics->address << "/metrics"
            << std::endl;
  return absl::OkStatus();
}

int RunDaemon() {
  pstrain::TuneAllocatorForLargeMessages();
  // SIGINT and SIGTERM are taken by a thread that shuts the daemon down;
  // blocked before any other thread starts, so that every thread inherits it.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  absl::StatusOr<pstrain::DaemonSecurity> security = pstrain::DaemonSecurityFromFlags(false);
  if (!security.ok()) return Fail(security.status());
  pstrain::WorkerDaemon::Options options;
  options.coordinator_address = absl::GetFlag(FLAGS_server);
  options.channel = security->channel;
  options.identity = security->identity;
  options.data_roots = DataRoots();
  absl::StatusOr<pstrain::storage::StorageOptions> storage =
      pstrain::storage::StorageOptionsFromFlags(WorkerLog);
  if (!storage.ok()) return Fail(storage.status());
  options.storage = *std::move(storage);
  if (auto it = g_repeated.find("command-root"); it != g_repeated.end()) {
    options.command_roots = it->second;
  }
  if (!(absl::GetFlag(FLAGS_command_stop_grace_s) >= 0 &&
        absl::GetFlag(FLAGS_command_stop_grace_s) <= 3600)) {
    return Fail(absl::InvalidArgumentError("--command-stop-grace-s must be in [0, 3600]"));
  }
  options.command_stop_grace = absl::Seconds(absl::GetFlag(FLAGS_command_stop_grace_s));
  options.launcher_credentials = {.tls_ca = security->tls.ca_file,
                                  .tls_cert = security->tls.cert_file,
                                  .tls_key = security->tls.key_file,
                                  .tls_server_name = security->tls.server_name,
                                  .token_file = absl::GetFlag(FLAGS_token_file)};
  if (security->channel.credentials == nullptr &&
      !pstrain::IsLoopbackAddress(options.coordinator_address)) {
    std::cerr << "pstrain-worker: WARNING: calls to " << options.coordinator_address
              << " go without TLS (no --tls-ca): the network sees the model and the tokens"
              << std::endl;
  }
  options.device = absl::GetFlag(FLAGS_device);
  options.num_threads = absl::GetFlag(FLAGS_threads);
  options.job_id = absl::GetFlag(FLAGS_job);
  options.tensorboard_dir = absl::GetFlag(FLAGS_tensorboard_dir);
  options.connections_per_shard = absl::GetFlag(FLAGS_connections_per_shard);
  if (options.connections_per_shard < 1 ||
      options.connections_per_shard > pstrain::PsClient::kMaxConnectionsPerShard) {
    return Fail(absl::InvalidArgumentError(absl::StrCat("--connections-per-shard must be 1 to ",
                                                        pstrain::PsClient::kMaxConnectionsPerShard,
                                                        ", got ", options.connections_per_shard)));
  }
  if (const int fixed_ms = absl::GetFlag(FLAGS_bench_only_fixed_compute_ms); fixed_ms != 0) {
    if (fixed_ms < 0) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat("--bench_only_fixed_compute_ms must be >= 0, got ", fixed_ms)));
    }
    options.bench_only_fixed_compute = absl::Milliseconds(fixed_ms);
    std::cerr << "pstrain-worker: BENCH ONLY: bench_only_fixed_compute_ms=" << fixed_ms
              << ": forward/backward replaced by a fixed " << fixed_ms
              << " ms per step; jobs run by this worker do not learn" << std::endl;
  }
  WorkerMetrics metrics;
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    options.registry = std::make_shared<prometheus::Registry>();
    absl::Status started = StartWorkerMetrics(*security, options.registry, &metrics);
    if (!started.ok()) return Fail(started);
    options.metrics_address = metrics.address;
  }
  pstrain::HealthServer health;
  if (const int health_port = absl::GetFlag(FLAGS_health_port); health_port > 0) {
    auto started = pstrain::StartHealthServer(absl::GetFlag(FLAGS_health_host) + ":" +
                                              std::to_string(health_port));
    if (!started.ok()) return Fail(started.status());
    health = *std::move(started);
    pstrain::SetServing(health.server.get(), {kWorkerHealthService}, false);
    options.on_coordinator_state = [server = health.server.get()](bool connected) {
      pstrain::SetServing(server, {kWorkerHealthService}, connected);
    };
    std::cout << "health on " << absl::GetFlag(FLAGS_health_host) << ":" << health.port
              << " (grpc.health.v1.Health)" << std::endl;
  }
  auto daemon = pstrain::WorkerDaemon::Create(options);
  if (!daemon.ok()) return Fail(daemon.status());
  std::thread signal_thread([&signals, d = daemon->get()] {
    int signal = 0;
    sigwait(&signals, &signal);
    if (signal != 0) d->Shutdown();
  });
  absl::Status status = (*daemon)->Run();
  // Wake the signal thread if Run() returned on its own.
  pthread_kill(signal_thread.native_handle(), SIGTERM);
  signal_thread.join();
  if (health.server != nullptr) {
    pstrain::SetServing(health.server.get(), {}, false);
    health.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  if (!status.ok()) return Fail(status);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (DaemonMode(argc, argv)) {
    pstrain::EnsurePassiveOpenMpWait(argv, std::getenv("OMP_WAIT_POLICY") != nullptr);
  }
  absl::SetProgramUsageMessage(
      "trains pstrain jobs.\n"
      "  pstrain-worker --standalone JOB.json [--epochs N] [--batch B] [--limit SAMPLES] "
      "[--device auto|cpu|cuda[:N]] [--precision fp32|bf16|fp16] [--checkpoint FILE] "
      "[--tensorboard-dir DIR] [--metrics-port "
      "P] [CUDA flags: --cuda-module, --cudnn-transforms, ...]\n"
      "  pstrain-worker --evaluate CKPT [--data DIR] [--device D] [--limit N] "
      "[--logits-out F.npy] [--inputs-out F.npy]\n"
      "  pstrain-worker --server HOST:PORT [--metrics-port P] [--health-port P] [--device D] "
      "[--threads N] [--tensorboard-dir DIR] [--data-root DIR]... [TLS and token flags]");
  // --version runs after every flag was parsed: it looks with --cuda-module.
  pstrain::InstallVersionFlag([] {
    const absl::Status configured = ConfigureCudaFromFlags();
    return (configured.ok() ? "" : std::string(configured.message()) + "\n") +
           pstrain::CudaModule().Summary() + "\n";
  });
  std::vector<std::string> storage;
  std::vector<char*> args = pstrain::NormalizeFlagSpelling(argc, argv, &storage);
  CollectRepeated(argc, args.data(), "data-root");
  CollectRepeated(argc, args.data(), "command-root");
  SeedCudaFlagsFromEnvironment();
  absl::ParseCommandLine(argc, args.data());
  if (absl::Status configured = ConfigureCudaFromFlags(); !configured.ok()) {
    return Fail(configured);
  }

  if (!absl::GetFlag(FLAGS_server).empty()) return RunDaemon();

  if (!absl::GetFlag(FLAGS_evaluate).empty()) {
    std::string device;
    auto metrics =
        pstrain::EvaluateCheckpoint(absl::GetFlag(FLAGS_evaluate), absl::GetFlag(FLAGS_data),
                                    absl::GetFlag(FLAGS_device), &device,
                                    {.limit = absl::GetFlag(FLAGS_limit),
                                     .logits_out = absl::GetFlag(FLAGS_logits_out),
                                     .inputs_out = absl::GetFlag(FLAGS_inputs_out)});
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
    std::cerr << "pstrain-worker: nothing to do: pass --standalone JOB.json, --evaluate CKPT "
                 "or --server HOST:PORT (see --help)"
              << std::endl;
    return 2;
  }
  auto job = pstrain::LoadJobSpec(job_path);
  if (!job.ok()) return Fail(job.status());

  if (const std::string precision = absl::GetFlag(FLAGS_precision); !precision.empty()) {
    if (precision == "fp32") {
      job->set_precision(pstrain::v1::PRECISION_FP32);
    } else if (precision == "bf16") {
      job->set_precision(pstrain::v1::PRECISION_BF16);
    } else if (precision == "fp16") {
      job->set_precision(pstrain::v1::PRECISION_FP16);
    } else {
      std::cerr << "pstrain-worker: --precision must be fp32, bf16 or fp16, got '" << precision
                << "'" << std::endl;
      return 2;
    }
  }

  pstrain::StandaloneOptions options;
  options.device = absl::GetFlag(FLAGS_device);
  options.epochs = absl::GetFlag(FLAGS_epochs);
  options.batch_size = absl::GetFlag(FLAGS_batch);
  options.limit = absl::GetFlag(FLAGS_limit);
  options.checkpoint_path = absl::GetFlag(FLAGS_checkpoint);
  options.tensorboard_dir = absl::GetFlag(FLAGS_tensorboard_dir);
  std::unique_ptr<pstrain::storage::Storage> store;
  if (absl::StartsWith(job->dataset().path(), "s3://")) {
    absl::StatusOr<pstrain::storage::StorageOptions> storage_options =
        pstrain::storage::StorageOptionsFromFlags(WorkerLog);
    if (!storage_options.ok()) return Fail(storage_options.status());
    absl::StatusOr<std::unique_ptr<pstrain::storage::Storage>> opened =
        pstrain::storage::OpenStorage(*storage_options);
    if (!opened.ok()) return Fail(opened.status());
    store = *std::move(opened);
    options.storage = store.get();
  }
  if (options.checkpoint_path.empty()) {
    options.checkpoint_path = (job->name().empty() ? std::string("model") : job->name()) + ".ckpt";
  } else if (options.checkpoint_path == "none") {
    options.checkpoint_path.clear();
  }
  // /metrics while it trains: the per-GPU gauges (utilization, memory, power).
  WorkerMetrics metrics;
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    absl::StatusOr<pstrain::DaemonSecurity> security = pstrain::DaemonSecurityFromFlags(false);
    if (!security.ok()) return Fail(security.status());
    absl::Status started =
        StartWorkerMetrics(*security, std::make_shared<prometheus::Registry>(), &metrics);
    if (!started.ok()) return Fail(started);
  }
  auto result = pstrain::RunStandalone(*job, options, std::cout);
  if (!result.ok()) return Fail(result.status());
  std::cout << pstrain::StandaloneResultJson(*result) << std::endl;
  return 0;
}
