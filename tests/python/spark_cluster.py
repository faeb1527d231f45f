"""A real Spark standalone cluster on 127.0.0.1 for the Spark tests.

The Spark twin of cluster.py: one Master and `workers` Workers, started from
the installed pyspark package (PyPI's pyspark is a whole Spark: its directory
has bin/spark-class and jars/, so it is SPARK_HOME), each in its own process
group, on free 127.0.0.1 ports, with logs, work and scratch directories under
`workdir`. session() gives a SparkSession whose driver is this process (and
the JVM PySpark starts for it) and whose executors run Python with `python`
(PYSPARK_PYTHON). stop() ends the session, its driver JVM and every process
group started.

    with SparkStandalone(workdir, python=sys.executable, workers=2) as spark_cluster:
        spark = spark_cluster.session("barrier")
        spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(f).collect()

One session at a time: PySpark allows one SparkContext per process.

Also here: Fashion-MNIST (Debian's dataset-fashion-mnist) written as PNG
files, for tests that read images with Spark (write_fashion_mnist_pngs).
"""

import contextlib
import gzip
import importlib.util
import json
import os
import signal
import struct
import subprocess
import time
import urllib.request
import zlib

from cluster import free_port

START_TIMEOUT_S = 120  # Master up, then every Worker registered.
SESSION_TIMEOUT_S = 120  # A session's executors all registered.
STOP_GRACE_S = 5  # SIGTERM, then SIGKILL.
# Every JVM here (launchers, daemons, driver, executors): C1 only and the
# serial collector start a JVM in about half the time on 2 cores (the cluster
# up in 5 s instead of 10, a session with its executors in 7 s instead of 15),
# and tests run short jobs.
JVM_STARTUP_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


def spark_home():
    """The installed pyspark package's directory (it has bin/spark-class), or
    None when this interpreter has no pyspark."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.origin:
        return None
    home = os.path.dirname(spec.origin)
    return home if os.access(os.path.join(home, "bin", "spark-class"), os.X_OK) else None


class SparkStandalone:
    """A Master and Workers on 127.0.0.1, and at most one session on them.
    Not thread-safe: one thread starts, uses and stops it."""

    def __init__(self, workdir, python, workers=2, cores=1, memory="1g", extra_pythonpath=()):
        self.workdir = os.path.abspath(workdir)
        self.python = python  # The executors' Python (PYSPARK_PYTHON).
        self.num_workers, self.cores, self.memory = workers, cores, memory
        self.extra_pythonpath = list(extra_pythonpath)  # After the driver's PYTHONPATH.
        self.spark_home = spark_home()
        self.master_port, self.master_ui_port = free_port(), free_port()
        self.master_url = f"spark://127.0.0.1:{self.master_port}"
        self.master_ui_url = f"http://127.0.0.1:{self.master_ui_port}"
        self.procs = []  # (name, Popen); each Popen leads its own process group.
        self._session = None
        self._owns_driver = False  # A driver JVM started by session() may be running.

    # --- Life cycle ---

    def start(self):
        """Starts the Master, then the Workers; returns once every Worker is
        ALIVE in the Master's JSON API. Raises RuntimeError (with the logs'
        tails) when that takes over START_TIMEOUT_S or a daemon exits."""
        if self.spark_home is None:
            raise RuntimeError("this interpreter has no pyspark (with bin/spark-class)")
        deadline = time.monotonic() + START_TIMEOUT_S
        self._spawn("master", [
            "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
            "--port", str(self.master_port), "--webui-port", str(self.master_ui_port)])
        self._wait_for("the Master to be ALIVE", deadline,
                       lambda state: state.get("status") == "ALIVE")
        # After the Master: a Worker that finds no Master retries only after
        # 5 to 15 s.
        for w in range(self.num_workers):
            work_dir = os.path.join(self.workdir, f"worker{w}")
            os.makedirs(work_dir, exist_ok=True)
            self._spawn(f"worker{w}", [
                "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                "--cores", str(self.cores), "--memory", self.memory,
                "--webui-port", str(free_port()), "--work-dir", work_dir, self.master_url])
        self._wait_for(f"{self.num_workers} ALIVE workers", deadline,
                       lambda state: self._alive_workers(state) == self.num_workers)
        return self

    def stop(self):
        """Stops the session (and its driver JVM), then SIGTERM to every
        process group started, SIGKILL to those left after STOP_GRACE_S.
        Bounded: about 2 * STOP_GRACE_S plus the session's own stop."""
        self.stop_session()
        self._signal_groups(signal.SIGTERM)
        if not self._wait_groups_gone(STOP_GRACE_S):
            self._signal_groups(signal.SIGKILL)
            self._wait_groups_gone(STOP_GRACE_S)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    # --- Sessions ---

    def session(self, app_name, conf=None, env=None):
        """A SparkSession on this cluster: one executor of `cores` cores per
        Worker, all registered before it returns (a barrier stage needs every
        slot up front). `conf`: more Spark properties, over these; `env`: more
        variables for the executors and their Python workers
        (spark.executorEnv.*). Stops the previous session, if any."""
        from pyspark.sql import SparkSession
        self.stop_session()
        os.makedirs(self.event_log_dir, exist_ok=True)
        # Absolute: executors run in their Worker's work directory.
        driver_path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        pythonpath = [os.path.abspath(p) for p in driver_path + self.extra_pythonpath if p]
        properties = {
            "spark.master": self.master_url,
            "spark.app.name": app_name,
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.port": str(free_port()),
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions": JVM_STARTUP_OPTS,
            "spark.executor.extraJavaOptions": JVM_STARTUP_OPTS,
            "spark.executor.cores": str(self.cores),
            "spark.executor.memory": "512m",
            "spark.cores.max": str(self.num_workers * self.cores),
            # getOrCreate() waits for every executor (at most the waiting
            # time; the check below says which did not come).
            "spark.scheduler.minRegisteredResourcesRatio": "1.0",
            "spark.scheduler.maxRegisteredResourcesWaitingTime": f"{SESSION_TIMEOUT_S}s",
            # One plain JSON-lines file per application (Spark 4's default
            # is a directory of rolled zstd files), for tests to read.
            "spark.eventLog.enabled": "true",
            "spark.eventLog.dir": "file://" + self.event_log_dir,
            "spark.eventLog.compress": "false",
            "spark.eventLog.rolling.enabled": "false",
            "spark.executorEnv.PYSPARK_PYTHON": self.python,
            "spark.executorEnv.PYTHONPATH": os.pathsep.join(pythonpath),
        }
        properties.update({f"spark.executorEnv.{k}": v for k, v in (env or {}).items()})
        properties.update(conf or {})
        builder = SparkSession.builder
        for key, value in properties.items():
            builder = builder.config(key, value)
        # PySpark starts the driver JVM with this process's environment (it
        # takes no other) and the executors' Python is PYSPARK_PYTHON's here
        # (SparkContext reads it once, at its start).
        self._owns_driver = True
        try:
            with _environ(SPARK_HOME=self.spark_home, SPARK_LOCAL_IP="127.0.0.1",
                          SPARK_CONF_DIR=self._conf_dir(), SPARK_LAUNCHER_OPTS=JVM_STARTUP_OPTS,
                          SPARK_LOCAL_DIRS=os.path.join(self.workdir, "local"),
                          PYSPARK_PYTHON=self.python):
                self._session = builder.getOrCreate()
            self._wait_for_executors()
        except BaseException:
            self.stop_session()
            raise
        return self._session

    def stop_session(self):
        """Stops the session, then its driver JVM: PySpark would keep that
        one for the next SparkContext, with the first one's environment."""
        session, self._session = self._session, None
        if not self._owns_driver:
            return
        self._owns_driver = False
        from pyspark import SparkContext
        try:
            if session is not None:
                session.stop()
        finally:
            gateway = SparkContext._gateway
            SparkContext._gateway = SparkContext._jvm = None
            if gateway is not None:
                _stop_gateway(gateway)

    @property
    def ui_url(self):
        """The running application's web UI (http://127.0.0.1:port), or None."""
        return self._session.sparkContext.uiWebUrl if self._session else None

    @property
    def event_log_dir(self):
        return os.path.join(self.workdir, "events")

    def executor_pids(self, app_id=None):
        """Pids of this cluster's executor JVMs (of application `app_id`, else
        of any), for kill -9 tests. A Worker starts its executors in its own
        process group."""
        groups = {proc.pid for name, proc in self.procs if name.startswith("worker")}
        pids = []
        for pid in _pids():
            argv = _cmdline(pid)
            if EXECUTOR_CLASS not in argv:
                continue
            if app_id is not None and _flag(argv, "--app-id") != app_id:
                continue
            with contextlib.suppress(OSError):
                if os.getpgid(pid) in groups:
                    pids.append(pid)
        return sorted(pids)

    # --- Logs ---

    def log(self, name):
        with open(os.path.join(self.workdir, f"{name}.log"), "rb") as f:
            return f.read().decode(errors="replace")

    def logs(self, lines=40):
        """The last `lines` lines of every daemon's log and executor's stderr."""
        out = [(name, self.log(name)) for name, _ in self.procs]
        for w in range(self.num_workers):
            root = os.path.join(self.workdir, f"worker{w}")
            for parent, _, files in sorted(os.walk(root)):
                if "stderr" in files:
                    with open(os.path.join(parent, "stderr"), "rb") as f:
                        out.append((os.path.relpath(parent, self.workdir),
                                    f.read().decode(errors="replace")))
        return "".join(f"---- {name} ----\n" + "\n".join(text.splitlines()[-lines:]) + "\n"
                       for name, text in out)

    # --- Internals ---

    def _conf_dir(self):
        """An empty SPARK_CONF_DIR: no spark-defaults.conf or spark-env.sh of
        the machine's; Spark's default logging (INFO to stderr)."""
        path = os.path.join(self.workdir, "conf")
        os.makedirs(path, exist_ok=True)
        return path

    def _spawn(self, name, args):
        env = dict(os.environ, SPARK_HOME=self.spark_home, SPARK_LOCAL_IP="127.0.0.1",
                   SPARK_CONF_DIR=self._conf_dir(),
                   SPARK_LOCAL_DIRS=os.path.join(self.workdir, "local"),
                   SPARK_DAEMON_MEMORY="256m", SPARK_DAEMON_JAVA_OPTS=JVM_STARTUP_OPTS,
                   SPARK_LAUNCHER_OPTS=JVM_STARTUP_OPTS, PYSPARK_PYTHON=self.python)
        with open(os.path.join(self.workdir, f"{name}.log"), "wb") as log:
            proc = subprocess.Popen([os.path.join(self.spark_home, "bin", "spark-class")] + args,
                                    stdout=log, stderr=subprocess.STDOUT, env=env,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append((name, proc))

    def _master_state(self):
        """The Master's /json/ (workers, applications, status), or None."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.master_ui_url}/json/", timeout=2) as response:
                return json.load(response)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive_workers(state):
        return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")

    def _wait_for(self, what, deadline, done):
        while True:
            state = self._master_state()
            if state is not None and done(state):
                return
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for "
                                       f"{what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {START_TIMEOUT_S} s "
                                   f"(master: {state}):\n{self.logs()}")
            time.sleep(0.2)

    def _wait_for_executors(self):
        """Raises unless every Worker runs an executor of this session."""
        sc = self._session.sparkContext
        deadline = time.monotonic() + SESSION_TIMEOUT_S
        # getExecutorMemoryStatus: the executors' block managers and the driver's.
        while sc._jsc.sc().getExecutorMemoryStatus().size() < self.num_workers + 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the session's {self.num_workers} executors did not "
                                   f"register within {SESSION_TIMEOUT_S} s:\n{self.logs()}")
            time.sleep(0.2)

    def _signal_groups(self, sig):
        for _, proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)

    def _wait_groups_gone(self, timeout_s):
        """True once no process of any group started is left."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = 0
            for _, proc in self.procs:
                proc.poll()  # Reaps the group's leader.
                try:
                    os.killpg(proc.pid, 0)
                    alive += 1
                except ProcessLookupError:
                    pass
            if not alive:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


@contextlib.contextmanager
def _environ(**values):
    """os.environ with `values` set, put back as it was on exit."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _stop_gateway(gateway):
    """Ends PySpark's driver JVM: it exits when its stdin closes."""
    with contextlib.suppress(Exception):
        gateway.shutdown()
    proc = getattr(gateway, "proc", None)
    if proc is None:
        return
    with contextlib.suppress(OSError):
        proc.stdin.close()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_GRACE_S)


def executor_jvm_pid(pid=None):
    """The executor JVM above process `pid` (default: this one), or None: in a
    Spark task, the JVM that runs it (a Python worker is its child, or a
    child of its pyspark.daemon)."""
    pid = pid or os.getpid()
    while pid > 1:
        if EXECUTOR_CLASS in _cmdline(pid):
            return pid
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                # After "(comm)": the state, then the parent's pid.
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None
    return None


def _pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:  # Gone, or not ours to read.
        return []


def _flag(argv, name):
    """The value after `name` in argv, or None."""
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


# --- Fashion-MNIST as PNG files ---


def read_fashion_mnist(split, limit):
    """The first `limit` images of Fashion-MNIST's `split` ("train" or
    "test") from Debian's IDX files: (images, labels), each image 784 bytes
    (28 rows of 28 8-bit gray pixels, row-major)."""
    prefix = {"train": "train", "test": "t10k"}[split]
    with gzip.open(f"{FASHION_MNIST_DIR}/{prefix}-images-idx3-ubyte.gz") as f:
        magic, count, rows, cols = struct.unpack(">IIII", f.read(16))
        if magic != 2051 or (rows, cols) != (28, 28) or limit > count:
            raise ValueError(f"{prefix} images: magic {magic}, {count} of {rows}x{cols}")
        pixels = f.read(limit * rows * cols)
    with gzip.open(f"{FASHION_MNIST_DIR}/{prefix}-labels-idx1-ubyte.gz") as f:
        magic, count = struct.unpack(">II", f.read(8))
        if magic != 2049 or limit > count:
            raise ValueError(f"{prefix} labels: magic {magic}, {count} labels")
        labels = list(f.read(limit))
    size = rows * cols
    return [pixels[i * size:(i + 1) * size] for i in range(limit)], labels


def encode_png_gray8(pixels, width, height):
    """A PNG of 8-bit grayscale `pixels` (row-major bytes), no filtering,
    no timestamp: the same pixels give the same bytes."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    # Bit depth 8, colour type 0 (grayscale), deflate, filter method 0, no interlace.
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    scanlines = b"".join(b"\0" + pixels[y * width:(y + 1) * width] for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(scanlines, 9)) + chunk(b"IEND", b""))


def write_fashion_mnist_pngs(out_dir, split, limit, per_class_dirs=True):
    """Writes the first `limit` images of `split` as out_dir/<label>/<index>.png
    (out_dir/<index>.png without per_class_dirs); returns (paths, labels) in
    index order."""
    images, labels = read_fashion_mnist(split, limit)
    paths = []
    for index, (pixels, label) in enumerate(zip(images, labels)):
        directory = os.path.join(out_dir, str(label)) if per_class_dirs else out_dir
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{index}.png")
        with open(path, "wb") as f:
            f.write(encode_png_gray8(pixels, 28, 28))
        paths.append(path)
    return paths, labels
