#include "server/server_metrics.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "common/job_state.h"
#include "common/status_macros.h"

namespace pstrain {

ServerMetrics::ServerMetrics() : registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  auto counter = [this](const char* name, const char* help) {
    return &BuildCounter().Name(name).Help(help).Register(*registry_).Add({});
  };
  pushes_ = counter("pstrain_server_pushes_total", "Chunk pushes accepted");
  pulls_ = counter("pstrain_server_pulls_total", "Chunk pulls served");
  push_bytes_ = counter("pstrain_server_push_bytes_total",
                        "Payload bytes received in pushes, as they travelled (compressed "
                        "gradients count their encoded size)");
  push_represented_bytes_ = counter(
      "pstrain_server_push_represented_bytes_total",
      "F32 bytes the pushed payloads decode to; over pstrain_server_push_bytes_total it is the "
      "compression ratio of the job's gradient codec");
  pull_bytes_ = counter("pstrain_server_pull_bytes_total",
                        "Payload bytes sent in pulls, as they travelled (with pull compression: "
                        "the encoded deltas)");
  pull_represented_bytes_ = counter(
      "pstrain_server_pull_represented_bytes_total",
      "F32 bytes of the values the pulls delivered; over pstrain_server_pull_bytes_total it is "
      "the compression ratio of the job's pull codec");
  rejected_ = counter("pstrain_server_rejected_pushes_total", "Pushes rejected by validation");
  updates_ = counter("pstrain_server_applied_updates_total", "Updates applied to the model");
  duplicates_ = counter("pstrain_server_duplicate_pushes_total",
                        "Pushes acknowledged without being applied again (retried updates "
                        "already applied: exactly-once delivery)");
  const prometheus::Histogram::BucketBoundaries latency_buckets = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
  push_latency_ =
      &BuildHistogram()
           .Name("pstrain_server_push_latency_seconds")
           .Help("Time to decode, validate and apply one pushed chunk frame on this shard")
           .Register(*registry_)
           .Add({}, latency_buckets);
  pull_latency_ = &BuildHistogram()
                       .Name("pstrain_server_pull_latency_seconds")
                       .Help(
                           "Time of one pull call on this shard, from its request to its "
                           "last chunk queued (includes waiting for the asked version)")
                       .Register(*registry_)
                       .Add({}, latency_buckets);
  staleness_family_ = &BuildHistogram()
                           .Name("pstrain_server_staleness")
                           .Help(
                               "Staleness of async/ssp gradients in model versions (server "
                               "version minus the version the gradient was computed from)")
                           .Register(*registry_);
  {
    prometheus::Histogram::BucketBoundaries bounds(std::begin(kBarrierWaitBounds),
                                                   std::end(kBarrierWaitBounds));
    barrier_wait_ = &BuildHistogram()
                         .Name("pstrain_server_barrier_wait_seconds")
                         .Help(
                             "Sync and average barriers of a chunk completed on this shard, by "
                             "the time from their first member's push to their last: what "
                             "the slowest member costs the others")
                         .Register(*registry_)
                         .Add({}, bounds);
  }
  model_version_ = &BuildGauge()
                        .Name("pstrain_server_model_version")
                        .Help(
                            "Live model version of each job on this shard (highest chunk "
                            "version pushed or pulled; the series goes when the job does)")
                        .Register(*registry_);
}

ServerMetrics::~ServerMetrics() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

std::function<void(absl::Duration)> ServerMetrics::PushObserver() {
  return [h = push_latency_](absl::Duration d) { h->Observe(absl::ToDoubleSeconds(d)); };
}

std::function<void(absl::Duration)> ServerMetrics::PullObserver() {
  return [h = pull_latency_](absl::Duration d) { h->Observe(absl::ToDoubleSeconds(d)); };
}

absl::Status ServerMetrics::Start(const std::string& host, int port, const MetricsTls* tls,
                                  ParameterShard* shard, Coordinator* coordinator) {
  shard_ = shard;
  coordinator_ = coordinator;
  if (coordinator_ != nullptr) {
    using prometheus::BuildCounter;
    using prometheus::BuildGauge;
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
    stragglers_ = &BuildGauge()
                       .Name("pstrain_server_stragglers")
                       .Help(
                           "Members of running jobs holding the others back (silent for three "
                           "heartbeat intervals, or behind the others' steps)")
                       .Register(*registry_)
                       .Add({});
    workers_lost_ = &BuildCounter()
                         .Name("pstrain_server_workers_lost_total")
                         .Help(
                             "Workers dropped from a job (missed heartbeats or errors), "
                             "summed over the jobs this coordinator knows")
                         .Register(*registry_)
                         .Add({});
  }
  Refresh();
  PSTRAIN_ASSIGN_OR_RETURN(endpoint_,
                           MetricsHttpServer::Start(host, port, PrometheusTextOf(registry_), tls));
  thread_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(absl::Seconds(1))) Refresh();
  });
  return absl::OkStatus();
}

void ServerMetrics::Refresh() {
  const ShardStats s = shard_->stats();
  Advance(pushes_, s.pushes, last_.pushes);
  Advance(pulls_, s.pulls, last_.pulls);
  Advance(push_bytes_, s.push_bytes, last_.push_bytes);
  Advance(push_represented_bytes_, s.push_represented_bytes, last_.push_represented_bytes);
  Advance(pull_bytes_, s.pull_bytes, last_.pull_bytes);
  Advance(pull_represented_bytes_, s.pull_represented_bytes, last_.pull_represented_bytes);
  Advance(rejected_, s.rejected_pushes, last_.rejected_pushes);
  Advance(updates_, s.applied_updates, last_.applied_updates);
  Advance(duplicates_, s.duplicate_pushes, last_.duplicate_pushes);
  RefreshStaleness(s.staleness_counts);
  RefreshBarrierWait(s, last_);
  RefreshModelVersions(s.model_version_by_job);
  last_ = s;
  if (coordinator_ == nullptr) return;
  const CoordinatorStats c = coordinator_->Stats();
  workers_->Set(c.workers_alive);
  stragglers_->Set(c.stragglers);
  std::map<std::string, int> counts;
  for (const auto& [state, count] : c.jobs_by_state) {
    counts[JobStateName(state)] += count;
  }
  for (auto& [state, gauge] : jobs_) gauge->Set(counts[state]);
  int64_t lost = 0;
  for (const v1::JobStatus& job : coordinator_->ListJobs()) lost += job.workers_lost();
  Advance(workers_lost_, lost, last_workers_lost_);
  last_workers_lost_ = std::max(lost, last_workers_lost_);
}

void ServerMetrics::RefreshStaleness(const std::vector<int64_t>& counts) {
  if (counts.empty()) return;
  if (staleness_ == nullptr) {
    prometheus::Histogram::BucketBoundaries bounds;
    for (size_t i = 0; i + 1 < counts.size(); ++i) bounds.push_back(static_cast<double>(i));
    staleness_ = &staleness_family_->Add({}, bounds);
    staleness_seen_.assign(counts.size(), 0);
  }
  if (counts.size() != staleness_seen_.size()) return;  // Fixed per shard; never happens.
  std::vector<double> increments(counts.size(), 0);
  double sum = 0;
  bool any = false;
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t delta = counts[i] - staleness_seen_[i];
    if (delta <= 0) continue;
    increments[i] = static_cast<double>(delta);
    sum += static_cast<double>(delta) * static_cast<double>(i);
    any = true;
  }
  if (any) staleness_->ObserveMultiple(increments, sum);
  staleness_seen_ = counts;
}

void ServerMetrics::RefreshBarrierWait(const ShardStats& now, const ShardStats& before) {
  std::vector<double> increments(now.barrier_wait_counts.size(), 0);
  bool any = false;
  for (size_t i = 0; i < now.barrier_wait_counts.size(); ++i) {
    const int64_t seen = i < before.barrier_wait_counts.size() ? before.barrier_wait_counts[i] : 0;
    increments[i] = static_cast<double>(now.barrier_wait_counts[i] - seen);
    any |= increments[i] > 0;
  }
  if (any) {
    barrier_wait_->ObserveMultiple(increments,
                                   now.barrier_wait_seconds - before.barrier_wait_seconds);
  }
}

void ServerMetrics::RefreshModelVersions(const std::map<std::string, int64_t>& versions) {
  for (auto it = model_version_by_job_.begin(); it != model_version_by_job_.end();) {
    if (versions.count(it->first) == 0) {
      model_version_->Remove(it->second);
      it = model_version_by_job_.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& [job, version] : versions) {
    prometheus::Gauge*& gauge = model_version_by_job_[job];
    if (gauge == nullptr) gauge = &model_version_->Add({{"job", job}});
    gauge->Set(static_cast<double>(version));
  }
}

void ServerMetrics::Advance(prometheus::Counter* counter, int64_t now, int64_t before) {
  if (now > before) counter->Increment(static_cast<double>(now - before));
}

}  // namespace pstrain
