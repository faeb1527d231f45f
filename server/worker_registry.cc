#include "server/worker_registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pstrain {

int64_t IdNumber(const std::string& id, const std::string& prefix) {
  int64_t n = 0;
  if (!absl::StartsWith(id, prefix) || !absl::SimpleAtoi(id.substr(prefix.size()), &n)) return 0;
  return n;
}

WorkerRegistry::WorkerRegistry(Options options) : options_(std::move(options)) {}

void WorkerRegistry::Log(const std::string& line) const {
  if (options_.log) options_.log(line);
}

absl::StatusOr<RegisteredWorker*> WorkerRegistry::Register(const v1::WorkerInfo& info,
                                                           const std::string& previous_id,
                                                           absl::Time now) {
  if (const size_t bytes = info.ByteSizeLong();
      bytes > static_cast<size_t>(options_.max_info_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("worker info has ", bytes, " bytes; at most ",
                                                   options_.max_info_bytes, " are allowed"));
  }
  if (size() >= options_.max_workers) ForgetDead(now);
  if (size() >= options_.max_workers) {
    return absl::ResourceExhaustedError(absl::StrCat(
        workers_.size(), " workers are registered, the most this server takes (--max-workers)"));
  }
  auto worker = std::make_unique<RegisteredWorker>();
  // The caller's previous id when this state directory issued it and it is
  // free (the caller registers again after a restart); else a new one.
  const int64_t previous = IdNumber(previous_id, "worker-");
  if (previous > 0 && previous < next_id_ && previous_id == absl::StrCat("worker-", previous) &&
      workers_.count(previous_id) == 0) {
    worker->id = previous_id;
  } else {
    worker->id = absl::StrCat("worker-", next_id_++);
    // Saved before the id is handed out: never issued twice.
    if (options_.save_next_id) {
      if (absl::Status saved = options_.save_next_id(next_id_); !saved.ok()) {
        --next_id_;
        return absl::UnavailableError(
            absl::StrCat("cannot save the worker id counter: ", saved.message()));
      }
    }
  }
  worker->info = info;
  worker->last_heartbeat = now;
  RegisteredWorker* raw = worker.get();
  workers_[worker->id] = std::move(worker);
  return raw;
}

RegisteredWorker* WorkerRegistry::Find(const std::string& id) const {
  auto it = workers_.find(id);
  return it == workers_.end() ? nullptr : it->second.get();
}

bool WorkerRegistry::Heard(RegisteredWorker& worker, absl::Time now) {
  worker.last_heartbeat = now;
  if (worker.alive) return false;
  worker.alive = true;
  return true;
}

std::vector<RegisteredWorker*> WorkerRegistry::Overdue(absl::Time now) const {
  std::vector<RegisteredWorker*> overdue;
  for (const auto& [id, w] : workers_) {
    if (w->alive && now - w->last_heartbeat > options_.heartbeat_timeout) {
      overdue.push_back(w.get());
    }
  }
  return overdue;
}

void WorkerRegistry::MarkDead(RegisteredWorker& worker, absl::Time now) {
  worker.alive = false;
  Log(absl::StrCat(worker.id, ": no heartbeat for ",
                   absl::FormatDuration(now - worker.last_heartbeat), "; marked dead"));
}

void WorkerRegistry::ForgetDead(absl::Time now) {
  for (auto it = workers_.begin(); it != workers_.end();) {
    const RegisteredWorker& w = *it->second;
    if (!w.alive && w.job_id.empty() && now - w.last_heartbeat > options_.forget_dead_after) {
      Log(absl::StrCat(it->first, ": forgotten (no heartbeat for ",
                       absl::FormatDuration(now - w.last_heartbeat), ")"));
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
}

std::set<std::string> WorkerRegistry::Silent(absl::Duration silence, absl::Time now) const {
  std::set<std::string> silent;
  for (const auto& [id, w] : workers_) {
    if (now - w->last_heartbeat > silence) silent.insert(id);
  }
  return silent;
}

std::vector<RegisteredWorker*> WorkerRegistry::IdleByNumber() const {
  std::vector<std::pair<int64_t, RegisteredWorker*>> idle;
  for (const auto& [id, w] : workers_) {
    if (w->alive && w->job_id.empty() && w->launching.empty()) {
      idle.emplace_back(IdNumber(id, "worker-"), w.get());
    }
  }
  std::sort(idle.begin(), idle.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<RegisteredWorker*> out;
  for (const auto& [n, w] : idle) out.push_back(w);
  return out;
}

int WorkerRegistry::IdleCount() const {
  int n = 0;
  for (const auto& [id, w] : workers_) {
    n += w->alive && w->job_id.empty() && w->launching.empty() ? 1 : 0;
  }
  return n;
}

std::vector<RegisteredWorker*> WorkerRegistry::All() const {
  std::vector<RegisteredWorker*> all;
  for (const auto& [id, w] : workers_) all.push_back(w.get());
  return all;
}

int WorkerRegistry::AliveCount() const {
  int n = 0;
  for (const auto& [id, w] : workers_) n += w->alive ? 1 : 0;
  return n;
}

void WorkerRegistry::Free(const std::string& job_id, const std::vector<std::string>& ids) {
  for (const std::string& id : ids) {
    RegisteredWorker* w = Find(id);
    if (w != nullptr && w->job_id == job_id) w->job_id.clear();
  }
}

std::vector<v1::WorkerStatus> WorkerRegistry::List() const {
  std::vector<std::pair<int64_t, v1::WorkerStatus>> rows;
  for (const auto& [id, w] : workers_) {
    v1::WorkerStatus s;
    s.set_worker_id(id);
    *s.mutable_info() = w->info;
    s.set_job_id(w->job_id.empty() ? w->launching : w->job_id);
    s.set_last_heartbeat_unix_ms(absl::ToUnixMillis(w->last_heartbeat));
    s.set_alive(w->alive);
    rows.emplace_back(IdNumber(id, "worker-"), std::move(s));
  }
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<v1::WorkerStatus> out;
  for (auto& [n, s] : rows) out.push_back(std::move(s));
  return out;
}

}  // namespace pstrain
