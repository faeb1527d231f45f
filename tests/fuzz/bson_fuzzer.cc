// The Cdiscount BSON product dump (common/data/bson_dataset.h): the length
// framing, libbson's parse of each document, the product's fields, the
// category table and the pictures' decoding, on a file of any bytes. Every
// damaged record is allowed to be skipped, so that mutations reach the
// records after it.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/data/bson_dataset.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = pstrain::fuzz::WriteScratch("train.bson", data, size);
  absl::StatusOr<pstrain::data::BsonIndex> index =
      pstrain::data::IndexBsonFile(path, {.max_bad_records = 1 << 20});
  if (!index.ok()) return 0;
  const pstrain::data::CategoryTable table = pstrain::data::CategoryTable::Of(*index);
  if (table.ids.empty()) return 0;
  (void)pstrain::data::DecodeBsonFile(
      path, *index, table,
      {.channels = 3, .height = 8, .width = 8, .max_bad_records = 1 << 20, .limit = 64});
  return 0;
}
