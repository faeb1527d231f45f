// What gRPC guarantees about a callback reactor's order, said to
// ThreadSanitizer. gRPC runs a reactor's On*Done on whichever of its threads
// completed the operation, and everything the starting thread did before
// StartRead / StartWrite / StartCall / Finish happens before the matching
// On*Done. gRPC keeps that order with its own lock-free queues, and Debian's
// gRPC is not built with TSan, so TSan would not see it and would report the
// reactor's members as races (deploy/local/sanitize.sh). These calls say it;
// outside a TSan build they compile to nothing.
//
//   BeforeGrpc(&reply_);  StartRead(&reply_);          // the starting thread
//   void OnReadDone(bool ok) override {
//     GrpcReaction reaction(this, &reply_);            // first line
//     ...
//   }
//   void OnDone(...) override { AfterGrpc(this); AfterGrpc(&reply_); ... }
//
// In OnDone the AfterGrpc calls come before anything that reads a member:
// a read above them is a race to TSan (PushReactor's pacer was one).
//
// One key per direction (the buffer of a read or a write; `this` for the
// call itself: StartCall, StartWritesDone, Finish), so that a read's order
// does not also order the writes that really run beside it. gRPC runs OnDone
// after every other reaction has returned: each reaction ends by releasing
// `this`, and OnDone takes every key.
#ifndef PSTRAIN_COMMON_RPC_GRPC_ORDER_H_
#define PSTRAIN_COMMON_RPC_GRPC_ORDER_H_

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PSTRAIN_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define PSTRAIN_TSAN 1
#endif

#ifdef PSTRAIN_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace pstrain {

// Called right before handing an operation keyed by `key` to gRPC.
inline void BeforeGrpc(const void* key) {
#ifdef PSTRAIN_TSAN
  __tsan_release(const_cast<void*>(key));
#else
  (void)key;
#endif
}

// Called first in the callback that completes the operation keyed by `key`.
inline void AfterGrpc(const void* key) {
#ifdef PSTRAIN_TSAN
  __tsan_acquire(const_cast<void*>(key));
#else
  (void)key;
#endif
}

// The scope of an On*Done other than OnDone: after the operation keyed by
// `key`, and before the call's OnDone.
class GrpcReaction {
 public:
  GrpcReaction(const void* call, const void* key) : call_(call) { AfterGrpc(key); }
  ~GrpcReaction() { BeforeGrpc(call_); }
  GrpcReaction(const GrpcReaction&) = delete;
  GrpcReaction& operator=(const GrpcReaction&) = delete;

 private:
  const void* const call_;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_GRPC_ORDER_H_
