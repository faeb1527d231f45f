// Framing (common/rpc/wire.h): round trips over one and many slices, every
// decode error, the buffer pool, and the fp16/bf16 conversions.
#include "common/rpc/wire.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

v1::ChunkHeader Header(int64_t n, v1::DType dtype = v1::DTYPE_F32) {
  v1::ChunkHeader h;
  h.set_job_id("job-1");
  h.set_worker_id("worker-1");
  h.set_generation(3);
  h.set_chunk_id(17);
  h.set_version(42);
  h.set_kind(v1::ChunkHeader::KIND_GRADIENT);
  h.set_dtype(dtype);
  h.set_num_elements(n);
  return h;
}

std::vector<float> Ramp(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(i) * 0.5f - 3.0f;
  return v;
}

// The frame's bytes re-cut into slices of `piece` bytes (as a receiver may get them).
grpc::ByteBuffer Recut(const grpc::ByteBuffer& frame, size_t piece) {
  std::vector<grpc::Slice> slices;
  EXPECT_OK(frame.Dump(&slices));
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  std::vector<grpc::Slice> pieces;
  for (size_t at = 0; at < bytes.size(); at += piece) {
    pieces.emplace_back(bytes.data() + at, std::min(piece, bytes.size() - at));
  }
  return grpc::ByteBuffer(pieces.data(), pieces.size());
}

grpc::ByteBuffer Raw(const std::string& bytes) {
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

std::string Prefixed(uint32_t header_size, const std::string& rest) {
  std::string out(4, '\0');
  std::memcpy(out.data(), &header_size, 4);  // The test machine is little-endian.
  return out + rest;
}

TEST(WireTest, RoundTripReferencesThePayloadWithoutCopying) {
  std::vector<float> values = Ramp(1000);
  grpc::ByteBuffer frame;
  ASSERT_OK(EncodeFrame(Header(1000), values.data(), values.size() * 4, &frame));
  std::vector<grpc::Slice> slices;
  ASSERT_OK(frame.Dump(&slices));
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(slices[1].begin(), reinterpret_cast<const uint8_t*>(values.data()));

  v1::ChunkHeader header;
  PayloadView payload;
  ASSERT_OK(DecodeFrame(frame, &header, &payload));
  EXPECT_EQ(header.SerializeAsString(), Header(1000).SerializeAsString());
  ASSERT_EQ(payload.size(), 4000u);
  EXPECT_TRUE(payload.in_place());
  BufferPool pool;
  EXPECT_EQ(payload.Contiguous(&pool), values.data());  // Read in place.
  std::vector<float> out(1000);
  payload.CopyTo(out.data());
  EXPECT_EQ(out, values);
}

TEST(WireTest, CopiedPayloadDoesNotAliasTheSource) {
  std::vector<float> values = Ramp(10);
  grpc::ByteBuffer frame;
  ASSERT_OK(EncodeFrame(Header(10), values.data(), 40, &frame, /*copy_payload=*/true));
  values.assign(10, 0.0f);
  v1::ChunkHeader header;
  PayloadView payload;
  ASSERT_OK(DecodeFrame(frame, &header, &payload));
  std::vector<float> out(10);
  payload.CopyTo(out.data());
  EXPECT_EQ(out, Ramp(10));
}

TEST(WireTest, KeepAliveIsReleasedWithTheFrame) {
  auto values = std::make_shared<std::vector<float>>(Ramp(64));
  std::weak_ptr<std::vector<float>> watch = values;
  {
    grpc::ByteBuffer frame;
    ASSERT_OK(EncodeFrame(Header(64), values->data(), 256, std::shared_ptr<const void>(values), &frame));
    values.reset();
    EXPECT_FALSE(watch.expired());  // The frame holds it.
    v1::ChunkHeader header;
    PayloadView payload;
    ASSERT_OK(DecodeFrame(frame, &header, &payload));
    std::vector<float> out(64);
    payload.CopyTo(out.data());
    EXPECT_EQ(out, Ramp(64));
  }
  EXPECT_TRUE(watch.expired());
}

TEST(WireTest, DecodesAcrossManySlicesAtEveryCut) {
  std::vector<float> values = Ramp(257);
  grpc::ByteBuffer frame;
  ASSERT_OK(EncodeFrame(Header(257), values.data(), values.size() * 4, &frame));
  BufferPool pool;
  for (size_t piece : {1u, 3u, 7u, 64u, 1000u}) {
    grpc::ByteBuffer cut = Recut(frame, piece);
    v1::ChunkHeader header;
    PayloadView payload;
    ASSERT_OK(DecodeFrame(cut, &header, &payload)) << piece;
    EXPECT_EQ(header.chunk_id(), 17);
    EXPECT_FALSE(payload.in_place()) << piece;
    std::vector<float> out(257);
    payload.CopyTo(out.data());
    EXPECT_EQ(out, values) << piece;
    const float* contiguous = static_cast<const float*>(payload.Contiguous(&pool));
    EXPECT_EQ(std::vector<float>(contiguous, contiguous + 257), values) << piece;
  }
}

TEST(WireTest, HeaderOnlyFrame) {
  v1::ChunkHeader request = Header(0, v1::DTYPE_UNSPECIFIED);
  request.add_chunk_ids(3);
  request.add_chunk_ids(1);
  grpc::ByteBuffer frame;
  ASSERT_OK(EncodeFrame(request, nullptr, 0, &frame));
  v1::ChunkHeader header;
  PayloadView payload;
  ASSERT_OK(DecodeFrame(frame, &header, &payload));
  EXPECT_EQ(payload.size(), 0u);
  EXPECT_THAT(header.chunk_ids(), ::testing::ElementsAre(3, 1));
}

TEST(WireTest, DecodeErrorsAreInvalidArgument) {
  struct Case {
    std::string bytes;
    std::string message;
  };
  const std::string good_header = Header(2).SerializeAsString();
  std::vector<Case> cases = {
      {"", "shorter"},
      {"\x01\x02", "shorter"},
      {Prefixed(100, "abc"), "header_size"},
      {Prefixed(static_cast<uint32_t>(kMaxFrameHeaderBytes) + 1,
                std::string(kMaxFrameHeaderBytes + 2, 'x')),
       "header_size"},
      {Prefixed(4, "\xff\xff\xff\xff"), "not a valid ChunkHeader"},
      // Two floats announced, seven bytes sent.
      {Prefixed(good_header.size(), good_header + std::string(7, '\0')), "needs 8"},
      {Prefixed(good_header.size(), good_header + std::string(9, '\0')), "needs 8"},
  };
  v1::ChunkHeader negative = Header(-1);
  cases.push_back({Prefixed(negative.ByteSizeLong(), negative.SerializeAsString()), ">= 0"});
  v1::ChunkHeader unknown = Header(2, static_cast<v1::DType>(99));
  cases.push_back(
      {Prefixed(unknown.ByteSizeLong(), unknown.SerializeAsString() + std::string(8, '\0')),
       "unsupported payload dtype"});
  for (const Case& c : cases) {
    v1::ChunkHeader header;
    PayloadView payload;
    absl::Status status = DecodeFrame(Raw(c.bytes), &header, &payload);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.message));
  }
}

TEST(WireTest, PoolReusesBuffersAndCapsWhatItKeeps) {
  BufferPool pool(/*max_cached_bytes=*/1 << 20);
  void* first;
  {
    PooledBuffer a = pool.Acquire(300000);
    EXPECT_GE(a.capacity(), 300000u);
    first = a.data();
  }
  EXPECT_EQ(pool.cached_bytes(), size_t{1} << 19);
  {
    PooledBuffer b = pool.Acquire(400000);  // Same power-of-two class.
    EXPECT_EQ(b.data(), first);
    EXPECT_EQ(pool.cached_bytes(), 0u);
    PooledBuffer c = pool.Acquire(400000);
    EXPECT_NE(c.data(), first);
    PooledBuffer big = pool.Acquire(2 << 20);  // Above the cap: freed on return.
  }
  EXPECT_EQ(pool.cached_bytes(), size_t{1} << 20);
  PooledBuffer moved = pool.Acquire(100);
  PooledBuffer target = std::move(moved);
  EXPECT_TRUE(moved.empty());
  EXPECT_FALSE(target.empty());
}

TEST(WireTest, HalfConversionsAreExactWhereRepresentable) {
  for (int bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = HalfToFloat(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    ASSERT_EQ(FloatToHalf(f), h) << std::hex << bits;  // Every half round-trips.
  }
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // Rounds to infinity.
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // Tie to even.
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -26)), 0x0000);
}

TEST(WireTest, Bf16Conversions) {
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // Tie to even (down).
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // Tie to even (up).
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
}

TEST(WireTest, ConvertBuffers) {
  std::vector<float> values = {0.5f, -1.25f, 3.0f, 1024.0f};
  for (v1::DType dtype : {v1::DTYPE_F16, v1::DTYPE_BF16}) {
    std::vector<char> wire(values.size() * 2);
    ASSERT_OK(ConvertFromF32(dtype, values.data(), 4, wire.data()));
    std::vector<float> back(4);
    ASSERT_OK(ConvertToF32(dtype, wire.data(), 4, back.data()));
    EXPECT_EQ(back, values);
  }
  std::vector<float> copy(4);
  ASSERT_OK(ConvertToF32(v1::DTYPE_F32, values.data(), 4, copy.data()));
  EXPECT_EQ(copy, values);
  EXPECT_EQ(ConvertToF32(v1::DTYPE_I32, values.data(), 4, copy.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ConvertFromF32(v1::DTYPE_F32, values.data(), 4, copy.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// The bulk conversions (vectorised; F16C where the CPU has it) give the bits
// of the scalar functions: every F16 and BF16 pattern back to float, and a
// spread of float patterns (every 4099th, plus the edges) to both, with and
// without saturation. NaN only has to stay NaN.
TEST(WireTest, BulkConversionsMatchTheScalarFunctions) {
  std::vector<uint8_t> all(65536 * 2);
  for (uint32_t h = 0; h < 65536; ++h) {
    all[2 * h] = static_cast<uint8_t>(h & 0xff);
    all[2 * h + 1] = static_cast<uint8_t>(h >> 8);
  }
  std::vector<float> back(65536);
  for (v1::DType dtype : {v1::DTYPE_F16, v1::DTYPE_BF16}) {
    ASSERT_OK(ConvertToF32(dtype, all.data(), 65536, back.data()));
    for (uint32_t h = 0; h < 65536; ++h) {
      const float expected = dtype == v1::DTYPE_F16 ? HalfToFloat(static_cast<uint16_t>(h))
                                                    : Bf16ToFloat(static_cast<uint16_t>(h));
      if (std::isnan(expected)) {
        ASSERT_TRUE(std::isnan(back[h])) << v1::DType_Name(dtype) << " pattern " << h;
        continue;
      }
      uint32_t got_bits, expected_bits;
      std::memcpy(&got_bits, &back[h], 4);
      std::memcpy(&expected_bits, &expected, 4);
      ASSERT_EQ(got_bits, expected_bits) << v1::DType_Name(dtype) << " pattern " << h;
    }
  }

  std::vector<float> floats;
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099) {
    const uint32_t b = static_cast<uint32_t>(bits);
    float f;
    std::memcpy(&f, &b, 4);
    floats.push_back(f);
  }
  for (float f :
       {65504.0f, 65519.99f, 65520.0f, 65536.0f, 6.1e-5f, 5.96e-8f, 2.98e-8f, 0.0f, -0.0f,
        3.38953139e38f, std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
        std::numeric_limits<float>::denorm_min()}) {
    floats.push_back(f);
    floats.push_back(-f);
  }
  std::vector<uint8_t> wire(floats.size() * 2);
  for (v1::DType dtype : {v1::DTYPE_F16, v1::DTYPE_BF16}) {
    for (bool saturate : {false, true}) {
      ASSERT_OK(ConvertFromF32(dtype, floats.data(), static_cast<int64_t>(floats.size()),
                                 wire.data(), saturate));
      const bool half = dtype == v1::DTYPE_F16;
      const float limit = half ? 65504.0f : 3.38953139e38f;
      for (size_t i = 0; i < floats.size(); ++i) {
        const uint16_t got = static_cast<uint16_t>(wire[2 * i] | (wire[2 * i + 1] << 8));
        float v = floats[i];
        if (std::isnan(v)) {
          EXPECT_TRUE(std::isnan(half ? HalfToFloat(got) : Bf16ToFloat(got))) << i;
          continue;
        }
        if (saturate) v = std::clamp(v, -limit, limit);
        const uint16_t expected = half ? FloatToHalf(v) : FloatToBf16(v);
        ASSERT_EQ(got, expected) << v1::DType_Name(dtype) << " saturate " << saturate << " value "
                                 << floats[i];
      }
    }
  }
}

}  // namespace
}  // namespace pstrain
