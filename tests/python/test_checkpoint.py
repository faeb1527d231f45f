"""pstrain.load_checkpoint reads what the C++ code writes: a real checkpoint
saved by `pstrain-worker --standalone` (format 2) from a model made in
Python, the same data as a format-1 envelope and as format 2 cut into small
parts (both also read back by the C++ reader), and corrupt files refused."""

import json
import os
import struct
import subprocess
import zlib

import numpy as np
import pytest
from google.protobuf import json_format

import pstrain
from pstrain import layers
from pstrain.v1 import checkpoint_pb2, job_pb2

TRAIN, TEST, BATCH = 512, 256, 64


def small_model():
    return pstrain.Sequential(
        [layers.Conv2D(4, 3, padding="same"), layers.BatchNormalization(), layers.ReLU(),
         layers.MaxPool2D(2), layers.Flatten(), layers.Dense(10)],
        input_shape=(1, 28, 28), name="ckpt-test", init_seed=5)


def job_spec(model, fashion_mnist):
    return job_pb2.JobSpec(
        name="ckpt-test", model=model.to_spec(),
        dataset=pstrain.datasets.FashionMNIST(fashion_mnist, train_limit=TRAIN,
                                              test_limit=TEST).to_spec(),
        optimizer=pstrain.optimizers.SGD(0.05, momentum=0.9).to_spec(),
        epochs=1, batch_size=BATCH, seed=1)


def run_worker(bin_dir, *args):
    result = subprocess.run([os.path.join(bin_dir, "pstrain-worker"), *args, "--device", "cpu",
                             "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(bin_dir, fashion_mnist, tmp_path_factory):
    """(model, path of the checkpoint the C++ worker wrote, its evaluation JSON)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    model = small_model()
    job_path = str(tmp / "job.json")
    with open(job_path, "w") as f:
        f.write(json_format.MessageToJson(job_spec(model, fashion_mnist)))
    ckpt_path = str(tmp / "model.ckpt")
    run_worker(bin_dir, "--standalone", job_path, "--checkpoint", ckpt_path)
    evaluation = run_worker(bin_dir, "--evaluate", ckpt_path)
    return model, ckpt_path, evaluation


def test_reads_the_workers_checkpoint(trained):
    model, path, _ = trained
    with open(path, "rb") as f:
        assert f.read(8) == b"PSTCKPT2"  # What pstrain writes today: format 2.
    ckpt = pstrain.load_checkpoint(path)
    assert ckpt.spec.model == model.to_spec()
    assert ckpt.model == model
    assert ckpt.step == TRAIN // BATCH and ckpt.epoch == 1
    assert [(name, w.shape) for name, w in ckpt.weights.items()] == model.parameters
    for name, w in ckpt.weights.items():
        assert w.dtype == np.float32 and np.all(np.isfinite(w)), name
    # Trained: batch norm's running mean moved off its initial zeros.
    assert np.any(ckpt.weights["bn1/running_mean"] != 0)
    # SGD with momentum keeps one slot per trainable parameter.
    trainable = [name for name, _ in model.parameters if "/running_" not in name]
    assert sorted(ckpt.optimizer_state) == sorted(f"{n}/momentum" for n in trainable)


def format1(ckpt_proto, version=1):
    payload = ckpt_proto.SerializeToString()
    return checkpoint_pb2.CheckpointFile(format_version=version, checkpoint=payload,
                                         crc32=zlib.crc32(payload)).SerializeToString()


def format2(ckpt_proto, max_part_bytes):
    """checkpoint.proto's parts, each tensor cut into max_part_bytes slices."""
    def part(kind, payload):
        header = struct.pack("<IQ", kind, len(payload))
        return header + payload + struct.pack("<I", zlib.crc32(payload, zlib.crc32(header)))
    meta = checkpoint_pb2.Checkpoint()
    meta.CopyFrom(ckpt_proto)
    del meta.parameters[:]
    del meta.optimizer_state[:]
    out = [b"PSTCKPT2", part(1, checkpoint_pb2.CheckpointManifest(
        meta=meta, parameters=len(ckpt_proto.parameters),
        optimizer_state=len(ckpt_proto.optimizer_state)).SerializeToString())]
    for t in list(ckpt_proto.parameters) + list(ckpt_proto.optimizer_state):
        for offset in range(0, max(len(t.data), 1), max_part_bytes):
            piece = checkpoint_pb2.TensorPart(offset=offset)
            piece.tensor.CopyFrom(t)
            piece.tensor.data = t.data[offset:offset + max_part_bytes]
            out.append(part(2, piece.SerializeToString()))
    out.append(part(3, struct.pack("<Q", len(out) - 1)))
    return b"".join(out)


@pytest.mark.parametrize("layout", ["format1", "format2_small_parts"])
def test_other_layouts_read_the_same_here_and_in_cpp(bin_dir, trained, tmp_path, layout):
    _, path, evaluation = trained
    original = pstrain.load_checkpoint(path)
    data = format1(original.proto) if layout == "format1" else format2(original.proto, 100)
    other = str(tmp_path / "other.ckpt")
    with open(other, "wb") as f:
        f.write(data)
    ckpt = pstrain.load_checkpoint(other)
    assert ckpt.spec == original.spec and ckpt.step == original.step
    assert ckpt.weights.keys() == original.weights.keys()
    for name in original.weights:
        np.testing.assert_array_equal(ckpt.weights[name], original.weights[name])
    # The C++ reader takes the same file and finds the same model in it.
    assert run_worker(bin_dir, "--evaluate", other)["test_accuracy"] == evaluation["test_accuracy"]


def test_corrupt_files_are_refused(trained, tmp_path):
    _, path, _ = trained
    with open(path, "rb") as f:
        data = f.read()

    def load(content):
        bad = str(tmp_path / "bad.ckpt")
        with open(bad, "wb") as f:
            f.write(content)
        return pstrain.load_checkpoint(bad)

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    with pytest.raises(pstrain.DataLossError, match="checksum mismatch"):
        load(bytes(flipped))
    with pytest.raises(pstrain.DataLossError, match="incomplete|cut short"):
        load(data[:-10])
    with pytest.raises(pstrain.DataLossError, match="bytes after the end part"):
        load(data + b"\0")
    with pytest.raises(pstrain.DataLossError, match="not a pstrain checkpoint"):
        load(b"hello, world")
    original = pstrain.load_checkpoint(path).proto
    with pytest.raises(pstrain.FailedPreconditionError, match="unsupported format_version 7"):
        load(format1(original, version=7))
    envelope = checkpoint_pb2.CheckpointFile.FromString(format1(original))
    envelope.crc32 ^= 1
    with pytest.raises(pstrain.DataLossError, match="checksum mismatch"):
        load(envelope.SerializeToString())
