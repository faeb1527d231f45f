#include "common/data/bson_dataset.h"

#include <bson/bson.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/data/file_io.h"
#include "common/data/image_codec.h"
#include "common/status_macros.h"

namespace pstrain::data {
namespace {

constexpr size_t kMaxListedErrors = 10;

absl::Status Invalid(const std::string& what) { return absl::InvalidArgumentError(what); }

const char* TypeName(bson_type_t type) {
  switch (type) {
    case BSON_TYPE_DOUBLE: return "a double";
    case BSON_TYPE_UTF8: return "a string";
    case BSON_TYPE_DOCUMENT: return "a document";
    case BSON_TYPE_ARRAY: return "an array";
    case BSON_TYPE_BINARY: return "binary";
    case BSON_TYPE_INT32: return "an int32";
    case BSON_TYPE_INT64: return "an int64";
    case BSON_TYPE_NULL: return "null";
    default: return "another BSON type";
  }
}

// The element `it` points at ended an iteration over a document: corrupt
// when libbson stopped before the end (bson_iter_t.err_off, set by
// bson_iter_next on an element whose length or type is wrong).
absl::Status CheckIteration(const bson_iter_t& it, const std::string& what) {
  if (it.err_off != 0) {
    return Invalid(absl::StrCat(what, " is corrupt at byte ", it.err_off, " of it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CategoryOf(const bson_iter_t& it) {
  switch (bson_iter_type(&it)) {
    case BSON_TYPE_INT32: return bson_iter_int32(&it);
    case BSON_TYPE_INT64: return bson_iter_int64(&it);
    case BSON_TYPE_DOUBLE: {
      const double v = bson_iter_double(&it);
      if (v >= -9.0e15 && v <= 9.0e15 && v == static_cast<double>(static_cast<int64_t>(v))) {
        return static_cast<int64_t>(v);
      }
      return Invalid(absl::StrCat("category_id ", v, " is not an integer"));
    }
    default:
      return Invalid(absl::StrCat("category_id is ", TypeName(bson_iter_type(&it)),
                                  ", not an integer"));
  }
}

// `imgs`: an array of {picture: <binary>} documents.
absl::Status ReadPictures(const bson_iter_t& imgs, BsonProduct* product) {
  if (bson_iter_type(&imgs) != BSON_TYPE_ARRAY) {
    return Invalid(absl::StrCat("imgs is ", TypeName(bson_iter_type(&imgs)), ", not an array"));
  }
  bson_iter_t element;
  if (!bson_iter_recurse(&imgs, &element)) return Invalid("imgs is a corrupt array");
  while (bson_iter_next(&element)) {
    const size_t i = product->pictures.size();
    if (i >= static_cast<size_t>(kBsonMaxPictures)) {
      return Invalid(absl::StrCat("imgs holds more than ", kBsonMaxPictures, " pictures"));
    }
    if (bson_iter_type(&element) != BSON_TYPE_DOCUMENT) {
      return Invalid(absl::StrCat("imgs[", i, "] is ", TypeName(bson_iter_type(&element)),
                                  ", not a document"));
    }
    bson_iter_t field;
    if (!bson_iter_recurse(&element, &field)) {
      return Invalid(absl::StrCat("imgs[", i, "] is a corrupt document"));
    }
    bool found = false;
    while (bson_iter_next(&field)) {
      if (std::strcmp(bson_iter_key(&field), "picture") != 0) continue;
      if (bson_iter_type(&field) != BSON_TYPE_BINARY) {
        return Invalid(absl::StrCat("imgs[", i, "].picture is ", TypeName(bson_iter_type(&field)),
                                    ", not binary"));
      }
      bson_subtype_t subtype;
      uint32_t length = 0;
      const uint8_t* data = nullptr;
      bson_iter_binary(&field, &subtype, &length, &data);
      product->pictures.emplace_back(reinterpret_cast<const char*>(data), length);
      found = true;
    }
    PSTRAIN_RETURN_IF_ERROR(CheckIteration(field, absl::StrCat("imgs[", i, "]")));
    if (!found) return Invalid(absl::StrCat("imgs[", i, "] has no picture"));
  }
  return CheckIteration(element, "imgs");
}

// What the offset of a record says in an error.
std::string At(const std::string& path, int64_t offset) {
  return absl::StrCat(path, ": record at byte ", offset);
}

}  // namespace

absl::StatusOr<BsonProduct> ParseBsonProduct(std::string_view document) {
  bson_t doc;
  if (!bson_init_static(&doc, reinterpret_cast<const uint8_t*>(document.data()),
                        document.size())) {
    return Invalid("not a BSON document (its length prefix or its terminator is wrong)");
  }
  bson_iter_t it;
  if (!bson_iter_init(&it, &doc)) return Invalid("not a BSON document");
  BsonProduct product;
  bool has_imgs = false;
  while (bson_iter_next(&it)) {
    const char* key = bson_iter_key(&it);
    if (std::strcmp(key, "category_id") == 0) {
      PSTRAIN_ASSIGN_OR_RETURN(product.category_id, CategoryOf(it));
      product.has_category = true;
    } else if (std::strcmp(key, "imgs") == 0) {
      PSTRAIN_RETURN_IF_ERROR(ReadPictures(it, &product));
      has_imgs = true;
    }
  }
  PSTRAIN_RETURN_IF_ERROR(CheckIteration(it, "the document"));
  if (!has_imgs) return Invalid("the document has no imgs");
  return product;
}

absl::StatusOr<BsonIndex> IndexBsonFile(const std::string& path, const BsonOptions& options) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  BsonIndex index;
  std::string document;
  int64_t offset = 0;
  for (;;) {
    char prefix[4];
    in.read(prefix, 4);
    const std::streamsize got = in.gcount();
    if (got == 0) break;  // The end, between records.
    if (got < 4) {
      return absl::DataLossError(absl::StrCat(At(path, offset), ": the file ends inside its ",
                                              "length prefix (", got, " of 4 bytes)"));
    }
    const int64_t length = static_cast<int64_t>(static_cast<uint8_t>(prefix[0])) |
                           static_cast<int64_t>(static_cast<uint8_t>(prefix[1])) << 8 |
                           static_cast<int64_t>(static_cast<uint8_t>(prefix[2])) << 16 |
                           static_cast<int64_t>(static_cast<uint8_t>(prefix[3])) << 24;
    if (length < 5 || length > kBsonMaxDocumentBytes) {
      return absl::DataLossError(absl::StrCat(
          At(path, offset), ": length prefix ", length, " is outside [5, ", kBsonMaxDocumentBytes,
          "]; the file cannot be read past it"));
    }
    document.resize(static_cast<size_t>(length));
    std::memcpy(document.data(), prefix, 4);
    in.read(document.data() + 4, length - 4);
    if (in.gcount() < length - 4) {
      return absl::DataLossError(absl::StrCat(At(path, offset), ": truncated: the file ends ",
                                              4 + in.gcount(), " bytes into its ", length,
                                              " bytes"));
    }
    absl::StatusOr<BsonProduct> product = ParseBsonProduct(document);
    if (product.ok() && !product->has_category) {
      product = Invalid("the document has no category_id");
    }
    if (!product.ok()) {
      const std::string error = absl::StrCat(At(path, offset), ": ", product.status().message());
      if (++index.bad_records > options.max_bad_records) {
        return absl::DataLossError(
            options.max_bad_records > 0
                ? absl::StrCat(error, " (", index.bad_records, " damaged records, more than ",
                               "max_bad_records ", options.max_bad_records, ")")
                : error);
      }
      if (index.bad.size() < kMaxListedErrors) index.bad.push_back(error);
    } else {
      index.records.push_back({offset, static_cast<int32_t>(length), product->category_id,
                               static_cast<int32_t>(product->pictures.size())});
      index.pictures += static_cast<int64_t>(product->pictures.size());
    }
    offset += length;
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error at byte ", offset));
  index.file_bytes = offset;
  return index;
}

CategoryTable CategoryTable::Of(const BsonIndex& index) {
  CategoryTable table;
  for (const BsonRecord& r : index.records) table.ids.push_back(r.category_id);
  std::sort(table.ids.begin(), table.ids.end());
  table.ids.erase(std::unique(table.ids.begin(), table.ids.end()), table.ids.end());
  return table;
}

int CategoryTable::ClassOf(int64_t category_id) const {
  const auto it = std::lower_bound(ids.begin(), ids.end(), category_id);
  return it != ids.end() && *it == category_id ? static_cast<int>(it - ids.begin()) : -1;
}

absl::StatusOr<ImageDataset> DecodeBsonFile(const std::string& path, const BsonIndex& index,
                                            const CategoryTable& table,
                                            const BsonDecodeOptions& options,
                                            int64_t* bad_records) {
  if ((options.channels != 1 && options.channels != 3) || options.height <= 0 ||
      options.width <= 0) {
    return Invalid(absl::StrCat(path, ": images must be 1 or 3 channels of a positive size, got ",
                                options.channels, "x", options.height, "x", options.width));
  }
  if (table.ids.empty()) return Invalid(absl::StrCat(path, ": no categories"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  ImageDataset ds;
  ds.channels = options.channels;
  ds.height = options.height;
  ds.width = options.width;
  ds.num_classes = static_cast<int>(table.ids.size());
  const int64_t wanted =
      options.limit > 0 ? std::min(options.limit, index.pictures) : index.pictures;
  const size_t sample = static_cast<size_t>(ds.sample_elements());
  ds.pixels.reserve(static_cast<size_t>(wanted) * sample);
  ds.labels.reserve(static_cast<size_t>(wanted));
  int64_t bad = 0;
  std::string document;
  for (const BsonRecord& r : index.records) {
    if (ds.size() >= wanted) break;
    document.resize(static_cast<size_t>(r.bytes));
    in.seekg(r.offset);
    in.read(document.data(), r.bytes);
    if (in.gcount() != r.bytes) {
      return absl::DataLossError(
          absl::StrCat(At(path, r.offset), ": the file changed since it was indexed"));
    }
    absl::Status status;
    const int label = table.ClassOf(r.category_id);
    absl::StatusOr<BsonProduct> product = ParseBsonProduct(document);
    if (label < 0) {
      status = Invalid(absl::StrCat("category_id ", r.category_id, " is not among the ",
                                    table.ids.size(), " categories of the training file"));
    } else if (!product.ok()) {
      status = absl::DataLossError(absl::StrCat("the file changed since it was indexed: ",
                                                product.status().message()));
    }
    // The record's samples go in whole or not at all.
    std::vector<uint8_t> pixels;
    for (size_t i = 0; status.ok() && i < product->pictures.size(); ++i) {
      absl::StatusOr<DecodedImage> image =
          DecodeImage(product->pictures[i], absl::StrCat("imgs[", i, "].picture"));
      if (!image.ok()) {
        status = image.status();
        break;
      }
      pixels.resize(pixels.size() + sample);
      ResizeToChw(*image, ds.channels, ds.height, ds.width, pixels.data() + pixels.size() - sample);
    }
    if (!status.ok()) {
      const std::string error = absl::StrCat(At(path, r.offset), ": ", status.message());
      if (++bad > options.max_bad_records) {
        return absl::DataLossError(
            options.max_bad_records > 0
                ? absl::StrCat(error, " (", bad, " damaged records, more than max_bad_records ",
                               options.max_bad_records, ")")
                : error);
      }
      continue;
    }
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(pixels.size() / sample),
                                        wanted - ds.size());
    ds.pixels.insert(ds.pixels.end(), pixels.begin(),
                     pixels.begin() + static_cast<std::ptrdiff_t>(n * static_cast<int64_t>(sample)));
    ds.labels.insert(ds.labels.end(), static_cast<size_t>(n), label);
  }
  if (bad_records != nullptr) *bad_records = bad;
  PSTRAIN_RETURN_IF_ERROR(ds.Validate(path));
  return ds;
}

absl::StatusOr<DatasetSplits> LoadBsonDataset(const std::string& dir,
                                              const BsonDecodeOptions& options,
                                              int64_t train_limit, int64_t test_limit) {
  const BsonOptions index_options{.max_bad_records = options.max_bad_records};
  PSTRAIN_ASSIGN_OR_RETURN(BsonIndex train,
                           IndexBsonFile(JoinPath(dir, "train.bson"), index_options));
  PSTRAIN_ASSIGN_OR_RETURN(BsonIndex test,
                           IndexBsonFile(JoinPath(dir, "test.bson"), index_options));
  const CategoryTable table = CategoryTable::Of(train);
  DatasetSplits splits;
  for (auto [split, index, limit] : {std::tuple{&splits.train, &train, train_limit},
                                     std::tuple{&splits.test, &test, test_limit}}) {
    BsonDecodeOptions decode = options;
    decode.limit = limit;
    decode.max_bad_records = options.max_bad_records - index->bad_records;  // What is left.
    const std::string path = JoinPath(dir, split == &splits.train ? "train.bson" : "test.bson");
    PSTRAIN_ASSIGN_OR_RETURN(*split, DecodeBsonFile(path, *index, table, decode));
  }
  return splits;
}

}  // namespace pstrain::data
