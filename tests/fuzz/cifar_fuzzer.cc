// CIFAR-10 binary batch files: records of a label and 3x32x32 bytes.
#include <cstddef>
#include <cstdint>

#include "common/data/cifar_reader.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = pstrain::fuzz::WriteScratch("data_batch.bin", data, size);
  (void)pstrain::data::ReadCifar10Files({path});
  return 0;
}
