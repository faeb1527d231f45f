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
#include <exception>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/daemon_util.h"
#include "common/rpc/channel.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"
#include "server/coordinator.h"
#include "server/coordinator_service.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "server/shard_controller.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070",
          "host:port to serve on (port 0 picks a free port). Without TLS keep it on loopback");
ABSL_FLAG(int, metrics_port, 0, "Serve Prometheus /metrics on 127.0.0.1:PORT (0 = off)");
ABSL_FLAG(std::string, state_dir, "pstrain-state",
          "Directory for job statuses and checkpoints (created if missing)");
ABSL_FLAG(int, shard_index, 0, "This server's index in --shards; 0 is also the coordinator");
ABSL_FLAG(std::string, shards, "",
          "Every shard's host:port, comma-separated, in index order (default: just --listen)");
ABSL_FLAG(int, heartbeat_timeout_ms, 10000,
          "A worker silent this long is dropped from its job and its shard reassigned");
ABSL_FLAG(int, heartbeat_interval_ms, 1000, "How often workers are told to heartbeat");
ABSL_FLAG(int, shard_rpc_timeout_ms, 60000, "Deadline of the coordinator's calls to shards");

namespace {

int Fail(const std::string& message) {
  std::cerr << "pstrain-server: error: " << message << std::endl;
  return 1;
}

// /metrics: counters and gauges refreshed from the shard and the coordinator.
class ServerMetrics {
 public:
  ServerMetrics(int port, pstrain::ParameterShard* shard, pstrain::Coordinator* coordinator)
      : exposer_(absl::StrCat("127.0.0.1:", port)),
        registry_(std::make_shared<prometheus::Registry>()),
        shard_(shard),
        coordinator_(coordinator) {
    using prometheus::BuildCounter;
    using prometheus::BuildGauge;
    pushes_ = &BuildCounter()
                   .Name("pstrain_server_pushes_total")
                   .Help("Chunk pushes received")
                   .Register(*registry_)
                   .Add({});
    pulls_ = &BuildCounter()
                  .Name("pstrain_server_pulls_total")
                  .Help("Chunk pulls served")
                  .Register(*registry_)
                  .Add({});
    push_bytes_ = &BuildCounter()
                       .Name("pstrain_server_push_bytes_total")
                       .Help("Payload bytes received in pushes")
                       .Register(*registry_)
                       .Add({});
    pull_bytes_ = &BuildCounter()
                       .Name("pstrain_server_pull_bytes_total")
                       .Help("Payload bytes sent in pulls")
                       .Register(*registry_)
                       .Add({});
    rejected_ = &BuildCounter()
                     .Name("pstrain_server_rejected_pushes_total")
                     .Help("Pushes rejected by validation")
                     .Register(*registry_)
                     .Add({});
    updates_ = &BuildCounter()
                    .Name("pstrain_server_applied_updates_total")
                    .Help("Updates applied to the model")
                    .Register(*registry_)
                    .Add({});
    if (coordinator_ != nullptr) {
      model_version_ = &BuildGauge()
                            .Name("pstrain_server_model_version")
                            .Help("Highest model version seen at a checkpoint")
                            .Register(*registry_)
                            .Add({});
      auto& jobs =
          BuildGauge().Name("pstrain_server_jobs").Help("Jobs by state").Register(*registry_);
      for (const char* state : {"QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"}) {
        jobs_[state] = &jobs.Add({{"state", state}});
      }
      workers_ = &BuildGauge()
                      .Name("pstrain_server_workers_connected")
                      .Help("Registered workers with a recent heartbeat")
                      .Register(*registry_)
                      .Add({});
    }
    exposer_.RegisterCollectable(registry_);
    thread_ = std::thread([this] { Loop(); });
  }
  ~ServerMetrics() {
    stop_.Notify();
    thread_.join();
  }

 private:
  void Loop() {
    while (!stop_.WaitForNotificationWithTimeout(absl::Seconds(1))) Refresh();
  }
  void Refresh() {
    const pstrain::ShardStats s = shard_->stats();
    Advance(pushes_, s.pushes, last_.pushes);
    Advance(pulls_, s.pulls, last_.pulls);
    Advance(push_bytes_, s.push_bytes, last_.push_bytes);
    Advance(pull_bytes_, s.pull_bytes, last_.pull_bytes);
    Advance(rejected_, s.rejected_pushes, last_.rejected_pushes);
    Advance(updates_, s.applied_updates, last_.applied_updates);
    last_ = s;
    if (coordinator_ == nullptr) return;
    const pstrain::CoordinatorStats c = coordinator_->Stats();
    model_version_->Set(static_cast<double>(c.max_model_version));
    workers_->Set(c.workers_alive);
    for (const auto& [state, count] : c.jobs_by_state) {
      std::string name = pstrain::v1::JobState_Name(state);
      name = name.substr(std::string("JOB_STATE_").size());
      auto it = jobs_.find(name);
      if (it != jobs_.end()) it->second->Set(count);
    }
  }
  static void Advance(prometheus::Counter* counter, int64_t now, int64_t before) {
    if (now > before) counter->Increment(static_cast<double>(now - before));
  }

  prometheus::Exposer exposer_;
  std::shared_ptr<prometheus::Registry> registry_;
  pstrain::ParameterShard* const shard_;
  pstrain::Coordinator* const coordinator_;
  prometheus::Counter *pushes_, *pulls_, *push_bytes_, *pull_bytes_, *rejected_, *updates_;
  prometheus::Gauge* model_version_ = nullptr;
  prometheus::Gauge* workers_ = nullptr;
  std::map<std::string, prometheus::Gauge*> jobs_;
  pstrain::ShardStats last_;  // Only touched by thread_.
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  pstrain::EnsurePassiveOpenMpWait(argv);
  std::vector<std::string> arg_storage;
  std::vector<char*> args = pstrain::NormalizeFlagSpelling(argc, argv, &arg_storage);
  absl::SetProgramUsageMessage(
      "parameter-server shard; shard 0 is also the coordinator.\n"
      "  pstrain-server --listen 127.0.0.1:7070 [--metrics-port P] [--state-dir DIR]\n"
      "                 [--shard-index I --shards HOST:PORT,...]\n"
      "                 [--heartbeat-timeout-ms MS] [--heartbeat-interval-ms MS]");
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

  // SIGINT/SIGTERM are taken by sigwait below; block them before any thread
  // starts so that every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  pstrain::TuneAllocatorForLargeMessages();

  pstrain::ParameterShard shard({.shard_index = shard_index});
  pstrain::ShardServices shard_services(&shard);

  // Server 0: the coordinator and its control path to every shard.
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
            pstrain::CreateChannel(shard_addresses[i]), shard_addresses[i],
            absl::Milliseconds(absl::GetFlag(FLAGS_shard_rpc_timeout_ms))));
      }
    }
    controller = std::make_unique<pstrain::ShardController>(std::move(clients));
    pstrain::Coordinator::Options options;
    options.state_dir = absl::GetFlag(FLAGS_state_dir);
    options.heartbeat_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_timeout_ms));
    options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
    options.shard_addresses = shard_addresses;
    auto created = pstrain::Coordinator::Create(std::move(options), controller.get());
    if (!created.ok()) return Fail(std::string(created.status().message()));
    coordinator = *std::move(created);
    coordinator_service = std::make_unique<pstrain::CoordinatorService>(coordinator.get());
  }

  std::unique_ptr<ServerMetrics> metrics;
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    // prometheus-cpp reports a failed bind by throwing; this is the one place
    // where an exception can reach us.
    try {
      metrics = std::make_unique<ServerMetrics>(absl::GetFlag(FLAGS_metrics_port), &shard,
                                                coordinator.get());
    } catch (const std::exception& e) {
      return Fail(absl::StrCat("cannot serve /metrics on 127.0.0.1:",
                               absl::GetFlag(FLAGS_metrics_port), ": ", e.what()));
    }
  }

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  shard_services.Register(&builder);
  if (coordinator_service != nullptr) builder.RegisterService(coordinator_service.get());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return Fail(absl::StrCat("cannot listen on ", listen));
  const std::string address = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  // With --listen HOST:0 and no --shards, workers learn the chosen port.
  if (coordinator != nullptr && !shards_given) coordinator->SetShardAddresses({address});
  std::cout << "pstrain-server listening on " << address << " (shard " << shard_index << " of "
            << shard_addresses.size() << (shard_index == 0 ? ", coordinator" : "") << ")"
            << std::endl;

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  std::cerr << "pstrain-server: " << (signal_number == SIGINT ? "SIGINT" : "SIGTERM")
            << ", shutting down" << std::endl;
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  server->Wait();
  metrics.reset();
  coordinator_service.reset();
  coordinator.reset();
  return 0;
}
