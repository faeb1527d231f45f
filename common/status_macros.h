// Status propagation helpers used across pstrain.
//
//   absl::StatusOr<int> Parse(...);
//   absl::Status Use() {
//     PSTRAIN_ASSIGN_OR_RETURN(int v, Parse(...));
//     PSTRAIN_RETURN_IF_ERROR(Check(v));
//     return absl::OkStatus();
//   }
#ifndef PSTRAIN_COMMON_STATUS_MACROS_H_
#define PSTRAIN_COMMON_STATUS_MACROS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define PSTRAIN_STATUS_CONCAT_INNER_(a, b) a##b
#define PSTRAIN_STATUS_CONCAT_(a, b) PSTRAIN_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define PSTRAIN_RETURN_IF_ERROR(expr)                 \
  do {                                                \
    ::absl::Status _pstrain_status = (expr);          \
    if (!_pstrain_status.ok()) return _pstrain_status; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else
// moves the value into `lhs` (which may be a declaration).
#define PSTRAIN_ASSIGN_OR_RETURN(lhs, rexpr) \
  PSTRAIN_ASSIGN_OR_RETURN_IMPL_(PSTRAIN_STATUS_CONCAT_(_pstrain_or_, __LINE__), lhs, rexpr)

#define PSTRAIN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                   \
  if (!tmp.ok()) return tmp.status();                   \
  lhs = std::move(tmp).value()

#endif  // PSTRAIN_COMMON_STATUS_MACROS_H_
