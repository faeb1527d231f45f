#!/usr/bin/env python3
"""Object-store reads: pstrain's S3 client against boto3, in one run, on one
moto server (auth on) on 127.0.0.1; then the trainer fed from s3:// against
a local path.

    build/venv-tools/bin/python3 bench/s3_bench.py --bin-dir build/bin [--repeat 5]

1. Objects: Fashion-MNIST packed by `pstrain prepare` (3 train shards of
   ~20 MB and a test shard of ~8 MB, real data) and one 256 MiB object of
   random bytes, uploaded with boto3.
2. Reads, each repetition every object once, median over repetitions:
   - boto3: `download_fileobj` into memory (s3transfer's defaults: 8 MiB
     ranged GETs, 10 threads);
   - pstrain: bench/s3_read_bench (Storage::Read: a HEAD, then 8 MiB
     ranged GETs, 4 in parallel, held to the ETag).
3. Training: `pstrain-worker --standalone` on the same packed dataset from
   the local directory (mapped) and from s3:// (streamed in ~4 MiB chunks:
   the default window, which holds the whole split, and a 4 MiB window, one
   chunk, fetched as the epoch goes), the example CNN, 1 epoch on
   --train-limit samples, interleaved, the median of --train-repeat: the
   trainer's samples/s, wall time, and the time before the first step.
"""

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "tools"))
from s3_harness import MotoServer  # noqa: E402

BUCKET = "bench"
FMNIST = "/usr/share/datasets/fashion-mnist"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin-dir", default=os.path.join(REPO, "build", "bin"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--random-mib", type=int, default=256)
    parser.add_argument("--train-limit", type=int, default=60000)
    parser.add_argument("--train-repeat", type=int, default=3)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="s3_bench_")
    with MotoServer(log_path=os.path.join(work, "moto.log")) as s3:
        env = dict(os.environ, AWS_ACCESS_KEY_ID=s3.access_key,
                   AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_ENDPOINT_URL=s3.endpoint,
                   AWS_REGION=s3.region)
        client = s3.boto3_client()
        client.create_bucket(Bucket=BUCKET)
        # 1. Objects.
        packed = os.path.join(work, "fmnist")
        subprocess.run([os.path.join(args.bin_dir, "pstrain"), "prepare", "--format", "idx",
                        "--path", FMNIST, "-o", packed, "--records-per-shard", "25000"],
                       check=True, stdout=subprocess.DEVNULL)
        keys = []
        for name in sorted(os.listdir(packed)):
            client.upload_file(os.path.join(packed, name), BUCKET, f"fmnist/{name}")
            keys.append(f"fmnist/{name}")
        client.put_object(Bucket=BUCKET, Key="random.bin",
                          Body=os.urandom(args.random_mib << 20))
        keys.append("random.bin")
        sizes = {k: client.head_object(Bucket=BUCKET, Key=k)["ContentLength"] for k in keys}
        total = sum(sizes.values())

        # 2. Reads, alternating the two clients each repetition.
        boto_rates, pstrain_rates = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for k in keys:
                buf = io.BytesIO()
                client.download_fileobj(BUCKET, k, buf)
                assert buf.getbuffer().nbytes == sizes[k]
            boto_rates.append(total / (time.perf_counter() - start) / 1e6)
            out = subprocess.run([os.path.join(args.bin_dir, "s3_read_bench"), "--repeat", "1"]
                                 + [f"s3://{BUCKET}/{k}" for k in keys],
                                 env=env, check=True, capture_output=True, text=True).stdout
            line = json.loads(out.splitlines()[-1])
            assert line["bytes"] == total
            pstrain_rates.append(line["bytes"] / line["seconds"] / 1e6)
        b, p = statistics.median(boto_rates), statistics.median(pstrain_rates)
        print(f"objects: {len(keys)}, {total / 1e6:.1f} MB per repetition, {args.repeat} "
              "repetitions")
        print(f"boto3 download_fileobj   median {b:8.1f} MB/s  (all: "
              f"{', '.join(f'{r:.0f}' for r in boto_rates)})")
        print(f"pstrain S3 client        median {p:8.1f} MB/s  (all: "
              f"{', '.join(f'{r:.0f}' for r in pstrain_rates)})")
        print(f"ratio pstrain / boto3: {p / b:.2f}x")

        # 3. Training from s3:// (streamed) and from the local directory
        # (mapped), interleaved, the median of --train-repeat runs each.
        job = json.load(open(os.path.join(REPO, "examples", "fashion-mnist.json")))
        job["model_file"] = os.path.join(REPO, "examples", job["model_file"])
        variants = (("local", packed, 0), ("s3://", f"s3://{BUCKET}/fmnist", 0),
                    ("s3:// 4 MiB window", f"s3://{BUCKET}/fmnist", 4))
        runs = {label: [] for label, _, _ in variants}
        for _ in range(args.train_repeat):
            for label, path, window in variants:
                job["dataset"] = {"format": "DATASET_FORMAT_PACKED", "path": path,
                                  "mean": [0.2860], "std": [0.3530],
                                  "train_limit": args.train_limit, "test_limit": 2000,
                                  "shuffle_window_mib": window}
                spec = os.path.join(work, "job.json")
                json.dump(job, open(spec, "w"))
                start = time.perf_counter()
                out = subprocess.run([os.path.join(args.bin_dir, "pstrain-worker"),
                                      "--standalone", spec, "--device", "cpu", "--epochs", "1",
                                      "--checkpoint", "none"], env=env, check=True,
                                     capture_output=True, text=True).stdout
                wall = time.perf_counter() - start
                result = json.loads(out.splitlines()[-1])
                runs[label].append((result["train_samples_per_sec"], wall,
                                    wall - result["train_seconds"], result["test_accuracy"]))
        print(f"training: the example CNN, 1 epoch on {args.train_limit} samples, standalone, "
              f"median of {args.train_repeat}")
        medians = {}
        for label, _, _ in variants:
            rates = [r[0] for r in runs[label]]
            medians[label] = statistics.median(rates)
            print(f"train from {label:19s}: trainer median {medians[label]:8.1f} samples/s "
                  f"(all: {', '.join(f'{r:.0f}' for r in rates)}), wall "
                  f"{statistics.median(r[1] for r in runs[label]):6.2f} s, before the first "
                  f"step {statistics.median(r[2] for r in runs[label]):5.2f} s, test accuracy "
                  f"{runs[label][0][3]:.4f}")
        for label in ("s3://", "s3:// 4 MiB window"):
            print(f"trainer samples/s, {label} / local: {medians[label] / medians['local']:.2f}x")


if __name__ == "__main__":
    main()
