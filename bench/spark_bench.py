#!/usr/bin/env python3
"""pstrain.spark against Spark's own references, in one run, on a Spark
standalone cluster on 127.0.0.1 (tests/python/spark_cluster.py: a Master
and two 1-core Workers, each executor its own JVM) with real Fashion-MNIST.

    PYTHONPATH=build/python build/venv-spark/bin/python3 bench/spark_bench.py \\
        --bin-dir build/bin [--images 20000] [--repeat 3] [--tta-epochs 4]

1. prepare: `pstrain.spark.prepare` of a DataFrame of --images PNG files
   (binaryFile, 4 partitions) into a fresh directory, against
   `df.write.parquet` of the same DataFrame: rows/s, median of --repeat,
   interleaved.
2. fit: `Estimator(cnn).fit(df)` (examples/models/fmnist-cnn.json as JSON;
   the packing reused, a pstrain-server of
   the bench's, 2 barrier tasks of 1 thread) against a plain 2-worker
   `pstrain submit` of the same job on the same packing (2 pstrain-worker
   daemons, --threads 1): samples/s while the job RUNNING (epochs x train
   samples / the time from RUNNING to done), and the fit's whole wall time
   (the stage's launch included) against submit-to-done; median of --repeat.
3. PyTorch: one training loop, a small CNN on the whole of Fashion-MNIST
   (60,000 / 10,000), run by `pstrain.spark.run` (sync, the servers' SGD with
   momentum) and by DDP over gloo (torch's SGD with the same momentum and
   learning rate) in a barrier stage set up as TorchDistributor sets it up
   (TorchDistributor itself needs torchrun, which fails on Debian 12's
   torch: see ddp_stage), 2 processes of 1 thread each,
   --tta-batch (32) per worker, --tta-epochs epochs. Rank 0 evaluates the test set
   after each epoch (not timed): time to 0.90 test accuracy (training time
   only) and samples/s.
Prints one JSON line per result and a summary.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
sys.path.insert(0, os.path.join(REPO, "examples", "spark"))

DATA = "/usr/share/datasets/fashion-mnist"

# examples/spark/torch_run.py's IDX reader; main() has cloudpickle send that
# module's functions by value (the executors cannot import it).
from torch_run import read_idx  # noqa: E402


def log(**fields):
    print(json.dumps(fields), flush=True)


# --- The training function (both launchers) ---------------------------------------------


def fmnist(split):
    import numpy as np
    import torch
    prefix = "train" if split == "train" else "t10k"
    x = read_idx(f"{DATA}/{prefix}-images-idx3-ubyte.gz")
    y = read_idx(f"{DATA}/{prefix}-labels-idx1-ubyte.gz")
    return (torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1),
            torch.from_numpy(y.astype(np.int64)))


def cnn():
    import torch.nn as nn
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def accuracy(model, x, y):
    import torch
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                      for i in range(0, len(y), 1000))
    model.train()
    return correct / len(y)


def train_epoch(model, opt, loader):
    """One epoch of the loop both launchers run: (seconds, samples)."""
    import torch.nn.functional as F
    start, samples = time.perf_counter(), 0
    for xb, yb in loader:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        samples += len(yb)
    return time.perf_counter() - start, samples


def pstrain_train(epochs, batch):
    """pstrain.torch: the servers' optimizer, the job's epoch plan."""
    import torch
    import pstrain.torch as pst
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = fmnist("train")
    tx, ty = fmnist("test")
    train = torch.utils.data.TensorDataset(x, y)
    worker = pst.init()
    model = cnn()
    opt = pst.DistributedOptimizer(model)
    loader = torch.utils.data.DataLoader(train, batch_sampler=pst.DistributedSampler(train))
    history, trained, samples = [], 0.0, 0
    for epoch in pst.epochs():
        seconds, n = train_epoch(model, opt, loader)
        trained, samples = trained + seconds, samples + n
        acc = accuracy(model, tx, ty) if pst.rank() == 0 else None
        history.append({"epoch": epoch, "train_s": trained, "samples": samples, "acc": acc})
        pst.report(accuracy=acc)
    worker.close()
    return history


def ddp_train(epochs, batch):
    """DDP over gloo, torch's SGD, a DistributedSampler: the reference."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = fmnist("train")
    tx, ty = fmnist("test")
    train = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.parallel.DistributedDataParallel(cnn())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = torch.utils.data.distributed.DistributedSampler(train, world, rank, seed=0)
    loader = torch.utils.data.DataLoader(train, batch_size=batch, sampler=sampler)
    history, trained, samples = [], 0.0, 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        seconds, n = train_epoch(model, opt, loader)
        trained, samples = trained + seconds, samples + n
        acc = accuracy(model.module, tx, ty) if rank == 0 else None
        dist.barrier()
        history.append({"epoch": epoch, "train_s": trained, "samples": samples, "acc": acc})
    dist.destroy_process_group()
    return history


def ddp_stage(spark, workers, fn, *args):
    """`fn(*args)` on `workers` barrier tasks with torch.distributed's
    environment (MASTER_ADDR/PORT from task 0, RANK, WORLD_SIZE): what
    TorchDistributor(local_mode=False) sets up, without torchrun. Debian 12's
    torchrun (torch 1.13.1 on Python 3.11) fails before it starts a process:
    `Std.from_str("0")` is None there (enum.Flag no longer iterates NONE), so
    TorchDistributor itself cannot run here. Rank 0's result."""

    def task(_):
        import socket
        from pyspark import BarrierTaskContext
        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        port = ""
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = str(s.getsockname()[1])
        ports = ctx.allGather(port)
        os.environ.update(MASTER_ADDR=ctx.getTaskInfos()[0].address.split(":")[0],
                          MASTER_PORT=next(p for p in ports if p), RANK=str(rank),
                          WORLD_SIZE=str(workers))
        yield rank, fn(*args)

    results = spark.sparkContext.parallelize(range(workers), workers).barrier() \
        .mapPartitions(task).collect()
    return dict(results)[0]


def time_to(history, target):
    for h in history:
        if h["acc"] is not None and h["acc"] >= target:
            return h["train_s"]
    return None


# --- The bench ----------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--fit-epochs", type=int, default=2)
    parser.add_argument("--tta-epochs", type=int, default=4)
    parser.add_argument("--tta-batch", type=int, default=32, help="per worker")
    parser.add_argument("--skip", default="", help="comma-separated: prepare,fit,torch")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    bin_dir = os.path.abspath(args.bin_dir)
    os.environ["PSTRAIN_BIN_DIR"] = bin_dir

    import torch_run
    from pyspark import cloudpickle
    cloudpickle.register_pickle_by_value(torch_run)
    from cluster import LocalCluster
    from spark_cluster import SparkStandalone, write_fashion_mnist_pngs
    from pyspark.sql import functions as F

    import pstrain
    from pstrain.spark import Estimator, prepare, run

    work = tempfile.mkdtemp(prefix="pstrain-spark-bench-")
    spark_cluster = SparkStandalone(os.path.join(work, "spark"), sys.executable).start()
    summary = {}
    try:
        spark = spark_cluster.session("pstrain-spark-bench", env={"PSTRAIN_BIN_DIR": bin_dir})
        images = os.path.join(work, "png")
        write_fashion_mnist_pngs(images, "train", args.images)
        df = (spark.read.format("binaryFile").load(f"{images}/*/*.png")
              .withColumn("label", F.regexp_extract("path", r"/(\d+)/[^/]+$", 1).cast("int"))
              .repartition(4, "path").sortWithinPartitions("path"))
        df.cache().count()  # The same rows for every pass, read once.

        # 1. prepare against parquet.
        if "prepare" not in skip:
            rates = {"prepare": [], "parquet": []}
            for r in range(args.repeat):
                out = os.path.join(work, f"parquet-{r}")
                start = time.perf_counter()
                df.write.parquet(out)
                rates["parquet"].append(args.images / (time.perf_counter() - start))
                shutil.rmtree(out)
                store = os.path.join(work, f"store-{r}")
                start = time.perf_counter()
                prepared = prepare(df, store, features="content", label="label",
                                   image_size=(28, 28))
                rates["prepare"].append(args.images / (time.perf_counter() - start))
                assert not prepared.reused
                if r:
                    shutil.rmtree(store)
                log(part="prepare", repetition=r, prepare_rows_s=rates["prepare"][-1],
                    parquet_rows_s=rates["parquet"][-1])
            summary["prepare_rows_s"] = statistics.median(rates["prepare"])
            summary["parquet_rows_s"] = statistics.median(rates["parquet"])

        # 2. fit against a plain 2-worker job on the same packing.
        if "fit" not in skip:
            store = os.path.join(work, "store-0")
            if "prepare" in skip:
                prepare(df, store, features="content", label="label", image_size=(28, 28))

            def mlp():
                """The example CNN (examples/models/fmnist-cnn.json), as JSON."""
                with open(os.path.join(REPO, "examples", "models", "fmnist-cnn.json")) as f:
                    return f.read()

            def running_rate(client, job_id, epochs, samples):
                """Samples/s from RUNNING to done, polled every 50 ms."""
                job = client.job(job_id)
                started = None
                while True:
                    status = job.status()
                    if started is None and status.state == "RUNNING":
                        started = time.perf_counter()
                    if status.done:
                        return status, epochs * samples / (time.perf_counter() - started)
                    time.sleep(0.05)

            fit_rates, fit_walls, plain_rates, plain_walls = [], [], [], []
            for r in range(args.repeat):
                with LocalCluster(bin_dir, REPO, os.path.join(work, f"servers-{r}"), workers=2,
                                  server_args=["--heartbeat-timeout-ms", "3000"],
                                  worker_args=["--data-root", work]) as cluster:
                    client = pstrain.Client(cluster.address, **cluster.admin_credentials())
                    estimator = Estimator(
                        mlp(), server=cluster.address, store=store, features="content",
                        label="label", image_size=(28, 28), workers=2, threads=1,
                        epochs=args.fit_epochs, batch_size=64, progress=False,
                        optimizer=pstrain.optimizers.SGD(0.05, momentum=0.9),
                        worker_credentials={
                            "tls_ca": f"{cluster.certs}/ca.pem",
                            "tls_cert": f"{cluster.certs}/worker.pem",
                            "tls_key": f"{cluster.certs}/worker-key.pem",
                            "token_file": f"{cluster.certs}/worker.token"},
                        **cluster.admin_credentials())
                    # The fit, timed whole; its RUNNING phase timed by a watcher.
                    import threading
                    box = {}

                    def watch():
                        while "job" not in box:
                            jobs = [j for j in client.jobs() if j.name == "spark-fit"]
                            if jobs:
                                box["job"] = jobs[0].job_id
                            time.sleep(0.02)

                    watcher = threading.Thread(target=watch, daemon=True)
                    watcher.start()
                    start = time.perf_counter()
                    holder = {}
                    fitter = threading.Thread(target=lambda: holder.update(m=estimator.fit(df)))
                    fitter.start()
                    watcher.join(timeout=300)
                    status, rate = running_rate(client, box["job"], args.fit_epochs,
                                                estimator_samples(store))
                    fitter.join(timeout=600)
                    fit_walls.append(time.perf_counter() - start)
                    fit_rates.append(rate)
                    assert status.state == "SUCCEEDED", status.report()
                    fit_acc = status.test.accuracy
                    # The plain job: the same spec, the pool's 2 daemons.
                    spec = estimator._spec(estimator.last_prepared, False)
                    spec.bound_workers = False
                    spec.name = "plain"
                    start = time.perf_counter()
                    job = client.submit_spec(spec)
                    status, rate = running_rate(client, job.id, args.fit_epochs,
                                                estimator_samples(store))
                    plain_walls.append(time.perf_counter() - start)
                    plain_rates.append(rate)
                    assert status.state == "SUCCEEDED", status.report()
                    log(part="fit", repetition=r, fit_samples_s=fit_rates[-1],
                        fit_wall_s=fit_walls[-1], fit_accuracy=fit_acc,
                        plain_samples_s=plain_rates[-1], plain_wall_s=plain_walls[-1],
                        plain_accuracy=status.test.accuracy)
            summary.update(fit_samples_s=statistics.median(fit_rates),
                           plain_samples_s=statistics.median(plain_rates),
                           fit_wall_s=statistics.median(fit_walls),
                           plain_wall_s=statistics.median(plain_walls))

        # 3. PyTorch: pstrain.spark.run against TorchDistributor.
        if "torch" not in skip:
            start = time.perf_counter()
            status, results = run(pstrain_train, 2, args.tta_epochs, args.tta_batch, spark=spark,
                                  epochs=args.tta_epochs, batch_size=args.tta_batch,
                                  progress=False,
                                  optimizer=pstrain.optimizers.SGD(0.05, momentum=0.9))
            pstrain_wall = time.perf_counter() - start
            # The job's rank 0 (the coordinator's, not Spark's partition 0) evaluated.
            ours = next(r for r in results if any(h["acc"] is not None for h in r))
            start = time.perf_counter()
            theirs = ddp_stage(spark, 2, ddp_train, args.tta_epochs, args.tta_batch)
            ddp_wall = time.perf_counter() - start
            for name, history, wall in (("pstrain", ours, pstrain_wall),
                                        ("ddp", theirs, ddp_wall)):
                last = history[-1]
                log(part="torch", system=name, history=history, wall_s=wall,
                    samples_s_per_worker=last["samples"] / last["train_s"],
                    time_to_090_s=time_to(history, 0.90))
                summary[f"{name}_samples_s"] = 2 * last["samples"] / last["train_s"]
                summary[f"{name}_time_to_090_s"] = time_to(history, 0.90)
                summary[f"{name}_final_acc"] = last["acc"]
        spark_cluster.stop_session()
    finally:
        spark_cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    log(part="summary", **summary)


def estimator_samples(store):
    """The train samples of the (only) packing under `store`."""
    for name in os.listdir(store):
        manifest = os.path.join(store, name, "_pstrain_spark.json")
        if os.path.exists(manifest):
            with open(manifest) as f:
                return json.load(f)["train_samples"]
    raise FileNotFoundError(f"no packing in {store}")


if __name__ == "__main__":
    main()
