#!/usr/bin/env python3
"""TensorBoard's own reader reads what `pstrain-worker --tensorboard-dir` wrote.

Standalone: trains a small Fashion-MNIST subset with a real
`pstrain-worker --standalone` run, then loads the log directory with
TensorBoard's EventAccumulator (not a reader of ours) and checks the scalar
tags, their steps and their values against the worker's own JSON summary.
Daemon (with --server and --cli): a real pstrain-server and one
`pstrain-worker --server` train the same subset submitted through the CLI;
TensorBoard reads <dir>/<job id>/worker-0.

  read_tfevents.py --worker build/bin/pstrain-worker --job examples/fashion-mnist.json \\
      [--server build/bin/pstrain-server --cli build/bin/pstrain] \\
      [--python build/venv-tools/bin/python3]

TensorBoard comes from PyPI (deploy/local/test.sh installs it into
<build>/venv-tools). When this interpreter has no tensorboard the script runs
itself again with --python; when neither has it, the test fails: the tool can
be installed on every machine that runs the suite.
"""

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

EPOCHS = 2
LIMIT = 640
BATCH = 64
TRAIN_TAGS = ("train/loss", "train/accuracy", "train/samples_per_sec")
TEST_TAGS = ("test/accuracy", "test/loss")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", required=True, help="the pstrain-worker binary")
    parser.add_argument("--job", required=True, help="a Fashion-MNIST job JSON")
    parser.add_argument("--server", default="", help="pstrain-server: also check daemon mode")
    parser.add_argument("--cli", default="", help="the pstrain CLI (with --server)")
    parser.add_argument("--python", default="", help="an interpreter with tensorboard installed")
    return parser.parse_args()


def import_event_accumulator(args):
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        return EventAccumulator
    except ImportError as error:
        other = args.python
        # A venv's python is a symlink to the same binary: compare by the
        # environment variable, not by path.
        if other and os.path.exists(other) and not os.environ.get("PSTRAIN_READ_TFEVENTS_REEXEC"):
            os.environ["PSTRAIN_READ_TFEVENTS_REEXEC"] = "1"
            os.execv(other, [other] + sys.argv)
        sys.exit(f"FAIL: cannot import TensorBoard's event_accumulator ({error}); "
                 f"install it: python3 -m venv build/venv-tools && "
                 f"build/venv-tools/bin/pip install tensorboard (deploy/local/test.sh does this), "
                 f"tried {sys.executable}" + (f" and {other}" if other else ""))


def fail(message):
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


def run_worker(args, log_dir):
    command = [
        args.worker, "--standalone", args.job, "--device", "cpu", "--limit", str(LIMIT),
        "--epochs", str(EPOCHS), "--batch", str(BATCH), "--checkpoint", "none",
        "--tensorboard-dir", log_dir
    ]
    print("running:", " ".join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
        fail(f"pstrain-worker exited with {result.returncode}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_line(path, text, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        with open(path, errors="replace") as f:
            if text in f.read():
                return
        time.sleep(0.1)
    with open(path, errors="replace") as f:
        fail(f"timed out waiting for {text!r} in {path}:\n{f.read()[-3000:]}")


def check_daemon(args, EventAccumulator):
    with tempfile.TemporaryDirectory(prefix="pstrain_tb_daemon_") as work:
        with open(args.job) as f:
            job = json.load(f)
        if "model_file" in job:
            job["model_file"] = os.path.join(os.path.dirname(os.path.abspath(args.job)),
                                             job["model_file"])
        job["dataset"]["train_limit"] = LIMIT
        job.update(epochs=EPOCHS, batch_size=BATCH, workers=1)
        job_path = os.path.join(work, "job.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        address = f"127.0.0.1:{free_port()}"
        log_dir = os.path.join(work, "tb")
        processes = []
        try:
            server_log = os.path.join(work, "server.log")
            worker_log = os.path.join(work, "worker.log")
            with open(server_log, "w") as out:
                processes.append(subprocess.Popen(
                    [args.server, "--listen", address, "--state-dir", os.path.join(work, "state")],
                    stdout=out, stderr=subprocess.STDOUT))
            wait_for_line(server_log, "listening on", 60)
            with open(worker_log, "w") as out:
                processes.append(subprocess.Popen(
                    [args.worker, "--server", address, "--device", "cpu", "--threads", "1",
                     "--tensorboard-dir", log_dir], stdout=out, stderr=subprocess.STDOUT))
            wait_for_line(worker_log, "registered", 60)
            submit = subprocess.run(
                [args.cli, "--server", address, "submit", job_path, "--watch", "--json"],
                capture_output=True, text=True, timeout=600)
            if submit.returncode != 0:
                fail(f"pstrain submit exited with {submit.returncode}:\n{submit.stdout}"
                     f"{submit.stderr}")
            wait_for_line(worker_log, ": finished", 60)
        finally:
            for p in processes:
                p.terminate()
            for p in processes:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
        jobs = os.listdir(log_dir)
        if len(jobs) != 1:
            fail(f"daemon: expected one job directory in {log_dir}, found {jobs}")
        run_dir = os.path.join(log_dir, jobs[0], "worker-0")
        if not os.path.isdir(run_dir):
            fail(f"daemon: no {run_dir}; found {os.listdir(os.path.join(log_dir, jobs[0]))}")
        accumulator = EventAccumulator(run_dir, size_guidance={"scalars": 0})
        accumulator.Reload()
        print("daemon: TensorBoard read tags:", accumulator.Tags()["scalars"])
        for tag in TRAIN_TAGS + ("test/shard_accuracy", "test/shard_loss"):
            if tag not in accumulator.Tags()["scalars"]:
                fail(f"daemon: TensorBoard found no {tag} in {run_dir}")
        losses = accumulator.Scalars("train/loss")
        print("daemon: train/loss", [(e.step, e.value) for e in losses])
        steps = [e.step for e in losses]
        if steps != sorted(set(steps)) or len(steps) < EPOCHS:
            fail(f"daemon: train/loss steps {steps} not increasing, or fewer than one per epoch")
        if not all(math.isfinite(e.value) and e.value > 0 for e in losses):
            fail(f"daemon: train/loss values not finite and positive: {losses}")
        accuracy = accumulator.Scalars("test/shard_accuracy")
        if len(accuracy) != 1 or not 0 < accuracy[0].value <= 1 or accuracy[0].step != steps[-1]:
            fail(f"daemon: test/shard_accuracy {accuracy} not one value in (0, 1] at the last step")


def main():
    args = parse_args()
    EventAccumulator = import_event_accumulator(args)
    if args.server:
        check_daemon(args, EventAccumulator)
    with tempfile.TemporaryDirectory(prefix="pstrain_tb_") as log_dir:
        summary = run_worker(args, log_dir)
        files = [f for f in os.listdir(log_dir) if f.startswith("events.out.tfevents.")]
        if len(files) != 1:
            fail(f"expected one events.out.tfevents.* file in {log_dir}, found {files}")

        accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
        accumulator.Reload()
        tags = accumulator.Tags()
        print("TensorBoard read tags:", tags["scalars"])
        missing = [t for t in TRAIN_TAGS + TEST_TAGS if t not in tags["scalars"]]
        if missing:
            fail(f"TensorBoard found no scalars {missing}; it found {tags['scalars']}")

        # One train point per epoch, at the global step that ended it.
        steps_per_epoch = summary["steps"] // EPOCHS
        expected_steps = [steps_per_epoch * (e + 1) for e in range(EPOCHS)]
        for tag in TRAIN_TAGS:
            events = accumulator.Scalars(tag)
            steps = [e.step for e in events]
            values = [e.value for e in events]
            print(f"{tag}: steps {steps} values {values}")
            if steps != expected_steps:
                fail(f"{tag}: steps {steps}, expected {expected_steps}")
            if not all(math.isfinite(v) for v in values):
                fail(f"{tag}: values not finite: {values}")
            wall_times = [e.wall_time for e in events]
            if wall_times != sorted(wall_times) or abs(wall_times[-1] - time.time()) > 3600:
                fail(f"{tag}: wall times {wall_times} not increasing or not now")

        losses = [e.value for e in accumulator.Scalars("train/loss")]
        if not all(v > 0 for v in losses):
            fail(f"train/loss not positive: {losses}")
        if not math.isclose(losses[-1], summary["final_train_loss"], rel_tol=1e-5, abs_tol=1e-6):
            fail(f"last train/loss {losses[-1]} != the worker's final_train_loss "
                 f"{summary['final_train_loss']}")
        if losses[-1] >= losses[0]:
            fail(f"train/loss did not decrease over {EPOCHS} epochs: {losses}")
        accuracies = [e.value for e in accumulator.Scalars("train/accuracy")]
        if not all(0 <= v <= 1 for v in accuracies):
            fail(f"train/accuracy outside [0, 1]: {accuracies}")
        if not all(v > 0 for v in (e.value for e in accumulator.Scalars("train/samples_per_sec"))):
            fail("train/samples_per_sec not positive")

        for tag, key in (("test/accuracy", "test_accuracy"), ("test/loss", "test_loss")):
            events = accumulator.Scalars(tag)
            if len(events) != 1 or events[0].step != summary["steps"]:
                fail(f"{tag}: expected one point at step {summary['steps']}, got "
                     f"{[(e.step, e.value) for e in events]}")
            if not math.isclose(events[0].value, summary[key], rel_tol=1e-5, abs_tol=1e-6):
                fail(f"{tag} {events[0].value} != the worker's {key} {summary[key]}")
    print("PASS: TensorBoard's EventAccumulator read every scalar back")


if __name__ == "__main__":
    main()
