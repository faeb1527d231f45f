// The reactor of one ParameterService Push call (a client stream of chunk
// frames, one reply frame with the lowest version reached), part of
// ShardServices (ps_service.h, which states the validation rules and the
// threads). Reading the next frames overlaps applying the current ones. The
// first frame is applied alone (it names the worker and the job, checked
// once for the stream); after it, up to Options::max_parallel_frames frames
// of the stream (different chunks) are decoded and applied at once on the
// executor. Paced streams (sync jobs) also get credit frames from the
// shard's PaceSlack.
#ifndef PSTRAIN_SERVER_PUSH_REACTOR_H_
#define PSTRAIN_SERVER_PUSH_REACTOR_H_

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/support/server_callback.h>

#include <string>

#include "server/ps_service.h"

namespace pstrain {

// A new reactor for a Push call admitted for the worker role; `credential`
// is the call's worker credential metadata. The reactor deletes itself when
// the call is done; `owner` must outlive it.
grpc::ServerGenericBidiReactor* NewPushReactor(ShardServices::Impl* owner, std::string credential);

}  // namespace pstrain

#endif  // PSTRAIN_SERVER_PUSH_REACTOR_H_
