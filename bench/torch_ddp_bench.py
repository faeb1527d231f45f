"""pstrain.torch against torch.nn.parallel.DistributedDataParallel (gloo).

The same model, data, batch, optimizer and machine, the two alternating in
one run; every figure is the workers' samples per second together over the
steps after a warm-up, and the table gives the median over the rounds and
pstrain's ratio to DDP.

    PYTHONPATH=build/python python3 bench/torch_ddp_bench.py --pstrain build/bin/pstrain \
        --model cnn --workers 2 --steps 60 --rounds 3

--model cnn: examples/torch/train_fmnist.py's CNN on Fashion-MNIST images;
resnet18: torchvision's ResNet-18 on synthetic 3x64x64 images (10 classes).
pstrain runs sync mode with SGD (momentum 0.9) on its local server on
127.0.0.1 (`pstrain run`); DDP runs the same SGD in each process, gradients
all-reduced by gloo over 127.0.0.1. Each worker process uses
--threads-per-worker threads (default: cores / workers).

bench/cluster_emulation.sh torch runs the same workers (--as-worker) on
emulated hosts and links instead: one process per network namespace, DDP
with --ddp-hook none or fp16 (its fp16_compress_hook), pstrain against a
server in a namespace of its own, the job submitted with --submit ADDR
--compression none|fp16|topk:RATIO. Each worker writes its samples per
second and its median step time after the warm-up.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def make_model(name):
    if name == "cnn":
        sys.path.insert(0, os.path.join(REPO, "examples", "torch"))
        import train_fmnist
        return train_fmnist.CNN()
    import torchvision
    return torchvision.models.resnet18(num_classes=10)


def make_data(name, samples, data_dir):
    import torch
    if name == "cnn":
        sys.path.insert(0, os.path.join(REPO, "examples", "torch"))
        import train_fmnist
        return train_fmnist.load(data_dir, "train", samples)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 3, 64, 64, generator=g)
    y = torch.randint(0, 10, (samples,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def worker_main(args):
    """One worker process of either side; writes its figures to --out."""
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads_per_worker)
    torch.manual_seed(1)
    model = make_model(args.model)
    samples = args.steps * args.batch * args.workers
    data = make_data(args.model, samples, args.data)
    times, cpu = [], []  # Wall and this process's CPU (all its threads) at each step's end.
    if args.side == "ddp":
        import torch.distributed as dist
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=args.workers)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if args.ddp_hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=args.workers, rank=rank,
                                                      shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler,
                                             drop_last=True)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            times.append(time.perf_counter())
            cpu.append(time.process_time())
        dist.destroy_process_group()
    else:  # pstrain, or pstrain-serial: the pulls not overlapped with the next forward.
        import pstrain.torch as pst
        worker = pst.init()
        serial = {"overlap_pulls": False} if args.side == "pstrain-serial" else {}
        opt = pst.DistributedOptimizer(model, **serial)
        rank = worker.rank
        loader = torch.utils.data.DataLoader(data, batch_sampler=pst.DistributedSampler(data))
        for _ in pst.epochs():
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                times.append(time.perf_counter())
                cpu.append(time.process_time())
    warm = args.warmup
    steps = len(times) - 1 - warm
    rate = steps * args.batch / (times[-1] - times[warm]) if steps > 0 else 0.0
    intervals = [b - a for a, b in zip(times[warm:], times[warm + 1:])]
    step_ms = 1000 * statistics.median(intervals) if intervals else 0.0
    cpu_ms = 1000 * (cpu[-1] - cpu[warm]) / steps if steps > 0 else 0.0
    with open(f"{args.out}.{args.side}.{rank}", "w") as f:
        json.dump({"samples_per_sec": rate, "step_ms": step_ms, "cpu_ms_per_step": cpu_ms,
                   "steps": len(times)}, f)


def submit(args):
    """Submits the pstrain side's job to the server at args.submit (plaintext)
    and prints its id: sync SGD as DDP's, the push compression asked."""
    import pstrain
    from pstrain._proto import job_pb2
    methods = {"none": job_pb2.CompressionSpec.COMPRESSION_NONE,
               "fp16": job_pb2.CompressionSpec.COMPRESSION_FP16,
               "bf16": job_pb2.CompressionSpec.COMPRESSION_BF16,
               "topk": job_pb2.CompressionSpec.COMPRESSION_TOPK,
               "onebit": job_pb2.CompressionSpec.COMPRESSION_ONEBIT}

    def codec(text):
        method, _, ratio = text.partition(":")
        return job_pb2.CompressionSpec(method=methods[method],
                                       topk_ratio=float(ratio) if ratio else 0.0)

    push, _, pull = args.compression.partition("/")
    spec = job_pb2.JobSpec(
        name=f"bench-{args.model}-{args.compression}",
        external_model=job_pb2.ExternalModel(framework="torch"),
        optimizer=job_pb2.OptimizerSpec(type=job_pb2.OPTIMIZER_SGD, learning_rate=0.01,
                                        momentum=0.9),
        epochs=1, batch_size=args.batch, seed=0, workers=args.workers,
        mode=job_pb2.CONSISTENCY_SYNC, compression=codec(push))
    if pull:
        spec.pull_compression.CopyFrom(codec(pull))
    with pstrain.Client(args.submit) as client:
        print(client.submit_spec(spec).id)


def launch(side, worker, workers, threads, pstrain, job, state_dir, timeout):
    """Runs `workers` processes of `worker` (an argv) on one side and waits:
    DDP's ranks with gloo on 127.0.0.1, or `pstrain run` (sync SGD with
    momentum 0.9, the `job` options, a local server in `state_dir`)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if side == "ddp":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        procs = [subprocess.Popen(worker, env=dict(env, RANK=str(r))) for r in range(workers)]
        codes = [p.wait(timeout=timeout) for p in procs]
    else:
        cmd = [pstrain, "run", "-n", str(workers), "--mode", "sync", "--optimizer", "sgd",
               "--momentum", "0.9", "--state-dir", state_dir] + job + ["--"] + worker
        codes = [subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL,
                                timeout=timeout).returncode]
    if any(codes):
        raise RuntimeError(f"{side}: exit codes {codes}")


def run_side(args, side, tmp):
    out = os.path.join(tmp, "fig")
    for name in os.listdir(tmp):
        if name.startswith("fig."):
            os.remove(os.path.join(tmp, name))
    worker = [sys.executable, os.path.abspath(__file__), "--as-worker", "--side", side,
              "--model", args.model, "--workers", str(args.workers), "--steps", str(args.steps),
              "--batch", str(args.batch), "--warmup", str(args.warmup), "--data", args.data,
              "--threads-per-worker", str(args.threads_per_worker), "--out", out]
    launch(side, worker, args.workers, args.threads_per_worker, args.pstrain,
           ["--epochs", "1", "--batch-size", str(args.batch), "--lr", "0.01"],
           os.path.join(tmp, "state"), args.timeout)
    rates = []
    for name in os.listdir(tmp):
        if name.startswith(f"fig.{side}."):
            with open(os.path.join(tmp, name)) as f:
                rates.append(json.load(f)["samples_per_sec"])
    return sum(rates)


def common_parser(description):
    """The options every torch-against-DDP script shares (the worker's own
    --as-worker, --side and --out among them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--pstrain", default=os.path.join(REPO, "build", "bin", "pstrain"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    return parser


def main():
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cnn", "resnet18"], default="cnn")
    parser.add_argument("--steps", type=int, default=60, help="steps per worker")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads-per-worker", type=int,
                        default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--ddp-hook", choices=["none", "fp16"], default="none")
    parser.add_argument("--sides", default="ddp,pstrain",
                        help="comma-separated: ddp, pstrain, pstrain-serial (no overlapped pulls)")
    parser.add_argument("--submit", default="", metavar="ADDR",
                        help="submit the pstrain side's job to ADDR and print its id")
    parser.add_argument("--compression", default="none",
                        help="PUSH[/PULL]: none, fp16, bf16, topk:RATIO or onebit")
    args = parser.parse_args()
    if args.submit:
        return submit(args)
    if args.as_worker:
        return worker_main(args)
    sides = args.sides.split(",")
    figures = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="torch-ddp-bench-") as tmp:
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else reversed(sides):
                rate = run_side(args, side, tmp)
                figures[side].append(rate)
                print(f"round {r + 1} {side}: {rate:.1f} samples/s", flush=True)
    names = {"ddp": "DDP (gloo)", "pstrain": "pstrain sync",
             "pstrain-serial": "pstrain sync, pulls not overlapped"}
    print(f"\n{args.model}, {args.workers} workers x {args.threads_per_worker} threads, batch "
          f"{args.batch}, {args.steps} steps per worker ({args.warmup} warm-up), "
          f"{args.rounds} rounds")
    print("| side | samples/s (median) | rounds |\n| --- | --- | --- |")
    medians = {side: statistics.median(v) for side, v in figures.items()}
    for side, values in figures.items():
        print(f"| {names[side]} | {medians[side]:.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    for side in sides:
        if side != "ddp" and "ddp" in medians:
            print(f"{side} / DDP: {medians[side] / medians['ddp']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
