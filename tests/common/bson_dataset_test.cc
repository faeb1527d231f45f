// common/data/bson_dataset.h on files in the Cdiscount dump's layout made
// from Fashion-MNIST's real images (tests/testing/bson_dump.h), and on the
// damaged documents a dump or an attacker can hold.
#include "common/data/bson_dataset.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/data/idx_reader.h"
#include "common/data/load_dataset.h"
#include "common/data/packed_format.h"
#include "common/storage/storage.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/bson_dump.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::data {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::DumpCategoryId;
using ::pstrain::testing::ProductDocument;
using ::pstrain::testing::StatusIs;
using ::testing::HasSubstr;

constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

class BsonDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           absl::StrCat("bson_dataset_test_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }

  // A real JPEG (a Fashion-MNIST image, or a gray square without it).
  static std::string Jpeg(uint8_t shade = 128) {
    DecodedImage image;
    image.width = image.height = 28;
    image.channels = 1;
    image.pixels.assign(28 * 28, shade);
    return EncodeJpeg(image, 90).value();
  }

  fs::path dir_;
};

TEST_F(BsonDatasetTest, AFashionMnistDumpIndexesDecodesAndMapsCategoriesToClasses) {
  if (!fs::exists(kFashionMnistDir)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  absl::StatusOr<DatasetSplits> fmnist = LoadIdxDataset(kFashionMnistDir);
  ASSERT_OK(fmnist);
  const testing::BsonDump train = testing::MakeBsonDump(fmnist->train, 3000, 7);
  const testing::BsonDump test = testing::MakeBsonDump(fmnist->test, 600, 8);
  Write("train.bson", train.bytes);
  Write("test.bson", test.bytes);

  absl::StatusOr<BsonIndex> index = IndexBsonFile((dir_ / "train.bson").string(), {});
  ASSERT_OK(index);
  EXPECT_EQ(index->pictures, 3000);
  EXPECT_EQ(static_cast<int64_t>(index->records.size()), train.products);
  EXPECT_EQ(index->file_bytes, static_cast<int64_t>(train.bytes.size()));
  EXPECT_LT(index->records.size(), 3000u);  // 1 to 4 pictures a product.
  const CategoryTable table = CategoryTable::Of(*index);
  ASSERT_EQ(table.ids.size(), 10u);
  EXPECT_EQ(table.ClassOf(DumpCategoryId(0)), 0);
  EXPECT_EQ(table.ClassOf(DumpCategoryId(9)), 9);
  EXPECT_EQ(table.ClassOf(42), -1);

  v1::DatasetSpec spec;
  spec.set_format(v1::DATASET_FORMAT_BSON);
  spec.set_path(dir_.string());
  spec.set_image_channels(1);
  spec.set_image_height(28);
  spec.set_image_width(28);
  absl::StatusOr<DatasetSplits> splits = LoadDataset(spec);
  ASSERT_OK(splits);
  ASSERT_EQ(splits->train.size(), 3000);
  ASSERT_EQ(splits->test.size(), 600);
  EXPECT_EQ(splits->train.num_classes, 10);
  // Labels in file order; pixels within JPEG's error of the source image.
  int64_t far = 0;
  for (int64_t i = 0; i < splits->train.size(); ++i) {
    ASSERT_EQ(splits->train.labels[i], train.labels[i]) << i;
    ASSERT_EQ(fmnist->train.labels[train.sources[i]], train.labels[i]);
    const uint8_t* got = splits->train.image(i);
    const uint8_t* want = fmnist->train.image(train.sources[i]);
    for (int p = 0; p < 28 * 28; ++p) far += std::abs(int{got[p]} - int{want[p]}) > 48;
  }
  EXPECT_LT(far, splits->train.size() * 28 * 28 / 100) << "over 1% of pixels off by > 48";
  // Skewed: class 0 holds about 4x class 9's pictures.
  const auto count = [&](int c) {
    return std::count(splits->train.labels.begin(), splits->train.labels.end(), c);
  };
  EXPECT_GT(count(0), 3 * count(9));
  // Limits decode only what they keep; RGB replicates gray.
  spec.set_train_limit(100);
  spec.set_image_channels(3);
  spec.set_image_height(32);
  spec.set_image_width(32);
  splits = LoadDataset(spec);
  ASSERT_OK(splits);
  EXPECT_EQ(splits->train.size(), 100);
  EXPECT_EQ(splits->train.sample_elements(), 3 * 32 * 32);
}

TEST_F(BsonDatasetTest, PackingStreamsTheDumpIntoShardsThatReadBackAsTheDumpDoes) {
  if (!fs::exists(kFashionMnistDir)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  ASSERT_OK_AND_ASSIGN(DatasetSplits fmnist, LoadIdxDataset(kFashionMnistDir));
  Write("train.bson", testing::MakeBsonDump(fmnist.train, 1500, 7).bytes);
  Write("test.bson", testing::MakeBsonDump(fmnist.test, 300, 8).bytes);
  // Cdiscount's names file: a header, a quoted name with a comma, one id
  // the dump does not hold; class 9 has no line.
  std::string names = "category_id,category_level1,category_level2,category_level3\n";
  for (int c = 0; c < 9; ++c) {
    absl::StrAppend(&names, DumpCategoryId(c), ",MODE,VETEMENT,",
                    c == 2 ? "\"PULL, GILET\"" : absl::StrCat("ARTICLE ", c), "\n");
  }
  absl::StrAppend(&names, "999,AUTRE,AUTRE,AUTRE\n");
  Write("category_names.csv", names);

  BsonDecodeOptions decode;
  decode.channels = 1;
  decode.height = decode.width = 28;
  PackOptions pack;
  pack.records_per_shard = 400;  // 4 train shards, the last partly filled.
  std::unique_ptr<storage::Storage> store = storage::NewLocalStorage();
  const std::string out = (dir_ / "packed").string();
  ASSERT_OK_AND_ASSIGN(PackSummary summary,
                       PackBsonDataset(dir_.string(), decode, out, pack, *store));
  EXPECT_EQ(summary.train_samples, 1500);
  EXPECT_EQ(summary.train_shards, 4);
  EXPECT_EQ(summary.test_samples, 300);
  ASSERT_OK_AND_ASSIGN(DatasetSplits packed, LoadPackedDataset(out));
  ASSERT_OK_AND_ASSIGN(DatasetSplits direct, LoadBsonDataset(dir_.string(), decode, 0, 0));
  EXPECT_EQ(packed.train.labels, direct.train.labels);
  EXPECT_EQ(*packed.train.CopyPixels(), direct.train.pixels);
  EXPECT_EQ(packed.test.labels, direct.test.labels);
  EXPECT_EQ(*packed.test.CopyPixels(), direct.test.pixels);
  // The names travel with the shards: classes.csv, read back with them.
  ASSERT_EQ(packed.class_names.size(), 10u);
  EXPECT_EQ(packed.class_names[0], "ARTICLE 0");
  EXPECT_EQ(packed.class_names[2], "PULL, GILET");
  EXPECT_EQ(packed.class_names[9], absl::StrCat(DumpCategoryId(9)));
  EXPECT_EQ(direct.class_names, packed.class_names);
  ASSERT_OK_AND_ASSIGN(std::string classes, store->Read(out + "/classes.csv"));
  EXPECT_THAT(classes, HasSubstr(absl::StrCat("class,category_id,name\n0,", DumpCategoryId(0),
                                              ",ARTICLE 0\n")));
  EXPECT_THAT(classes, HasSubstr(absl::StrCat("2,", DumpCategoryId(2), ",\"PULL, GILET\"\n")));
  EXPECT_THAT(classes, HasSubstr(absl::StrCat("9,", DumpCategoryId(9), ",\n")));
  // A names file that does not parse is named with its line.
  Write("category_names.csv", "category_id,level1\n1000010653,\"open quote\n");
  EXPECT_THAT(ReadCategoryNames(dir_.string()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("category_names.csv:2")));
}

TEST_F(BsonDatasetTest, TheIndexIsKeptBesideTheFileAndRebuiltWhenTheFileChanges) {
  if (!fs::exists(kFashionMnistDir)) GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  ASSERT_OK_AND_ASSIGN(DatasetSplits fmnist, LoadIdxDataset(kFashionMnistDir));
  const std::string path = Write("train.bson", testing::MakeBsonDump(fmnist.train, 500, 7).bytes);
  bool cached = true;
  ASSERT_OK_AND_ASSIGN(BsonIndex first, LoadOrBuildBsonIndex(path, {}, &cached));
  EXPECT_FALSE(cached);
  EXPECT_TRUE(fs::exists(path + ".pstrain-index"));
  ASSERT_OK_AND_ASSIGN(BsonIndex again, LoadOrBuildBsonIndex(path, {}, &cached));
  EXPECT_TRUE(cached);
  ASSERT_EQ(again.records.size(), first.records.size());
  for (size_t i = 0; i < first.records.size(); ++i) {
    EXPECT_EQ(again.records[i].offset, first.records[i].offset);
    EXPECT_EQ(again.records[i].category_id, first.records[i].category_id);
    EXPECT_EQ(again.records[i].pictures, first.records[i].pictures);
  }
  EXPECT_EQ(again.pictures, 500);
  // Another dump under the same name: the cache no longer describes it.
  Write("train.bson", testing::MakeBsonDump(fmnist.train, 200, 9).bytes);
  ASSERT_OK_AND_ASSIGN(BsonIndex changed, LoadOrBuildBsonIndex(path, {}, &cached));
  EXPECT_FALSE(cached);
  EXPECT_EQ(changed.pictures, 200);
  // A damaged cache is ignored.
  Write("train.bson.pstrain-index", "PSBIDX01 and then garbage");
  ASSERT_OK_AND_ASSIGN(BsonIndex rebuilt, LoadOrBuildBsonIndex(path, {}, &cached));
  EXPECT_FALSE(cached);
  EXPECT_EQ(rebuilt.pictures, 200);
}

TEST_F(BsonDatasetTest, DamagedRecordsNameTheirOffsetAndAreSkippedWithinTheBound) {
  const std::string good = ProductDocument(1, 1000010653, {Jpeg(), Jpeg(200)});
  const std::string no_category = ProductDocument(2, std::nullopt, {Jpeg()});
  const std::string not_jpeg = ProductDocument(3, 1000010653, {"not a JPEG at all"});
  // imgs[0].picture is a string: libbson writes it, the reader refuses it.
  bson_t doc = BSON_INITIALIZER;
  bson_append_int32(&doc, "category_id", -1, 1000010653);
  bson_t imgs, pic;
  bson_append_array_begin(&doc, "imgs", -1, &imgs);
  bson_append_document_begin(&imgs, "0", -1, &pic);
  bson_append_utf8(&pic, "picture", -1, "jpeg?", -1);
  bson_append_document_end(&imgs, &pic);
  bson_append_array_end(&doc, &imgs);
  const std::string string_picture(reinterpret_cast<const char*>(bson_get_data(&doc)), doc.len);
  bson_destroy(&doc);

  const int64_t second = static_cast<int64_t>(good.size());
  const std::string path = Write("train.bson", good + no_category + good + string_picture);
  EXPECT_THAT(IndexBsonFile(path, {}),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(absl::StrCat("record at byte ", second,
                                              ": the document has no category_id"))));
  EXPECT_THAT(IndexBsonFile(path, {.max_bad_records = 1}),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("imgs[0].picture is a string, not binary (2 damaged records, "
                                 "more than max_bad_records 1)")));
  absl::StatusOr<BsonIndex> index = IndexBsonFile(path, {.max_bad_records = 2});
  ASSERT_OK(index);
  EXPECT_EQ(index->records.size(), 2u);
  EXPECT_EQ(index->pictures, 4);
  EXPECT_EQ(index->bad_records, 2);

  // A picture that is not an image: found when decoding, by its offset.
  const std::string decode_path = Write("decode.bson", good + not_jpeg);
  absl::StatusOr<BsonIndex> with_bad_jpeg = IndexBsonFile(decode_path, {});
  ASSERT_OK(with_bad_jpeg);
  const CategoryTable table = CategoryTable::Of(*with_bad_jpeg);
  BsonDecodeOptions decode{.channels = 1, .height = 28, .width = 28};
  EXPECT_THAT(DecodeBsonFile(decode_path, *with_bad_jpeg, table, decode),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(absl::StrCat("record at byte ", second, ": imgs[0].picture"))));
  decode.max_bad_records = 1;
  int64_t skipped = 0;
  absl::StatusOr<ImageDataset> ds =
      DecodeBsonFile(decode_path, *with_bad_jpeg, table, decode, &skipped);
  ASSERT_OK(ds);
  EXPECT_EQ(ds->size(), 2);
  EXPECT_EQ(skipped, 1);
}

TEST_F(BsonDatasetTest, BrokenFramingStopsTheReadWhateverTheBound) {
  const std::string good = ProductDocument(1, 1000010653, {Jpeg()});
  const int64_t at = static_cast<int64_t>(good.size());
  const BsonOptions lenient{.max_bad_records = 1000};
  // The file ends inside a document, or inside a length prefix.
  EXPECT_THAT(IndexBsonFile(Write("a.bson", good + good.substr(0, 30)), lenient),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr(absl::StrCat("record at byte ", at, ": truncated: the file ends "
                                              "30 bytes into its"))));
  EXPECT_THAT(IndexBsonFile(Write("b.bson", good + "\x10\x00"), lenient),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("inside its length prefix")));
  // Absurd length prefixes: too small, and 2 GiB.
  EXPECT_THAT(IndexBsonFile(Write("c.bson", good + std::string("\x03\x00\x00\x00", 4)), lenient),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("length prefix 3 is outside")));
  EXPECT_THAT(IndexBsonFile(Write("d.bson", std::string("\x00\x00\x00\x80", 4) + good), lenient),
              StatusIs(absl::StatusCode::kDataLoss,
                       HasSubstr("record at byte 0: length prefix 2147483648 is outside")));
  // A length that lands beside the terminator: libbson refuses it, the
  // next record is still found (the framing held), so it is skippable.
  std::string bad_terminator = good;
  bad_terminator.back() = '\x01';
  absl::StatusOr<BsonIndex> index = IndexBsonFile(Write("e.bson", bad_terminator + good), lenient);
  ASSERT_OK(index);
  EXPECT_EQ(index->bad_records, 1);
  EXPECT_THAT(index->bad[0], HasSubstr("record at byte 0: not a BSON document"));
  EXPECT_THAT(IndexBsonFile((dir_ / "missing.bson").string(), {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing.bson")));
}

TEST_F(BsonDatasetTest, TooManyPicturesAndWrongTypesAreRefusedByName) {
  std::vector<std::string> many(kBsonMaxPictures + 1, "x");
  EXPECT_THAT(ParseBsonProduct(ProductDocument(1, 5, many)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("more than 64 pictures")));
  bson_t doc = BSON_INITIALIZER;
  bson_append_utf8(&doc, "category_id", -1, "shoes", -1);
  bson_t imgs;
  bson_append_array_begin(&doc, "imgs", -1, &imgs);
  bson_append_array_end(&doc, &imgs);
  const std::string text_category(reinterpret_cast<const char*>(bson_get_data(&doc)), doc.len);
  bson_destroy(&doc);
  EXPECT_THAT(ParseBsonProduct(text_category),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("category_id is a string, not an integer")));
  EXPECT_THAT(ParseBsonProduct(std::string("\x05\x00\x00\x00\x00", 5)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has no imgs")));
}

}  // namespace
}  // namespace pstrain::data
