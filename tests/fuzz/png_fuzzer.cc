// Png decoding (common/data/image_codec, libpng / libjpeg-turbo), as the
// image-folder reader does for every file of a dataset: decode, then resize
// into a small CHW tensor.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "common/data/image_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto image =
      pstrain::data::DecodePng(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!image.ok()) return 0;
  std::vector<uint8_t> out(3 * 8 * 8);
  pstrain::data::ResizeToChw(*image, 3, 8, 8, out.data());
  return 0;
}
