// Tests for common/checkpoint.{h,cc}: bit-exact round trips, the parts
// format (tensors split over parts, format-1 files still read), every kind
// of damage a file can suffer (flipped bytes, truncation, malformed parts,
// foreign versions, bad tensors), atomic replacement under injected write
// failures and under a kill -9 between parts, and a checkpoint larger than
// protobuf's historical 64 MiB parse limit.
#include "common/checkpoint.h"

#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::testing::HasSubstr;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "/pstrain_ckpt_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    chmod(dir_.c_str(), 0700);
    std::string command = "rm -rf '" + dir_ + "'";
    ASSERT_EQ(std::system(command.c_str()), 0);
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Names in the test directory (to find left-over temporary files).
  std::vector<std::string> ListDir() const {
    std::vector<std::string> names;
    DIR* d = opendir(dir_.c_str());
    if (d == nullptr) return names;
    while (dirent* e = readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(name);
    }
    closedir(d);
    std::sort(names.begin(), names.end());
    return names;
  }

  static std::string ReadBytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  static void WriteBytes(const std::string& path, const std::string& bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  std::string dir_;
};

float FromBits(uint32_t bits) { return std::bit_cast<float>(bits); }

// Floats that a careless round trip would change: NaNs with payloads (quiet
// and signalling, both signs), -0.0, denormals, infinities, extremes.
std::vector<float> TrickyFloats(size_t random_count, uint32_t seed) {
  std::vector<float> values = {FromBits(0x7fc12345u),
                               FromBits(0xffc00001u),
                               FromBits(0x7f800001u),  // NaN payloads.
                               FromBits(0xff812345u),
                               -0.0f,
                               0.0f,
                               FromBits(0x00000001u),  // Denormals...
                               FromBits(0x807fffffu),
                               INFINITY,
                               -INFINITY,
                               3.4028235e38f,
                               -1.1754944e-38f};
  std::mt19937 rng(seed);
  for (size_t i = 0; i < random_count; ++i) values.push_back(FromBits(rng()));  // Any pattern.
  return values;
}

std::vector<uint32_t> Bits(const std::string& data) {
  std::vector<uint32_t> bits(data.size() / 4);
  std::memcpy(bits.data(), data.data(), bits.size() * 4);
  return bits;
}

v1::Checkpoint SampleCheckpoint() {
  v1::Checkpoint ckpt;
  ckpt.mutable_job()->set_name("fmnist");
  ckpt.mutable_job()->set_epochs(3);
  ckpt.mutable_job()->mutable_model()->set_name("fmnist-cnn");
  ckpt.mutable_job()->mutable_optimizer()->set_learning_rate(0.01f);
  std::vector<float> w = TrickyFloats(500, 1);
  *ckpt.add_parameters() = MakeTensorProto("fc1/weight", {2, 256}, w.data());
  std::vector<float> b = TrickyFloats(0, 2);
  *ckpt.add_parameters() = MakeTensorProto("fc1/bias", {12}, b.data());
  *ckpt.add_parameters() = MakeTensorProto("empty", {0, 5}, nullptr);
  float scalar = -0.0f;
  *ckpt.add_parameters() = MakeTensorProto("scalar", {}, &scalar);
  std::vector<float> m = TrickyFloats(500, 3);
  *ckpt.add_optimizer_state() = MakeTensorProto("fc1/weight/momentum", {512}, m.data());
  ckpt.set_step(123456789012LL);
  ckpt.set_epoch(2);
  ckpt.set_created_unix_ms(1700000000123LL);
  return ckpt;
}

// ---------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------

TEST_F(CheckpointTest, RoundTripIsBitExact) {
  v1::Checkpoint ckpt = SampleCheckpoint();
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), ckpt));
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  ASSERT_OK(loaded);
  EXPECT_EQ(loaded->SerializeAsString(), ckpt.SerializeAsString());
  ASSERT_EQ(loaded->parameters_size(), 4);
  EXPECT_EQ(Bits(loaded->parameters(0).data()), Bits(ckpt.parameters(0).data()));
  EXPECT_EQ(loaded->step(), 123456789012LL);
  EXPECT_EQ(loaded->job().model().name(), "fmnist-cnn");

  // Through the float helpers too, comparing bit patterns (NaN != NaN).
  absl::StatusOr<std::vector<float>> w = TensorProtoToFloats(loaded->parameters(0));
  ASSERT_OK(w);
  std::vector<float> expected = TrickyFloats(500, 1);
  ASSERT_EQ(w->size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>((*w)[i]), std::bit_cast<uint32_t>(expected[i])) << i;
  }
  EXPECT_THAT(ListDir(), ::testing::ElementsAre("a.ckpt"));  // No temporary left.
}

// One part of a format-2 file, as checkpoint.proto documents it.
struct Part {
  uint32_t kind;
  std::string payload;
  bool crc_ok;
};
uint64_t Le(const std::string& bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<unsigned char>(bytes[at + i])} << (8 * i);
  return v;
}
std::vector<Part> SplitParts(const std::string& file) {
  std::vector<Part> parts;
  size_t at = 8;
  while (at + 12 <= file.size()) {
    const uint64_t length = Le(file, at + 4, 8);
    if (at + 12 + length + 4 > file.size()) break;
    const uint32_t crc = static_cast<uint32_t>(
        crc32(0L, reinterpret_cast<const Bytef*>(file.data() + at), 12 + length));
    parts.push_back({static_cast<uint32_t>(Le(file, at, 4)), file.substr(at + 12, length),
                     crc == Le(file, at + 12 + length, 4)});
    at += 12 + length + 4;
  }
  return parts;
}

TEST_F(CheckpointTest, FileIsTheDocumentedParts) {
  v1::Checkpoint ckpt = SampleCheckpoint();
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), ckpt));
  const std::string file = ReadBytes(Path("a.ckpt"));
  ASSERT_EQ(file.substr(0, 8), "PSTCKPT2");
  const std::vector<Part> parts = SplitParts(file);
  ASSERT_EQ(parts.size(), 7u);  // Manifest, 5 tensors, end.
  for (const Part& p : parts) EXPECT_TRUE(p.crc_ok);
  v1::CheckpointManifest manifest;
  ASSERT_EQ(parts[0].kind, 1u);
  ASSERT_TRUE(manifest.ParseFromString(parts[0].payload));
  EXPECT_EQ(manifest.parameters(), 4);
  EXPECT_EQ(manifest.optimizer_state(), 1);
  EXPECT_EQ(manifest.meta().step(), ckpt.step());
  EXPECT_EQ(manifest.meta().parameters_size(), 0);
  v1::TensorPart tensor;
  ASSERT_EQ(parts[1].kind, 2u);
  ASSERT_TRUE(tensor.ParseFromString(parts[1].payload));
  EXPECT_EQ(tensor.tensor().SerializeAsString(), ckpt.parameters(0).SerializeAsString());
  EXPECT_EQ(tensor.offset(), 0);
  ASSERT_EQ(parts[6].kind, 3u);
  EXPECT_EQ(Le(parts[6].payload, 0, 8), 6u);
  size_t total = 8;
  for (const Part& p : parts) total += 16 + p.payload.size();
  EXPECT_EQ(total, file.size());
}

// Issue 9: no size limit. A tensor larger than one part is split over
// consecutive parts (64 MiB each; 100 bytes here) and read back whole.
TEST_F(CheckpointTest, TensorsSplitOverManyPartsRoundTripBitExact) {
  v1::Checkpoint ckpt = SampleCheckpoint();
  CheckpointWriteOptions options;
  options.max_part_bytes = 100;
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), ckpt, options));
  // fc1/weight: 2048 bytes in 21 parts; fc1/bias 48 in 1; empty 1; scalar 1;
  // momentum 2048 in 21; plus manifest and end.
  EXPECT_EQ(SplitParts(ReadBytes(Path("a.ckpt"))).size(), 2u + 21 + 1 + 1 + 1 + 21);
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  ASSERT_OK(loaded);
  EXPECT_EQ(loaded->SerializeAsString(), ckpt.SerializeAsString());
}

// Format 1 (one envelope), written by earlier builds, still reads.
TEST_F(CheckpointTest, FormatOneEnvelopesStillRead) {
  const v1::Checkpoint ckpt = SampleCheckpoint();
  v1::CheckpointFile envelope;
  envelope.set_format_version(1);
  const std::string payload = ckpt.SerializeAsString();
  envelope.set_crc32(static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(payload.data()),
                                                 static_cast<uInt>(payload.size()))));
  envelope.set_checkpoint(payload);
  WriteBytes(Path("old.ckpt"), envelope.SerializeAsString());
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("old.ckpt"));
  ASSERT_OK(loaded);
  EXPECT_EQ(loaded->SerializeAsString(), payload);
}

// Issue 9: kill -9 during a checkpoint write, between two parts. A child
// process writes a newer checkpoint over the path and is killed after its
// third part; the older checkpoint still loads (every part's CRC good) and
// only the killed writer's temporary file is left.
TEST_F(CheckpointTest, AKillBetweenPartsLeavesThePreviousCheckpointLoadable) {
  v1::Checkpoint old_ckpt = SampleCheckpoint();
  old_ckpt.set_step(1);
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), old_ckpt));
  v1::Checkpoint new_ckpt = SampleCheckpoint();
  new_ckpt.set_step(2);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    CheckpointWriteOptions options;
    options.max_part_bytes = 256;
    options.after_part = [](int part) {
      if (part == 2) raise(SIGKILL);
    };
    (void)WriteCheckpointFile(Path("a.ckpt"), new_ckpt, options);
    _exit(0);  // Not reached.
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  ASSERT_OK(loaded);
  EXPECT_EQ(loaded->step(), 1);
  EXPECT_EQ(loaded->SerializeAsString(), old_ckpt.SerializeAsString());
  const std::vector<std::string> names = ListDir();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0], "a.ckpt");
  EXPECT_THAT(names[1], HasSubstr("a.ckpt.tmp."));
  // The debris holds the three parts written and is no checkpoint.
  const std::string debris = ReadBytes(Path(names[1]));
  EXPECT_EQ(SplitParts(debris).size(), 3u);
  absl::StatusOr<v1::Checkpoint> half = ReadCheckpointFile(Path(names[1]));
  EXPECT_EQ(half.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(half.status().message(), HasSubstr("incomplete"));
}

// Hostile or damaged parts: a huge claimed length, a tensor part that does
// not continue the one before, more tensors than the manifest, data beyond
// the shape, bytes after the end. Each is DATA_LOSS and nothing is
// allocated for a claimed length.
TEST_F(CheckpointTest, MalformedPartsAreDataLoss) {
  auto frame = [](uint32_t kind, const std::string& payload) {
    std::string header(12, '\0');
    for (int i = 0; i < 4; ++i) header[i] = static_cast<char>((kind >> (8 * i)) & 0xff);
    for (int i = 0; i < 8; ++i) {
      header[4 + i] = static_cast<char>((uint64_t{payload.size()} >> (8 * i)) & 0xff);
    }
    std::string out = header + payload;
    const uint32_t crc = static_cast<uint32_t>(
        crc32(0L, reinterpret_cast<const Bytef*>(out.data()), static_cast<uInt>(out.size())));
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
    return out;
  };
  auto end = [&](uint64_t parts) {
    std::string p(8, '\0');
    for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((parts >> (8 * i)) & 0xff);
    return frame(3, p);
  };
  v1::CheckpointManifest manifest;
  manifest.mutable_meta()->set_step(5);
  manifest.set_parameters(1);
  float w[4] = {1, 2, 3, 4};
  auto tensor_part = [&](const std::string& name, int64_t offset, size_t from, size_t n) {
    v1::TensorPart part;
    *part.mutable_tensor() = MakeTensorProto(name, {4}, w);
    part.mutable_tensor()->set_data(reinterpret_cast<const char*>(w) + from, n);
    part.set_offset(offset);
    return frame(2, part.SerializeAsString());
  };
  const std::string head = std::string("PSTCKPT2") + frame(1, manifest.SerializeAsString());
  const std::string good = head + tensor_part("w", 0, 0, 8) + tensor_part("w", 8, 8, 8) + end(3);
  WriteBytes(Path("a.ckpt"), good);
  ASSERT_OK(ReadCheckpointFile(Path("a.ckpt")));

  std::string huge = head;
  huge += std::string("\x02\0\0\0", 4) + std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8);
  const struct {
    std::string label, bytes, message;
  } cases[] = {
      {"huge length", huge, "claims"},
      {"gap", head + tensor_part("w", 0, 0, 8) + tensor_part("w", 12, 12, 4) + end(3),
       "does not continue"},
      {"other tensor", head + tensor_part("w", 0, 0, 8) + tensor_part("v", 8, 8, 8) + end(3),
       "does not continue"},
      {"incomplete", head + tensor_part("w", 0, 0, 8) + end(2), "incomplete"},
      {"too much data", head + tensor_part("w", 0, 0, 16) + tensor_part("w", 16, 0, 8) + end(3),
       "more data than its shape"},
      {"extra tensor", head + tensor_part("w", 0, 0, 16) + tensor_part("x", 0, 0, 16) + end(3),
       "more tensors"},
      {"wrong end count", head + tensor_part("w", 0, 0, 16) + end(7), "malformed end"},
      {"trailing bytes", head + tensor_part("w", 0, 0, 16) + end(2) + "x", "after the end"},
      {"no manifest", std::string("PSTCKPT2") + tensor_part("w", 0, 0, 16) + end(1), "manifest"},
  };
  for (const auto& c : cases) {
    WriteBytes(Path("a.ckpt"), c.bytes);
    absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << c.label;
    EXPECT_THAT(loaded.status().message(), HasSubstr(c.message)) << c.label;
  }
}

TEST_F(CheckpointTest, OverwritesAnExistingCheckpoint) {
  v1::Checkpoint first = SampleCheckpoint();
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), first));
  v1::Checkpoint second = SampleCheckpoint();
  second.set_step(7);
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), second));
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  ASSERT_OK(loaded);
  EXPECT_EQ(loaded->step(), 7);
  EXPECT_THAT(ListDir(), ::testing::ElementsAre("a.ckpt"));
}

TEST_F(CheckpointTest, LargerThanProtobufDefaultLimitRoundTrips) {
  // 72 MiB of weights: beyond the 64 MiB that older protobuf parsers accept
  // by default.
  const size_t count = 18u << 20;
  std::vector<float> w(count);
  std::mt19937 rng(7);
  for (float& x : w) x = FromBits(rng());
  v1::Checkpoint ckpt;
  *ckpt.add_parameters() = MakeTensorProto("big/weight", {static_cast<int64_t>(count)}, w.data());
  ASSERT_OK(WriteCheckpointFile(Path("big.ckpt"), ckpt));
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("big.ckpt"));
  ASSERT_OK(loaded);
  ASSERT_EQ(loaded->parameters_size(), 1);
  EXPECT_TRUE(loaded->parameters(0).data() == ckpt.parameters(0).data());
}

TEST_F(CheckpointTest, ConcurrentWritersOfOnePathLeaveOneWholeCheckpoint) {
  auto writer = [&](int64_t step) {
    for (int i = 0; i < 20; ++i) {
      v1::Checkpoint ckpt = SampleCheckpoint();
      ckpt.set_step(step);
      EXPECT_OK(WriteCheckpointFile(Path("a.ckpt"), ckpt));
    }
  };
  std::thread a(writer, 1), b(writer, 2);
  a.join();
  b.join();
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  ASSERT_OK(loaded);
  EXPECT_TRUE(loaded->step() == 1 || loaded->step() == 2);
  EXPECT_THAT(ListDir(), ::testing::ElementsAre("a.ckpt"));
}

// ---------------------------------------------------------------------------
// Damaged files
// ---------------------------------------------------------------------------

TEST_F(CheckpointTest, MissingFileIsNotFound) {
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("nope.ckpt"));
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(loaded.status().message(), HasSubstr(Path("nope.ckpt")));
}

TEST_F(CheckpointTest, CorruptedDataByteIsAChecksumError) {
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), SampleCheckpoint()));
  std::string bytes = ReadBytes(Path("a.ckpt"));
  bytes[bytes.size() / 2] ^= 0x10;  // Inside fc1/weight's data.
  WriteBytes(Path("a.ckpt"), bytes);
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(loaded.status().message(), HasSubstr("checksum mismatch: file is corrupt"));
  EXPECT_THAT(loaded.status().message(), HasSubstr(Path("a.ckpt")));
}

TEST_F(CheckpointTest, EverySingleBitFlipIsDetected) {
  v1::Checkpoint ckpt;
  float values[3] = {1.f, -0.f, FromBits(0x7fc00abc)};
  *ckpt.add_parameters() = MakeTensorProto("w", {3}, values);
  ckpt.set_step(42);
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), ckpt));
  const std::string original = ReadBytes(Path("a.ckpt"));
  for (size_t i = 0; i < original.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bytes = original;
      bytes[i] = static_cast<char>(bytes[i] ^ (1 << bit));
      WriteBytes(Path("a.ckpt"), bytes);
      EXPECT_FALSE(ReadCheckpointFile(Path("a.ckpt")).ok()) << "byte " << i << " bit " << bit;
    }
  }
}

TEST_F(CheckpointTest, TruncatedFileIsRejected) {
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), SampleCheckpoint()));
  const std::string original = ReadBytes(Path("a.ckpt"));
  for (size_t length : {size_t{0}, size_t{1}, size_t{2}, size_t{10}, original.size() / 2,
                        original.size() - 6, original.size() - 1}) {
    WriteBytes(Path("a.ckpt"), original.substr(0, length));
    absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << "length " << length;
  }
}

TEST_F(CheckpointTest, GarbageIsRejected) {
  WriteBytes(Path("a.ckpt"), "this is not a checkpoint at all\n");
  EXPECT_EQ(ReadCheckpointFile(Path("a.ckpt")).status().code(), absl::StatusCode::kDataLoss);
}

// Writes an envelope with a correct CRC around `ckpt` (bypassing the
// writer's own validation).
void WriteEnvelope(const std::string& path, const v1::Checkpoint& ckpt, uint32_t version) {
  v1::CheckpointFile envelope;
  envelope.set_format_version(version);
  std::string payload = ckpt.SerializeAsString();
  envelope.set_crc32(static_cast<uint32_t>(crc32(0L, reinterpret_cast<const Bytef*>(payload.data()),
                                                 static_cast<uInt>(payload.size()))));
  envelope.set_checkpoint(payload);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << envelope.SerializeAsString();
}

TEST_F(CheckpointTest, UnknownFormatVersionIsRejected) {
  WriteEnvelope(Path("a.ckpt"), SampleCheckpoint(), 2);
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(loaded.status().message(), HasSubstr("format_version 2"));
  WriteEnvelope(Path("a.ckpt"), SampleCheckpoint(), 1);  // Control: version 1 reads.
  EXPECT_OK(ReadCheckpointFile(Path("a.ckpt")));
}

TEST_F(CheckpointTest, UnparsablePayloadWithValidChecksumIsRejected) {
  v1::CheckpointFile envelope;
  envelope.set_format_version(1);
  const std::string payload = "\xff\xff\xff";  // Not a Checkpoint.
  envelope.set_crc32(static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(payload.data()), payload.size())));
  envelope.set_checkpoint(payload);
  WriteBytes(Path("a.ckpt"), envelope.SerializeAsString());
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(loaded.status().message(), HasSubstr("payload"));
}

TEST_F(CheckpointTest, BadTensorsInAFileAreRejected) {
  struct Case {
    std::string label;
    v1::TensorProto tensor;
    std::string message;
  };
  float values[6] = {1, 2, 3, 4, 5, 6};
  std::vector<Case> cases;
  {
    v1::TensorProto t = MakeTensorProto("short", {2, 3}, values);
    t.mutable_data()->pop_back();
    cases.push_back({"one byte short", t, "data has 23 bytes"});
  }
  {
    v1::TensorProto t = MakeTensorProto("long", {2, 3}, values);
    t.mutable_data()->append(4, '\0');
    cases.push_back({"one float too many", t, "data has 28 bytes"});
  }
  {
    v1::TensorProto t = MakeTensorProto("negative", {2, 3}, values);
    t.set_shape(0, -2);
    t.set_shape(1, -3);
    cases.push_back({"negative dims", t, "negative dimension"});
  }
  {
    v1::TensorProto t = MakeTensorProto("f16", {2, 3}, values);
    t.set_dtype(v1::DTYPE_F16);  // 6 x 2 bytes expected, 24 present.
    cases.push_back({"dtype width", t, "data has 24 bytes"});
  }
  {
    v1::TensorProto t = MakeTensorProto("nodtype", {2, 3}, values);
    t.set_dtype(v1::DTYPE_UNSPECIFIED);
    cases.push_back({"unspecified dtype", t, "unknown dtype"});
  }
  {
    v1::TensorProto t = MakeTensorProto("huge", {int64_t{1} << 40, int64_t{1} << 40}, nullptr);
    cases.push_back({"overflowing shape", t, "overflows"});
  }
  for (const Case& c : cases) {
    v1::Checkpoint ckpt;
    *ckpt.add_optimizer_state() = c.tensor;
    WriteEnvelope(Path("bad.ckpt"), ckpt, 1);
    absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("bad.ckpt"));
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss) << c.label;
    EXPECT_THAT(loaded.status().message(), HasSubstr(c.message)) << c.label;
    EXPECT_THAT(loaded.status().message(), HasSubstr(c.tensor.name())) << c.label;

    // The writer refuses the same tensor and writes nothing.
    absl::Status written = WriteCheckpointFile(Path("refused.ckpt"), ckpt);
    EXPECT_EQ(written.code(), absl::StatusCode::kInvalidArgument) << c.label;
    EXPECT_THAT(written.message(), HasSubstr(c.message)) << c.label;
  }
  EXPECT_THAT(ListDir(), ::testing::ElementsAre("bad.ckpt"));
}

// Regression: a file cut right after its format_version used to read back as
// an empty, valid checkpoint (the CRC-32 of nothing is 0, proto3's default).
TEST_F(CheckpointTest, EmptyCheckpointIsRefusedAndEmptyPayloadRejected) {
  absl::Status status = WriteCheckpointFile(Path("a.ckpt"), v1::Checkpoint());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("empty"));
  EXPECT_TRUE(ListDir().empty());
  WriteEnvelope(Path("a.ckpt"), v1::Checkpoint(), 1);
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(loaded.status().message(), HasSubstr("no checkpoint payload"));
}

TEST_F(CheckpointTest, DuplicateTensorNamesAreRejected) {
  v1::Checkpoint ckpt;
  float x = 1;
  *ckpt.add_parameters() = MakeTensorProto("w", {1}, &x);
  *ckpt.add_optimizer_state() = MakeTensorProto("w", {1}, &x);
  EXPECT_EQ(WriteCheckpointFile(Path("a.ckpt"), ckpt).code(), absl::StatusCode::kInvalidArgument);
  WriteEnvelope(Path("a.ckpt"), ckpt, 1);
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(loaded.status().message(), HasSubstr("duplicate tensor name 'w'"));
}

// ---------------------------------------------------------------------------
// Atomicity under failure
// ---------------------------------------------------------------------------

// Limits the size of files this process may write (RLIMIT_FSIZE), so that a
// write fails part-way with EFBIG, as on a full disk. Works as root too.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &saved_);
    old_handler_ = signal(SIGXFSZ, SIG_IGN);
    rlimit limit = saved_;
    limit.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &limit);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &saved_);
    signal(SIGXFSZ, old_handler_);
  }

 private:
  rlimit saved_;
  sighandler_t old_handler_;
};

TEST_F(CheckpointTest, FailedWriteLeavesTheOldCheckpointIntact) {
  v1::Checkpoint old_ckpt = SampleCheckpoint();
  old_ckpt.set_step(1);
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), old_ckpt));
  const std::string old_bytes = ReadBytes(Path("a.ckpt"));

  std::vector<float> w(1 << 20, 0.5f);  // 4 MiB, well over the limit below.
  v1::Checkpoint new_ckpt;
  *new_ckpt.add_parameters() = MakeTensorProto("w", {1 << 20}, w.data());
  absl::Status status;
  {
    FileSizeLimit limit(old_bytes.size() + 4096);
    status = WriteCheckpointFile(Path("a.ckpt"), new_ckpt);
  }
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr(Path("a.ckpt")));
  EXPECT_EQ(ReadBytes(Path("a.ckpt")), old_bytes);
  absl::StatusOr<v1::Checkpoint> loaded = ReadCheckpointFile(Path("a.ckpt"));
  ASSERT_OK(loaded);
  EXPECT_EQ(loaded->step(), 1);
  EXPECT_THAT(ListDir(), ::testing::ElementsAre("a.ckpt"));  // Temporary removed.
}

TEST_F(CheckpointTest, UnwritableDirectoryLeavesTheOldCheckpointIntact) {
  if (geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  ASSERT_OK(WriteCheckpointFile(Path("a.ckpt"), SampleCheckpoint()));
  const std::string old_bytes = ReadBytes(Path("a.ckpt"));
  ASSERT_EQ(chmod(dir_.c_str(), 0500), 0);
  v1::Checkpoint next = SampleCheckpoint();
  next.set_step(99);
  absl::Status status = WriteCheckpointFile(Path("a.ckpt"), next);
  chmod(dir_.c_str(), 0700);
  EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(status.message(), HasSubstr(Path("a.ckpt")));
  EXPECT_EQ(ReadBytes(Path("a.ckpt")), old_bytes);
}

TEST_F(CheckpointTest, FailedRenameRemovesTheTemporary) {
  // The target is a non-empty directory: the temporary is written, the
  // rename fails, and the temporary must not be left behind.
  ASSERT_EQ(mkdir(Path("a.ckpt").c_str(), 0700), 0);
  WriteBytes(Path("a.ckpt") + "/keep", "x");
  absl::Status status = WriteCheckpointFile(Path("a.ckpt"), SampleCheckpoint());
  EXPECT_FALSE(status.ok());
  EXPECT_THAT(status.message(), HasSubstr(Path("a.ckpt")));
  EXPECT_THAT(ListDir(), ::testing::ElementsAre("a.ckpt"));
}

TEST_F(CheckpointTest, MissingDirectoryIsNotFound) {
  absl::Status status = WriteCheckpointFile(Path("no/such/dir/a.ckpt"), SampleCheckpoint());
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(Path("no/such/dir/a.ckpt")));
}

// ---------------------------------------------------------------------------
// Tensor helpers
// ---------------------------------------------------------------------------

TEST(TensorProtoTest, MakeTensorProtoStoresLittleEndianF32) {
  float values[2] = {1.0f, -2.5f};
  v1::TensorProto t = MakeTensorProto("x", {1, 2}, values);
  EXPECT_EQ(t.name(), "x");
  EXPECT_EQ(t.dtype(), v1::DTYPE_F32);
  EXPECT_THAT(t.shape(), ::testing::ElementsAre(1, 2));
  // 1.0f = 0x3f800000, -2.5f = 0xc0200000, least significant byte first.
  EXPECT_EQ(t.data(), std::string("\x00\x00\x80\x3f\x00\x00\x20\xc0", 8));
  EXPECT_OK(ValidateTensorProto(t));
}

TEST(TensorProtoTest, ScalarsAndEmptyTensors) {
  float one = 1;
  v1::TensorProto scalar = MakeTensorProto("s", {}, &one);
  EXPECT_EQ(scalar.data().size(), 4u);
  EXPECT_OK(ValidateTensorProto(scalar));
  v1::TensorProto empty = MakeTensorProto("e", {3, 0}, nullptr);
  EXPECT_TRUE(empty.data().empty());
  EXPECT_OK(ValidateTensorProto(empty));
  absl::StatusOr<std::vector<float>> floats = TensorProtoToFloats(empty);
  ASSERT_OK(floats);
  EXPECT_TRUE(floats->empty());
}

TEST(TensorProtoTest, DTypeWidths) {
  EXPECT_EQ(DTypeWidth(v1::DTYPE_F32), 4);
  EXPECT_EQ(DTypeWidth(v1::DTYPE_I32), 4);
  EXPECT_EQ(DTypeWidth(v1::DTYPE_F16), 2);
  EXPECT_EQ(DTypeWidth(v1::DTYPE_BF16), 2);
  EXPECT_EQ(DTypeWidth(v1::DTYPE_U8), 1);
  EXPECT_EQ(DTypeWidth(v1::DTYPE_UNSPECIFIED), 0);
  EXPECT_EQ(DTypeWidth(static_cast<v1::DType>(99)), 0);
}

TEST(TensorProtoTest, ValidatesOtherDtypesBySize) {
  v1::TensorProto t;
  t.set_name("labels");
  t.set_dtype(v1::DTYPE_U8);
  t.add_shape(5);
  t.set_data("abcde");
  EXPECT_OK(ValidateTensorProto(t));
  t.set_data("abcd");
  EXPECT_EQ(ValidateTensorProto(t).code(), absl::StatusCode::kInvalidArgument);
}

TEST(TensorProtoTest, ToFloatsRejectsOtherDtypesAndBadSizes) {
  v1::TensorProto t;
  t.set_name("half");
  t.set_dtype(v1::DTYPE_F16);
  t.add_shape(2);
  t.set_data(std::string(4, '\0'));
  EXPECT_EQ(TensorProtoToFloats(t).status().code(), absl::StatusCode::kUnimplemented);
  float x[2] = {1, 2};
  v1::TensorProto f = MakeTensorProto("f", {2}, x);
  f.mutable_data()->pop_back();
  EXPECT_EQ(TensorProtoToFloats(f).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain
