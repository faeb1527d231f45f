// TensorBoard event files: scalars written in the tfevents format that
// TensorBoard (and tf.summary readers) read, with no TensorFlow dependency.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<TfEventsWriter> writer,
//                            TfEventsWriter::Create("runs/fashion-mnist"));
//   PSTRAIN_RETURN_IF_ERROR(writer->WriteScalars(step, {{"train/loss", 0.41},
//                                                       {"train/accuracy", 0.86}}));
//   PSTRAIN_RETURN_IF_ERROR(writer->Flush());  // After each epoch: visible to TensorBoard.
//
// File format: a sequence of TFRecords, each
//   uint64 length (little endian) | uint32 masked CRC-32C of the length bytes |
//   data (length bytes)           | uint32 masked CRC-32C of the data
// where mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 and CRC-32C is the
// Castagnoli polynomial. Each record's data is a serialized tensorflow.Event;
// the first one carries file_version "brain.Event:2", the others wall_time,
// step and a Summary of simple_value scalars. Only those protobuf fields are
// written, by hand (Event: wall_time=1 double, step=2 int64, file_version=3
// string, summary=5 Summary; Summary: repeated Value value=1; Summary.Value:
// tag=1 string, simple_value=2 float), so that no copy of TensorFlow's protos
// enters the build.
#ifndef PSTRAIN_COMMON_TFEVENTS_H_
#define PSTRAIN_COMMON_TFEVENTS_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace pstrain {

// CRC-32C (Castagnoli, reflected polynomial 0x82f63b78) of `data`.
uint32_t Crc32c(absl::string_view data);
// TFRecord's (and LevelDB's) masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t MaskCrc32c(uint32_t crc);
// One TFRecord: length, masked CRC of the length, data, masked CRC of the data.
std::string FrameTfRecord(absl::string_view data);

// One scalar of a summary. `tag` names the series ("train/loss").
struct TfScalar {
  std::string tag;
  double value = 0;  // Stored as a 32-bit float (Summary.Value.simple_value).
};

// Serialized tensorflow.Event messages (no framing).
std::string EncodeFileVersionEvent(double wall_time_sec);
std::string EncodeScalarsEvent(double wall_time_sec, int64_t step,
                               absl::Span<const TfScalar> scalars);

// Appends scalar events to one new file events.out.tfevents.<unix seconds>.
// <hostname> in a directory. Records are buffered until Flush() (or the
// destructor); a file that already has that name (two writers in the same
// second) gets a ".N" suffix instead of being overwritten.
//
// Threads: not thread-safe; one thread at a time (callers serialize).
class TfEventsWriter {
 public:
  struct Options {
    std::string hostname;                   // "" = gethostname().
    absl::Time now = absl::InfinitePast();  // Names the file; InfinitePast = absl::Now().
  };

  // Creates `dir` (and its parents) and the file with its file_version
  // record. INVALID_ARGUMENT for an empty dir; the error of the file system
  // (e.g. PERMISSION_DENIED, FAILED_PRECONDITION) otherwise.
  static absl::StatusOr<std::unique_ptr<TfEventsWriter>> Create(const std::string& dir,
                                                                Options options);
  static absl::StatusOr<std::unique_ptr<TfEventsWriter>> Create(const std::string& dir) {
    return Create(dir, Options());
  }
  ~TfEventsWriter();  // Flushes and closes; errors then are lost (call Close() to see them).
  TfEventsWriter(const TfEventsWriter&) = delete;
  TfEventsWriter& operator=(const TfEventsWriter&) = delete;

  // One Event with `step` and every scalar of `scalars`, stamped `wall_time`
  // (absl::Now() when InfinitePast). INVALID_ARGUMENT for an empty list or
  // tag; FAILED_PRECONDITION after Close().
  absl::Status WriteScalars(int64_t step, absl::Span<const TfScalar> scalars,
                            absl::Time wall_time = absl::InfinitePast());
  // Pushes buffered records to the file system.
  absl::Status Flush();
  // Flushes and closes the file; later writes fail.
  absl::Status Close();

  const std::string& path() const { return path_; }

 private:
  TfEventsWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  absl::Status Append(absl::string_view event);

  // Constant after construction.
  const std::string path_;
  std::FILE* file_;  // Owned; null after Close().
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_TFEVENTS_H_
