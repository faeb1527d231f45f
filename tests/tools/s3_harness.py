#!/usr/bin/env python3
"""A real S3 endpoint for tests: moto's server with IAM authentication on.

Importable module and CLI (Python 3.11, stdlib + boto3 + moto[server]). moto
and boto3 are not in Debian's python3: run this with a venv's interpreter.

As a module:

    from s3_harness import MotoServer
    with MotoServer(log_path="/tmp/moto.log") as s3:
        s3.make_bucket("data")
        s3.upload_dir("fixtures/", "data", "train/")
        print(s3.list_keys("data", "train/"))
        ro = s3.create_restricted_user("data", "train/")   # s3 on data/train/* only
        client = s3.boto3_client()                          # signed with the admin key

As a CLI (what bash integration tests use):

    PY=/tmp/venv-s3/bin/python3
    $PY tests/tools/s3_harness.py serve --env-file "$T/s3.env" --log "$T/moto.log" \\
        [--bucket data] [--restricted-bucket data --restricted-prefix train/] &
    trap 'kill $!' EXIT              # SIGTERM: moto's process group is killed
    while [ ! -s "$T/s3.env" ]; do sleep 0.1; done   # appears once moto is ready
    . "$T/s3.env"                    # AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...
    $PY tests/tools/s3_harness.py mb s3://data
    $PY tests/tools/s3_harness.py upload fixtures/ s3://data/train/
    $PY tests/tools/s3_harness.py ls s3://data/train/

How authentication works (moto 5.x, verified against moto 5.2.6): moto's
settings read INITIAL_NO_AUTH_ACTION_COUNT once at import (default: inf, i.e.
no auth at all). The first N authorizable actions (IAM and S3 API calls;
/moto-api/* endpoints are not counted) run unauthenticated; from then on
every request's SigV4 signature is recomputed with the secret key of the
access key named in Authorization (wrong secret: 403 SignatureDoesNotMatch,
unknown key: 403 InvalidAccessKeyId) and the action is checked against the
user's IAM policies (403 AccessDenied). The bootstrap here takes exactly
BOOTSTRAP_ACTIONS actions (CreateUser, CreatePolicy, AttachUserPolicy,
CreateAccessKey) and then checks that a bogus key is refused; were a future
moto to count differently, it falls back to POST /moto-api/reset-auth "0"
(moto's own switch, which turns enforcement on at once) and logs that.

The admin user's policy allows s3:* and iam:* on everything (iam:* so that
restricted users can be created after auth is on). moto's IAM checks use the
API operation's name as the action (s3:ListObjectsV2, s3:HeadObject,
s3:ListBuckets, ...) where AWS uses s3:ListBucket / s3:GetObject; the
restricted policy lists both spellings. Policy Conditions (s3:prefix on
listing) are not evaluated by moto for S3, so a restricted user may list
the whole bucket (keys only) but read/write only objects under the prefix.

Quirks worth knowing: moto does not check the payload hash against the body,
nor the request time (no RequestTimeTooSkewed); an unsigned bucket listing
gets a 500 (KeyError in moto) rather than a 403. /moto-api/reset-auth is
unauthenticated, so this is a test fixture, never a security boundary.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

DEFAULT_REGION = "us-east-1"
# Unauthenticated actions moto lets through before enforcing auth: exactly the
# bootstrap below (CreateUser, CreatePolicy, AttachUserPolicy, CreateAccessKey).
BOOTSTRAP_ACTIONS = 4
ADMIN_USER = "pstrain-admin"

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the process that started it dies
    (even by SIGKILL), so moto never outlives its harness."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _moto_command() -> list[str]:
    """moto_server next to this interpreter (a venv's bin/), else -m moto.server."""
    candidate = os.path.join(os.path.dirname(sys.executable), "moto_server")
    if os.access(candidate, os.X_OK):
        return [candidate]
    return [sys.executable, "-m", "moto.server"]


def parse_s3_url(url: str) -> tuple[str, str]:
    """s3://bucket/prefix -> ("bucket", "prefix")."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url}")
    return bucket, prefix


# --------------------------------------------------------------------------
# boto3 helpers. Each takes an optional client; without one they use
# boto3_client(), i.e. the AWS_* environment variables (as written by `serve`).


def boto3_client(
    endpoint: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
    service: str = "s3",
    max_attempts: int = 5,
    **config_kwargs,
):
    """A boto3 client for moto: path-style addressing (the endpoint is an IP),
    botocore's "standard" retry mode. Missing arguments come from
    AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        raise RuntimeError("no endpoint: pass one or set AWS_ENDPOINT_URL")
    cfg = dict(
        s3={"addressing_style": "path"},
        retries={"mode": "standard", "max_attempts": max_attempts},
        connect_timeout=5,
        read_timeout=30,
    )
    cfg.update(config_kwargs)
    return boto3.client(
        service,
        endpoint_url=endpoint,
        aws_access_key_id=access_key or os.environ.get("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=secret_key or os.environ.get("AWS_SECRET_ACCESS_KEY"),
        aws_session_token=None,
        region_name=region
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
        or DEFAULT_REGION,
        config=Config(**cfg),
    )


def make_bucket(name: str, client=None) -> None:
    (client or boto3_client()).create_bucket(Bucket=name)


def upload_dir(local_dir: str, bucket: str, prefix: str = "", client=None) -> list[str]:
    """Uploads every regular file under local_dir to s3://bucket/prefix<relpath>
    (a "/" is put between a non-empty prefix and the path). Returns the keys."""
    client = client or boto3_client()
    if not os.path.isdir(local_dir):
        raise NotADirectoryError(local_dir)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    keys = []
    for root, dirs, files in os.walk(local_dir):
        dirs.sort()
        for f in sorted(files):
            path = os.path.join(root, f)
            if not os.path.isfile(path):
                continue
            rel = os.path.relpath(path, local_dir).replace(os.sep, "/")
            key = prefix + rel
            client.upload_file(path, bucket, key)
            keys.append(key)
    return keys


def list_keys(bucket: str, prefix: str = "", client=None) -> list[str]:
    client = client or boto3_client()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(o["Key"] for o in page.get("Contents", []))
    return keys


def restricted_policy(bucket: str, prefix: str, allow_list: bool = True) -> dict:
    """IAM policy: any S3 action on objects under bucket/prefix, listing the
    bucket (moto ignores s3:prefix conditions, so no condition is set), and
    nothing else. Both AWS's and moto's action names are listed."""
    statements = [
        {
            "Sid": "ObjectsUnderPrefix",
            "Effect": "Allow",
            "Action": "s3:*",
            "Resource": f"arn:aws:s3:::{bucket}/{prefix}*",
        }
    ]
    if allow_list:
        statements.append(
            {
                "Sid": "ListBucket",
                "Effect": "Allow",
                "Action": [
                    "s3:ListBucket",  # AWS
                    "s3:ListObjects",  # moto's names
                    "s3:ListObjectsV2",
                    "s3:HeadBucket",
                    "s3:GetBucketLocation",
                ],
                "Resource": f"arn:aws:s3:::{bucket}",
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


class MotoServer:
    """moto's server on 127.0.0.1 with auth enforced, as a context manager.

    After start(): endpoint ("http://127.0.0.1:PORT"), access_key, secret_key
    (the admin user's), region, port, pid. stop() kills moto's process group
    (SIGTERM, then SIGKILL after 5 s); it also runs at interpreter exit, and
    moto gets SIGKILL (PR_SET_PDEATHSIG) if this process dies first.
    moto's stdout/stderr (its request log; no secrets) go to log_path.
    """

    def __init__(
        self,
        log_path: str,
        port: int | None = None,
        host: str = "127.0.0.1",
        region: str = DEFAULT_REGION,
        startup_timeout: float = 20.0,
    ):
        self.log_path = log_path
        self.host = host
        self.region = region
        self.startup_timeout = startup_timeout
        self._fixed_port = port
        self.port: int | None = None
        self.endpoint: str | None = None
        self.access_key: str | None = None
        self.secret_key: str | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._stop_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    # ---- lifecycle

    def __enter__(self) -> "MotoServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "MotoServer":
        atexit.register(self.stop)
        try:
            attempts = 1 if self._fixed_port else 3  # free_port() can race
            for attempt in range(attempts):
                self._spawn(self._fixed_port or free_port(self.host))
                if self._wait_ready():
                    break
                self._kill()
                if attempt + 1 == attempts:
                    raise RuntimeError(
                        f"moto did not answer on {self.endpoint} within "
                        f"{self.startup_timeout:.0f} s; see {self.log_path}:\n{self._log_tail()}"
                    )
            self._bootstrap()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, port: int) -> None:
        self.port = port
        self.endpoint = f"http://{self.host}:{port}"
        env = dict(os.environ)
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(BOOTSTRAP_ACTIONS)
        env["MOTO_PORT"] = str(port)
        env["PYTHONUNBUFFERED"] = "1"
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            env.pop(var, None)  # moto needs none; keep them out of its log
        if self._log is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"--- s3_harness: starting moto on {self.endpoint}\n".encode())
        self.proc = subprocess.Popen(
            _moto_command() + ["-H", self.host, "-p", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # own process group: killpg() gets it all
            preexec_fn=_die_with_parent,
        )

    def _wait_ready(self) -> bool:
        """True once moto answers HTTP; False if it exited or timed out."""
        deadline = time.monotonic() + self.startup_timeout
        url = f"{self.endpoint}/moto-api/data.json"  # not an authorized action
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    r.read()
                return True
            except urllib.error.HTTPError:
                return True  # it answered
            except OSError:
                time.sleep(0.1)
        return False

    def _bootstrap(self) -> None:
        from botocore.exceptions import ClientError

        # Unauthenticated while moto's action count is below BOOTSTRAP_ACTIONS;
        # one attempt per call so that no retry is counted twice.
        iam = boto3_client(self.endpoint, "bootstrap", "bootstrap", self.region,
                           service="iam", max_attempts=1)
        iam.create_user(UserName=ADMIN_USER)
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": ["s3:*", "iam:*"], "Resource": "*"}],
        }
        arn = iam.create_policy(PolicyName=f"{ADMIN_USER}-all",
                                PolicyDocument=json.dumps(policy))["Policy"]["Arn"]
        iam.attach_user_policy(UserName=ADMIN_USER, PolicyArn=arn)
        key = iam.create_access_key(UserName=ADMIN_USER)["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]

        if not self._auth_enforced():
            self._log_line("bootstrap: moto did not enforce auth after "
                           f"{BOOTSTRAP_ACTIONS} actions; POST /moto-api/reset-auth 0")
            req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth",
                                         data=b"0", method="POST")
            with urllib.request.urlopen(req, timeout=5) as r:
                r.read()
            if not self._auth_enforced():
                raise RuntimeError("moto does not enforce authentication")
        # The admin key must work.
        try:
            self.boto3_client(max_attempts=1).list_buckets()
        except ClientError as e:
            raise RuntimeError(f"moto refused the admin key: {e}") from e
        self._log_line(f"bootstrap: auth enforced, admin user {ADMIN_USER} ready")

    def _auth_enforced(self) -> bool:
        from botocore.exceptions import ClientError

        bogus = boto3_client(self.endpoint, "AKIANOTAREALKEY00000", "x" * 40,
                             self.region, max_attempts=1)
        try:
            bogus.list_buckets()
        except ClientError as e:
            return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 403
        return False

    def stop(self) -> None:
        with self._stop_lock:
            self._kill()
            if self._log is not None:
                self._log.close()
                self._log = None
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)  # pgid == pid (start_new_session)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # moto_server may have forked helpers into its group: make sure.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _log_line(self, text: str) -> None:
        if self._log is not None:
            self._log.write(f"--- s3_harness: {text}\n".encode())

    def _log_tail(self, n: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # ---- clients and helpers bound to this server

    def boto3_client(self, service: str = "s3", endpoint: str | None = None, **kw):
        """Signed with the admin key. endpoint overrides (e.g. a fault proxy)."""
        return boto3_client(endpoint or self.endpoint, self.access_key, self.secret_key,
                            self.region, service=service, **kw)

    def make_bucket(self, name: str) -> None:
        make_bucket(name, self.boto3_client())

    def upload_dir(self, local_dir: str, bucket: str, prefix: str = "") -> list[str]:
        return upload_dir(local_dir, bucket, prefix, self.boto3_client())

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        return list_keys(bucket, prefix, self.boto3_client())

    def create_restricted_user(self, bucket: str, prefix: str = "", name: str | None = None,
                               allow_list: bool = True) -> dict:
        """An IAM user whose only permissions are restricted_policy(bucket,
        prefix): requests outside it get 403 AccessDenied. Returns
        {"user", "access_key", "secret_key"}."""
        iam = self.boto3_client("iam", max_attempts=1)
        name = name or f"restricted-{len(iam.list_users()['Users'])}"
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-s3",
                            PolicyDocument=json.dumps(restricted_policy(bucket, prefix, allow_list)))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"user": name, "access_key": key["AccessKeyId"],
                "secret_key": key["SecretAccessKey"]}


# --------------------------------------------------------------------------
# CLI


def _write_env_file(path: str, values: dict[str, str]) -> None:
    """Shell-sourceable, written atomically (rename), mode 0600."""
    lines = [
        "# written by tests/tools/s3_harness.py serve; contains test credentials",
        "unset AWS_SESSION_TOKEN AWS_SECURITY_TOKEN AWS_PROFILE",
    ]
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in values.items()]
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".s3env.", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _cmd_serve(args) -> int:
    # A stale file from an earlier run must not look like "ready".
    try:
        os.unlink(args.env_file)
    except FileNotFoundError:
        pass
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()

    with MotoServer(args.log, port=args.port, startup_timeout=args.startup_timeout) as s3:
        for b in args.bucket:
            s3.make_bucket(b)
        values = {
            "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_ENDPOINT_URL": s3.endpoint,
            "AWS_REGION": s3.region,
            "AWS_DEFAULT_REGION": s3.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "PSTRAIN_S3_ENDPOINT": s3.endpoint,
            "PSTRAIN_S3_PORT": s3.port,
            "PSTRAIN_S3_PID": os.getpid(),  # SIGTERM this one; it stops moto
            "PSTRAIN_S3_MOTO_PID": s3.pid,
        }
        if args.restricted_bucket:
            r = s3.create_restricted_user(args.restricted_bucket, args.restricted_prefix)
            values["PSTRAIN_S3_RESTRICTED_ACCESS_KEY_ID"] = r["access_key"]
            values["PSTRAIN_S3_RESTRICTED_SECRET_ACCESS_KEY"] = r["secret_key"]
            values["PSTRAIN_S3_RESTRICTED_SCOPE"] = (
                f"s3://{args.restricted_bucket}/{args.restricted_prefix}")
        _write_env_file(args.env_file, values)
        print(f"s3_harness: moto ready on {s3.endpoint} (pid {s3.pid}); env in {args.env_file}",
              file=sys.stderr, flush=True)
        rc = 0
        while not stop.wait(0.5):
            if not s3.alive():
                print("s3_harness: moto exited unexpectedly", file=sys.stderr, flush=True)
                rc = 1
                break
            if args.exit_with_parent and os.getppid() != parent:
                print("s3_harness: parent exited; stopping", file=sys.stderr, flush=True)
                break
    print("s3_harness: stopped", file=sys.stderr, flush=True)
    return rc


def _cmd_upload(args) -> int:
    bucket, prefix = parse_s3_url(args.dest)
    keys = upload_dir(args.dir, bucket, prefix)
    print(f"uploaded {len(keys)} files to s3://{bucket}/{prefix}")
    return 0


def _cmd_mb(args) -> int:
    bucket, _ = parse_s3_url(args.url)
    make_bucket(bucket)
    return 0


def _cmd_ls(args) -> int:
    bucket, prefix = parse_s3_url(args.url)
    for k in list_keys(bucket, prefix):
        print(k)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run moto until SIGTERM; write a sourceable env file")
    s.add_argument("--env-file", required=True)
    s.add_argument("--log", required=True, help="moto's log (appended)")
    s.add_argument("--port", type=int, default=None, help="default: a free port")
    s.add_argument("--startup-timeout", type=float, default=20.0)
    s.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    s.add_argument("--restricted-bucket", help="also create a user limited to this bucket...")
    s.add_argument("--restricted-prefix", default="", help="...and this key prefix")
    s.add_argument("--no-exit-with-parent", dest="exit_with_parent", action="store_false",
                   help="keep running when the parent process exits")
    s.set_defaults(func=_cmd_serve)

    u = sub.add_parser("upload", help="upload a directory (AWS_* env vars)")
    u.add_argument("dir")
    u.add_argument("dest", metavar="s3://bucket/prefix")
    u.set_defaults(func=_cmd_upload)

    m = sub.add_parser("mb", help="make a bucket (AWS_* env vars)")
    m.add_argument("url", metavar="s3://bucket")
    m.set_defaults(func=_cmd_mb)

    ls = sub.add_parser("ls", help="list keys (AWS_* env vars)")
    ls.add_argument("url", metavar="s3://bucket/prefix")
    ls.set_defaults(func=_cmd_ls)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
