#!/usr/bin/env python3
"""ONNX export against onnxruntime, a runtime we did not write.

For Fashion-MNIST's CNN (trained briefly on the real data), resnet-small and
a model with every layer kind (trained briefly on synthetic data, so that
batch norm's running statistics are not the initial ones):
  1. `pstrain-worker --standalone` trains and writes a checkpoint;
  2. `pstrain-worker --evaluate --limit 256 --logits-out --inputs-out` writes
     the logits and inputs of the first 256 test samples;
  3. `pstrain export` (C++) and `pstrain.Checkpoint.export_onnx()` (Python)
     each write an ONNX model; onnx.checker.check_model (full check) passes;
  4. onnxruntime runs each model on those inputs: the logits must match the
     worker's within 1e-4 relative (max |difference| <= 1e-4 x the largest
     |logit| of the batch), the predicted classes must all agree and the
     probabilities must be the logits' softmax.
For Fashion-MNIST it also checks the documented input contract: the worker's
inputs are (pixel / 255 - 0.2860) / 0.3530 of the t10k IDX file's images.

Runs with a Python that has onnx (Debian's python3-onnx) and onnxruntime
(PyPI): <build>/venv-onnx, made by deploy/local/test.sh.
"""

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile

EVERY_KIND = {
    "name": "every-kind", "input_shape": [2, 9, 9], "num_classes": 3, "layers": [
        {"name": "c", "conv2d": {"filters": 4, "kernel_size": 3, "stride": 2, "padding": 1}},
        {"name": "bn", "batch_norm": {"epsilon": 0.001}},
        {"name": "lr", "leaky_relu": {"alpha": 0.2}},
        {"name": "mp", "max_pool": {"pool_size": 3, "stride": 1, "padding": 1}},
        {"name": "ap", "avg_pool": {"pool_size": 3, "stride": 1, "padding": 1},
         "inputs": ["lr"]},
        {"name": "t", "tanh": {}, "inputs": ["ap"]},
        {"name": "s", "sigmoid": {}, "inputs": ["mp"]},
        {"name": "sum", "add": {}, "inputs": ["mp", "t", "s"]},
        {"name": "d", "dropout": {"rate": 0.5}},
        {"name": "fc", "dense": {"units": 5, "no_bias": True}},
        {"name": "bn1d", "batch_norm": {}},
        {"name": "r", "relu": {}},
        {"name": "logits", "dense": {"units": 3}},
        {"name": "loss", "softmax_cross_entropy": {}}]}


def synthetic_job(name, model, channels, height, width, classes):
    return {
        "name": name, "model": model,
        "dataset": {"format": "DATASET_FORMAT_SYNTHETIC",
                    "synthetic": {"channels": channels, "height": height, "width": width,
                                  "num_classes": classes, "train_samples": 512,
                                  "test_samples": 256, "seed": 5}},
        "optimizer": {"type": "OPTIMIZER_SGD", "learning_rate": 0.05, "momentum": 0.9},
        "epochs": 1, "batch_size": 64, "seed": 3}


def run(cmd, **kwargs):
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    if done.returncode != 0:
        sys.exit(f"FAIL: {cmd[0]} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def idx_images(path, count):
    import numpy as np
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    n, h, w = (int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(3))
    assert n >= count, (path, n)
    return np.frombuffer(data, np.uint8, count * h * w, 16).reshape(count, 1, h, w)


def check_case(args, name, job_path, tmp, fmnist_dir=None):
    import numpy as np
    import onnx
    import onnxruntime as ort
    import pstrain

    ckpt = os.path.join(tmp, f"{name}.ckpt")
    run([args.worker, "--standalone", job_path, "--device", "cpu", "--epochs", "1", "--limit",
         "2048", "--checkpoint", ckpt])
    logits_path = os.path.join(tmp, f"{name}-logits.npy")
    inputs_path = os.path.join(tmp, f"{name}-inputs.npy")
    run([args.worker, "--evaluate", ckpt, "--device", "cpu", "--limit", "256",
         "--logits-out", logits_path, "--inputs-out", inputs_path])
    want = np.load(logits_path)
    x = np.load(inputs_path)
    assert want.shape[0] == 256 and x.shape[0] == 256, (want.shape, x.shape)

    if fmnist_dir is not None:
        images = None
        for f in ("t10k-images-idx3-ubyte", "t10k-images-idx3-ubyte.gz"):
            if os.path.exists(os.path.join(fmnist_dir, f)):
                images = idx_images(os.path.join(fmnist_dir, f), 256)
                break
        assert images is not None, f"no t10k images in {fmnist_dir}"
        expected = (images.astype(np.float32) / 255.0 - np.float32(0.2860)) / np.float32(0.3530)
        np.testing.assert_allclose(x, expected, rtol=0, atol=1e-5,
                                   err_msg="the worker's inputs are not the documented "
                                           "normalisation of the IDX pixels")

    cpp_path = os.path.join(tmp, f"{name}.onnx")
    run([args.cli, "export", ckpt, "-o", cpp_path])
    py_path = os.path.join(tmp, f"{name}-py.onnx")
    pstrain.load_checkpoint(ckpt).export_onnx(py_path)

    for which, path in (("pstrain export", cpp_path), ("Checkpoint.export_onnx", py_path)):
        model = onnx.load(path)
        onnx.checker.check_model(model, full_check=True)
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        got, probs = session.run(["logits", "probabilities"], {"input": x})
        scale = float(np.abs(want).max())
        diff = float(np.abs(got - want).max())
        agree = float((got.argmax(1) == want.argmax(1)).mean())
        print(f"{name} ({which}): {len(model.graph.node)} nodes; max |onnxruntime - worker| "
              f"= {diff:.3g} = {diff / scale:.3g} of the largest |logit| ({scale:.3g}); "
              f"argmax agrees on {agree:.0%}", flush=True)
        if diff > 1e-4 * scale:
            sys.exit(f"FAIL: {name} via {which}: logits differ by {diff} (> 1e-4 x {scale})")
        # A different predicted class is only allowed where the worker's top
        # two logits are closer than the tolerance (a tie either could break).
        top2 = np.sort(want, 1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 2e-4 * scale
        if not (got.argmax(1) == want.argmax(1))[clear].all():
            sys.exit(f"FAIL: {name} via {which}: predicted classes differ")
        e = np.exp(got - got.max(1, keepdims=True))
        np.testing.assert_allclose(probs, e / e.sum(1, keepdims=True), rtol=1e-5, atol=1e-6)
    # Both exports describe the same graph.
    a, b = onnx.load(cpp_path), onnx.load(py_path)
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node], name
    assert {p.key: p.value for p in a.metadata_props}.keys() == \
        {p.key: p.value for p in b.metadata_props}.keys(), name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("--fashion-mnist", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--onnx-python", default="",
                        help="a Python with onnx and onnxruntime, run instead of this one when "
                             "this one lacks them")
    args = parser.parse_args()
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as e:
        if args.onnx_python and os.path.exists(args.onnx_python) and \
                os.path.abspath(args.onnx_python) != os.path.abspath(sys.executable) and \
                "PSTRAIN_ONNX_REEXEC" not in os.environ:
            os.environ["PSTRAIN_ONNX_REEXEC"] = "1"
            os.execv(args.onnx_python, [args.onnx_python] + sys.argv)
        sys.exit(f"FAIL: {e} (Python {sys.executable}): this test needs onnx (Debian's "
                 f"python3-onnx) and onnxruntime (PyPI); deploy/local/test.sh installs them in "
                 f"{args.onnx_python or '<build>/venv-onnx'}")

    with tempfile.TemporaryDirectory(prefix="pstrain-onnx-") as tmp:
        check_case(args, "fmnist-cnn", os.path.join(args.source_dir, "examples/fashion-mnist.json"),
                   tmp, fmnist_dir=args.fashion_mnist)
        with open(os.path.join(args.source_dir, "examples/models/resnet-small.json")) as f:
            resnet = json.load(f)
        for name, job in (("resnet-small", synthetic_job("resnet-small", resnet, 3, 32, 32, 10)),
                          ("every-kind", synthetic_job("every-kind", EVERY_KIND, 2, 9, 9, 3))):
            path = os.path.join(tmp, f"{name}.json")
            with open(path, "w") as f:
                json.dump(job, f)
            check_case(args, name, path, tmp)
    print("PASS: ONNX exports match onnxruntime for fmnist-cnn, resnet-small and every layer kind")


if __name__ == "__main__":
    main()
