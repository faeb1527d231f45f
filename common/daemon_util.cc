#include "common/daemon_util.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "common/build_info.h"

namespace pstrain {

void EnsurePassiveOpenMpWait(char** argv, bool policy_given) {
  if (policy_given) return;
  ::setenv("OMP_WAIT_POLICY", "passive", 1);
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return;
  path[n] = '\0';
  ::execv(path, argv);
  // execv only returns on failure: carry on; the variable is set for any
  // OpenMP runtime that initialises later in this process.
}

std::vector<char*> NormalizeFlagSpelling(int argc, char** argv, std::vector<std::string>* storage) {
  storage->clear();
  storage->reserve(argc);
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    if (i > 0 && arg.size() > 2 && arg.compare(0, 2, "--") == 0) {
      const size_t end = std::min(arg.find('='), arg.size());
      for (size_t k = 2; k < end; ++k) {
        if (arg[k] == '-') arg[k] = '_';
      }
    }
    storage->push_back(std::move(arg));
  }
  std::vector<char*> out;
  for (std::string& s : *storage) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

void InstallVersionFlag(std::function<std::string()> extra) {
  absl::FlagsUsageConfig config;
  // --help lists the flags of the daemon's main file and the shared security
  // and S3 flags (Abseil's default looks for files named after the binary,
  // "pstrain-server", and lists none).
  config.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "_main.cc") || absl::EndsWith(file, "rpc/security_flags.cc") ||
           absl::EndsWith(file, "storage/s3_flags.cc");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.version_string = [extra = std::move(extra)] {
    std::string text = std::string(BuildId()) + "\n";
    if (extra) text += extra();
    return text;
  };
  absl::SetFlagsUsageConfig(config);
}

}  // namespace pstrain
