// Tests for common/tfevents.{h,cc}: CRC-32C against published vectors, the
// TFRecord framing, the hand-written Event bytes (exact bytes, and decoded by
// protobuf's own wire parser), and the writer's files. TensorBoard's own
// reader reads a real worker's files in tests/tools/read_tfevents.py.
#include "common/tfevents.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/base/casts.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain {
namespace {

using ::google::protobuf::UnknownField;
using ::google::protobuf::UnknownFieldSet;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

uint64_t ReadLe(const std::string& bytes, size_t offset, int width) {
  uint64_t v = 0;
  for (int i = width - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[offset + i]);
  return v;
}

// Splits a tfevents file into its records' data, checking both CRCs of each.
std::vector<std::string> ReadRecords(const std::string& bytes) {
  std::vector<std::string> records;
  size_t offset = 0;
  while (offset < bytes.size()) {
    EXPECT_LE(offset + 12, bytes.size()) << "truncated header";
    if (offset + 12 > bytes.size()) break;
    const uint64_t length = ReadLe(bytes, offset, 8);
    EXPECT_EQ(ReadLe(bytes, offset + 8, 4), MaskCrc32c(Crc32c(bytes.substr(offset, 8))));
    EXPECT_LE(offset + 12 + length + 4, bytes.size()) << "truncated record";
    if (offset + 12 + length + 4 > bytes.size()) break;
    std::string data = bytes.substr(offset + 12, length);
    EXPECT_EQ(ReadLe(bytes, offset + 12 + length, 4), MaskCrc32c(Crc32c(data)));
    records.push_back(std::move(data));
    offset += 12 + length + 4;
  }
  return records;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

const UnknownField* Find(const UnknownFieldSet& set, int number) {
  for (int i = 0; i < set.field_count(); ++i) {
    if (set.field(i).number() == number) return &set.field(i);
  }
  return nullptr;
}

TEST(Crc32cTest, PublishedVectors) {
  // The check value of CRC-32C, and the iSCSI vectors of RFC 3720 B.4.
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8a9136aau);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62a8ab43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(Crc32c(ascending), 0x46dd794eu);
  EXPECT_EQ(Crc32c(descending), 0x113fdb5cu);
  EXPECT_EQ(Crc32c(""), 0u);
}

TEST(Crc32cTest, MaskIsTfRecordsRotateAndAdd) {
  EXPECT_EQ(MaskCrc32c(0), 0xa282ead8u);
  const uint32_t crc = 0xe3069283u;
  EXPECT_EQ(MaskCrc32c(crc), ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  EXPECT_NE(MaskCrc32c(crc), crc);
  // Unmasking (LevelDB's Unmask) gives the CRC back.
  const uint32_t rot = MaskCrc32c(crc) - 0xa282ead8u;
  EXPECT_EQ((rot >> 17) | (rot << 15), crc);
}

TEST(TfRecordTest, FramesLengthDataAndBothCrcs) {
  const std::string data = "hello tensorboard";
  const std::string record = FrameTfRecord(data);
  ASSERT_EQ(record.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(ReadLe(record, 0, 8), data.size());
  EXPECT_EQ(ReadLe(record, 8, 4), MaskCrc32c(Crc32c(record.substr(0, 8))));
  EXPECT_EQ(record.substr(12, data.size()), data);
  EXPECT_EQ(ReadLe(record, 12 + data.size(), 4), MaskCrc32c(Crc32c(data)));
}

TEST(TfRecordTest, EmptyRecordIsHeaderAndDataCrcOfNothing) {
  const std::string record = FrameTfRecord("");
  ASSERT_EQ(record.size(), 16u);
  EXPECT_EQ(record.substr(0, 8), std::string(8, '\0'));
  EXPECT_EQ(ReadLe(record, 12, 4), 0xa282ead8u);  // mask(crc32c("")) = mask(0).
}

TEST(EventEncodingTest, FileVersionEventBytes) {
  // wall_time = 1.0 (fixed64 field 1), file_version (field 3).
  const std::string expected =
      std::string("\x09\x00\x00\x00\x00\x00\x00\xf0\x3f", 9) + "\x1a\x0d" + "brain.Event:2";
  EXPECT_EQ(EncodeFileVersionEvent(1.0), expected);
}

TEST(EventEncodingTest, OneScalarEventBytes) {
  const TfScalar scalar{"a", 1.0};
  // Value: tag "a" (field 1), simple_value 1.0f (fixed32 field 2).
  const std::string value = std::string(
      "\x0a\x01"
      "a"
      "\x15\x00\x00\x80\x3f",
      8);
  const std::string summary = std::string("\x0a\x08", 2) + value;
  const std::string expected = std::string("\x09\x00\x00\x00\x00\x00\x00\x00\x40", 9) +  // 2.0
                               std::string("\x10\x05", 2) +                              // step
                               std::string("\x2a\x0a", 2) + summary;
  EXPECT_EQ(EncodeScalarsEvent(2.0, 5, {&scalar, 1}), expected);
}

TEST(EventEncodingTest, ProtobufsWireParserReadsEveryField) {
  const std::vector<TfScalar> scalars = {{"train/loss", 0.4125}, {"train/accuracy", 0.875}};
  const int64_t step = int64_t{1} << 40;
  UnknownFieldSet event;
  ASSERT_TRUE(event.ParseFromString(EncodeScalarsEvent(1700000000.25, step, scalars)));
  const UnknownField* wall_time = Find(event, 1);
  ASSERT_NE(wall_time, nullptr);
  ASSERT_EQ(wall_time->type(), UnknownField::TYPE_FIXED64);
  EXPECT_EQ(absl::bit_cast<double>(wall_time->fixed64()), 1700000000.25);
  const UnknownField* step_field = Find(event, 2);
  ASSERT_NE(step_field, nullptr);
  ASSERT_EQ(step_field->type(), UnknownField::TYPE_VARINT);
  EXPECT_EQ(static_cast<int64_t>(step_field->varint()), step);
  const UnknownField* summary_field = Find(event, 5);
  ASSERT_NE(summary_field, nullptr);
  ASSERT_EQ(summary_field->type(), UnknownField::TYPE_LENGTH_DELIMITED);
  UnknownFieldSet summary;
  ASSERT_TRUE(summary.ParseFromString(summary_field->length_delimited()));
  ASSERT_EQ(summary.field_count(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(summary.field(i).number(), 1);
    UnknownFieldSet value;
    ASSERT_TRUE(value.ParseFromString(summary.field(i).length_delimited()));
    ASSERT_NE(Find(value, 1), nullptr);
    EXPECT_EQ(Find(value, 1)->length_delimited(), scalars[i].tag);
    ASSERT_NE(Find(value, 2), nullptr);
    ASSERT_EQ(Find(value, 2)->type(), UnknownField::TYPE_FIXED32);
    EXPECT_EQ(absl::bit_cast<float>(Find(value, 2)->fixed32()),
              static_cast<float>(scalars[i].value));
  }
}

class TfEventsWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = ::testing::TempDir() + "/pstrain_tfevents_XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

TEST_F(TfEventsWriterTest, WritesVersionThenScalarRecordsAfterFlush) {
  TfEventsWriter::Options options;
  options.hostname = "host-a";
  options.now = absl::FromUnixSeconds(1700000123);
  auto writer = TfEventsWriter::Create(dir_ + "/job-1/worker-0", options);
  ASSERT_OK(writer);
  EXPECT_EQ((*writer)->path(), dir_ + "/job-1/worker-0/events.out.tfevents.1700000123.host-a");
  // The file_version record is on disk before any scalar is written.
  std::vector<std::string> records = ReadRecords(ReadFile((*writer)->path()));
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0], EncodeFileVersionEvent(1700000123.0));

  const absl::Time t1 = absl::FromUnixMillis(1700000124500);
  ASSERT_OK((*writer)->WriteScalars(10, {{"train/loss", 1.5}, {"train/accuracy", 0.5}}, t1));
  ASSERT_OK((*writer)->WriteScalars(20, {{"train/loss", 1.25}}, t1 + absl::Seconds(1)));
  ASSERT_OK((*writer)->Flush());
  records = ReadRecords(ReadFile((*writer)->path()));
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[1],
            EncodeScalarsEvent(1700000124.5, 10, {{"train/loss", 1.5}, {"train/accuracy", 0.5}}));
  EXPECT_EQ(records[2], EncodeScalarsEvent(1700000125.5, 20, {{"train/loss", 1.25}}));
  EXPECT_OK((*writer)->Close());
}

TEST_F(TfEventsWriterTest, SecondWriterInTheSameSecondGetsItsOwnFile) {
  TfEventsWriter::Options options;
  options.hostname = "h";
  options.now = absl::FromUnixSeconds(42);
  auto first = TfEventsWriter::Create(dir_, options);
  auto second = TfEventsWriter::Create(dir_, options);
  ASSERT_OK(first);
  ASSERT_OK(second);
  EXPECT_NE((*first)->path(), (*second)->path());
  EXPECT_THAT((*second)->path(), MatchesRegex(".*/events\\.out\\.tfevents\\.42\\.h\\.1"));
  ASSERT_OK((*first)->WriteScalars(1, {{"x", 1}}));
  ASSERT_OK((*first)->Flush());
  EXPECT_EQ(ReadRecords(ReadFile((*first)->path())).size(), 2u);
  EXPECT_EQ(ReadRecords(ReadFile((*second)->path())).size(), 1u);
}

TEST_F(TfEventsWriterTest, DefaultNameIsNowAndThisHost) {
  auto writer = TfEventsWriter::Create(dir_);
  ASSERT_OK(writer);
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof(host) - 1), 0);
  const std::string name = std::filesystem::path((*writer)->path()).filename().string();
  EXPECT_THAT(name, MatchesRegex("events\\.out\\.tfevents\\.[0-9]+\\..*"));
  EXPECT_EQ(name.substr(name.size() - std::strlen(host)), host);
  const int64_t seconds = std::stoll(name.substr(std::strlen("events.out.tfevents.")));
  EXPECT_NEAR(seconds, absl::ToUnixSeconds(absl::Now()), 60);
}

TEST_F(TfEventsWriterTest, DestructorFlushes) {
  std::string path;
  {
    auto writer = TfEventsWriter::Create(dir_);
    ASSERT_OK(writer);
    path = (*writer)->path();
    ASSERT_OK((*writer)->WriteScalars(3, {{"y", 2}}));
  }
  EXPECT_EQ(ReadRecords(ReadFile(path)).size(), 2u);
}

TEST_F(TfEventsWriterTest, RejectsBadInputAndUseAfterClose) {
  EXPECT_EQ(TfEventsWriter::Create("").status().code(), absl::StatusCode::kInvalidArgument);
  auto writer = TfEventsWriter::Create(dir_);
  ASSERT_OK(writer);
  EXPECT_EQ((*writer)->WriteScalars(1, {}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*writer)->WriteScalars(1, {{"", 1}}).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK((*writer)->Close());
  EXPECT_OK((*writer)->Close());
  EXPECT_EQ((*writer)->WriteScalars(1, {{"x", 1}}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*writer)->Flush().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(TfEventsWriterTest, DirectoryThatIsAFileIsAnError) {
  const std::string file = dir_ + "/plain-file";
  std::ofstream(file) << "x";
  auto writer = TfEventsWriter::Create(file + "/sub");
  ASSERT_FALSE(writer.ok());
  EXPECT_THAT(writer.status().message(), HasSubstr("plain-file"));
}

}  // namespace
}  // namespace pstrain
