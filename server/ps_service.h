// ShardServices: the gRPC edge of one parameter-server shard. It serves
//  * ParameterService (the hot path) through gRPC's generic callback API with
//    the raw framing of common/rpc/wire.h: Push (client stream of chunk frames)
//    and Pull (one request frame, then one reply frame per chunk), and
//  * ShardControl (protobuf; server 0 configures every shard through it),
// both over one ParameterShard.
//
//   ParameterShard shard({.shard_index = 0});
//   ShardServices services(&shard);
//   grpc::ServerBuilder builder;
//   int port = 0;
//   builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
//   services.Register(&builder);               // also ConfigureServerBuilder(&builder)
//   builder.RegisterService(&coordinator);     // other services may share the server
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
//   ...
//   server->Shutdown();                        // before `services` is destroyed
//
// Validation happens before the shard is touched; errors end the call with
// the absl code mapped 1:1 to gRPC: a frame that does not decode (wrong byte
// count, bad header), a dtype other than F32 (F16/BF16 are accepted for
// gradients and converted to F32), or an oversized stream (a frame above
// kMaxFrameBytes, or more frames than 3 x the chunks this shard owns + 1) ->
// INVALID_ARGUMENT; a ShardControl request above
// Options::max_control_message_bytes -> RESOURCE_EXHAUSTED; everything the shard rejects (unknown
// job or worker, chunk not owned, stale generation, non-finite values, future versions) keeps the
// shard's code. The first bad frame ends a Push: nothing from it is applied; frames before it
// were, and frames being applied beside it (Options::max_parallel_frames) may be; none after them
// is. Pushes carry update ids, so a client may send the whole push again.
//
// Threads: gRPC callbacks never block. Push frames are decoded and applied on
// threads this object owns, up to Options::max_parallel_frames of one stream
// at a time after its first frame (reading the next frames overlaps applying
// the current ones); a Pull sends the chunks whose version is there
// from the same pool, which never waits for a version, so pushes and ready
// pulls are always served. A pull that must wait moves to a second pool with
// one thread per waiting pull (at most Options::max_waiting_pulls; one more
// is RESOURCE_EXHAUSTED) and waits in slices of Options::pull_poll_interval
// so that a cancelled call or a server shutdown frees it promptly. Both pools
// grow on demand up to their bound. Register is called once, before the
// server starts; the object must outlive the server.
#ifndef PSTRAIN_SERVER_PS_SERVICE_H_
#define PSTRAIN_SERVER_PS_SERVICE_H_

#include <grpcpp/server_builder.h>

#include <functional>
#include <memory>

#include "absl/time/time.h"
#include "common/rpc/security.h"
#include "server/parameter_shard.h"

namespace pstrain {

class ShardServices {
 public:
  struct Options {
    // Longest uninterrupted wait of a pull inside ParameterShard::Pull before
    // it checks for cancellation; bounds shutdown latency.
    absl::Duration pull_poll_interval = absl::Milliseconds(200);
    // Upper bound on threads applying pushes and sending ready pulls (work
    // beyond it queues; none of it waits for a version).
    int max_threads = 256;
    // Frames of one push stream (different chunks) decoded and applied at
    // the same time, after its first frame: one worker's push spreads the
    // update over this many of the executor's threads. With 1, frames apply
    // in order and nothing after a bad frame is applied. pstrain-server sets
    // it from --update-threads (default: the machine's cores).
    int max_parallel_frames = 1;
    // Pulls that may wait for a version at the same time, each on its own
    // thread of a separate pool; one more fails with RESOURCE_EXHAUSTED.
    int max_waiting_pulls = 1024;
    // ShardControl requests above this are RESOURCE_EXHAUSTED. ConfigureJob
    // carries this shard's share of a job's parameters and optimizer state,
    // so the default is gRPC's largest (just under 2 GiB).
    int max_control_message_bytes = 2047 << 20;
    // The gRPC server's receive limit that Register sets (-1: unlimited).
    // pstrain-server passes the largest of its services' limits.
    int max_receive_message_bytes = -1;
    // Calls TuneAllocatorForLargeMessages() (common/rpc/channel.h) on
    // construction: process-wide glibc settings that keep received frames
    // from being mapped and unmapped each time (2-3x on a 100 MB push + pull,
    // docs/BENCHMARKS.md). Off for processes that manage their allocator.
    bool tune_allocator = true;
    // Latency hooks for /metrics, called on this object's threads (they must
    // be thread-safe and must not block); empty = not measured. on_push_frame:
    // one accepted push frame's decode, validation and apply. on_pull_call:
    // one successful pull from its request to its last frame queued for
    // sending (includes waiting for the requested version).
    std::function<void(absl::Duration)> on_push_frame;
    std::function<void(absl::Duration)> on_pull_call;
    // Who may call what (null: everyone). ParameterService Push and Pull need
    // the worker role and the worker credential of the worker id in their
    // frames; every ShardControl call needs the peer role.
    std::shared_ptr<const Authorizer> authorizer;
    // Fault injection for tests (never set by pstrain-server): called for
    // every push frame before it is applied (`applied` false) and after it
    // (true); returning true ends the push call with UNAVAILABLE there, as a
    // cut stream would. Called on this object's threads; must be thread-safe.
    std::function<bool(const v1::ChunkHeader& frame, bool applied)> cut_push_stream;
  };

  // `shard` must outlive this object.
  explicit ShardServices(ParameterShard* shard) : ShardServices(shard, Options()) {}
  ShardServices(ParameterShard* shard, Options options);
  ShardServices(const ShardServices&) = delete;
  ShardServices& operator=(const ShardServices&) = delete;
  // Joins the worker threads; the server must have been shut down.
  ~ShardServices();

  // Registers ParameterService (as the server's generic service: at most one
  // per server) and ShardControl, and applies ConfigureServerBuilder.
  void Register(grpc::ServerBuilder* builder);

  class Impl;  // Defined in ps_service.cc.

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_PS_SERVICE_H_
