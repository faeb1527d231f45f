#!/usr/bin/env python3
"""Self-test of s3_harness.py and s3_fault_proxy.py (well under a minute).

    /tmp/venv-s3/bin/python3 tests/tools/s3_harness_selftest.py [--keep]

Needs boto3 and moto[server] in the interpreter that runs it (a venv:
python3 -m venv V && V/bin/pip install 'moto[server]' boto3). Checks:
  * moto with auth on: a wrong secret gets 403 SignatureDoesNotMatch, an
    unknown key 403 InvalidAccessKeyId, the admin key works;
  * a restricted user reads/writes under its prefix and gets 403
    AccessDenied elsewhere;
  * upload_dir / list_keys;
  * through s3_fault_proxy.py with each fault forced on the first requests,
    boto3's retries (botocore's for reset/slowdown, s3transfer's for
    truncated bodies) still yield the exact bytes of a 4 MiB object, for GET
    and for PUT (100-continue) faults, and under random faults by rate;
  * `corrupt` makes the bytes differ in exactly one position (and, when moto
    stores a checksum, botocore's response checksum validation catches it);
  * the proxy reuses client connections and writes the same counters to
    --stats as it prints on SIGTERM.
Exit status 0 when every check passed. Everything started is stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from s3_harness import MotoServer, boto3_client, list_keys  # noqa: E402

PROXY = os.path.join(HERE, "s3_fault_proxy.py")
BUCKET = "selftest"
BIG_KEY = "blobs/big.bin"


class Checks:
    def __init__(self):
        self.failed: list[str] = []
        self.t0 = time.monotonic()

    def __call__(self, ok: bool, what: str, detail: str = "") -> bool:
        tag = "PASS" if ok else "FAIL"
        print(f"[{time.monotonic() - self.t0:5.1f}s] {tag} {what}"
              + (f" ({detail})" if detail else ""), flush=True)
        if not ok:
            self.failed.append(what)
        return ok

    def info(self, what: str) -> None:
        print(f"[{time.monotonic() - self.t0:5.1f}s] INFO {what}", flush=True)


def error_code(fn) -> tuple[int | None, str]:
    """(HTTP status, S3 error code) of a ClientError from fn(), (None, "") if none."""
    from botocore.exceptions import ClientError

    try:
        fn()
    except ClientError as e:
        return (e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
                e.response.get("Error", {}).get("Code", ""))
    return None, ""


class ProxyProc:
    """s3_fault_proxy.py as a subprocess, like a bash test runs it."""

    count = 0
    result: dict | None = None

    def __init__(self, tmp: str, upstream: str, *flags: str):
        ProxyProc.count += 1
        n = ProxyProc.count
        self.port_file = os.path.join(tmp, f"proxy{n}.port")
        self.stats_file = os.path.join(tmp, f"proxy{n}.json")
        self.log_file = os.path.join(tmp, f"proxy{n}.log")
        self.proc = subprocess.Popen(
            [sys.executable, PROXY, "--upstream", upstream, "--port-file", self.port_file,
             "--stats", self.stats_file, "--log", self.log_file, *flags],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + 10
        while not (os.path.exists(self.port_file) and os.path.getsize(self.port_file)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"proxy did not start; see {self.log_file}")
            time.sleep(0.05)
        with open(self.port_file) as f:
            self.endpoint = f"http://127.0.0.1:{int(f.read())}"

    def stop(self) -> dict:
        """SIGTERM; returns the counters it printed. Idempotent."""
        if self.result is not None:
            return self.result
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
        self.result = json.loads(lines[-1]) if lines else {}
        return self.result

    def file_stats(self) -> dict:
        with open(self.stats_file) as f:
            return json.load(f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def download(client, how: str) -> bytes:
    if how == "get_object":  # botocore's retries only
        return client.get_object(Bucket=BUCKET, Key=BIG_KEY)["Body"].read()
    buf = io.BytesIO()  # s3transfer: also retries broken bodies
    client.download_fileobj(BUCKET, BIG_KEY, buf)
    return buf.getvalue()


def run(tmp: str, check: Checks) -> None:
    with MotoServer(log_path=os.path.join(tmp, "moto.log")) as s3:
        check.info(f"moto pid {s3.pid} on {s3.endpoint}")
        admin = s3.boto3_client()

        # --- authentication
        status, code = error_code(lambda: s3.boto3_client(max_attempts=1).list_buckets())
        check(status is None, "admin key is accepted")
        wrong = boto3_client(s3.endpoint, s3.access_key, "x" * 40, max_attempts=1)
        status, code = error_code(lambda: wrong.list_buckets())
        check(status == 403 and code == "SignatureDoesNotMatch",
              "wrong secret key: 403 SignatureDoesNotMatch", f"{status} {code}")
        unknown = boto3_client(s3.endpoint, "AKIAUNKNOWNKEY000000", s3.secret_key, max_attempts=1)
        status, code = error_code(lambda: unknown.list_buckets())
        check(status == 403 and code == "InvalidAccessKeyId",
              "unknown access key: 403 InvalidAccessKeyId", f"{status} {code}")

        # --- bucket, objects, restricted user
        s3.make_bucket(BUCKET)
        admin.put_object(Bucket=BUCKET, Key="allowed/a.txt", Body=b"allowed")
        admin.put_object(Bucket=BUCKET, Key="denied/b.txt", Body=b"denied")
        r = s3.create_restricted_user(BUCKET, "allowed/")
        rc = boto3_client(s3.endpoint, r["access_key"], r["secret_key"], max_attempts=1)
        got = rc.get_object(Bucket=BUCKET, Key="allowed/a.txt")["Body"].read()
        check(got == b"allowed", "restricted user reads under its prefix")
        status, code = error_code(lambda: rc.put_object(Bucket=BUCKET, Key="allowed/c", Body=b"1"))
        check(status is None, "restricted user writes under its prefix", code)
        status, code = error_code(lambda: rc.get_object(Bucket=BUCKET, Key="denied/b.txt"))
        check(status == 403 and code == "AccessDenied",
              "restricted user, GET outside its prefix: 403 AccessDenied", f"{status} {code}")
        status, code = error_code(lambda: rc.put_object(Bucket=BUCKET, Key="denied/x", Body=b"1"))
        check(status == 403 and code == "AccessDenied",
              "restricted user, PUT outside its prefix: 403 AccessDenied", f"{status} {code}")
        status, code = error_code(lambda: rc.create_bucket(Bucket="other-bucket"))
        check(status == 403, "restricted user, CreateBucket: 403", f"{status} {code}")

        # --- upload_dir / list_keys
        src = os.path.join(tmp, "fixture")
        os.makedirs(os.path.join(src, "sub"))
        for rel, size in (("a.bin", 10), ("sub/b.bin", 1000), ("sub/c.bin", 0)):
            with open(os.path.join(src, rel), "wb") as f:
                f.write(os.urandom(size))
        keys = s3.upload_dir(src, BUCKET, "fixture")
        listed = list_keys(BUCKET, "fixture/", client=admin)
        want = ["fixture/a.bin", "fixture/sub/b.bin", "fixture/sub/c.bin"]
        check(keys == want and listed == want, "upload_dir + list_keys", f"{listed}")

        # --- the object the faults are injected on
        data = random.Random(7).randbytes(4 * 1024 * 1024 + 123)
        digest = hashlib.sha256(data).hexdigest()
        admin.put_object(Bucket=BUCKET, Key=BIG_KEY, Body=data)
        check(download(admin, "get_object") == data, "4 MiB object round trip without proxy")

        def same(b: bytes) -> bool:
            return len(b) == len(data) and hashlib.sha256(b).hexdigest() == digest

        # --- each fault forced on the first 2 GETs: retries still give the bytes
        for kind, hows in (("reset", ("get_object", "download_fileobj")),
                           ("slowdown", ("get_object", "download_fileobj")),
                           ("truncate", ("download_fileobj",))):
            for how in hows:
                with ProxyProc(tmp, s3.endpoint, "--first-n-faults", "2",
                               "--fault-kind", kind) as p:
                    client = s3.boto3_client(endpoint=p.endpoint)
                    try:
                        got = download(client, how)
                        err = ""
                    except Exception as e:  # noqa: BLE001 - reported as a failure
                        got, err = b"", f"{type(e).__name__}: {e}"
                    stats = p.stop()
                check(same(got) and stats.get(kind) == 2,
                      f"{kind} x2 on GET, {how} retries to the exact bytes",
                      err or f"{kind}={stats.get(kind)} requests={stats.get('requests')}")

        # --- faults on PUT (Expect: 100-continue bodies)
        for kind in ("slowdown", "reset"):
            with ProxyProc(tmp, s3.endpoint, "--methods", "PUT", "--first-n-faults", "2",
                           "--fault-kind", kind) as p:
                client = s3.boto3_client(endpoint=p.endpoint)
                key = f"blobs/put-{kind}.bin"
                try:
                    client.put_object(Bucket=BUCKET, Key=key, Body=data)
                    err = ""
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"
                stats = p.stop()
            got = admin.get_object(Bucket=BUCKET, Key=key)["Body"].read() if not err else b""
            check(same(got) and stats.get(kind) == 2,
                  f"{kind} x2 on PUT, put_object retries and stores the exact bytes",
                  err or f"{kind}={stats.get(kind)} requests={stats.get('requests')}")

        # --- random faults by rate (seeded)
        with ProxyProc(tmp, s3.endpoint, "--seed", "1", "--reset-rate", "0.1",
                       "--slowdown-rate", "0.1", "--truncate-rate", "0.1") as p:
            client = s3.boto3_client(endpoint=p.endpoint)
            ok = 0
            for _ in range(12):
                try:
                    ok += same(download(client, "download_fileobj"))
                except Exception as e:  # noqa: BLE001
                    check.info(f"download failed: {type(e).__name__}: {e}")
            stats = p.stop()
        check(ok == 12 and stats.get("faults", 0) > 0,
              "12 downloads under 10% reset/slowdown/truncate each: all exact",
              " ".join(f"{k}={stats.get(k)}" for k in
                       ("requests", "reset", "slowdown", "truncate", "connections")))

        # --- corrupt: the bytes differ in exactly one place
        with ProxyProc(tmp, s3.endpoint, "--first-n-faults", "1", "--fault-kind", "corrupt") as p:
            client = s3.boto3_client(endpoint=p.endpoint,
                                     response_checksum_validation="when_required")
            # The proxy corrupts only ranged object reads (206).
            whole = f"bytes=0-{len(data) - 1}"
            got = client.get_object(Bucket=BUCKET, Key=BIG_KEY, Range=whole)["Body"].read()
            again = client.get_object(Bucket=BUCKET, Key=BIG_KEY, Range=whole)["Body"].read()
            stats = p.stop()
        diffs = [i for i in range(min(len(got), len(data))) if got[i] != data[i]] \
            if len(got) == len(data) else None
        check(diffs is not None and len(diffs) == 1 and stats.get("corrupt") == 1,
              "corrupt x1: same length, exactly one byte differs",
              f"differing positions {diffs[:3] if diffs else diffs}")
        check(same(again), "after the corrupt fault the next GET is exact")

        # --- keep-alive and the stats file
        with ProxyProc(tmp, s3.endpoint) as p:
            client = s3.boto3_client(endpoint=p.endpoint)
            for _ in range(4):
                client.head_object(Bucket=BUCKET, Key=BIG_KEY)
                client.get_object(Bucket=BUCKET, Key="allowed/a.txt")["Body"].read()
            time.sleep(0.1)
            from_file = p.file_stats()
            printed = p.stop()
        check(printed.get("requests") == 8 and printed.get("connections") == 1,
              "8 requests through the proxy on one client connection (keep-alive)",
              f"requests={printed.get('requests')} connections={printed.get('connections')}")
        check(from_file == printed, "--stats file matches the counters printed on SIGTERM")

        moto_proc = s3.proc
    check(moto_proc.poll() is not None, "moto stopped with the context manager")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = ap.parse_args()

    # A bound on everything; the context managers still clean up.
    def on_alarm(*_):
        raise TimeoutError("self-test exceeded 120 s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(120)
    tmp = tempfile.mkdtemp(prefix="s3-selftest-")
    check = Checks()
    try:
        run(tmp, check)
    except Exception as e:  # noqa: BLE001
        check(False, f"self-test aborted: {type(e).__name__}: {e}")
    finally:
        signal.alarm(0)
        if args.keep or check.failed:
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    n = len(check.failed)
    print(f"{'OK' if not n else 'FAILED'}: {n} failure(s) in {time.monotonic() - check.t0:.1f} s")
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
