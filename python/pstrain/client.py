"""The client: submit, follow, cancel and download jobs on a pstrain cluster.

    client = pstrain.Client("127.0.0.1:7070", token_file="certs/admin.token",
                            tls=pstrain.TLS(ca="certs/ca.pem", cert="certs/admin.pem",
                                            key="certs/admin-key.pem"))
    job = client.submit(model, dataset=pstrain.datasets.FashionMNIST(),
                        optimizer=pstrain.optimizers.SGD(0.01, momentum=0.9),
                        epochs=10, workers=2, mode="sync")
    job.watch()                         # progress bar, then the final report
    job.metrics().confusion             # numpy [classes, classes]
    ckpt = job.download("model.ckpt")   # pstrain.Checkpoint

It speaks the Coordinator service of proto/pstrain/v1/service.proto like the
`pstrain` CLI (client/cli.cc): TLS with the cluster's CA (and a client
certificate where the server requires one), the admin token as
`authorization: Bearer TOKEN` metadata, a deadline on every call (`timeout`
seconds; unary calls wait for the channel to connect within it), gRPC errors
raised as pstrain.errors exceptions. Defaults come from the CLI's
environment: PSTRAIN_SERVER, PSTRAIN_TOKEN_FILE, PSTRAIN_TLS_CA,
PSTRAIN_TLS_CERT, PSTRAIN_TLS_KEY.

Threads: a Client (its channel) may be shared by threads; a Job is a handle
(job id + client) with no state of its own.
"""

import math
import os
import sys
import threading
import time

import grpc
import numpy as np

from pstrain import errors
from pstrain._proto import job_pb2, service_pb2, service_pb2_grpc
from pstrain.checkpoint import Checkpoint
from pstrain.model import Model

DEFAULT_SERVER = "127.0.0.1:7070"
MODES = {"sync": job_pb2.CONSISTENCY_SYNC, "async": job_pb2.CONSISTENCY_ASYNC,
         "ssp": job_pb2.CONSISTENCY_SSP, "average": job_pb2.CONSISTENCY_AVERAGE}
# Gradient codecs (JobSpec.compression), as `pstrain submit --compression` spells them.
COMPRESSION = {"none": job_pb2.CompressionSpec.COMPRESSION_NONE,
               "fp16": job_pb2.CompressionSpec.COMPRESSION_FP16,
               "bf16": job_pb2.CompressionSpec.COMPRESSION_BF16,
               "topk": job_pb2.CompressionSpec.COMPRESSION_TOPK,
               "onebit": job_pb2.CompressionSpec.COMPRESSION_ONEBIT}
# Training arithmetic on the workers (JobSpec.precision), as `pstrain submit
# --precision` spells it.
PRECISION = {"fp32": job_pb2.PRECISION_FP32, "bf16": job_pb2.PRECISION_BF16,
             "fp16": job_pb2.PRECISION_FP16}
TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
_ROLES = ("admin", "worker", "peer")


# --- Credentials -------------------------------------------------------------------


class TLS:
    """TLS for the client's channel: the CA that signed the server's
    certificate, and this client's certificate and key where the server
    requires one (mTLS). server_name: the name the server's certificate must
    carry when it is not the host dialled."""

    def __init__(self, ca=None, cert=None, key=None, server_name=None):
        if bool(cert) != bool(key):
            raise ValueError("TLS: a client certificate needs its key (cert and key together)")
        self.ca, self.cert, self.key, self.server_name = ca, cert, key, server_name

    @classmethod
    def from_env(cls):
        """From PSTRAIN_TLS_CA/CERT/KEY, as the CLI reads them; None when unset."""
        ca, cert, key = (os.environ.get(f"PSTRAIN_TLS_{k}") for k in ("CA", "CERT", "KEY"))
        if not (ca or cert):
            return None
        return cls(ca=ca, cert=cert, key=key)

    def credentials(self):
        def read(path):
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca),
                                            private_key=read(self.key),
                                            certificate_chain=read(self.cert))

    def __repr__(self):
        return f"<pstrain.TLS ca={self.ca!r} cert={self.cert!r}>"


def read_token_file(path):
    """The token a client sends: the first token in the file (a bare token, or
    the first "ROLE TOKEN" line; '#' starts a comment), as ReadTokenFile in
    common/rpc/security.cc. Errors name the file, never its contents."""
    with open(path) as f:
        text = f.read()
    for line in text.split("\n"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) == 2 and fields[0] in _ROLES:
            return fields[1]
        if len(fields) == 1:
            return fields[0]
        raise errors.InvalidArgumentError(
            f"token file {path}: expected a token or 'ROLE TOKEN' on its first line")
    raise errors.InvalidArgumentError(f"token file {path} holds no token")


# --- What the server says about a job ----------------------------------------------


def _format_duration(seconds):
    if seconds < 0 or not math.isfinite(seconds):
        return "?"
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Metrics:
    """Test-set metrics of a job, merged over every worker's shard.

    accuracy, precision, recall, f1 (macro averages), loss, samples,
    num_classes, confusion (numpy int64 [num_classes, num_classes], row = true
    label, column = prediction), per_class_precision/recall/f1 (numpy),
    class_names (the dataset's names of the classes, or an empty list).
    """

    def __init__(self, proto):
        self.proto = proto
        self.accuracy, self.precision, self.recall = proto.accuracy, proto.precision, proto.recall
        self.f1, self.loss, self.samples = proto.f1, proto.loss, proto.samples
        self.num_classes = k = proto.num_classes
        self.class_names = list(proto.class_names) if len(proto.class_names) == k else []
        if k > 0 and len(proto.confusion) == k * k:
            self.confusion = np.array(proto.confusion, dtype=np.int64).reshape(k, k)
        else:
            self.confusion = np.zeros((k, k), dtype=np.int64)
        tp = np.diag(self.confusion).astype(np.float64)
        columns, rows = self.confusion.sum(axis=0), self.confusion.sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            self.per_class_precision = np.where(columns > 0, tp / np.maximum(columns, 1), 0.0)
            self.per_class_recall = np.where(rows > 0, tp / np.maximum(rows, 1), 0.0)
            both = self.per_class_precision + self.per_class_recall
            self.per_class_f1 = np.where(
                both > 0, 2 * self.per_class_precision * self.per_class_recall /
                np.where(both > 0, both, 1), 0.0)

    def confusion_text(self):
        """The confusion matrix and per-class scores as the CLI prints them."""
        k = self.num_classes
        if k <= 0:
            return ""
        corner = "true\\pred"
        cell = max([len(str(k - 1))] + [len(str(int(c))) for c in self.confusion.flat])
        first = len(corner)
        out = f"{corner:>{first}}" + "".join(f"  {p:>{cell}}" for p in range(k)) + "\n"
        for t in range(k):
            out += f"{t:>{first}}" + "".join(f"  {int(c):>{cell}}" for c in self.confusion[t])
            out += "\n"
        named = len(self.class_names) == k
        out += (f"{'class':>{first}}  {'precision':>9}  {'recall':>9}  {'f1':>9}"
                + ("  name" if named else "") + "\n")
        for c in range(k):
            out += (f"{c:>{first}}  {self.per_class_precision[c]:9.4f}  "
                    f"{self.per_class_recall[c]:9.4f}  {self.per_class_f1[c]:9.4f}"
                    + (f"  {self.class_names[c]}" if named else "") + "\n")
        return out

    def __repr__(self):
        return (f"<pstrain.Metrics accuracy {self.accuracy:.4f} f1 {self.f1:.4f} "
                f"({self.samples} samples)>")


class JobStatus:
    """A job's status (v1.JobStatus) with Python types; `proto` is the message.

    state: "QUEUED", "RUNNING", "SUCCEEDED", "FAILED" or "CANCELLED".
    test: Metrics once the job SUCCEEDED, else None.
    """

    def __init__(self, proto):
        self.proto = proto
        self.job_id, self.name, self.reason = proto.job_id, proto.name, proto.reason
        state = service_pb2.JobState.Name(proto.state)
        self.state = state[len("JOB_STATE_"):] if state.startswith("JOB_STATE_") else state
        self.epoch, self.epochs = proto.epoch, proto.spec.epochs
        self.step, self.total_steps = proto.step, proto.total_steps
        self.loss, self.train_accuracy = proto.loss, proto.train_accuracy
        self.samples_per_sec = proto.samples_per_sec
        self.workers = list(proto.workers)
        self.workers_lost, self.runs = proto.workers_lost, proto.runs
        self.test = Metrics(proto.test) if proto.HasField("test") else None

    @property
    def done(self):
        return self.state in TERMINAL_STATES

    @property
    def succeeded(self):
        return self.state == "SUCCEEDED"

    def progress_line(self, steps_per_sec=0.0):
        """One line of the progress bar (FormatProgressLine in client/cli.cc)."""
        line = f"{self.job_id} {self.state}"
        if self.state == "QUEUED":
            return line + (f": {self.reason}" if self.reason else "")
        line += f"  epoch {min(self.epoch + 1, self.epochs)}/{self.epochs}"
        if self.total_steps > 0:
            width = 20
            fraction = min(max(self.step / self.total_steps, 0.0), 1.0)
            filled = int(fraction * width)
            line += (f"  step {self.step}/{self.total_steps} [{'#' * filled}"
                     f"{'-' * (width - filled)}] {int(fraction * 100):3d}%")
        else:
            line += f"  step {self.step}"
        line += (f"  loss {self.loss:.4f}  acc {self.train_accuracy:.4f}  "
                 f"{self.samples_per_sec:.0f} samples/s")
        if steps_per_sec > 0 and self.total_steps > self.step:
            line += "  ETA " + _format_duration((self.total_steps - self.step) / steps_per_sec)
        if self.proto.stragglers:
            line += "  waiting for " + ", ".join(self.proto.stragglers)
        return line

    def report(self):
        """The final report (FormatFinalReport in client/cli.cc)."""
        out = f"{self.job_id} {self.state}" + (f": {self.reason}" if self.reason else "")
        out += (f"\n  epochs {self.epoch}, steps {self.step}, final loss {self.loss:.4f}, train "
                f"accuracy {self.train_accuracy:.4f}, workers lost {self.workers_lost}\n")
        if self.proto.epoch_samples:
            counts = [f"{e.samples}/{e.expected}" if e.expected > 0 else str(e.samples)
                      for e in self.proto.epoch_samples]
            out += "  samples trained per epoch: " + ", ".join(counts) + "\n"
        if self.runs > 1:
            out += (f"  resumed {self.runs - 1} time{'' if self.runs == 2 else 's'} from a "
                    f"checkpoint, {self.proto.steps_lost} steps trained again\n")
        if self.succeeded and self.test is not None:
            t = self.test
            out += (f"test: accuracy {t.accuracy:.4f}  loss {t.loss:.4f}  precision "
                    f"{t.precision:.4f}  recall {t.recall:.4f}  f1 {t.f1:.4f}  "
                    f"({t.samples} samples)\n") + t.confusion_text()
        return out

    def __repr__(self):
        return f"<pstrain.JobStatus {self.job_id} {self.state} epoch {self.epoch}/{self.epochs}>"


# --- Jobs ----------------------------------------------------------------------------


class _IdleWatchdog:
    """Cancels `call` when kick() was not called for `idle_s` seconds."""

    def __init__(self, call, idle_s):
        self.call, self.idle_s = call, idle_s
        self.fired = False
        self._timer = None
        self.kick()

    def kick(self):
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(self.idle_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self):
        self.fired = True
        self.call.cancel()

    def stop(self):
        if self._timer is not None:
            self._timer.cancel()


class Job:
    """A handle on one job of a Client: its id, and calls about it."""

    def __init__(self, client, job_id):
        self.client = client
        self.id = job_id

    def status(self):
        """The job's JobStatus now (GetJob)."""
        return JobStatus(self.client._unary("GetJob", service_pb2.GetJobRequest(job_id=self.id)))

    def history(self):
        """The job's training history (GetJobHistory): a dict of numpy arrays,
        one entry per recorded point in step order: 'step', 'epoch', 'loss',
        'train_accuracy', 'samples_per_sec' (all workers), 'unix_ms' and 'run'
        (1 = the first run; a resumed run's points follow the kept model).
        `pstrain report JOB -o F.html` draws the same points."""
        reply = self.client._unary("GetJobHistory", service_pb2.GetJobRequest(job_id=self.id))
        points = reply.points
        return {
            "step": np.array([p.step for p in points], dtype=np.int64),
            "epoch": np.array([p.epoch for p in points], dtype=np.int32),
            "loss": np.array([p.loss for p in points], dtype=np.float64),
            "train_accuracy": np.array([p.train_accuracy for p in points], dtype=np.float64),
            "samples_per_sec": np.array([p.samples_per_sec for p in points], dtype=np.float64),
            "unix_ms": np.array([p.unix_ms for p in points], dtype=np.int64),
            "run": np.array([p.run for p in points], dtype=np.int32),
        }

    def metrics(self):
        """The test-set Metrics of a job that SUCCEEDED; FailedPreconditionError
        before (the metrics exist once every worker evaluated its shard)."""
        status = self.status()
        if not status.succeeded or status.test is None:
            raise errors.FailedPreconditionError(
                f"{self.id} is {status.state}: test metrics exist once it SUCCEEDED"
                + (f" ({status.reason})" if status.reason else ""))
        return status.test

    def cancel(self, reason=""):
        """Cancels a queued or running job (a finished one is left as it is).
        reason: shown in its status ("cancelled: ..."; at most 1024 bytes)."""
        response = self.client._unary("CancelJob", service_pb2.CancelJobRequest(
            job_id=self.id, reason=str(reason)[:1024]))
        return JobStatus(response.status)

    def watch(self, progress=True, file=None, timeout=None, min_interval_s=0.5,
              reconnect_limit_s=60.0):
        """Follows the job until it ends and returns its final JobStatus.

        progress: draw the progress bar (epoch, step, loss, accuracy,
        samples/s, ETA) on `file` (stdout), in place on a terminal and one line
        per change otherwise, then the final report. timeout: seconds before
        DeadlineExceededError (None: 24 hours, as the CLI). A broken stream
        (server restart) is reopened for up to reconnect_limit_s.
        """
        out = file if file is not None else sys.stdout
        tty = progress and hasattr(out, "isatty") and out.isatty()
        limit_s = timeout if timeout is not None else 24 * 3600.0
        deadline = time.monotonic() + limit_s
        request = service_pb2.WatchJobRequest(job_id=self.id,
                                              min_interval_ms=int(min_interval_s * 1000))
        first_step, first_time, last_line, drew = -1, 0.0, None, False
        broken_since, backoff = None, 0.2
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise errors.DeadlineExceededError(
                    f"{self.id} did not end within {limit_s:g} s (watch timeout)")
            end = None
            try:
                for proto in self.client._stream("WatchJob", request, remaining):
                    broken_since, backoff = None, 0.2
                    status = JobStatus(proto)
                    if status.done:
                        if drew:
                            out.write("\n")
                        if progress:
                            out.write(status.report())
                            out.flush()
                        return status
                    if not progress:
                        continue
                    now = time.monotonic()
                    if first_step < 0 and status.state == "RUNNING":
                        first_step, first_time = status.step, now
                    rate = ((status.step - first_step) / (now - first_time)
                            if first_step >= 0 and status.step > first_step else 0.0)
                    line = status.progress_line(rate)
                    if tty:
                        out.write("\r" + line + "\033[K")
                        drew = True
                    elif line != last_line:
                        out.write(line + "\n")
                    out.flush()
                    last_line = line
            except (errors.UnavailableError, errors.InternalError, errors.UnknownError,
                    errors.CancelledError) as error:
                end = error
            except errors.DeadlineExceededError:
                if time.monotonic() >= deadline:
                    raise errors.DeadlineExceededError(
                        f"{self.id} did not end within {limit_s:g} s (watch timeout)") from None
                end = "deadline"
            # The stream ended before a terminal state: reconnect.
            now = time.monotonic()
            if broken_since is None:
                broken_since = now
            if now - broken_since > reconnect_limit_s:
                raise errors.UnavailableError(
                    f"gave up reconnecting to {self.client.address} after "
                    f"{reconnect_limit_s:g} s: {end or 'stream ended'}")
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def wait(self, timeout=None):
        """watch() without output: blocks until the job ends, returns its status."""
        return self.watch(progress=False, timeout=timeout)

    def download(self, path=None, timeout=3600.0):
        """The job's latest checkpoint as a pstrain.Checkpoint (DownloadModel).

        With `path`, also saves the file (written to path.tmp, verified, then
        renamed, as `pstrain download -o`). Gives up when no data arrives for
        the client's timeout, or after `timeout` seconds in all.
        FailedPreconditionError before the job's first checkpoint exists.
        """
        request = service_pb2.DownloadModelRequest(job_id=self.id)
        call = self.client._stub.DownloadModel(request, timeout=timeout,
                                               metadata=self.client._metadata,
                                               wait_for_ready=True)
        watchdog = _IdleWatchdog(call, self.client.timeout)
        pieces, written, total = [], 0, -1
        try:
            for chunk in call:
                watchdog.kick()
                if chunk.offset != written:
                    call.cancel()
                    raise errors.DataLossError(f"chunk at offset {chunk.offset} after {written} "
                                               "bytes: the stream is out of order")
                total = chunk.total_bytes
                pieces.append(chunk.data)
                written += len(chunk.data)
        except grpc.RpcError as error:
            if watchdog.fired:
                raise errors.DeadlineExceededError(
                    f"no data from {self.client.address} for {self.client.timeout:g} s "
                    "(Client(timeout=...))") from None
            raise self.client._error(error) from None
        finally:
            watchdog.stop()
        if total < 0 or written != total:
            raise errors.DataLossError(f"received {written} of {total} bytes")
        data = b"".join(pieces)
        checkpoint = Checkpoint.from_bytes(data, source=f"{self.id} from {self.client.address}")
        if path is not None:
            tmp = f"{path}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        return checkpoint

    def __repr__(self):
        return f"<pstrain.Job {self.id} on {self.client.address}>"


# --- The client ------------------------------------------------------------------------


class Client:
    """A connection to a cluster's coordinator (server 0).

    address: "host:port" (default $PSTRAIN_SERVER, else 127.0.0.1:7070).
    token_file: the admin token (default $PSTRAIN_TOKEN_FILE; None: no token).
    tls: a pstrain.TLS, a CA file path (TLS without a client certificate),
      False for plaintext, or None: from PSTRAIN_TLS_CA/CERT/KEY, else plaintext.
    timeout: seconds, the deadline of every unary call (and the idle limit
      of a download).
    """

    def __init__(self, address=None, token_file=None, tls=None, timeout=10.0):
        self.address = address or os.environ.get("PSTRAIN_SERVER") or DEFAULT_SERVER
        self.timeout = float(timeout)
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        token_file = token_file or os.environ.get("PSTRAIN_TOKEN_FILE")
        self._metadata = ()
        if token_file:
            self._metadata = (("authorization", "Bearer " + read_token_file(token_file)),)
        if tls is None:
            tls = TLS.from_env()
        elif isinstance(tls, (str, os.PathLike)):
            tls = TLS(ca=os.fspath(tls))
        elif tls is False:
            tls = None
        self.tls = tls
        options = [("grpc.max_receive_message_length", -1),
                   ("grpc.max_send_message_length", -1),
                   ("grpc.keepalive_time_ms", 20000), ("grpc.keepalive_timeout_ms", 10000),
                   ("grpc.http2.max_pings_without_data", 0),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        if tls is not None:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(self.address, tls.credentials(), options)
        else:
            self._channel = grpc.insecure_channel(self.address, options)
        self._stub = service_pb2_grpc.CoordinatorStub(self._channel)

    # --- Jobs ---

    def submit(self, model, dataset, optimizer, epochs, batch_size=64, workers=1, mode="sync",
               name=None, seed=0, staleness=0, averaging_frequency=0,
               average_optimizer_state=False, compression="none", topk_ratio=0.0,
               min_compress_bytes=None, pull_compression="none", pull_topk_ratio=0.0,
               precision="fp32"):
        """Submits a job and returns its Job. The server validates it: a bad
        job raises InvalidArgumentError with the server's message (a bad model
        cannot get here: a Model is checked when it is made).

        model: a pstrain.Model; dataset: a pstrain.datasets.*; optimizer: a
        pstrain.optimizers.*; mode: "sync", "async", "ssp" (with staleness) or
        "average" (every averaging_frequency local steps; 0 = 5); compression:
        how workers push gradients in sync, async and ssp: "none", "fp16",
        "bf16", "topk" (the largest topk_ratio of each chunk; 0 = 0.01) or
        "onebit" (sign bits and a scale), the last two with error feedback;
        min_compress_bytes: with those two, parameters of fewer F32 bytes go
        whole (None: the server's default, 262144, which keeps small layers
        exact; 0 = compress every parameter);
        pull_compression (sync only; same names, pull_topk_ratio for "topk"):
        how servers send each step's new model, as its change since the last
        step, with what a codec leaves out sent in later steps;
        precision: "fp32", or "bf16" / "fp16" mixed precision on GPU workers
        (fp32 master weights; fp16 with dynamic loss scaling). A worker that
        cannot run it (a CPU, or a GPU without the tensor cores for it) fails
        the job with a reason that says so.
        """
        if not isinstance(model, Model):
            raise TypeError(f"submit: model must be a pstrain.Model, got {type(model).__name__}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if compression not in COMPRESSION:
            raise ValueError(
                f"compression must be one of {', '.join(COMPRESSION)}, got {compression!r}")
        if pull_compression not in COMPRESSION:
            raise ValueError(f"pull_compression must be one of {', '.join(COMPRESSION)}, "
                             f"got {pull_compression!r}")
        if precision not in PRECISION:
            raise ValueError(f"precision must be one of {', '.join(PRECISION)}, got {precision!r}")
        spec = job_pb2.JobSpec(
            name=name if name is not None else model.name, model=model.to_spec(),
            dataset=dataset.to_spec(), optimizer=optimizer.to_spec(), epochs=int(epochs),
            batch_size=int(batch_size), seed=int(seed), workers=int(workers), mode=MODES[mode],
            staleness=int(staleness), averaging_frequency=int(averaging_frequency),
            average_optimizer_state=bool(average_optimizer_state),
            compression=job_pb2.CompressionSpec(method=COMPRESSION[compression],
                                                topk_ratio=float(topk_ratio)),
            pull_compression=job_pb2.CompressionSpec(method=COMPRESSION[pull_compression],
                                                     topk_ratio=float(pull_topk_ratio)),
            precision=PRECISION[precision])
        if min_compress_bytes is not None:  # Unset: the server's default.
            spec.compression.min_compress_bytes = int(min_compress_bytes)
        return self.submit_spec(spec)

    def submit_spec(self, spec):
        """Submits a pstrain.v1.JobSpec as it is (model inline) and returns its Job."""
        response = self._unary("SubmitJob", service_pb2.SubmitJobRequest(spec=spec))
        return Job(self, response.job_id)

    def job(self, job_id):
        """A handle on an existing job (no call is made)."""
        return Job(self, job_id)

    def jobs(self):
        """Every job's JobStatus, newest first."""
        return [JobStatus(s) for s in self._unary("ListJobs", service_pb2.ListJobsRequest()).jobs]

    def workers(self):
        """The registered workers (v1.WorkerStatus messages)."""
        return list(self._unary("ListWorkers", service_pb2.ListWorkersRequest()).workers)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<pstrain.Client {self.address} {'TLS' if self.tls else 'plaintext'}>"

    # --- Calls ---

    def _error(self, error):
        return errors.from_rpc_error(error, self.address, self.timeout)

    def _unary(self, method, request):
        """A unary call with the deadline, the token and wait-for-ready (a call
        made while the channel connects waits for it within the deadline)."""
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout,
                                               metadata=self._metadata, wait_for_ready=True)
        except grpc.RpcError as error:
            raise self._error(error) from None

    def _stream(self, method, request, timeout_s):
        """Yields a server stream's messages; errors raised as pstrain errors."""
        call = getattr(self._stub, method)(request, timeout=timeout_s, metadata=self._metadata,
                                           wait_for_ready=True)
        try:
            for message in call:
                yield message
        except grpc.RpcError as error:
            raise self._error(error) from None
        finally:
            call.cancel()
