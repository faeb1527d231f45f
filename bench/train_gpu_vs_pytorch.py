#!/usr/bin/env python3
"""GPU training throughput: pstrain vs PyTorch eager on the same GPU, same run.

Cases (from the training-engine issue):
  fmnist-cnn   real Fashion-MNIST, batch 256, SGD lr 0.01 momentum 0.9
  resnet-small synthetic 3x64x64 images (examples/models/resnet-small-64.json), batch 128
Both sides build the model from the same spec file (bench/torch_from_spec.py).
PyTorch keeps the data in pinned host memory and copies each batch with
non_blocking=True, as pstrain's prefetcher does. Each run trains --epochs epochs
and only epochs 2.. are timed, on both sides. Rounds alternate; medians and
ratios are printed.

pstrain's fp32 is strict IEEE fp32 (cuBLAS default math, cuDNN FMA-only
algorithms), so the reference it is held to is PyTorch eager with TF32 off
(torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 =
False). PyTorch's own default, which runs convolutions in TF32, is printed
beside it for context.

Mixed precision (--precisions fp32,bf16,fp16): pstrain runs the job with
--precision P; its reference is PyTorch eager under torch.autocast(dtype=P)
(fp16 with torch.amp.GradScaler), TF32 off, and each mixed-precision rate is
also given as a ratio to pstrain's own fp32 rate from the same rounds.

Usage: python3 bench/train_gpu_vs_pytorch.py --binary build/bin/pstrain-worker [--rounds 3]
           [--precisions fp32,bf16,fp16] [--cases fmnist,resnet]
(On the lent GPU machine see docs/BENCHMARKS.md for the libraries to carry.)
"""
import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_from_spec import SpecModel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fmnist(limit, data_dir):
    with gzip.open(os.path.join(data_dir, "train-images-idx3-ubyte.gz")) as f:
        x = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)[:limit]
    with gzip.open(os.path.join(data_dir, "train-labels-idx1-ubyte.gz")) as f:
        y = np.frombuffer(f.read(), np.uint8, offset=8)[:limit]
    return (torch.from_numpy(x.astype(np.float32) / 255.0).pin_memory(),
            torch.from_numpy(y.astype(np.int64)).pin_memory())


def synthetic(n, shape):
    g = torch.Generator().manual_seed(3)
    x = torch.rand((n, *shape), generator=g).pin_memory()
    y = torch.randint(0, 10, (n,), generator=g).pin_memory()
    return x, y


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def torch_rate(spec_file, x, y, batch, lr, tf32, epochs, precision="fp32"):
    """Samples/s over epochs 2..epochs (the first one warms up: cuDNN's
    benchmark search, allocator growth), timed with a device sync at each end.
    bf16/fp16: autocast to that type (and a GradScaler for fp16)."""
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default either way.
    with open(os.path.join(ROOT, spec_file)) as f:
        model = SpecModel(json.load(f)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dtype = AUTOCAST.get(precision)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    steps = len(x) // batch
    for epoch in range(epochs):
        if epoch == 1:
            torch.cuda.synchronize()
            start = time.perf_counter()
        for s in range(steps):
            xb = x[s * batch:(s + 1) * batch].cuda(non_blocking=True)
            yb = y[s * batch:(s + 1) * batch].cuda(non_blocking=True)
            opt.zero_grad(set_to_none=True)
            if dtype is None:
                loss_fn(model(xb), yb).backward()
                opt.step()
                continue
            with torch.autocast("cuda", dtype=dtype):
                loss = loss_fn(model(xb), yb)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    torch.cuda.synchronize()
    return (epochs - 1) * steps * batch / (time.perf_counter() - start)


EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) .* ([0-9.]+) samples/s")


def ours_rate(binary, job, batch, limit, epochs, precision="fp32"):
    """Samples/s over epochs 2..epochs, from the trainer's per-epoch lines (each
    epoch's samples over its wall time, data waits included): the same window
    as torch_rate's."""
    cmd = [binary, "--standalone", os.path.join(ROOT, job), "--device", "cuda", "--batch", str(batch),
           "--epochs", str(epochs), "--checkpoint", "none", "--precision", precision]
    if limit:
        cmd += ["--limit", str(limit)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rates = [float(m.group(3)) for m in map(EPOCH_LINE.match, out.splitlines()) if m]
    if len(rates) != epochs:
        raise RuntimeError(f"expected {epochs} epoch lines from pstrain-worker, got: {out[-2000:]}")
    steady = rates[1:]
    line = json.loads(out.strip().splitlines()[-1])
    # Equal samples per epoch: the rate over them is the harmonic mean.
    return len(steady) / sum(1 / r for r in steady), line["device"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "build/bin/pstrain-worker"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4,
                    help="epochs per run; the first is warm-up and not timed (both sides)")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--precisions", default="fp32",
                    help="comma-separated: fp32 (against PyTorch with TF32 off and on), bf16, "
                         "fp16 (against PyTorch autocast to that type)")
    ap.add_argument("--cases", default="fmnist,resnet")
    args = ap.parse_args()
    precisions = args.precisions.split(",")
    wanted = args.cases.split(",")
    torch.backends.cudnn.benchmark = True
    cases = [
        ("fmnist-cnn b256", "examples/models/fmnist-cnn.json", "bench/jobs/fmnist-cnn-bench.json",
         256, 0.01, 51200, lambda: fmnist(51200, args.data)),
        ("resnet-small 3x64x64 b128", "examples/models/resnet-small-64.json",
         "bench/jobs/resnet-small-64-synthetic.json", 128, 0.05, 0, lambda: synthetic(25600, (3, 64, 64))),
    ]
    print(f"GPU: {torch.cuda.get_device_name(0)}, PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for name, spec, job, batch, lr, limit, data in cases:
        if not any(name.startswith(w) for w in wanted):
            continue
        x, y = data()
        ours = {p: [] for p in precisions}
        theirs = {p: [] for p in precisions}
        theirs_tf32 = []
        for r in range(args.rounds):
            for p in precisions:
                rate, device = ours_rate(args.binary, job, batch, limit, args.epochs, p)
                ours[p].append(rate)
                theirs[p].append(torch_rate(spec, x, y, batch, lr, tf32=False,
                                            epochs=args.epochs, precision=p))
                line = (f"  {name} {p} round {r + 1}: pstrain {rate:.0f} ({device}), PyTorch "
                        f"{'eager fp32' if p == 'fp32' else 'autocast ' + p} {theirs[p][-1]:.0f}")
                if p == "fp32":
                    theirs_tf32.append(torch_rate(spec, x, y, batch, lr, tf32=True,
                                                  epochs=args.epochs))
                    line += f", PyTorch default (TF32 conv) {theirs_tf32[-1]:.0f}"
                print(line + " samples/s", flush=True)
        for p in precisions:
            o, t = statistics.median(ours[p]), statistics.median(theirs[p])
            if p == "fp32":
                t32 = statistics.median(theirs_tf32)
                print(f"{name}: pstrain median {o:.0f} samples/s, PyTorch eager fp32 median {t:.0f} "
                      f"samples/s, ratio {o / t:.2f}x; PyTorch default (TF32 conv) {t32:.0f}, "
                      f"ratio {o / t32:.2f}x", flush=True)
            else:
                line = (f"{name} {p}: pstrain median {o:.0f} samples/s, PyTorch autocast {p} "
                        f"median {t:.0f} samples/s, ratio {o / t:.2f}x")
                if "fp32" in ours:
                    line += f"; {o / statistics.median(ours['fp32']):.2f}x pstrain's own fp32"
                print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
