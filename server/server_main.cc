// pstrain-server: a parameter-server shard; shard 0 is also the coordinator.
//
//   pstrain-server --listen 127.0.0.1:7070 --metrics-port 9100 --state-dir /var/lib/pstrain
//   # two shards:
//   pstrain-server --listen 127.0.0.1:7070 --shard-index 0 --shards 127.0.0.1:7070,127.0.0.1:7071
//   pstrain-server --listen 127.0.0.1:7071 --shard-index 1 --shards 127.0.0.1:7070,127.0.0.1:7071
//
// Prints "pstrain-server listening on ADDRESS" once serving; SIGINT or
// SIGTERM shut it down cleanly.
#include <grpcpp/grpcpp.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "common/daemon_util.h"
#include "common/metrics_http.h"
#include "common/rpc/channel.h"
#include "common/rpc/health.h"
#include "common/rpc/security_flags.h"
#include "common/rpc/wire.h"
#include "common/status_macros.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "server/server_metrics.h"
#include "server/shard_controller.h"
#include "server/state_epoch.h"
#include "common/storage/s3_flags.h"
#include "common/storage/storage.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "host:port to serve on (port 0 picks a free port). A non-loopback address needs TLS "
          "and --token-file, or --insecure");
ABSL_FLAG(int, metrics_port, 0, "Serve Prometheus /metrics on METRICS_HOST:PORT (0 = off)");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1",
          "Address /metrics binds to (0.0.0.0 in containers, for the Prometheus scraper). /metrics "
          "is HTTPS with --tls-cert (and wants a client certificate of --tls-ca with "
          "--require-client-cert); plain HTTP needs a loopback address or --insecure");
ABSL_FLAG(int, health_port, 0,
          "Also serve grpc.health.v1.Health (only) in plaintext on HEALTH_HOST:PORT, for probes "
          "that cannot speak TLS (Kubernetes' grpc probes); 0 = off");
ABSL_FLAG(std::string, health_host, "127.0.0.1", "Address --health-port binds to");
ABSL_FLAG(std::string, state_dir, "pstrain-state",
          "Directory for job statuses and checkpoints (created if missing)");
ABSL_FLAG(int, shard_index, 0, "This server's index in --shards; 0 is also the coordinator");
ABSL_FLAG(std::string, shards, "",
          "Every shard's host:port, comma-separated, in index order (default: just --listen)");
ABSL_FLAG(int, heartbeat_timeout_ms, 10000,
          "A worker silent this long is dropped from its job and its shard reassigned");
ABSL_FLAG(int, heartbeat_interval_ms, 1000, "How often workers are told to heartbeat");
ABSL_FLAG(int, shard_rpc_timeout_ms, 60000, "Deadline of the coordinator's calls to shards");
ABSL_FLAG(int, checkpoint_interval_s, 60,
          "Checkpoint every running job at least this often, besides after every epoch "
          "(0 = after epochs only): a crash of server 0 loses at most about this much training");
ABSL_FLAG(int, keep_checkpoints, 3, "Newest checkpoints kept per job");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Object-store prefix for checkpoints (s3://bucket/prefix; --s3-* flags and AWS_* "
          "variables say how to reach it): each committed by a manifest written last. "
          "Default: under --state-dir");
ABSL_FLAG(int, straggler_timeout_s, 60,
          "In sync mode, drop a member whose steps stay behind the others' this long, like a "
          "dead worker (0 = never); stragglers are listed in the job's status after 5 s");

// Limits: what one request or client can make this server hold
// (docs/ARCHITECTURE.md, "Limits"). Beyond a size limit a request is
// INVALID_ARGUMENT, beyond a count RESOURCE_EXHAUSTED; nothing changes.
ABSL_FLAG(int64_t, max_job_parameters, int64_t{1} << 28,
          "Most parameter values (fp32) a job's model may have");
ABSL_FLAG(int64_t, max_job_bytes, int64_t{2} << 30,
          "Most bytes of parameters plus server-side optimizer state a job may take");
ABSL_FLAG(int, max_name_bytes, 256, "Longest job and model name, in bytes");
ABSL_FLAG(int, max_id_bytes, 128, "Longest job or worker id accepted in a request, in bytes");
ABSL_FLAG(std::string, push_pacing_lead, "auto",
          "Sync jobs: a worker's push may run at most this many frames ahead of the slowest "
          "member's at this shard (credits on the push stream; 0 = no pacing). auto: each job "
          "tries 1 and 2 for 8 steps each of every 256 and keeps the one whose steps are "
          "shorter: 1 where the links are the bottleneck, 2 where the cores are");
ABSL_FLAG(int, max_queued_jobs, 1000, "Most jobs waiting in the queue; SubmitJob beyond it fails");
ABSL_FLAG(int, max_workers, 10000,
          "Most registered workers (after forgetting dead ones); RegisterWorker beyond it fails");
ABSL_FLAG(int, forget_dead_workers_after_s, 600,
          "A worker dead and idle this long is forgotten (it must register again)");
ABSL_FLAG(int, max_worker_info_bytes, 4096, "Largest WorkerInfo a worker may register with");
ABSL_FLAG(int, max_reason_bytes, 4096, "A worker's error message is cut to this many bytes");
ABSL_FLAG(int64_t, max_eval_samples, 100000000,
          "Most test samples a job's eval shards may claim together, when the job spec does not "
          "state the test set's size");
ABSL_FLAG(int, max_history_points, 2000,
          "Points of a job's loss and accuracy history kept (>= 2); past it every other point "
          "is dropped and the step gap doubles");
ABSL_FLAG(int, update_threads, 0,
          "Frames of one push stream (different chunks) decoded and applied at once, so that "
          "one worker's push spreads the update over the cores; 0 = the machine's cores");
ABSL_FLAG(int, max_waiting_pulls, 1024,
          "Most pulls waiting for a version at once (one thread each); one more fails");
ABSL_FLAG(int, max_coordinator_message_bytes, 64 << 20,
          "Largest Coordinator request (SubmitJob, RegisterWorker, ...)");
ABSL_FLAG(int, max_shard_control_message_bytes, 2047 << 20,
          "Largest ShardControl request (ConfigureJob carries a shard's share of a job's "
          "parameters and optimizer state). The server's gRPC receive limit is the larger of "
          "this and --max-coordinator-message-bytes; ParameterService frames keep their own "
          "bound of 4 MiB + 64 KiB");

namespace {

int Fail(const std::string& message) {
  std::cerr << "pstrain-server: error: " << message << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  pstrain::EnsurePassiveOpenMpWait(argv, std::getenv("OMP_WAIT_POLICY") != nullptr);
  pstrain::InstallVersionFlag();
  std::vector<std::string> arg_storage;
  std::vector<char*> args = pstrain::NormalizeFlagSpelling(argc, argv, &arg_storage);
  absl::SetProgramUsageMessage(
      "parameter-server shard; shard 0 is also the coordinator.\n"
      "  pstrain-server --listen 127.0.0.1:7070 [--metrics-port P] [--state-dir DIR]\n"
      "                 [--shard-index I --shards HOST:PORT,...]\n"
      "                 [--heartbeat-timeout-ms MS] [--heartbeat-interval-ms MS]\n"
      "                 [--max-job-parameters N] [--max-job-bytes B] [--max-queued-jobs N]\n"
      "                 [--max-workers N] [--max-waiting-pulls N] ... (limits: see --help)");
  absl::ParseCommandLine(argc, args.data());

  const std::string listen = absl::GetFlag(FLAGS_listen);
  const int shard_index = absl::GetFlag(FLAGS_shard_index);
  std::vector<std::string> shard_addresses;
  if (absl::GetFlag(FLAGS_shards).empty()) {
    shard_addresses.push_back(listen);
  } else {
    shard_addresses = absl::StrSplit(absl::GetFlag(FLAGS_shards), ',', absl::SkipWhitespace());
  }
  const bool shards_given = !absl::GetFlag(FLAGS_shards).empty();
  for (const std::string& a : shard_addresses) {
    if (shards_given && (a.rfind(':') == std::string::npos || absl::EndsWith(a, ":0"))) {
      return Fail(absl::StrCat("--shards entry '", a, "' needs an explicit host:port"));
    }
  }
  if (shard_index < 0 || shard_index >= static_cast<int>(shard_addresses.size())) {
    return Fail(absl::StrCat("--shard-index ", shard_index, " is outside the ",
                             shard_addresses.size(), " addresses of --shards"));
  }
  if (absl::GetFlag(FLAGS_heartbeat_timeout_ms) <= 0 ||
      absl::GetFlag(FLAGS_heartbeat_interval_ms) <= 0) {
    return Fail("--heartbeat-timeout-ms and --heartbeat-interval-ms must be > 0");
  }
  if (absl::GetFlag(FLAGS_checkpoint_interval_s) < 0 || absl::GetFlag(FLAGS_keep_checkpoints) < 1 ||
      absl::GetFlag(FLAGS_straggler_timeout_s) < 0) {
    return Fail(
        "--checkpoint-interval-s and --straggler-timeout-s must be >= 0, --keep-checkpoints >= 1");
  }
  pstrain::JobLimits job_limits;
  job_limits.max_parameters = absl::GetFlag(FLAGS_max_job_parameters);
  job_limits.max_parameter_bytes = absl::GetFlag(FLAGS_max_job_bytes);
  job_limits.max_name_bytes = absl::GetFlag(FLAGS_max_name_bytes);
  const int max_coordinator_message_bytes = absl::GetFlag(FLAGS_max_coordinator_message_bytes);
  const int max_shard_control_message_bytes = absl::GetFlag(FLAGS_max_shard_control_message_bytes);
  if (job_limits.max_parameters < 1 || job_limits.max_parameter_bytes < 4 ||
      job_limits.max_name_bytes < 1 || absl::GetFlag(FLAGS_max_id_bytes) < 16 ||
      absl::GetFlag(FLAGS_max_queued_jobs) < 1 || absl::GetFlag(FLAGS_max_workers) < 1 ||
      absl::GetFlag(FLAGS_forget_dead_workers_after_s) < 1 ||
      absl::GetFlag(FLAGS_max_worker_info_bytes) < 1 || absl::GetFlag(FLAGS_max_reason_bytes) < 1 ||
      absl::GetFlag(FLAGS_max_eval_samples) < 1 || absl::GetFlag(FLAGS_max_waiting_pulls) < 1 ||
      absl::GetFlag(FLAGS_max_history_points) < 2 || max_coordinator_message_bytes < (1 << 20) ||
      max_shard_control_message_bytes < (1 << 20)) {
    return Fail(
        "limits must be >= 1 (--max-id-bytes >= 16, --max-history-points >= 2, message sizes >= "
        "1 MiB); see --help");
  }

  absl::StatusOr<pstrain::DaemonSecurity> security_or =
      pstrain::DaemonSecurityFromFlags(/*server=*/true);
  if (!security_or.ok()) return Fail(std::string(security_or.status().message()));
  const pstrain::DaemonSecurity security = *std::move(security_or);
  if (absl::Status s = security.CheckListen("--listen", listen); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  if (shard_addresses.size() > 1 && security.tls.enabled() && security.tls.ca_file.empty()) {
    return Fail("several shards with TLS need --tls-ca: server 0 calls the others over TLS");
  }

  // SIGINT/SIGTERM are taken by sigwait below; block them before any thread
  // starts so that every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  pstrain::TuneAllocatorForLargeMessages();

  pstrain::ParameterShard::Options shard_options;
  shard_options.shard_index = shard_index;
  shard_options.job_limits = job_limits;
  shard_options.max_id_bytes = absl::GetFlag(FLAGS_max_id_bytes);
  if (const std::string lead = absl::GetFlag(FLAGS_push_pacing_lead); lead == "auto") {
    shard_options.pace_lead_frames = pstrain::ParameterShard::kAutoPaceLead;
  } else if (!absl::SimpleAtoi(lead, &shard_options.pace_lead_frames) ||
             shard_options.pace_lead_frames < 0) {
    return Fail("--push-pacing-lead must be auto or a whole number >= 0, got '" + lead + "'");
  }
  shard_options.log = [](const std::string& line) {
    std::cerr << "pstrain-server: " << line << std::endl;
  };
  pstrain::ParameterShard shard(shard_options);
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  std::unique_ptr<pstrain::ServerMetrics> metrics;
  pstrain::ShardServices::Options service_options;
  service_options.max_waiting_pulls = absl::GetFlag(FLAGS_max_waiting_pulls);
  const int update_threads = absl::GetFlag(FLAGS_update_threads);
  if (update_threads < 0 || update_threads > 1024) {
    return Fail(absl::StrCat("--update-threads must be in [0, 1024], got ", update_threads));
  }
  service_options.max_parallel_frames =
      update_threads > 0 ? update_threads
                         : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  service_options.max_control_message_bytes = max_shard_control_message_bytes;
  service_options.authorizer = security.authorizer;
  // One receive limit for the whole server: the largest service's. Each
  // service checks its own; ParameterService frames are bounded per frame.
  service_options.max_receive_message_bytes =
      std::max({max_coordinator_message_bytes, max_shard_control_message_bytes,
                static_cast<int>(pstrain::kMaxFrameBytes)});
  if (metrics_port > 0) {
    metrics = std::make_unique<pstrain::ServerMetrics>();
    service_options.on_push_frame = metrics->PushObserver();
    service_options.on_pull_call = metrics->PullObserver();
  }
  pstrain::ShardServices shard_services(&shard, service_options);

  // Server 0: the coordinator and its control path to every shard.
  std::unique_ptr<pstrain::storage::Storage> checkpoint_store;
  const std::string checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  if (shard_index == 0 && !checkpoint_dir.empty()) {
    if (!pstrain::storage::IsS3Uri(checkpoint_dir)) {
      return Fail(absl::StrCat("--checkpoint-dir must be s3://bucket/prefix, got '",
                               checkpoint_dir, "' (local checkpoints go under --state-dir)"));
    }
    if (absl::StatusOr<pstrain::storage::S3Uri> uri = pstrain::storage::ParseS3Uri(checkpoint_dir);
        !uri.ok()) {
      return Fail(absl::StrCat("--checkpoint-dir: ", uri.status().message()));
    }
    absl::StatusOr<pstrain::storage::StorageOptions> storage_options =
        pstrain::storage::StorageOptionsFromFlags(
            [](const std::string& line) { std::cerr << "pstrain-server: " << line << std::endl; });
    if (!storage_options.ok()) return Fail(std::string(storage_options.status().message()));
    absl::StatusOr<std::unique_ptr<pstrain::storage::Storage>> opened =
        pstrain::storage::OpenStorage(*storage_options);
    if (!opened.ok()) return Fail(std::string(opened.status().message()));
    checkpoint_store = *std::move(opened);
  }
  std::unique_ptr<pstrain::ShardController> controller;
  std::unique_ptr<pstrain::Coordinator> coordinator;
  std::unique_ptr<pstrain::CoordinatorService> coordinator_service;
  if (shard_index == 0) {
    std::vector<std::unique_ptr<pstrain::ShardClient>> clients;
    for (size_t i = 0; i < shard_addresses.size(); ++i) {
      if (static_cast<int>(i) == shard_index) {
        clients.push_back(pstrain::MakeLocalShardClient(&shard));
      } else {
        clients.push_back(pstrain::MakeRemoteShardClient(
            pstrain::CreateChannel(shard_addresses[i], security.channel), shard_addresses[i],
            absl::Milliseconds(absl::GetFlag(FLAGS_shard_rpc_timeout_ms))));
      }
    }
    controller = std::make_unique<pstrain::ShardController>(std::move(clients));
    pstrain::Coordinator::Options options;
    options.state_dir = absl::GetFlag(FLAGS_state_dir);
    options.checkpoint_interval = absl::Seconds(absl::GetFlag(FLAGS_checkpoint_interval_s));
    options.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
    options.checkpoint_dir = checkpoint_dir;
    options.storage = checkpoint_store.get();
    options.straggler_timeout = absl::Seconds(absl::GetFlag(FLAGS_straggler_timeout_s));
    options.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
    options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
    options.shard_addresses = shard_addresses;
    options.job_limits = job_limits;
    options.max_queued_jobs = absl::GetFlag(FLAGS_max_queued_jobs);
    options.max_workers = absl::GetFlag(FLAGS_max_workers);
    options.forget_dead_workers_after =
        absl::Seconds(absl::GetFlag(FLAGS_forget_dead_workers_after_s));
    options.max_id_bytes = absl::GetFlag(FLAGS_max_id_bytes);
    options.max_worker_info_bytes = absl::GetFlag(FLAGS_max_worker_info_bytes);
    options.max_reason_bytes = absl::GetFlag(FLAGS_max_reason_bytes);
    options.max_eval_samples = absl::GetFlag(FLAGS_max_eval_samples);
    options.max_history_points = absl::GetFlag(FLAGS_max_history_points);
    auto created = pstrain::Coordinator::Create(std::move(options), controller.get());
    if (!created.ok()) return Fail(std::string(created.status().message()));
    coordinator = *std::move(created);
    // Worker credentials are bound to this state directory (made by Create).
    if (const std::string state_dir = absl::GetFlag(FLAGS_state_dir);
        security.authorizer->enabled() && !state_dir.empty()) {
      absl::StatusOr<std::string> epoch = pstrain::LoadOrCreateStateEpoch(state_dir);
      if (!epoch.ok()) return Fail(std::string(epoch.status().message()));
      security.authorizer->SetStateEpoch(*epoch);
    }
    coordinator_service = std::make_unique<pstrain::CoordinatorService>(
        coordinator.get(),
        pstrain::CoordinatorService::Options{.max_message_bytes = max_coordinator_message_bytes,
                                             .authorizer = security.authorizer});
  }

  std::string warning;
  if (metrics != nullptr) {
    // HTTPS with the daemon's certificate, asking scrapers for a client
    // certificate as the gRPC port does; plain HTTP only on loopback (or
    // with --insecure).
    const std::string metrics_host = absl::GetFlag(FLAGS_metrics_host);
    std::optional<pstrain::MetricsTls> metrics_tls;
    if (!security.tls.cert_file.empty()) {
      metrics_tls = pstrain::MetricsTls{
          security.tls.cert_file, security.tls.key_file,
          security.tls.require_client_cert ? security.tls.ca_file : std::string()};
    } else if (absl::Status s = pstrain::CheckListenPolicy(
                   "--metrics-host", absl::StrCat(metrics_host, ":", metrics_port),
                   /*tls_enabled=*/false, /*tokens_enabled=*/true, security.insecure, &warning);
               !s.ok()) {
      return Fail(std::string(s.message()));
    } else if (!warning.empty()) {
      std::cerr << warning << std::endl;
    }
    absl::Status started =
        metrics->Start(metrics_host, metrics_port, metrics_tls ? &*metrics_tls : nullptr, &shard,
                       coordinator.get());
    if (!started.ok()) return Fail(std::string(started.message()));
  }

  // grpc.health.v1.Health and reflection: each service below is SERVING once
  // the server listens, and every one NOT_SERVING from the shutdown signal on.
  pstrain::EnableHealthAndReflection();
  grpc::ServerBuilder builder;
  int port = 0;
  // gRPC sets SO_REUSEPORT by default: a second server on the same port then
  // listens too, and the kernel splits new connections between the two (a
  // client reached the wrong one and failed its TLS handshake). One port,
  // one server: the second one fails to start.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(listen, security.server_credentials, &port);
  shard_services.Register(&builder);
  if (coordinator_service != nullptr) builder.RegisterService(coordinator_service.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(absl::StrCat("cannot listen on ", listen,
                             " (is another process listening there? see --listen)"));
  }
  const std::string address = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  // With --listen HOST:0 and no --shards, workers learn the chosen port.
  if (coordinator != nullptr && !shards_given) coordinator->SetShardAddresses({address});
  std::vector<std::string> services = {"pstrain.v1.ParameterService", "pstrain.v1.ShardControl"};
  if (coordinator_service != nullptr) services.push_back("pstrain.v1.Coordinator");
  pstrain::SetServing(server.get(), services, true);
  pstrain::HealthServer health;
  if (const int health_port = absl::GetFlag(FLAGS_health_port); health_port > 0) {
    auto started = pstrain::StartHealthServer(
        absl::StrCat(absl::GetFlag(FLAGS_health_host), ":", health_port));
    if (!started.ok()) return Fail(std::string(started.status().message()));
    health = *std::move(started);
    pstrain::SetServing(health.server.get(), services, true);
    std::cout << "health on " << absl::GetFlag(FLAGS_health_host) << ":" << health.port
              << " (grpc.health.v1.Health, plaintext)" << std::endl;
  }
  std::cout << "pstrain-server listening on " << address << " (shard " << shard_index << " of "
            << shard_addresses.size() << (shard_index == 0 ? ", coordinator" : "") << ")"
            << std::endl;

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  std::cerr << "pstrain-server: " << (signal_number == SIGINT ? "SIGINT" : "SIGTERM")
            << ", shutting down" << std::endl;
  pstrain::SetServing(server.get(), {}, false);
  if (health.server != nullptr) pstrain::SetServing(health.server.get(), {}, false);
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  server->Wait();
  if (health.server != nullptr) {
    health.server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    health.server->Wait();
  }
  metrics.reset();
  coordinator_service.reset();
  coordinator.reset();
  return 0;
}
