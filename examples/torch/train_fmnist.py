#!/usr/bin/env python3
"""Fashion-MNIST with your own PyTorch model, trained through pstrain.

Started by a launcher that names the job (PSTRAIN_SERVER, PSTRAIN_JOB,
PSTRAIN_CREDENTIALS): `pstrain run -n 2 -- python3 train_fmnist.py --model cnn`,
or pstrain-worker daemons running job-daemons.json (copy this file into their
--command-root).
The changes from a plain PyTorch loop are the five `pst.` lines.

    --model mlp|cnn|lstm|transformer   what to train (the LSTM reads the 28
                                       rows in order; the transformer encodes
                                       7x7 patches)
    --data DIR                         the IDX files (Debian's
                                       dataset-fashion-mnist)
    --limit N                          the first N training images only
    --optimizer sgd|adam               average mode's local optimizer
    --record DIR                       writes initial.pt, final.pt and the
                                       batches trained (batches.json), for tests
"""

import argparse
import gzip
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import pstrain.torch as pst


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(data_dir, split, limit=0):
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - 0.2860) / 0.3530
    return torch.utils.data.TensorDataset(x, torch.from_numpy(labels.astype(np.int64)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 128), nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(64 * 7 * 7, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class RowLSTM(nn.Module):
    """Reads an image's 28 rows as a sequence: no JSON layer can express it."""

    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(28, 64, batch_first=True), nn.Linear(64, 10)

    def forward(self, x):
        out, _ = self.lstm(x.squeeze(1))
        return self.head(out[:, -1])


class PatchTransformer(nn.Module):
    """A small transformer encoder over the 16 patches of 7x7 pixels."""

    def __init__(self, dim=64):
        super().__init__()
        self.embed = nn.Linear(49, dim)
        self.position = nn.Parameter(torch.zeros(1, 16, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        patches = x.unfold(2, 7, 7).unfold(3, 7, 7).reshape(x.shape[0], 16, 49)
        return self.head(self.encoder(self.embed(patches) + self.position).mean(1))


MODELS = {"mlp": MLP, "cnn": CNN, "lstm": RowLSTM, "transformer": PatchTransformer}


def evaluate(model, test_set, device):
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(test_set, batch_size=1000):
            correct += (model(x.to(device)).argmax(1).cpu() == y).sum().item()
    model.train()
    return correct / len(test_set)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="cnn")
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--test-limit", type=int, default=0)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--record", default="")
    parser.add_argument("--mark-step", type=int, default=0,
                        help="touch RECORD/step-N.<pid> after this process's step N (tests "
                        "kill a worker there)")
    parser.add_argument("--hold", action="store_true",
                        help="after --mark-step, wait (at most 120 s) for RECORD/go")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", default="cpu",
                        help="where the model trains: cpu, cuda or cuda:N (its tensors then go "
                        "through pinned host buffers)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_set = load(args.data, "train", args.limit)
    test_set = load(args.data, "test", args.test_limit)
    worker = pst.init()
    device = torch.device(args.device)
    model = MODELS[args.model]().to(device)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    local = None
    if pst.mode() == "average":
        local = (torch.optim.SGD(model.parameters(), lr=args.lr) if args.optimizer == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=args.lr))
    opt = pst.DistributedOptimizer(model, optimizer=local)
    sampler = pst.DistributedSampler(train_set)
    batches = []
    if args.record:
        sampler = Recording(sampler, batches)
    loader = torch.utils.data.DataLoader(train_set, batch_sampler=sampler)
    trained = 0
    for epoch in pst.epochs():
        total, steps = 0.0, 0
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total, steps, trained = total + loss.item(), steps + 1, trained + 1
            if args.mark_step and trained == args.mark_step:
                mark(args.record, trained, args.hold)
        pst.report(loss=total / max(1, steps))
        print(f"rank {pst.rank()}: epoch {epoch + 1}: loss {total / max(1, steps):.4f}",
              flush=True)
    accuracy = evaluate(model, test_set, device)
    print(f"rank {worker.rank}: test accuracy {accuracy:.4f}", flush=True)
    if args.record:
        os.makedirs(args.record, exist_ok=True)
        torch.save(initial, os.path.join(args.record, f"initial-{worker.rank}.pt"))
        torch.save({k: v.cpu() for k, v in model.state_dict().items()},
                   os.path.join(args.record, f"final-{worker.rank}.pt"))
        with open(os.path.join(args.record, f"batches-{worker.rank}.json"), "w") as f:
            json.dump({"batches": batches, "accuracy": accuracy}, f)
    return 0


def mark(record, step, hold):
    """Tells a test that this process reached `step`; with `hold`, waits for
    its go (the worker's heartbeats go on meanwhile)."""
    os.makedirs(record, exist_ok=True)
    open(os.path.join(record, f"step-{step}.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 120
    while hold and not os.path.exists(os.path.join(record, "go")):
        if time.monotonic() > deadline:
            raise RuntimeError("--hold: no go within 120 s")
        time.sleep(0.05)


class Recording(torch.utils.data.Sampler):
    """A batch sampler that notes the batches it hands out (--record)."""

    def __init__(self, inner, batches):
        self.inner, self.batches = inner, batches

    def __iter__(self):
        for batch in self.inner:
            self.batches.append([int(i) for i in batch])
            yield batch

    def __len__(self):
        return len(self.inner)


if __name__ == "__main__":
    sys.exit(main())
