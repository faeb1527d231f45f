#include "common/data/image_codec.h"

// jpeglib.h needs size_t and FILE declared first.
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

#include "absl/strings/str_cat.h"

namespace pstrain::data {
namespace {

// ---- JPEG -------------------------------------------------------------------
// libjpeg reports fatal errors through error_exit, which must not return: we
// longjmp back into DecodeJpegInto. That function keeps every piece of state
// that outlives the jump behind pointers (no C++ objects with destructors in
// its frame), so the jump skips no destructor and clobbers nothing.

struct JpegErrorManager {
  jpeg_error_mgr pub;  // First member: libjpeg sees a jpeg_error_mgr*.
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void JpegErrorExit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings are silent, except a premature end of data, which would otherwise
// decode as a silently gray-padded image: that becomes an error.
void JpegEmitMessage(j_common_ptr cinfo, int msg_level) {
  if (msg_level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) JpegErrorExit(cinfo);
  if (msg_level < 0) cinfo->err->num_warnings++;
}

struct JpegOutput {
  DecodedImage* image;
  const char* error;  // Set when the size check fails.
};

// Returns false with err->message (or out->error) set on failure.
bool DecodeJpegInto(const unsigned char* data, size_t size, JpegErrorManager* err,
                    JpegOutput* out) {
  jpeg_decompress_struct cinfo;
  cinfo.err = jpeg_std_error(&err->pub);
  err->pub.error_exit = JpegErrorExit;
  err->pub.emit_message = JpegEmitMessage;
  if (setjmp(err->jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&cinfo, TRUE);
  // The size check comes before jpeg_start_decompress, which allocates for
  // the header's dimensions (a progressive or multi-scan image keeps every
  // coefficient of the whole image): found by jpeg_fuzzer, a 65496 x 65350
  // header made libjpeg allocate 12.8 GB. libjpeg's own allocations are
  // bounded as well, for what the header does not show.
  const int64_t header_pixels = static_cast<int64_t>(cinfo.image_width) * cinfo.image_height;
  if (header_pixels <= 0 || header_pixels > kMaxDecodedPixels) {
    out->error = "image dimensions out of range";
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  cinfo.mem->max_memory_to_use = static_cast<long>(8 * kMaxDecodedPixels);
  cinfo.out_color_space = cinfo.jpeg_color_space == JCS_GRAYSCALE ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_start_decompress(&cinfo);
  const int64_t pixels = static_cast<int64_t>(cinfo.output_width) * cinfo.output_height;
  if (pixels <= 0 || pixels > kMaxDecodedPixels) {
    out->error = "image dimensions out of range";
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  out->image->width = static_cast<int>(cinfo.output_width);
  out->image->height = static_cast<int>(cinfo.output_height);
  out->image->channels = cinfo.output_components;
  const size_t row_bytes = static_cast<size_t>(cinfo.output_width) * cinfo.output_components;
  out->image->pixels.resize(row_bytes * cinfo.output_height);
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = out->image->pixels.data() + cinfo.output_scanline * row_bytes;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return true;
}

bool HasPrefix(std::string_view bytes, std::string_view magic) {
  return bytes.size() >= magic.size() && bytes.substr(0, magic.size()) == magic;
}

constexpr std::string_view kJpegMagic("\xFF\xD8\xFF", 3);
constexpr std::string_view kPngMagic("\x89PNG\r\n\x1A\n", 8);

absl::Status CheckImageForEncode(const DecodedImage& image) {
  if ((image.channels != 1 && image.channels != 3) || image.width <= 0 || image.height <= 0 ||
      image.pixels.size() !=
          static_cast<size_t>(image.width) * image.height * image.channels) {
    return absl::InvalidArgumentError(absl::StrCat("encode: bad image ", image.width, "x",
                                                   image.height, "x", image.channels, " with ",
                                                   image.pixels.size(), " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DecodedImage> DecodeJpeg(std::string_view bytes, const std::string& name) {
  DecodedImage image;
  JpegErrorManager err;
  err.message[0] = '\0';
  JpegOutput out{&image, nullptr};
  if (!DecodeJpegInto(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(), &err,
                      &out)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": corrupt JPEG: ", out.error != nullptr ? out.error : err.message));
  }
  return image;
}

absl::StatusOr<DecodedImage> DecodePng(std::string_view bytes, const std::string& name) {
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&png, bytes.data(), bytes.size())) {
    std::string message = png.message;
    png_image_free(&png);
    return absl::InvalidArgumentError(absl::StrCat(name, ": corrupt PNG: ", message));
  }
  const bool color = (png.format & PNG_FORMAT_FLAG_COLOR) != 0;
  png.format = color ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
  const int64_t pixels = static_cast<int64_t>(png.width) * png.height;
  if (pixels <= 0 || pixels > kMaxDecodedPixels) {
    png_image_free(&png);
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": PNG dimensions out of range: ", png.width, "x", png.height));
  }
  DecodedImage image;
  image.width = static_cast<int>(png.width);
  image.height = static_cast<int>(png.height);
  image.channels = color ? 3 : 1;
  // Zeroed: alpha is composited onto the buffer, i.e. onto black.
  image.pixels.assign(PNG_IMAGE_SIZE(png), 0);
  if (!png_image_finish_read(&png, nullptr, image.pixels.data(), 0, nullptr)) {
    std::string message = png.message;
    png_image_free(&png);
    return absl::InvalidArgumentError(absl::StrCat(name, ": corrupt PNG: ", message));
  }
  if ((png.warning_or_error & PNG_IMAGE_ERROR) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": corrupt PNG: ", png.message));
  }
  return image;
}

absl::StatusOr<DecodedImage> DecodeImage(std::string_view bytes, const std::string& name) {
  if (HasPrefix(bytes, kJpegMagic)) return DecodeJpeg(bytes, name);
  if (HasPrefix(bytes, kPngMagic)) return DecodePng(bytes, name);
  return absl::InvalidArgumentError(
      absl::StrCat(name, ": not a JPEG or PNG file (unrecognised magic bytes)"));
}

absl::StatusOr<std::string> EncodeJpeg(const DecodedImage& image, int quality) {
  absl::Status check = CheckImageForEncode(image);
  if (!check.ok()) return check;
  jpeg_compress_struct cinfo;
  // Compression of a well-formed in-memory image only fails on allocation,
  // which libjpeg reports through error_exit; the default (exit) is replaced
  // with one that records and longjmps like the decoder.
  JpegErrorManager err;
  err.message[0] = '\0';
  cinfo.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = JpegErrorExit;
  unsigned char* buffer = nullptr;
  unsigned long size = 0;  // NOLINT(runtime/int): libjpeg's type.
  if (setjmp(err.jump)) {
    jpeg_destroy_compress(&cinfo);
    std::free(buffer);
    return absl::InternalError(absl::StrCat("EncodeJpeg: ", err.message));
  }
  jpeg_create_compress(&cinfo);
  jpeg_mem_dest(&cinfo, &buffer, &size);
  cinfo.image_width = static_cast<JDIMENSION>(image.width);
  cinfo.image_height = static_cast<JDIMENSION>(image.height);
  cinfo.input_components = image.channels;
  cinfo.in_color_space = image.channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  const size_t row_bytes = static_cast<size_t>(image.width) * image.channels;
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<JSAMPLE*>(image.pixels.data() + cinfo.next_scanline * row_bytes);
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::string out(reinterpret_cast<const char*>(buffer), size);
  std::free(buffer);
  return out;
}

absl::StatusOr<std::string> EncodePng(const DecodedImage& image) {
  absl::Status check = CheckImageForEncode(image);
  if (!check.ok()) return check;
  png_image png;
  std::memset(&png, 0, sizeof(png));
  png.version = PNG_IMAGE_VERSION;
  png.width = static_cast<png_uint_32>(image.width);
  png.height = static_cast<png_uint_32>(image.height);
  png.format = image.channels == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&png, nullptr, &size, 0, image.pixels.data(), 0, nullptr)) {
    return absl::InternalError(absl::StrCat("EncodePng: ", png.message));
  }
  std::string out(size, '\0');
  if (!png_image_write_to_memory(&png, out.data(), &size, 0, image.pixels.data(), 0, nullptr)) {
    return absl::InternalError(absl::StrCat("EncodePng: ", png.message));
  }
  out.resize(size);
  return out;
}

void ResizeToChw(const DecodedImage& image, int channels, int height, int width, uint8_t* out) {
  const int src_c = image.channels;
  for (int y = 0; y < height; ++y) {
    const int64_t sy = (2 * int64_t{y} + 1) * image.height / (2 * int64_t{height});
    for (int x = 0; x < width; ++x) {
      const int64_t sx = (2 * int64_t{x} + 1) * image.width / (2 * int64_t{width});
      const uint8_t* p = image.pixels.data() + (sy * image.width + sx) * src_c;
      const int64_t plane = int64_t{height} * width;
      const int64_t at = int64_t{y} * width + x;
      if (channels == src_c) {
        for (int c = 0; c < channels; ++c) out[c * plane + at] = p[c];
      } else if (src_c == 1) {  // Gray -> RGB.
        for (int c = 0; c < channels; ++c) out[c * plane + at] = p[0];
      } else {  // RGB -> gray.
        out[at] = static_cast<uint8_t>((299 * p[0] + 587 * p[1] + 114 * p[2] + 500) / 1000);
      }
    }
  }
}

}  // namespace pstrain::data
