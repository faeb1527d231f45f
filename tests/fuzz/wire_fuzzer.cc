// The push/pull frame decoder (common/rpc/wire): what a shard does with the
// bytes of every ParameterService message before anything is applied.
// DecodeFrame, then the payload as floats for every dtype and encoding the
// wire carries (DecodeGradient: F32, F16, BF16, top-k, sign bits), as
// ShardServices does, and as a pull reply's delta added to held values
// (AddEncodedDelta), as PsClient does. The first input byte splits the
// frame over up to four slices, as gRPC may deliver it.
#include <grpc/grpc.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/rpc/gradient_codec.h"
#include "common/rpc/wire.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  grpc_init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int pieces = 1 + data[0] % 4;
  ++data;
  --size;
  std::vector<grpc::Slice> slices;
  size_t offset = 0;
  for (int i = 0; i < pieces; ++i) {
    const size_t n = i + 1 == pieces ? size - offset : (size - offset) / 2;
    slices.emplace_back(data + offset, n);
    offset += n;
  }
  grpc::ByteBuffer buffer(slices.data(), slices.size());
  pstrain::v1::ChunkHeader header;
  pstrain::PayloadView payload;
  if (!pstrain::DecodeFrame(buffer, &header, &payload).ok()) return 0;
  const int64_t n = header.num_elements();
  if (n <= 0) return 0;
  std::vector<float> values(static_cast<size_t>(n));
  const void* src = payload.Contiguous(pstrain::BufferPool::Default());
  (void)pstrain::DecodeGradient(header, src, payload.size(), absl::MakeSpan(values));
  // A pull reply's delta (pull compression), added to values held, as a
  // worker's PsClient does.
  std::vector<float> held(static_cast<size_t>(n), 1.0f), scratch;
  (void)pstrain::AddEncodedDelta(header, src, payload.size(), absl::MakeSpan(held), &scratch);
  return 0;
}
