"""pstrain's exceptions: one class per gRPC status code, with the server's message.

Every error a call to the server can end with is a PstrainError subclass that
keeps the gRPC code (`.code`, a grpc.StatusCode) and the server's message
(`.message`); they also derive from the built-in exception a Python caller
would expect (ValueError for a bad request, LookupError for an unknown job,
TimeoutError for a deadline, ConnectionError for an unreachable server,
PermissionError for a refused token).

    try:
        job = client.submit(model, ...)
    except pstrain.InvalidArgumentError as e:   # also a ValueError
        print("bad job:", e.message)

Codes follow the server's rule (proto/pstrain/v1/service.proto): UNAVAILABLE
means retry the call, FAILED_PRECONDITION fix state first, INVALID_ARGUMENT
a bad request, never retried.
"""

import grpc


class PstrainError(Exception):
    """Base of every pstrain error. `code` is a grpc.StatusCode or None."""

    code = None

    def __init__(self, message, code=None, hint=""):
        super().__init__(message + (f" ({hint})" if hint else ""))
        self.message = message
        if code is not None:
            self.code = code
        self.hint = hint


class InvalidArgumentError(PstrainError, ValueError):
    """The request was refused as invalid (INVALID_ARGUMENT); never retried."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidModelError(InvalidArgumentError):
    """A model the server would refuse. The message is the server's own
    (common/model_graph.cc, e.g. "layer 'add1' (add): input 'conv3' has shape
    [64, 8, 8] but input 'pool1' has shape [32, 8, 8]"). `spec` is the
    pstrain.v1.ModelSpec that was refused (None when not known)."""

    spec = None


class NotFoundError(PstrainError, LookupError):
    """Unknown job (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(PstrainError):
    code = grpc.StatusCode.ALREADY_EXISTS


class UnauthenticatedError(PstrainError, PermissionError):
    """No token, or one the server does not know (UNAUTHENTICATED)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(PstrainError, PermissionError):
    """The token is valid but of another role (PERMISSION_DENIED)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPreconditionError(PstrainError):
    """The job is not in a state for this call, e.g. no checkpoint yet
    (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(PstrainError):
    """A server limit was reached, e.g. too many queued jobs (RESOURCE_EXHAUSTED)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class AbortedError(PstrainError):
    code = grpc.StatusCode.ABORTED


class UnavailableError(PstrainError, ConnectionError):
    """The server could not be reached (UNAVAILABLE): retry the call."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(PstrainError, TimeoutError):
    """The call's timeout passed (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(PstrainError):
    code = grpc.StatusCode.CANCELLED


class DataLossError(PstrainError):
    """Corrupt or truncated data, e.g. a checkpoint whose checksum does not match."""

    code = grpc.StatusCode.DATA_LOSS


class InternalError(PstrainError):
    code = grpc.StatusCode.INTERNAL


class UnimplementedError(PstrainError):
    code = grpc.StatusCode.UNIMPLEMENTED


class UnknownError(PstrainError):
    code = grpc.StatusCode.UNKNOWN


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgumentError, NotFoundError, AlreadyExistsError, UnauthenticatedError,
    PermissionDeniedError, FailedPreconditionError, ResourceExhaustedError, AbortedError,
    UnavailableError, DeadlineExceededError, CancelledError, DataLossError, InternalError,
    UnimplementedError, UnknownError)}
# OUT_OF_RANGE is a bad argument as far as a caller is concerned.
_BY_CODE[grpc.StatusCode.OUT_OF_RANGE] = InvalidArgumentError


def error_for(code, message, hint=""):
    """The PstrainError for a gRPC status `code` (a grpc.StatusCode)."""
    cls = _BY_CODE.get(code, UnknownError)
    return cls(message, code=code, hint=hint)


def from_rpc_error(error, server="", timeout_s=None):
    """Turns a grpc.RpcError into the matching PstrainError, with a hint on
    what to check for the codes a user can fix (like the CLI's)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    message = message or str(code)
    hint = ""
    if code == grpc.StatusCode.UNAVAILABLE:
        hint = (f"is pstrain-server running at {server}? With TLS: is its certificate signed by "
                f"the CA given, for the name dialled, and does it need a client certificate?")
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        hint = "the admin token: Client(token_file=...) or PSTRAIN_TOKEN_FILE"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None:
        hint = (f"no answer from {server} within {timeout_s:g} s: is pstrain-server running "
                f"there, and do its certificate and the CA match? (Client(timeout=...))")
    return error_for(code, message, hint)
