// Gradient codecs (common/rpc/gradient_codec.h): round trips of every codec,
// error feedback converging to the true accumulated gradient, and strict
// validation of hostile encoded payloads.
#include "common/rpc/gradient_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

ChunkPlan OneChunkPlan(int64_t n) {
  ChunkPlan plan;
  ChunkInfo info;
  info.id = 0;
  info.param = 0;
  info.offset = 0;
  info.count = n;
  info.shard = 0;
  plan.chunks.push_back(info);
  plan.by_param.push_back({0});
  return plan;
}

v1::CompressionSpec Spec(v1::CompressionSpec::Method method, float ratio = 0) {
  v1::CompressionSpec spec;
  spec.set_method(method);
  spec.set_topk_ratio(ratio);
  return spec;
}

std::vector<float> RandomGradient(int64_t n, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> g(static_cast<size_t>(n));
  for (float& v : g) v = dist(rng);
  return g;
}

v1::ChunkHeader HeaderOf(const EncodedGradient& e, int64_t n) {
  v1::ChunkHeader h;
  h.set_chunk_id(0);
  h.set_kind(v1::ChunkHeader::KIND_GRADIENT);
  h.set_num_elements(n);
  h.set_dtype(e.dtype);
  h.set_encoding(e.encoding);
  h.set_encoded_count(e.encoded_count);
  return h;
}

std::vector<float> Decode(const EncodedGradient& e, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n), 123.0f);
  absl::Status status =
      DecodeGradient(HeaderOf(e, n), e.bytes.data(), e.bytes.size(), absl::MakeSpan(out));
  EXPECT_OK(status);
  return out;
}

TEST(CompressionSpecTest, ValidatesMethodAndRatio) {
  EXPECT_OK(ValidateCompression(Spec(v1::CompressionSpec::COMPRESSION_NONE)));
  EXPECT_OK(ValidateCompression(Spec(v1::CompressionSpec::COMPRESSION_TOPK)));
  EXPECT_OK(ValidateCompression(Spec(v1::CompressionSpec::COMPRESSION_TOPK, 1.0f)));
  EXPECT_THAT(ValidateCompression(Spec(v1::CompressionSpec::COMPRESSION_TOPK, 1.5f)).message(),
              HasSubstr("topk_ratio must be in (0, 1]"));
  EXPECT_FALSE(
      ValidateCompression(Spec(v1::CompressionSpec::COMPRESSION_TOPK, std::nanf(""))).ok());
  EXPECT_THAT(ValidateCompression(Spec(v1::CompressionSpec::COMPRESSION_ONEBIT, 0.1f)).message(),
              HasSubstr("only for COMPRESSION_TOPK"));
  EXPECT_THAT(ValidateCompression(Spec(static_cast<v1::CompressionSpec::Method>(42))).message(),
              HasSubstr("compression.method 42 is not a known method"));
}

TEST(CompressionSpecTest, MinCompressBytesIsForTopKAndOneBitAndNotNegative) {
  for (auto method :
       {v1::CompressionSpec::COMPRESSION_TOPK, v1::CompressionSpec::COMPRESSION_ONEBIT}) {
    v1::CompressionSpec spec = Spec(method);
    spec.set_min_compress_bytes(262144);
    EXPECT_OK(ValidateCompression(spec));
    spec.set_min_compress_bytes(-1);
    EXPECT_THAT(ValidateCompression(spec).message(),
                HasSubstr("min_compress_bytes must be >= 0, got -1"));
  }
  for (auto method : {v1::CompressionSpec::COMPRESSION_NONE, v1::CompressionSpec::COMPRESSION_FP16,
                      v1::CompressionSpec::COMPRESSION_BF16}) {
    v1::CompressionSpec spec = Spec(method);
    spec.set_min_compress_bytes(4096);
    EXPECT_THAT(
        ValidateCompression(spec).message(),
        HasSubstr("min_compress_bytes is only for COMPRESSION_TOPK and COMPRESSION_ONEBIT"));
  }
}

TEST(CompressionSpecTest, TopKCountIsCeilingClampedToOneAndN) {
  EXPECT_EQ(TopKCount(0.01f, 1000), 10);
  EXPECT_EQ(TopKCount(0.01f, 1001), 11);
  EXPECT_EQ(TopKCount(0.01f, 5), 1);
  EXPECT_EQ(TopKCount(0.0f, 1000), 10);  // The default ratio.
  EXPECT_EQ(TopKCount(1.0f, 7), 7);
  EXPECT_EQ(TopKCount(0.5f, 0), 0);
}

TEST(GradientCodecTest, NoneIsExact) {
  const int64_t n = 1000;
  GradientEncoder encoder(Spec(v1::CompressionSpec::COMPRESSION_NONE), OneChunkPlan(n));
  std::vector<float> g = RandomGradient(n, 1);
  EncodedGradient e;
  ASSERT_OK(encoder.Encode(0, g, &e));
  EXPECT_EQ(e.bytes.size(), 4u * n);
  EXPECT_EQ(Decode(e, n), g);
  EXPECT_FALSE(encoder.error_feedback());
}

TEST(GradientCodecTest, HalfAndBfloatRoundTripWithinTheirPrecision) {
  const int64_t n = 4096;
  std::vector<float> g = RandomGradient(n, 2, 0.01f);
  g[0] = 1e6f;  // Beyond fp16: saturates to 65504 (bf16 keeps it).
  g[1] = -1e6f;
  for (auto [method, rel] : {std::pair{v1::CompressionSpec::COMPRESSION_FP16, 1.0f / 2048},
                             std::pair{v1::CompressionSpec::COMPRESSION_BF16, 1.0f / 256}}) {
    GradientEncoder encoder(Spec(method), OneChunkPlan(n));
    EncodedGradient e;
    ASSERT_OK(encoder.Encode(0, g, &e));
    EXPECT_EQ(e.bytes.size(), 2u * n);
    const std::vector<float> d = Decode(e, n);
    for (int64_t i = 2; i < n; ++i) {
      // Normal range: relative error within half an ulp; tiny values: the
      // subnormal step.
      EXPECT_NEAR(d[i], g[i], std::fabs(g[i]) * rel + 6e-8f) << i;
    }
    if (method == v1::CompressionSpec::COMPRESSION_FP16) {
      EXPECT_EQ(d[0], 65504.0f);
      EXPECT_EQ(d[1], -65504.0f);
    } else {
      EXPECT_NEAR(d[0], 1e6f, 1e6f / 256);
    }
    EXPECT_TRUE(encoder.residual(0).empty());  // No error feedback.
  }
}

TEST(GradientCodecTest, TopKSendsTheLargestMagnitudesAndKeepsTheRestExactly) {
  const int64_t n = 10000;
  GradientEncoder encoder(Spec(v1::CompressionSpec::COMPRESSION_TOPK, 0.01f), OneChunkPlan(n));
  std::vector<float> g = RandomGradient(n, 3);
  EncodedGradient e;
  ASSERT_OK(encoder.Encode(0, g, &e));
  EXPECT_EQ(e.encoding, v1::ChunkHeader::ENCODING_TOPK);
  EXPECT_EQ(e.encoded_count, 100);
  EXPECT_EQ(e.bytes.size(), 800u);
  const std::vector<float> d = Decode(e, n);
  // Every sent value is exact, and no unsent magnitude exceeds a sent one.
  float smallest_sent = std::numeric_limits<float>::infinity(), largest_unsent = 0;
  int sent = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (d[i] != 0.0f) {
      ++sent;
      EXPECT_EQ(d[i], g[i]);
      smallest_sent = std::min(smallest_sent, std::fabs(g[i]));
    } else {
      largest_unsent = std::max(largest_unsent, std::fabs(g[i]));
    }
  }
  EXPECT_EQ(sent, 100);
  EXPECT_GE(smallest_sent, largest_unsent);
  // sent + residual == gradient, bit for bit.
  absl::Span<const float> r = encoder.residual(0);
  ASSERT_EQ(r.size(), static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(d[i] + r[i], g[i]) << i;
}

// The selection is the k largest magnitudes with ties to the lower index,
// sent in index order, whatever shortcut finds them: compared, byte for
// byte, with a plain sort of all indices, on random gradients and on ones
// made of a few repeated magnitudes (many ties at the threshold), at
// several sizes and ratios.
TEST(GradientCodecTest, TopKPicksTheSameElementsAsAFullSort) {
  std::mt19937 rng(11);
  for (int64_t n : {int64_t{7}, int64_t{1000}, int64_t{10000}, int64_t{262144}}) {
    for (float ratio : {0.001f, 0.01f, 0.3f, 1.0f}) {
      for (bool ties : {false, true}) {
        std::vector<float> g = RandomGradient(n, static_cast<uint32_t>(n) + (ties ? 1 : 0));
        if (ties) {
          std::uniform_int_distribution<int> level(-3, 3);
          for (float& v : g) v = 0.25f * static_cast<float>(level(rng));
        }
        GradientEncoder encoder(Spec(v1::CompressionSpec::COMPRESSION_TOPK, ratio),
                                OneChunkPlan(n));
        EncodedGradient e;
        ASSERT_OK(encoder.Encode(0, g, &e));
        const int64_t k = TopKCount(ratio, n);
        std::vector<uint32_t> order(static_cast<size_t>(n));
        std::iota(order.begin(), order.end(), 0u);
        std::sort(order.begin(), order.end(), [&g](uint32_t a, uint32_t b) {
          const float fa = std::fabs(g[a]), fb = std::fabs(g[b]);
          return fa > fb || (fa == fb && a < b);
        });
        std::sort(order.begin(), order.begin() + k);
        ASSERT_EQ(e.encoded_count, k);
        ASSERT_EQ(e.bytes.size(), static_cast<size_t>(8 * k));
        for (int64_t i = 0; i < k; ++i) {
          uint32_t index;
          float value;
          std::memcpy(&index, e.bytes.data() + 4 * i, 4);
          std::memcpy(&value, e.bytes.data() + 4 * k + 4 * i, 4);
          ASSERT_EQ(index, order[i]) << "n " << n << " ratio " << ratio << " ties " << ties;
          ASSERT_EQ(value, g[index]);
        }
      }
    }
  }
}

// Under min_compress_bytes a parameter goes whole, exactly, and keeps no
// residual; from it up, as before. A two-chunk plan: 1000 and 1024 elements
// (4000 and 4096 bytes) against a limit of 4096 bytes.
TEST(GradientCodecTest, ParametersUnderMinCompressBytesArePushedWholeWithoutResidual) {
  ChunkPlan plan = OneChunkPlan(1000);
  ChunkInfo second = plan.chunks[0];
  second.id = 1;
  second.param = 1;
  second.count = 1024;
  plan.chunks.push_back(second);
  plan.by_param.push_back({1});
  for (auto method :
       {v1::CompressionSpec::COMPRESSION_TOPK, v1::CompressionSpec::COMPRESSION_ONEBIT}) {
    SCOPED_TRACE(v1::CompressionSpec::Method_Name(method));
    v1::CompressionSpec spec = Spec(method);
    spec.set_min_compress_bytes(4096);
    GradientEncoder encoder(spec, plan);
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> small = RandomGradient(1000, 20 + step);
      EncodedGradient e;
      ASSERT_OK(encoder.Encode(0, small, &e));
      EXPECT_EQ(e.encoding, v1::ChunkHeader::ENCODING_DENSE);
      EXPECT_EQ(e.dtype, v1::DTYPE_F32);
      EXPECT_EQ(e.bytes.size(), 4000u);
      EXPECT_EQ(Decode(e, 1000), small);  // Exact: nothing held back.
      EXPECT_TRUE(encoder.residual(0).empty());

      const std::vector<float> large = RandomGradient(1024, 40 + step);
      ASSERT_OK(encoder.Encode(1, large, &e));
      EXPECT_NE(e.encoding, v1::ChunkHeader::ENCODING_DENSE);
      EXPECT_LT(e.bytes.size(), 4096u / 4);
      EXPECT_EQ(encoder.residual(1).size(), 1024u);
    }
  }
}

// min_compress_bytes measures the parameter, not the chunk: a parameter of
// 8192 bytes cut into two chunks of 4096 (more shards cut finer, see
// AutoChunkBytes) is still compressed under a limit of 6000, while a
// one-chunk parameter of 4000 bytes is not.
TEST(GradientCodecTest, MinCompressBytesMeasuresTheWholeParameterNotItsChunks) {
  ChunkPlan plan = OneChunkPlan(1000);
  for (int i = 1; i <= 2; ++i) {
    ChunkInfo c = plan.chunks[0];
    c.id = i;
    c.param = 1;
    c.offset = (i - 1) * 1024;
    c.count = 1024;
    plan.chunks.push_back(c);
  }
  plan.by_param.push_back({1, 2});
  v1::CompressionSpec spec = Spec(v1::CompressionSpec::COMPRESSION_ONEBIT);
  spec.set_min_compress_bytes(6000);
  GradientEncoder encoder(spec, plan);
  EncodedGradient e;
  ASSERT_OK(encoder.Encode(0, RandomGradient(1000, 3), &e));
  EXPECT_EQ(e.encoding, v1::ChunkHeader::ENCODING_DENSE);
  for (int id : {1, 2}) {
    ASSERT_OK(encoder.Encode(id, RandomGradient(1024, 4 + id), &e));
    EXPECT_NE(e.encoding, v1::ChunkHeader::ENCODING_DENSE) << "chunk " << id;
    EXPECT_EQ(encoder.residual(id).size(), 1024u);
  }
}

TEST(GradientCodecTest, OneBitSendsSignsAndTheMeanMagnitude) {
  const int64_t n = 1003;  // Not a multiple of 8: the last byte is partial.
  GradientEncoder encoder(Spec(v1::CompressionSpec::COMPRESSION_ONEBIT), OneChunkPlan(n));
  std::vector<float> g = RandomGradient(n, 4);
  EncodedGradient e;
  ASSERT_OK(encoder.Encode(0, g, &e));
  EXPECT_EQ(e.encoding, v1::ChunkHeader::ENCODING_SIGN);
  EXPECT_EQ(e.bytes.size(), 4u + (n + 7) / 8);
  double mean = 0;
  for (float v : g) mean += std::fabs(v);
  mean /= n;
  const std::vector<float> d = Decode(e, n);
  absl::Span<const float> r = encoder.residual(0);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(std::fabs(d[i]), mean, 1e-6) << i;
    EXPECT_EQ(d[i] < 0, g[i] < 0) << i;
    EXPECT_NEAR(d[i] + r[i], g[i], 1e-6f) << i;
  }
}

// The error-feedback property: summed over T steps, the decoded updates
// equal the summed true gradients minus the current residual, and the
// residual stays bounded, so the accumulated error relative to the
// accumulated gradient shrinks as 1/T. Without feedback (a fresh encoder,
// hence no residual, every step) top-k at 1% loses 99% of the gradient.
TEST(GradientCodecTest, ErrorFeedbackMakesAccumulatedUpdatesConvergeToTheTrueGradients) {
  const int64_t n = 2000;
  const int steps = 400;
  for (auto method :
       {v1::CompressionSpec::COMPRESSION_TOPK, v1::CompressionSpec::COMPRESSION_ONEBIT}) {
    GradientEncoder with_feedback(Spec(method), OneChunkPlan(n));
    std::vector<double> sum_true(n), sum_fed(n), sum_plain(n);
    std::vector<float> mean_direction = RandomGradient(n, 5, 0.1f);
    for (int t = 0; t < steps; ++t) {
      // A consistent direction plus noise, like minibatch gradients.
      std::vector<float> g = RandomGradient(n, 100 + t);
      for (int64_t i = 0; i < n; ++i) g[i] += mean_direction[i];
      EncodedGradient e;
      ASSERT_OK(with_feedback.Encode(0, g, &e));
      const std::vector<float> fed = Decode(e, n);
      GradientEncoder without(Spec(method), OneChunkPlan(n));
      ASSERT_OK(without.Encode(0, g, &e));
      const std::vector<float> plain = Decode(e, n);
      for (int64_t i = 0; i < n; ++i) {
        sum_true[i] += g[i];
        sum_fed[i] += fed[i];
        sum_plain[i] += plain[i];
      }
    }
    double norm_true = 0, err_fed = 0, err_plain = 0, identity = 0;
    absl::Span<const float> r = with_feedback.residual(0);
    for (int64_t i = 0; i < n; ++i) {
      norm_true += sum_true[i] * sum_true[i];
      err_fed += (sum_fed[i] - sum_true[i]) * (sum_fed[i] - sum_true[i]);
      err_plain += (sum_plain[i] - sum_true[i]) * (sum_plain[i] - sum_true[i]);
      const double gap = sum_true[i] - sum_fed[i] - r[i];
      identity += gap * gap;
    }
    const double rel_fed = std::sqrt(err_fed / norm_true);
    const double rel_plain = std::sqrt(err_plain / norm_true);
    SCOPED_TRACE(v1::CompressionSpec::Method_Name(method));
    // sum(decoded) == sum(true) - residual, up to float rounding.
    EXPECT_LT(std::sqrt(identity / norm_true), 1e-4);
    EXPECT_LT(rel_fed, 0.25) << "with error feedback";
    EXPECT_GT(rel_plain, 2 * rel_fed) << "without error feedback";
  }
}

TEST(GradientCodecTest, ANonFiniteGradientIsRefusedAndTheResidualKept) {
  const int64_t n = 100;
  GradientEncoder encoder(Spec(v1::CompressionSpec::COMPRESSION_TOPK, 0.1f), OneChunkPlan(n));
  EncodedGradient e;
  ASSERT_OK(encoder.Encode(0, RandomGradient(n, 6), &e));
  const std::vector<float> before(encoder.residual(0).begin(), encoder.residual(0).end());
  std::vector<float> bad = RandomGradient(n, 7);
  bad[50] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(encoder.Encode(0, bad, &e).message(), HasSubstr("not finite at element 50"));
  EXPECT_EQ(std::vector<float>(encoder.residual(0).begin(), encoder.residual(0).end()), before);
  EXPECT_FALSE(encoder.Encode(0, std::vector<float>(n + 1), &e).ok());
  EXPECT_FALSE(encoder.Encode(1, std::vector<float>(n), &e).ok());
  encoder.Reset();
  EXPECT_TRUE(encoder.residual(0).empty());
}

// --- Hostile payloads -------------------------------------------------------------

class HostilePayloadTest : public ::testing::Test {
 protected:
  absl::Status DecodeBytes(const v1::ChunkHeader& header, const std::vector<uint8_t>& bytes) {
    std::vector<float> out(static_cast<size_t>(std::max<int64_t>(0, header.num_elements())));
    return DecodeGradient(header, bytes.data(), bytes.size(), absl::MakeSpan(out));
  }
  static void PutU32(std::vector<uint8_t>& b, size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
  }
  static void PutF32(std::vector<uint8_t>& b, size_t at, float f) {
    uint32_t v;
    std::memcpy(&v, &f, 4);
    PutU32(b, at, v);
  }
  // A valid TOPK frame of n = 16 with k = 2 (indices 3, 9).
  std::pair<v1::ChunkHeader, std::vector<uint8_t>> TopK() {
    EncodedGradient e;
    e.encoding = v1::ChunkHeader::ENCODING_TOPK;
    e.encoded_count = 2;
    std::vector<uint8_t> b(16);
    PutU32(b, 0, 3);
    PutU32(b, 4, 9);
    PutF32(b, 8, 0.5f);
    PutF32(b, 12, -2.0f);
    return {HeaderOf(e, 16), b};
  }
  std::pair<v1::ChunkHeader, std::vector<uint8_t>> Sign(int64_t n) {
    EncodedGradient e;
    e.encoding = v1::ChunkHeader::ENCODING_SIGN;
    std::vector<uint8_t> b(4 + (n + 7) / 8, 0);
    PutF32(b, 0, 0.25f);
    return {HeaderOf(e, n), b};
  }
};

TEST_F(HostilePayloadTest, ValidFramesDecode) {
  auto [h, b] = TopK();
  std::vector<float> out(16, 7.0f);
  ASSERT_OK(DecodeGradient(h, b.data(), b.size(), absl::MakeSpan(out)));
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(out[i], i == 3 ? 0.5f : i == 9 ? -2.0f : 0.0f) << i;
  }
  auto [hs, bs] = Sign(10);
  bs[4] = 0x05;  // Elements 0 and 2 negative.
  bs[5] = 0x02;  // Element 9 negative.
  std::vector<float> sign(10);
  ASSERT_OK(DecodeGradient(hs, bs.data(), bs.size(), absl::MakeSpan(sign)));
  EXPECT_EQ(sign, (std::vector<float>{-0.25f, 0.25f, -0.25f, 0.25f, 0.25f, 0.25f, 0.25f, 0.25f,
                                      0.25f, -0.25f}));
}

TEST_F(HostilePayloadTest, TopKIndexOutOfRange) {
  auto [h, b] = TopK();
  PutU32(b, 4, 16);
  EXPECT_THAT(DecodeBytes(h, b).message(), HasSubstr("out of range"));
  PutU32(b, 4, 0xFFFFFFFFu);
  EXPECT_FALSE(DecodeBytes(h, b).ok());
}

TEST_F(HostilePayloadTest, TopKDuplicateOrDescendingIndex) {
  auto [h, b] = TopK();
  PutU32(b, 4, 3);  // Duplicate: would apply index 3 twice.
  EXPECT_THAT(DecodeBytes(h, b).message(), HasSubstr("not above the previous one"));
  PutU32(b, 4, 1);
  EXPECT_FALSE(DecodeBytes(h, b).ok());
}

TEST_F(HostilePayloadTest, TopKCountBeyondTheChunkOrNegative) {
  auto [h, b] = TopK();
  h.set_encoded_count(17);
  b.resize(17 * 8);
  EXPECT_THAT(DecodeBytes(h, b).message(), HasSubstr("outside [0, num_elements = 16]"));
  h.set_encoded_count(-1);
  EXPECT_FALSE(EncodedPayloadBytes(h).ok());
  h.set_encoded_count(std::numeric_limits<int64_t>::max());
  h.set_num_elements(std::numeric_limits<int64_t>::max());
  EXPECT_THAT(EncodedPayloadBytes(h).status().message(), HasSubstr("overflows"));
}

TEST_F(HostilePayloadTest, TopKNonFiniteValueOrWrongDtypeOrSize) {
  auto [h, b] = TopK();
  PutF32(b, 12, std::numeric_limits<float>::quiet_NaN());
  EXPECT_THAT(DecodeBytes(h, b).message(), HasSubstr("not finite"));
  auto [h2, b2] = TopK();
  h2.set_dtype(v1::DTYPE_F16);
  EXPECT_THAT(DecodeBytes(h2, b2).message(), HasSubstr("dtype must be F32"));
  auto [h3, b3] = TopK();
  b3.pop_back();
  EXPECT_THAT(DecodeBytes(h3, b3).message(), HasSubstr("has 15 bytes but needs 16"));
}

TEST_F(HostilePayloadTest, SignScaleNotFiniteOrNegative) {
  for (float scale :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(), -1.0f}) {
    auto [h, b] = Sign(16);
    PutF32(b, 0, scale);
    EXPECT_THAT(DecodeBytes(h, b).message(), HasSubstr("is not finite and >= 0")) << scale;
  }
}

TEST_F(HostilePayloadTest, SignPaddingBitsOrCountOrSize) {
  auto [h, b] = Sign(10);
  b[5] = 0x04;  // Bit 10: beyond the 10 elements.
  EXPECT_THAT(DecodeBytes(h, b).message(), HasSubstr("unused bits"));
  auto [h2, b2] = Sign(10);
  h2.set_encoded_count(3);
  EXPECT_THAT(DecodeBytes(h2, b2).message(), HasSubstr("encoded_count must be 0"));
  auto [h3, b3] = Sign(10);
  b3.push_back(0);
  EXPECT_FALSE(DecodeBytes(h3, b3).ok());
}

TEST_F(HostilePayloadTest, UnknownEncodingAndDenseCountAndWrongDestination) {
  auto [h, b] = TopK();
  h.set_encoding(static_cast<v1::ChunkHeader::Encoding>(9));
  EXPECT_THAT(DecodeBytes(h, b).message(), HasSubstr("unknown payload encoding 9"));
  v1::ChunkHeader dense;
  dense.set_num_elements(4);
  dense.set_dtype(v1::DTYPE_F32);
  dense.set_encoded_count(1);
  EXPECT_THAT(DecodeBytes(dense, std::vector<uint8_t>(16)).message(),
              HasSubstr("encoded_count must be 0"));
  dense.set_encoded_count(0);
  std::vector<uint8_t> bytes(16);
  std::vector<float> small(3);
  EXPECT_FALSE(DecodeGradient(dense, bytes.data(), bytes.size(), absl::MakeSpan(small)).ok());
}

// --- Pull compression -----------------------------------------------------------

// Without feedback, what the encoding does not carry stays in the input:
// adding the decoded values to a copy of the base and the remainder gives
// the target back (up to F32 rounding), for every codec.
TEST(PullDeltaTest, EncodeWithoutFeedbackLeavesWhatItDidNotSendInTheInput) {
  const int64_t n = 1000;
  const std::vector<float> difference = RandomGradient(n, 21, 0.01f);
  for (auto method : {v1::CompressionSpec::COMPRESSION_NONE, v1::CompressionSpec::COMPRESSION_FP16,
                      v1::CompressionSpec::COMPRESSION_BF16, v1::CompressionSpec::COMPRESSION_TOPK,
                      v1::CompressionSpec::COMPRESSION_ONEBIT}) {
    const v1::CompressionSpec spec =
        Spec(method, method == v1::CompressionSpec::COMPRESSION_TOPK ? 0.1f : 0.f);
    std::vector<float> p = difference;
    EncodedGradient e;
    ASSERT_OK(EncodeWithoutFeedback(spec, absl::MakeSpan(p), &e));
    std::vector<float> base(static_cast<size_t>(n), 0.5f), scratch;
    ASSERT_OK(AddEncodedDelta(HeaderOf(e, n), e.bytes.data(), e.bytes.size(),
                                absl::MakeSpan(base), &scratch));
    const std::vector<float> sent = Decode(e, n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(base[i], 0.5f + sent[i]) << i;  // The same F32 addition.
      if (method == v1::CompressionSpec::COMPRESSION_TOPK ||
          method == v1::CompressionSpec::COMPRESSION_ONEBIT) {
        ASSERT_NEAR(sent[i] + p[i], difference[i], 1e-6f) << i;
      }
    }
  }
  std::vector<float> bad = {1.0f, std::numeric_limits<float>::infinity()};
  EncodedGradient e;
  EXPECT_FALSE(
      EncodeWithoutFeedback(Spec(v1::CompressionSpec::COMPRESSION_FP16), absl::MakeSpan(bad), &e)
          .ok());
}

// A hostile delta (bad index, wrong size, infinite half) is refused and the
// values it would have been added to are untouched.
TEST(PullDeltaTest, AMalformedDeltaLeavesTheValuesUnchanged) {
  const int64_t n = 16;
  const std::vector<float> before = RandomGradient(n, 5);
  std::vector<float> values = before, scratch;
  // Top-k with indices out of order.
  v1::ChunkHeader topk;
  topk.set_num_elements(n);
  topk.set_dtype(v1::DTYPE_F32);
  topk.set_encoding(v1::ChunkHeader::ENCODING_TOPK);
  topk.set_encoded_count(2);
  std::vector<uint8_t> payload(16, 0);
  payload[0] = 9;  // Index 9, then index 3.
  payload[4] = 3;
  EXPECT_FALSE(
      AddEncodedDelta(topk, payload.data(), payload.size(), absl::MakeSpan(values), &scratch).ok());
  EXPECT_EQ(values, before);
  // A payload one byte short.
  EXPECT_FALSE(
      AddEncodedDelta(topk, payload.data(), payload.size() - 1, absl::MakeSpan(values), &scratch)
          .ok());
  EXPECT_EQ(values, before);
  // F16 infinity (0x7c00) in a dense half-precision delta.
  v1::ChunkHeader half;
  half.set_num_elements(n);
  half.set_dtype(v1::DTYPE_F16);
  std::vector<uint16_t> halves(static_cast<size_t>(n), 0x3c00);  // 1.0
  halves[7] = 0x7c00;
  absl::Status status =
      AddEncodedDelta(half, halves.data(), halves.size() * 2, absl::MakeSpan(values), &scratch);
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr("not finite"));
  EXPECT_EQ(values, before);
}

}  // namespace
}  // namespace pstrain
