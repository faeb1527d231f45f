// WorkerRegistry: the workers server 0 knows, what each one trains and
// whether it is alive. Ids ("worker-<n>") are issued once per state
// directory: the next number is saved before an id is handed out, and a
// worker that registers again after a restart gets its previous id back when
// this directory issued it and nobody holds it.
//
//   WorkerRegistry workers({.max_workers = 100, .save_next_id = save});
//   PSTRAIN_ASSIGN_OR_RETURN(RegisteredWorker* w, workers.Register(info, "", now));
//   workers.Heard(*w, now);                            // a heartbeat
//   for (RegisteredWorker* dead : workers.Overdue(now)) workers.MarkDead(*dead, now);
//   workers.ForgetDead(now);                           // dead and idle long enough
//
// Threads: thread-compatible. The Coordinator owns it and calls it under its
// mutex; it does no I/O beyond Options::save_next_id and never blocks.
// Pointers it returns stay valid until the worker is forgotten (ForgetDead,
// or Register making room).
#ifndef PSTRAIN_SERVER_WORKER_REGISTRY_H_
#define PSTRAIN_SERVER_WORKER_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

struct RegisteredWorker {
  std::string id;
  v1::WorkerInfo info;
  std::string job_id;        // The job it trains (an unfinished member), or "".
  std::string finished_job;  // The last job it finished training.
  // A daemon that runs commands: the job whose command it was told to run,
  // or runs (HeartbeatResponse.ACTION_LAUNCH); such a daemon is not idle.
  std::string launching;
  absl::Time last_heartbeat;
  bool alive = true;
};

class WorkerRegistry {
 public:
  struct Options {
    int max_workers = 10000;
    int max_info_bytes = 4096;                             // Of a WorkerInfo.
    absl::Duration heartbeat_timeout = absl::Seconds(10);  // Silent this long: dead.
    absl::Duration forget_dead_after = absl::Minutes(10);  // Dead and idle this long: forgotten.
    // Saves the next id number before an id is handed out; empty: nothing saved.
    std::function<absl::Status(int64_t next)> save_next_id;
    std::function<void(const std::string&)> log;  // "worker-3: marked dead ..."
  };

  explicit WorkerRegistry(Options options);

  // The next id number, as the state directory saved it (>= 1).
  void set_next_id(int64_t next) { next_id_ = next; }

  // Registers a worker heard from at `now`: `previous_id` when this registry
  // issued it and nobody holds it, else a new id. INVALID_ARGUMENT for
  // `info` over max_info_bytes; RESOURCE_EXHAUSTED when
  // max_workers are registered and none can be forgotten; UNAVAILABLE when
  // the id counter cannot be saved (no id is used up).
  absl::StatusOr<RegisteredWorker*> Register(const v1::WorkerInfo& info,
                                             const std::string& previous_id, absl::Time now);
  // Null for an id not registered (never, or forgotten).
  RegisteredWorker* Find(const std::string& id) const;
  // A heartbeat (or any call) from `worker` at `now`. True when it was dead
  // and is alive again.
  bool Heard(RegisteredWorker& worker, absl::Time now);

  // Alive workers silent for heartbeat_timeout, by id.
  std::vector<RegisteredWorker*> Overdue(absl::Time now) const;
  // Marks an Overdue worker dead (logged); its job_id stays for the caller.
  void MarkDead(RegisteredWorker& worker, absl::Time now);
  // Forgets workers dead and idle for forget_dead_after (logged).
  void ForgetDead(absl::Time now);
  // Ids of the workers, alive or not, silent for longer than `silence`.
  std::set<std::string> Silent(absl::Duration silence, absl::Time now) const;

  // Every worker, alive or not, by id.
  std::vector<RegisteredWorker*> All() const;
  // Alive workers that train nothing and run no command, by id number
  // ("worker-2" before "worker-10").
  std::vector<RegisteredWorker*> IdleByNumber() const;
  int IdleCount() const;
  // The workers among `ids` that train `job_id` train nothing now.
  void Free(const std::string& job_id, const std::vector<std::string>& ids);

  // Every worker, by id number.
  std::vector<v1::WorkerStatus> List() const;
  int size() const { return static_cast<int>(workers_.size()); }
  int AliveCount() const;

 private:
  void Log(const std::string& line) const;

  const Options options_;
  std::map<std::string, std::unique_ptr<RegisteredWorker>> workers_;
  int64_t next_id_ = 1;
};

// "worker-12" -> 12 (with prefix "worker-"); 0 when the id has another form.
int64_t IdNumber(const std::string& id, const std::string& prefix);

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_WORKER_REGISTRY_H_
