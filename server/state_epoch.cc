#include "server/state_epoch.h"

#include <openssl/rand.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/data/file_io.h"
#include "common/status_macros.h"

namespace pstrain {
namespace {

constexpr char kFileName[] = "state_epoch";
constexpr size_t kEpochBytes = 16;  // 32 hex digits.

bool IsEpoch(const std::string& text) {
  if (text.size() != 2 * kEpochBytes) return false;
  for (char c : text) {
    if (!absl::ascii_isxdigit(c) || absl::ascii_isupper(c)) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::string> LoadOrCreateStateEpoch(const std::string& state_dir) {
  const std::string path = data::JoinPath(state_dir, kFileName);
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    PSTRAIN_ASSIGN_OR_RETURN(std::string text, data::ReadFileBytes(path));
    text = std::string(absl::StripAsciiWhitespace(text));
    if (!IsEpoch(text)) {
      return absl::DataLossError(absl::StrCat(
          path, " does not hold a state epoch (32 lowercase hex digits); it is made by "
                "pstrain-server and must not be edited"));
    }
    return text;
  }
  if (ec) return data::ErrnoError(ec.value(), "cannot look for", path);
  unsigned char random[kEpochBytes];
  if (RAND_bytes(random, sizeof(random)) != 1) {
    return absl::InternalError("cannot draw a random state epoch (OpenSSL RAND_bytes failed)");
  }
  const std::string epoch =
      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(random), kEpochBytes));
  PSTRAIN_RETURN_IF_ERROR(data::WriteFileAtomically(path, epoch + "\n"));
  return epoch;
}

}  // namespace pstrain
