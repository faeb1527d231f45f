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

// Matches an absl::Status, absl::StatusOr<T> or grpc::Status whose code is `code` and whose
// message matches `message_matcher`.
MATCHER_P2(StatusIs, code, message_matcher,
           std::string("status code is ") + absl::StatusCodeToString(code)) {
  const absl::Status status = ToStatus(arg);
  *result_listener << "which is " << status;
  return status.code() == code &&
         ::testing::Matches(message_matcher)(std::string(status.message()));
}

}  // namespace pstrain::testing

#define PSTRAIN_STATUS_CONCAT_INNER_(a, b) a##b
#define PSTRAIN_STATUS_CONCAT_(a, b) PSTRAIN_STATUS_CONCAT_INNER_(a, b)

// EXPECT_OK and ASSERT_OK take more context like the gtest assertions:
//   ASSERT_OK(cluster.Start()) << cluster.Logs();
// (the switch keeps a caller's `else` from binding to the macro's `if`).
#define PSTRAIN_CHECK_OK_IMPL_(expr, on_failure)                                       \
  switch (0)                                                                           \
  case 0:                                                                              \
  default:                                                                             \
    if (const ::absl::Status _pstrain_status = ::pstrain::testing::ToStatus(expr);     \
        _pstrain_status.ok()) {                                                        \
    } else /* NOLINT */                                                                \
      on_failure() << #expr << ": " << _pstrain_status << " "

#define EXPECT_OK(expr) PSTRAIN_CHECK_OK_IMPL_(expr, ADD_FAILURE)
#define ASSERT_OK(expr) PSTRAIN_CHECK_OK_IMPL_(expr, GTEST_FAIL)

#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(PSTRAIN_STATUS_CONCAT_(_pstrain_or_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr)                   \
  auto statusor = (expr);                                                 \
  ASSERT_TRUE(statusor.ok()) << #expr << ": " << statusor.status();      \
  lhs = std::move(statusor).value()

#endif  // PSTRAIN_TESTS_TESTING_STATUS_MATCHERS_H_
