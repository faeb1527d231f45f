#include "server/push_reactor.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc/channel.h"
#include "common/rpc/gradient_codec.h"
#include "common/rpc/grpc_order.h"
#include "common/rpc/wire.h"
#include "common/status_macros.h"
#include "server/ps_service_impl.h"

namespace pstrain {
namespace {

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

class PushReactor;

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
  const std::string credential_;    // The call's worker credential metadata.
  grpc::ByteBuffer read_buffer_;    // Target of the one outstanding read.
  grpc::ByteBuffer reply_buffer_;   // The reply frame.
  grpc::ByteBuffer credit_buffer_;  // The credit frame being written.
  const std::shared_ptr<StreamPacer> pacer_ = std::make_shared<StreamPacer>(this);

  // Written by the drainer of the first frame, which runs alone; read-only
  // once first_applied_ lets other drainers start (ordered by mu_).
  std::string worker_id_;
  std::string job_id_;
  int64_t max_frames_ = 0;
  int64_t pace_version_ = 0;               // The version the stream's frames push.
  std::atomic<int64_t> frames_{0};         // Frames taken for applying.
  std::atomic<int64_t> applied_{0};        // Frames applied.
  std::atomic<bool> paced_{false};         // The shard paces this stream.
  std::atomic<bool> wants_credit_{false};  // The first frame said `paced`.

  absl::Mutex mu_;
  int64_t min_version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::max();
  v1::ChunkHeader::Kind last_kind_ ABSL_GUARDED_BY(mu_) = v1::ChunkHeader::KIND_UNSPECIFIED;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;        // A read is outstanding.
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;     // The client half-closed.
  int drainers_ ABSL_GUARDED_BY(mu_) = 0;            // Drain tasks running or queued.
  bool first_applied_ ABSL_GUARDED_BY(mu_) = false;  // Others may drain beside.
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;        // Error or cancel: apply nothing more.
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

}  // namespace

grpc::ServerGenericBidiReactor* NewPushReactor(ShardServices::Impl* owner, std::string credential) {
  return new PushReactor(owner, std::move(credential));
}

}  // namespace pstrain
