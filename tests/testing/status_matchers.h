// Status assertions that print the status's message on failure (instead of
// ASSERT_TRUE(s.ok()), which hides it).
//
//   EXPECT_OK(backend->Synchronize());
//   ASSERT_OK(cluster.Start()) << cluster.Logs();   // more context, as gtest's
//   ASSERT_OK_AND_ASSIGN(std::unique_ptr<Backend> b, CreateBackend(spec));
//   EXPECT_THAT(LoadBackendModule(path).status(),
//               StatusIs(absl::StatusCode::kNotFound, HasSubstr("does not exist")));
#ifndef PSTRAIN_TESTS_TESTING_STATUS_MATCHERS_H_
#define PSTRAIN_TESTS_TESTING_STATUS_MATCHERS_H_

#include <ostream>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "google/protobuf/stubs/status.h"
#include "grpcpp/support/status.h"
#include "gtest/gtest.h"

namespace pstrain::testing {

inline const absl::Status& ToStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& ToStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}
// A gRPC status, with its code and message, for the service tests.
inline absl::Status ToStatus(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

// Protobuf's own status (google::protobuf::util::JsonStringToMessage's).
inline absl::Status ToStatus(const google::protobuf::util::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.code()),
                      std::string(status.message()));
}

// Matches an absl::Status, absl::StatusOr<T> or grpc::Status whose code is `code` and whose
// message matches `message_matcher`.
MATCHER_P2(StatusIs, code, message_matcher,
           std::string("status code is ") + absl::StatusCodeToString(code)) {
  const absl::Status status = ToStatus(arg);
  *result_listener << "which is " << status;
  return status.code() == code &&
         ::testing::Matches(message_matcher)(std::string(status.message()));
}

// What EXPECT_OK and ASSERT_OK test: true when the status is OK.
struct OkCheck {
  absl::Status status;
  explicit operator bool() const { return status.ok(); }
};

}  // namespace pstrain::testing

#define PSTRAIN_STATUS_CONCAT_INNER_(a, b) a##b
#define PSTRAIN_STATUS_CONCAT_(a, b) PSTRAIN_STATUS_CONCAT_INNER_(a, b)

// EXPECT_OK and ASSERT_OK take more context like the gtest assertions:
//   ASSERT_OK(cluster.Start()) << cluster.Logs();
// They are built as gtest builds ASSERT_TRUE (an else-blocker, then an `if`
// on a declaration). Like it, under `if` they want braces (gcc's
// -Wdangling-else).
#define PSTRAIN_CHECK_OK_IMPL_(expr, on_failure)                                      \
  GTEST_AMBIGUOUS_ELSE_BLOCKER_                                                       \
  if (const ::pstrain::testing::OkCheck _pstrain_check{::pstrain::testing::ToStatus(expr)}) \
    ;                                                                                 \
  else                                                                                \
    on_failure() << #expr << ": " << _pstrain_check.status << " "

#define EXPECT_OK(expr) PSTRAIN_CHECK_OK_IMPL_(expr, ADD_FAILURE)
#define ASSERT_OK(expr) PSTRAIN_CHECK_OK_IMPL_(expr, GTEST_FAIL)

#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(PSTRAIN_STATUS_CONCAT_(_pstrain_or_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr)                   \
  auto statusor = (expr);                                                 \
  ASSERT_TRUE(statusor.ok()) << #expr << ": " << statusor.status();      \
  lhs = std::move(statusor).value()

#endif  // PSTRAIN_TESTS_TESTING_STATUS_MATCHERS_H_
