// LocalCluster: pstrain-server shard(s) and pstrain-worker daemons as real
// processes on 127.0.0.1 with random free ports, for integration tests. By
// default the cluster runs as users should run it: TLS with client
// certificates required (mTLS) and per-role tokens, all made by
// deploy/local/make-certs.sh; the CLI calls carry the admin's, and every
// daemon's /metrics wants Prometheus' client certificate (ScrapeMetrics).
//
//   LocalCluster cluster({.workers = 2});
//   ASSERT_TRUE(cluster.Start()) << cluster.Logs();
//   CommandResult r = cluster.Cli({"submit", job, "--workers", "2", "--watch", "--json"});
//   v1::JobStatus status = ParseJobStatus(r.LastLine());
#ifndef PSTRAIN_TESTS_INTEGRATION_CLUSTER_H_
#define PSTRAIN_TESTS_INTEGRATION_CLUSTER_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/data/file_io.h"
#include "common/rpc/channel.h"
#include "common/rpc/security.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "pstrain/v1/service.pb.h"
#include "tests/integration/process_util.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::testing {

struct ClusterOptions {
  int shards = 1;
  int workers = 2;
  int heartbeat_timeout_ms = 2000;
  int heartbeat_interval_ms = 250;
  // TLS, mTLS and tokens on every channel (false: plaintext, no tokens).
  bool secure = true;
  // More pstrain-worker flags.
  std::vector<std::string> worker_args = {};
};

class LocalCluster {
 public:
  explicit LocalCluster(ClusterOptions options) : options_(options) {
    static int counter = 0;
    state_root_ = absl::StrCat(::testing::TempDir(), "/pstrain-cluster-", getpid(), "-", counter++);
    std::filesystem::create_directories(state_root_);
    for (int s = 0; s < options_.shards; ++s) shard_ports_.push_back(FreePort());
  }

  std::string coordinator() const { return Address(shard_ports_[0]); }
  // The /metrics port of server `s` and of worker `w` (after Start).
  int server_metrics_port(int s) const { return server_metrics_ports_.at(s); }
  int worker_metrics_port(int w) const { return worker_metrics_ports_.at(w); }
  const std::string& state_root() const { return state_root_; }
  std::string certs() const { return state_root_ + "/certs"; }

  // Starts every shard, then the workers; true once all are serving.
  bool Start() {
    if (options_.secure) {
      const std::string command =
          absl::StrCat(SourcePath("deploy/local/make-certs.sh"), " ", certs(), " >/dev/null");
      if (std::system(command.c_str()) != 0) {
        ADD_FAILURE() << command << " failed";
        return false;
      }
    }
    std::vector<std::string> addresses;
    for (int port : shard_ports_) addresses.push_back(Address(port));
    for (int s = 0; s < options_.shards; ++s) {
      server_metrics_ports_.push_back(FreePort());
      std::vector<std::string> argv = {BinPath("pstrain-server"),
                                       "--listen",
                                       addresses[s],
                                       "--metrics-port",
                                       absl::StrCat(server_metrics_ports_.back()),
                                       "--state-dir",
                                       absl::StrCat(state_root_, "/shard", s),
                                       "--heartbeat-timeout-ms",
                                       absl::StrCat(options_.heartbeat_timeout_ms),
                                       "--heartbeat-interval-ms",
                                       absl::StrCat(options_.heartbeat_interval_ms)};
      if (options_.shards > 1) {
        argv.insert(argv.end(), {"--shard-index", absl::StrCat(s), "--shards",
                                 absl::StrJoin(addresses, ",")});
      }
      if (options_.secure) {
        argv.insert(argv.end(), {"--tls-cert", certs() + "/server.pem", "--tls-key",
                                 certs() + "/server-key.pem", "--tls-ca", certs() + "/ca.pem",
                                 "--require-client-cert", "--token-file", certs() + "/tokens"});
      }
      server_argv_.push_back(argv);
      servers_.push_back(std::make_unique<ChildProcess>(argv));
      if (!servers_.back()->WaitForOutput("listening on", absl::Seconds(60))) return false;
    }
    for (int w = 0; w < options_.workers; ++w) {
      if (!AddWorker()) return false;
    }
    return true;
  }

  bool AddWorker() {
    worker_metrics_ports_.push_back(FreePort());
    std::vector<std::string> argv = {BinPath("pstrain-worker"),
                                     "--server",
                                     coordinator(),
                                     "--metrics-port",
                                     absl::StrCat(worker_metrics_ports_.back()),
                                     "--device",
                                     "cpu",
                                     "--threads",
                                     "1"};
    if (options_.secure) {
      argv.insert(argv.end(), {"--tls-ca", certs() + "/ca.pem", "--tls-cert",
                               certs() + "/worker.pem", "--tls-key", certs() + "/worker-key.pem",
                               "--require-client-cert", "--token-file", certs() + "/worker.token"});
    }
    argv.insert(argv.end(), options_.worker_args.begin(), options_.worker_args.end());
    workers_.push_back(std::make_unique<ChildProcess>(argv));
    return workers_.back()->WaitForOutput("registered", absl::Seconds(60));
  }

  // What a client needs to reach the servers as `role`: TLS with a client
  // certificate and the role's token; as a worker, also the credential of
  // `worker_id` (made with the cluster's peer token, as server 0 does).
  ChannelOptions ClientOptions(Role role, const std::string& worker_id = "") const {
    ChannelOptions options;
    if (!options_.secure) return options;
    TlsOptions tls;
    tls.ca_file = certs() + "/ca.pem";
    tls.cert_file = certs() + (role == Role::kPeer ? "/server.pem" : "/worker.pem");
    tls.key_file = certs() + (role == Role::kPeer ? "/server-key.pem" : "/worker-key.pem");
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
        ChannelCredentialsFor(tls);
    EXPECT_OK(credentials);
    options.credentials = *credentials;
    absl::StatusOr<std::shared_ptr<Authorizer>> servers =
        Authorizer::FromTokenFile(certs() + "/tokens");
    EXPECT_OK(servers);
    auto identity = std::make_shared<CallIdentity>();
    if (role == Role::kPeer) identity->token = (*servers)->peer_token();
    if (role != Role::kPeer) {
      identity->token =
          *ReadTokenFile(certs() + (role == Role::kAdmin ? "/admin.token" : "/worker.token"));
    }
    if (!worker_id.empty()) {
      // As server 0 issues it: bound to its state directory's epoch.
      absl::StatusOr<std::string> epoch =
          data::ReadFileBytes(absl::StrCat(state_root_, "/shard0/state_epoch"));
      EXPECT_OK(epoch);
      (*servers)->SetStateEpoch(
          std::string(absl::StripAsciiWhitespace(epoch.value_or(std::string()))));
      identity->set_worker_credential((*servers)->IssueWorkerCredential(worker_id));
    }
    options.identity = std::move(identity);
    return options;
  }

  ChildProcess& worker(int i) { return *workers_[i]; }
  ChildProcess& server(int i) { return *servers_[i]; }

  // kill -9 of server `i`, then the same command again (same port, same
  // state directory); true once it listens. The dead process's output
  // stays in Logs().
  bool RestartServer(int i) {
    servers_[i]->Kill(SIGKILL);
    servers_[i]->Wait(absl::Seconds(10));
    dead_.push_back(std::move(servers_[i]));
    servers_[i] = std::make_unique<ChildProcess>(server_argv_[i]);
    return servers_[i]->WaitForOutput("listening on", absl::Seconds(60));
  }

  CommandResult Cli(std::vector<std::string> args, absl::Duration timeout = absl::Minutes(10)) {
    std::vector<std::string> argv = {BinPath("pstrain"), "--server", coordinator()};
    if (options_.secure) {
      argv.insert(argv.end(), {"--tls-ca", certs() + "/ca.pem", "--tls-cert",
                               certs() + "/admin.pem", "--tls-key", certs() + "/admin-key.pem",
                               "--token-file", certs() + "/admin.token"});
    }
    argv.insert(argv.end(), args.begin(), args.end());
    return RunCommand(argv, timeout);
  }

  // curl of the /metrics on 127.0.0.1:`metrics_port`, as Prometheus scrapes
  // it: on a secure cluster HTTPS verified against the cluster's CA, with
  // Prometheus' client certificate unless !client_certificate; plain HTTP
  // otherwise. exit_code 0 and the metrics text, or curl's error.
  CommandResult ScrapeMetrics(int metrics_port, bool client_certificate = true) const {
    std::vector<std::string> argv = {"/usr/bin/curl", "-sf", "--max-time", "10"};
    if (options_.secure) {
      argv.insert(argv.end(), {"--cacert", certs() + "/ca.pem"});
      if (client_certificate) {
        argv.insert(argv.end(), {"--cert", certs() + "/prometheus.pem", "--key",
                                 certs() + "/prometheus-key.pem"});
      }
    }
    argv.push_back(absl::StrCat(options_.secure ? "https" : "http", "://127.0.0.1:",
                                metrics_port, "/metrics"));
    return RunCommand(argv);
  }

  // Everything the processes printed, for failure messages.
  std::string Logs() const {
    std::string out;
    for (size_t i = 0; i < dead_.size(); ++i) {
      absl::StrAppend(&out, "---- killed server process ", i, " ----\n", dead_[i]->output());
    }
    for (size_t i = 0; i < servers_.size(); ++i) {
      absl::StrAppend(&out, "---- server ", i, " ----\n", servers_[i]->output());
    }
    for (size_t i = 0; i < workers_.size(); ++i) {
      absl::StrAppend(&out, "---- worker ", i, " ----\n", workers_[i]->output());
    }
    return out;
  }

 private:
  ClusterOptions options_;
  std::string state_root_;
  std::vector<int> shard_ports_;
  std::vector<int> server_metrics_ports_;
  std::vector<int> worker_metrics_ports_;
  std::vector<std::unique_ptr<ChildProcess>> servers_;
  std::vector<std::vector<std::string>> server_argv_;
  std::vector<std::unique_ptr<ChildProcess>> dead_;  // Killed by RestartServer.
  std::vector<std::unique_ptr<ChildProcess>> workers_;
};

// A Fashion-MNIST job small enough for CI: `train` samples, `test` samples.
inline std::string WriteFashionMnistJob(const std::string& dir, int64_t train, int64_t test,
                                        int epochs, const std::string& extra = "") {
  std::string path = dir + "/job.json";
  std::ofstream(path) << "{\"name\": \"it-fmnist\", \"model_file\": \""
                      << SourcePath("examples/models/fmnist-cnn.json") << "\", "
                      << "\"dataset\": {\"format\": \"DATASET_FORMAT_IDX\", "
                      << "\"path\": \"/usr/share/datasets/fashion-mnist\", "
                      << "\"mean\": [0.2860], \"std\": [0.3530], "
                      << "\"train_limit\": " << train << ", \"test_limit\": " << test << "}, "
                      << "\"optimizer\": {\"type\": \"OPTIMIZER_SGD\", \"learning_rate\": 0.01, "
                      << "\"momentum\": 0.9}, \"epochs\": " << epochs
                      << ", \"batch_size\": 64, \"seed\": 1" << extra << "}";
  return path;
}

inline bool HaveFashionMnist() {
  return std::filesystem::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

// Parses one JSON object (e.g. the last line of `--json` output).
inline google::protobuf::Struct ParseJson(const std::string& text) {
  google::protobuf::Struct out;
  auto status = google::protobuf::util::JsonStringToMessage(text, &out);
  EXPECT_OK(status) << "not JSON: " << text;
  return out;
}

// Parses the JobStatus that `status --json` and `submit --json` print (the
// proto3 JSON mapping; a field JobStatus does not have fails the test).
inline v1::JobStatus ParseJobStatus(const std::string& text) {
  v1::JobStatus out;
  auto status = google::protobuf::util::JsonStringToMessage(text, &out);
  EXPECT_OK(status) << status << ": not a JobStatus: " << text;
  return out;
}

inline std::string StringField(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? "" : it->second.string_value();
}

inline double NumberField(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? -1 : it->second.number_value();
}

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_INTEGRATION_CLUSTER_H_
