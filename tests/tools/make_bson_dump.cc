// make_bson_dump: writes a BSON file in the Cdiscount product dump's layout
// (docs/DATA.md) from an IDX dataset's real images (Fashion-MNIST), for the
// BSON accuracy test and the reader's benchmarks. Nothing is downloaded.
//
//   make_bson_dump IDX_DIR OUT_DIR [MAX_IMAGES] [--in-order] [--repeat K]
//
// OUT_DIR gets train.bson and test.bson (JPEG quality 90, 1 to 4 pictures a
// product, ten-digit category ids). Without --in-order the products are
// shuffled and the classes skewed (tests/testing/bson_dump.h); with it every
// image is kept in source order. --repeat K writes train.bson's products K
// times over (a multi-GB file for the streaming benchmark; the test file
// once).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>

#include "common/data/idx_reader.h"
#include "tests/testing/bson_dump.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: make_bson_dump IDX_DIR OUT_DIR [MAX_IMAGES] [--in-order] [--repeat K]\n";
    return 2;
  }
  bool in_order = false;
  int64_t max_images = int64_t{1} << 40;
  int repeat = 1;
  for (int i = 3; i < argc; ++i) {
    if (std::strcmp(argv[i], "--in-order") == 0) {
      in_order = true;
    } else if (std::strcmp(argv[i], "--repeat") == 0 && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else {
      max_images = std::atoll(argv[i]);
    }
  }
  absl::StatusOr<pstrain::data::DatasetSplits> source = pstrain::data::LoadIdxDataset(argv[1]);
  if (!source.ok()) {
    std::cerr << "make_bson_dump: " << source.status().message() << "\n";
    return 1;
  }
  for (const auto& [name, split, seed] :
       {std::tuple{"train.bson", &source->train, 1}, std::tuple{"test.bson", &source->test, 2}}) {
    const pstrain::testing::BsonDump dump =
        pstrain::testing::MakeBsonDump(*split, max_images, seed, in_order);
    const std::string path = std::string(argv[2]) + "/" + name;
    std::ofstream out(path, std::ios::binary);
    const int copies = std::string(name) == "train.bson" ? repeat : 1;
    for (int r = 0; r < copies; ++r) out << dump.bytes;
    if (!out.flush()) {
      std::cerr << "make_bson_dump: cannot write " << path << "\n";
      return 1;
    }
    std::cout << path << ": " << dump.products * copies << " products, "
              << dump.labels.size() * copies << " pictures, " << dump.bytes.size() * copies
              << " bytes\n";
  }
  return 0;
}
