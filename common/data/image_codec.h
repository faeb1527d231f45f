// JPEG (libjpeg-turbo) and PNG (libpng) decoding and encoding of 8-bit images,
// plus the nearest-neighbour resize into the CHW layout of ImageDataset.
//
//   PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, data::ReadFileBytes(path));
//   PSTRAIN_ASSIGN_OR_RETURN(data::DecodedImage img, data::DecodeImage(bytes, path));
//   std::vector<uint8_t> chw(3 * 32 * 32);
//   data::ResizeToChw(img, /*channels=*/3, /*height=*/32, /*width=*/32, chw.data());
//
// Free functions without shared state; thread-safe (each call has its own
// decoder). Corrupt input is an error Status, never a process exit.
#ifndef PSTRAIN_COMMON_DATA_IMAGE_CODEC_H_
#define PSTRAIN_COMMON_DATA_IMAGE_CODEC_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace pstrain::data {

// An 8-bit image, rows top to bottom, channels interleaved (HWC): 1 channel
// (gray) or 3 (RGB).
struct DecodedImage {
  int width = 0, height = 0, channels = 0;
  std::vector<uint8_t> pixels;  // height * width * channels bytes.
};

// Images larger than this many pixels are rejected (a corrupt header would
// otherwise ask for gigabytes).
inline constexpr int64_t kMaxDecodedPixels = int64_t{1} << 28;

// Decodes a JPEG or PNG (chosen by the magic bytes). Grayscale files give one
// channel, everything else three (PNG alpha is composited onto black). A
// corrupt or truncated file, or an unknown format, is INVALID_ARGUMENT whose
// message starts with `name` (usually the file path).
absl::StatusOr<DecodedImage> DecodeImage(std::string_view bytes, const std::string& name);
absl::StatusOr<DecodedImage> DecodeJpeg(std::string_view bytes, const std::string& name);
absl::StatusOr<DecodedImage> DecodePng(std::string_view bytes, const std::string& name);

// Encoders (used by tests and dataset tools). `image` must have 1 or 3
// channels and pixels.size() == height * width * channels.
absl::StatusOr<std::string> EncodeJpeg(const DecodedImage& image, int quality);
absl::StatusOr<std::string> EncodePng(const DecodedImage& image);

// Writes `image` as CHW with `channels` channels (1 or 3) resized to
// height x width by nearest neighbour (source pixel floor((y + 0.5) * H / h)).
// Gray becomes RGB by replication; RGB becomes gray by the BT.601 luma
// (0.299 R + 0.587 G + 0.114 B, rounded). `out` holds channels*height*width bytes.
void ResizeToChw(const DecodedImage& image, int channels, int height, int width, uint8_t* out);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_IMAGE_CODEC_H_
