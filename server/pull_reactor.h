// The reactor of one ParameterService Pull call (one request frame, then a
// reply frame per chunk in request order), part of ShardServices
// (ps_service.h, which states the validation rules and the threads). Chunks
// whose version is there are sent from the executor; at the first that is
// not, the call moves to the waiting pool (RESOURCE_EXHAUSTED when
// Options::max_waiting_pulls already wait) and waits there, in slices of
// Options::pull_poll_interval, for it and the rest.
#ifndef PSTRAIN_SERVER_PULL_REACTOR_H_
#define PSTRAIN_SERVER_PULL_REACTOR_H_

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/support/server_callback.h>

#include "server/ps_service.h"

namespace pstrain {

// A new reactor for a Pull call admitted for the worker role. It deletes
// itself when the call is done; `owner` must outlive it.
grpc::ServerGenericBidiReactor* NewPullReactor(ShardServices::Impl* owner,
                                               grpc::GenericCallbackServerContext* ctx);

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_PULL_REACTOR_H_
