#include "common/storage/storage.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/storage/s3_client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace pstrain::storage {
namespace {

namespace fs = std::filesystem;
using ::pstrain::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::Field;
using ::testing::HasSubstr;

TEST(S3UriTest, ParsesBucketAndKey) {
  ASSERT_OK_AND_ASSIGN(S3Uri a, ParseS3Uri("s3://train-data/fmnist/train-00000-of-00001.pspack"));
  EXPECT_EQ(a.bucket, "train-data");
  EXPECT_EQ(a.key, "fmnist/train-00000-of-00001.pspack");
  ASSERT_OK_AND_ASSIGN(S3Uri b, ParseS3Uri("s3://train-data"));
  EXPECT_EQ(b.key, "");
  ASSERT_OK_AND_ASSIGN(S3Uri c, ParseS3Uri("s3://train-data/dir/"));
  EXPECT_EQ(c.key, "dir/");
  EXPECT_TRUE(IsS3Uri("s3://x"));
  EXPECT_FALSE(IsS3Uri("/data/s3://x"));
}

TEST(S3UriTest, RefusesWhatStoresReadDifferently) {
  for (const char* bad : {"s3://", "s3://ab", "s3://Upper", "s3://under_score/k", "s3://-dash/k",
                          "/local/path"}) {
    EXPECT_THAT(ParseS3Uri(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("")))
        << bad;
  }
  for (const char* bad : {"s3://bucket/a/../b", "s3://bucket/./a", "s3://bucket/a//b",
                          "s3://bucket/a\nb"}) {
    EXPECT_EQ(ParseS3Uri(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseS3Uri(absl::StrCat("s3://bucket/", std::string(1100, 'k'))).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(JoinUriTest, OneSeparator) {
  EXPECT_EQ(JoinUri("s3://b/p", "x"), "s3://b/p/x");
  EXPECT_EQ(JoinUri("s3://b/p/", "x"), "s3://b/p/x");
  EXPECT_EQ(JoinUri("/data", "x"), "/data/x");
}

class LocalStorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/storage_test_", getpid());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(LocalStorageTest, WriteReadListDelete) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> store, OpenStorage({}));
  ASSERT_OK(store->Write(dir_ + "/sub/b.bin", "0123456789"));
  ASSERT_OK(store->Write("file://" + dir_ + "/sub/a.bin", "xy"));
  ASSERT_OK_AND_ASSIGN(std::string all, store->Read(dir_ + "/sub/b.bin"));
  EXPECT_EQ(all, "0123456789");
  ASSERT_OK_AND_ASSIGN(std::string part, store->ReadRange(dir_ + "/sub/b.bin", 3, 4));
  EXPECT_EQ(part, "3456");
  EXPECT_EQ(store->ReadRange(dir_ + "/sub/b.bin", 8, 4).status().code(),
            absl::StatusCode::kOutOfRange);
  ASSERT_OK_AND_ASSIGN(ObjectInfo info, store->Stat(dir_ + "/sub/b.bin"));
  EXPECT_EQ(info.size, 10);
  ASSERT_OK_AND_ASSIGN(std::vector<ObjectInfo> listed, store->List(dir_ + "/sub"));
  EXPECT_THAT(listed, ElementsAre(Field(&ObjectInfo::key, "a.bin"), Field(&ObjectInfo::key, "b.bin")));
  ASSERT_OK(store->Write(dir_ + "/sub/deeper/c.bin", "z"));
  ASSERT_OK_AND_ASSIGN(std::vector<ObjectInfo> below, store->ListRecursive(dir_));
  EXPECT_THAT(below, ElementsAre(Field(&ObjectInfo::key, "sub/a.bin"),
                               Field(&ObjectInfo::key, "sub/b.bin"),
                               Field(&ObjectInfo::key, "sub/deeper/c.bin")));
  ASSERT_OK(store->Delete(dir_ + "/sub/a.bin"));
  ASSERT_OK(store->Delete(dir_ + "/sub/a.bin"));  // Already gone: fine.
  EXPECT_EQ(store->Read(dir_ + "/sub/a.bin").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->List(dir_ + "/none").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(LocalStorageTest, ASmallFileIsReadOnlyWhenItIsSmall) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> store, OpenStorage({}));
  ASSERT_OK(store->Write(dir_ + "/classes.csv", "class,category_id,name\n"));
  ASSERT_OK_AND_ASSIGN(std::string text, ReadAtMost(*store, dir_ + "/classes.csv", 23));
  EXPECT_EQ(text, "class,category_id,name\n");
  EXPECT_THAT(
      ReadAtMost(*store, dir_ + "/classes.csv", 22).status(),
      StatusIs(absl::StatusCode::kDataLoss, HasSubstr("classes.csv: 23 bytes, more than the 22")));
  EXPECT_EQ(ReadAtMost(*store, dir_ + "/missing.csv", 22).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(LocalStorageTest, S3WithoutSettingsAndOtherSchemesSaySo) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> store, OpenStorage({}));
  EXPECT_THAT(store->Read("s3://bucket/key").status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("without S3 settings")));
  EXPECT_THAT(store->Read("hdfs://nn/x").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"hdfs://\"")));
}

TEST(S3ClientTest, AnUnreachableStoreIsRetriedThenUnavailableNamingTheObject) {
  StorageOptions options;
  S3ClientOptions& s3 = options.s3.emplace();
  s3.endpoint.endpoint = "http://127.0.0.1:1";  // Nothing listens on port 1.
  s3.endpoint.path_style = true;
  s3.credentials.access_key_id = "AKIDEXAMPLE";
  s3.credentials.secret_access_key = "do-not-print-me";
  s3.max_attempts = 3;
  s3.backoff_initial = absl::Milliseconds(1);
  s3.backoff_max = absl::Milliseconds(5);
  int retries_logged = 0;
  s3.log = [&](const std::string& line) {
    ++retries_logged;
    EXPECT_THAT(line, ::testing::Not(HasSubstr("do-not-print-me")));
  };
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> store, OpenStorage(options));
  absl::Status status = store->Read("s3://some-bucket/data/x.pspack").status();
  EXPECT_THAT(status, StatusIs(absl::StatusCode::kUnavailable,
                               HasSubstr("S3 HEAD s3://some-bucket/data/x.pspack")));
  EXPECT_THAT(status.message(), HasSubstr("3 attempts"));
  EXPECT_THAT(status.message(), ::testing::Not(HasSubstr("do-not-print-me")));
  EXPECT_EQ(retries_logged, 2);
}

TEST(S3ClientTest, OnlyASinglePartEtagStandsForTheBytesMd5) {
  EXPECT_EQ(ContentMd5OfEtag("\"D41D8CD98F00B204E9800998ECF8427E\""),
            "d41d8cd98f00b204e9800998ecf8427e");
  EXPECT_EQ(ContentMd5OfEtag("d41d8cd98f00b204e9800998ecf8427e"),
            "d41d8cd98f00b204e9800998ecf8427e");
  EXPECT_EQ(ContentMd5OfEtag("\"d41d8cd98f00b204e9800998ecf8427e-3\""), "");
  EXPECT_EQ(ContentMd5OfEtag("\"zz1d8cd98f00b204e9800998ecf8427e\""), "");
  EXPECT_EQ(ContentMd5OfEtag(""), "");
}

// A one-object store over HTTP/1.1 on 127.0.0.1: HEAD and ranged GET of
// `body` under `etag`, one request per connection. The first `damaged_gets`
// GETs have one byte of their body flipped, as a faulty link would.
class OneObjectStore {
 public:
  OneObjectStore(std::string body, std::string etag, int damaged_gets,
                 std::string extra_headers = "")
      : body_(std::move(body)),
        etag_(std::move(etag)),
        extra_headers_(std::move(extra_headers)),
        damaged_left_(damaged_gets) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(addr);
    if (bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listener_, 16) != 0 ||
        getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
      ADD_FAILURE() << "cannot listen on 127.0.0.1";
    }
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~OneObjectStore() {
    stop_.store(true);
    thread_.join();
    close(listener_);
  }
  std::string endpoint() const { return absl::StrCat("http://127.0.0.1:", port_); }
  void SlowDown(int gets) { slowdowns_left_.store(gets); }
  int gets() const { return gets_.load(); }

 private:
  void Serve() {
    while (!stop_.load()) {
      pollfd p{listener_, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      const int fd = accept(listener_, nullptr, nullptr);
      if (fd < 0) continue;
      Answer(fd);
      close(fd);
    }
  }
  void Answer(int fd) {
    std::string request;
    char buffer[4096];
    while (!absl::StrContains(request, "\r\n\r\n") && request.size() < 65536) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 5000) <= 0) return;
      const ssize_t n = read(fd, buffer, sizeof(buffer));
      if (n <= 0) return;
      request.append(buffer, n);
    }
    int64_t first = 0, last = static_cast<int64_t>(body_.size()) - 1;
    for (absl::string_view line : absl::StrSplit(request, "\r\n")) {
      if (absl::ConsumePrefix(&line, "If-Match: ") && line != etag_) {
        const std::string xml =
            "<Error><Code>PreconditionFailed</Code><Message>At least one of the pre-conditions "
            "you specified did not hold</Message></Error>";
        const std::string response =
            absl::StrCat("HTTP/1.1 412 Precondition Failed\r\nContent-Length: ", xml.size(),
                         "\r\nConnection: close\r\n\r\n", xml);
        (void)!write(fd, response.data(), response.size());
        return;
      }
      if (absl::ConsumePrefix(&line, "Range: bytes=")) {
        std::pair<std::string, std::string> range = absl::StrSplit(line, '-');
        EXPECT_TRUE(absl::SimpleAtoi(range.first, &first) && absl::SimpleAtoi(range.second, &last));
      }
    }
    const bool head = absl::StartsWith(request, "HEAD ");
    if (!head && slowdowns_left_.fetch_sub(1) > 0) {
      // S3's answer to too many requests: an XML body larger than a small range.
      const std::string xml = absl::StrCat(
          "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
          "<Message>Please reduce your request rate.</Message><RequestId>",
          std::string(64, '7'), "</RequestId></Error>");
      const std::string response =
          absl::StrCat("HTTP/1.1 503 Slow Down\r\nContent-Length: ", xml.size(),
                       "\r\nConnection: close\r\n\r\n", xml);
      (void)!write(fd, response.data(), response.size());
      return;
    }
    std::string piece = body_.substr(first, last - first + 1);
    if (!head) {
      gets_.fetch_add(1);
      if (damaged_left_.fetch_sub(1) > 0 && !piece.empty()) piece[piece.size() / 2] ^= 0xff;
    }
    std::string response =
        absl::StrCat(head ? "HTTP/1.1 200 OK\r\n" : "HTTP/1.1 206 Partial Content\r\n",
                     "Content-Length: ", head ? body_.size() : piece.size(), "\r\nETag: ", etag_,
                     "\r\n", extra_headers_, "Connection: close\r\n");
    if (!head) {
      absl::StrAppend(&response, "Content-Range: bytes ", first, "-", last, "/", body_.size(),
                      "\r\n");
    }
    absl::StrAppend(&response, "\r\n");
    if (!head) absl::StrAppend(&response, piece);
    for (size_t sent = 0; sent < response.size();) {
      const ssize_t n = write(fd, response.data() + sent, response.size() - sent);
      if (n <= 0) return;
      sent += n;
    }
  }

  const std::string body_, etag_, extra_headers_;
  std::atomic<int> damaged_left_, gets_{0}, slowdowns_left_{0};
  std::atomic<bool> stop_{false};
  int listener_ = -1;
  int port_ = 0;
  std::thread thread_;
};

std::string QuotedMd5(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_md5(), nullptr);
  std::string out = "\"";
  for (unsigned int i = 0; i < length; ++i) absl::StrAppendFormat(&out, "%02x", digest[i]);
  return out + "\"";
}

StorageOptions OptionsFor(const OneObjectStore& store, std::vector<std::string>* log) {
  StorageOptions options;
  S3ClientOptions& s3 = options.s3.emplace();
  s3.endpoint.endpoint = store.endpoint();
  s3.endpoint.path_style = true;
  s3.credentials.access_key_id = "AKIDEXAMPLE";
  s3.credentials.secret_access_key = "secret";
  s3.range_bytes = 1700;  // Three ranges, fetched in parallel and hashed in order.
  s3.log = [log](const std::string& line) { log->push_back(line); };
  return options;
}

std::string CsvOfClasses() {
  std::string csv = "class,category_id,name\n";
  for (int c = 0; c < 200; ++c) absl::StrAppend(&csv, c, ",", 1000010653 + c, ",Class ", c, "\n");
  return csv;
}

TEST(S3ClientTest, BytesDamagedOnTheWayAreReadAgainAndThenAreTheObjects) {
  const std::string csv = CsvOfClasses();
  ASSERT_GT(csv.size(), 2000u);
  OneObjectStore store(csv, QuotedMd5(csv), /*damaged_gets=*/1);
  std::vector<std::string> log;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> s3, OpenStorage(OptionsFor(store, &log)));
  ASSERT_OK_AND_ASSIGN(std::string bytes, s3->Read("s3://bucket/dump/classes.csv"));
  EXPECT_EQ(bytes, csv);
  EXPECT_EQ(store.gets(), 6);  // Three ranges, twice.
  ASSERT_EQ(log.size(), 1u);
  EXPECT_THAT(log[0], HasSubstr("s3://bucket/dump/classes.csv"));
  EXPECT_THAT(log[0], HasSubstr("reading it again"));
}

TEST(S3ClientTest, AnErrorLargerThanASmallRangeIsReadAndRetried) {
  const std::string csv = CsvOfClasses();
  OneObjectStore store(csv, QuotedMd5(csv), /*damaged_gets=*/0);
  store.SlowDown(1);
  std::vector<std::string> log;
  StorageOptions options = OptionsFor(store, &log);
  options.s3->backoff_initial = absl::Milliseconds(1);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> s3, OpenStorage(options));
  ASSERT_OK_AND_ASSIGN(std::string header, s3->ReadRange("s3://bucket/dump/classes.csv", 0, 22));
  EXPECT_EQ(header, "class,category_id,name");
  ASSERT_EQ(log.size(), 1u);
  EXPECT_THAT(log[0], HasSubstr("503 SlowDown"));
}

TEST(S3ClientTest, ARangeHeldToAVersionThatIsGoneIsDataLoss) {
  const std::string csv = CsvOfClasses();
  OneObjectStore store(csv, QuotedMd5(csv), /*damaged_gets=*/0);
  std::vector<std::string> log;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> s3, OpenStorage(OptionsFor(store, &log)));
  ASSERT_OK_AND_ASSIGN(std::string header,
                       s3->ReadRangeOfVersion("s3://bucket/classes.csv", 0, 22, QuotedMd5(csv)));
  EXPECT_EQ(header, "class,category_id,name");
  EXPECT_THAT(
      s3->ReadRangeOfVersion("s3://bucket/classes.csv", 0, 22, QuotedMd5("an older packing")),
      StatusIs(absl::StatusCode::kDataLoss,
               AllOf(HasSubstr("s3://bucket/classes.csv changed while it was read"),
                     HasSubstr("412 PreconditionFailed"))));
}

TEST(S3ClientTest, BytesThatNeverMatchTheirMd5AreDataLoss) {
  const std::string csv = CsvOfClasses();
  OneObjectStore store(csv, QuotedMd5(csv), /*damaged_gets=*/1000);
  std::vector<std::string> log;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> s3, OpenStorage(OptionsFor(store, &log)));
  EXPECT_THAT(s3->Read("s3://bucket/dump/classes.csv").status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("s3://bucket/dump/classes.csv"), HasSubstr("MD5"),
                             HasSubstr(QuotedMd5(csv).substr(1, 32)))));
  EXPECT_EQ(store.gets(), 3 * S3Client::kWholeReadAttempts);
}

TEST(S3ClientTest, AnEtagThatIsNoMd5HoldsTheBytesToNothing) {
  // A multipart upload's ETag, and a KMS-encrypted object's: the bytes come
  // back as served (formats with their own checksums catch damage there).
  const std::string csv = CsvOfClasses();
  std::vector<std::string> log;
  {
    OneObjectStore store(csv, "\"0123456789abcdef0123456789abcdef-2\"", 1);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> s3, OpenStorage(OptionsFor(store, &log)));
    ASSERT_OK_AND_ASSIGN(std::string bytes, s3->Read("s3://bucket/x"));
    EXPECT_NE(bytes, csv);
    EXPECT_EQ(store.gets(), 3);
  }
  {
    OneObjectStore store(csv, "\"0123456789abcdef0123456789abcdef\"", 0,
                         "x-amz-server-side-encryption: aws:kms\r\n");
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> s3, OpenStorage(OptionsFor(store, &log)));
    ASSERT_OK_AND_ASSIGN(std::string bytes, s3->Read("s3://bucket/x"));
    EXPECT_EQ(bytes, csv);
  }
  EXPECT_TRUE(log.empty());
}

}  // namespace
}  // namespace pstrain::storage
