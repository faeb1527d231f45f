#include "server/pull_reactor.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/rpc/channel.h"
#include "common/rpc/gradient_codec.h"
#include "common/rpc/grpc_order.h"
#include "common/rpc/wire.h"
#include "common/status_macros.h"
#include "server/ps_service_impl.h"

namespace pstrain {
namespace {

// Pull: one request frame, then a reply frame per chunk in request order.
// A producer task on the executor queues the frame of each chunk whose
// version is there (referencing the shard's immutable snapshot); at the
// first chunk that is not, it moves to the waiting pool (or fails with
// RESOURCE_EXHAUSTED when max_waiting_pulls already wait) and waits there
// for it and the rest. Writes go out one at a time from the queue.
class PullReactor final : public grpc::ServerGenericBidiReactor {
 public:
  PullReactor(ShardServices::Impl* owner, grpc::GenericCallbackServerContext* ctx)
      : owner_(owner),
        credential_(Authorizer::WorkerCredentialOf(*ctx)),
        deadline_(absl::FromChrono(ctx->deadline())) {
    StartSendInitialMetadata();
    BeforeGrpc(&request_);
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    GrpcReaction reaction(this, &request_);
    if (!ok) {
      absl::MutexLock lock(&mu_);
      if (got_request_) return;  // Half-close after the request: expected.
    }
    std::optional<grpc::Status> finish;
    if (!ok) {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
      error_ = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "pull without a request frame");
      producing_done_ = true;
      finish = MaybeFinishLocked();
    } else {
      {
        absl::MutexLock lock(&mu_);
        got_request_ = true;
      }
      owner_->executor()->Schedule([this] { Produce(); });
    }
    if (finish) FinishCall(*finish);
  }

  void OnWriteDone(bool ok) override {
    GrpcReaction reaction(this, &current_);
    std::optional<grpc::Status> finish;
    bool write_next = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok && !stopped_) {
        stopped_ = true;
        error_ = grpc::Status(grpc::StatusCode::UNAVAILABLE, "pull reply could not be sent");
        queue_.clear();
      }
      write_next = StartNextWriteLocked();
      finish = MaybeFinishLocked();
    }
    if (write_next) WriteCurrent();
    if (finish) FinishCall(*finish);
  }

  void OnCancel() override {
    GrpcReaction reaction(this, this);
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }

  void OnDone() override {
    AfterGrpc(this);
    AfterGrpc(&request_);
    AfterGrpc(&current_);
    delete this;
  }

 private:
  // On the executor: decodes the request and sends what is ready.
  void Produce() {
    start_ = absl::Now();
    absl::Status status = DecodeRequest();
    if (status.ok()) {
      absl::StatusOr<bool> done = ProduceFrames(/*may_wait=*/false);
      if (done.ok() && !*done) {
        if (owner_->ReserveWaitingPull()) {
          owner_->waiting_executor()->Schedule([this] { ProduceWaiting(); });
          return;
        }
        done = absl::ResourceExhaustedError(absl::StrCat(
            owner_->options().max_waiting_pulls,
            " pulls already wait for versions on this shard (--max-waiting-pulls); retry later"));
      }
      status = done.status();
    }
    Complete(status);
  }

  // On the waiting pool: waits for the remaining chunks.
  void ProduceWaiting() {
    absl::Status status = ProduceFrames(/*may_wait=*/true).status();
    owner_->ReleaseWaitingPull();
    Complete(status);
  }

  void Complete(const absl::Status& status) {
    if (status.ok() && owner_->options().on_pull_call) {
      owner_->options().on_pull_call(absl::Now() - start_);
    }
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!status.ok() && !stopped_) {
        stopped_ = true;
        error_ = ToGrpcStatus(status);
        queue_.clear();
      }
      producing_done_ = true;
      finish = MaybeFinishLocked();
    }
    if (finish) FinishCall(*finish);  // Last touch of `this` by this thread.
  }

  absl::Status DecodeRequest() {
    ParameterShard* shard = owner_->shard();
    v1::ChunkHeader header;
    PayloadView payload;
    PSTRAIN_RETURN_IF_ERROR(DecodeFrame(request_, &header, &payload));
    if (payload.size() != 0) {
      return absl::InvalidArgumentError("a pull request frame carries no payload");
    }
    PSTRAIN_RETURN_IF_ERROR(
        ToAbslStatus(owner_->authorizer().CheckWorkerCredential(credential_, header.worker_id())));
    PSTRAIN_ASSIGN_OR_RETURN(ChunkPlan plan, shard->Plan(header.job_id()));
    const int index = shard->shard_index();
    std::vector<int> chunk_ids(header.chunk_ids().begin(), header.chunk_ids().end());
    if (chunk_ids.empty() && index < static_cast<int>(plan.by_shard.size())) {
      chunk_ids = plan.by_shard[index];
    }
    for (int id : chunk_ids) {
      if (id < 0 || id >= static_cast<int>(plan.chunks.size())) {
        return absl::NotFoundError(absl::StrCat("job '", header.job_id(), "' has no chunk ", id));
      }
      if (plan.chunks[id].shard != index) {
        return absl::InvalidArgumentError(absl::StrCat("chunk ", id, " of job '", header.job_id(),
                                                       "' is owned by shard ",
                                                       plan.chunks[id].shard, ", not ", index));
      }
    }
    args_.job_id = header.job_id();
    args_.worker_id = header.worker_id();
    args_.generation = header.generation();
    args_.min_version = header.version();
    args_.kind = header.kind() == v1::ChunkHeader::KIND_UNSPECIFIED
                     ? v1::ChunkHeader::KIND_PARAMETERS
                     : header.kind();
    args_.slot = header.slot();
    args_.worker_clock = header.worker_clock();
    args_.master = header.master();
    if (header.held_versions_size() > 0) {
      if (header.held_versions_size() != header.chunk_ids_size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "a pull request names ", header.chunk_ids_size(), " chunks but holds versions of ",
            header.held_versions_size(), "; held_versions needs one entry per chunk_ids entry"));
      }
      for (int64_t v : header.held_versions()) {
        if (v < -1) {
          return absl::InvalidArgumentError(
              absl::StrCat("held version ", v, " in a pull request is below -1"));
        }
      }
      held_versions_.assign(header.held_versions().begin(), header.held_versions().end());
      args_.held_epoch = header.held_epoch();
    }
    chunk_ids_ = std::move(chunk_ids);
    return absl::OkStatus();
  }

  // Queues the frames of chunk_ids_[next_chunk_...]. Without may_wait it
  // stops at the first chunk whose version is not there and returns false;
  // true once every frame is queued (or the call stopped).
  absl::StatusOr<bool> ProduceFrames(bool may_wait) {
    PullArgs& args = args_;
    for (; next_chunk_ < chunk_ids_.size(); ++next_chunk_) {
      const int id = chunk_ids_[next_chunk_];
      args.chunk_id = id;
      args.held_version = held_versions_.empty() ? -1 : held_versions_[next_chunk_];
      absl::StatusOr<PulledChunk> pulled =
          may_wait ? WaitForChunk(args) : owner_->shard()->Pull(args, absl::InfinitePast());
      if (!may_wait && pulled.status().code() == absl::StatusCode::kDeadlineExceeded) {
        return false;  // Not there yet (a past deadline only checks).
      }
      PSTRAIN_ASSIGN_OR_RETURN(PulledChunk chunk, std::move(pulled));
      v1::ChunkHeader reply;
      reply.set_chunk_id(id);
      reply.set_version(chunk.version);
      reply.set_kind(args.kind);
      reply.set_slot(args.slot);
      reply.set_num_elements(static_cast<int64_t>(chunk.values->size()));
      reply.set_values_epoch(chunk.values_epoch);
      grpc::ByteBuffer frame;
      if (chunk.delta != nullptr) {
        // Pull compression: the change since the version the client holds.
        const EncodedGradient& delta = *chunk.delta;
        reply.set_delta(true);
        reply.set_dtype(delta.dtype);
        reply.set_encoding(delta.encoding);
        reply.set_encoded_count(delta.encoded_count);
        PSTRAIN_RETURN_IF_ERROR(EncodeFrame(reply, delta.bytes.data(), delta.bytes.size(),
                                            std::shared_ptr<const void>(chunk.delta), &frame));
      } else {
        reply.set_dtype(v1::DTYPE_F32);
        PSTRAIN_RETURN_IF_ERROR(EncodeFrame(reply, chunk.values->data(),
                                            chunk.values->size() * sizeof(float),
                                            std::shared_ptr<const void>(chunk.values), &frame));
      }
      bool write_now = false;
      {
        absl::MutexLock lock(&mu_);
        if (stopped_) return true;
        queue_.emplace_back();
        queue_.back().Swap(&frame);
        write_now = StartNextWriteLocked();
      }
      if (write_now) WriteCurrent();
    }
    return true;
  }

  // ParameterShard::Pull in slices of pull_poll_interval, so that a cancelled
  // call stops waiting soon.
  absl::StatusOr<PulledChunk> WaitForChunk(const PullArgs& args) {
    for (;;) {
      {
        absl::MutexLock lock(&mu_);
        if (cancelled_) return absl::CancelledError("pull cancelled by the client");
      }
      const absl::Time now = absl::Now();
      const absl::Time slice_end = std::min(deadline_, now + owner_->options().pull_poll_interval);
      absl::StatusOr<PulledChunk> chunk = owner_->shard()->Pull(args, slice_end);
      if (chunk.ok() || chunk.status().code() != absl::StatusCode::kDeadlineExceeded ||
          absl::Now() >= deadline_) {
        return chunk;
      }
    }
  }

  void WriteCurrent() {
    BeforeGrpc(&current_);
    StartWrite(&current_);
  }
  void FinishCall(const grpc::Status& status) {
    BeforeGrpc(this);
    Finish(status);
  }

  // Moves the next queued frame into current_ if no write is outstanding.
  bool StartNextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || queue_.empty() || stopped_) return false;
    current_.Clear();
    current_.Swap(&queue_.front());
    queue_.pop_front();
    writing_ = true;
    return true;
  }

  std::optional<grpc::Status> MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finish_called_ || writing_ || !producing_done_) return std::nullopt;
    if (!stopped_ && !queue_.empty()) return std::nullopt;
    finish_called_ = true;
    return stopped_ ? error_ : grpc::Status::OK;
  }

  ShardServices::Impl* const owner_;
  const std::string credential_;  // The call's worker credential metadata.
  const absl::Time deadline_;
  // Touched by one producer task at a time (the executor's, then the
  // waiting pool's, handed over by Schedule).
  absl::Time start_;
  PullArgs args_;
  std::vector<int> chunk_ids_;
  std::vector<int64_t> held_versions_;  // Empty, or one per chunk_ids_ entry.
  size_t next_chunk_ = 0;
  grpc::ByteBuffer request_;  // Written by the read, then read by Produce.
  grpc::ByteBuffer current_;  // The frame being written.

  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool got_request_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool producing_done_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerGenericBidiReactor* NewPullReactor(ShardServices::Impl* owner,
                                               grpc::GenericCallbackServerContext* ctx) {
  return new PullReactor(owner, ctx);
}

}  // namespace pstrain
