// S3Client over libcurl. One call is Call() -> Attempt()s: an attempt takes a
// curl handle from the pool, signs with CURLOPT_AWS_SIGV4, and classifies
// what came back as done, transient (retry after a jittered backoff) or
// permanent. Bodies are collected into bounded strings.
#include "common/storage/s3_client.h"

#include <curl/curl.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "absl/base/call_once.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace pstrain::storage {

struct S3Client::Request {
  std::string op;      // "GET", "HEAD", "PUT", "POST", "DELETE".
  std::string bucket;  // May be empty only for listing buckets (unused).
  std::string key;     // Unencoded.
  std::string query;   // Encoded, in canonical (sorted) order, without '?'.
  int64_t range_offset = -1, range_length = 0;
  std::string if_match;
  const std::string* body = nullptr;  // PUT/POST payload.
  int64_t max_body = 0;               // Largest response body accepted.
};

struct S3Client::Response {
  long status = 0;  // NOLINT(runtime/int): curl's type.
  std::string body;
  std::map<std::string, std::string> headers;  // Lower-case names.
};

namespace {

absl::once_flag curl_init_once;

constexpr char kEmptySha256[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

// RFC 3986 percent-encoding of everything but the unreserved characters (and
// '/' in a key's path), as SigV4's canonical request spells it.
std::string UriEncode(const std::string& text, bool keep_slash) {
  std::string out;
  for (unsigned char c : text) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", c);
    }
  }
  return out;
}

// The canonical query string of (name, value) pairs: sorted, encoded, and
// "name=" for a valueless parameter (libcurl signs the query as written).
std::string Query(std::vector<std::pair<std::string, std::string>> params) {
  std::sort(params.begin(), params.end());
  std::vector<std::string> parts;
  for (const auto& [name, value] : params) {
    parts.push_back(absl::StrCat(UriEncode(name, false), "=", UriEncode(value, false)));
  }
  return absl::StrJoin(parts, "&");
}

std::string XmlUnescape(absl::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '&') {
      out.push_back(text[i]);
      continue;
    }
    const size_t semi = text.find(';', i);
    if (semi == absl::string_view::npos) {
      absl::StrAppend(&out, text.substr(i));
      break;
    }
    const absl::string_view entity = text.substr(i + 1, semi - i - 1);
    uint32_t code = 0;
    if (entity == "amp") out.push_back('&');
    else if (entity == "lt") out.push_back('<');
    else if (entity == "gt") out.push_back('>');
    else if (entity == "quot") out.push_back('"');
    else if (entity == "apos") out.push_back('\'');
    else if (absl::StartsWith(entity, "#x") &&
             absl::SimpleHexAtoi(entity.substr(2), &code) && code < 128)
      out.push_back(static_cast<char>(code));
    else if (absl::StartsWith(entity, "#") && absl::SimpleAtoi(entity.substr(1), &code) &&
             code < 128)
      out.push_back(static_cast<char>(code));
    else
      absl::StrAppend(&out, text.substr(i, semi - i + 1));
    i = semi;
  }
  return out;
}

std::string XmlEscape(absl::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

// The text of every <tag>…</tag> in `xml`, in order. S3's responses are
// flat enough that its fields never nest a tag of the same name.
std::vector<absl::string_view> XmlElements(absl::string_view xml, absl::string_view tag) {
  std::vector<absl::string_view> found;
  const std::string open = absl::StrCat("<", tag, ">"), close = absl::StrCat("</", tag, ">");
  size_t pos = 0;
  while ((pos = xml.find(open, pos)) != absl::string_view::npos) {
    const size_t start = pos + open.size();
    const size_t end = xml.find(close, start);
    if (end == absl::string_view::npos) break;
    found.push_back(xml.substr(start, end - start));
    pos = end + close.size();
  }
  return found;
}

std::string XmlField(absl::string_view xml, absl::string_view tag) {
  std::vector<absl::string_view> all = XmlElements(xml, tag);
  return all.empty() ? "" : XmlUnescape(all.front());
}

struct Collector {
  std::string* body;
  int64_t max_body;        // For a 2xx response.
  int64_t max_error_body;  // For any other (S3's XML error, from a small range too).
  bool overflow = false;
  std::map<std::string, std::string>* headers;
  bool success = true;  // The status line of the latest response is 2xx.
};

size_t WriteBody(char* data, size_t size, size_t count, void* user) {
  auto* c = static_cast<Collector*>(user);
  const size_t bytes = size * count;
  if (static_cast<int64_t>(c->body->size() + bytes) >
      (c->success ? c->max_body : c->max_error_body)) {
    c->overflow = true;
    return 0;  // Aborts the transfer (CURLE_WRITE_ERROR).
  }
  c->body->append(data, bytes);
  return bytes;
}

size_t WriteHeader(char* data, size_t size, size_t count, void* user) {
  auto* c = static_cast<Collector*>(user);
  const absl::string_view line(data, size * count);
  if (absl::StartsWith(line, "HTTP/")) {
    c->headers->clear();  // A new response (after 100 Continue or a redirect).
    const size_t space = line.find(' ');
    c->success =
        space != absl::string_view::npos && line.size() > space + 1 && line[space + 1] == '2';
  } else if (const size_t colon = line.find(':'); colon != absl::string_view::npos) {
    c->headers->insert_or_assign(absl::AsciiStrToLower(line.substr(0, colon)),
                                 std::string(absl::StripAsciiWhitespace(line.substr(colon + 1))));
  }
  return size * count;
}

bool TransientCurlError(CURLcode code) {
  switch (code) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_PARTIAL_FILE:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_GOT_NOTHING:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR:
      return true;
    default:
      return false;
  }
}

bool TransientHttpStatus(long status) {  // NOLINT(runtime/int)
  return status == 429 || status == 500 || status == 502 || status == 503 || status == 504;
}

absl::StatusCode CodeForHttpStatus(long status) {  // NOLINT(runtime/int)
  switch (status) {
    case 400: return absl::StatusCode::kInvalidArgument;
    case 401:
    case 403: return absl::StatusCode::kPermissionDenied;
    case 404: return absl::StatusCode::kNotFound;
    case 409: return absl::StatusCode::kAborted;
    case 412: return absl::StatusCode::kAborted;
    case 416: return absl::StatusCode::kOutOfRange;
    default: return status >= 500 ? absl::StatusCode::kUnavailable
                                  : absl::StatusCode::kFailedPrecondition;
  }
}

// "403 AccessDenied: Access Denied", from S3's XML error body when present.
std::string DescribeHttpError(const S3Client::Response& r) {
  std::string text = absl::StrCat(r.status);
  const std::string code = XmlField(r.body, "Code");
  const std::string message = XmlField(r.body, "Message");
  if (!code.empty()) absl::StrAppend(&text, " ", code);
  if (!message.empty()) absl::StrAppend(&text, ": ", message);
  if (code.empty() && r.status == 404) absl::StrAppend(&text, " Not Found");
  if (code.empty() && r.status == 403) absl::StrAppend(&text, " Forbidden");
  return text;
}

absl::Duration Backoff(const S3ClientOptions& o, int retry) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  const double cap = absl::ToDoubleMilliseconds(
      std::min(o.backoff_max, o.backoff_initial * (int64_t{1} << std::min(retry, 20))));
  return absl::Milliseconds(std::uniform_real_distribution<double>(cap / 2, cap)(rng));
}

S3Client::Request MakeRequest(std::string op, std::string bucket, std::string key,
                              std::string query = "") {
  S3Client::Request request;
  request.op = std::move(op);
  request.bucket = std::move(bucket);
  request.key = std::move(key);
  request.query = std::move(query);
  return request;
}

// Internal marker: the attempt failed in a way worth retrying.
absl::Status Transient(std::string message) { return absl::UnavailableError(std::move(message)); }

}  // namespace

std::string Sha256Hex(absl::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr);
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) absl::StrAppendFormat(&hex, "%02x", digest[i]);
  return hex;
}

std::string S3Client::Uri(const std::string& bucket, const std::string& key) {
  return absl::StrCat("s3://", bucket, "/", key);
}

absl::StatusOr<std::unique_ptr<S3Client>> S3Client::Create(const S3ClientOptions& options) {
  absl::call_once(curl_init_once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (options.max_attempts < 1 || options.range_bytes < 1 || options.parallel_ranges < 1 ||
      options.part_bytes < (int64_t{5} << 20) || options.max_response_bytes < 4096) {
    return absl::InvalidArgumentError(
        "S3 client: max_attempts, range_bytes and parallel_ranges must be >= 1, part_bytes >= 5 "
        "MiB, max_response_bytes >= 4096");
  }
  std::unique_ptr<S3Client> client(new S3Client(options));
  absl::string_view rest = options.endpoint.endpoint;
  if (absl::ConsumePrefix(&rest, "https://")) {
    client->scheme_ = "https";
  } else if (absl::ConsumePrefix(&rest, "http://")) {
    client->scheme_ = "http";
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "S3 endpoint must start with http:// or https://, got \"", options.endpoint.endpoint, "\""));
  }
  const size_t slash = rest.find('/');
  client->host_ = std::string(rest.substr(0, slash));
  if (slash != absl::string_view::npos) {
    client->base_path_ = std::string(absl::StripSuffix(rest.substr(slash), "/"));
  }
  if (client->host_.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("S3 endpoint has no host: \"", options.endpoint.endpoint, "\""));
  }
  client->sigv4_ = absl::StrCat("aws:amz:", options.endpoint.region, ":s3");
  return client;
}

S3Client::S3Client(const S3ClientOptions& options) : options_(options) {}

S3Client::~S3Client() {
  absl::MutexLock lock(&mu_);
  for (void* handle : idle_handles_) curl_easy_cleanup(static_cast<CURL*>(handle));
}

S3ClientStats S3Client::stats() const {
  return S3ClientStats{requests_.load(), retries_.load(), bytes_read_.load(),
                       bytes_written_.load()};
}

void* S3Client::TakeHandle() {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_handles_.empty()) {
      void* handle = idle_handles_.back();
      idle_handles_.pop_back();
      return handle;
    }
  }
  return curl_easy_init();
}

void S3Client::ReturnHandle(void* handle) {
  absl::MutexLock lock(&mu_);
  idle_handles_.push_back(handle);
}

std::string S3Client::UrlFor(const std::string& bucket, const std::string& key,
                             const std::string& query) const {
  std::string url;
  if (options_.endpoint.path_style || bucket.empty()) {
    url = absl::StrCat(scheme_, "://", host_, base_path_, "/", UriEncode(bucket, false));
    if (!key.empty() || !query.empty()) absl::StrAppend(&url, "/");
  } else {
    url = absl::StrCat(scheme_, "://", bucket, ".", host_, base_path_, "/");
  }
  absl::StrAppend(&url, UriEncode(key, true));
  if (!query.empty()) absl::StrAppend(&url, "?", query);
  return url;
}

absl::StatusOr<S3Client::Response> S3Client::Attempt(const Request& request,
                                                     absl::Time call_deadline) {
  CURL* curl = static_cast<CURL*>(TakeHandle());
  if (curl == nullptr) return absl::ResourceExhaustedError("S3: curl_easy_init failed");
  curl_easy_reset(curl);  // Options go; the connection cache stays.
  Response response;
  // A range's size is known: one allocation, not a doubling string's.
  if (request.range_offset >= 0) response.body.reserve(request.range_length);
  Collector collector{&response.body, request.max_body,
                      std::max(request.max_body, options_.max_response_bytes), false,
                      &response.headers};
  char error_buffer[CURL_ERROR_SIZE] = {0};
  const std::string url = UrlFor(request.bucket, request.key, request.query);
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error_buffer);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, WriteBody);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &collector);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, WriteHeader);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &collector);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(absl::ToInt64Milliseconds(options_.connect_timeout)));
  const absl::Duration left = std::min(options_.attempt_timeout, call_deadline - absl::Now());
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS,
                   static_cast<long>(std::max<int64_t>(1, absl::ToInt64Milliseconds(left))));
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME,
                   static_cast<long>(std::max<int64_t>(1, absl::ToInt64Seconds(options_.stall_timeout))));
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
  if (!options_.endpoint.ca_file.empty()) {
    curl_easy_setopt(curl, CURLOPT_CAINFO, options_.endpoint.ca_file.c_str());
  }
  if (!options_.endpoint.verify_tls) {
    curl_easy_setopt(curl, CURLOPT_SSL_VERIFYPEER, 0L);
    curl_easy_setopt(curl, CURLOPT_SSL_VERIFYHOST, 0L);
  }
  const S3Credentials& creds = options_.credentials;
  if (!creds.empty()) {
    curl_easy_setopt(curl, CURLOPT_AWS_SIGV4, sigv4_.c_str());
    curl_easy_setopt(curl, CURLOPT_USERNAME, creds.access_key_id.c_str());
    curl_easy_setopt(curl, CURLOPT_PASSWORD, creds.secret_access_key.c_str());
  }
  curl_slist* headers = nullptr;
  const std::string payload_hash = request.body ? Sha256Hex(*request.body) : kEmptySha256;
  // No "Expect:" line to suppress 100-continue: libcurl's SigV4 would sign
  // that empty header, which is never sent.
  std::vector<std::string> lines = {absl::StrCat("x-amz-content-sha256: ", payload_hash)};
  if (!creds.session_token.empty()) {
    lines.push_back(absl::StrCat("x-amz-security-token: ", creds.session_token));
  }
  if (request.range_offset >= 0) {
    lines.push_back(absl::StrCat("Range: bytes=", request.range_offset, "-",
                                 request.range_offset + request.range_length - 1));
  }
  if (!request.if_match.empty()) lines.push_back(absl::StrCat("If-Match: ", request.if_match));
  if (request.body != nullptr) lines.push_back("Content-Type: application/octet-stream");
  for (const std::string& line : lines) headers = curl_slist_append(headers, line.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);

  if (request.op == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (request.op == "PUT" || request.op == "POST") {
    // The payload is in memory (POSTFIELDS) so that libcurl can sign its hash.
    static const std::string kEmpty;
    const std::string& body = request.body ? *request.body : kEmpty;
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body.data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
    if (request.op == "PUT") curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, "PUT");
  } else if (request.op != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.op.c_str());
  }
  requests_.fetch_add(1, std::memory_order_relaxed);
  const CURLcode code = curl_easy_perform(curl);
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &response.status);
  curl_slist_free_all(headers);
  ReturnHandle(curl);

  const std::string what = absl::StrCat("S3 ", request.op, " ", Uri(request.bucket, request.key));
  if (collector.overflow) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": response body larger than the ",
        collector.success ? collector.max_body : collector.max_error_body, " bytes expected"));
  }
  if (code != CURLE_OK) {
    std::string reason = error_buffer[0] != '\0' ? error_buffer : curl_easy_strerror(code);
    std::string message = absl::StrCat(what, ": ", reason);
    if (TransientCurlError(code)) return Transient(std::move(message));
    return absl::FailedPreconditionError(std::move(message));
  }
  if (response.status < 200 || response.status >= 300) {
    std::string message = absl::StrCat(what, ": ", DescribeHttpError(response));
    if (TransientHttpStatus(response.status)) return Transient(std::move(message));
    return absl::Status(CodeForHttpStatus(response.status), std::move(message));
  }
  if (request.range_offset >= 0) {
    const int64_t got = static_cast<int64_t>(response.body.size());
    int64_t total = -1;
    const auto range = response.headers.find("content-range");
    if (range != response.headers.end()) {
      const size_t slash = range->second.rfind('/');
      if (slash != std::string::npos) {
        (void)absl::SimpleAtoi(range->second.substr(slash + 1), &total);
      }
    }
    if (total >= 0 && total < request.range_offset + request.range_length) {
      return absl::OutOfRangeError(absl::StrFormat(
          "%s: bytes %d-%d asked for, but the object has %d bytes", what, request.range_offset,
          request.range_offset + request.range_length - 1, total));
    }
    if (got != request.range_length) {
      return Transient(absl::StrFormat("%s: truncated body, %d of %d bytes", what, got,
                                       request.range_length));
    }
  }
  return response;
}

absl::StatusOr<S3Client::Response> S3Client::Call(const Request& request) {
  const absl::Time deadline = absl::Now() + options_.call_timeout;
  absl::Status last;
  for (int attempt = 1; attempt <= options_.max_attempts; ++attempt) {
    absl::StatusOr<Response> response = Attempt(request, deadline);
    if (response.ok()) return response;
    last = response.status();
    if (!absl::IsUnavailable(last)) return last;
    if (attempt == options_.max_attempts) break;
    const absl::Duration wait = Backoff(options_, attempt - 1);
    if (absl::Now() + wait >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          last.message(), " (gave up after ", attempt, " attempts: the call's ",
          absl::FormatDuration(options_.call_timeout), " deadline)"));
    }
    retries_.fetch_add(1, std::memory_order_relaxed);
    if (options_.log) {
      options_.log(absl::StrCat(last.message(), "; retry ", attempt, " of ",
                                options_.max_attempts - 1, " in ", absl::FormatDuration(wait)));
    }
    absl::SleepFor(wait);
  }
  return absl::UnavailableError(
      absl::StrCat(last.message(), " (gave up after ", options_.max_attempts, " attempts)"));
}

absl::StatusOr<ObjectInfo> S3Client::Head(const std::string& bucket, const std::string& key) {
  Request request = MakeRequest("HEAD", bucket, key);
  request.max_body = options_.max_response_bytes;
  PSTRAIN_ASSIGN_OR_RETURN(Response response, Call(request));
  ObjectInfo info;
  info.key = key;
  const auto length = response.headers.find("content-length");
  if (length == response.headers.end() || !absl::SimpleAtoi(length->second, &info.size) ||
      info.size < 0) {
    return absl::DataLossError(absl::StrCat("S3 HEAD ", Uri(bucket, key),
                                            ": the response has no valid Content-Length"));
  }
  const auto etag = response.headers.find("etag");
  if (etag != response.headers.end()) info.etag = etag->second;
  return info;
}

absl::StatusOr<S3Client::Response> S3Client::RangeResponse(const std::string& bucket,
                                                           const std::string& key, int64_t offset,
                                                           int64_t length,
                                                           const std::string& etag) {
  if (offset < 0 || length < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "S3 GET %s: bad range offset %d length %d", Uri(bucket, key), offset, length));
  }
  Request request = MakeRequest("GET", bucket, key);
  request.range_offset = offset;
  request.range_length = length;
  request.if_match = etag;
  request.max_body = length;
  PSTRAIN_ASSIGN_OR_RETURN(Response response, Call(request));
  bytes_read_.fetch_add(length, std::memory_order_relaxed);
  return response;
}

absl::StatusOr<std::string> S3Client::GetRange(const std::string& bucket, const std::string& key,
                                               int64_t offset, int64_t length,
                                               const std::string& etag) {
  PSTRAIN_ASSIGN_OR_RETURN(Response response, RangeResponse(bucket, key, offset, length, etag));
  return std::move(response.body);
}

std::string ContentMd5OfEtag(absl::string_view etag) {
  absl::ConsumePrefix(&etag, "\"");
  absl::ConsumeSuffix(&etag, "\"");
  if (etag.size() != 32) return "";
  for (char c : etag) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return "";
  }
  return absl::AsciiStrToLower(etag);
}

namespace {

// Under SSE-KMS and SSE-C the ETag is not the MD5 of the bytes.
bool EncryptedWithKeys(const std::map<std::string, std::string>& headers) {
  const auto sse = headers.find("x-amz-server-side-encryption");
  if (sse != headers.end() && absl::StartsWith(sse->second, "aws:kms")) return true;
  return headers.count("x-amz-server-side-encryption-customer-algorithm") > 0;
}

std::string Hex(const unsigned char* digest, unsigned int length) {
  std::string out;
  for (unsigned int i = 0; i < length; ++i) absl::StrAppendFormat(&out, "%02x", digest[i]);
  return out;
}

}  // namespace

absl::StatusOr<std::string> S3Client::Get(const std::string& bucket, const ObjectInfo& info) {
  const std::string expected_md5 = ContentMd5OfEtag(info.etag);
  absl::Status last;
  for (int attempt = 1; attempt <= kWholeReadAttempts; ++attempt) {
    absl::StatusOr<std::string> bytes = GetOnce(bucket, info, expected_md5);
    if (bytes.ok() || !absl::IsDataLoss(bytes.status())) return bytes;
    last = bytes.status();
    retries_.fetch_add(1, std::memory_order_relaxed);
    if (options_.log && attempt < kWholeReadAttempts) {
      options_.log(absl::StrCat(last.message(), "; reading it again (", attempt, " of ",
                                kWholeReadAttempts - 1, ")"));
    }
  }
  return last;
}

absl::StatusOr<std::string> S3Client::GetOnce(const std::string& bucket, const ObjectInfo& info,
                                              const std::string& expected_md5) {
  std::string bytes(info.size, '\0');
  const int64_t ranges = (info.size + options_.range_bytes - 1) / options_.range_bytes;
  std::atomic<int64_t> next{0};
  std::atomic<bool> keyed{false};  // The store encrypts with keys: no MD5 to hold it to.
  // The MD5 is taken range by range in order, by whichever fetching thread
  // finds the next range done and nobody hashing, so it overlaps the network.
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> md5(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  const bool check = !expected_md5.empty() && md5 != nullptr &&
                     EVP_DigestInit_ex(md5.get(), EVP_md5(), nullptr) == 1;
  absl::Mutex mu;
  absl::Status first_error;
  std::vector<char> done(ranges, 0);
  int64_t hashed = 0;
  bool hashing = false;
  auto hash_ready_ranges = [&] {
    for (;;) {
      int64_t r;
      {
        absl::MutexLock lock(&mu);
        if (hashed == ranges || !done[hashed]) {
          hashing = false;
          return;
        }
        r = hashed;
      }
      const int64_t offset = r * options_.range_bytes;
      const int64_t length = std::min(options_.range_bytes, info.size - offset);
      EVP_DigestUpdate(md5.get(), bytes.data() + offset, length);
      absl::MutexLock lock(&mu);
      ++hashed;
    }
  };
  auto fetch = [&] {
    for (int64_t r = next.fetch_add(1); r < ranges; r = next.fetch_add(1)) {
      const int64_t offset = r * options_.range_bytes;
      const int64_t length = std::min(options_.range_bytes, info.size - offset);
      absl::StatusOr<Response> part = RangeResponse(bucket, info.key, offset, length, info.etag);
      if (!part.ok()) {
        absl::MutexLock lock(&mu);
        if (first_error.ok()) first_error = part.status();
        next.store(ranges);  // The others stop at their next range.
        return;
      }
      if (EncryptedWithKeys(part->headers)) keyed.store(true);
      std::copy(part->body.begin(), part->body.end(), bytes.begin() + offset);
      if (!check) continue;
      {
        absl::MutexLock lock(&mu);
        done[r] = 1;
        if (hashing) continue;
        hashing = true;
      }
      hash_ready_ranges();
    }
  };
  const int threads = static_cast<int>(std::min<int64_t>(options_.parallel_ranges, ranges));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(fetch);
  fetch();
  for (std::thread& t : pool) t.join();
  PSTRAIN_RETURN_IF_ERROR(first_error);
  if (check && !keyed.load()) {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int length = 0;
    EVP_DigestFinal_ex(md5.get(), digest, &length);
    const std::string got = Hex(digest, length);
    if (got != expected_md5) {
      return absl::DataLossError(absl::StrCat("S3 GET ", Uri(bucket, info.key), ": the ", info.size,
                                              " bytes read have MD5 ", got, ", not the ETag's ",
                                              expected_md5, " (damaged on the way)"));
    }
  }
  return bytes;
}

absl::Status S3Client::Put(const std::string& bucket, const std::string& key,
                           const std::string& bytes) {
  if (static_cast<int64_t>(bytes.size()) > options_.multipart_threshold) {
    return PutMultipart(bucket, key, bytes);
  }
  Request request = MakeRequest("PUT", bucket, key);
  request.body = &bytes;
  request.max_body = options_.max_response_bytes;
  PSTRAIN_RETURN_IF_ERROR(Call(request).status());
  bytes_written_.fetch_add(static_cast<int64_t>(bytes.size()), std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status S3Client::PutMultipart(const std::string& bucket, const std::string& key,
                                    const std::string& bytes) {
  Request create = MakeRequest("POST", bucket, key, Query({{"uploads", ""}}));
  create.max_body = options_.max_response_bytes;
  PSTRAIN_ASSIGN_OR_RETURN(Response created, Call(create));
  const std::string upload_id = XmlField(created.body, "UploadId");
  if (upload_id.empty()) {
    return absl::DataLossError(absl::StrCat("S3 multipart upload of ", Uri(bucket, key),
                                            ": the store returned no UploadId"));
  }
  auto upload_parts = [&]() -> absl::Status {
    std::string complete = "<CompleteMultipartUpload>";
    const int64_t total = static_cast<int64_t>(bytes.size());
    for (int64_t offset = 0, number = 1; offset < total; offset += options_.part_bytes, ++number) {
      const std::string part = bytes.substr(offset, options_.part_bytes);
      Request put = MakeRequest("PUT", bucket, key,
                  Query({{"partNumber", absl::StrCat(number)}, {"uploadId", upload_id}}));
      put.body = &part;
      put.max_body = options_.max_response_bytes;
      PSTRAIN_ASSIGN_OR_RETURN(Response done, Call(put));
      const auto etag = done.headers.find("etag");
      if (etag == done.headers.end()) {
        return absl::DataLossError(absl::StrCat("S3 multipart upload of ", Uri(bucket, key),
                                                ": part ", number, " came back without an ETag"));
      }
      absl::StrAppend(&complete, "<Part><PartNumber>", number, "</PartNumber><ETag>",
                      XmlEscape(etag->second), "</ETag></Part>");
    }
    absl::StrAppend(&complete, "</CompleteMultipartUpload>");
    Request finish = MakeRequest("POST", bucket, key, Query({{"uploadId", upload_id}}));
    finish.body = &complete;
    finish.max_body = options_.max_response_bytes;
    PSTRAIN_ASSIGN_OR_RETURN(Response finished, Call(finish));
    // S3 may answer 200 and put the error in the body.
    if (absl::StrContains(finished.body, "<Error>")) {
      return absl::InternalError(absl::StrCat("S3 multipart upload of ", Uri(bucket, key),
                                              ": completion failed: ",
                                              XmlField(finished.body, "Code"), " ",
                                              XmlField(finished.body, "Message")));
    }
    return absl::OkStatus();
  };
  absl::Status status = upload_parts();
  if (!status.ok()) {
    Request abort = MakeRequest("DELETE", bucket, key, Query({{"uploadId", upload_id}}));
    abort.max_body = options_.max_response_bytes;
    absl::Status aborted = Call(abort).status();
    if (!aborted.ok() && options_.log) {
      options_.log(absl::StrCat("abandoned multipart upload of ", Uri(bucket, key),
                                " could not be aborted: ", aborted.message()));
    }
    return status;
  }
  bytes_written_.fetch_add(static_cast<int64_t>(bytes.size()), std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ObjectInfo>> S3Client::List(const std::string& bucket,
                                                       const std::string& prefix) {
  std::vector<ObjectInfo> objects;
  std::string token;
  for (int page = 0; page < 100000; ++page) {
    std::vector<std::pair<std::string, std::string>> params = {{"list-type", "2"},
                                                               {"prefix", prefix}};
    if (!token.empty()) params.emplace_back("continuation-token", token);
    Request request = MakeRequest("GET", bucket, "", Query(params));
    request.max_body = options_.max_response_bytes;
    PSTRAIN_ASSIGN_OR_RETURN(Response response, Call(request));
    for (absl::string_view contents : XmlElements(response.body, "Contents")) {
      ObjectInfo info;
      info.key = XmlField(contents, "Key");
      info.etag = XmlField(contents, "ETag");
      if (info.key.empty() || !absl::SimpleAtoi(XmlField(contents, "Size"), &info.size)) {
        return absl::DataLossError(absl::StrCat("S3 LIST ", Uri(bucket, prefix),
                                                ": an entry without a key or a size"));
      }
      objects.push_back(std::move(info));
    }
    if (XmlField(response.body, "IsTruncated") != "true") {
      std::sort(objects.begin(), objects.end(),
                [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
      return objects;
    }
    token = XmlField(response.body, "NextContinuationToken");
    if (token.empty()) {
      return absl::DataLossError(absl::StrCat("S3 LIST ", Uri(bucket, prefix),
                                              ": a truncated page without a continuation token"));
    }
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("S3 LIST ", Uri(bucket, prefix), ": more than 100000 pages"));
}

absl::StatusOr<int> S3Client::AbortIncompleteUploads(const std::string& bucket,
                                                     const std::string& prefix) {
  Request request = MakeRequest("GET", bucket, "", Query({{"prefix", prefix}, {"uploads", ""}}));
  request.max_body = options_.max_response_bytes;
  PSTRAIN_ASSIGN_OR_RETURN(Response response, Call(request));
  int aborted = 0;
  for (absl::string_view upload : XmlElements(response.body, "Upload")) {
    const std::string key = XmlField(upload, "Key");
    const std::string id = XmlField(upload, "UploadId");
    if (key.empty() || id.empty()) continue;
    Request abort = MakeRequest("DELETE", bucket, key, Query({{"uploadId", id}}));
    abort.max_body = options_.max_response_bytes;
    absl::Status status = Call(abort).status();
    if (!status.ok() && !absl::IsNotFound(status)) return status;
    ++aborted;
  }
  return aborted;
}

absl::Status S3Client::Delete(const std::string& bucket, const std::string& key) {
  Request request = MakeRequest("DELETE", bucket, key);
  request.max_body = options_.max_response_bytes;
  absl::StatusOr<Response> response = Call(request);
  if (absl::IsNotFound(response.status())) return absl::OkStatus();
  return response.status();
}

}  // namespace pstrain::storage
