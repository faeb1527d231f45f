// Tensor-chunk framing for the ParameterService streams (the hot path).
//
// A stream message is a raw grpc::ByteBuffer, not a protobuf message:
//   [fixed32 little-endian header_size][v1::ChunkHeader, header_size bytes][payload]
// The payload travels as a slice that points at the caller's tensor (no
// protobuf `bytes` copies) and is read in place on receipt when it lies in one
// slice; otherwise it is copied once, into a pooled buffer or straight into
// the caller's destination.
//
//   // Sender: the payload slice references `values` until gRPC releases it.
//   grpc::ByteBuffer frame;
//   PSTRAIN_RETURN_IF_ERROR(EncodeFrame(header, values, bytes, keep_alive, &frame));
//   // Receiver:
//   v1::ChunkHeader header;
//   PayloadView payload;
//   PSTRAIN_RETURN_IF_ERROR(DecodeFrame(frame, &header, &payload));
//   payload.CopyTo(destination);                  // one copy, or
//   const void* p = payload.Contiguous(&pool);    // in place when possible
//
// Threads: the free functions are thread-safe; a PayloadView belongs to one
// thread at a time; BufferPool is thread-safe.
#ifndef PSTRAIN_COMMON_RPC_WIRE_H_
#define PSTRAIN_COMMON_RPC_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/checkpoint.h"  // DTypeWidth
#include "common/chunking.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

// Frames longer than this are rejected ("oversized stream"): the largest chunk
// plus room for its header.
inline constexpr int64_t kMaxFrameHeaderBytes = int64_t{64} << 10;
inline constexpr int64_t kMaxFrameBytes = kMaxChunkBytes + kMaxFrameHeaderBytes;

// gRPC method names of the ParameterService (served through the generic API).
inline constexpr char kPullMethod[] = "/pstrain.v1.ParameterService/Pull";
inline constexpr char kPushMethod[] = "/pstrain.v1.ParameterService/Push";

// ---------------------------------------------------------------------------
// Pooled receive buffers
// ---------------------------------------------------------------------------

class BufferPool;

// A buffer on loan from a BufferPool; returns to it when destroyed. Move-only.
class PooledBuffer {
 public:
  PooledBuffer() = default;
  PooledBuffer(PooledBuffer&& other) noexcept;
  PooledBuffer& operator=(PooledBuffer&& other) noexcept;
  PooledBuffer(const PooledBuffer&) = delete;
  PooledBuffer& operator=(const PooledBuffer&) = delete;
  ~PooledBuffer();

  void* data() const { return data_.get(); }
  size_t capacity() const { return capacity_; }
  bool empty() const { return data_ == nullptr; }

 private:
  friend class BufferPool;
  PooledBuffer(BufferPool* pool, std::unique_ptr<char[]> data, size_t capacity)
      : pool_(pool), data_(std::move(data)), capacity_(capacity) {}
  void Release();

  BufferPool* pool_ = nullptr;
  std::unique_ptr<char[]> data_;
  size_t capacity_ = 0;
};

// Reuses large receive buffers so that each frame does not map, fault in and
// unmap fresh memory (see "Transport lessons" in the design). Sizes are
// rounded up to a power of two (at least 4 KiB); at most max_cached_bytes are
// kept idle, the rest is freed. Thread-safe; must outlive its buffers.
class BufferPool {
 public:
  explicit BufferPool(size_t max_cached_bytes = size_t{256} << 20);
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `bytes` bytes (contents unspecified).
  PooledBuffer Acquire(size_t bytes);
  // Bytes held idle in the pool now.
  size_t cached_bytes() const;

  // A process-wide pool (never destroyed).
  static BufferPool* Default();

 private:
  friend class PooledBuffer;
  void Return(std::unique_ptr<char[]> data, size_t capacity);

  const size_t max_cached_bytes_;  // Constant after construction.
  mutable absl::Mutex mu_;
  std::multimap<size_t, std::unique_ptr<char[]>> idle_ ABSL_GUARDED_BY(mu_);
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// ---------------------------------------------------------------------------
// Frames
// ---------------------------------------------------------------------------

// Builds [header_size][header][payload] into *out. With copy_payload the
// payload is copied into the frame; otherwise the payload slice points at
// `payload`, which the caller keeps alive and unchanged until gRPC is done
// with the frame (the write has completed and the call has ended).
// INVALID_ARGUMENT when the header exceeds kMaxFrameHeaderBytes.
absl::Status EncodeFrame(const v1::ChunkHeader& header, const void* payload, size_t bytes,
                         grpc::ByteBuffer* out, bool copy_payload = false);

// As above, zero-copy, but the frame itself keeps `keep_alive` referenced and
// drops that reference when gRPC releases the payload slice: the safe way to
// send a shared snapshot or a buffer whose owner waits on the release.
absl::Status EncodeFrame(const v1::ChunkHeader& header, const void* payload, size_t bytes,
                         std::shared_ptr<const void> keep_alive, grpc::ByteBuffer* out);

// The payload of a decoded frame: references the received slices (no copy)
// until CopyTo or Contiguous is asked for.
class PayloadView {
 public:
  PayloadView() = default;
  PayloadView(PayloadView&&) = default;
  PayloadView& operator=(PayloadView&&) = default;

  size_t size() const { return size_; }
  // True when the payload lies in one received slice (Contiguous is free).
  bool in_place() const;
  // Copies the size() payload bytes to dst.
  void CopyTo(void* dst) const;
  // The payload as one block, valid while this view lives: in place when it
  // lies in one slice at a 4-byte aligned address, else copied once into a
  // buffer from `pool` (kept by this view).
  const void* Contiguous(BufferPool* pool);

 private:
  friend absl::Status DecodeFrame(const grpc::ByteBuffer&, v1::ChunkHeader*, PayloadView*);
  std::vector<grpc::Slice> slices_;
  size_t first_slice_ = 0;   // Slice holding the payload's first byte.
  size_t first_offset_ = 0;  // Offset of that byte in the slice.
  size_t size_ = 0;
  PooledBuffer copy_;
};

// Parses a frame. INVALID_ARGUMENT for a buffer shorter than 4 bytes, a
// header_size beyond the buffer or kMaxFrameHeaderBytes, an unparsable header,
// a negative num_elements, an unknown dtype with a payload, or a payload whose
// size differs from num_elements times the dtype's width.
absl::Status DecodeFrame(const grpc::ByteBuffer& buffer, v1::ChunkHeader* header,
                         PayloadView* payload);

// ---------------------------------------------------------------------------
// Wire dtypes for gradients
// ---------------------------------------------------------------------------

// IEEE-754 binary16 <-> binary32; round-to-nearest-even, overflow to
// infinity, NaN kept NaN, subnormals exact.
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
// bfloat16 <-> binary32; round-to-nearest-even, NaN kept NaN.
float Bf16ToFloat(uint16_t b);
uint16_t FloatToBf16(float f);

// Converts `count` elements of `dtype` (F32, F16 or BF16) at src to floats.
// INVALID_ARGUMENT for other dtypes.
absl::Status ConvertToF32(v1::DType dtype, const void* src, int64_t count, float* dst);
// Converts floats to F16 or BF16 (dst holds count * 2 bytes, little-endian),
// rounding to nearest even. With `saturate`, magnitudes beyond the dtype's
// largest finite value become it instead of infinity; NaN stays NaN.
// INVALID_ARGUMENT for other dtypes. Both directions run vectorised (F16C
// where the CPU has it) and give the bits of the scalar functions above,
// NaN payloads aside.
absl::Status ConvertFromF32(v1::DType dtype, const float* src, int64_t count, void* dst,
                            bool saturate = false);

// True on an x86 CPU with AVX2 (which also has F16C): the codecs' bulk loops
// then run their AVX2 builds.
bool CpuHasAvx2();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_WIRE_H_
