#include "common/rpc/wire.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rpc/gradient_codec.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

uint32_t FloatBits(float f) { return std::bit_cast<uint32_t>(f); }
float BitsFloat(uint32_t u) { return std::bit_cast<float>(u); }

void ReleaseKeepAlive(void* user_data) {
  delete static_cast<std::shared_ptr<const void>*>(user_data);
}

// Builds the [header_size][header] slice. The header is small: one copy.
absl::StatusOr<grpc::Slice> HeaderSlice(const v1::ChunkHeader& header) {
  const size_t header_size = header.ByteSizeLong();
  if (header_size > static_cast<size_t>(kMaxFrameHeaderBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk header of ", header_size, " bytes exceeds ", kMaxFrameHeaderBytes));
  }
  std::string bytes(4 + header_size, '\0');
  const uint32_t n = static_cast<uint32_t>(header_size);
  bytes[0] = static_cast<char>(n & 0xff);
  bytes[1] = static_cast<char>((n >> 8) & 0xff);
  bytes[2] = static_cast<char>((n >> 16) & 0xff);
  bytes[3] = static_cast<char>((n >> 24) & 0xff);
  if (!header.SerializeToArray(bytes.data() + 4, static_cast<int>(header_size))) {
    return absl::InvalidArgumentError("chunk header does not serialise");
  }
  return grpc::Slice(bytes);
}

// Copies `n` bytes starting at (slice, offset) of `slices` to dst; advances
// the position. The caller has checked that enough bytes remain.
void CopyFromSlices(const std::vector<grpc::Slice>& slices, size_t* slice, size_t* offset, size_t n,
                    char* dst) {
  while (n > 0) {
    const grpc::Slice& s = slices[*slice];
    const size_t available = s.size() - *offset;
    const size_t take = std::min(available, n);
    std::memcpy(dst, s.begin() + *offset, take);
    dst += take;
    n -= take;
    *offset += take;
    if (*offset == s.size()) {
      ++*slice;
      *offset = 0;
    }
  }
}

// Skips empty slices so that (slice, offset) names a real byte (or the end).
void Normalise(const std::vector<grpc::Slice>& slices, size_t* slice, size_t* offset) {
  while (*slice < slices.size() && *offset == slices[*slice].size()) {
    ++*slice;
    *offset = 0;
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// BufferPool
// ---------------------------------------------------------------------------

PooledBuffer::PooledBuffer(PooledBuffer&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      data_(std::move(other.data_)),
      capacity_(std::exchange(other.capacity_, 0)) {}

PooledBuffer& PooledBuffer::operator=(PooledBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::move(other.data_);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

PooledBuffer::~PooledBuffer() { Release(); }

void PooledBuffer::Release() {
  if (data_ != nullptr && pool_ != nullptr) pool_->Return(std::move(data_), capacity_);
  data_.reset();
  pool_ = nullptr;
  capacity_ = 0;
}

BufferPool::BufferPool(size_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}

PooledBuffer BufferPool::Acquire(size_t bytes) {
  const size_t capacity = std::bit_ceil(std::max<size_t>(bytes, 4096));
  {
    absl::MutexLock lock(&mu_);
    auto it = idle_.find(capacity);
    if (it != idle_.end()) {
      std::unique_ptr<char[]> data = std::move(it->second);
      idle_.erase(it);
      cached_bytes_ -= capacity;
      return PooledBuffer(this, std::move(data), capacity);
    }
  }
  return PooledBuffer(this, std::unique_ptr<char[]>(new char[capacity]), capacity);
}

void BufferPool::Return(std::unique_ptr<char[]> data, size_t capacity) {
  absl::MutexLock lock(&mu_);
  if (cached_bytes_ + capacity > max_cached_bytes_) return;  // `data` is freed.
  cached_bytes_ += capacity;
  idle_.emplace(capacity, std::move(data));
}

size_t BufferPool::cached_bytes() const {
  absl::MutexLock lock(&mu_);
  return cached_bytes_;
}

BufferPool* BufferPool::Default() {
  static BufferPool* pool = new BufferPool();
  return pool;
}

// ---------------------------------------------------------------------------
// Frames
// ---------------------------------------------------------------------------

absl::Status EncodeFrame(const v1::ChunkHeader& header, const void* payload, size_t bytes,
                         grpc::ByteBuffer* out, bool copy_payload) {
  absl::StatusOr<grpc::Slice> head = HeaderSlice(header);
  if (!head.ok()) return head.status();
  if (bytes == 0) {
    *out = grpc::ByteBuffer(&*head, 1);
    return absl::OkStatus();
  }
  grpc::Slice slices[2] = {*std::move(head),
                           copy_payload ? grpc::Slice(payload, bytes)
                                        : grpc::Slice(payload, bytes, grpc::Slice::STATIC_SLICE)};
  *out = grpc::ByteBuffer(slices, 2);
  return absl::OkStatus();
}

absl::Status EncodeFrame(const v1::ChunkHeader& header, const void* payload, size_t bytes,
                         std::shared_ptr<const void> keep_alive, grpc::ByteBuffer* out) {
  absl::StatusOr<grpc::Slice> head = HeaderSlice(header);
  if (!head.ok()) return head.status();
  if (bytes == 0) {
    *out = grpc::ByteBuffer(&*head, 1);
    return absl::OkStatus();
  }
  auto* holder = new std::shared_ptr<const void>(std::move(keep_alive));
  grpc::Slice slices[2] = {
      *std::move(head), grpc::Slice(const_cast<void*>(payload), bytes, &ReleaseKeepAlive, holder)};
  *out = grpc::ByteBuffer(slices, 2);
  return absl::OkStatus();
}

bool PayloadView::in_place() const {
  return size_ == 0 ||
         (first_slice_ < slices_.size() && slices_[first_slice_].size() - first_offset_ >= size_);
}

void PayloadView::CopyTo(void* dst) const {
  if (size_ == 0) return;
  size_t slice = first_slice_, offset = first_offset_;
  CopyFromSlices(slices_, &slice, &offset, size_, static_cast<char*>(dst));
}

const void* PayloadView::Contiguous(BufferPool* pool) {
  if (size_ == 0) return nullptr;
  if (!copy_.empty()) return copy_.data();
  if (in_place()) {
    const uint8_t* p = slices_[first_slice_].begin() + first_offset_;
    if (reinterpret_cast<uintptr_t>(p) % alignof(float) == 0) return p;
  }
  copy_ = pool->Acquire(size_);
  CopyTo(copy_.data());
  return copy_.data();
}

absl::Status DecodeFrame(const grpc::ByteBuffer& buffer, v1::ChunkHeader* header,
                         PayloadView* payload) {
  *payload = PayloadView();
  const size_t total = buffer.Length();
  if (total < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame of ", total, " bytes is shorter than its 4-byte prefix"));
  }
  std::vector<grpc::Slice>& slices = payload->slices_;
  grpc::Status dumped = buffer.Dump(&slices);
  if (!dumped.ok()) return absl::InvalidArgumentError("frame cannot be read");
  size_t slice = 0, offset = 0;
  unsigned char prefix[4];
  CopyFromSlices(slices, &slice, &offset, 4, reinterpret_cast<char*>(prefix));
  const uint32_t header_size = uint32_t{prefix[0]} | (uint32_t{prefix[1]} << 8) |
                               (uint32_t{prefix[2]} << 16) | (uint32_t{prefix[3]} << 24);
  if (header_size > kMaxFrameHeaderBytes || header_size > total - 4) {
    return absl::InvalidArgumentError(absl::StrCat("frame header_size ", header_size,
                                                   " exceeds the frame (", total, " bytes) or ",
                                                   kMaxFrameHeaderBytes));
  }
  Normalise(slices, &slice, &offset);
  bool parsed;
  if (header_size == 0) {
    header->Clear();
    parsed = true;
  } else if (slices[slice].size() - offset >= header_size) {
    parsed = header->ParseFromArray(slices[slice].begin() + offset, static_cast<int>(header_size));
    offset += header_size;
  } else {
    std::string bytes(header_size, '\0');
    CopyFromSlices(slices, &slice, &offset, header_size, bytes.data());
    parsed = header->ParseFromString(bytes);
  }
  if (!parsed) return absl::InvalidArgumentError("frame header is not a valid ChunkHeader");
  Normalise(slices, &slice, &offset);

  const size_t payload_bytes = total - 4 - header_size;
  if (header->num_elements() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_elements must be >= 0, got ", header->num_elements()));
  }
  // No chunk holds more elements than the largest chunk's F32 values: a
  // claimed count beyond it is refused before anyone sizes a buffer by it.
  if (header->num_elements() > kMaxChunkBytes / 4) {
    return absl::InvalidArgumentError(absl::StrCat("num_elements ", header->num_elements(),
                                                   " exceeds the largest chunk (",
                                                   kMaxChunkBytes / 4, " elements)"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(const uint64_t expected, EncodedPayloadBytes(*header));
  if (payload_bytes != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("payload of chunk ", header->chunk_id(), " has ", payload_bytes, " bytes but ",
                     header->num_elements(), " x ", v1::DType_Name(header->dtype()),
                     header->encoding() == v1::ChunkHeader::ENCODING_DENSE
                         ? ""
                         : absl::StrCat(" as ", v1::ChunkHeader::Encoding_Name(header->encoding())),
                     " needs ", expected));
  }
  payload->first_slice_ = slice;
  payload->first_offset_ = offset;
  payload->size_ = payload_bytes;
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Wire dtypes
// ---------------------------------------------------------------------------

float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in binary32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 31) return BitsFloat(sign | 0x7f800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t FloatToHalf(float f) {
  // Round-to-nearest-even after F. Giesen's float_to_half_fast3_rtne.
  constexpr uint32_t kF32Infinity = 255u << 23;
  constexpr uint32_t kF16Limit = (127u + 16) << 23;  // 65536: rounds to infinity.
  constexpr uint32_t kDenormMagic = ((127u - 15) + (23 - 10) + 1) << 23;
  uint32_t bits = FloatBits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint32_t out;
  if (bits >= kF16Limit) {
    out = bits > kF32Infinity ? 0x7e00 : 0x7c00;
  } else if (bits < (113u << 23)) {
    // Becomes a half subnormal (or zero): let the FPU round.
    out = FloatBits(BitsFloat(bits) + BitsFloat(kDenormMagic)) - kDenormMagic;
  } else {
    const uint32_t mantissa_odd = (bits >> 13) & 1;
    bits += ((15u - 127u) << 23) + 0xfff;
    bits += mantissa_odd;
    out = bits >> 13;
  }
  return static_cast<uint16_t>(out | (sign >> 16));
}

float Bf16ToFloat(uint16_t b) { return BitsFloat(uint32_t{b} << 16); }

uint16_t FloatToBf16(float f) {
  const uint32_t bits = FloatBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

bool CpuHasAvx2() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
#else
  return false;
#endif
}

namespace {

constexpr float kMaxHalfValue = 65504.0f;
constexpr float kMaxBf16Value = 3.38953139e38f;  // 0x7F7F: the largest finite bfloat16.

// Magnitudes above `limit` become `limit`; NaN stays NaN.
inline float Saturate(float v, float limit) {
  return v > limit ? limit : (v < -limit ? -limit : v);
}

inline void StoreU16(uint8_t* dst, uint16_t v) {
  dst[0] = static_cast<uint8_t>(v & 0xff);
  dst[1] = static_cast<uint8_t>(v >> 8);
}
inline uint16_t LoadU16(const uint8_t* src) {
  return static_cast<uint16_t>(src[0] | (src[1] << 8));
}

// The bulk loops below are written branch-free so that the compiler
// vectorises them, and each is compiled twice: for the baseline and, in a
// wrapper with target("avx2"), for AVX2 CPUs; CpuHasAvx2() picks at run
// time. (Not target_clones: its ifunc resolvers run before a sanitizer's
// runtime is up and crashed the TSan build.) F16 uses the F16C conversion
// instructions where the CPU has them (exact IEEE round-to-nearest-even,
// like FloatToHalf; a NaN may keep more of its payload, and stays NaN).

inline __attribute__((always_inline)) void FloatsToBf16Loop(const float* src, int64_t count,
                                                            bool saturate, uint8_t* dst) {
  for (int64_t i = 0; i < count; ++i) {
    const float v = saturate ? Saturate(src[i], kMaxBf16Value) : src[i];
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t out = nan ? ((bits >> 16) | 0x40u) : rounded;
    StoreU16(dst + 2 * i, static_cast<uint16_t>(out));
  }
}

inline __attribute__((always_inline)) void Bf16ToFloatsLoop(const uint8_t* src, int64_t count,
                                                            float* dst) {
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t bits = uint32_t{LoadU16(src + 2 * i)} << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void FloatsToBf16Avx2(const float* src, int64_t count,
                                                      bool saturate, uint8_t* dst) {
  FloatsToBf16Loop(src, count, saturate, dst);
}
__attribute__((target("avx2"))) void Bf16ToFloatsAvx2(const uint8_t* src, int64_t count,
                                                      float* dst) {
  Bf16ToFloatsLoop(src, count, dst);
}
#endif

void FloatsToBf16(const float* src, int64_t count, bool saturate, uint8_t* dst) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return FloatsToBf16Avx2(src, count, saturate, dst);
#endif
  FloatsToBf16Loop(src, count, saturate, dst);
}

void Bf16ToFloats(const uint8_t* src, int64_t count, float* dst) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return Bf16ToFloatsAvx2(src, count, dst);
#endif
  Bf16ToFloatsLoop(src, count, dst);
}

#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void FloatsToHalfF16c(const float* src, int64_t count,
                                                           bool saturate, uint8_t* dst) {
  const __m256 high = _mm256_set1_ps(kMaxHalfValue);
  const __m256 low = _mm256_set1_ps(-kMaxHalfValue);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 v = _mm256_loadu_ps(src + i);
    // max/min return their second operand when either is NaN: NaN stays NaN.
    if (saturate) v = _mm256_min_ps(high, _mm256_max_ps(low, v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < count; ++i) {
    StoreU16(dst + 2 * i, FloatToHalf(saturate ? Saturate(src[i], kMaxHalfValue) : src[i]));
  }
}

__attribute__((target("avx2,f16c"))) void HalfToFloatsF16c(const uint8_t* src, int64_t count,
                                                           float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(
        dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
  }
  for (; i < count; ++i) dst[i] = HalfToFloat(LoadU16(src + 2 * i));
}

#endif

void FloatsToHalf(const float* src, int64_t count, bool saturate, uint8_t* dst) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return FloatsToHalfF16c(src, count, saturate, dst);
#endif
  for (int64_t i = 0; i < count; ++i) {
    StoreU16(dst + 2 * i, FloatToHalf(saturate ? Saturate(src[i], kMaxHalfValue) : src[i]));
  }
}

void HalfToFloats(const uint8_t* src, int64_t count, float* dst) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return HalfToFloatsF16c(src, count, dst);
#endif
  for (int64_t i = 0; i < count; ++i) dst[i] = HalfToFloat(LoadU16(src + 2 * i));
}

}  // namespace

absl::Status ConvertToF32(v1::DType dtype, const void* src, int64_t count, float* dst) {
  switch (dtype) {
    case v1::DTYPE_F32:
      std::memcpy(dst, src, static_cast<size_t>(count) * 4);
      return absl::OkStatus();
    case v1::DTYPE_F16:
      HalfToFloats(static_cast<const uint8_t*>(src), count, dst);
      return absl::OkStatus();
    case v1::DTYPE_BF16:
      Bf16ToFloats(static_cast<const uint8_t*>(src), count, dst);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot convert ", v1::DType_Name(dtype), " to F32"));
  }
}

absl::Status ConvertFromF32(v1::DType dtype, const float* src, int64_t count, void* dst,
                            bool saturate) {
  auto* out = static_cast<uint8_t*>(dst);
  switch (dtype) {
    case v1::DTYPE_F16:
      FloatsToHalf(src, count, saturate, out);
      return absl::OkStatus();
    case v1::DTYPE_BF16:
      FloatsToBf16(src, count, saturate, out);
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot convert F32 to ", v1::DType_Name(dtype)));
  }
}

}  // namespace pstrain
