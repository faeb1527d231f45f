// PsClient over gRPC's generic callback API: two channels (connections) per shard,
// one for pushes and one for pulls, one
// client-streaming Push or server-streaming Pull per shard and operation
// (the pushes on a connection one after another, in the order they were
// made: WriteTurns), all driven by gRPC's callback threads (no thread of ours blocks on the
// network, so no pool is needed here).
//
// Zero-copy send: every push frame's payload slice points at the caller's
// buffer and holds a reference token; an operation completes only after every
// call has ended AND gRPC has released every such slice, so the caller may
// reuse its buffers as soon as Wait() returns.
//
// Receive: pull replies are copied once, straight from the received slices
// into the caller's destination.
//
// Retries: calls are made wait_for_ready, so a shard that is not reachable yet
// (starting, restarting) is retried by the channel with backoff (capped at
// 1 s, common/rpc/channel.cc). A call that fails with UNAVAILABLE (a cut
// stream, a restarted server) or DEADLINE_EXCEEDED (one attempt's
// deadline, Options::attempt_timeout) is made again after a backoff until
// the operation's deadline (Options::rpc_timeout) has passed: a push with
// the same update id (incarnation, update_seq), so that the frames the shard
// had already applied are acknowledged and not applied twice; a pull for the
// chunks not yet received. Other errors are returned as they are.
#include "worker/ps_client.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/client_callback.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/rpc/channel.h"
#include "common/rpc/gradient_codec.h"
#include "common/rpc/grpc_order.h"
#include "common/rpc/wire.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

using GenericReactor = grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>;

// State shared by an operation's handle, its calls and its payload slices.
// Thread-safe.
class OpState {
 public:
  explicit OpState(int calls) : pending_calls_(calls) {}

  void Fail(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = status;
  }
  void CallDone(const absl::Status& status, int64_t min_version) {
    absl::MutexLock lock(&mu_);
    if (status_.ok() && !status.ok()) status_ = status;
    if (status.ok()) version_ = std::min(version_, min_version);
    --pending_calls_;
  }
  void SliceTaken() {
    absl::MutexLock lock(&mu_);
    ++pending_slices_;
  }
  void SliceReleased() {
    absl::MutexLock lock(&mu_);
    --pending_slices_;
  }

  absl::Status Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &OpState::DoneLocked));
    return status_;
  }
  bool Done() const {
    absl::MutexLock lock(&mu_);
    return DoneLocked();
  }
  int64_t version() const {
    absl::MutexLock lock(&mu_);
    return version_ == std::numeric_limits<int64_t>::max() ? 0 : version_;
  }

  // The calls in flight, for Cancel(): a call registers its context once
  // gRPC holds it (false: the operation was cancelled, cancel it now) and
  // unregisters in OnDone. Weak, so Cancel() never keeps an ended call's
  // context, and TryCancel runs outside mu_ (gRPC may run OnDone inline).
  bool Register(const std::shared_ptr<grpc::ClientContext>& ctx) {
    absl::MutexLock lock(&mu_);
    live_.emplace(ctx.get(), ctx);
    return !cancelled_;
  }
  void Unregister(grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    live_.erase(ctx);
  }
  bool cancelled() const {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }
  void Cancel() {
    std::vector<std::shared_ptr<grpc::ClientContext>> live;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      for (const auto& [raw, weak] : live_) {
        if (std::shared_ptr<grpc::ClientContext> ctx = weak.lock()) live.push_back(std::move(ctx));
      }
    }
    for (const auto& ctx : live) ctx->TryCancel();
  }

 private:
  bool DoneLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pending_calls_ == 0 && pending_slices_ == 0;
  }

  mutable absl::Mutex mu_;
  int pending_calls_ ABSL_GUARDED_BY(mu_);
  int64_t pending_slices_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int64_t version_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::max();
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::map<grpc::ClientContext*, std::weak_ptr<grpc::ClientContext>> live_ ABSL_GUARDED_BY(mu_);
};

class Op final : public PendingOp {
 public:
  explicit Op(std::shared_ptr<OpState> state) : state_(std::move(state)) {}
  // Buffers must not be touched by gRPC after the handle is gone.
  ~Op() override { state_->Wait().IgnoreError(); }
  absl::Status Wait() override { return state_->Wait(); }
  int64_t version() const override { return state_->version(); }
  bool Done() const override { return state_->Done(); }
  void Cancel() override { state_->Cancel(); }

 private:
  std::shared_ptr<OpState> state_;
};

std::unique_ptr<PendingOp> FailedOp(const absl::Status& status) {
  auto state = std::make_shared<OpState>(1);
  state->CallDone(status, 0);
  return std::make_unique<Op>(std::move(state));
}

// Push calls on one connection run one after another, in the order they
// were started: a call takes the turn before it starts and hands it on when
// it has ended. A step may push its layers as separate calls, and a shard
// answers a sync pull's chunks in push order, each once every worker's push
// of it is in; calls that shared a connection side by side delivered every
// layer's chunks late, and the pull waited on them. Handing the turn on
// when the last frame is written is not enough: HTTP/2 flow control then
// still lets the next call's frames overtake the last ones (docs/
// BENCHMARKS.md, "One push at a time"). Thread-safe.
class WriteTurns {
 public:
  // Runs `start` now if no call holds the turn, else once the calls ahead
  // of it have released it (on the releasing thread).
  void Take(std::function<void()> start) {
    {
      absl::MutexLock lock(&mu_);
      if (held_) {
        waiting_.push_back(std::move(start));
        return;
      }
      held_ = true;
    }
    start();
  }
  // The holder has ended: the next waiting call starts.
  void Release() {
    std::function<void()> next;
    {
      absl::MutexLock lock(&mu_);
      if (waiting_.empty()) {
        held_ = false;
        return;
      }
      next = std::move(waiting_.front());
      waiting_.pop_front();
    }
    next();
  }

 private:
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::function<void()>> waiting_ ABSL_GUARDED_BY(mu_);
};

// One connection of one shard, for pushes or for pulls.
struct ShardChannel {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
  WriteTurns push_turns;  // Push connections only.
};

// The connections of one shard. Pushes and pulls on separate ones: with TLS
// each connection's records are sealed and opened by one thread at a time,
// so a pipelined push and pull on one connection share a core; on two they
// do not. Options::connections_per_shard of each.
struct ShardConnections {
  std::vector<std::shared_ptr<ShardChannel>> push, pull;
};

// Deals `items` round-robin into at most `ways` non-empty groups.
template <typename T>
std::vector<std::vector<T>> Deal(std::vector<T> items, int ways) {
  std::vector<std::vector<T>> groups(std::min<size_t>(static_cast<size_t>(ways), items.size()));
  for (size_t i = 0; i < items.size(); ++i)
    groups[i % groups.size()].push_back(std::move(items[i]));
  return groups;
}

// Retry policy of one operation's calls (constant).
struct RetryPolicy {
  absl::Time deadline;             // Of the whole operation.
  absl::Duration attempt_timeout;  // Of one call.
};

// True when a failed call may be made again (with the same update id).
bool RetryableCall(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsDeadlineExceeded(status);
}

// The backoff before attempt `attempt` (1 = the first retry): 50 ms doubling,
// capped at 1 s.
absl::Duration RetryBackoff(int attempt) {
  return std::min(absl::Milliseconds(50) * (int64_t{1} << std::min(attempt - 1, 5)),
                  absl::Seconds(1));
}

// One attempt's deadline: attempt_timeout from now, never past the operation's.
std::chrono::system_clock::time_point AttemptDeadline(const RetryPolicy& retry) {
  return absl::ToChronoTime(std::min(retry.deadline, absl::Now() + retry.attempt_timeout));
}

// Runs `start` after `delay` on a short-lived thread (retries are rare; a
// gRPC callback thread must not sleep).
void StartAfter(absl::Duration delay, std::function<void()> start) {
  std::thread([delay, start = std::move(start)] {
    absl::SleepFor(delay);
    start();
  }).detach();
}

// Status of a finished call: a call that never reached the server (no
// initial metadata) and ran out of time reports the shard as unreachable.
absl::Status CallStatus(const grpc::Status& status, bool reached_server, const std::string& address,
                        const char* what) {
  if (status.ok()) return absl::OkStatus();
  if (!reached_server && (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                          status.error_code() == grpc::StatusCode::UNAVAILABLE)) {
    return absl::UnavailableError(
        absl::StrCat(what, " to shard ", address, ": shard unreachable: ", status.error_message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(status.error_code())),
                      absl::StrCat(what, " to shard ", address, ": ", status.error_message()));
}

// One client-streaming Push to one shard. Deletes itself when done.
class PushCall final : public GenericReactor {
 public:
  struct Frame {
    int chunk_id;
    int64_t count;        // Elements the payload represents.
    const void* payload;  // The caller's F32 values, or encoded->bytes.
    size_t payload_bytes;
    // An encoded gradient (compression): owns the payload until every
    // attempt's slice of it is released. Null for the caller's F32 values.
    std::shared_ptr<const EncodedGradient> encoded;
  };

  PushCall(std::shared_ptr<ShardChannel> shard, std::shared_ptr<OpState> op,
           v1::ChunkHeader header_template, std::vector<Frame> frames, RetryPolicy retry,
           int attempt = 0)
      : shard_(std::move(shard)),
        op_(std::move(op)),
        header_(std::move(header_template)),
        frames_(std::move(frames)),
        retry_(retry),
        attempt_(attempt) {
    // A paced stream carries its first frame, then waits for the shard's
    // first credit (which every shard sends a paced stream after its first
    // frame). Sent freely, the rest of a call went into the socket before
    // the shard could hold it back, so a step's second call was not paced.
    if (header_.paced()) credit_ = 1;
    ctx_->set_deadline(AttemptDeadline(retry_));
    ctx_->set_wait_for_ready(true);
  }

  // Starts the call once it holds the connection's turn.
  void Start() {
    shard_->push_turns.Take([this] { StartNow(); });
  }

  void OnReadInitialMetadataDone(bool ok) override {
    GrpcReaction reaction(this, this);
    reached_server_ = ok;
  }

  void OnWriteDone(bool ok) override {
    GrpcReaction reaction(this, &buffer_);
    if (ok) WriteNext();  // Else the stream broke: the status comes in OnDone.
  }

  // A credit frame (then the next read), or the reply.
  void OnReadDone(bool ok) override {
    GrpcReaction reaction(this, &reply_);
    if (!ok) return;
    v1::ChunkHeader reply;
    PayloadView payload;
    if (!DecodeFrame(reply_, &reply, &payload).ok()) return;
    if (reply.credit() <= 0) {
      version_ = reply.version();
      return;
    }
    bool resume = false;
    {
      absl::MutexLock lock(&mu_);
      credit_ = std::max(credit_, reply.credit());
      resume = std::exchange(waiting_for_credit_, false);
    }
    BeforeGrpc(&reply_);
    StartRead(&reply_);
    if (resume) WriteNext();
  }

  void OnDone(const grpc::Status& status) override {
    AfterGrpc(this);
    AfterGrpc(&reply_);
    AfterGrpc(&buffer_);
    shard_->push_turns.Release();  // The next push on this connection starts.
    op_->Unregister(ctx_.get());
    const absl::Status result = CallStatus(status, reached_server_, shard_->address, "push");
    const absl::Duration backoff = RetryBackoff(attempt_ + 1);
    if (!encode_failed_ && RetryableCall(result) && !op_->cancelled() &&
        absl::Now() + backoff < retry_.deadline) {
      // The same frames with the same update id: what the shard applied
      // before the failure is acknowledged, not applied again.
      auto* again = new PushCall(shard_, op_, header_, frames_, retry_, attempt_ + 1);
      StartAfter(backoff, [again] { again->Start(); });
      delete this;
      return;
    }
    // The reactor (and its ClientContext, which holds a reference to the
    // channel) goes before the operation is reported done: a caller that
    // returns from Wait() and drops the client then drops the channel's
    // last reference on its own thread, not on a gRPC thread that may
    // still be tearing the channel down when the process exits.
    const std::shared_ptr<OpState> op = op_;
    const int64_t version = version_;
    delete this;
    op->CallDone(result, version);
  }

 private:
  void StartNow() {
    shard_->stub->PrepareBidiStreamingCall(ctx_.get(), kPushMethod, grpc::StubOptions(), this);
    if (!op_->Register(ctx_)) ctx_->TryCancel();  // Cancelled before this attempt.
    BeforeGrpc(&reply_);
    StartRead(&reply_);
    WriteNext();
    BeforeGrpc(this);
    StartCall();
  }

  // Writes the next frame, or half-closes after the last; waits instead
  // when the shard's credit (once one came) does not cover it. One write
  // at a time: called at the start, when a write is done, or when a credit
  // frees a waiting stream.
  void WriteNext() {
    {
      absl::MutexLock lock(&mu_);
      if (next_ < frames_.size() && credit_ >= 0 && static_cast<int64_t>(next_) >= credit_) {
        waiting_for_credit_ = true;
        return;
      }
    }
    if (next_ == frames_.size()) {
      BeforeGrpc(this);
      StartWritesDone();
      return;
    }
    const Frame& f = frames_[next_++];
    header_.set_chunk_id(f.chunk_id);
    header_.set_num_elements(f.count);
    header_.set_dtype(f.encoded ? f.encoded->dtype : v1::DTYPE_F32);
    header_.set_encoding(f.encoded ? f.encoded->encoding : v1::ChunkHeader::ENCODING_DENSE);
    header_.set_encoded_count(f.encoded ? f.encoded->encoded_count : 0);
    // The token's release tells the operation that gRPC let go of the slice
    // (and frees an encoded payload no attempt still holds).
    op_->SliceTaken();
    OpState* raw = op_.get();
    std::shared_ptr<const void> token(
        raw, [op = op_, keep = f.encoded](const void*) { op->SliceReleased(); });
    absl::Status encoded =
        EncodeFrame(header_, f.payload, f.payload_bytes, std::move(token), &buffer_);
    if (!encoded.ok()) {
      encode_failed_ = true;
      op_->Fail(encoded);
      ctx_->TryCancel();
      return;
    }
    BeforeGrpc(&buffer_);
    StartWrite(&buffer_);
  }

  const std::shared_ptr<ShardChannel> shard_;
  const std::shared_ptr<OpState> op_;
  // Shared with OpState's registry (weakly) so that Cancel() can reach it.
  const std::shared_ptr<grpc::ClientContext> ctx_ = std::make_shared<grpc::ClientContext>();
  v1::ChunkHeader header_;
  const std::vector<Frame> frames_;
  const RetryPolicy retry_;
  const int attempt_;
  bool encode_failed_ = false;  // Set before TryCancel; read in OnDone.
  size_t next_ = 0;             // Touched by one WriteNext at a time (ordered by mu_).
  grpc::ByteBuffer buffer_;  // The frame being written.
  grpc::ByteBuffer reply_;
  absl::Mutex mu_;
  int64_t credit_ ABSL_GUARDED_BY(mu_) = -1;  // Frames the shard allows in all; -1: unpaced.
  bool waiting_for_credit_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> reached_server_{false};
  int64_t version_ = 0;
};

// One server-streaming Pull from one shard. Deletes itself when done.
class PullCall final : public GenericReactor {
 public:
  struct Dest {
    int chunk_id;
    float* values;
    int64_t count;
    PsClient::HeldValues* held;  // May be null.
  };

  PullCall(std::shared_ptr<ShardChannel> shard, std::shared_ptr<OpState> op,
           v1::ChunkHeader request, std::vector<Dest> dests, RetryPolicy retry, int attempt = 0,
           int64_t min_version = std::numeric_limits<int64_t>::max())
      : shard_(std::move(shard)),
        op_(std::move(op)),
        request_header_(std::move(request)),
        dests_(std::move(dests)),
        retry_(retry),
        attempt_(attempt),
        min_version_(min_version) {
    ctx_->set_deadline(AttemptDeadline(retry_));
    ctx_->set_wait_for_ready(true);
    v1::ChunkHeader with_ids = request_header_;
    for (const Dest& d : dests_) with_ids.add_chunk_ids(d.chunk_id);
    // Pull compression: offer the held versions of one epoch (a shard has
    // one per job) as delta bases; a pull of the master values takes them
    // whole.
    uint64_t epoch = 0;
    for (const Dest& d : dests_) {
      if (request_header_.master()) break;
      if (d.held != nullptr && d.held->version >= 0 && d.held->epoch != 0) {
        epoch = d.held->epoch;
        break;
      }
    }
    if (epoch != 0) {
      with_ids.set_held_epoch(epoch);
      for (const Dest& d : dests_) {
        const bool offered = d.held != nullptr && d.held->epoch == epoch;
        with_ids.add_held_versions(offered ? d.held->version : -1);
      }
    }
    request_status_ = EncodeFrame(with_ids, nullptr, 0, &request_);
  }

  void Start() {
    shard_->stub->PrepareBidiStreamingCall(ctx_.get(), kPullMethod, grpc::StubOptions(), this);
    if (!op_->Register(ctx_)) ctx_->TryCancel();  // Cancelled before this attempt.
    if (!request_status_.ok()) {
      error_ = request_status_;
      ctx_->TryCancel();
    } else {
      BeforeGrpc(&request_);
      StartWriteLast(&request_, grpc::WriteOptions());
      BeforeGrpc(&reply_);
      StartRead(&reply_);
    }
    BeforeGrpc(this);
    StartCall();
  }

  void OnReadInitialMetadataDone(bool ok) override {
    GrpcReaction reaction(this, this);
    reached_server_ = ok;
  }

  void OnReadDone(bool ok) override {
    GrpcReaction reaction(this, &reply_);
    if (!ok) return;  // End of stream: the status comes in OnDone.
    absl::Status status = Receive();
    if (!status.ok()) {
      error_ = status;
      ctx_->TryCancel();
      return;
    }
    BeforeGrpc(&reply_);
    StartRead(&reply_);
  }

  void OnDone(const grpc::Status& status) override {
    AfterGrpc(this);
    AfterGrpc(&request_);
    AfterGrpc(&reply_);
    op_->Unregister(ctx_.get());
    absl::Status result = error_;
    if (result.ok()) result = CallStatus(status, reached_server_, shard_->address, "pull");
    if (result.ok() && next_ != dests_.size()) {
      result =
          absl::InternalError(absl::StrCat("pull from shard ", shard_->address, " ended after ",
                                           next_, " of ", dests_.size(), " chunks"));
    }
    const absl::Duration backoff = RetryBackoff(attempt_ + 1);
    if (error_.ok() && RetryableCall(result) && !op_->cancelled() &&
        absl::Now() + backoff < retry_.deadline) {
      // Pulls are idempotent: ask again for the chunks not received yet.
      std::vector<Dest> rest(dests_.begin() + static_cast<ptrdiff_t>(next_), dests_.end());
      auto* again = new PullCall(shard_, op_, request_header_, std::move(rest), retry_,
                                 attempt_ + 1, min_version_);
      StartAfter(backoff, [again] { again->Start(); });
      delete this;
      return;
    }
    // The reactor (and its ClientContext, which holds a reference to the
    // channel) goes before the operation is reported done: a caller that
    // returns from Wait() and drops the client then drops the channel's
    // last reference on its own thread, not on a gRPC thread that may
    // still be tearing the channel down when the process exits.
    const std::shared_ptr<OpState> op = op_;
    const int64_t version = min_version_;
    delete this;
    op->CallDone(result, version);
  }

 private:
  absl::Status Receive() {
    v1::ChunkHeader header;
    PayloadView payload;
    absl::Status decoded = DecodeFrame(reply_, &header, &payload);
    if (!decoded.ok())
      return absl::InternalError(absl::StrCat("bad pull reply: ", decoded.message()));
    if (next_ >= dests_.size()) {
      return absl::InternalError(
          absl::StrCat("shard ", shard_->address, " sent more than ", dests_.size(), " chunks"));
    }
    const Dest& d = dests_[next_];
    const bool dense_f32 =
        header.dtype() == v1::DTYPE_F32 && header.encoding() == v1::ChunkHeader::ENCODING_DENSE;
    if (header.chunk_id() != d.chunk_id || header.num_elements() != d.count ||
        (!header.delta() && !dense_f32)) {
      return absl::InternalError(absl::StrCat(
          "shard ", shard_->address, " sent chunk ", header.chunk_id(), " (", header.num_elements(),
          " x ", v1::DType_Name(header.dtype()), header.delta() ? ", a delta" : "",
          ") where chunk ", d.chunk_id, " (", d.count, " x DTYPE_F32) was expected"));
    }
    if (header.delta()) {
      // Pull compression: the change since the version held, of the same epoch.
      if (d.held == nullptr || d.held->version < 0 || d.held->version + 1 != header.version() ||
          header.values_epoch() == 0 || header.values_epoch() != d.held->epoch) {
        return absl::InternalError(absl::StrCat(
            "shard ", shard_->address, " sent a delta to version ", header.version(), " of chunk ",
            d.chunk_id, " (epoch ", header.values_epoch(), ") where the client holds version ",
            d.held == nullptr ? -1 : d.held->version, " (epoch ",
            d.held == nullptr ? 0 : d.held->epoch, ")"));
      }
      const void* bytes = payload.Contiguous(BufferPool::Default());
      absl::Status added = AddEncodedDelta(header, bytes, payload.size(),
                                           absl::MakeSpan(d.values, d.count), &decoded_);
      if (!added.ok()) {
        return absl::InternalError(
            absl::StrCat("bad delta from shard ", shard_->address, ": ", added.message()));
      }
    } else {
      payload.CopyTo(d.values);
    }
    if (d.held != nullptr) {
      // The master values are not what the shard publishes: no delta base.
      *d.held = request_header_.master()
                    ? PsClient::HeldValues{}
                    : PsClient::HeldValues{header.version(), header.values_epoch()};
    }
    min_version_ = std::min(min_version_, header.version());
    ++next_;
    return absl::OkStatus();
  }

  const std::shared_ptr<ShardChannel> shard_;
  const std::shared_ptr<OpState> op_;
  // Shared with OpState's registry (weakly) so that Cancel() can reach it.
  const std::shared_ptr<grpc::ClientContext> ctx_ = std::make_shared<grpc::ClientContext>();
  const v1::ChunkHeader request_header_;  // Without chunk_ids (a retry asks for the rest).
  const std::vector<Dest> dests_;
  const RetryPolicy retry_;
  const int attempt_;
  grpc::ByteBuffer request_;
  absl::Status request_status_;
  grpc::ByteBuffer reply_;
  size_t next_ = 0;  // Reads are sequential: touched by one callback at a time.
  std::vector<float> decoded_;  // A delta's values (as next_).
  int64_t min_version_;  // Lowest version received, earlier attempts included.
  std::atomic<bool> reached_server_{false};
  absl::Status error_;  // Set by a read callback before TryCancel; read in OnDone.
};

class GrpcPsClient final : public PsClient {
 public:
  GrpcPsClient(Options options, ChunkPlan plan, uint64_t incarnation)
      : options_(std::move(options)),
        plan_(std::move(plan)),
        incarnation_(incarnation),
        generation_(options_.generation) {
    if (options_.compression.method() != v1::CompressionSpec::COMPRESSION_NONE) {
      encoder_ = std::make_unique<GradientEncoder>(options_.compression, plan_);
      encoder_thread_ = std::thread([this] { EncoderLoop(); });
    }
    for (const std::string& address : options_.shard_addresses) {
      ShardConnections shard;
      for (int i = 0; i < options_.connections_per_shard; ++i) {
        shard.push.push_back(Connect(address, absl::StrCat("push-", i)));
        shard.pull.push_back(Connect(address, absl::StrCat("pull-", i)));
      }
      shards_.push_back(std::move(shard));
    }
  }

  // A connection of its own (distinct channel arguments are distinct
  // connections in gRPC).
  std::shared_ptr<ShardChannel> Connect(const std::string& address, std::string name) const {
    ChannelOptions options = options_.channel;
    options.connection_name = std::move(name);
    auto shard = std::make_shared<ShardChannel>();
    shard->address = address;
    shard->channel = CreateChannel(address, options);
    shard->stub = std::make_unique<grpc::GenericStub>(shard->channel);
    return shard;
  }

  // The calls a push or pull makes to a shard for `items` chunks: one per
  // connection, at most one per chunk.
  int CallsFor(size_t items) const {
    return static_cast<int>(std::min(items, static_cast<size_t>(options_.connections_per_shard)));
  }
  template <typename T>
  int CountCalls(const std::vector<std::vector<T>>& by_shard) const {
    int calls = 0;
    for (const auto& items : by_shard) calls += CallsFor(items.size());
    return calls;
  }

  std::unique_ptr<PendingOp> Push(v1::ChunkHeader::Kind kind, int64_t version, int worker_clock,
                                  std::vector<ChunkRef> chunks, int slot) override {
    std::vector<std::vector<PushCall::Frame>> by_shard(shards_.size());
    for (const ChunkRef& c : chunks) {
      absl::Status valid = CheckChunk(c.chunk_id, c.values);
      if (!valid.ok()) return FailedOp(valid);
      const ChunkInfo& info = plan_.chunks[c.chunk_id];
      by_shard[info.shard].push_back(
          {c.chunk_id, info.count, c.values, static_cast<size_t>(info.count) * 4, nullptr});
    }
    v1::ChunkHeader header = BaseHeader(kind, version, worker_clock, slot);
    header.set_paced(options_.pace_pushes);
    header.set_incarnation(incarnation_);
    header.set_update_seq(next_update_seq_.fetch_add(1));
    auto op = std::make_shared<OpState>(CountCalls(by_shard));
    Track(op);
    const RetryPolicy retry = Retry();
    if (encoder_ != nullptr && kind == v1::ChunkHeader::KIND_GRADIENT) {
      // Encoded on the encoder thread, in Push order, never on the caller's
      // (the trainer's, in the middle of backward).
      absl::MutexLock lock(&encode_mu_);
      encode_queue_.push_back({std::move(header), std::move(by_shard), op, retry});
      return std::make_unique<Op>(std::move(op));
    }
    std::vector<PushCall*> calls;
    for (size_t s = 0; s < shards_.size(); ++s) {
      std::vector<std::vector<PushCall::Frame>> groups =
          Deal(std::move(by_shard[s]), options_.connections_per_shard);
      for (size_t i = 0; i < groups.size(); ++i) {
        calls.push_back(new PushCall(shards_[s].push[i], op, header, std::move(groups[i]), retry));
      }
    }
    for (PushCall* call : calls) call->Start();
    return std::make_unique<Op>(std::move(op));
  }

  std::unique_ptr<PendingOp> Pull(v1::ChunkHeader::Kind kind, int64_t min_version, int worker_clock,
                                  std::vector<ChunkDest> chunks, int slot, bool master) override {
    std::vector<std::vector<PullCall::Dest>> by_shard(shards_.size());
    for (const ChunkDest& c : chunks) {
      absl::Status valid = CheckChunk(c.chunk_id, c.values);
      if (!valid.ok()) return FailedOp(valid);
      const ChunkInfo& info = plan_.chunks[c.chunk_id];
      by_shard[info.shard].push_back({c.chunk_id, c.values, info.count, c.held});
    }
    v1::ChunkHeader request = BaseHeader(kind, min_version, worker_clock, slot);
    request.set_master(master);
    std::vector<PullCall*> calls;
    auto op = std::make_shared<OpState>(CountCalls(by_shard));
    Track(op);
    const RetryPolicy retry = Retry();
    for (size_t s = 0; s < shards_.size(); ++s) {
      std::vector<std::vector<PullCall::Dest>> groups =
          Deal(std::move(by_shard[s]), options_.connections_per_shard);
      for (size_t i = 0; i < groups.size(); ++i) {
        calls.push_back(new PullCall(shards_[s].pull[i], op, request, std::move(groups[i]), retry));
      }
    }
    for (PullCall* call : calls) call->Start();
    return std::make_unique<Op>(std::move(op));
  }

  ~GrpcPsClient() override {
    if (!encoder_thread_.joinable()) return;
    {
      absl::MutexLock lock(&encode_mu_);
      stop_encoder_ = true;  // The loop drains the queue first.
    }
    encoder_thread_.join();
  }

  void SetGeneration(int64_t generation) override { generation_.store(generation); }
  const ChunkPlan& plan() const override { return plan_; }
  uint64_t incarnation() const override { return incarnation_; }

  void CancelAll() override {
    std::vector<std::shared_ptr<OpState>> live;
    {
      absl::MutexLock lock(&live_mu_);
      cancelled_all_ = true;
      for (const std::weak_ptr<OpState>& weak : live_ops_) {
        if (std::shared_ptr<OpState> op = weak.lock()) live.push_back(std::move(op));
      }
      live_ops_.clear();
    }
    for (const auto& op : live) op->Cancel();
  }

 private:
  // Keeps a weak reference to every operation for CancelAll(); one made
  // after it is cancelled at once.
  void Track(const std::shared_ptr<OpState>& op) {
    {
      absl::MutexLock lock(&live_mu_);
      if (!cancelled_all_) {
        live_ops_.erase(std::remove_if(live_ops_.begin(), live_ops_.end(),
                                       [](const std::weak_ptr<OpState>& w) { return w.expired(); }),
                        live_ops_.end());
        live_ops_.push_back(op);
        return;
      }
    }
    op->Cancel();
  }

  RetryPolicy Retry() const {
    return {absl::Now() + options_.rpc_timeout,
            std::min(options_.attempt_timeout, options_.rpc_timeout)};
  }

  absl::Status CheckChunk(int chunk_id, const void* values) const {
    if (chunk_id < 0 || chunk_id >= static_cast<int>(plan_.chunks.size())) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", chunk_id, " is not in the plan (",
                                                     plan_.chunks.size(), " chunks)"));
    }
    if (values == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", chunk_id, ": null buffer"));
    }
    return absl::OkStatus();
  }

  v1::ChunkHeader BaseHeader(v1::ChunkHeader::Kind kind, int64_t version, int worker_clock,
                             int slot) const {
    v1::ChunkHeader header;
    header.set_job_id(options_.job_id);
    header.set_worker_id(options_.worker_id);
    header.set_generation(generation_.load());
    header.set_version(version);
    header.set_kind(kind);
    header.set_slot(slot);
    header.set_worker_clock(worker_clock);
    return header;
  }

  // A gradient Push waiting for the encoder thread.
  struct EncodeTask {
    v1::ChunkHeader header;
    std::vector<std::vector<PushCall::Frame>> by_shard;  // Frames with the caller's F32 values.
    std::shared_ptr<OpState> op;
    RetryPolicy retry;
  };

  void EncoderLoop() {
    for (;;) {
      EncodeTask task;
      {
        absl::MutexLock lock(&encode_mu_);
        encode_mu_.Await(absl::Condition(
            +[](GrpcPsClient* c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->encode_mu_) {
              return c->stop_encoder_ || !c->encode_queue_.empty();
            },
            this));
        if (encode_queue_.empty()) return;  // Stopping, and drained.
        task = std::move(encode_queue_.front());
        encode_queue_.pop_front();
      }
      // Shard by shard: the first shard's frames travel while the next
      // shard's are encoded.
      for (size_t s = 0; s < shards_.size(); ++s) {
        std::vector<PushCall::Frame>& frames = task.by_shard[s];
        if (frames.empty()) continue;
        absl::Status status;
        for (PushCall::Frame& f : frames) {
          auto encoded = std::make_shared<EncodedGradient>();
          status = encoder_->Encode(
              f.chunk_id, absl::MakeConstSpan(static_cast<const float*>(f.payload), f.count),
              encoded.get());
          if (!status.ok()) break;
          f.payload = encoded->bytes.data();
          f.payload_bytes = encoded->bytes.size();
          f.encoded = std::move(encoded);
        }
        if (!status.ok()) {
          // Every call this shard's frames would have made ends with it.
          for (int i = CallsFor(frames.size()); i > 0; --i) task.op->CallDone(status, 0);
          continue;
        }
        std::vector<std::vector<PushCall::Frame>> groups =
            Deal(std::move(frames), options_.connections_per_shard);
        for (size_t i = 0; i < groups.size(); ++i) {
          (new PushCall(shards_[s].push[i], task.op, task.header, std::move(groups[i]), task.retry))
              ->Start();
        }
      }
    }
  }

  const Options options_;
  const ChunkPlan plan_;
  const uint64_t incarnation_;  // Non-zero; one per client.
  std::atomic<int64_t> generation_;
  std::atomic<int64_t> next_update_seq_{1};
  // Constant after construction; calls in flight share ownership, so a
  // PendingOp may outlive the client.
  std::vector<ShardConnections> shards_;
  absl::Mutex live_mu_;
  std::vector<std::weak_ptr<OpState>> live_ops_ ABSL_GUARDED_BY(live_mu_);
  bool cancelled_all_ ABSL_GUARDED_BY(live_mu_) = false;

  // Gradient compression (Options::compression), when on: the encoder and
  // its residuals belong to encoder_thread_.
  std::unique_ptr<GradientEncoder> encoder_;
  absl::Mutex encode_mu_;
  std::deque<EncodeTask> encode_queue_ ABSL_GUARDED_BY(encode_mu_);
  bool stop_encoder_ ABSL_GUARDED_BY(encode_mu_) = false;
  std::thread encoder_thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PsClient>> PsClient::Create(Options options, ChunkPlan plan) {
  if (options.shard_addresses.empty()) {
    return absl::InvalidArgumentError("PsClient needs at least one shard address");
  }
  if (static_cast<int>(options.shard_addresses.size()) != plan.num_shards) {
    return absl::InvalidArgumentError(absl::StrCat("the chunk plan has ", plan.num_shards,
                                                   " shards but ", options.shard_addresses.size(),
                                                   " addresses were given"));
  }
  for (const ChunkInfo& c : plan.chunks) {
    if (c.shard < 0 || c.shard >= plan.num_shards) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", c.id, " has shard ", c.shard));
    }
  }
  PSTRAIN_RETURN_IF_ERROR(ValidateCompression(options.compression));
  if (options.connections_per_shard < 1 ||
      options.connections_per_shard > kMaxConnectionsPerShard) {
    return absl::InvalidArgumentError(absl::StrCat("connections_per_shard must be 1 to ",
                                                   kMaxConnectionsPerShard, ", got ",
                                                   options.connections_per_shard));
  }
  if (options.rpc_timeout <= absl::ZeroDuration() ||
      options.attempt_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rpc_timeout and attempt_timeout must be positive");
  }
  uint64_t incarnation = options.incarnation;
  if (incarnation == 0) {
    absl::BitGen bits;
    while (incarnation == 0) incarnation = absl::Uniform<uint64_t>(bits);
  }
  return std::unique_ptr<PsClient>(
      new GrpcPsClient(std::move(options), std::move(plan), incarnation));
}

}  // namespace pstrain
