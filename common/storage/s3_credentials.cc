#include "common/storage/s3_credentials.h"

#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/data/file_io.h"
#include "common/status_macros.h"

namespace pstrain::storage {
namespace {

std::string EnvOr(const EnvLookup& env, const char* name, const std::string& fallback) {
  std::optional<std::string> value = env(name);
  return value.has_value() && !value->empty() ? *value : fallback;
}

// The shared credentials file, when there is one to read: an explicit
// AWS_SHARED_CREDENTIALS_FILE must exist; the default ~/.aws/credentials may not.
absl::StatusOr<std::optional<S3Credentials>> FromSharedFile(const EnvLookup& env,
                                                            const std::string& profile) {
  std::string path = EnvOr(env, "AWS_SHARED_CREDENTIALS_FILE", "");
  const bool explicit_path = !path.empty();
  if (!explicit_path) {
    const std::string home = EnvOr(env, "HOME", "");
    if (home.empty()) return std::optional<S3Credentials>();
    path = home + "/.aws/credentials";
  }
  absl::StatusOr<std::string> text = data::ReadFileBytes(path);
  if (!text.ok()) {
    if (!explicit_path && absl::IsNotFound(text.status())) return std::optional<S3Credentials>();
    return absl::Status(text.status().code(),
                        absl::StrCat("S3 shared credentials file: ", text.status().message()));
  }
  absl::StatusOr<S3Credentials> creds = ParseCredentialsFile(*text, profile, path);
  // A default file without the profile is somebody else's file: go on down the chain.
  if (!explicit_path && absl::IsNotFound(creds.status())) return std::optional<S3Credentials>();
  if (!creds.ok()) return creds.status();
  creds->source = absl::StrCat("shared credentials file ", path, " [", profile, "]");
  return std::optional<S3Credentials>(*std::move(creds));
}

}  // namespace

std::string S3Settings::Describe() const {
  std::string key = "none";
  if (!credentials.access_key_id.empty()) {
    const std::string& id = credentials.access_key_id;
    key = id.size() > 4 ? absl::StrCat("...", id.substr(id.size() - 4)) : "...";
  }
  return absl::StrCat("endpoint ", endpoint.endpoint, endpoint.path_style ? " (path-style)" : "",
                      ", region ", endpoint.region, ", credentials from ", credentials.source,
                      " (key ", key, ")", endpoint.verify_tls ? "" : ", TLS NOT verified",
                      endpoint.ca_file.empty() ? "" : absl::StrCat(", CA ", endpoint.ca_file));
}

EnvLookup ProcessEnvironment() {
  return [](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

absl::StatusOr<S3Credentials> ParseCredentialsFile(absl::string_view text,
                                                   const std::string& profile,
                                                   const std::string& origin) {
  bool in_profile = false, found = false;
  S3Credentials creds;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[') {
      if (line.back() != ']') {
        return absl::InvalidArgumentError(
            absl::StrCat(origin, ":", line_number, ": a section header needs a closing ']'"));
      }
      absl::string_view name = absl::StripAsciiWhitespace(line.substr(1, line.size() - 2));
      absl::ConsumePrefix(&name, "profile ");  // The config file's spelling.
      in_profile = name == profile;
      found |= in_profile;
      continue;
    }
    if (!in_profile) continue;
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) {
      // Never quote the line: it may be a secret without its key.
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ":", line_number, ": expected key = value"));
    }
    const std::string key = absl::AsciiStrToLower(absl::StripAsciiWhitespace(line.substr(0, eq)));
    const std::string value(absl::StripAsciiWhitespace(line.substr(eq + 1)));
    if (key == "aws_access_key_id") creds.access_key_id = value;
    if (key == "aws_secret_access_key") creds.secret_access_key = value;
    if (key == "aws_session_token") creds.session_token = value;
  }
  if (!found) {
    return absl::NotFoundError(absl::StrCat(origin, " has no profile [", profile, "]"));
  }
  if (creds.access_key_id.empty() || creds.secret_access_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        origin, " [", profile, "] needs both aws_access_key_id and aws_secret_access_key"));
  }
  return creds;
}

absl::StatusOr<S3Settings> ResolveS3Settings(const EnvLookup& env, const S3Flags& flags) {
  S3Settings settings;
  S3Endpoint& ep = settings.endpoint;
  ep.region = !flags.region.empty()
                  ? flags.region
                  : EnvOr(env, "AWS_REGION", EnvOr(env, "AWS_DEFAULT_REGION", "us-east-1"));
  std::string endpoint = !flags.endpoint.empty()
                             ? flags.endpoint
                             : EnvOr(env, "AWS_ENDPOINT_URL_S3", EnvOr(env, "AWS_ENDPOINT_URL", ""));
  if (endpoint.empty()) {
    ep.endpoint = absl::StrCat("https://s3.", ep.region, ".amazonaws.com");
    ep.path_style = flags.path_style;
  } else {
    if (!absl::StartsWith(endpoint, "http://") && !absl::StartsWith(endpoint, "https://")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "S3 endpoint must start with http:// or https://, got \"", endpoint, "\""));
    }
    while (absl::EndsWith(endpoint, "/")) endpoint.pop_back();
    ep.endpoint = endpoint;
    // MinIO, Ceph and moto answer on one host: buckets go in the path.
    ep.path_style = true;
  }
  ep.ca_file = !flags.ca_file.empty() ? flags.ca_file : EnvOr(env, "AWS_CA_BUNDLE", "");
  ep.verify_tls = !flags.no_verify_tls;

  const std::string profile = EnvOr(env, "AWS_PROFILE", "default");
  // 1. The environment.
  const std::string key_id = EnvOr(env, "AWS_ACCESS_KEY_ID", "");
  if (!key_id.empty()) {
    const std::string secret = EnvOr(env, "AWS_SECRET_ACCESS_KEY", "");
    if (secret.empty()) {
      return absl::InvalidArgumentError(
          "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not");
    }
    settings.credentials.access_key_id = key_id;
    settings.credentials.secret_access_key = secret;
    settings.credentials.session_token = EnvOr(env, "AWS_SESSION_TOKEN", "");
    settings.credentials.source = "environment";
    return settings;
  }
  // 2. The shared credentials file.
  PSTRAIN_ASSIGN_OR_RETURN(std::optional<S3Credentials> shared, FromSharedFile(env, profile));
  if (shared.has_value()) {
    settings.credentials = *std::move(shared);
    return settings;
  }
  // 3. --s3-credentials FILE.
  if (!flags.credentials_file.empty()) {
    absl::StatusOr<std::string> text = data::ReadFileBytes(flags.credentials_file);
    if (!text.ok()) {
      return absl::Status(text.status().code(),
                          absl::StrCat("--s3-credentials: ", text.status().message()));
    }
    PSTRAIN_ASSIGN_OR_RETURN(settings.credentials,
                             ParseCredentialsFile(*text, profile, flags.credentials_file));
    settings.credentials.source =
        absl::StrCat("--s3-credentials ", flags.credentials_file, " [", profile, "]");
  }
  return settings;
}

}  // namespace pstrain::storage
