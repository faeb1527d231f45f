// S3Client: the object-store calls pstrain needs (HEAD, ranged GET, PUT,
// multipart upload, LIST, DELETE) over libcurl, signed by libcurl's own AWS
// SigV4 (CURLOPT_AWS_SIGV4). Works with AWS S3 and S3-compatible stores
// (MinIO, Ceph RGW, moto).
//
//   S3ClientOptions options;
//   options.endpoint = settings.endpoint;  options.credentials = settings.credentials;
//   PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<S3Client> s3, S3Client::Create(options));
//   PSTRAIN_ASSIGN_OR_RETURN(ObjectInfo info, s3->Head("data", "fmnist/train-00000-of-00001.pspack"));
//   PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, s3->Get("data", "fmnist/...", info));
//
// Failures. Every attempt has a connect timeout, a stall limit (no byte for
// `stall_timeout`) and a total timeout; a call gives up after `max_attempts`
// or at `deadline`, whichever comes first. Retried, with full-jitter
// exponential backoff: connection refused or reset, a timeout, 429, 500,
// 502, 503 (SlowDown), 504, and a body shorter than its Content-Length or
// than the range asked for. Not retried: any other 4xx (403 AccessDenied or
// SignatureDoesNotMatch, 404 NoSuchKey / NoSuchBucket, 412 when the object
// changed during a ranged read). Errors name the operation, bucket, key,
// HTTP status and S3's error code ("S3 GET s3://data/fmnist/train-00000:
// 403 AccessDenied: Access Denied"); a 403 is PERMISSION_DENIED, a 404
// NOT_FOUND, a 412 ABORTED, exhausted retries UNAVAILABLE (or
// DEADLINE_EXCEEDED). Keys, secrets and signatures never appear in a
// Status or a log line.
//
// Bounds. A response body is read into memory only up to what the call
// expects (the range, or `max_response_bytes` for listings and errors); a
// larger one is an error, not an allocation.
//
// Threads: thread-safe; calls may run concurrently (each takes a curl handle
// from a pool, so connections are reused). Constant after Create but for the
// pool and the counters.
#ifndef PSTRAIN_COMMON_STORAGE_S3_CLIENT_H_
#define PSTRAIN_COMMON_STORAGE_S3_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/storage/s3_credentials.h"

namespace pstrain::storage {

// SHA-256 of `bytes` in lower-case hex (OpenSSL).
std::string Sha256Hex(absl::string_view bytes);

struct ObjectInfo {
  std::string key;   // Full key within the bucket (List); as asked (Head).
  int64_t size = 0;  // Bytes.
  std::string etag;  // As the store gives it, quotes included.
};

struct S3ClientOptions {
  S3Endpoint endpoint;
  S3Credentials credentials;
  absl::Duration connect_timeout = absl::Seconds(10);
  // An attempt that receives or sends nothing for this long is abandoned.
  absl::Duration stall_timeout = absl::Seconds(30);
  // One attempt's whole time (a 64 MiB part at 10 MB/s takes ~7 s).
  absl::Duration attempt_timeout = absl::Minutes(5);
  // The whole call, retries included.
  absl::Duration call_timeout = absl::Minutes(15);
  int max_attempts = 8;
  absl::Duration backoff_initial = absl::Milliseconds(100);
  absl::Duration backoff_max = absl::Seconds(5);
  // Objects read with Get() come in ranged GETs of this many bytes, up to
  // `parallel_ranges` at a time.
  int64_t range_bytes = int64_t{8} << 20;
  int parallel_ranges = 4;
  // Put() of more than this many bytes is a multipart upload of
  // `part_bytes` parts (S3's minimum part is 5 MiB; boto3's defaults are
  // 8 MiB and 8 MiB).
  int64_t multipart_threshold = int64_t{16} << 20;
  int64_t part_bytes = int64_t{8} << 20;
  // Listings and error bodies larger than this are refused.
  int64_t max_response_bytes = int64_t{16} << 20;
  // Told of each retry ("S3 GET s3://b/k: 503 SlowDown; retry 2 of 7 in
  // 180ms"); may be empty. Called from the calling thread.
  std::function<void(const std::string&)> log;
};

// What the client has done, for tests, benchmarks and metrics.
struct S3ClientStats {
  int64_t requests = 0;       // Attempts sent, retries included.
  int64_t retries = 0;        // Attempts after a transient failure.
  int64_t bytes_read = 0;     // Body bytes received from GETs that succeeded.
  int64_t bytes_written = 0;  // Body bytes of PUTs and parts that succeeded.
};

// The MD5 an ETag stands for, in lower-case hex: an ETag of 32 hex digits
// (quotes aside); "" for any other (a multipart upload's "<md5>-<parts>").
std::string ContentMd5OfEtag(absl::string_view etag);

class S3Client {
 public:
  // INVALID_ARGUMENT for a malformed endpoint or bad sizes.
  static absl::StatusOr<std::unique_ptr<S3Client>> Create(const S3ClientOptions& options);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  // The object's size and ETag (HEAD). NOT_FOUND names bucket and key.
  absl::StatusOr<ObjectInfo> Head(const std::string& bucket, const std::string& key);

  // Bytes [offset, offset + length) of the object. When `etag` is given, the
  // store must still hold that version (If-Match), else ABORTED. A range past
  // the end is OUT_OF_RANGE.
  absl::StatusOr<std::string> GetRange(const std::string& bucket, const std::string& key,
                                       int64_t offset, int64_t length,
                                       const std::string& etag = "");

  // The whole object `info` describes (from Head or List), in ranged GETs run
  // in parallel, each held to info.etag, the total checked against info.size.
  // Where the ETag is the bytes' MD5 (a single-part upload not encrypted with
  // KMS or customer keys), the bytes are held to it too: a mismatch (bytes
  // damaged on the way) reads the object again, up to kWholeReadAttempts
  // times, then is DATA_LOSS.
  static constexpr int kWholeReadAttempts = 4;
  absl::StatusOr<std::string> Get(const std::string& bucket, const ObjectInfo& info);

  // Writes the object: one PUT, or a multipart upload above the threshold
  // (aborted on any failure, so no part is left behind). The object appears
  // whole or not at all.
  absl::Status Put(const std::string& bucket, const std::string& key, const std::string& bytes);

  // Every object whose key starts with `prefix`, in key order (ListObjectsV2,
  // all pages).
  absl::StatusOr<std::vector<ObjectInfo>> List(const std::string& bucket,
                                               const std::string& prefix);

  // Deletes the object; deleting a missing key is OK (S3's own rule).
  absl::Status Delete(const std::string& bucket, const std::string& key);

  // Aborts every multipart upload under `prefix` that was started and never
  // completed (a writer killed mid-upload leaves its parts stored and
  // billed); returns how many.
  absl::StatusOr<int> AbortIncompleteUploads(const std::string& bucket, const std::string& prefix);

  S3ClientStats stats() const;

  // "s3://bucket/key", for messages.
  static std::string Uri(const std::string& bucket, const std::string& key);

  struct Request;   // One HTTP call (s3_client.cc).
  struct Response;

 private:
  explicit S3Client(const S3ClientOptions& options);
  // Runs `request` with retries; the last response, or why none came.
  absl::StatusOr<Response> Call(const Request& request);
  absl::StatusOr<Response> Attempt(const Request& request, absl::Time call_deadline);
  void* TakeHandle();
  void ReturnHandle(void* handle);
  std::string UrlFor(const std::string& bucket, const std::string& key,
                     const std::string& query) const;
  absl::StatusOr<Response> RangeResponse(const std::string& bucket, const std::string& key,
                                         int64_t offset, int64_t length, const std::string& etag);
  absl::StatusOr<std::string> GetOnce(const std::string& bucket, const ObjectInfo& info,
                                      const std::string& expected_md5);
  absl::Status PutMultipart(const std::string& bucket, const std::string& key,
                            const std::string& bytes);

  // Constant after construction.
  const S3ClientOptions options_;
  std::string sigv4_;    // "aws:amz:<region>:s3"
  std::string scheme_;   // "http" or "https"
  std::string host_;     // host[:port] of the endpoint.
  std::string base_path_;  // Path prefix of the endpoint ("" usually).

  absl::Mutex mu_;
  std::vector<void*> idle_handles_ ABSL_GUARDED_BY(mu_);  // CURL*, kept for connection reuse.

  std::atomic<int64_t> requests_{0}, retries_{0}, bytes_read_{0}, bytes_written_{0};
};

}  // namespace pstrain::storage

#endif  // PSTRAIN_COMMON_STORAGE_S3_CLIENT_H_
