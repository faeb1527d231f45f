#!/usr/bin/env python3
"""A fault-injecting HTTP/1.1 reverse proxy in front of an S3 endpoint (moto).

Stdlib only; plain HTTP/1.1 (no TLS, no CONNECT). Clients point their S3
endpoint at the proxy. Requests go upstream byte for byte: request line and
headers exactly as the client sent them (Host included, so SigV4 signatures
stay valid), bodies framed by Content-Length or chunked. Each request goes
upstream over a new connection. Upstream's interim "100 Continue" responses
are relayed as they come, so "Expect: 100-continue" uploads work (werkzeug
sends two; HTTP clients skip the extra one). Responses come back byte for
byte unless a fault says otherwise, except that moto's "Connection: close"
(werkzeug sends it on every response) is dropped from length-delimited
responses so that client connections are kept alive and reused
(--no-client-keep-alive passes it through: one request per connection).
A client connection ends when the client asks, after reset, slowdown and
truncate faults, after --client-timeout idle seconds, and on errors.

Faults, for requests whose method is in --methods (default GET):
  reset     read the request, then close the client socket with SO_LINGER 0
            (an RST), without a response; nothing goes upstream.
  slowdown  answer 503 with S3's SlowDown XML error (Connection: close);
            nothing goes upstream.
  truncate  forward; send upstream's response head (original Content-Length)
            and only --truncate-fraction of its body, then close. Needs a
            Content-Length body of >= 1 byte, else it counts as not_applicable
            and the response passes intact.
  corrupt   forward; flip all bits of one byte (position from the RNG) of a
            206 (ranged object read) response body with a Content-Length,
            keeping the length. Only object bytes: a reader can hold those to
            checksums of its own (pstrain's packed records), while a listing's
            XML has none (on a real store TLS guards it), so it passes intact.
The first --first-n-faults eligible requests get a fault (--fault-kind, or one
drawn from the kinds with a non-zero rate, weighted by rate); after that each
eligible request gets a fault with the given rates, drawn from an RNG seeded
with --seed (deterministic for a given order of requests).

Counters go as JSON to --stats, rewritten atomically after every request,
and to stdout on SIGTERM/SIGINT/SIGHUP: connections, rejected_connections
(over --max-connections), requests, eligible (method matched), forwarded
(sent upstream, truncated/corrupted ones included), reset, slowdown,
truncate, corrupt, faults (their sum), delayed (--delay-ms), not_applicable, client_errors,
upstream_errors, get_body_bytes (bodies of GETs answered 200/206 and not truncated). The listening port goes to --port-file (atomically, once
listening). The proxy also stops when its parent process exits (unless
--no-exit-with-parent). No headers or query strings are logged.

Example (after `. s3.env` from s3_harness.py serve):

    PY=/tmp/venv-s3/bin/python3
    $PY tests/tools/s3_fault_proxy.py --upstream "$AWS_ENDPOINT_URL" \\
        --port-file "$T/proxy.port" --stats "$T/proxy.json" --log "$T/proxy.log" \\
        --seed 1 --reset-rate 0.05 --slowdown-rate 0.05 --truncate-rate 0.05 &
    PROXY=$!; trap 'kill $PROXY' EXIT
    while [ ! -s "$T/proxy.port" ]; do sleep 0.1; done
    export AWS_ENDPOINT_URL="http://127.0.0.1:$(cat "$T/proxy.port")"
    # deterministic: the first 3 GETs are reset, then everything passes
    $PY tests/tools/s3_fault_proxy.py --upstream ... --first-n-faults 3 --fault-kind reset
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.parse

FAULT_KINDS = ("reset", "slowdown", "truncate", "corrupt")
MAX_HEAD_BYTES = 64 * 1024
CHUNK = 64 * 1024

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>FAULTPROXY0000000</RequestId><HostId>s3-fault-proxy</HostId></Error>"
)


class ProtocolError(Exception):
    pass


class UpstreamError(Exception):
    pass


class Log:
    def __init__(self, path: str | None, verbose: bool):
        self.f = open(path, "a", buffering=1) if path else sys.stderr
        self.verbose = verbose
        self.lock = threading.Lock()

    def __call__(self, msg: str, always: bool = True) -> None:
        if always or self.verbose:
            with self.lock:
                self.f.write(f"{time.strftime('%H:%M:%S')} s3_fault_proxy: {msg}\n")
                self.f.flush()


class Stats:
    """Counters, written atomically as JSON to a file after every request."""

    KEYS = ("connections", "rejected_connections", "requests", "eligible", "forwarded",
            *FAULT_KINDS, "faults", "delayed", "not_applicable", "client_errors",
            "upstream_errors", "get_body_bytes")

    def __init__(self, path: str | None):
        self.path = path
        self.counts = {k: 0 for k in self.KEYS}
        self.lock = threading.Lock()
        self.write()

    def add(self, key: str, n: int = 1, write: bool = False) -> None:
        with self.lock:
            self.counts[key] += n
            if key in FAULT_KINDS:
                self.counts["faults"] += n
        if write:
            self.write()

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.counts)

    def write(self) -> None:
        if not self.path:
            return
        with self.lock:  # serialises writers too
            data = json.dumps(self.counts, sort_keys=True) + "\n"
            d = os.path.dirname(os.path.abspath(self.path))
            fd, tmp = tempfile.mkstemp(prefix=".stats.", dir=d)
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, self.path)


class FaultPlan:
    """Decides per request which fault (if any) to inject."""

    def __init__(self, rates: dict[str, float], methods: set[str], first_n: int,
                 fault_kind: str | None, seed: int):
        self.rates = rates
        self.methods = methods
        self.forced_left = first_n
        self.fault_kind = fault_kind
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        if sum(rates.values()) > 1.0:
            raise ValueError("fault rates add up to more than 1")
        if first_n > 0 and not fault_kind and not any(rates.values()):
            raise ValueError("--first-n-faults needs --fault-kind or a non-zero rate")

    def choose(self, method: str) -> str | None:
        if method not in self.methods:
            return None
        with self.lock:
            if self.forced_left > 0:
                self.forced_left -= 1
                if self.fault_kind:
                    return self.fault_kind
                kinds = [k for k in FAULT_KINDS if self.rates[k] > 0]
                return self.rng.choices(kinds, weights=[self.rates[k] for k in kinds])[0]
            r = self.rng.random()
            acc = 0.0
            for k in FAULT_KINDS:
                acc += self.rates[k]
                if r < acc:
                    return k
            return None

    def randrange(self, n: int) -> int:
        with self.lock:
            return self.rng.randrange(n)


# --------------------------------------------------------------------------
# HTTP/1.1 message reading (raw bytes kept for byte-exact forwarding)


class Head:
    """A request or response head: raw bytes, first line, headers (lower-case
    names, values stripped; repeated headers keep the last)."""

    def __init__(self, raw: bytes):
        self.raw = raw
        lines = raw.decode("latin-1").split("\r\n")
        self.first = lines[0]
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError("malformed header line")
            self.headers[name.strip().lower()] = value.strip()

    def get(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    def has_token(self, name: str, token: str) -> bool:
        return token in [t.strip().lower() for t in self.get(name).split(",")]

    def content_length(self) -> int | None:
        v = self.get("content-length")
        if not v:
            return None
        if not v.isdigit():
            raise ProtocolError("bad Content-Length")
        return int(v)

    def chunked(self) -> bool:
        return self.has_token("transfer-encoding", "chunked")


def read_head(f) -> Head | None:
    """Reads up to and including the blank line. None on a clean EOF before
    the first byte (the peer closed an idle keep-alive connection)."""
    buf = bytearray()
    while True:
        line = f.readline(MAX_HEAD_BYTES + 1)
        if not line:
            if not buf:
                return None
            raise ProtocolError("EOF inside a message head")
        if not buf and line in (b"\r\n", b"\n"):
            continue  # tolerated stray CRLF between messages (RFC 9112 2.2)
        buf += line
        if len(buf) > MAX_HEAD_BYTES:
            raise ProtocolError("message head too large")
        if line in (b"\r\n", b"\n"):
            return Head(bytes(buf))


def drop_connection_close(raw: bytes) -> bytes:
    """A response head without its "Connection: close" header line(s)."""
    lines = raw.split(b"\r\n")
    kept = [ln for ln in lines
            if not (ln.split(b":", 1)[0].strip().lower() == b"connection"
                    and b"close" in ln.lower())]
    return b"\r\n".join(kept)


def copy_exact(src, n: int, sink) -> None:
    """Copies exactly n bytes from file src to sink(bytes)."""
    while n > 0:
        data = src.read(min(CHUNK, n))
        if not data:
            raise ProtocolError("EOF inside a body")
        sink(data)
        n -= len(data)


def copy_chunked(src, sink) -> None:
    """Copies a chunked body (chunks and trailers) raw, up to its end."""
    while True:
        line = src.readline(1024)
        if not line.endswith(b"\n"):
            raise ProtocolError("bad chunk-size line")
        sink(line)
        size = int(line.split(b";")[0].strip() or b"x", 16)
        if size == 0:
            while True:  # trailers, then the final blank line
                t = src.readline(MAX_HEAD_BYTES)
                if not t:
                    raise ProtocolError("EOF in trailers")
                sink(t)
                if t in (b"\r\n", b"\n"):
                    return
        copy_exact(src, size, sink)
        crlf = src.readline(3)
        if crlf not in (b"\r\n", b"\n"):
            raise ProtocolError("bad chunk terminator")
        sink(crlf)


def copy_body(src, head: Head, sink) -> None:
    """A request body by its framing (no framing = no body)."""
    if head.chunked():
        copy_chunked(src, sink)
    else:
        copy_exact(src, head.content_length() or 0, sink)


class Conn:
    """A socket and its buffered reader. (A socket with an open makefile()
    keeps its descriptor until both are closed, hence this pair.)"""

    def __init__(self, sock: socket.socket, timeout: float):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        self.sock = sock
        self.file = sock.makefile("rb")
        self.sendall = sock.sendall

    def close(self) -> None:
        for c in (self.file, self.sock):
            try:
                c.close()
            except OSError:
                pass

    def reset(self) -> None:
        """Close with SO_LINGER 0: the peer gets an RST, not a FIN."""
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        self.close()

    def graceful_close(self) -> None:
        """FIN, then drain briefly so the peer can read what was sent."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(1.0)
            end = time.monotonic() + 1.0
            while time.monotonic() < end and self.sock.recv(CHUNK):
                pass
        except OSError:
            pass
        self.close()


# --------------------------------------------------------------------------


class Proxy:
    def __init__(self, args, log: Log, stats: Stats, plan: FaultPlan):
        u = urllib.parse.urlsplit(args.upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError("--upstream must be http://host:port")
        self.upstream = (u.hostname, u.port or 80)
        self.args = args
        self.log = log
        self.stats = stats
        self.plan = plan
        self.slots = threading.BoundedSemaphore(args.max_connections)
        self.stop = threading.Event()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((args.host, args.port))
        self.sock.listen(128)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]

    def serve(self) -> None:
        parent = os.getppid()
        while not self.stop.is_set():
            if self.args.exit_with_parent and os.getppid() != parent:
                self.log("parent exited; stopping")
                break
            try:
                csock, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self.stop.is_set():
                    break
                raise
            if not self.slots.acquire(blocking=False):
                self.stats.add("rejected_connections", write=True)
                self.log("too many connections; closing a new one")
                csock.close()
                continue
            self.stats.add("connections")
            threading.Thread(target=self._client, args=(csock,), daemon=True).start()
        self.sock.close()

    def _client(self, sock: socket.socket) -> None:
        client = None
        try:
            client = Conn(sock, self.args.client_timeout)
            keep = True
            while keep and not self.stop.is_set():
                try:
                    head = read_head(client.file)
                except (OSError, ProtocolError):
                    break  # idle timeout or the client went away between requests
                if head is None:
                    break
                try:
                    keep = self._request(client, head)
                except (OSError, ProtocolError, ValueError) as e:
                    self.stats.add("client_errors", write=True)
                    self.log(f"{head.first.split(' ')[0]}: client connection dropped: "
                             f"{type(e).__name__}: {e}", always=False)
                    keep = False
        except OSError:
            pass
        finally:
            if client is not None:
                client.close()  # idempotent; faults may have closed it already
            else:
                sock.close()
            self.slots.release()

    def _request(self, client: Conn, head: Head) -> bool:
        """Handles one request; True if the client connection may be reused."""
        parts = head.first.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise ProtocolError("bad request line")
        method, target, version = parts
        path = target.split("?", 1)[0]
        if head.chunked() and head.get("content-length"):
            raise ProtocolError("both Content-Length and chunked")
        client_close = head.has_token("connection", "close") or (
            version == "HTTP/1.0" and not head.has_token("connection", "keep-alive"))
        expect_continue = head.has_token("expect", "100-continue")

        self.stats.add("requests")
        if method in self.plan.methods:
            self.stats.add("eligible")
        kind = self.plan.choose(method)

        if kind == "reset":
            self.stats.add("reset", write=True)
            self.log(f"reset {method} {path}")
            client.reset()
            return False
        if kind == "slowdown":
            if not expect_continue:
                copy_body(client.file, head, lambda b: None)  # the client sends it anyway
            self.stats.add("slowdown", write=True)
            self.log(f"slowdown {method} {path}")
            client.sendall(
                b"HTTP/1.1 503 Slow Down\r\n"
                b"Content-Type: application/xml\r\n"
                b"x-amz-request-id: FAULTPROXY0000000\r\n"
                + f"Content-Length: {len(SLOWDOWN_BODY)}\r\n".encode()
                + b"Connection: close\r\n\r\n" + SLOWDOWN_BODY)
            client.graceful_close()
            return False
        if method in self.args.delay_methods and self.args.delay_ms > 0:
            # A slow store: the request waits before it goes upstream (tests
            # use it to kill a writer while its upload is in flight).
            self.stats.add("delayed", write=True)
            self.log(f"delay {method} {target}: {self.args.delay_ms} ms")
            time.sleep(self.args.delay_ms / 1000)
        return self._forward(client, head, method, path, kind, client_close, expect_continue)

    def _forward(self, client: Conn, head: Head, method: str, path: str, kind: str | None,
                 client_close: bool, expect_continue: bool) -> bool:
        try:
            upstream = Conn(socket.create_connection(self.upstream,
                                                     timeout=self.args.upstream_timeout),
                            self.args.upstream_timeout)
        except OSError as e:
            self.stats.add("upstream_errors", write=True)
            self.log(f"{method} {path}: upstream connect failed: {e}")
            client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n"
                          b"Connection: close\r\n\r\n")
            return False
        body_done = threading.Event()
        body_error: list[BaseException] = []
        pump = None
        resp: Head | None = None
        try:
            ufile = upstream.file
            upstream.sendall(head.raw)
            has_body = head.chunked() or (head.content_length() or 0) > 0

            def pump_body():
                try:
                    copy_body(client.file, head, upstream.sendall)
                except BaseException as e:  # noqa: BLE001 - reported below
                    body_error.append(e)
                finally:
                    body_done.set()

            if not has_body:
                body_done.set()
            elif expect_continue:
                # The client waits for upstream's 100 Continue (relayed below)
                # before it sends the body: pump concurrently.
                pump = threading.Thread(target=pump_body, daemon=True)
                pump.start()
            else:
                pump_body()
                if body_error:
                    raise body_error[0]

            while True:  # interim 1xx responses are relayed as they come
                try:
                    resp = read_head(ufile)
                except (OSError, ProtocolError) as e:
                    raise UpstreamError(str(e)) from e
                if resp is None:
                    raise UpstreamError("upstream closed without a response")
                try:
                    status = int(resp.first.split(" ")[1])
                except (IndexError, ValueError):
                    raise UpstreamError("bad status line") from None
                if status >= 200 or status == 101:
                    break
                client.sendall(resp.raw)

            self.stats.add("forwarded")
            no_body = method == "HEAD" or status in (204, 304) or 100 <= status < 200
            length = None if no_body else resp.content_length()
            if method == "GET" and length and status in (200, 206) and kind != "truncate":
                self.stats.add("get_body_bytes", length)
            chunked = not no_body and resp.chunked()
            until_close = not no_body and not chunked and length is None
            # moto (werkzeug) closes after every response. With --client-keep-alive
            # its "Connection: close" is dropped from a length-delimited response,
            # provided the request body has been read in full, so the client's
            # connection is reused. Response headers are not signed.
            may_reuse = (body_done.is_set() and not client_close and not until_close
                         and not resp.first.startswith("HTTP/1.0"))
            out_head = resp.raw
            if may_reuse and self.args.client_keep_alive:
                out_head = drop_connection_close(resp.raw)
            reusable = may_reuse and not Head(out_head).has_token("connection", "close")

            if kind == "truncate" and length:
                keep_bytes = int(length * self.args.truncate_fraction)
                keep_bytes = min(max(keep_bytes, 0), length - 1)
                client.sendall(out_head)
                copy_exact(ufile, keep_bytes, client.sendall)
                self.stats.add("truncate", write=True)
                self.log(f"truncate {method} {path}: {keep_bytes} of {length} body bytes")
                client.close()
                return False
            if kind == "corrupt" and length and status == 206:
                pos = self.plan.randrange(length)
                sent = 0
                client.sendall(out_head)

                def sink(data: bytes) -> None:
                    nonlocal sent
                    if sent <= pos < sent + len(data):
                        b = bytearray(data)
                        b[pos - sent] ^= 0xFF
                        data = bytes(b)
                    sent += len(data)
                    client.sendall(data)

                copy_exact(ufile, length, sink)
                self.stats.add("corrupt")
                self.log(f"corrupt {method} {path}: byte {pos} of {length}")
            else:
                if kind in ("truncate", "corrupt"):
                    self.stats.add("not_applicable")
                    self.log(f"{kind} not applicable to {method} {path} (status {status}, "
                             f"length {length}); passed intact")
                client.sendall(out_head)
                if no_body:
                    pass
                elif chunked:
                    copy_chunked(ufile, client.sendall)
                elif length is not None:
                    copy_exact(ufile, length, client.sendall)
                else:
                    while True:  # delimited by upstream closing
                        data = ufile.read1(CHUNK)
                        if not data:
                            break
                        client.sendall(data)
            self.log(f"{method} {path}{' (100-continue)' if expect_continue else ''} -> {status}",
                     always=False)

            return reusable and not body_error
        except UpstreamError as e:
            self.stats.add("upstream_errors", write=True)
            self.log(f"{method} {path}: upstream error: {e}")
            if resp is None:  # nothing sent to the client yet
                client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n"
                               b"Connection: close\r\n\r\n")
            return False
        finally:
            upstream.close()
            self.stats.write()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="http://127.0.0.1:PORT (moto)")
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=int, default=0, help="listen port (0: a free one)")
    p.add_argument("--port-file", help="write the listening port here, once listening")
    p.add_argument("--stats", help="JSON counters, rewritten after every request")
    p.add_argument("--log", help="log file (default: stderr)")
    p.add_argument("--verbose", action="store_true", help="log every request, not just faults")
    p.add_argument("--seed", type=int, default=1)
    for k in FAULT_KINDS:
        p.add_argument(f"--{k}-rate", type=float, default=0.0, metavar="P")
    p.add_argument("--methods", default="GET",
                   help="comma-separated methods faults apply to (e.g. GET,PUT,POST)")
    p.add_argument("--first-n-faults", type=int, default=0, metavar="N",
                   help="inject a fault into each of the first N eligible requests")
    p.add_argument("--fault-kind", choices=FAULT_KINDS,
                   help="the kind for --first-n-faults (default: drawn by rate)")
    p.add_argument("--truncate-fraction", type=float, default=0.5,
                   help="share of the body a truncated response keeps (at most length-1)")
    p.add_argument("--no-client-keep-alive", dest="client_keep_alive", action="store_false",
                   help="pass upstream's \"Connection: close\" through (moto sends it on "
                        "every response), so every client connection serves one request")
    p.add_argument("--no-exit-with-parent", dest="exit_with_parent", action="store_false",
                   help="keep running when the parent process exits")
    p.add_argument("--delay-ms", type=int, default=0,
                   help="hold each request of --delay-methods this long before forwarding it "
                        "(counted as 'delayed')")
    p.add_argument("--delay-methods", default="PUT,POST",
                   type=lambda v: {m.strip().upper() for m in v.split(",") if m.strip()},
                   help="methods --delay-ms applies to")
    p.add_argument("--max-connections", type=int, default=128)
    p.add_argument("--client-timeout", type=float, default=60.0,
                   help="socket timeout on client connections (idle keep-alive included)")
    p.add_argument("--upstream-timeout", type=float, default=60.0)
    args = p.parse_args(argv)

    log = Log(args.log, args.verbose)
    stats = Stats(args.stats)
    plan = FaultPlan({k: getattr(args, f"{k}_rate") for k in FAULT_KINDS},
                     {m.strip().upper() for m in args.methods.split(",") if m.strip()},
                     args.first_n_faults, args.fault_kind, args.seed)
    proxy = Proxy(args, log, stats, plan)

    def on_signal(*_):
        proxy.stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)

    if args.port_file:
        d = os.path.dirname(os.path.abspath(args.port_file))
        fd, tmp = tempfile.mkstemp(prefix=".port.", dir=d)
        with os.fdopen(fd, "w") as f:
            f.write(f"{proxy.port}\n")
        os.replace(tmp, args.port_file)
    log(f"listening on {args.host}:{proxy.port} -> {args.upstream}; methods "
        f"{sorted(plan.methods)}, seed {args.seed}, first {args.first_n_faults} "
        f"{args.fault_kind or 'by rate'}, rates "
        + ", ".join(f"{k} {plan.rates[k]}" for k in FAULT_KINDS))
    proxy.serve()
    stats.write()
    print(json.dumps(stats.snapshot(), sort_keys=True), flush=True)
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
