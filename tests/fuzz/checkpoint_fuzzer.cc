// Checkpoint files (common/checkpoint): what `pstrain-worker --evaluate`,
// the coordinator's resume and `pstrain download` users read back. Reads the
// file, then every tensor as floats. Half of the inputs are taken as a whole
// file; the other half as the inner Checkpoint, wrapped in a valid envelope
// (format 1, right CRC-32) so that mutations reach past the checksum.
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/checkpoint.h"
#include "pstrain/v1/checkpoint.pb.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool wrap = (data[0] & 1) == 1;
  ++data;
  --size;
  std::string path;
  if (wrap) {
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
