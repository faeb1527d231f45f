// Status assertions that print the status's message on failure (instead of
// ASSERT_TRUE(s.ok()), which hides it).
//
//   EXPECT_OK(backend->Synchronize());
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
#include "gtest/gtest.h"

namespace pstrain::testing {

inline const absl::Status& ToStatus(const absl::Status& status) { return status; }
template <typename T>
const absl::Status& ToStatus(const absl::StatusOr<T>& status_or) {
  return status_or.status();
}

// Matches an absl::Status or absl::StatusOr<T> whose code is `code` and whose
// message matches `message_matcher`.
MATCHER_P2(StatusIs, code, message_matcher,
           std::string("status code is ") + absl::StatusCodeToString(code)) {
  const absl::Status& status = ToStatus(arg);
  *result_listener << "which is " << status;
  return status.code() == code &&
         ::testing::Matches(message_matcher)(std::string(status.message()));
}

}  // namespace pstrain::testing

#define PSTRAIN_STATUS_CONCAT_INNER_(a, b) a##b
#define PSTRAIN_STATUS_CONCAT_(a, b) PSTRAIN_STATUS_CONCAT_INNER_(a, b)

#define EXPECT_OK(expr)                                                          \
  do {                                                                           \
    const ::absl::Status _pstrain_status = ::pstrain::testing::ToStatus(expr);   \
    EXPECT_TRUE(_pstrain_status.ok()) << #expr << ": " << _pstrain_status;       \
  } while (0)

#define ASSERT_OK(expr)                                                          \
  do {                                                                           \
    const ::absl::Status _pstrain_status = ::pstrain::testing::ToStatus(expr);   \
    ASSERT_TRUE(_pstrain_status.ok()) << #expr << ": " << _pstrain_status;       \
  } while (0)

#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL_(PSTRAIN_STATUS_CONCAT_(_pstrain_or_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL_(statusor, lhs, expr)                   \
  auto statusor = (expr);                                                 \
  ASSERT_TRUE(statusor.ok()) << #expr << ": " << statusor.status();      \
  lhs = std::move(statusor).value()

#endif  // PSTRAIN_TESTS_TESTING_STATUS_MATCHERS_H_
