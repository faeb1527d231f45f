// Helpers of the libFuzzer targets in tests/fuzz/: the readers under test
// take file paths, so an input is written to a scratch file first (tmpfs
// when there is one).
#ifndef PSTRAIN_TESTS_FUZZ_FUZZ_UTIL_H_
#define PSTRAIN_TESTS_FUZZ_FUZZ_UTIL_H_

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

namespace pstrain::fuzz {

// A scratch directory of this process, made once.
inline const std::string& ScratchDir() {
  static const std::string dir = [] {
    std::error_code error;
    const char* base = std::filesystem::is_directory("/dev/shm", error) ? "/dev/shm" : "/tmp";
    std::string d = std::string(base) + "/pstrain-fuzz-" + std::to_string(getpid());
    std::filesystem::create_directories(d, error);
    return d;
  }();
  return dir;
}

// Writes `size` bytes to ScratchDir()/name and returns the path.
inline std::string WriteScratch(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = ScratchDir() + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

}  // namespace pstrain::fuzz

#endif  // PSTRAIN_TESTS_FUZZ_FUZZ_UTIL_H_
