// bson_bench: reading the Cdiscount BSON layout (common/data/bson_dataset.h)
// against libbson's own bulk reader in the same run.
//
//   build/bin/bson_bench --file=DIR/train.bson [--reps=5] [--decode_records=5000]
//
// Per pass over the file (median of --reps, the two readers alternating):
//   libbson bson_reader_t   bson_reader_read over every document, nothing
//                           else (the reference: reading and framing alone);
//   pstrain index           IndexBsonFile: framing, libbson's parse of each
//                           product, its category and pictures;
// and once, DecodeBsonFile of the first --decode_records products (JPEG
// decode and resize to 1x28x28: the cost a job pays per picture).
// Make a file with tests/tools/make_bson_dump (build/bin/make_bson_dump
// /usr/share/datasets/fashion-mnist DIR --in-order).
#include <bson/bson.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/data/bson_dataset.h"

ABSL_FLAG(std::string, file, "", "A BSON file in the dump's layout");
ABSL_FLAG(int, reps, 5, "Timed passes per reader (median reported)");
ABSL_FLAG(int, decode_records, 5000, "Products decoded once (0: none)");

namespace pstrain {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Documents read by bson_reader_t; -1 on an error.
int64_t ReadAllWithLibbson(const std::string& path) {
  bson_error_t error;
  bson_reader_t* reader = bson_reader_new_from_file(path.c_str(), &error);
  if (reader == nullptr) return -1;
  int64_t documents = 0;
  bool eof = false;
  while (bson_reader_read(reader, &eof) != nullptr) ++documents;
  bson_reader_destroy(reader);
  return eof ? documents : -1;
}

int Main() {
  const std::string path = absl::GetFlag(FLAGS_file);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  absl::StatusOr<data::BsonIndex> index = data::IndexBsonFile(path, {});
  if (!index.ok()) {
    std::fprintf(stderr, "bson_bench: %s\n", std::string(index.status().message()).c_str());
    return 1;
  }
  const double mb = static_cast<double>(index->file_bytes) / 1e6;
  const double records = static_cast<double>(index->records.size());
  std::printf("%s: %.1f MB, %.0f products, %lld pictures\n", path.c_str(), mb, records,
              static_cast<long long>(index->pictures));
  std::vector<double> libbson, ours;
  for (int r = 0; r < reps; ++r) {
    Clock::time_point t = Clock::now();
    const int64_t documents = ReadAllWithLibbson(path);
    libbson.push_back(Seconds(t));
    if (documents != index->records.size()) {
      std::fprintf(stderr, "bson_bench: bson_reader_t read %lld documents\n",
                   static_cast<long long>(documents));
      return 1;
    }
    t = Clock::now();
    if (!data::IndexBsonFile(path, {}).ok()) return 1;
    ours.push_back(Seconds(t));
  }
  const double a = Median(libbson), b = Median(ours);
  std::printf("%-24s %9.3f s %12.0f products/s %8.0f MB/s\n", "libbson bson_reader_t", a,
              records / a, mb / a);
  std::printf("%-24s %9.3f s %12.0f products/s %8.0f MB/s   %.2fx libbson's time\n",
              "pstrain index", b, records / b, mb / b, b / a);
  const int decode = absl::GetFlag(FLAGS_decode_records);
  if (decode > 0) {
    data::BsonIndex part = *index;
    part.records.resize(std::min<size_t>(part.records.size(), static_cast<size_t>(decode)));
    part.pictures = 0;
    for (const data::BsonRecord& rec : part.records) part.pictures += rec.pictures;
    const Clock::time_point t = Clock::now();
    absl::StatusOr<data::ImageDataset> ds = data::DecodeBsonFile(
        path, part, data::CategoryTable::Of(*index), {.channels = 1, .height = 28, .width = 28});
    const double s = Seconds(t);
    if (!ds.ok()) {
      std::fprintf(stderr, "bson_bench: %s\n", std::string(ds.status().message()).c_str());
      return 1;
    }
    std::printf("%-24s %9.3f s %12.0f pictures/s (%zu products, 1 thread)\n", "pstrain decode", s,
                static_cast<double>(ds->size()) / s, part.records.size());
  }
  return 0;
}

}  // namespace
}  // namespace pstrain

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pstrain::Main();
}
