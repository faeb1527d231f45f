#!/usr/bin/python3
"""CPU training throughput: pstrain vs PyTorch on fmnist-cnn, same run.

Both sides train the TensorFlow layers-tutorial CNN (bench/jobs/fmnist-cnn-bench.json)
on the real Fashion-MNIST training images, pixels scaled to [0, 1], SGD lr 0.01
momentum 0.9, batch 64, dropout 0.4 on both. PyTorch (Debian's python3-torch) runs
with every thread pool set to the core count. Rounds alternate between the two
so that machine noise hits both; the medians and their ratio are printed.

Usage: /usr/bin/python3 bench/train_cpu_vs_pytorch.py [--samples 12800] [--rounds 3]
           [--baseline OTHER_WORKER_BINARY]

--baseline adds a second pstrain build (the one before a change) to every round,
so that a change is measured before and after in the same alternating run.
OpenMP settings in the environment (OMP_PROC_BIND, OMP_PLACES) apply to both
sides.
"""
import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time

# The cores this run may use, read before torch loads OpenMP: with
# OMP_PROC_BIND set, OpenMP binds this (the initial) thread to one core at
# start-up, and pstrain's process, started from it, would inherit that.
CORES = os.sched_getaffinity(0)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_from_spec import SpecModel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = "/usr/share/datasets/fashion-mnist"


def load_fmnist(limit):
    with gzip.open(os.path.join(DATA, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(DATA, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = torch.from_numpy(images[:limit].astype(np.float32) / 255.0)
    y = torch.from_numpy(labels[:limit].astype(np.int64))
    return x, y


def torch_model():
    # The same spec file pstrain trains (examples/models/fmnist-cnn.json).
    with open(os.path.join(ROOT, "examples/models/fmnist-cnn.json")) as f:
        return SpecModel(json.load(f))


def torch_samples_per_sec(x, y, batch):
    model = torch_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    steps = len(x) // batch
    # Every step is timed, the first ones (oneDNN's primitive creation)
    # included, as pstrain's train_samples_per_sec times every step of its
    # epoch; model creation and data loading are outside both.
    start = time.perf_counter()
    for s in range(steps):
        idx = perm[s * batch:(s + 1) * batch]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
    return steps * batch / (time.perf_counter() - start)


def pstrain_samples_per_sec(binary, samples, batch):
    cmd = [binary, "--standalone", os.path.join(ROOT, "bench/jobs/fmnist-cnn-bench.json"),
           "--device", "cpu", "--limit", str(samples), "--batch", str(batch), "--checkpoint", "none"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, CORES)).stdout
    return json.loads(out.strip().splitlines()[-1])["train_samples_per_sec"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=12800)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/bin/pstrain-worker"))
    ap.add_argument("--baseline", help="another pstrain-worker build, run in every round too")
    args = ap.parse_args()

    cores = len(CORES)  # What taskset or a cpuset allows, as OpenMP counts.
    torch.set_num_threads(cores)
    torch.set_num_interop_threads(cores)
    x, y = load_fmnist(args.samples)
    ours, theirs, base = [], [], []
    for r in range(args.rounds):
        ours.append(pstrain_samples_per_sec(args.binary, args.samples, args.batch))
        theirs.append(torch_samples_per_sec(x, y, args.batch))
        line = f"round {r + 1}: pstrain {ours[-1]:.1f} samples/s, PyTorch {theirs[-1]:.1f} samples/s"
        if args.baseline:
            base.append(pstrain_samples_per_sec(args.baseline, args.samples, args.batch))
            line += f", baseline {base[-1]:.1f} samples/s"
        print(line, flush=True)
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"fmnist-cnn CPU training, batch {args.batch}, {cores} cores, {args.samples} samples/round, "
          f"{args.rounds} rounds")
    print(f"  pstrain  median {o:8.1f} samples/s")
    print(f"  PyTorch {torch.__version__} median {t:8.1f} samples/s (threads={torch.get_num_threads()})")
    print(f"  ratio pstrain/PyTorch = {o / t:.2f}x")
    if base:
        b = statistics.median(base)
        print(f"  baseline {args.baseline} median {b:8.1f} samples/s = {b / t:.2f}x PyTorch; "
              f"pstrain/baseline = {o / b:.3f}x")


if __name__ == "__main__":
    sys.exit(main())
