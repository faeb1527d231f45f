// The Cdiscount product dump (DATASET_FORMAT_BSON; docs/DATA.md): a file of
// concatenated BSON documents, one per product,
//
//   {_id: <int>, category_id: <int>, imgs: [{picture: <binary JPEG>}, ...]}
//
// read with libbson. Every picture is one sample labelled with its product's
// category; category ids map to class indices in ascending order of the ids
// that train.bson holds (CategoryTable).
//
//   PSTRAIN_ASSIGN_OR_RETURN(data::BsonIndex index, data::IndexBsonFile(path, {}));
//   data::CategoryTable table = data::CategoryTable::Of(index);
//   PSTRAIN_ASSIGN_OR_RETURN(data::ImageDataset ds,
//                            data::DecodeBsonFile(path, index, table, decode));
//
// Indexing is one pass that holds one document at a time (at most
// kBsonMaxDocumentBytes): each record's offset, size, category and picture
// count. Decoding reads the records back by offset. The decoded dataset is
// held in memory (as every format's is today): a dump larger than memory
// must first be packed with `pstrain prepare`, or wait for the streaming
// reader (not built).
//
// Errors name the file and the record's byte offset: a length prefix outside
// [5, kBsonMaxDocumentBytes] or a file that ends inside a document (the file
// cannot be read past it: always an error), a document libbson refuses, a
// missing or non-integer category_id, `imgs` that is not an array of
// documents with a binary `picture`, more than kBsonMaxPictures pictures, a
// picture that does not decode. The damaged records after the framing
// checks are skipped and counted up to Options::max_bad_records; one more
// is the error.
//
// Threads: free functions without shared state; thread-safe.
#ifndef PSTRAIN_COMMON_DATA_BSON_DATASET_H_
#define PSTRAIN_COMMON_DATA_BSON_DATASET_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/data/image_dataset.h"
#include "common/data/packed_format.h"

namespace pstrain::data {

// BSON's own limit on a document (MongoDB's), and a product's pictures.
inline constexpr int64_t kBsonMaxDocumentBytes = int64_t{16} << 20;
inline constexpr int kBsonMaxPictures = 64;

// One product document, as libbson reads it: views into the document.
struct BsonProduct {
  bool has_category = false;
  int64_t category_id = 0;
  std::vector<std::string_view> pictures;
};

// Parses one document (its bytes, length prefix included). INVALID_ARGUMENT
// saying what is wrong (without the offset, which the caller knows).
absl::StatusOr<BsonProduct> ParseBsonProduct(std::string_view document);

struct BsonRecord {
  int64_t offset = 0;  // Of its length prefix in the file.
  int32_t bytes = 0;
  int64_t category_id = 0;
  int32_t pictures = 0;
};

struct BsonOptions {
  // Damaged records skipped and counted; one more is the error.
  int64_t max_bad_records = 0;
};

struct BsonIndex {
  std::vector<BsonRecord> records;  // The readable ones, in file order.
  int64_t pictures = 0;             // Over `records`: the samples.
  int64_t file_bytes = 0;
  int64_t bad_records = 0;
  std::vector<std::string> bad;  // The first 10 skipped records' errors.
};

// One pass over `path` (see the file comment). NOT_FOUND for a missing
// file; DATA_LOSS for framing errors and for one damaged record more than
// max_bad_records, naming the offset.
//
// `store`, when given, reads the path (s3:// too: ranged reads of 8 MiB);
// null reads local files. The same holds for every function below.
absl::StatusOr<BsonIndex> IndexBsonFile(const std::string& path, const BsonOptions& options,
                                        storage::Storage* store = nullptr);

// IndexBsonFile, kept beside the file as "<path>.pstrain-index" (a binary
// copy of the records with the file's size and modification time, and a
// CRC-32): a later call whose file has the same size and time reads it
// instead of the whole file. An index with damaged records is not kept; a
// stale, damaged or unreadable cache is ignored and written again; a
// directory that cannot be written only costs the pass. `from_cache`, when
// given, says which happened.
// An s3:// path is indexed every time (no cache in the operator's bucket).
absl::StatusOr<BsonIndex> LoadOrBuildBsonIndex(const std::string& path,
                                               const BsonOptions& options,
                                               bool* from_cache = nullptr,
                                               storage::Storage* store = nullptr);

// Category ids to class indices: position in `ids` (ascending, unique).
struct CategoryTable {
  std::vector<int64_t> ids;
  static CategoryTable Of(const BsonIndex& index);
  // -1 for an id the table does not hold.
  int ClassOf(int64_t category_id) const;
};

struct BsonDecodeOptions {
  int channels = 3, height = 0, width = 0;  // The samples' shape; 1 or 3 channels.
  int64_t max_bad_records = 0;              // Pictures that do not decode, and
                                            // records whose category is not in the table.
  int64_t limit = 0;                        // Samples, from the first; 0 = all.
};

// Receives a record's decoded samples: `n` images of the options' shape,
// CHW one after another, all with `label`. An error stops the decoding.
using BsonSampleSink =
    std::function<absl::Status(int label, const uint8_t* pixels, int64_t n)>;

// Decodes the pictures of `index`'s records in order, handing each record's
// samples to `sink` (nothing is kept: memory is one record's pictures). The
// errors and the bound on damaged records are DecodeBsonFile's.
absl::Status DecodeBsonRecords(const std::string& path, const BsonIndex& index,
                               const CategoryTable& table, const BsonDecodeOptions& options,
                               const BsonSampleSink& sink, int64_t* bad_records = nullptr,
                               storage::Storage* store = nullptr);

// Decodes the pictures of `index`'s records, in order. `bad_records`, when
// given, receives how many were skipped. DATA_LOSS naming the offset and the
// picture for one more than max_bad_records.
absl::StatusOr<ImageDataset> DecodeBsonFile(const std::string& path, const BsonIndex& index,
                                            const CategoryTable& table,
                                            const BsonDecodeOptions& options,
                                            int64_t* bad_records = nullptr,
                                            storage::Storage* store = nullptr);

// <dir>/train.bson and <dir>/test.bson, classes from train's categories;
// options.limit is ignored for `train_limit` and `test_limit` (0 = all),
// and max_bad_records bounds each split's damaged records, indexing and
// decoding together.
absl::StatusOr<DatasetSplits> LoadBsonDataset(const std::string& dir,
                                              const BsonDecodeOptions& options,
                                              int64_t train_limit, int64_t test_limit,
                                              storage::Storage* store = nullptr);

// The dump's optional <dir>/category_names.csv (Cdiscount's: category_id,
// category_level1, category_level2, category_level3; quoted fields allowed):
// each id's most specific non-empty level. Empty when the file is not there;
// INVALID_ARGUMENT naming the line for one that does not parse.
absl::StatusOr<std::map<int64_t, std::string>> ReadCategoryNames(
    const std::string& dir, storage::Storage* store = nullptr);

// Streams <dir>/train.bson and test.bson (local or s3://, read through
// `store`) into packed shards at `out` (any URI `store` takes;
// packed_format.h), one record at a time: memory holds the
// indexes (24 bytes a record) and one shard, never the dump. Also writes
// <out>/classes.csv, "class,category_id,name", the names from
// category_names.csv when the dump has one. The summary counts both splits.
absl::StatusOr<PackSummary> PackBsonDataset(const std::string& dir,
                                            const BsonDecodeOptions& options,
                                            const std::string& out, const PackOptions& pack,
                                            storage::Storage& store);

}  // namespace pstrain::data

#endif  // PSTRAIN_COMMON_DATA_BSON_DATASET_H_
