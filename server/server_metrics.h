// ServerMetrics: pstrain-server's /metrics (pstrain_server_*): counters and gauges copied from the
// shard's and the coordinator's stats once a second, latency histograms observed by the
// ShardServices hooks as calls happen. Served by common/metrics_http.h.
//
//   auto metrics = std::make_unique<ServerMetrics>();
//   service_options.on_push_frame = metrics->PushObserver();  // Before the services.
//   PSTRAIN_RETURN_IF_ERROR(metrics->Start(host, port, tls, &shard, coordinator));
//
// Threads: the latency observers run on ShardServices threads (prometheus
// histograms are thread-safe); Refresh runs on the owned thread only.
#ifndef PSTRAIN_SERVER_SERVER_METRICS_H_
#define PSTRAIN_SERVER_SERVER_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/metrics_http.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "server/coordinator.h"
#include "server/parameter_shard.h"

namespace pstrain {

class ServerMetrics {
 public:
  // Histograms exist from construction so that the hooks can be installed
  // before the shard services are created; Start begins refreshing.
  ServerMetrics();
  ~ServerMetrics();

  std::function<void(absl::Duration)> PushObserver();
  std::function<void(absl::Duration)> PullObserver();

  // Serves /metrics on 127.0.0.1:port and refreshes every second. `shard`
  // (and `coordinator`, null on shards other than 0) must outlive this.
  absl::Status Start(const std::string& host, int port, const MetricsTls* tls,
                     ParameterShard* shard, Coordinator* coordinator);

 private:
  void Refresh();

  // staleness_counts[s] counts pushes of staleness s (the last bucket: >= s):
  // buckets le="0", le="1", ... and +Inf for the last one.
  void RefreshStaleness(const std::vector<int64_t>& counts);

  // The barriers completed since the last refresh, into the histogram.
  void RefreshBarrierWait(const ShardStats& now, const ShardStats& before);

  // One series per live job; a dropped job's series is removed.
  void RefreshModelVersions(const std::map<std::string, int64_t>& versions);

  static void Advance(prometheus::Counter* counter, int64_t now, int64_t before);

  // Constant after construction (Start sets shard_, coordinator_ and the
  // coordinator series before the thread starts).
  const std::shared_ptr<prometheus::Registry> registry_;
  ParameterShard* shard_ = nullptr;
  Coordinator* coordinator_ = nullptr;
  prometheus::Counter *pushes_, *pulls_, *push_bytes_, *push_represented_bytes_, *pull_bytes_,
      *pull_represented_bytes_, *rejected_, *updates_, *duplicates_;
  prometheus::Histogram *push_latency_, *pull_latency_, *barrier_wait_;
  prometheus::Family<prometheus::Histogram>* staleness_family_;
  prometheus::Family<prometheus::Gauge>* model_version_;
  prometheus::Gauge* workers_ = nullptr;
  prometheus::Gauge* stragglers_ = nullptr;
  prometheus::Counter* workers_lost_ = nullptr;
  std::map<std::string, prometheus::Gauge*> jobs_;

  // Only touched by Refresh (Start's thread, then thread_).
  ShardStats last_;
  int64_t last_workers_lost_ = 0;
  prometheus::Histogram* staleness_ = nullptr;
  std::vector<int64_t> staleness_seen_;
  std::map<std::string, prometheus::Gauge*> model_version_by_job_;

  std::unique_ptr<MetricsHttpServer> endpoint_;
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_SERVER_METRICS_H_
