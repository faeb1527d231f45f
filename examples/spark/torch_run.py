#!/usr/bin/env python3
"""A pstrain.torch training function, launched by Spark or by `pstrain run`.

    spark-submit --master spark://HOST:7077 torch_run.py --spark   # a barrier stage of 2 tasks
    pstrain run -n 2 -- python3 torch_run.py                        # the same function

`train()` is unchanged between the two: it joins the job the launcher names
(PSTRAIN_SERVER, PSTRAIN_JOB, PSTRAIN_CREDENTIALS) with pst.init().
"""

import gzip
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstrain.torch as pst

DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def train(limit=4000):
    """Trains an MLP on the first `limit` Fashion-MNIST images; returns the last loss."""
    images = read_idx(f"{DATA}/train-images-idx3-ubyte.gz")[:limit]
    labels = read_idx(f"{DATA}/train-labels-idx1-ubyte.gz")[:limit]
    dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1),
        torch.from_numpy(labels.astype(np.int64)))
    worker = pst.init()
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = pst.DistributedOptimizer(model)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=pst.DistributedSampler(dataset))
    loss = None
    for _ in pst.epochs():
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        pst.report(loss=float(loss))
    worker.close()
    return float(loss)


if __name__ == "__main__":
    if "--spark" in sys.argv:
        from pyspark.sql import SparkSession
        from pstrain import optimizers
        from pstrain.spark import run
        spark = SparkSession.builder.appName("pstrain-run").getOrCreate()
        status, _ = run(train, 2, spark=spark, epochs=2, batch_size=32,
                        optimizer=optimizers.SGD(0.05, momentum=0.9))
        print(status.report())
        spark.stop()
    else:
        train()
