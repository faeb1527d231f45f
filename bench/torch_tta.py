"""Time to a test accuracy: pstrain.torch (sync) against DistributedDataParallel (gloo).

examples/torch/train_fmnist.py's CNN on all 60,000 Fashion-MNIST training
images, two worker processes on this machine, the same SGD (momentum 0.9),
learning rate, batch and seed on both sides: pstrain through `pstrain run`
and its local server on 127.0.0.1, DDP with gloo over 127.0.0.1. After each
epoch every worker evaluates its model on the 10,000 test images; the
clock counts training only (the evaluation is left out on both sides).
The figure is the training seconds until rank 0 first reaches --target,
and the ratio DDP's time over pstrain's.

    PYTHONPATH=build/python python3 bench/torch_tta.py --pstrain build/bin/pstrain \
        --target 0.90 --epochs 6
"""

import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "examples", "torch"))
sys.path.insert(0, HERE)
import torch_ddp_bench  # noqa: E402  (launch: the two sides' processes)


def worker_main(args):
    """One worker of either side: writes rank 0's (training seconds, test
    accuracy) after each epoch to --out."""
    import torch
    import torch.nn.functional as F
    import train_fmnist
    torch.set_num_threads(1)
    torch.manual_seed(1)
    model = train_fmnist.CNN()
    train = train_fmnist.load(args.data, "train")
    test = train_fmnist.load(args.data, "test")
    record, trained_s = [], 0.0

    def after_epoch(started):
        nonlocal trained_s
        trained_s += time.perf_counter() - started
        record.append((trained_s, train_fmnist.evaluate(model, test, "cpu")))

    if args.side == "ddp":
        import torch.distributed as dist
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=args.workers)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        sampler = torch.utils.data.DistributedSampler(train, num_replicas=args.workers,
                                                      rank=rank, shuffle=True, seed=0)
        loader = torch.utils.data.DataLoader(train, batch_size=args.batch, sampler=sampler)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            started = time.perf_counter()
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
            after_epoch(started)
        dist.destroy_process_group()
    else:
        import pstrain.torch as pst
        worker = pst.init()
        opt = pst.DistributedOptimizer(model)
        rank = worker.rank
        loader = torch.utils.data.DataLoader(train, batch_sampler=pst.DistributedSampler(train))
        for _ in pst.epochs():
            started = time.perf_counter()
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            after_epoch(started)
    if rank == 0:
        with open(f"{args.out}.{args.side}", "w") as f:
            json.dump(record, f)


def run_side(args, side, tmp):
    out = os.path.join(tmp, "record")
    worker = [sys.executable, os.path.abspath(__file__), "--as-worker", "--side", side,
              "--workers", str(args.workers), "--epochs", str(args.epochs), "--batch",
              str(args.batch), "--lr", str(args.lr), "--data", args.data, "--out", out]
    torch_ddp_bench.launch(side, worker, args.workers, 1, args.pstrain,
                           ["--epochs", str(args.epochs), "--batch-size", str(args.batch),
                            "--lr", str(args.lr)], os.path.join(tmp, "state"), args.timeout)
    with open(f"{out}.{side}") as f:
        return json.load(f)


def time_to(record, target):
    for seconds, accuracy in record:
        if accuracy >= target:
            return seconds
    return None


def main():
    parser = torch_ddp_bench.common_parser(__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--target", type=float, default=0.90)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    if args.as_worker:
        return worker_main(args)
    records = {}
    with tempfile.TemporaryDirectory(prefix="torch-tta-") as tmp:
        for side in ("ddp", "pstrain"):
            records[side] = run_side(args, side, tmp)
            print(f"{side}: " + ", ".join(f"epoch {e + 1} {s:.1f} s {a:.4f}"
                                          for e, (s, a) in enumerate(records[side])), flush=True)
    print(f"\nCNN, Fashion-MNIST (60,000 / 10,000), {args.workers} workers x 1 thread, batch "
          f"{args.batch}, SGD lr {args.lr} momentum 0.9, {args.epochs} epochs")
    print("| epoch | DDP (gloo): training s, test accuracy | pstrain sync |\n| --- | --- | --- |")
    for e in range(args.epochs):
        cells = [f"{records[s][e][0]:.1f} s, {records[s][e][1]:.4f}" if e < len(records[s])
                 else "" for s in ("ddp", "pstrain")]
        print(f"| {e + 1} | {cells[0]} | {cells[1]} |")
    ddp, ps = time_to(records["ddp"], args.target), time_to(records["pstrain"], args.target)
    def say(seconds):
        return "not reached" if seconds is None else f"{seconds:.1f} s"
    print(f"time to {args.target}: DDP {say(ddp)}, pstrain {say(ps)}" +
          (f"; DDP / pstrain: {ddp / ps:.2f}x" if ddp and ps else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
