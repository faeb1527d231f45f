// IDX image and label files (Fashion-MNIST's format, raw or gzip: the reader
// inflates a file that starts with the gzip magic). The input is both files:
// its first two bytes say how many of the rest (mod the length) are the
// images file; the labels file is what follows.
#include <cstddef>
#include <cstdint>

#include "common/data/idx_reader.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const size_t rest = size - 2;
  const size_t split = rest == 0 ? 0 : ((size_t{data[0]} << 8) | data[1]) % (rest + 1);
  const uint8_t* images = data + 2;
  const std::string images_path = pstrain::fuzz::WriteScratch("images", images, split);
  const std::string labels_path =
      pstrain::fuzz::WriteScratch("labels", images + split, rest - split);
  (void)pstrain::data::ReadIdxPair(images_path, labels_path);
  return 0;
}
