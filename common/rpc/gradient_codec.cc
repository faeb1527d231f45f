#include "common/rpc/gradient_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"  // DTypeWidth
#include "common/rpc/wire.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

// The loops of the lossy codecs, written branch-free so that they
// vectorise; each is compiled for the baseline and, in its Avx2 wrapper,
// for AVX2, picked at run time (CpuHasAvx2; see wire.cc for why not
// target_clones).
#define PSTRAIN_INLINE_LOOP inline __attribute__((always_inline))

PSTRAIN_INLINE_LOOP void AddIntoLoop(const float* a, const float* b, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// Whether any element is not finite (exponent bits all ones).
PSTRAIN_INLINE_LOOP bool AnyNonFiniteLoop(const float* p, int64_t n) {
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, p + i, 4);
    any |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
  }
  return any != 0;
}

// The sum of |p| in double, over eight independent partial sums (so that
// the additions need not wait on each other).
PSTRAIN_INLINE_LOOP double SumOfMagnitudesLoop(const float* p, int64_t n) {
  double partial[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) partial[j] += static_cast<double>(std::fabs(p[i + j]));
  }
  double sum = 0;
  for (; i < n; ++i) sum += static_cast<double>(std::fabs(p[i]));
  for (double v : partial) sum += v;
  return sum;
}

// Bit i of `bits` (LSB first) is set when p[i] < 0; the residual p[i] then
// gains `scale`, else it loses it (what decoding gives back: -scale or
// +scale). `bits` holds (n + 7) / 8 zeroed bytes.
PSTRAIN_INLINE_LOOP void PackSignsLoop(float* p, int64_t n, float scale, uint8_t* bits) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint32_t byte = 0;
    for (int j = 0; j < 8; ++j) {
      const bool negative = p[i + j] < 0.0f;
      byte |= static_cast<uint32_t>(negative) << j;
      p[i + j] -= negative ? -scale : scale;
    }
    bits[i / 8] = static_cast<uint8_t>(byte);
  }
  for (; i < n; ++i) {
    const bool negative = p[i] < 0.0f;
    bits[i / 8] |= static_cast<uint8_t>(static_cast<uint32_t>(negative) << (i % 8));
    p[i] -= negative ? -scale : scale;
  }
}

// out[i] = -scale where bit i is set, else scale (scale >= 0: the bit is
// the sign bit).
PSTRAIN_INLINE_LOOP void UnpackSignsLoop(const uint8_t* bits, int64_t n, float scale, float* out) {
  uint32_t magnitude;
  std::memcpy(&magnitude, &scale, 4);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = magnitude | (((uint32_t{bits[i >> 3]} >> (i & 7)) & 1u) << 31);
    std::memcpy(out + i, &v, 4);
  }
}
#undef PSTRAIN_INLINE_LOOP

#if defined(__x86_64__)
__attribute__((target("avx2"))) void AddIntoAvx2(const float* a, const float* b, int64_t n,
                                                 float* out) {
  AddIntoLoop(a, b, n, out);
}
__attribute__((target("avx2"))) bool AnyNonFiniteAvx2(const float* p, int64_t n) {
  return AnyNonFiniteLoop(p, n);
}
__attribute__((target("avx2"))) double SumOfMagnitudesAvx2(const float* p, int64_t n) {
  return SumOfMagnitudesLoop(p, n);
}
__attribute__((target("avx2"))) void PackSignsAvx2(float* p, int64_t n, float scale,
                                                   uint8_t* bits) {
  PackSignsLoop(p, n, scale, bits);
}
__attribute__((target("avx2"))) void UnpackSignsAvx2(const uint8_t* bits, int64_t n, float scale,
                                                     float* out) {
  UnpackSignsLoop(bits, n, scale, out);
}
#endif

void AddInto(const float* a, const float* b, int64_t n, float* out) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return AddIntoAvx2(a, b, n, out);
#endif
  AddIntoLoop(a, b, n, out);
}

bool AnyNonFinite(const float* p, int64_t n) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return AnyNonFiniteAvx2(p, n);
#endif
  return AnyNonFiniteLoop(p, n);
}

double SumOfMagnitudes(const float* p, int64_t n) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return SumOfMagnitudesAvx2(p, n);
#endif
  return SumOfMagnitudesLoop(p, n);
}

void PackSigns(float* p, int64_t n, float scale, uint8_t* bits) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return PackSignsAvx2(p, n, scale, bits);
#endif
  PackSignsLoop(p, n, scale, bits);
}

void UnpackSigns(const uint8_t* bits, int64_t n, float scale, float* out) {
#if defined(__x86_64__)
  if (CpuHasAvx2()) return UnpackSignsAvx2(bits, n, scale, out);
#endif
  UnpackSignsLoop(bits, n, scale, out);
}

void StoreU32(uint8_t* dst, uint32_t v) {
  for (int i = 0; i < 4; ++i) dst[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t LoadU32(const uint8_t* src) {
  return uint32_t{src[0]} | (uint32_t{src[1]} << 8) | (uint32_t{src[2]} << 16) |
         (uint32_t{src[3]} << 24);
}
void StoreF32(uint8_t* dst, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  StoreU32(dst, bits);
}
float LoadF32(const uint8_t* src) {
  const uint32_t bits = LoadU32(src);
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

std::string ChunkName(const v1::ChunkHeader& header) {
  return absl::StrCat("chunk ", header.chunk_id(), " (",
                      v1::ChunkHeader::Encoding_Name(header.encoding()), ")");
}

// The dense encodings: F32 for NONE (and chunks sent whole), F16 or BF16.
// F16 and BF16 saturate rather than overflow to infinity; NaN stays NaN
// (and is refused by the shard like any non-finite gradient).
absl::Status EncodeDense(v1::CompressionSpec::Method method, const float* p, int64_t n,
                         EncodedGradient* out) {
  out->encoding = v1::ChunkHeader::ENCODING_DENSE;
  out->encoded_count = 0;
  if (method == v1::CompressionSpec::COMPRESSION_NONE) {
    out->dtype = v1::DTYPE_F32;
    out->bytes.resize(static_cast<size_t>(n) * 4);
    if (n > 0) std::memcpy(out->bytes.data(), p, out->bytes.size());
    return absl::OkStatus();
  }
  out->dtype = method == v1::CompressionSpec::COMPRESSION_FP16 ? v1::DTYPE_F16 : v1::DTYPE_BF16;
  out->bytes.resize(static_cast<size_t>(n) * 2);
  return ConvertFromF32(out->dtype, p, n, out->bytes.data(), /*saturate=*/true);
}

}  // namespace

int64_t FirstNonFiniteIndex(const float* p, int64_t n) {
  if (!AnyNonFinite(p, n)) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(p[i])) return i;
  }
  return -1;
}

int64_t TopKCount(float ratio, int64_t n) {
  if (n <= 0) return 0;
  if (!(ratio > 0.0f)) ratio = kDefaultTopKRatio;
  const double k = std::ceil(static_cast<double>(ratio) * static_cast<double>(n));
  if (!(k < static_cast<double>(n))) return n;
  return std::max<int64_t>(1, static_cast<int64_t>(k));
}

absl::StatusOr<uint64_t> EncodedPayloadBytes(const v1::ChunkHeader& header) {
  const int64_t n = header.num_elements();
  if (n < 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_elements must be >= 0, got ", n));
  }
  const uint64_t un = static_cast<uint64_t>(n);
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  switch (header.encoding()) {
    case v1::ChunkHeader::ENCODING_DENSE: {
      if (header.encoded_count() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            ChunkName(header), ": encoded_count must be 0, got ", header.encoded_count()));
      }
      const uint64_t width = static_cast<uint64_t>(DTypeWidth(header.dtype()));
      if (width == 0) {
        if (n == 0) return 0;
        return absl::InvalidArgumentError(
            absl::StrCat("unsupported payload dtype ", v1::DType_Name(header.dtype())));
      }
      if (un > kMax / width) {
        return absl::InvalidArgumentError(
            absl::StrCat("num_elements ", n, " overflows the payload size"));
      }
      return un * width;
    }
    case v1::ChunkHeader::ENCODING_TOPK: {
      if (header.dtype() != v1::DTYPE_F32) {
        return absl::InvalidArgumentError(absl::StrCat(
            ChunkName(header), ": dtype must be F32, got ", v1::DType_Name(header.dtype())));
      }
      const int64_t k = header.encoded_count();
      if (k < 0 || k > n) {
        return absl::InvalidArgumentError(absl::StrCat(ChunkName(header), ": encoded_count ", k,
                                                       " is outside [0, num_elements = ", n, "]"));
      }
      if (static_cast<uint64_t>(k) > kMax / 8) {
        return absl::InvalidArgumentError(
            absl::StrCat(ChunkName(header), ": encoded_count ", k, " overflows the payload size"));
      }
      return static_cast<uint64_t>(k) * 8;
    }
    case v1::ChunkHeader::ENCODING_SIGN: {
      if (header.dtype() != v1::DTYPE_F32) {
        return absl::InvalidArgumentError(absl::StrCat(
            ChunkName(header), ": dtype must be F32, got ", v1::DType_Name(header.dtype())));
      }
      if (header.encoded_count() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            ChunkName(header), ": encoded_count must be 0, got ", header.encoded_count()));
      }
      return 4 + un / 8 + (un % 8 != 0 ? 1 : 0);
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("chunk ", header.chunk_id(),
                                                     ": unknown payload encoding ",
                                                     static_cast<int>(header.encoding())));
  }
}

absl::Status DecodeGradient(const v1::ChunkHeader& header, const void* payload, size_t bytes,
                            absl::Span<float> out) {
  const int64_t n = header.num_elements();
  if (n < 0 || static_cast<uint64_t>(n) != out.size()) {
    return absl::InvalidArgumentError(absl::StrCat(ChunkName(header), ": num_elements ", n,
                                                   " but the destination holds ", out.size()));
  }
  absl::StatusOr<uint64_t> expected = EncodedPayloadBytes(header);
  if (!expected.ok()) return expected.status();
  if (bytes != *expected) {
    return absl::InvalidArgumentError(absl::StrCat("payload of ", ChunkName(header), " has ", bytes,
                                                   " bytes but needs ", *expected));
  }
  const uint8_t* src = static_cast<const uint8_t*>(payload);
  switch (header.encoding()) {
    case v1::ChunkHeader::ENCODING_DENSE:
      if (n == 0) return absl::OkStatus();
      return ConvertToF32(header.dtype(), payload, n, out.data());
    case v1::ChunkHeader::ENCODING_TOPK: {
      const int64_t k = header.encoded_count();
      const uint8_t* values = src + 4 * k;
      std::fill(out.begin(), out.end(), 0.0f);
      int64_t previous = -1;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t index = LoadU32(src + 4 * i);
        if (index <= previous || index >= n) {
          return absl::InvalidArgumentError(absl::StrCat(
              ChunkName(header), ": index ", index, " at position ", i,
              " is out of range or not above the previous one (", previous, "); num_elements ", n));
        }
        const float v = LoadF32(values + 4 * i);
        if (!std::isfinite(v)) {
          return absl::InvalidArgumentError(
              absl::StrCat(ChunkName(header), ": value at index ", index, " is not finite"));
        }
        out[index] = v;
        previous = index;
      }
      return absl::OkStatus();
    }
    case v1::ChunkHeader::ENCODING_SIGN: {
      const float scale = LoadF32(src);
      if (!std::isfinite(scale) || scale < 0.0f) {
        return absl::InvalidArgumentError(
            absl::StrCat(ChunkName(header), ": scale ", scale, " is not finite and >= 0"));
      }
      const uint8_t* bits = src + 4;
      if (n % 8 != 0 && (bits[n / 8] >> (n % 8)) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(ChunkName(header), ": the unused bits of the last sign byte are not 0"));
      }
      UnpackSigns(bits, n, scale, out.data());
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", header.chunk_id(), ": unknown payload encoding"));
  }
}

// --- GradientEncoder ------------------------------------------------------------

GradientEncoder::GradientEncoder(const v1::CompressionSpec& spec, ChunkPlan plan)
    : method_(spec.method()), topk_ratio_(spec.topk_ratio()), plan_(std::move(plan)) {
  residuals_.resize(plan_.chunks.size());
  whole_ = ChunksSentWhole(spec, plan_);
}

bool GradientEncoder::error_feedback() const {
  return method_ == v1::CompressionSpec::COMPRESSION_TOPK ||
         method_ == v1::CompressionSpec::COMPRESSION_ONEBIT;
}

void GradientEncoder::Reset() {
  for (std::vector<float>& r : residuals_) std::vector<float>().swap(r);
}

absl::Span<const float> GradientEncoder::residual(int chunk_id) const {
  if (chunk_id < 0 || chunk_id >= static_cast<int>(residuals_.size())) return {};
  return residuals_[chunk_id];
}

absl::Status GradientEncoder::Encode(int chunk_id, absl::Span<const float> gradient,
                                     EncodedGradient* out) {
  if (chunk_id < 0 || chunk_id >= static_cast<int>(plan_.chunks.size())) {
    return absl::InvalidArgumentError(absl::StrCat("unknown chunk ", chunk_id));
  }
  const int64_t n = plan_.chunks[chunk_id].count;
  if (static_cast<int64_t>(gradient.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", chunk_id, " has ", n, " elements, got ", gradient.size()));
  }
  out->encoded_count = 0;
  // A parameter under min_compress_bytes goes whole (and keeps no residual).
  const v1::CompressionSpec::Method method =
      whole_[chunk_id] ? v1::CompressionSpec::COMPRESSION_NONE : method_;
  switch (method) {
    case v1::CompressionSpec::COMPRESSION_NONE:
    case v1::CompressionSpec::COMPRESSION_FP16:
    case v1::CompressionSpec::COMPRESSION_BF16:
      return EncodeDense(method, gradient.data(), n, out);
    case v1::CompressionSpec::COMPRESSION_TOPK:
    case v1::CompressionSpec::COMPRESSION_ONEBIT:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("compression.method: unknown value ", static_cast<int>(method_)));
  }
  // p = g + r, accepted into the residual only once encoded.
  std::vector<float>& residual = residuals_[chunk_id];
  scratch_.resize(static_cast<size_t>(n));
  if (residual.empty()) {
    std::copy(gradient.begin(), gradient.end(), scratch_.begin());
  } else {
    AddInto(gradient.data(), residual.data(), n, scratch_.data());
  }
  if (const int64_t bad = FirstNonFiniteIndex(scratch_.data(), n); bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the gradient of chunk ", chunk_id, " is not finite at element ", bad));
  }
  absl::Status status = method_ == v1::CompressionSpec::COMPRESSION_TOPK
                            ? EncodeTopK(scratch_, out)
                            : EncodeSign(scratch_, out);
  if (!status.ok()) return status;
  residual.swap(scratch_);  // What was not sent.
  return absl::OkStatus();
}

namespace {

// The TOPK encoding of p; what is sent becomes 0 in p, so that p keeps
// what was not. `magnitudes` and `sample` are scratch.
absl::Status EncodeTopKInto(absl::Span<float> p, float topk_ratio, std::vector<float>& magnitudes,
                            std::vector<float>& sample, EncodedGradient* out) {
  const int64_t n = static_cast<int64_t>(p.size());
  const int64_t k = TopKCount(topk_ratio, n);
  // The k largest magnitudes, ties to the lower index (the same on every
  // machine), sent in index order. T, the k-th largest magnitude, decides:
  // every |p| > T is sent, and the lowest-indexed |p| == T fill the rest.
  // T comes from a candidate set: every magnitude at or above a bound drawn
  // from a sample, when at least k are (then the k largest are all among
  // them); else from all n.
  float threshold = 0.0f;
  if (k < n) {
    magnitudes.clear();
    if (k * 16 < n) {
      // Every 16th magnitude; the bound is the sample's (2k/16)-th largest,
      // which leaves about 2k candidates.
      sample.clear();
      for (int64_t i = 0; i < n; i += 16) sample.push_back(std::fabs(p[i]));
      const int64_t rank = std::min<int64_t>(static_cast<int64_t>(sample.size()) - 1, 2 * k / 16);
      std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<float>());
      const float bound = sample[rank];
      for (int64_t i = 0; i < n; ++i) {
        const float m = std::fabs(p[i]);
        if (m >= bound) magnitudes.push_back(m);
      }
      if (static_cast<int64_t>(magnitudes.size()) < k) magnitudes.clear();
    }
    if (magnitudes.empty()) {
      magnitudes.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) magnitudes[i] = std::fabs(p[i]);
    }
    std::nth_element(magnitudes.begin(), magnitudes.begin() + (k - 1), magnitudes.end(),
                     std::greater<float>());
    threshold = magnitudes[k - 1];
  }
  int64_t above = 0;
  if (k < n) {
    for (int64_t i = 0; i < n; ++i) above += std::fabs(p[i]) > threshold ? 1 : 0;
  }
  int64_t ties_left = k - above;  // Elements equal to T to send, lowest index first.
  out->dtype = v1::DTYPE_F32;
  out->encoding = v1::ChunkHeader::ENCODING_TOPK;
  out->encoded_count = k;
  out->bytes.resize(static_cast<size_t>(k) * 8);
  uint8_t* indices = out->bytes.data();
  uint8_t* values = indices + 4 * k;
  int64_t sent = 0;
  for (int64_t i = 0; i < n && sent < k; ++i) {
    const float m = std::fabs(p[i]);
    bool take = k == n || m > threshold;
    if (!take && m == threshold && ties_left > 0) {
      take = true;
      --ties_left;
    }
    if (!take) continue;
    StoreU32(indices + 4 * sent, static_cast<uint32_t>(i));
    StoreF32(values + 4 * sent, p[i]);
    p[i] = 0.0f;  // Sent: nothing of it stays in the residual.
    ++sent;
  }
  return absl::OkStatus();
}

// SIGN of p; p keeps what decoding does not give back.
absl::Status EncodeSignInto(absl::Span<float> p, EncodedGradient* out) {
  const int64_t n = static_cast<int64_t>(p.size());
  const double sum = SumOfMagnitudes(p.data(), n);
  const float scale = n == 0 ? 0.0f : static_cast<float>(sum / static_cast<double>(n));
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError("the mean magnitude of a gradient chunk is not finite");
  }
  out->dtype = v1::DTYPE_F32;
  out->encoding = v1::ChunkHeader::ENCODING_SIGN;
  out->encoded_count = 0;
  out->bytes.assign(4 + static_cast<size_t>((n + 7) / 8), 0);
  StoreF32(out->bytes.data(), scale);
  PackSigns(p.data(), n, scale, out->bytes.data() + 4);
  return absl::OkStatus();
}

}  // namespace

absl::Status GradientEncoder::EncodeTopK(std::vector<float>& p, EncodedGradient* out) {
  return EncodeTopKInto(absl::MakeSpan(p), topk_ratio_, magnitudes_, sample_, out);
}

absl::Status GradientEncoder::EncodeSign(std::vector<float>& p, EncodedGradient* out) {
  return EncodeSignInto(absl::MakeSpan(p), out);
}

// --- Pull compression -----------------------------------------------------------

std::vector<bool> ChunksSentWhole(const v1::CompressionSpec& spec, const ChunkPlan& plan) {
  std::vector<bool> whole(plan.chunks.size(), false);
  if (spec.method() != v1::CompressionSpec::COMPRESSION_TOPK &&
      spec.method() != v1::CompressionSpec::COMPRESSION_ONEBIT) {
    return whole;
  }
  // Whole parameters, not chunks, are measured: how finely a plan cuts a
  // large parameter (more shards, smaller chunks) must not stop compressing it.
  for (const std::vector<int>& chunks : plan.by_param) {
    int64_t bytes = 0;
    for (int id : chunks) bytes += plan.chunks[id].count * int64_t{4};
    if (bytes >= spec.min_compress_bytes()) continue;
    for (int id : chunks) whole[id] = true;
  }
  return whole;
}

absl::Status EncodeWithoutFeedback(const v1::CompressionSpec& spec, absl::Span<float> p,
                                   EncodedGradient* out) {
  const int64_t n = static_cast<int64_t>(p.size());
  out->encoded_count = 0;
  if (const int64_t bad = FirstNonFiniteIndex(p.data(), n); bad >= 0) {
    return absl::InvalidArgumentError(absl::StrCat("element ", bad, " is not finite"));
  }
  switch (spec.method()) {
    case v1::CompressionSpec::COMPRESSION_NONE:
    case v1::CompressionSpec::COMPRESSION_FP16:
    case v1::CompressionSpec::COMPRESSION_BF16:
      return EncodeDense(spec.method(), p.data(), n, out);
    case v1::CompressionSpec::COMPRESSION_TOPK: {
      std::vector<float> magnitudes, sample;
      return EncodeTopKInto(p, spec.topk_ratio(), magnitudes, sample, out);
    }
    case v1::CompressionSpec::COMPRESSION_ONEBIT:
      return EncodeSignInto(p, out);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("compression.method: unknown value ", static_cast<int>(spec.method())));
  }
}

absl::Status AddEncodedDelta(const v1::ChunkHeader& header, const void* payload, size_t bytes,
                             absl::Span<float> values, std::vector<float>* scratch) {
  scratch->resize(values.size());
  PSTRAIN_RETURN_IF_ERROR(DecodeGradient(header, payload, bytes, absl::MakeSpan(*scratch)));
  const int64_t n = static_cast<int64_t>(values.size());
  if (const int64_t bad = FirstNonFiniteIndex(scratch->data(), n); bad >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(ChunkName(header), ": element ", bad, " of the delta is not finite"));
  }
  AddInto(values.data(), scratch->data(), n, values.data());
  return absl::OkStatus();
}

}  // namespace pstrain
