"""gRPC status codes become pstrain exceptions; token files read as the C++
client reads them; every call has a deadline. (The errors a real server
gives are checked in test_journey.py.)"""

import time

import grpc
import pytest

import pstrain
from pstrain import errors

from cluster import free_port

EXPECTED = {
    grpc.StatusCode.INVALID_ARGUMENT: (pstrain.InvalidArgumentError, ValueError),
    grpc.StatusCode.OUT_OF_RANGE: (pstrain.InvalidArgumentError, ValueError),
    grpc.StatusCode.NOT_FOUND: (pstrain.NotFoundError, LookupError),
    grpc.StatusCode.UNAUTHENTICATED: (pstrain.UnauthenticatedError, PermissionError),
    grpc.StatusCode.PERMISSION_DENIED: (pstrain.PermissionDeniedError, PermissionError),
    grpc.StatusCode.FAILED_PRECONDITION: (pstrain.FailedPreconditionError, pstrain.PstrainError),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (pstrain.ResourceExhaustedError, pstrain.PstrainError),
    grpc.StatusCode.ABORTED: (pstrain.AbortedError, pstrain.PstrainError),
    grpc.StatusCode.UNAVAILABLE: (pstrain.UnavailableError, ConnectionError),
    grpc.StatusCode.DEADLINE_EXCEEDED: (pstrain.DeadlineExceededError, TimeoutError),
    grpc.StatusCode.DATA_LOSS: (pstrain.DataLossError, pstrain.PstrainError),
    grpc.StatusCode.INTERNAL: (pstrain.InternalError, pstrain.PstrainError),
    grpc.StatusCode.UNKNOWN: (errors.UnknownError, pstrain.PstrainError),
}


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code", sorted(EXPECTED, key=lambda c: c.value[0]), ids=lambda c: c.name)
def test_codes_map_to_exceptions(code):
    error = errors.from_rpc_error(FakeRpcError(code, "what the server said"), "127.0.0.1:1", 3)
    cls, builtin = EXPECTED[code]
    assert type(error) is cls
    assert isinstance(error, builtin) and isinstance(error, pstrain.PstrainError)
    assert error.code == code
    assert error.message == "what the server said"
    assert str(error).startswith("what the server said")


def test_every_code_maps_to_a_pstrain_error():
    for code in grpc.StatusCode:
        if code != grpc.StatusCode.OK:
            assert isinstance(errors.from_rpc_error(FakeRpcError(code, "x")), pstrain.PstrainError)


def test_hints_say_what_to_check():
    unavailable = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "refused"),
                                        "10.0.0.1:7070")
    assert "is pstrain-server running at 10.0.0.1:7070" in str(unavailable)
    unauthenticated = errors.from_rpc_error(
        FakeRpcError(grpc.StatusCode.UNAUTHENTICATED, "no token"), "x")
    assert "PSTRAIN_TOKEN_FILE" in str(unauthenticated)
    assert unauthenticated.message == "no token"


@pytest.mark.parametrize("text,token", [
    ("abcdef0123456789abcdef\n", "abcdef0123456789abcdef"),
    ("# the admin's\n\nadmin 0123456789abcdef0123\nworker ffffffffffffffffffff\n",
     "0123456789abcdef0123"),
    ("  peer\tfeedfeedfeedfeedfeed  \n", "feedfeedfeedfeedfeed"),
])
def test_token_file(tmp_path, text, token):
    path = tmp_path / "token"
    path.write_text(text)
    assert pstrain.read_token_file(str(path)) == token


@pytest.mark.parametrize("text,message", [
    ("# nothing\n\n", "holds no token"),
    ("root s3cretvalue_s3cretvalue\n", "expected a token or 'ROLE TOKEN'"),
])
def test_bad_token_file(tmp_path, text, message):
    path = tmp_path / "token"
    path.write_text(text)
    with pytest.raises(pstrain.InvalidArgumentError, match=message) as raised:
        pstrain.read_token_file(str(path))
    assert "s3cret" not in str(raised.value)  # Errors never show a file's contents.


def test_tls_needs_cert_and_key_together():
    with pytest.raises(ValueError, match="cert and key together"):
        pstrain.TLS(ca="ca.pem", cert="admin.pem")


def test_calls_have_a_deadline():
    # Nothing listens there: the call waits for the channel within its
    # deadline, then gives up.
    client = pstrain.Client(f"127.0.0.1:{free_port()}", tls=False, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(pstrain.DeadlineExceededError) as raised:
        client.job("job-1").status()
    assert 0.9 < time.monotonic() - start < 10
    assert "within 1 s" in str(raised.value)
    with pytest.raises(ValueError, match="timeout"):
        pstrain.Client("127.0.0.1:1", tls=False, timeout=0)
