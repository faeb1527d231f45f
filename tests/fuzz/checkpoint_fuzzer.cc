// Checkpoint files (common/checkpoint): what `pstrain-worker --evaluate`,
// the coordinator's resume and `pstrain download` users read back. Reads the
// file, then every tensor as floats. The first byte picks how the rest is
// taken: as a whole file; as the inner Checkpoint of a valid format-1
// envelope (right CRC-32); or as the parts of a format-2 file, each
// [fixed32 kind][fixed64 length][payload] as in the input (lengths cut to
// what is left), framed with correct CRC-32s, so that mutations reach past
// the checksums of both formats.
#include <zlib.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/checkpoint.h"
#include "pstrain/v1/checkpoint.pb.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int how = data[0] % 3;
  ++data;
  --size;
  std::string path;
  if (how == 2) {
    // Format 2: re-frame the input's parts with correct CRCs.
    std::string bytes = pstrain::kCheckpointPartsMagic;
    size_t at = 0;
    while (at + 12 <= size) {
      uint64_t length = 0;
      for (int i = 0; i < 8; ++i) length |= uint64_t{data[at + 4 + i]} << (8 * i);
      length = std::min<uint64_t>(length, size - at - 12);
      const size_t start = bytes.size();
      bytes.append(reinterpret_cast<const char*>(data + at), 4);
      for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
      bytes.append(reinterpret_cast<const char*>(data + at + 12), length);
      const uint32_t crc = static_cast<uint32_t>(
          crc32(0L, reinterpret_cast<const Bytef*>(bytes.data() + start), 12 + length));
      for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
      at += 12 + length;
    }
    path = pstrain::fuzz::WriteScratch("model.ckpt", reinterpret_cast<const uint8_t*>(bytes.data()),
                                       bytes.size());
  } else if (how == 1) {
    pstrain::v1::CheckpointFile file;
    file.set_format_version(1);
    file.set_checkpoint(reinterpret_cast<const char*>(data), size);
    file.set_crc32(static_cast<uint32_t>(crc32(0L, data, static_cast<uInt>(size))));
    const std::string bytes = file.SerializeAsString();
    path = pstrain::fuzz::WriteScratch("model.ckpt", reinterpret_cast<const uint8_t*>(bytes.data()),
                                       bytes.size());
  } else {
    path = pstrain::fuzz::WriteScratch("model.ckpt", data, size);
  }
  auto ckpt = pstrain::ReadCheckpointFile(path);
  if (!ckpt.ok()) return 0;
  for (const auto* tensors : {&ckpt->parameters(), &ckpt->optimizer_state()}) {
    for (const pstrain::v1::TensorProto& t : *tensors) {
      if (pstrain::ValidateTensorProto(t).ok()) (void)pstrain::TensorProtoToFloats(t);
    }
  }
  return 0;
}
