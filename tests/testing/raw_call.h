// RawCall: one generic gRPC call driven by hand, for tests that must send
// bytes no well-behaved client would (malformed frames, unknown methods,
// requests from the wrong role).
//
//   grpc::GenericStub stub(channel);
//   std::vector<grpc::ByteBuffer> replies;
//   grpc::Status status = RawCall::Run(&stub, "/pstrain.v1.ParameterService/Push",
//                                      {frame1, frame2}, &replies);
#ifndef PSTRAIN_TESTS_TESTING_RAW_CALL_H_
#define PSTRAIN_TESTS_TESTING_RAW_CALL_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/rpc/channel.h"
#include "common/rpc/grpc_order.h"

namespace pstrain::testing {

// Runs one generic streaming call: writes every request, half-closes, reads
// every reply. Blocks until the call ends.
class RawCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  static grpc::Status Run(grpc::GenericStub* stub, const std::string& method,
                          std::vector<grpc::ByteBuffer> requests,
                          std::vector<grpc::ByteBuffer>* replies = nullptr,
                          absl::Duration timeout = absl::Seconds(10)) {
    RawCall call(std::move(requests));
    call.ctx_.set_deadline(DeadlineFromNow(timeout));
    stub->PrepareBidiStreamingCall(&call.ctx_, method, grpc::StubOptions(), &call);
    BeforeGrpc(&call.reply_);
    call.StartRead(&call.reply_);
    call.WriteNext();
    BeforeGrpc(&call);
    call.StartCall();
    call.done_.WaitForNotification();
    if (replies != nullptr) *replies = std::move(call.replies_);
    return call.status_;
  }

  // Writes are keyed by requests_ (grpc_order.h).
  void OnWriteDone(bool ok) override {
    GrpcReaction reaction(this, &requests_);
    if (ok) WriteNext();
  }
  void OnReadDone(bool ok) override {
    GrpcReaction reaction(this, &reply_);
    if (!ok) return;
    replies_.push_back(reply_);
    BeforeGrpc(&reply_);
    StartRead(&reply_);
  }
  void OnDone(const grpc::Status& status) override {
    AfterGrpc(this);
    AfterGrpc(&reply_);
    AfterGrpc(&requests_);
    status_ = status;
    done_.Notify();
  }

 private:
  explicit RawCall(std::vector<grpc::ByteBuffer> requests) : requests_(std::move(requests)) {}
  void WriteNext() {
    if (next_ == requests_.size()) {
      BeforeGrpc(this);
      StartWritesDone();
      return;
    }
    const grpc::ByteBuffer* request = &requests_[next_++];
    BeforeGrpc(&requests_);  // After every change this write's OnWriteDone may see.
    StartWrite(request);
  }

  grpc::ClientContext ctx_;
  std::vector<grpc::ByteBuffer> requests_;
  size_t next_ = 0;
  grpc::ByteBuffer reply_;
  std::vector<grpc::ByteBuffer> replies_;
  grpc::Status status_;
  absl::Notification done_;
};

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TESTING_RAW_CALL_H_
