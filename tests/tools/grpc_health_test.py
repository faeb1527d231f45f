#!/usr/bin/env python3
"""Clients we did not write ask pstrain's daemons whether they serve and what.

grpc.health.v1.Health through PyPI's grpcio-health-checking and server
reflection through grpcio-reflection, against real processes:

* pstrain-server (shard 0): "" and pstrain.v1.{Coordinator, ParameterService,
  ShardControl} are SERVING, an unknown service is NOT_FOUND; reflection lists
  Coordinator, ShardControl and the health service (ParameterService runs on
  gRPC's generic API, which ListServices cannot see) and serves each of the
  three services' descriptors by symbol, methods by name.
* pstrain-worker --health-port: "" is SERVING; "pstrain-worker" (readiness)
  becomes SERVING once it registered, NOT_SERVING within seconds of the
  server being killed (kill -9), and SERVING again after a new server starts
  on the same port. That plaintext port serves health alone: reflection
  there is UNIMPLEMENTED.
* a server on SIGTERM: NOT_SERVING before it stops (read through Watch).

  grpc_health_test.py --server build/bin/pstrain-server --worker build/bin/pstrain-worker \\
      --cli build/bin/pstrain [--python build/venv-tools/bin/python3]

The PyPI tools live in <build>/venv-tools (deploy/local/test.sh); when this
interpreter lacks them the script re-runs itself with --python, and fails
with the install command when neither has them.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

DEADLINE_S = 5  # Of every RPC.


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="the pstrain-server binary")
    parser.add_argument("--worker", required=True, help="the pstrain-worker binary")
    parser.add_argument("--cli", required=True, help="the pstrain CLI (its `health` command)")
    parser.add_argument("--python", default="", help="an interpreter with the grpcio tools")
    return parser.parse_args()


def import_tools(args):
    try:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        from google.protobuf import descriptor_pb2
        return grpc, health_pb2, health_pb2_grpc, reflection_pb2, reflection_pb2_grpc, descriptor_pb2
    except ImportError as error:
        other = args.python
        if other and os.path.exists(other) and not os.environ.get("PSTRAIN_HEALTH_TEST_REEXEC"):
            os.environ["PSTRAIN_HEALTH_TEST_REEXEC"] = "1"
            os.execv(other, [other] + sys.argv)
        sys.exit(f"FAIL: cannot import the gRPC test tools ({error}); install them with "
                 "`pip install grpcio-health-checking grpcio-reflection` (deploy/local/test.sh "
                 "does, into <build>/venv-tools)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(message):
    sys.exit(f"FAIL: {message}")


class Daemons:
    """Processes started by the test; all of them are killed at the end."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.procs = []

    def start(self, name, argv):
        log = open(os.path.join(self.workdir, f"{name}.log"), "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop_all(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)

    def log(self, name):
        with open(os.path.join(self.workdir, f"{name}.log"), "rb") as f:
            return f.read().decode(errors="replace")


def main():
    args = parse_args()
    grpc, health_pb2, health_pb2_grpc, reflection_pb2, reflection_pb2_grpc, descriptor_pb2 = (
        import_tools(args))
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    def check(address, service):
        """The status of `service`, or the gRPC status code on an error."""
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                return stub.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=DEADLINE_S).status
            except grpc.RpcError as error:
                return error.code()

    def wait_for(address, service, want, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        got = None
        while time.monotonic() < deadline:
            got = check(address, service)
            if got == want:
                return
            time.sleep(0.2)
        fail(f"{what}: health of {service!r} at {address} is {got}, wanted {want} "
             f"within {timeout_s} s")

    def reflection_services(address):
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            requests = [reflection_pb2.ServerReflectionRequest(list_services="")]
            for response in stub.ServerReflectionInfo(iter(requests), timeout=DEADLINE_S):
                return sorted(s.name for s in response.list_services_response.service)
        return []

    def reflection_methods(address, symbol):
        with grpc.insecure_channel(address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            requests = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)]
            for response in stub.ServerReflectionInfo(iter(requests), timeout=DEADLINE_S):
                if response.HasField("error_response"):
                    fail(f"reflection of {symbol}: {response.error_response.error_message}")
                methods = []
                for raw in response.file_descriptor_response.file_descriptor_proto:
                    proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
                    for service in proto.service:
                        if f"{proto.package}.{service.name}" == symbol:
                            methods += [m.name for m in service.method]
                return methods
        return []

    with tempfile.TemporaryDirectory(prefix="pstrain-health-") as workdir:
        daemons = Daemons(workdir)
        try:
            port = free_port()
            address = f"127.0.0.1:{port}"
            server_argv = [args.server, "--listen", address, "--state-dir",
                           os.path.join(workdir, "state"), "--heartbeat-timeout-ms", "3000"]
            server = daemons.start("server", server_argv)
            wait_for(address, "", serving, 30, "server start")

            print("== server: health per service")
            for service in ("pstrain.v1.Coordinator", "pstrain.v1.ParameterService",
                            "pstrain.v1.ShardControl"):
                status = check(address, service)
                if status != serving:
                    fail(f"server health of {service} is {status}, wanted SERVING")
                print(f"{service}: SERVING")
            # Our own client, `pstrain health`, agrees with PyPI's.
            for argv, want_rc, want_out in (
                    ([address], 0, "SERVING"),
                    ([address, "--service", "pstrain.v1.Coordinator"], 0, "SERVING"),
                    ([address, "--service", "pstrain.v1.NoSuchService"], 1, "NOT_FOUND")):
                run = subprocess.run([args.cli, "health"] + argv, capture_output=True, text=True,
                                     timeout=30)
                if run.returncode != want_rc or want_out not in run.stdout + run.stderr:
                    fail(f"pstrain health {argv}: exit {run.returncode}, {run.stdout}{run.stderr}")
                print(f"pstrain health {' '.join(argv)}: {(run.stdout + run.stderr).strip()}")
            status = check(address, "pstrain.v1.NoSuchService")
            if status != grpc.StatusCode.NOT_FOUND:
                fail(f"an unknown service gave {status}, wanted NOT_FOUND")
            print("pstrain.v1.NoSuchService: NOT_FOUND")

            print("== server: reflection")
            services = reflection_services(address)
            print(services)
            # ParameterService moves tensors as raw byte buffers through gRPC's
            # generic API, which ListServices cannot see; its descriptor is
            # still served by symbol (grpcurl describe works).
            for want in ("grpc.health.v1.Health", "pstrain.v1.Coordinator",
                         "pstrain.v1.ShardControl"):
                if want not in services:
                    fail(f"reflection does not list {want}: {services}")
            for symbol, wanted in (
                    ("pstrain.v1.Coordinator", ("SubmitJob", "Heartbeat", "RegisterWorker")),
                    ("pstrain.v1.ParameterService", ("Push", "Pull")),
                    ("pstrain.v1.ShardControl", ("ConfigureJob",))):
                methods = reflection_methods(address, symbol)
                print(f"{symbol} methods:", methods)
                for want in wanted:
                    if want not in methods:
                        fail(f"reflection's {symbol} has no {want}: {methods}")

            print("== worker: liveness and readiness")
            health_port = free_port()
            health = f"127.0.0.1:{health_port}"
            daemons.start("worker", [args.worker, "--server", address, "--device", "cpu",
                                     "--threads", "1", "--health-port", str(health_port)])
            wait_for(health, "", serving, 30, "worker start")
            wait_for(health, "pstrain-worker", serving, 30, "worker registered")
            print("worker: '' SERVING, 'pstrain-worker' SERVING")
            # The plaintext health port serves health alone: no reflection
            # (issue 43: it used to describe every service to anyone).
            try:
                services = reflection_services(health)
                fail(f"the plaintext health port serves reflection: {services}")
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    fail(f"reflection on the health port gave {error.code()}, wanted UNIMPLEMENTED")
            print("worker's health port: no reflection (UNIMPLEMENTED)")

            server.send_signal(signal.SIGKILL)
            server.wait(timeout=30)
            wait_for(health, "pstrain-worker", not_serving, 20, "server killed")
            run = subprocess.run([args.cli, "health", health, "--service", "pstrain-worker"],
                                 capture_output=True, text=True, timeout=30)
            if run.returncode != 1 or "NOT_SERVING" not in run.stdout:
                fail(f"pstrain health on the worker: exit {run.returncode}, {run.stdout}{run.stderr}")
            if check(health, "") != serving:
                fail("the worker's liveness went down with the server")
            print("server killed: 'pstrain-worker' NOT_SERVING, '' still SERVING")
            server = daemons.start("server", server_argv)
            wait_for(health, "pstrain-worker", serving, 40, "server restarted")
            print("server restarted: 'pstrain-worker' SERVING again")

            print("== server: SIGTERM drains")
            statuses = []
            ready = threading.Event()

            def watch():
                with grpc.insecure_channel(address) as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    try:
                        for response in stub.Watch(
                                health_pb2.HealthCheckRequest(service="pstrain.v1.Coordinator"),
                                timeout=30):
                            statuses.append(response.status)
                            ready.set()
                            if response.status == not_serving:
                                return
                    except grpc.RpcError:
                        pass
                    finally:
                        ready.set()

            watcher = threading.Thread(target=watch)
            watcher.start()
            if not ready.wait(timeout=30):
                fail("Watch gave no first status")
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
            watcher.join(timeout=30)
            print("Watch(pstrain.v1.Coordinator):", statuses)
            if statuses[:1] != [serving] or not_serving not in statuses:
                fail(f"Watch saw {statuses}, wanted SERVING then NOT_SERVING")
        except SystemExit:
            for name in ("server", "worker"):
                try:
                    print(f"--- {name}.log\n{daemons.log(name)[-3000:]}", file=sys.stderr)
                except OSError:
                    pass
            raise
        finally:
            daemons.stop_all()
    print("PASS: grpc health and reflection")


if __name__ == "__main__":
    main()
