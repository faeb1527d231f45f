#include "common/data/bson_dataset.h"

#include <bson/bson.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>

#include <sys/stat.h>
#include <zlib.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/data/file_io.h"
#include "common/storage/storage.h"
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

// A file or object read through 8 MiB blocks: the index pass reads it in
// order, decoding by ascending offsets, so one ranged read (one GET for an
// object) serves many records.
class BlockReader {
 public:
  static constexpr int64_t kBlockBytes = int64_t{8} << 20;

  // NOT_FOUND (naming the path) when there is nothing to read.
  static absl::StatusOr<BlockReader> Open(storage::Storage& store, const std::string& uri) {
    absl::StatusOr<storage::ObjectInfo> info = store.Stat(uri);
    if (!info.ok()) {
      return absl::Status(info.status().code(),
                          absl::StrCat(uri, ": cannot open (", info.status().message(), ")"));
    }
    return BlockReader(store, uri, info->size);
  }

  int64_t size() const { return size_; }

  // Up to `n` bytes at `offset` into `out`; fewer only at the end.
  absl::StatusOr<int64_t> Read(int64_t offset, int64_t n, char* out) {
    int64_t done = 0;
    while (done < n && offset + done < size_) {
      const int64_t at = offset + done;
      if (at < block_start_ || at >= block_start_ + static_cast<int64_t>(block_.size())) {
        block_start_ = at;
        const int64_t length = std::min(kBlockBytes, size_ - at);
        absl::StatusOr<std::string> block = store_->ReadRange(uri_, at, length);
        if (!block.ok() || static_cast<int64_t>(block->size()) != length) {
          return absl::DataLossError(absl::StrCat(
              uri_, ": read of bytes ", at, "+", length, " failed (",
              block.ok() ? "short" : block.status().message(), "; did the file change?)"));
        }
        block_ = *std::move(block);
      }
      const int64_t take =
          std::min(n - done, block_start_ + static_cast<int64_t>(block_.size()) - at);
      std::memcpy(out + done, block_.data() + (at - block_start_), static_cast<size_t>(take));
      done += take;
    }
    return done;
  }

 private:
  BlockReader(storage::Storage& store, std::string uri, int64_t size)
      : store_(&store), uri_(std::move(uri)), size_(size) {}
  storage::Storage* store_;
  std::string uri_;
  int64_t size_;
  int64_t block_start_ = 0;
  std::string block_;
};

// `store`, or a local one kept in `local` when it is null.
storage::Storage& StoreOr(storage::Storage* store, std::unique_ptr<storage::Storage>& local) {
  if (store != nullptr) return *store;
  local = storage::NewLocalStorage();
  return *local;
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

absl::StatusOr<BsonIndex> IndexBsonFile(const std::string& path, const BsonOptions& options,
                                        storage::Storage* store) {
  std::unique_ptr<storage::Storage> local;
  PSTRAIN_ASSIGN_OR_RETURN(BlockReader in, BlockReader::Open(StoreOr(store, local), path));
  BsonIndex index;
  std::string document;
  int64_t offset = 0;
  for (;;) {
    char prefix[4];
    PSTRAIN_ASSIGN_OR_RETURN(const int64_t got, in.Read(offset, 4, prefix));
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
    PSTRAIN_ASSIGN_OR_RETURN(const int64_t body, in.Read(offset + 4, length - 4,
                                                         document.data() + 4));
    if (body < length - 4) {
      return absl::DataLossError(absl::StrCat(At(path, offset), ": truncated: the file ends ",
                                              4 + body, " bytes into its ", length, " bytes"));
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

absl::Status DecodeBsonRecords(const std::string& path, const BsonIndex& index,
                               const CategoryTable& table, const BsonDecodeOptions& options,
                               const BsonSampleSink& sink, int64_t* bad_records,
                               storage::Storage* store) {
  if ((options.channels != 1 && options.channels != 3) || options.height <= 0 ||
      options.width <= 0) {
    return Invalid(absl::StrCat(path, ": images must be 1 or 3 channels of a positive size, got ",
                                options.channels, "x", options.height, "x", options.width));
  }
  if (table.ids.empty()) return Invalid(absl::StrCat(path, ": no categories"));
  std::unique_ptr<storage::Storage> local;
  PSTRAIN_ASSIGN_OR_RETURN(BlockReader in, BlockReader::Open(StoreOr(store, local), path));
  const int64_t wanted =
      options.limit > 0 ? std::min(options.limit, index.pictures) : index.pictures;
  const size_t sample = static_cast<size_t>(options.channels) * options.height * options.width;
  int64_t bad = 0, delivered = 0;
  std::string document;
  std::vector<uint8_t> pixels;
  for (const BsonRecord& r : index.records) {
    if (delivered >= wanted) break;
    document.resize(static_cast<size_t>(r.bytes));
    absl::StatusOr<int64_t> got = in.Read(r.offset, r.bytes, document.data());
    if (!got.ok() || *got != r.bytes) {
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
    pixels.clear();
    for (size_t i = 0; status.ok() && i < product->pictures.size(); ++i) {
      absl::StatusOr<DecodedImage> image =
          DecodeImage(product->pictures[i], absl::StrCat("imgs[", i, "].picture"));
      if (!image.ok()) {
        status = image.status();
        break;
      }
      pixels.resize(pixels.size() + sample);
      ResizeToChw(*image, options.channels, options.height, options.width,
                  pixels.data() + pixels.size() - sample);
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
                                        wanted - delivered);
    PSTRAIN_RETURN_IF_ERROR(sink(label, pixels.data(), n));
    delivered += n;
  }
  if (bad_records != nullptr) *bad_records = bad;
  return absl::OkStatus();
}

absl::StatusOr<ImageDataset> DecodeBsonFile(const std::string& path, const BsonIndex& index,
                                            const CategoryTable& table,
                                            const BsonDecodeOptions& options,
                                            int64_t* bad_records, storage::Storage* store) {
  ImageDataset ds;
  ds.channels = options.channels;
  ds.height = options.height;
  ds.width = options.width;
  ds.num_classes = static_cast<int>(table.ids.size());
  const size_t sample = static_cast<size_t>(std::max(0, options.channels)) *
                        std::max(0, options.height) * std::max(0, options.width);
  PSTRAIN_RETURN_IF_ERROR(DecodeBsonRecords(
      path, index, table, options,
      [&](int label, const uint8_t* pixels, int64_t n) {
        ds.pixels.insert(ds.pixels.end(), pixels, pixels + n * static_cast<int64_t>(sample));
        ds.labels.insert(ds.labels.end(), static_cast<size_t>(n), label);
        return absl::OkStatus();
      },
      bad_records, store));
  PSTRAIN_RETURN_IF_ERROR(ds.Validate(path));
  return ds;
}

// ---- The index kept beside the file ------------------------------------------------

namespace {

constexpr char kIndexMagic[8] = {'P', 'S', 'B', 'I', 'D', 'X', '0', '1'};
constexpr int64_t kIndexHeaderBytes = 8 + 8 + 8 + 8 + 8;  // magic, size, mtime, n, pictures
constexpr int64_t kIndexRecordBytes = 8 + 4 + 8 + 4;

template <typename T>
void Append(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));  // Little-endian hosts.
}
template <typename T>
T Take(const std::string& in, size_t at) {
  T value;
  std::memcpy(&value, in.data() + at, sizeof(T));
  return value;
}

// The file's size and modification time (ns), or nullopt.
std::optional<std::pair<int64_t, int64_t>> FileStamp(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return std::make_pair(static_cast<int64_t>(st.st_size),
                        static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec);
}

std::string EncodeIndex(const BsonIndex& index, int64_t mtime_ns) {
  std::string out(kIndexMagic, sizeof(kIndexMagic));
  Append<int64_t>(out, index.file_bytes);
  Append<int64_t>(out, mtime_ns);
  Append<int64_t>(out, static_cast<int64_t>(index.records.size()));
  Append<int64_t>(out, index.pictures);
  for (const BsonRecord& r : index.records) {
    Append<int64_t>(out, r.offset);
    Append<int32_t>(out, r.bytes);
    Append<int64_t>(out, r.category_id);
    Append<int32_t>(out, r.pictures);
  }
  Append<uint32_t>(out, static_cast<uint32_t>(
                            crc32_z(0L, reinterpret_cast<const Bytef*>(out.data()), out.size())));
  return out;
}

// The cached index when it is whole and describes the file as it is now.
std::optional<BsonIndex> DecodeIndex(const std::string& bytes, int64_t file_bytes,
                                     int64_t mtime_ns) {
  if (bytes.size() < static_cast<size_t>(kIndexHeaderBytes + 4) ||
      std::memcmp(bytes.data(), kIndexMagic, sizeof(kIndexMagic)) != 0) {
    return std::nullopt;
  }
  const uint32_t crc = Take<uint32_t>(bytes, bytes.size() - 4);
  if (crc != static_cast<uint32_t>(crc32_z(0L, reinterpret_cast<const Bytef*>(bytes.data()),
                                           bytes.size() - 4))) {
    return std::nullopt;
  }
  const int64_t n = Take<int64_t>(bytes, 24);
  if (Take<int64_t>(bytes, 8) != file_bytes || Take<int64_t>(bytes, 16) != mtime_ns || n < 0 ||
      static_cast<int64_t>(bytes.size()) != kIndexHeaderBytes + n * kIndexRecordBytes + 4) {
    return std::nullopt;
  }
  BsonIndex index;
  index.file_bytes = file_bytes;
  index.pictures = Take<int64_t>(bytes, 32);
  index.records.resize(static_cast<size_t>(n));
  size_t at = kIndexHeaderBytes;
  for (BsonRecord& r : index.records) {
    r.offset = Take<int64_t>(bytes, at);
    r.bytes = Take<int32_t>(bytes, at + 8);
    r.category_id = Take<int64_t>(bytes, at + 12);
    r.pictures = Take<int32_t>(bytes, at + 20);
    at += kIndexRecordBytes;
  }
  return index;
}

std::string CsvField(const std::string& text) {
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string out = "\"";
  for (char c : text) {
    if (c == '"') out.push_back('"');
    out.push_back(c == '\n' ? ' ' : c);
  }
  return out + "\"";
}

}  // namespace

absl::StatusOr<BsonIndex> LoadOrBuildBsonIndex(const std::string& path,
                                               const BsonOptions& options, bool* from_cache,
                                               storage::Storage* store) {
  if (from_cache != nullptr) *from_cache = false;
  // An object in a store: no cache (the bucket may be read-only, and is the
  // operator's); the pass reads it in 8 MiB ranges.
  if (storage::IsS3Uri(path)) return IndexBsonFile(path, options, store);
  const std::string cache = path + ".pstrain-index";
  const std::optional<std::pair<int64_t, int64_t>> stamp = FileStamp(path);
  if (stamp.has_value()) {
    if (absl::StatusOr<std::string> bytes = ReadFileBytes(cache); bytes.ok()) {
      if (std::optional<BsonIndex> index = DecodeIndex(*bytes, stamp->first, stamp->second)) {
        if (from_cache != nullptr) *from_cache = true;
        return *std::move(index);
      }
    }
  }
  PSTRAIN_ASSIGN_OR_RETURN(BsonIndex index, IndexBsonFile(path, options, store));
  // Kept only when clean and the file did not change while it was read; a
  // directory that cannot be written only costs the next pass.
  if (index.bad_records == 0 && stamp.has_value() && FileStamp(path) == stamp) {
    (void)WriteFileAtomically(cache, EncodeIndex(index, stamp->second));
  }
  return index;
}

absl::StatusOr<std::map<int64_t, std::string>> ReadCategoryNames(const std::string& dir,
                                                                 storage::Storage* store) {
  std::map<int64_t, std::string> names;
  const std::string path = storage::JoinUri(dir, "category_names.csv");
  std::unique_ptr<storage::Storage> local;
  // Cdiscount's has 5,270 lines; a few hundred bytes a category at most.
  absl::StatusOr<std::string> text =
      storage::ReadAtMost(StoreOr(store, local), path, int64_t{256} << 20);
  if (absl::IsNotFound(text.status())) return names;
  if (!text.ok()) return text.status();
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(*text, '\n')) {
    ++line_number;
    line = absl::StripTrailingAsciiWhitespace(line);
    if (line.empty()) continue;
    std::optional<std::vector<std::string>> fields = SplitCsvLine(line);
    int64_t id = 0;
    if (!fields.has_value() || fields->size() < 2 ||
        !absl::SimpleAtoi((*fields)[0], &id)) {
      if (line_number == 1) continue;  // The header.
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", line_number, ": expected category_id,level1[,level2[,level3]]"));
    }
    for (size_t i = fields->size(); i-- > 1;) {
      const std::string name(absl::StripAsciiWhitespace((*fields)[i]));
      if (!name.empty()) {
        names[id] = name;
        break;
      }
    }
  }
  return names;
}

absl::StatusOr<PackSummary> PackBsonDataset(const std::string& dir,
                                            const BsonDecodeOptions& options,
                                            const std::string& out, const PackOptions& pack,
                                            storage::Storage& store) {
  const BsonOptions index_options{.max_bad_records = options.max_bad_records};
  PSTRAIN_ASSIGN_OR_RETURN(
      BsonIndex train,
      LoadOrBuildBsonIndex(storage::JoinUri(dir, "train.bson"), index_options, nullptr, &store));
  PSTRAIN_ASSIGN_OR_RETURN(
      BsonIndex test,
      LoadOrBuildBsonIndex(storage::JoinUri(dir, "test.bson"), index_options, nullptr, &store));
  PSTRAIN_ASSIGN_OR_RETURN(const auto names, ReadCategoryNames(dir, &store));
  const CategoryTable table = CategoryTable::Of(train);
  PackSummary summary;
  for (auto [name, index] : {std::pair{"train", &train}, std::pair{"test", &test}}) {
    const PackedSplitWriter::Shape shape{options.channels, options.height, options.width,
                                         static_cast<int>(table.ids.size())};
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<PackedSplitWriter> writer,
                             PackedSplitWriter::Create(store, out, name, shape,
                                                       index->pictures, pack));
    const int64_t sample = int64_t{options.channels} * options.height * options.width;
    BsonDecodeOptions decode = options;
    decode.limit = 0;
    decode.max_bad_records = options.max_bad_records - index->bad_records;
    PSTRAIN_RETURN_IF_ERROR(DecodeBsonRecords(
        storage::JoinUri(dir, absl::StrCat(name, ".bson")), *index, table, decode,
        [&](int label, const uint8_t* pixels, int64_t n) -> absl::Status {
          for (int64_t i = 0; i < n; ++i) {
            PSTRAIN_RETURN_IF_ERROR(writer->Append(label, pixels + i * sample));
          }
          return absl::OkStatus();
        },
        nullptr, &store));
    PSTRAIN_ASSIGN_OR_RETURN(PackSummary written, writer->Finish());
    (std::string(name) == "train" ? summary.train_samples : summary.test_samples) =
        written.train_samples;
    (std::string(name) == "train" ? summary.train_shards : summary.test_shards) =
        written.train_shards;
    summary.bytes += written.bytes;
  }
  std::string classes = "class,category_id,name\n";
  for (size_t c = 0; c < table.ids.size(); ++c) {
    const auto name = names.find(table.ids[c]);
    absl::StrAppend(&classes, c, ",", table.ids[c], ",",
                    name == names.end() ? "" : CsvField(name->second), "\n");
  }
  PSTRAIN_RETURN_IF_ERROR(store.Write(storage::JoinUri(out, "classes.csv"), classes));
  summary.bytes += static_cast<int64_t>(classes.size());
  return summary;
}

absl::StatusOr<DatasetSplits> LoadBsonDataset(const std::string& dir,
                                              const BsonDecodeOptions& options,
                                              int64_t train_limit, int64_t test_limit,
                                              storage::Storage* store) {
  const BsonOptions index_options{.max_bad_records = options.max_bad_records};
  PSTRAIN_ASSIGN_OR_RETURN(
      BsonIndex train,
      LoadOrBuildBsonIndex(storage::JoinUri(dir, "train.bson"), index_options, nullptr, store));
  PSTRAIN_ASSIGN_OR_RETURN(
      BsonIndex test,
      LoadOrBuildBsonIndex(storage::JoinUri(dir, "test.bson"), index_options, nullptr, store));
  const CategoryTable table = CategoryTable::Of(train);
  DatasetSplits splits;
  for (auto [split, index, limit] : {std::tuple{&splits.train, &train, train_limit},
                                     std::tuple{&splits.test, &test, test_limit}}) {
    BsonDecodeOptions decode = options;
    decode.limit = limit;
    decode.max_bad_records = options.max_bad_records - index->bad_records;  // What is left.
    const std::string path =
        storage::JoinUri(dir, split == &splits.train ? "train.bson" : "test.bson");
    PSTRAIN_ASSIGN_OR_RETURN(*split, DecodeBsonFile(path, *index, table, decode, nullptr, store));
  }
  // Each class is its category: named by category_names.csv, else its id.
  PSTRAIN_ASSIGN_OR_RETURN(const auto names, ReadCategoryNames(dir, store));
  for (int64_t id : table.ids) {
    const auto name = names.find(id);
    splits.class_names.push_back(name != names.end() ? name->second : absl::StrCat(id));
  }
  return splits;
}

}  // namespace pstrain::data
