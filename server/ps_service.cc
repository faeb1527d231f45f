#include "server/ps_service.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/support/server_callback.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc/channel.h"
#include "common/rpc/gradient_codec.h"
#include "common/rpc/grpc_order.h"
#include "common/rpc/wire.h"
#include "common/status_macros.h"
#include "pstrain/v1/service.grpc.pb.h"

namespace pstrain {
namespace {

// A thread pool that grows on demand (a task never waits for a thread while
// fewer than max_threads exist). Threads live until destruction.
// Thread-safe.
class Executor {
 public:
  explicit Executor(int max_threads) : max_threads_(std::max(1, max_threads)) {}
  ~Executor() {
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
      mu_.Await(absl::Condition(this, &Executor::HasWorkOrStop));
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

// The values of a frame's payload as floats: in place for dense F32 when
// possible, else decoded (F16/BF16, top-k, sign; common/rpc/gradient_codec.h)
// into `scratch`. DecodeFrame has checked the payload's size.
absl::StatusOr<absl::Span<const float>> PayloadFloats(const v1::ChunkHeader& header,
                                                      PayloadView* payload, PooledBuffer* scratch) {
  const int64_t n = header.num_elements();
  if (n == 0) return absl::Span<const float>();
  if (header.dtype() == v1::DTYPE_F32 && header.encoding() == v1::ChunkHeader::ENCODING_DENSE) {
    return absl::Span<const float>(
        static_cast<const float*>(payload->Contiguous(BufferPool::Default())), n);
  }
  *scratch = BufferPool::Default()->Acquire(static_cast<size_t>(n) * sizeof(float));
  float* out = static_cast<float*>(scratch->data());
  const void* src = payload->Contiguous(BufferPool::Default());
  PSTRAIN_RETURN_IF_ERROR(DecodeGradient(header, src, payload->size(), absl::MakeSpan(out, n)));
  return absl::Span<const float>(out, n);
}

// Only gradients may travel in another dtype or encoding than dense F32.
absl::Status CheckPushDtype(const v1::ChunkHeader& header) {
  const bool gradient = header.kind() == v1::ChunkHeader::KIND_GRADIENT;
  if (header.encoding() != v1::ChunkHeader::ENCODING_DENSE && !gradient) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk ", header.chunk_id(), ": encoding ",
        v1::ChunkHeader::Encoding_Name(header.encoding()), " is only accepted for gradients; ",
        v1::ChunkHeader::Kind_Name(header.kind()), " must be ENCODING_DENSE"));
  }
  switch (header.dtype()) {
    case v1::DTYPE_F32:
      return absl::OkStatus();
    case v1::DTYPE_F16:
    case v1::DTYPE_BF16:
      if (gradient) return absl::OkStatus();
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", header.chunk_id(), ": dtype ", v1::DType_Name(header.dtype()),
                       " is only accepted for gradients; ",
                       v1::ChunkHeader::Kind_Name(header.kind()), " must be DTYPE_F32"));
    default:
      return absl::InvalidArgumentError(absl::StrCat("chunk ", header.chunk_id(),
                                                     ": unsupported payload dtype ",
                                                     v1::DType_Name(header.dtype())));
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Impl: owns the executor and the two services.
// ---------------------------------------------------------------------------

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
  Executor* executor() { return &executor_; }
  // Pulls waiting for a version, one thread each (at most max_waiting_pulls
  // at a time, so that a waiting pull never queues behind the others).
  Executor* waiting_executor() { return &waiting_executor_; }
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
  // ShardControl: control path, protobuf messages, sync handlers (they run
  // on gRPC's sync-server threads, which may block).
  class Control final : public v1::ShardControl::Service {
   public:
    Control(ParameterShard* shard, int max_message_bytes, const Authorizer* authorizer)
        : shard_(shard), max_message_bytes_(max_message_bytes), authorizer_(authorizer) {}

    grpc::Status ConfigureJob(grpc::ServerContext* ctx, const v1::ConfigureJobRequest* request,
                              v1::ConfigureJobResponse*) override {
      if (grpc::Status s = Admit(*ctx, "ConfigureJob", *request); !s.ok()) return s;
      if (request->shard_index() != shard_->shard_index()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("ConfigureJob for shard ", request->shard_index(),
                                         " sent to shard ", shard_->shard_index()));
      }
      ShardJobConfig config;
      config.job_id = request->job_id();
      config.spec = request->spec();
      config.num_shards = request->num_shards();
      config.chunk_bytes = request->chunk_bytes();
      config.members.assign(request->members().begin(), request->members().end());
      config.generation = request->generation();
      std::vector<v1::ChunkValues> chunks(request->chunks().begin(), request->chunks().end());
      return ToGrpcStatus(shard_->ConfigureJob(config, chunks));
    }

    grpc::Status SetMembers(grpc::ServerContext* ctx, const v1::SetMembersRequest* request,
                            v1::SetMembersResponse* response) override {
      if (grpc::Status s = Admit(*ctx, "SetMembers", *request); !s.ok()) return s;
      std::vector<std::string> members(request->members().begin(), request->members().end());
      return ToGrpcStatus(
          shard_->SetMembers(request->job_id(), members, request->generation(), response));
    }

    grpc::Status DropJob(grpc::ServerContext* ctx, const v1::DropJobRequest* request,
                         v1::DropJobResponse*) override {
      if (grpc::Status s = Admit(*ctx, "DropJob", *request); !s.ok()) return s;
      return ToGrpcStatus(shard_->DropJob(request->job_id()));
    }

    grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListShardJobsRequest* request,
                          v1::ListShardJobsResponse* response) override {
      if (grpc::Status s = Admit(*ctx, "ListJobs", *request); !s.ok()) return s;
      for (std::string& id : shard_->JobIds()) response->add_job_ids(std::move(id));
      return grpc::Status::OK;
    }

    grpc::Status ReadChunks(grpc::ServerContext* ctx, const v1::ReadChunksRequest* request,
                            grpc::ServerWriter<v1::ChunkValues>* writer) override {
      if (grpc::Status s = Admit(*ctx, "ReadChunks", *request); !s.ok()) return s;
      ParameterShard::ReadOptions options;
      options.at_version = request->at_version();
      options.versions_only = request->versions_only();
      // A cut waits for the chunks below it within the caller's deadline.
      const absl::Time deadline =
          std::min(absl::FromChrono(ctx->deadline()), absl::Now() + absl::Minutes(10));
      absl::StatusOr<std::vector<v1::ChunkValues>> chunks =
          shard_->ReadChunks(request->job_id(), options, deadline);
      if (!chunks.ok()) return ToGrpcStatus(chunks.status());
      for (const v1::ChunkValues& c : *chunks) {
        if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
        if (!writer->Write(c)) {
          return grpc::Status(grpc::StatusCode::UNAVAILABLE, "ReadChunks: client went away");
        }
      }
      return grpc::Status::OK;
    }

   private:
    // The peer role, then the size limit.
    grpc::Status Admit(const grpc::ServerContext& ctx, const char* method,
                       const google::protobuf::Message& request) const {
      if (grpc::Status s = authorizer_->Check(ctx, Role::kPeer, method); !s.ok()) return s;
      return CheckMessageSize(request, max_message_bytes_, "ShardControl",
                              "--max-shard-control-message-bytes");
    }

    ParameterShard* const shard_;
    const int max_message_bytes_;
    const Authorizer* const authorizer_;
  };

  ParameterShard* const shard_;
  const Options options_;
  absl::Mutex waiting_mu_;
  int waiting_pulls_ ABSL_GUARDED_BY(waiting_mu_) = 0;
  // Declared after waiting_mu_: joined (destroyed) first.
  Executor executor_;
  Executor waiting_executor_;
  const std::shared_ptr<const Authorizer> authorizer_;
  Control control_;
};

namespace {

class PushReactor;

// The pacing watcher of one push stream: forwards the shard's news to the
// reactor until the reactor is done.
class StreamPacer final : public PaceWatcher {
 public:
  explicit StreamPacer(PushReactor* reactor) : reactor_(reactor) {}
  void AllowanceChanged() override;
  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  PushReactor* reactor_ ABSL_GUARDED_BY(mu_);
};

// Push: client stream of chunk frames, one reply frame with the version.
// Reading the next frames overlaps applying the current ones (at most
// kMaxQueuedFrames wait). The first frame is applied alone (it names the
// worker and the job, checked once for the stream); after it, up to
// Options::max_parallel_frames frames of the stream (different chunks) are
// decoded and applied at once on the executor, so one worker's push spreads
// the shard's update over the cores, sharded by chunk.
// Paced streams (the first frame says `paced`; sync jobs) also get credit
// frames: how many frames the stream may carry in all, from the shard's
// PaceSlack, sent whenever this stream's member or the slowest one moves on.
// State changes under mu_; gRPC Start* calls are made outside it.
class PushReactor final : public grpc::ServerGenericBidiReactor {
 public:
  PushReactor(ShardServices::Impl* owner, std::string credential)
      : owner_(owner), credential_(std::move(credential)) {
    StartSendInitialMetadata();
    reading_ = true;
    BeforeGrpc(&read_buffer_);
    StartRead(&read_buffer_);
  }

  void OnReadDone(bool ok) override {
    GrpcReaction reaction(this, &read_buffer_);
    bool start_read = false, start_drain = false;
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (!ok) {
        reads_done_ = true;
      } else if (!stopped_) {
        queue_.emplace_back();
        queue_.back().Swap(&read_buffer_);
        if (queue_.size() < kMaxQueuedFrames) start_read = reading_ = true;
        start_drain = MayStartDrainerLocked();
        if (start_drain) ++drainers_;
      }
      finish = MaybeFinishLocked();
    }
    if (start_read) {
      BeforeGrpc(&read_buffer_);
      StartRead(&read_buffer_);
    }
    if (start_drain) owner_->executor()->Schedule([this] { Drain(); });
    if (finish) DoFinish(*finish);
  }

  void OnCancel() override {
    GrpcReaction reaction(this, this);
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!stopped_) {
        stopped_ = true;
        error_ = grpc::Status(grpc::StatusCode::CANCELLED, "push cancelled by the client");
        queue_.clear();
      }
      finish = MaybeFinishLocked();
    }
    if (finish) DoFinish(*finish);
  }

  // Only credit frames are written with StartWrite (the reply goes with Finish).
  void OnWriteDone(bool ok) override {
    GrpcReaction reaction(this, &credit_buffer_);
    int64_t next = 0;
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      writing_credit_ = false;
      if (deferred_finish_) {
        finish = std::move(deferred_finish_);
        deferred_finish_.reset();
      } else if (ok && !stopped_ && credit_wanted_ > credit_sent_) {
        writing_credit_ = true;
        credit_sent_ = next = credit_wanted_;
      }
    }
    if (finish) {
      DoFinish(*finish);
      return;
    }
    if (next > 0) WriteCredit(next);
  }
  void OnDone() override {
    AfterGrpc(this);
    AfterGrpc(&read_buffer_);
    AfterGrpc(&reply_buffer_);
    AfterGrpc(&credit_buffer_);
    pacer_->Detach();  // Waits for a credit update that is running.
    delete this;
  }

  // The stream's credit from the shard's slack for its member; written
  // unless a credit write is in flight (then OnWriteDone writes the newest).
  // A stream's first credit goes out even when its member may push nothing
  // more yet (a credit of the frames applied so far): a paced client sends
  // its first frame and then waits for it, so a stream that starts when its
  // member is already ahead (a step's second push call) is held from its
  // second frame on.
  void UpdateCredit() {
    absl::StatusOr<int64_t> slack = owner_->shard()->PaceSlack(job_id_, worker_id_, pace_version_);
    if (!slack.ok()) {
      // The job just went: the client's next frame gets the error, which a
      // client waiting for a credit would never send.
      OfferCredit(max_frames_, /*slack=*/true);
      return;
    }
    OfferCredit(applied_.load() + std::max<int64_t>(*slack, 0), *slack > 0);
  }

 private:
  static constexpr size_t kMaxQueuedFrames = 4;

  // Writes `credit` unless it allows nothing new, or unless a credit write
  // is in flight (then OnWriteDone writes the newest). Without `slack` only
  // a stream's first credit goes out.
  void OfferCredit(int64_t credit, bool slack) {
    {
      absl::MutexLock lock(&mu_);
      if (finish_started_ || stopped_ || credit <= credit_wanted_) return;
      if (!slack && credit_wanted_ > 0) return;
      credit_wanted_ = credit;
      if (writing_credit_) return;
      writing_credit_ = true;
      credit_sent_ = credit;
    }
    WriteCredit(credit);
  }

  // True when another Drain task may start: none runs, or the stream's
  // first frame is applied, frames wait and fewer than the limit run.
  bool MayStartDrainerLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (stopped_ || queue_.empty()) return false;
    if (drainers_ == 0) return true;
    return first_applied_ && drainers_ < owner_->options().max_parallel_frames;
  }

  // Applies queued frames on an executor thread, beside the other drainers
  // of this stream (MayStartDrainerLocked).
  void Drain() {
    for (;;) {
      grpc::ByteBuffer frame;
      bool took = false, start_read = false, start_drain = false;
      std::optional<grpc::Status> finish;
      {
        absl::MutexLock lock(&mu_);
        if (stopped_ || queue_.empty()) {
          --drainers_;
          finish = MaybeFinishLocked();
        } else {
          took = true;
          frame.Swap(&queue_.front());
          queue_.pop_front();
          if (!reading_ && !reads_done_) start_read = reading_ = true;
          start_drain = MayStartDrainerLocked();
          if (start_drain) ++drainers_;
        }
      }
      if (start_read) {
        BeforeGrpc(&read_buffer_);
        StartRead(&read_buffer_);
      }
      if (start_drain) owner_->executor()->Schedule([this] { Drain(); });
      if (!took) {
        // Nothing taken: this thread leaves; `this` may be deleted after DoFinish.
        if (finish) DoFinish(*finish);
        return;
      }
      const absl::Time apply_start = absl::Now();
      absl::Status status = Apply(frame);
      if (status.ok() && owner_->options().on_push_frame) {
        owner_->options().on_push_frame(absl::Now() - apply_start);
      }
      if (status.ok()) {
        const int64_t applied = ++applied_;
        if (paced_.load()) {
          UpdateCredit();
        } else if (wants_credit_.load() && applied == 1) {
          // The client asked for pacing but this shard does not pace the
          // job (not sync, or --push-pacing-lead 0): one credit for every
          // frame a stream may carry, so that it stops waiting.
          OfferCredit(max_frames_, /*slack=*/true);
        }
      }
      bool more = false;
      {
        absl::MutexLock lock(&mu_);
        if (!status.ok() && !stopped_) {
          stopped_ = true;
          error_ = ToGrpcStatus(status);
          queue_.clear();
        }
        first_applied_ = true;
        more = MayStartDrainerLocked();
        if (more) ++drainers_;
      }
      if (more) owner_->executor()->Schedule([this] { Drain(); });
    }
  }

  absl::Status Apply(const grpc::ByteBuffer& frame) {
    ParameterShard* shard = owner_->shard();
    if (frame.Length() > static_cast<size_t>(kMaxFrameBytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "oversized stream: a frame of ", frame.Length(), " bytes exceeds ", kMaxFrameBytes));
    }
    v1::ChunkHeader header;
    PayloadView payload;
    PSTRAIN_RETURN_IF_ERROR(DecodeFrame(frame, &header, &payload));
    if (frames_.load() == 0) {
      // The first frame, applied alone (Drain). One stream, one worker: the credential is checked
      // once, for the worker id of the first frame, and every later frame must name it.
      PSTRAIN_RETURN_IF_ERROR(ToAbslStatus(
          owner_->authorizer().CheckWorkerCredential(credential_, header.worker_id())));
      worker_id_ = header.worker_id();
      job_id_ = header.job_id();
      PSTRAIN_ASSIGN_OR_RETURN(ChunkPlan plan, shard->Plan(job_id_));
      const int index = shard->shard_index();
      const size_t owned =
          index < static_cast<int>(plan.by_shard.size()) ? plan.by_shard[index].size() : 0;
      max_frames_ = static_cast<int64_t>(owned) * 3 + 1;
      pace_version_ = header.version();
      if (header.paced()) {
        wants_credit_ = true;
        absl::StatusOr<bool> paced = shard->WatchPace(job_id_, pacer_);
        paced_ = paced.ok() && *paced;
      }
    } else if (header.job_id() != job_id_) {
      return absl::InvalidArgumentError(
          absl::StrCat("push stream mixes jobs '", job_id_, "' and '", header.job_id(), "'"));
    } else if (header.worker_id() != worker_id_) {
      return absl::PermissionDeniedError(absl::StrCat("push stream of worker '", worker_id_,
                                                      "' names worker '", header.worker_id(), "'"));
    }
    if (frames_.fetch_add(1) + 1 > max_frames_) {
      return absl::InvalidArgumentError(absl::StrCat("oversized stream: more than ", max_frames_,
                                                     " frames for job '", job_id_, "'"));
    }
    PSTRAIN_RETURN_IF_ERROR(CheckPushDtype(header));
    PooledBuffer scratch;
    PSTRAIN_ASSIGN_OR_RETURN(absl::Span<const float> values,
                             PayloadFloats(header, &payload, &scratch));
    PushArgs args;
    args.job_id = header.job_id();
    args.worker_id = header.worker_id();
    args.generation = header.generation();
    args.chunk_id = header.chunk_id();
    args.version = header.version();
    args.kind = header.kind();
    args.slot = header.slot();
    args.worker_clock = header.worker_clock();
    args.incarnation = header.incarnation();
    args.update_seq = header.update_seq();
    args.payload_bytes = static_cast<int64_t>(payload.size());
    const auto& cut = owner_->options().cut_push_stream;
    if (cut && cut(header, /*applied=*/false)) return InjectedCut();
    PSTRAIN_ASSIGN_OR_RETURN(int64_t version, shard->Push(args, values));
    if (cut && cut(header, /*applied=*/true)) return InjectedCut();
    absl::MutexLock lock(&mu_);
    min_version_ = std::min(min_version_, version);
    last_kind_ = header.kind();
    return absl::OkStatus();
  }

  static absl::Status InjectedCut() {
    return absl::UnavailableError("push stream cut (injected fault)");
  }

  // The status to finish with once nothing is running or pending, at most
  // once. A stopped stream does not wait for its outstanding read: a paced
  // client may send nothing more until a credit that will not come.
  std::optional<grpc::Status> MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || drainers_ > 0 || (reading_ && !stopped_)) return std::nullopt;
    if (!stopped_ && !(reads_done_ && queue_.empty())) return std::nullopt;
    finished_ = true;
    return stopped_ ? error_ : grpc::Status::OK;
  }

  // Called once, outside mu_, as the last touch of `this` by its caller
  // (deferred to OnWriteDone while a credit frame is being written).
  void DoFinish(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (writing_credit_) {
        deferred_finish_ = status;
        return;
      }
      finish_started_ = true;
    }
    BeforeGrpc(this);
    if (!status.ok()) {
      Finish(status);
      return;
    }
    v1::ChunkHeader reply;
    reply.set_job_id(job_id_);
    {
      absl::MutexLock lock(&mu_);
      reply.set_kind(last_kind_);
      reply.set_version(frames_.load() == 0 ? 0 : min_version_);
    }
    absl::Status encoded = EncodeFrame(reply, nullptr, 0, &reply_buffer_);
    if (!encoded.ok()) {
      Finish(ToGrpcStatus(encoded));
      return;
    }
    BeforeGrpc(&reply_buffer_);
    StartWriteAndFinish(&reply_buffer_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void WriteCredit(int64_t credit) {
    v1::ChunkHeader header;
    header.set_credit(credit);
    if (!EncodeFrame(header, nullptr, 0, &credit_buffer_).ok()) return;  // A header only.
    BeforeGrpc(&credit_buffer_);
    StartWrite(&credit_buffer_);
  }

  ShardServices::Impl* const owner_;
  const std::string credential_;   // The call's worker credential metadata.
  grpc::ByteBuffer read_buffer_;   // Target of the one outstanding read.
  grpc::ByteBuffer reply_buffer_;  // The reply frame.
  grpc::ByteBuffer credit_buffer_;  // The credit frame being written.
  const std::shared_ptr<StreamPacer> pacer_ = std::make_shared<StreamPacer>(this);

  // Written by the drainer of the first frame, which runs alone; read-only
  // once first_applied_ lets other drainers start (ordered by mu_).
  std::string worker_id_;
  std::string job_id_;
  int64_t max_frames_ = 0;
  int64_t pace_version_ = 0;        // The version the stream's frames push.
  std::atomic<int64_t> frames_{0};  // Frames taken for applying.
  std::atomic<int64_t> applied_{0};  // Frames applied.
  std::atomic<bool> paced_{false};   // The shard paces this stream.
  std::atomic<bool> wants_credit_{false};  // The first frame said `paced`.

  absl::Mutex mu_;
  int64_t min_version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::max();
  v1::ChunkHeader::Kind last_kind_ ABSL_GUARDED_BY(mu_) = v1::ChunkHeader::KIND_UNSPECIFIED;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;     // A read is outstanding.
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;  // The client half-closed.
  int drainers_ ABSL_GUARDED_BY(mu_) = 0;         // Drain tasks running or queued.
  bool first_applied_ ABSL_GUARDED_BY(mu_) = false;  // Others may drain beside.
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;     // Error or cancel: apply nothing more.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status error_ ABSL_GUARDED_BY(mu_);
  // Credits: the newest computed, the last written, a write in flight, and
  // Finish started or waiting for that write.
  int64_t credit_wanted_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t credit_sent_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_credit_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_started_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> deferred_finish_ ABSL_GUARDED_BY(mu_);
};

void StreamPacer::AllowanceChanged() {
  absl::MutexLock lock(&mu_);
  if (reactor_ != nullptr) reactor_->UpdateCredit();
}

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

// Ends the call at once with `status` (unknown method, not authorized).
class RefusingReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit RefusingReactor(const grpc::Status& status) {
    BeforeGrpc(this);
    Finish(status);
  }
  void OnDone() override {
    AfterGrpc(this);
    delete this;
  }
};

}  // namespace

grpc::ServerGenericBidiReactor* ShardServices::Impl::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  const bool push = ctx->method() == kPushMethod;
  if (!push && ctx->method() != kPullMethod) {
    return new RefusingReactor(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                            absl::StrCat("unknown method ", ctx->method())));
  }
  grpc::Status admitted = authorizer_->Check(*ctx, Role::kWorker, push ? "Push" : "Pull");
  if (!admitted.ok()) return new RefusingReactor(admitted);
  if (push) return new PushReactor(this, Authorizer::WorkerCredentialOf(*ctx));
  return new PullReactor(this, ctx);
}

ShardServices::ShardServices(ParameterShard* shard, Options options)
    : impl_(std::make_unique<Impl>(shard, options)) {
  if (options.tune_allocator) TuneAllocatorForLargeMessages();
}

ShardServices::~ShardServices() = default;

void ShardServices::Register(grpc::ServerBuilder* builder) { impl_->Register(builder); }

}  // namespace pstrain
