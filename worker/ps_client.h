// PsClient: a worker's connection to every parameter-server shard, in the
// ps-lite style: Push and Pull return a handle you Wait() on, so that
// gradients of the last layers travel while earlier layers still run
// backward, and the next pull is in flight while the next batch is prepared.
//
//   PSTRAIN_ASSIGN_OR_RETURN(auto client, PsClient::Create(options, plan));
//   auto push = client->Push(v1::ChunkHeader::KIND_GRADIENT, /*version=*/t, clock,
//                            {{chunk_id, host_gradient_ptr}});
//   PSTRAIN_RETURN_IF_ERROR(push->Wait());
//   auto pull = client->Pull(v1::ChunkHeader::KIND_PARAMETERS, /*min_version=*/t + 1,
//                            clock, {{chunk_id, host_destination_ptr}});
//   PSTRAIN_RETURN_IF_ERROR(pull->Wait());
//
// Each call is split by shard and sent on that shard's connections (one
// client-streaming Push or server-streaming Pull per shard and connection,
// in parallel; Options::connections_per_shard), in ~1 MiB chunk frames (see ChunkHeader in
// proto/pstrain/v1/service.proto for the framing). The pushes made on one
// connection run one after another, in the order Push was called, so that
// a shard receives a step's chunks in push order. Every RPC has a deadline (Options::rpc_timeout).
//
// Exactly once: every Push carries an update id (the client's random
// incarnation and a sequence number per Push). A call to a shard that fails
// with UNAVAILABLE (a cut stream, a restarting server) or runs out of
// Options::attempt_timeout is made again, with backoff, with the same id
// until rpc_timeout has passed; the shard applies each chunk's update once
// however often it arrives. Pulls are retried the same way.
//
// Threads: thread-safe; Push/Pull may be called from any thread and return at
// once. Source and destination buffers must stay valid until Wait() returns.
#ifndef PSTRAIN_WORKER_PS_CLIENT_H_
#define PSTRAIN_WORKER_PS_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/chunking.h"
#include "common/rpc/channel.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

// A handle on an operation in flight.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  // Blocks until done; the first error of any shard. For a pull, the lowest
  // version received is in version() afterwards.
  virtual absl::Status Wait() = 0;
  virtual int64_t version() const = 0;
  // Whether Wait() would return at once (never blocks).
  virtual bool Done() const { return true; }
  // The operation's calls end at once and Wait() returns CANCELLED. A pull
  // keeps the chunks it received; a push's update may have been applied on
  // some chunks and not others, as with a cut stream (each chunk's at most
  // once). For a pull that waits on a version that will not come (this
  // worker's own push was refused) and for a run that stops (CancelAll).
  // No effect on an operation that ended.
  virtual void Cancel() {}
};

class PsClient {
 public:
  struct Options {
    std::vector<std::string> shard_addresses;  // host:port, index = shard.
    std::string job_id;
    std::string worker_id;
    int64_t generation = 0;
    // Deadline of a whole Push or Pull, retries included.
    absl::Duration rpc_timeout = absl::Seconds(60);
    // Deadline of one attempt (a call to one shard); a call that runs out
    // of it (a shard that accepted the call and hangs) is made again while
    // rpc_timeout allows. Keep it well above a connection's set-up: a call
    // waits for the connection (wait_for_ready) within this deadline, and
    // attempts much shorter than gRPC's reconnect backoff were seen never
    // to connect.
    absl::Duration attempt_timeout = absl::Seconds(30);
    // The update ids' incarnation (ChunkHeader.incarnation); 0 draws a
    // random one. Tests set it to replay a client.
    uint64_t incarnation = 0;
    // TLS credentials and the worker's token and credential for the shard
    // channels (common/rpc/channel.h; default: insecure, none).
    ChannelOptions channel;
    // How KIND_GRADIENT pushes travel (JobSpec.compression; default F32).
    // With compression, Push only queues the gradient: the client's encoder
    // thread encodes it (common/rpc/gradient_codec.h; top-k and 1-bit keep
    // their error-feedback residuals for the client's life, one run) and
    // then sends it. A retried push resends the same encoded bytes.
    v1::CompressionSpec compression;
    // TCP connections to each shard for pushes, and as many for pulls (1 to
    // kMaxConnectionsPerShard): a push or pull deals its chunks of a shard
    // round-robin over them, one stream each. With TLS each connection
    // seals and opens its records on one core at a time, so a link faster
    // than one core's TLS needs more than one.
    int connections_per_shard = 1;
    // Push streams ask the shards for credits (ChunkHeader.paced): a stream
    // sends its first frame, then no frame beyond what the shard's credits
    // allow. Shards pace sync jobs (--push-pacing-lead) and answer other
    // streams with one credit for everything, so that costs those a round
    // trip a call: set it for sync jobs.
    bool pace_pushes = true;
  };
  static constexpr int kMaxConnectionsPerShard = 16;
  struct ChunkRef {
    int chunk_id = 0;
    const float* values = nullptr;  // plan.chunks[chunk_id].count floats.
  };
  // What a pull destination holds, as a shard sent it (pull compression).
  struct HeldValues {
    int64_t version = -1;  // -1: nothing the shard sent.
    uint64_t epoch = 0;    // The shard's values epoch of the job (0: none).
  };
  struct ChunkDest {
    int chunk_id = 0;
    float* values = nullptr;
    // Pull compression (JobSpec.pull_compression): when set, the pull offers
    // the held version as the base of a delta, adds a delta reply to
    // `values` (which must then hold exactly what the shard sent for that
    // version) and records what `values` holds after each reply. The
    // caller keeps it, with `values`, until Wait() returns.
    HeldValues* held = nullptr;
  };

  static absl::StatusOr<std::unique_ptr<PsClient>> Create(Options options, ChunkPlan plan);
  virtual ~PsClient() = default;

  virtual std::unique_ptr<PendingOp> Push(v1::ChunkHeader::Kind kind, int64_t version,
                                          int worker_clock, std::vector<ChunkRef> chunks,
                                          int slot = 0) = 0;
  // `master`: the master values whole, even where the job compresses pulls
  // (ChunkHeader.master; `held` is then ignored).
  virtual std::unique_ptr<PendingOp> Pull(v1::ChunkHeader::Kind kind, int64_t min_version,
                                          int worker_clock, std::vector<ChunkDest> chunks,
                                          int slot = 0, bool master = false) = 0;
  // After a membership change (new Assignment.generation).
  virtual void SetGeneration(int64_t generation) = 0;
  virtual const ChunkPlan& plan() const = 0;
  // The non-zero incarnation of this client's update ids.
  virtual uint64_t incarnation() const = 0;
  // Every operation in flight, and every later one, ends at once with
  // CANCELLED (PendingOp::Cancel for pushes too: a push's update is then
  // applied on some shards, or chunks, and not on others, as when its
  // streams are cut). For a run that stops: a worker shutting down while
  // the servers are gone must not wait out rpc_timeout on each call.
  virtual void CancelAll() {}
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_PS_CLIENT_H_
