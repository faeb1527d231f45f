// s3_read_bench: reads objects through pstrain's Storage (the S3 client:
// HEAD, then ranged GETs of 8 MiB, 4 in parallel, held to the ETag) and
// prints one JSON line per repetition: {"bytes": B, "seconds": S}. Driven by
// bench/s3_bench.py, which starts moto and measures boto3's
// download_fileobj of the same objects in the same run.
//
//   s3_read_bench --repeat 5 s3://bench/a s3://bench/b   (AWS_* in the environment)
#include <chrono>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/storage/s3_flags.h"
#include "common/storage/storage.h"

ABSL_FLAG(int, repeat, 5, "Times every object is read");

int main(int argc, char** argv) {
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  absl::StatusOr<pstrain::storage::StorageOptions> options =
      pstrain::storage::StorageOptionsFromFlags(nullptr);
  if (!options.ok()) {
    std::cerr << options.status() << std::endl;
    return 1;
  }
  absl::StatusOr<std::unique_ptr<pstrain::storage::Storage>> store =
      pstrain::storage::OpenStorage(*options);
  if (!store.ok()) {
    std::cerr << store.status() << std::endl;
    return 1;
  }
  for (int r = 0; r < absl::GetFlag(FLAGS_repeat); ++r) {
    int64_t bytes = 0;
    const auto start = std::chrono::steady_clock::now();
    for (size_t i = 1; i < args.size(); ++i) {
      absl::StatusOr<std::string> object = (*store)->Read(args[i]);
      if (!object.ok()) {
        std::cerr << object.status() << std::endl;
        return 1;
      }
      bytes += static_cast<int64_t>(object->size());
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "{\"bytes\": " << bytes << ", \"seconds\": " << seconds << "}" << std::endl;
  }
  return 0;
}
