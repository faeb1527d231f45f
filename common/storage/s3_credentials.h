// S3 credentials and settings from the places AWS tools look, resolved once by
// a program's main() and handed to the S3 client as plain values (libraries
// never read the environment themselves).
//
//   PSTRAIN_ASSIGN_OR_RETURN(storage::S3Settings s3,
//       storage::ResolveS3Settings(storage::ProcessEnvironment(), flags));
//   PSTRAIN_ASSIGN_OR_RETURN(auto client, storage::S3Client::Create(s3.client));
//   LOG(INFO) << s3.Describe();  // Where the keys came from; never the keys.
//
// Credentials come from the first of, in this order:
//   1. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN);
//   2. the shared credentials file (AWS_SHARED_CREDENTIALS_FILE, else
//      ~/.aws/credentials), profile AWS_PROFILE (else "default");
//   3. the file given with --s3-credentials (the same INI layout, profile
//      AWS_PROFILE or "default").
// A program with no credentials anywhere still starts: S3 then answers the
// first request naming the bucket (anonymous requests are what public
// buckets take).
//
// The endpoint is --s3-endpoint, else AWS_ENDPOINT_URL_S3, else
// AWS_ENDPOINT_URL, else AWS's own for the region (virtual-hosted
// addressing). The region is --s3-region, else AWS_REGION, else
// AWS_DEFAULT_REGION, else us-east-1. A custom CA bundle is --s3-ca-file, else
// AWS_CA_BUNDLE.
//
// Threads: free functions without shared state.
#ifndef PSTRAIN_COMMON_STORAGE_S3_CREDENTIALS_H_
#define PSTRAIN_COMMON_STORAGE_S3_CREDENTIALS_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pstrain::storage {

struct S3Credentials {
  std::string access_key_id;
  std::string secret_access_key;  // Secret: never logged, never in a Status.
  std::string session_token;      // Secret; empty for long-term keys.
  // Where they came from, for logs: "environment", "shared credentials file
  // /root/.aws/credentials [default]", "--s3-credentials FILE [p]", "none".
  std::string source = "none";

  bool empty() const { return access_key_id.empty(); }
};

// What the command line says about S3 (each empty when not given).
struct S3Flags {
  std::string endpoint;          // --s3-endpoint http(s)://host[:port]
  std::string region;            // --s3-region
  std::string credentials_file;  // --s3-credentials FILE
  std::string ca_file;           // --s3-ca-file PEM
  bool path_style = false;       // --s3-path-style (also implied by a custom endpoint)
  bool no_verify_tls = false;    // --s3-no-verify-tls (testing only)
};

// How to reach the store, without the keys.
struct S3Endpoint {
  std::string endpoint;  // "https://s3.us-east-1.amazonaws.com" or the override, no trailing '/'.
  std::string region = "us-east-1";
  bool path_style = false;  // http(s)://host/bucket/key instead of http(s)://bucket.host/key.
  std::string ca_file;      // Empty: the system's CA store.
  bool verify_tls = true;
};

struct S3Settings {
  S3Endpoint endpoint;
  S3Credentials credentials;

  // "endpoint http://127.0.0.1:9000 (path-style), region us-east-1,
  // credentials from environment (key AKIA…XYZ1)": the key id's last four
  // characters only, the secret never.
  std::string Describe() const;
};

// Looks a variable up; nullopt when it is not set.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

// The process's environment (getenv), for main() functions.
EnvLookup ProcessEnvironment();

// Parses an AWS INI credentials file's text and returns `profile`'s keys
// (aws_access_key_id, aws_secret_access_key, aws_session_token). NOT_FOUND
// when the profile is not there; INVALID_ARGUMENT for a profile without both
// keys. `origin` names the file in errors (whose text never quotes a value).
absl::StatusOr<S3Credentials> ParseCredentialsFile(absl::string_view text,
                                                   const std::string& profile,
                                                   const std::string& origin);

// Resolves the endpoint and the credential chain above. Errors: a malformed
// endpoint (not http:// or https://), an explicit --s3-credentials file that
// cannot be read or lacks the profile, or a set AWS_ACCESS_KEY_ID without
// AWS_SECRET_ACCESS_KEY. A missing default shared file is not an error.
absl::StatusOr<S3Settings> ResolveS3Settings(const EnvLookup& env, const S3Flags& flags);

}  // namespace pstrain::storage

#endif  // PSTRAIN_COMMON_STORAGE_S3_CREDENTIALS_H_
