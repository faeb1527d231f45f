// ShardServices: see ps_service.h. Its parts: ps_service_impl.h (what the
// reactors share, and the executors), push_reactor.cc (Push),
// pull_reactor.cc (Pull) and shard_control_service.cc (ShardControl). This
// file routes each ParameterService call to its reactor.
#include "server/ps_service.h"

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/support/server_callback.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/rpc/channel.h"
#include "common/rpc/grpc_order.h"
#include "common/rpc/wire.h"
#include "server/ps_service_impl.h"
#include "server/pull_reactor.h"
#include "server/push_reactor.h"

namespace pstrain {
namespace {

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
  if (push) return NewPushReactor(this, Authorizer::WorkerCredentialOf(*ctx));
  return NewPullReactor(this, ctx);
}

ShardServices::ShardServices(ParameterShard* shard, Options options)
    : impl_(std::make_unique<Impl>(shard, options)) {
  if (options.tune_allocator) TuneAllocatorForLargeMessages();
}

ShardServices::~ShardServices() = default;

void ShardServices::Register(grpc::ServerBuilder* builder) { impl_->Register(builder); }

}  // namespace pstrain
