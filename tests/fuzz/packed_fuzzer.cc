// Packed dataset shards (`pstrain prepare`, common/data/packed_format.h): a
// header, then fixed-size records with a CRC-32 each. Half the inputs get
// their header and record checksums restamped, so that mutations reach the
// shape, count, shard and label checks behind them.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/data/packed_format.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

void Stamp(std::string& bytes, size_t at, size_t n) {
  const uint32_t crc =
      static_cast<uint32_t>(crc32_z(0L, reinterpret_cast<const Bytef*>(bytes.data() + at), n));
  std::memcpy(bytes.data() + at + n, &crc, sizeof(crc));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  const size_t header = pstrain::data::kPackedHeaderBytes;
  if (size >= header && (data[size - 1] & 1) != 0) {
    uint32_t record = 0;
    std::memcpy(&record, bytes.data() + 28, sizeof(record));
    if (record >= 8) {
      for (size_t at = header; at + record <= size; at += record) Stamp(bytes, at, record - 4);
    }
    Stamp(bytes, 0, 60);
  }
  pstrain::fuzz::WriteScratch(pstrain::data::PackedShardName("train", 0, 1),
                              reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  (void)pstrain::data::LoadPackedSplit(pstrain::fuzz::ScratchDir(), "train");
  return 0;
}
