#include "common/storage/s3_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/storage/s3_credentials.h"

ABSL_FLAG(std::string, s3_endpoint, "",
          "S3-compatible endpoint for s3:// paths (http(s)://host:port; MinIO, Ceph, moto). "
          "Default $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, else AWS's own for the region");
ABSL_FLAG(std::string, s3_region, "",
          "S3 region for request signing; default $AWS_REGION, $AWS_DEFAULT_REGION, us-east-1");
ABSL_FLAG(std::string, s3_credentials, "",
          "AWS credentials file (INI, profile $AWS_PROFILE or default), used when neither "
          "$AWS_ACCESS_KEY_ID nor the shared credentials file has keys");
ABSL_FLAG(std::string, s3_ca_file, "",
          "CA bundle (PEM) for an https:// S3 endpoint; default $AWS_CA_BUNDLE, else the system's");
ABSL_FLAG(bool, s3_path_style, false,
          "Address buckets in the path (host/bucket/key); implied by a custom endpoint");
ABSL_FLAG(bool, s3_no_verify_tls, false,
          "Do not verify the S3 endpoint's TLS certificate (testing only)");

namespace pstrain::storage {

absl::StatusOr<StorageOptions> StorageOptionsFromFlags(
    const std::function<void(const std::string&)>& log) {
  S3Flags flags;
  flags.endpoint = absl::GetFlag(FLAGS_s3_endpoint);
  flags.region = absl::GetFlag(FLAGS_s3_region);
  flags.credentials_file = absl::GetFlag(FLAGS_s3_credentials);
  flags.ca_file = absl::GetFlag(FLAGS_s3_ca_file);
  flags.path_style = absl::GetFlag(FLAGS_s3_path_style);
  flags.no_verify_tls = absl::GetFlag(FLAGS_s3_no_verify_tls);
  PSTRAIN_ASSIGN_OR_RETURN(S3Settings settings, ResolveS3Settings(ProcessEnvironment(), flags));
  if (log) log(absl::StrCat("s3:// paths: ", settings.Describe()));
  StorageOptions options;
  S3ClientOptions& s3 = options.s3.emplace();
  s3.endpoint = settings.endpoint;
  s3.credentials = settings.credentials;
  s3.log = log;
  return options;
}

}  // namespace pstrain::storage
