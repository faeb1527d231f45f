// ShardServices::Impl: what the ParameterService reactors (push_reactor.h,
// pull_reactor.h) share: the shard, the options, the authorizer and the two
// executors; it also serves ShardControl (shard_control_service.h). Internal
// to ShardServices (ps_service.h): include it only from its parts.
//
// Threads: everything here is thread-safe; the executors' tasks run on their
// own threads and never block gRPC's callback threads.
#ifndef PSTRAIN_SERVER_PS_SERVICE_IMPL_H_
#define PSTRAIN_SERVER_PS_SERVICE_IMPL_H_

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/support/server_callback.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc/channel.h"
#include "common/rpc/security.h"
#include "server/parameter_shard.h"
#include "server/ps_service.h"
#include "server/shard_control_service.h"

namespace pstrain {

// A thread pool that grows on demand (a task never waits for a thread while
// fewer than max_threads exist). Threads live until destruction.
// Thread-safe.
class ShardExecutor {
 public:
  explicit ShardExecutor(int max_threads) : max_threads_(std::max(1, max_threads)) {}
  ~ShardExecutor() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }

  void Schedule(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
    if (static_cast<size_t>(idle_) < tasks_.size() &&
        static_cast<int>(threads_.size()) < max_threads_) {
      threads_.emplace_back([this] { Loop(); });
    }
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    for (;;) {
      ++idle_;
      mu_.Await(absl::Condition(this, &ShardExecutor::HasWorkOrStop));
      --idle_;
      if (tasks_.empty()) return;  // stop_ and drained.
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      mu_.Unlock();
      task();
      mu_.Lock();
    }
  }

  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !tasks_.empty(); }

  const int max_threads_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

class ShardServices::Impl final : public grpc::CallbackGenericService {
 public:
  Impl(ParameterShard* shard, Options options)
      : shard_(shard),
        options_(options),
        executor_(options.max_threads),
        waiting_executor_(options.max_waiting_pulls),
        authorizer_(options.authorizer != nullptr ? options.authorizer : Authorizer::Disabled()),
        control_(shard, options.max_control_message_bytes, authorizer_.get()) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

  void Register(grpc::ServerBuilder* builder) {
    ConfigureServerBuilder(builder, options_.max_receive_message_bytes);
    builder->RegisterCallbackGenericService(this);
    builder->RegisterService(&control_);
  }

  ParameterShard* shard() const { return shard_; }
  const Options& options() const { return options_; }
  const Authorizer& authorizer() const { return *authorizer_; }
  // Pushes and pulls that do not wait: never blocks on a version.
  ShardExecutor* executor() { return &executor_; }
  // Pulls waiting for a version, one thread each (at most max_waiting_pulls
  // at a time, so that a waiting pull never queues behind the others).
  ShardExecutor* waiting_executor() { return &waiting_executor_; }
  // Takes one of the max_waiting_pulls places; false when all are taken.
  bool ReserveWaitingPull() {
    absl::MutexLock lock(&waiting_mu_);
    if (waiting_pulls_ >= options_.max_waiting_pulls) return false;
    ++waiting_pulls_;
    return true;
  }
  void ReleaseWaitingPull() {
    absl::MutexLock lock(&waiting_mu_);
    --waiting_pulls_;
  }

 private:
  ParameterShard* const shard_;
  const Options options_;
  absl::Mutex waiting_mu_;
  int waiting_pulls_ ABSL_GUARDED_BY(waiting_mu_) = 0;
  // Declared after waiting_mu_: joined (destroyed) first.
  ShardExecutor executor_;
  ShardExecutor waiting_executor_;
  const std::shared_ptr<const Authorizer> authorizer_;
  ShardControlService control_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_PS_SERVICE_IMPL_H_
