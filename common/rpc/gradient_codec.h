// Gradient compression on the wire: how a worker encodes a gradient chunk
// (JobSpec.compression) and how a shard decodes and validates it
// (ChunkHeader.encoding), with the error feedback that lets lossy codecs
// converge.
//
//   // Worker, one encoder per run of a job, on the push thread:
//   GradientEncoder encoder(spec.compression(), plan);
//   EncodedGradient encoded;
//   PSTRAIN_RETURN_IF_ERROR(encoder.Encode(chunk_id, gradient, &encoded));
//   // frame: header.set_dtype(encoded.dtype), set_encoding(encoded.encoding),
//   // set_encoded_count(encoded.encoded_count); payload: encoded.bytes.
//
//   // Shard, at the service edge (after DecodeFrame checked the size):
//   PSTRAIN_RETURN_IF_ERROR(DecodeGradient(header, payload, payload_bytes, dense));
//
// Codecs (CompressionSpec.Method -> ChunkHeader.Encoding, bytes for n values):
//   NONE    DENSE F32            4n
//   FP16    DENSE F16            2n  (magnitudes above 65504 saturate)
//   BF16    DENSE BF16           2n
//   TOPK    TOPK, k = ceil(r n)  8k  (uint32 indices, then F32 values)
//   ONEBIT  SIGN                 n/8 + 4 (F32 scale = mean |p|, sign bits)
//
// Error feedback (TOPK, ONEBIT): the encoder keeps per chunk the residual r
// of what it has not sent. It encodes p = g + r and keeps r = p - decode(p's
// encoding). Summed over steps, what the server receives is the sum of the
// true gradients minus the current residual: no part of a gradient is lost,
// only delayed (Stich et al. 2018; Karimireddy et al. 2019, "Error Feedback
// Fixes SignSGD"; DL4J's threshold encoding keeps the same residual).
//
// Validation (DecodeGradient) is as strict as for raw F32: the payload size
// must match the encoding exactly, indices must be strictly increasing and
// in range, values and scales finite, unused bits zero; anything else is
// INVALID_ARGUMENT and nothing is written.
//
// Threads: the free functions are thread-safe. A GradientEncoder belongs to
// one thread at a time.
#ifndef PSTRAIN_COMMON_RPC_GRADIENT_CODEC_H_
#define PSTRAIN_COMMON_RPC_GRADIENT_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/chunking.h"
#include "common/job_spec.h"  // ValidateCompression, kDefaultTopKRatio
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/service.pb.h"

namespace pstrain {

// The number of elements a TOPK chunk of n elements sends: ceil(ratio * n),
// at least 1 and at most n (0 for n == 0). `ratio` 0 means the default.
int64_t TopKCount(float ratio, int64_t n);

// The index of the first of p[0, n) that is not finite, or -1: one
// branch-free pass over the exponent bits (AVX2 where the CPU has it), then a
// scan only when something was found.
int64_t FirstNonFiniteIndex(const float* p, int64_t n);

// The payload bytes a frame with this header must carry (num_elements,
// dtype, encoding, encoded_count), with overflow-safe arithmetic.
// INVALID_ARGUMENT when the combination is not valid (unknown encoding, a
// dtype the encoding does not allow, k out of range).
absl::StatusOr<uint64_t> EncodedPayloadBytes(const v1::ChunkHeader& header);

// Writes the header.num_elements() values a gradient frame's payload encodes
// into `out` (out.size() == num_elements). The payload must be `bytes` long
// (EncodedPayloadBytes). INVALID_ARGUMENT, with `out` unspecified, for an
// invalid payload (see above).
absl::Status DecodeGradient(const v1::ChunkHeader& header, const void* payload, size_t bytes,
                            absl::Span<float> out);

// One chunk's encoded gradient: the frame header's fields and its payload.
struct EncodedGradient {
  v1::DType dtype = v1::DTYPE_F32;
  v1::ChunkHeader::Encoding encoding = v1::ChunkHeader::ENCODING_DENSE;
  int64_t encoded_count = 0;
  std::vector<uint8_t> bytes;
};

// The worker's side: encodes gradient chunks of one chunk plan, keeping the
// error-feedback residuals of lossy codecs per chunk (allocated on a chunk's
// first Encode).
class GradientEncoder {
 public:
  // `spec` must pass ValidateCompression (common/job_spec.h).
  GradientEncoder(const v1::CompressionSpec& spec, ChunkPlan plan);

  // Encodes chunk `chunk_id`'s gradient (plan.chunks[chunk_id].count floats).
  // TOPK and ONEBIT add the chunk's residual first and keep what was not
  // sent; a chunk of a parameter of fewer than spec.min_compress_bytes F32
  // bytes is sent whole (DENSE F32) and has no residual. INVALID_ARGUMENT for an unknown chunk, a
  // wrong size or a non-finite value (the residual is then left as it was).
  absl::Status Encode(int chunk_id, absl::Span<const float> gradient, EncodedGradient* out);

  // Forgets every residual (a new run starts from a checkpoint).
  void Reset();

  // The residual of a chunk (empty before its first Encode); for tests.
  absl::Span<const float> residual(int chunk_id) const;
  v1::CompressionSpec::Method method() const { return method_; }
  // True for the codecs that keep a residual (TOPK, ONEBIT).
  bool error_feedback() const;

 private:
  absl::Status EncodeTopK(std::vector<float>& p, EncodedGradient* out);
  absl::Status EncodeSign(std::vector<float>& p, EncodedGradient* out);

  const v1::CompressionSpec::Method method_;
  const float topk_ratio_;
  const ChunkPlan plan_;
  std::vector<bool> whole_;  // By chunk id: its parameter is under min_compress_bytes.
  std::vector<std::vector<float>> residuals_;  // By chunk id.
  std::vector<float> scratch_;                 // p = g + r before it is accepted.
  std::vector<float> magnitudes_;              // TOPK: candidates for the threshold.
  std::vector<float> sample_;                  // TOPK: every 16th magnitude.
};

// --- Pull compression (JobSpec.pull_compression) ---------------------------
// A shard sends each step's change of the published values encoded like a
// gradient; the difference it has not sent yet is its error feedback, so
// no residual is kept here:
//
//   // Shard, after step v: d = master - published (scratch).
//   PSTRAIN_RETURN_IF_ERROR(EncodeWithoutFeedback(spec, d, &delta));
//   PSTRAIN_RETURN_IF_ERROR(AddEncodedDelta(header_of(delta), delta.bytes.data(),
//                                           delta.bytes.size(), published, &scratch));
//   // Worker holding published(v - 1): the same call gives it published(v),
//   // bit for bit (the same F32 additions of the same decoded values).

// By chunk id: whether `spec` sends the chunk's parameter whole (TOPK and
// ONEBIT with a parameter under min_compress_bytes F32 bytes).
std::vector<bool> ChunksSentWhole(const v1::CompressionSpec& spec, const ChunkPlan& plan);

// Encodes `p` with spec's method, without error feedback. `p` is scratch:
// afterwards it holds what the encoding does not carry (TOPK and ONEBIT;
// unchanged for the others). INVALID_ARGUMENT for a non-finite element.
absl::Status EncodeWithoutFeedback(const v1::CompressionSpec& spec, absl::Span<float> p,
                                   EncodedGradient* out);

// values[i] += the i-th value the payload decodes to (F32 additions, in
// order). Validates like DecodeGradient and refuses non-finite decoded
// values; on error `values` is unchanged. `scratch` holds the decoded values.
absl::Status AddEncodedDelta(const v1::ChunkHeader& header, const void* payload, size_t bytes,
                             absl::Span<float> values, std::vector<float>* scratch);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RPC_GRADIENT_CODEC_H_
