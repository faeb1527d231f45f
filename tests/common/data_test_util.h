// Test-only helpers for the dataset tests: a self-deleting temporary
// directory, writers for small synthetic IDX / CIFAR files, and a small
// in-memory dataset whose images name their samples.
//
//   TempDir dir;
//   WriteFile(dir.Path("a.bin"), "bytes");
//   WriteGzipFile(dir.Path("a.bin.gz"), "bytes");
#ifndef PSTRAIN_TESTS_COMMON_DATA_TEST_UTIL_H_
#define PSTRAIN_TESTS_COMMON_DATA_TEST_UTIL_H_

#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/data/dataset.h"
#include "gtest/gtest.h"

namespace pstrain::data::testing {

// n samples of 1x2x2 in 10 classes: every pixel of sample i is i mod 256 and
// its label i % 10, so with n <= 256 a delivered image names its sample.
inline ImageDataset CountingDataset(int64_t n) {
  ImageDataset ds;
  ds.channels = 1;
  ds.height = 2;
  ds.width = 2;
  ds.num_classes = 10;
  for (int64_t i = 0; i < n; ++i) {
    for (int k = 0; k < 4; ++k) ds.pixels.push_back(static_cast<uint8_t>(i));
    ds.labels.push_back(static_cast<int32_t>(i % 10));
  }
  return ds;
}

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on
// destruction. Not thread-safe; one per test.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base != nullptr ? base : "/tmp") + "/pstrain_data_XXXXXX";
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    const char* made = mkdtemp(buffer.data());
    EXPECT_NE(made, nullptr) << "mkdtemp failed for " << pattern;
    path_ = made != nullptr ? made : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string Path(const std::string& relative) const { return path_ + "/" + relative; }

 private:
  std::string path_;
};

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Gzip-compresses `bytes` in memory (a complete single-member stream).
inline std::string Gzip(const std::string& bytes) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, bytes.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  zs.avail_in = static_cast<uInt>(bytes.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

inline void WriteGzipFile(const std::string& path, const std::string& bytes) {
  WriteFile(path, Gzip(bytes));
}

inline void AppendBigEndian32(std::string* out, uint32_t v) {
  out->push_back(static_cast<char>(v >> 24));
  out->push_back(static_cast<char>(v >> 16));
  out->push_back(static_cast<char>(v >> 8));
  out->push_back(static_cast<char>(v));
}

// An IDX images file of `count` rows x cols images whose pixel k of image i
// is (i * 31 + k) % 256.
inline std::string IdxImages(uint32_t count, uint32_t rows, uint32_t cols,
                             uint32_t magic = 0x00000803) {
  std::string out;
  AppendBigEndian32(&out, magic);
  AppendBigEndian32(&out, count);
  AppendBigEndian32(&out, rows);
  AppendBigEndian32(&out, cols);
  for (uint32_t i = 0; i < count; ++i) {
    for (uint32_t k = 0; k < rows * cols; ++k) out.push_back(static_cast<char>((i * 31 + k) % 256));
  }
  return out;
}

inline std::string IdxLabels(const std::vector<uint8_t>& labels, uint32_t magic = 0x00000801) {
  std::string out;
  AppendBigEndian32(&out, magic);
  AppendBigEndian32(&out, static_cast<uint32_t>(labels.size()));
  for (uint8_t l : labels) out.push_back(static_cast<char>(l));
  return out;
}

// CIFAR-10 records; pixel k of record i (k in [0, 3072)) is (i * 7 + k) % 251.
inline std::string CifarRecords(const std::vector<uint8_t>& labels, uint32_t first_index = 0) {
  std::string out;
  for (size_t r = 0; r < labels.size(); ++r) {
    out.push_back(static_cast<char>(labels[r]));
    for (int k = 0; k < 3072; ++k) {
      out.push_back(static_cast<char>(((first_index + r) * 7 + k) % 251));
    }
  }
  return out;
}

}  // namespace pstrain::data::testing

#endif  // PSTRAIN_TESTS_COMMON_DATA_TEST_UTIL_H_
