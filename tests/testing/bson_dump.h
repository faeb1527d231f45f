// Writes BSON files in the Cdiscount product dump's layout (docs/DATA.md)
// from real images, for the BSON reader's tests, its fuzz seeds and
// tests/tools/make_bson_dump (the big file of the memory benchmark).
//
//   std::string doc = pstrain::testing::ProductDocument(17, 1000010653, {jpeg_a, jpeg_b});
//   pstrain::testing::BsonDump dump = pstrain::testing::MakeBsonDump(fmnist.train, 5000, 7);
//
// libbson writes every document; nothing here encodes BSON by hand.
#ifndef PSTRAIN_TESTS_TESTING_BSON_DUMP_H_
#define PSTRAIN_TESTS_TESTING_BSON_DUMP_H_

#include <bson/bson.h>

#include <cstdint>
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/data/image_codec.h"
#include "common/data/image_dataset.h"
#include "common/rng.h"

namespace pstrain::testing {

// One product: {_id, category_id (int32, absent when nullopt), imgs:
// [{picture: <binary>}, ...]}.
inline std::string ProductDocument(int64_t id, std::optional<int64_t> category,
                                   const std::vector<std::string>& pictures) {
  bson_t doc = BSON_INITIALIZER;
  bson_append_int32(&doc, "_id", -1, static_cast<int32_t>(id));
  if (category) bson_append_int32(&doc, "category_id", -1, static_cast<int32_t>(*category));
  bson_t imgs;
  bson_append_array_begin(&doc, "imgs", -1, &imgs);
  for (size_t i = 0; i < pictures.size(); ++i) {
    const std::string key = absl::StrCat(i);
    bson_t picture;
    bson_append_document_begin(&imgs, key.c_str(), -1, &picture);
    bson_append_binary(&picture, "picture", -1, BSON_SUBTYPE_BINARY,
                       reinterpret_cast<const uint8_t*>(pictures[i].data()),
                       static_cast<uint32_t>(pictures[i].size()));
    bson_append_document_end(&imgs, &picture);
  }
  bson_append_array_end(&doc, &imgs);
  std::string bytes(reinterpret_cast<const char*>(bson_get_data(&doc)), doc.len);
  bson_destroy(&doc);
  return bytes;
}

// The dump's category id of class `c` (ten-digit ids, as Cdiscount's).
inline int64_t DumpCategoryId(int c) { return 1000010653 + 7919 * int64_t{c}; }

struct BsonDump {
  std::string bytes;              // The file.
  std::vector<int32_t> labels;    // Each picture's class, in file order.
  std::vector<int64_t> sources;   // Each picture's index in the source dataset.
  int64_t products = 0;
};

// Up to `max_images` images of `source` (gray or RGB, as JPEG of quality
// 90) as products of 1 to 4 pictures of one class (consecutive in source
// order), the products shuffled; skewed counts: class c keeps about
// 1 / (1 + c / 3) of its images, so class 0 has about 4x class 9's.
//
// in_order: every image, in source order, as products of the runs of
// consecutive images of one class (at most 4): the dump's samples are the
// source's, sample for sample (for comparing training on both).
inline BsonDump MakeBsonDump(const data::ImageDataset& source, int64_t max_images,
                             uint64_t seed, bool in_order = false) {
  BsonDump dump;
  uint64_t draws = 0;
  auto next = [&] { return MixBits(seed, draws++); };
  std::vector<std::vector<int64_t>> by_class(static_cast<size_t>(source.num_classes));
  for (int64_t i = 0; i < source.size(); ++i) {
    const int c = source.labels[static_cast<size_t>(i)];
    const double keep = 1.0 / (1.0 + c / 3.0);
    if (static_cast<double>(next() % 1000000) < keep * 1e6) by_class[c].push_back(i);
  }
  // Products of 1 to 4 images of one class, then shuffled: classes come in
  // proportion to what they kept.
  std::vector<std::pair<int, std::vector<int64_t>>> products;
  for (size_t c = 0; c < by_class.size(); ++c) {
    for (size_t at = 0; at < by_class[c].size();) {
      const size_t n = std::min<size_t>(1 + next() % 4, by_class[c].size() - at);
      products.emplace_back(static_cast<int>(c),
                            std::vector<int64_t>(by_class[c].begin() + at,
                                                 by_class[c].begin() + at + n));
      at += n;
    }
  }
  for (size_t i = products.size(); i > 1; --i) std::swap(products[i - 1], products[next() % i]);
  if (in_order) {
    products.clear();
    for (int64_t i = 0; i < source.size(); ++i) {
      const int c = source.labels[static_cast<size_t>(i)];
      if (products.empty() || products.back().first != c || products.back().second.size() == 4) {
        products.emplace_back(c, std::vector<int64_t>());
      }
      products.back().second.push_back(i);
    }
  }
  for (const auto& [c, images] : products) {
    if (static_cast<int64_t>(dump.sources.size()) >= max_images) break;
    std::vector<std::string> pictures;
    for (int64_t i : images) {
      if (static_cast<int64_t>(dump.sources.size()) >= max_images) break;
      data::DecodedImage image;
      image.width = source.width;
      image.height = source.height;
      image.channels = source.channels;
      image.pixels.resize(static_cast<size_t>(source.sample_elements()));
      // CHW to HWC.
      const uint8_t* chw = source.image(i);
      const int64_t plane = int64_t{source.height} * source.width;
      for (int64_t p = 0; p < plane; ++p) {
        for (int ch = 0; ch < source.channels; ++ch) {
          image.pixels[static_cast<size_t>(p * source.channels + ch)] = chw[ch * plane + p];
        }
      }
      pictures.push_back(data::EncodeJpeg(image, 90).value());
      dump.labels.push_back(c);
      dump.sources.push_back(i);
    }
    dump.bytes += ProductDocument(dump.products++, DumpCategoryId(c), pictures);
  }
  return dump;
}

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TESTING_BSON_DUMP_H_
