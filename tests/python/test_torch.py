"""pstrain.torch end to end: the user's own PyTorch model trained through a
real server (TLS, mTLS, tokens) by worker processes bound to the job, on
real Fashion-MNIST images (examples/torch/train_fmnist.py).

A job whose model is external is submitted with its framework and no
tensors; each worker process joins it (pst.init), declares the module's
tensors (the first declaration gives the initial values), waits for the
job to start, and trains its batches of the server's epoch plan.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster import LocalCluster

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch


def submit_external(cluster, workers, mode="sync", epochs=1, batch_size=32, lr=0.05,
                    momentum=0.9, seed=7):
    import pstrain
    from pstrain._proto import job_pb2
    client = pstrain.Client(cluster.address, **cluster.admin_credentials())
    modes = {"sync": job_pb2.CONSISTENCY_SYNC, "async": job_pb2.CONSISTENCY_ASYNC,
             "ssp": job_pb2.CONSISTENCY_SSP, "average": job_pb2.CONSISTENCY_AVERAGE}
    spec = job_pb2.JobSpec(
        name=f"torch-{mode}", external_model=job_pb2.ExternalModel(framework="torch"),
        optimizer=job_pb2.OptimizerSpec(type=job_pb2.OPTIMIZER_SGD, learning_rate=lr,
                                        momentum=momentum),
        epochs=epochs, batch_size=batch_size, seed=seed, workers=workers, mode=modes[mode],
        staleness=2, averaging_frequency=4)
    return client, client.submit_spec(spec)


def credentials_file(cluster, workdir):
    c = cluster.certs
    path = os.path.join(workdir, "worker-credentials.json")
    with open(path, "w") as f:
        json.dump({"tls_ca": f"{c}/ca.pem", "tls_cert": f"{c}/worker.pem",
                   "tls_key": f"{c}/worker-key.pem", "token_file": f"{c}/worker.token"}, f)
    return path


def start_workers(cluster, job, workdir, n, args, mode="sync", env=None):
    script = os.path.join(cluster.source_dir, "examples/torch/train_fmnist.py")
    env = dict(os.environ, PSTRAIN_SERVER=cluster.address, PSTRAIN_JOB=job.id,
               PSTRAIN_CREDENTIALS=credentials_file(cluster, workdir), PSTRAIN_MODE=mode,
               OMP_NUM_THREADS="1", **(env or {}))
    procs = []
    for i in range(n):
        log = open(os.path.join(workdir, f"torch-{i}.log"), "wb")
        procs.append(subprocess.Popen([sys.executable, script] + args, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
        log.close()
    return procs


def wait_all(procs, workdir, timeout):
    logs = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        with open(os.path.join(workdir, f"torch-{i}.log"), errors="replace") as f:
            logs.append(f.read())
    return [p.returncode for p in procs], "\n".join(
        f"---- torch worker {i} ----\n{log}" for i, log in enumerate(logs))


def read_records(record, ranks):
    """What train_fmnist.py --record wrote: every sample index trained (over
    the ranks, in order) and each rank's test accuracy."""
    seen, accuracies = [], []
    for rank in range(ranks):
        with open(record / f"batches-{rank}.json") as f:
            data = json.load(f)
        seen += [i for b in data["batches"] for i in b]
        accuracies.append(data["accuracy"])
    return seen, accuracies


@pytest.mark.parametrize("staging", ["", "always"])
def test_one_worker_sync_equals_single_process_pytorch(bin_dir, source_dir, fashion_mnist,
                                                        tmp_path, staging):
    """One worker in sync mode with SGD and momentum: after every step the
    server applies the gradient, so the final weights are those of plain
    PyTorch (torch.optim.SGD, same momentum) from the same initial weights
    over the same batches, to 1e-6 relative. With PSTRAIN_TORCH_STAGING=always
    every tensor goes through its own host buffer, as a CUDA tensor does (the
    copies and their order; no GPU here)."""
    sys.path.insert(0, os.path.join(source_dir, "examples/torch"))
    import train_fmnist
    record = tmp_path / "record"
    with LocalCluster(bin_dir, source_dir, str(tmp_path), workers=0) as cluster:
        client, job = submit_external(cluster, workers=1, lr=0.05, momentum=0.9)
        procs = start_workers(cluster, job, str(tmp_path), 1,
                              ["--model", "mlp", "--limit", "480", "--test-limit", "1000",
                               "--record", str(record)],
                              env={"PSTRAIN_TORCH_STAGING": staging})
        codes, logs = wait_all(procs, str(tmp_path), 300)
        assert codes == [0], logs + cluster.logs()
        status = job.wait(timeout=60)
        assert status.succeeded, f"{status!r}\n{logs}\n{cluster.logs()}"
        checkpoint = job.download(str(tmp_path / "model.ckpt"))
        # The CLI shows and reports it like any other job.
        for args in (["status", job.id], ["list"], ["report", job.id, "-o",
                                                     str(tmp_path / "report.html")]):
            r = cluster.cli(*args)
            assert r.returncode == 0, f"pstrain {args}: {r.stdout}{r.stderr}"
        assert "SUCCEEDED" in cluster.cli("status", job.id).stdout
        assert "fc1.weight" in (tmp_path / "report.html").read_text()

    # The downloaded checkpoint loads into the user's module, by name.
    downloaded = checkpoint.load_into(train_fmnist.MLP())
    final = torch.load(record / "final-0.pt")
    for name, value in downloaded.state_dict().items():
        assert torch.equal(value, final[name]), name
    with open(record / "batches-0.json") as f:
        batches = json.load(f)["batches"]
    assert sorted(i for b in batches for i in b) == list(range(480)), "every sample once"
    assert len(batches) == 15
    train_set = train_fmnist.load(fashion_mnist, "train", 480)
    reference = train_fmnist.MLP()
    reference.load_state_dict(torch.load(record / "initial-0.pt"))
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for batch in batches:
        x, y = train_set[batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    for name, want in reference.state_dict().items():
        got = final[name]
        scale = want.abs().max().item()
        diff = (got - want).abs().max().item()
        assert diff <= 1e-6 * max(scale, 1e-12), f"{name}: max |diff| {diff} vs scale {scale}"


@pytest.mark.parametrize("mode", ["sync", "async", "ssp", "average"])
def test_two_workers_train_a_cnn_in_each_mode(bin_dir, source_dir, fashion_mnist, tmp_path,
                                              mode):
    """Two worker processes train a PyTorch CNN (batch norm included) on
    6,000 Fashion-MNIST images for one epoch; every sample once across the
    two, the job SUCCEEDED, and each worker's final model beats 0.60 on
    1,000 test images. Sync and average run with every tensor staged through
    host buffers (PSTRAIN_TORCH_STAGING=always: a CUDA tensor's path, its
    batch-norm buffers and average mode's local optimizer included)."""
    record = tmp_path / "record"
    # Async and ssp apply each worker's gradient on its own: half the
    # learning rate of sync, which applies the two workers' mean.
    lr = 0.05 if mode in ("sync", "average") else 0.025
    with LocalCluster(bin_dir, source_dir, str(tmp_path), workers=0) as cluster:
        client, job = submit_external(cluster, workers=2, mode=mode, lr=lr, momentum=0.9)
        procs = start_workers(cluster, job, str(tmp_path), 2,
                              ["--model", "cnn", "--limit", "6000", "--test-limit", "1000",
                               "--record", str(record), "--lr", "0.05"], mode=mode,
                              env={"PSTRAIN_TORCH_STAGING":
                                   "always" if mode in ("sync", "average") else ""})
        codes, logs = wait_all(procs, str(tmp_path), 600)
        assert codes == [0, 0], logs + cluster.logs()
        status = job.wait(timeout=60)
        assert status.succeeded, f"{status!r}\n{logs}\n{cluster.logs()}"
    seen, accuracies = read_records(record, ranks=2)
    print(f"{mode}: test accuracies {accuracies}")
    assert sorted(seen) == list(range(6000)), "every sample once"
    assert min(accuracies) > 0.60, f"test accuracies {accuracies}\n{logs}"


def run_cli(cluster_bin, args, env=None, timeout=300, drop=()):
    """`pstrain run ARGS` (environment variables in `drop` unset); a run past
    `timeout` fails the test with its output."""
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    # Its own process group: a run past the timeout is killed with its local
    # server and worker processes, leaving nothing behind.
    proc = subprocess.Popen([os.path.join(cluster_bin, "pstrain"), "run"] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env=dict(environ, OMP_NUM_THREADS="1", **(env or {})))
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"pstrain run did not end within {timeout} s:\n{out}{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("model,mode,floor", [("lstm", "sync", 0.40),
                                              ("transformer", "average", 0.40)])
def test_pstrain_run_trains_what_the_json_engine_cannot_express(bin_dir, source_dir, tmp_path,
                                                               fashion_mnist, model, mode,
                                                               floor):
    """`pstrain run -n 2` with TLS, mTLS and tokens on its local server: an
    LSTM over the images' rows, and a transformer encoder over 7x7 patches,
    train on 4,000 real images for one epoch; the job SUCCEEDED, every sample
    was trained once, and both workers' models beat `floor` (four times
    chance; measured: 0.53 and 0.50) on 1,000 test images."""
    certs = str(tmp_path / "certs")
    subprocess.run([os.path.join(source_dir, "deploy/local/make-certs.sh"), certs], check=True,
                   stdout=subprocess.DEVNULL)
    record = tmp_path / "record"
    server_args = (f"--tls-cert={certs}/server.pem --tls-key={certs}/server-key.pem "
                   f"--tls-ca={certs}/ca.pem --require-client-cert "
                   f"--token-file={certs}/tokens --heartbeat-timeout-ms=3000")
    r = run_cli(bin_dir, [
        "-n", "2", "--mode", mode, "--epochs", "1", "--batch-size", "32",
        "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
        "--averaging-frequency", "4", "--state-dir", str(tmp_path / "state"),
        "--server-args", server_args,
        "--tls-ca", f"{certs}/ca.pem", "--tls-cert", f"{certs}/admin.pem",
        "--tls-key", f"{certs}/admin-key.pem", "--token-file", f"{certs}/admin.token",
        "--worker-tls-cert", f"{certs}/worker.pem", "--worker-tls-key",
        f"{certs}/worker-key.pem", "--worker-token-file", f"{certs}/worker.token",
        "--", sys.executable, os.path.join(source_dir, "examples/torch/train_fmnist.py"),
        "--model", model, "--limit", "4000", "--test-limit", "1000", "--lr", "0.05",
        "--record", str(record)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCEEDED" in r.stdout, r.stdout + r.stderr
    seen, accuracies = read_records(record, ranks=2)
    print(f"{model} ({mode}): test accuracies {accuracies}")
    assert sorted(seen) == list(range(4000)), "every sample once"
    assert min(accuracies) > floor, f"test accuracies {accuracies}\n{r.stdout}{r.stderr}"


def test_pstrain_run_against_an_existing_server(bin_dir, source_dir, tmp_path, fashion_mnist):
    """`pstrain run --server ADDR` trains on a running cluster's server (TLS,
    mTLS, tokens: the admin's for the job, the worker's for the processes)
    and leaves that server running: the job SUCCEEDED there, with every
    sample once, and the server still answers afterwards."""
    record = tmp_path / "record"
    with LocalCluster(bin_dir, source_dir, str(tmp_path), workers=0) as cluster:
        c = cluster.certs
        r = run_cli(bin_dir, [
            "-n", "2", "--server", cluster.address, "--mode", "sync", "--epochs", "1",
            "--batch-size", "32", "--lr", "0.05", "--momentum", "0.9",
            "--tls-ca", f"{c}/ca.pem", "--tls-cert", f"{c}/admin.pem",
            "--tls-key", f"{c}/admin-key.pem", "--token-file", f"{c}/admin.token",
            "--worker-tls-cert", f"{c}/worker.pem", "--worker-tls-key", f"{c}/worker-key.pem",
            "--worker-token-file", f"{c}/worker.token",
            "--", sys.executable, os.path.join(source_dir, "examples/torch/train_fmnist.py"),
            "--model", "mlp", "--limit", "2000", "--test-limit", "500", "--record", str(record)])
        assert r.returncode == 0, r.stdout + r.stderr + cluster.logs()
        assert "SUCCEEDED" in r.stdout, r.stdout + r.stderr
        seen, _ = read_records(record, ranks=2)
        assert sorted(seen) == list(range(2000)), "every sample once"
        listed = cluster.cli("list")
        assert listed.returncode == 0 and "SUCCEEDED" in listed.stdout, listed.stdout + listed.stderr
        assert "declared the model" in cluster.log("server"), cluster.logs()


def test_pstrain_run_refuses_bad_usage(bin_dir):
    r = run_cli(bin_dir, ["-n", "2"])
    assert r.returncode == 2 and "no command: put it after --" in r.stderr, r.stderr
    r = run_cli(bin_dir, ["-n", "0", "--", "true"])
    assert r.returncode == 2 and "-n must be in [1, 64], got 0" in r.stderr, r.stderr
    r = run_cli(bin_dir, ["-n", "1", "--optimizer", "lbfgs", "--", "true"])
    assert r.returncode == 2 and "--optimizer must be sgd, adam or adamw" in r.stderr, r.stderr


def test_a_job_whose_workers_all_exit_early_is_cancelled(bin_dir, tmp_path):
    """Workers that die before declaring the model leave a job that cannot
    start: `pstrain run` cancels it and exits 1, naming the exits."""
    r = run_cli(bin_dir, ["-n", "2", "--state-dir", str(tmp_path / "state"), "--",
                          sys.executable, "-c", "import sys; sys.exit(3)"], timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "CANCELLED" in r.stdout, r.stdout + r.stderr
    assert "worker process 0" in r.stderr and "exited with status 3" in r.stderr, r.stderr


def test_a_worker_that_dies_before_the_start_stops_the_run(bin_dir, tmp_path):
    """Two processes; the first to start exits with 3 before joining, the
    other declares its model and waits for the job: `pstrain run` cancels the
    job (it can never start), the waiting process is told to stop and exits,
    and the run ends with 1 in seconds, not after the start timeout."""
    script = tmp_path / "one_dies.py"
    script.write_text(f"""
import os, sys, time
first, joined = {str(tmp_path / 'first')!r}, {str(tmp_path / 'joined')!r}
try:
    os.close(os.open(first, os.O_CREAT | os.O_EXCL))
    for _ in range(600):  # Until the other one has registered.
        if os.path.exists(joined):
            break
        time.sleep(0.1)
    sys.exit(3)
except FileExistsError:
    pass
import torch
import pstrain.torch as pst
pst.init()
open(joined, "w").close()
pst.DistributedOptimizer(torch.nn.Linear(4, 2))
""")
    r = run_cli(bin_dir, ["-n", "2", "--state-dir", str(tmp_path / "state"), "--",
                          sys.executable, str(script)], timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "CANCELLED" in r.stdout, r.stdout + r.stderr
    assert "exited with status 3" in r.stderr, r.stderr
    assert "the coordinator said stop" in r.stderr, r.stderr


def test_kill_nine_of_one_torch_worker_in_sync_still_succeeds(bin_dir, source_dir,
                                                              fashion_mnist, tmp_path):
    """Two PyTorch workers in sync; one is killed with SIGKILL after its 20th
    step. The coordinator drops it (missed heartbeats), the survivor's step
    completes in the smaller group, it trains the samples the lost worker
    left, and the job SUCCEEDED with every one of the 4,000 samples counted
    once in its epoch."""
    record = tmp_path / "record"
    with LocalCluster(bin_dir, source_dir, str(tmp_path), workers=0) as cluster:
        client, job = submit_external(cluster, workers=2, lr=0.05, momentum=0.9)
        procs = start_workers(cluster, job, str(tmp_path), 2,
                              ["--model", "mlp", "--limit", "4000", "--test-limit", "500",
                               "--record", str(record), "--mark-step", "20"])
        victim = None
        deadline = time.monotonic() + 120
        while victim is None and time.monotonic() < deadline:
            marks = list(record.glob("step-20.*")) if record.exists() else []
            for p in procs:
                if any(m.name == f"step-20.{p.pid}" for m in marks):
                    victim = p
                    break
            time.sleep(0.05)
        assert victim is not None, "no worker reached step 20"
        victim.send_signal(signal.SIGKILL)
        codes, logs = wait_all(procs, str(tmp_path), 300)
        assert sorted(codes) == [-signal.SIGKILL, 0], logs + cluster.logs()
        status = job.wait(timeout=60)
        assert status.succeeded, f"{status!r}\n{logs}\n{cluster.logs()}"
        assert status.workers_lost == 1, status.proto
        samples = {e.epoch: (e.samples, e.expected) for e in status.proto.epoch_samples}
        assert samples.get(0) == (4000, 4000), status.proto.epoch_samples


def test_kill_nine_of_server_zero_the_torch_workers_follow_the_resumed_job(
        bin_dir, source_dir, fashion_mnist, tmp_path):
    """Two PyTorch workers in sync, two epochs; server 0 is killed with
    SIGKILL in the middle of the second epoch and started again on the same
    state directory. The job resumes from its checkpoint (mid-epoch) as a
    second run, and the same worker processes (not restarted) register
    again, rewind to the checkpoint and finish it: SUCCEEDED, both ranks on
    the same weights, every sample of the second epoch counted once."""
    record = tmp_path / "record"
    with LocalCluster(bin_dir, source_dir, str(tmp_path), workers=0,
                      server_args=["--checkpoint-interval-s", "1"]) as cluster:
        client, job = submit_external(cluster, workers=2, epochs=2, lr=0.05, momentum=0.9)
        # 4000 samples, batch 32, 2 workers: 62 steps an epoch. Both workers
        # hold after step 80 (heartbeating) until the server was killed and
        # is back; meanwhile a checkpoint is cut at step 80.
        procs = start_workers(cluster, job, str(tmp_path), 2,
                              ["--model", "mlp", "--limit", "4000", "--test-limit", "500",
                               "--record", str(record), "--mark-step", "80", "--hold"])
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (
                len(list(record.glob("step-80.*"))) == 2 and
                "(epoch 1, step 80, interval," in cluster.log("server")):
            assert all(p.poll() is None for p in procs), cluster.logs()
            time.sleep(0.05)
        assert len(list(record.glob("step-80.*"))) == 2, cluster.logs()
        cluster.restart_server()
        (record / "go").touch()
        codes, logs = wait_all(procs, str(tmp_path), 300)
        assert codes == [0, 0], logs + cluster.logs()
        status = job.wait(timeout=60)
        assert status.succeeded, f"{status!r}\n{logs}\n{cluster.logs()}"
        assert status.proto.runs == 2, status.proto
        assert status.proto.steps_lost < 62, status.proto  # Since the epoch's checkpoint.
        assert logs.count("from epoch 2 (step 80)") == 2, logs
        # The resumed run counts its epochs afresh: the checkpoint's 80 - 62
        # steps of epoch 2, then the rest, trained by the rewound workers.
        samples = {e.epoch: (e.samples, e.expected) for e in status.proto.epoch_samples}
        assert samples.get(1) == (4000, 4000), status.proto.epoch_samples
    final = [torch.load(record / f"final-{rank}.pt") for rank in range(2)]
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name
    _, accuracies = read_records(record, 2)
    assert min(accuracies) > 0.60, f"test accuracies {accuracies}\n{logs}"


def test_pstrain_run_gives_its_processes_this_builds_package(bin_dir, tmp_path):
    """Without PYTHONPATH, a process that `pstrain run` starts imports the
    pstrain package (and pstrain._native) of the build the CLI belongs to."""
    package = os.path.join(os.path.dirname(os.path.abspath(bin_dir)), "python", "pstrain")
    check = (f"import sys, pstrain.torch, pstrain._native; "
             f"sys.exit(0 if pstrain.torch.__file__.startswith({package!r}) else 4)")
    r = run_cli(bin_dir, ["-n", "1", "--state-dir", str(tmp_path / "state"), "--",
                          sys.executable, "-c", check], timeout=120, drop=("PYTHONPATH",))
    # It exits without joining, so the job is cancelled; the process itself succeeded.
    assert "worker process 0" not in r.stderr, r.stdout + r.stderr
    assert "CANCELLED" in r.stdout, r.stdout + r.stderr


def command_root(tmp_path, source_dir):
    """The directory an operator allows (--command-root), holding the one
    program jobs may name: a wrapper that runs the example with this
    Python."""
    root = tmp_path / "jobs"
    root.mkdir()
    wrapper = root / "train-fmnist"
    script = os.path.join(source_dir, "examples/torch/train_fmnist.py")
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    wrapper.chmod(0o755)
    return root


def test_daemons_run_a_submitted_torch_command_and_a_killed_one_is_a_lost_worker(
        bin_dir, source_dir, fashion_mnist, tmp_path):
    """Two pstrain-worker daemons with --command-root, TLS, mTLS and tokens.
    A job file naming a command is submitted with `pstrain submit`; each
    daemon runs it (one process each, bound to the job through the daemon's
    credentials) and `pstrain workers` shows them busy. The process of one
    is killed with SIGKILL after its 20th step: its daemon reports it, the
    coordinator drops it as a lost worker at once, and the job SUCCEEDED
    with every sample once. A job naming a program outside the root fails
    with the daemon's refusal; the daemons are idle again."""
    root = command_root(tmp_path, source_dir)
    record = tmp_path / "record"
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({
        "name": "torch-daemons",
        "command": {"argv": ["train-fmnist", "--model", "mlp", "--limit", "4000",
                             "--test-limit", "500", "--record", str(record),
                             "--mark-step", "20"],
                    "env": {"OMP_NUM_THREADS": "1"}},
        "optimizer": {"type": "OPTIMIZER_SGD", "learning_rate": 0.05, "momentum": 0.9},
        "epochs": 1, "batch_size": 32, "seed": 7, "workers": 2, "mode": "CONSISTENCY_SYNC"}))
    with LocalCluster(bin_dir, source_dir, str(tmp_path), workers=2,
                      worker_args=["--command-root", str(root)]) as cluster:
        import pstrain
        client = pstrain.Client(cluster.address, **cluster.admin_credentials())
        r = cluster.cli("submit", str(job_file))
        assert r.returncode == 0, r.stdout + r.stderr
        job = client.job(r.stdout.split()[-1])
        deadline = time.monotonic() + 180
        marks = []
        while len(marks) < 2 and time.monotonic() < deadline:
            assert not job.status().done, f"{job.status()!r}\n{cluster.logs()}"
            marks = list(record.glob("step-20.*")) if record.exists() else []
            time.sleep(0.05)
        assert marks, f"no process reached step 20\n{cluster.logs()}"
        busy = cluster.cli("workers")
        assert busy.stdout.count(job.id) >= 4, busy.stdout  # 2 daemons, 2 processes.
        victim = int(marks[0].name.split(".")[1])
        os.kill(victim, signal.SIGKILL)
        status = job.wait(timeout=300)
        assert status.succeeded, f"{status!r}\n{cluster.logs()}"
        assert status.workers_lost == 1, status.proto
        samples = {e.epoch: (e.samples, e.expected) for e in status.proto.epoch_samples}
        assert samples.get(0) == (4000, 4000), status.proto.epoch_samples
        server_log = cluster.log("server")
        assert "was killed by signal 9" in server_log, server_log
        assert "missed heartbeats" not in server_log, server_log  # Reported, not timed out.
        # The survivor's process exits by itself once its job ended.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                "exited with status 0" in cluster.log(f"worker{i}") for i in range(2)):
            time.sleep(0.1)
        assert "stopping its command" not in cluster.logs(), cluster.logs()
        assert any("exited with status 0" in cluster.log(f"worker{i}") for i in range(2)), \
            cluster.logs()

        # A program outside the root: refused, and the job says so.
        job_file.write_text(json.dumps({
            "name": "escape", "command": {"argv": ["/bin/sh", "-c", "id"]},
            "optimizer": {"type": "OPTIMIZER_SGD", "learning_rate": 0.05},
            "epochs": 1, "batch_size": 32, "workers": 1}))
        r = cluster.cli("submit", str(job_file))
        assert r.returncode == 0, r.stdout + r.stderr
        refused = client.job(r.stdout.split()[-1]).wait(timeout=60)
        assert refused.state == "FAILED", f"{refused!r}\n{cluster.logs()}"
        assert "refused to run the command: '/bin/sh' is not an executable file under this " \
               f"worker's --command-root ({root})" in refused.reason, refused.reason
        idle = cluster.cli("workers").stdout
        assert job.id not in idle and refused.proto.job_id not in idle, idle


def test_a_cancelled_command_job_ends_a_command_that_ignores_sigterm(bin_dir, source_dir,
                                                                     tmp_path):
    """A job's command that never joins and ignores SIGTERM: the job is
    cancelled while it waits; the daemon gives the command its grace
    (--command-stop-grace-s 1), then SIGTERM to its process group, then
    SIGKILL, while its heartbeats go on (the server never marks it dead),
    and it is idle again."""
    root = tmp_path / "jobs"
    root.mkdir()
    stubborn = root / "stubborn"
    stubborn.write_text("#!/bin/sh\ntrap '' TERM\necho waiting\nsleep 600 &\nwait\nwait\n")
    stubborn.chmod(0o755)
    with LocalCluster(bin_dir, source_dir, str(tmp_path), workers=1,
                      worker_args=["--command-root", str(root),
                                   "--command-stop-grace-s", "1"]) as cluster:
        import pstrain
        from pstrain._proto import job_pb2
        client = pstrain.Client(cluster.address, **cluster.admin_credentials())
        job = client.submit_spec(job_pb2.JobSpec(
            name="stubborn", command=job_pb2.CommandSpec(argv=["stubborn"]),
            optimizer=job_pb2.OptimizerSpec(type=job_pb2.OPTIMIZER_SGD, learning_rate=0.1),
            epochs=1, batch_size=32, workers=1))
        cluster.wait_for_log("worker0", "job-1 command: waiting", 60)
        r = cluster.cli("cancel", job.id)
        assert r.returncode == 0, r.stdout + r.stderr
        cluster.wait_for_log("worker0", "was killed by signal 9", 60)
        log = cluster.log("worker0")
        assert log.index("its command has 1s to exit") < log.index("SIGTERM") < \
            log.index("SIGKILL"), log
        assert log.count("; SIGTERM to its") == 1 and log.count("to exit") == 1, log
        assert "marked dead" not in cluster.log("server"), cluster.logs()
        deadline = time.monotonic() + 30
        while job.id in cluster.cli("workers").stdout and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.id not in cluster.cli("workers").stdout, cluster.cli("workers").stdout
