// The S3 flags every program that reads or writes s3:// shares
// (pstrain-worker, pstrain): --s3-endpoint, --s3-region, --s3-credentials,
// --s3-ca-file, --s3-path-style and --s3-no-verify-tls, resolved with the
// environment's AWS variables (s3_credentials.h has the order).
//
//   PSTRAIN_ASSIGN_OR_RETURN(storage::StorageOptions options,
//                            storage::StorageOptionsFromFlags(log));
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<storage::Storage> store,
//                            storage::OpenStorage(options));
//
// Threads: call from main() after absl::ParseCommandLine.
#ifndef PSTRAIN_COMMON_STORAGE_S3_FLAGS_H_
#define PSTRAIN_COMMON_STORAGE_S3_FLAGS_H_

#include <functional>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/storage/storage.h"

// For commands that list the flags they take (the pstrain CLI).
ABSL_DECLARE_FLAG(std::string, s3_endpoint);
ABSL_DECLARE_FLAG(std::string, s3_region);
ABSL_DECLARE_FLAG(std::string, s3_credentials);
ABSL_DECLARE_FLAG(std::string, s3_ca_file);
ABSL_DECLARE_FLAG(bool, s3_path_style);
ABSL_DECLARE_FLAG(bool, s3_no_verify_tls);

namespace pstrain::storage {

// Storage options with the S3 client set from the flags and the process's
// environment. `log` gets one line saying where the settings and keys came
// from (never the secret), and the client's retry lines; it may be empty.
absl::StatusOr<StorageOptions> StorageOptionsFromFlags(
    const std::function<void(const std::string&)>& log);

}  // namespace pstrain::storage

#endif  // PSTRAIN_COMMON_STORAGE_S3_FLAGS_H_
