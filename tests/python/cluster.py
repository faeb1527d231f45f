"""A real pstrain cluster on 127.0.0.1 for the Python tests.

The Python twin of tests/integration/cluster.h: deploy/local/make-certs.sh
makes a CA, certificates and tokens; one pstrain-server runs with TLS,
required client certificates (mTLS) and per-role tokens; CPU workers
(--device cpu --threads 1) run with the worker certificate and token. Ports
are free ones picked on 127.0.0.1; every process started is killed by stop().

    with LocalCluster(bin_dir, source_dir, workdir, workers=2) as cluster:
        client = pstrain.Client(cluster.address, **cluster.admin_credentials())
"""

import os
import signal
import socket
import subprocess
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, bin_dir, source_dir, workdir, workers=2, server_args=(), worker_args=(),
                 worker_env=None, server_env=None):
        self.bin_dir, self.source_dir, self.workdir = bin_dir, source_dir, workdir
        self.num_workers = workers
        self.server_args = list(server_args)  # More pstrain-server flags.
        self.worker_args = list(worker_args)  # More pstrain-worker flags.
        self.worker_env = dict(worker_env or {})  # More variables for the workers.
        self.server_env = dict(server_env or {})  # More variables for the server.
        self.certs = os.path.join(workdir, "certs")
        self.address = f"127.0.0.1:{free_port()}"
        self.procs = []  # (name, Popen)

    # --- Life cycle ---

    def start(self):
        subprocess.run([os.path.join(self.source_dir, "deploy/local/make-certs.sh"), self.certs],
                       check=True, stdout=subprocess.DEVNULL)
        c = self.certs
        self._server_argv = [
            self._bin("pstrain-server"), "--listen", self.address,
            "--metrics-port", str(free_port()), "--state-dir", os.path.join(self.workdir, "state"),
            "--heartbeat-timeout-ms", "2000", "--heartbeat-interval-ms", "250",
            "--tls-cert", f"{c}/server.pem", "--tls-key", f"{c}/server-key.pem",
            "--tls-ca", f"{c}/ca.pem", "--require-client-cert", "--token-file", f"{c}/tokens"] + self.server_args
        self._spawn("server", self._server_argv, env=dict(os.environ, **self.server_env))
        self.wait_for_log("server", "listening on", 60)
        for w in range(self.num_workers):
            name = f"worker{w}"
            self._spawn(name, [
                self._bin("pstrain-worker"), "--server", self.address,
                "--metrics-port", str(free_port()), "--device", "cpu", "--threads", "1",
                "--tls-ca", f"{c}/ca.pem", "--tls-cert", f"{c}/worker.pem",
                "--tls-key", f"{c}/worker-key.pem", "--require-client-cert",
                "--token-file", f"{c}/worker.token"] + self.worker_args,
                env=dict(os.environ, **self.worker_env))
        for w in range(self.num_workers):
            self.wait_for_log(f"worker{w}", "registered", 60)
        return self

    def stop(self):
        """SIGTERM, then SIGKILL after 10 s, for every process started."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)

    def restart_server(self):
        """kill -9 of the server, then the same server again (same port and
        state directory, its log appended)."""
        procs = dict(self.procs)
        procs["server"].kill()
        procs["server"].wait(timeout=30)
        before = len(self.log("server"))
        self._spawn("server", self._server_argv, append=True,
                    env=dict(os.environ, **self.server_env))
        deadline = time.monotonic() + 60
        while "listening on" not in self.log("server")[before:]:
            if time.monotonic() > deadline or dict(self.procs)["server"].poll() is not None:
                raise RuntimeError(f"the restarted server is not listening:\n{self.logs()}")
            time.sleep(0.1)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    # --- What clients need ---

    def admin_credentials(self):
        """Client keyword arguments for the admin: token file and mTLS."""
        import pstrain
        c = self.certs
        return {"token_file": f"{c}/admin.token",
                "tls": pstrain.TLS(ca=f"{c}/ca.pem", cert=f"{c}/admin.pem",
                                   key=f"{c}/admin-key.pem")}

    def admin_env(self):
        """The CLI's environment variables for the admin (PSTRAIN_*)."""
        c = self.certs
        return {"PSTRAIN_SERVER": self.address, "PSTRAIN_TLS_CA": f"{c}/ca.pem",
                "PSTRAIN_TLS_CERT": f"{c}/admin.pem", "PSTRAIN_TLS_KEY": f"{c}/admin-key.pem",
                "PSTRAIN_TOKEN_FILE": f"{c}/admin.token"}

    def cli(self, *args, timeout=300):
        """Runs the C++ `pstrain` CLI as the admin."""
        env = dict(os.environ, **self.admin_env())
        return subprocess.run([self._bin("pstrain")] + list(args), env=env, capture_output=True,
                              text=True, timeout=timeout)

    # --- Logs ---

    def log(self, name):
        with open(os.path.join(self.workdir, f"{name}.log"), "rb") as f:
            return f.read().decode(errors="replace")

    def logs(self):
        return "".join(f"---- {name} ----\n{self.log(name)}" for name, _ in self.procs)

    def wait_for_log(self, name, pattern, timeout_s):
        deadline = time.monotonic() + timeout_s
        proc = dict(self.procs)[name]
        while time.monotonic() < deadline:
            if pattern in self.log(name):
                return
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}) before printing "
                                   f"{pattern!r}:\n{self.logs()}")
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not print {pattern!r} within {timeout_s} s:\n"
                           f"{self.logs()}")

    def _bin(self, name):
        return os.path.join(self.bin_dir, name)

    def _spawn(self, name, argv, append=False, env=None):
        log = open(os.path.join(self.workdir, f"{name}.log"), "ab" if append else "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        # A name started again replaces its dead process (stop() and logs()
        # see each name once).
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
