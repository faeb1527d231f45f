"""The Python journey against a real cluster: one pstrain-server and two CPU
workers with TLS, client certificates and tokens (cluster.py), started for
these tests and killed at the end.

examples/python/fashion_mnist.py runs as a user runs it (the cluster in the
PSTRAIN_* variables) on a Fashion-MNIST subset; its job is then checked
against the C++ CLI (`pstrain status --json`, `pstrain download`), and the
errors the server gives reach Python as the matching exceptions."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import pstrain
from pstrain import layers

pytestmark = pytest.mark.cluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "python", "fashion_mnist.py")
# The C++ integration tests' subset: 3200 training samples, 1000 test, 2 epochs.
TRAIN, TEST, EPOCHS = 3200, 1000, 2


@pytest.fixture(scope="module")
def journey(cluster, fashion_mnist, tmp_path_factory):
    """Runs the example once: (its output, job id, checkpoint path)."""
    ckpt = str(tmp_path_factory.mktemp("journey") / "fashion-mnist.ckpt")
    env = dict(os.environ, **cluster.admin_env())
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--epochs", str(EPOCHS), "--train-limit", str(TRAIN),
         "--test-limit", str(TEST), "-o", ckpt],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (f"{result.stdout}\n{result.stderr}\n{cluster.logs()}")
    job_id = re.search(r"^(job-\d+) SUCCEEDED\b", result.stdout, re.M)
    assert job_id, result.stdout
    return result.stdout, job_id.group(1), ckpt


def client_for(cluster, **overrides):
    kwargs = dict(cluster.admin_credentials(), timeout=10.0)
    kwargs.update(overrides)
    return pstrain.Client(cluster.address, **kwargs)


def test_example_runs_end_to_end(journey):
    out, job_id, ckpt_path = journey
    assert 'Model: "fmnist-cnn"' in out and "Total params: 3274634" in out  # summary
    assert re.search(rf"^{job_id} RUNNING  epoch \d/{EPOCHS}  step \d+/\d+ \[", out, re.M), out
    assert "test: accuracy" in out and "true\\pred" in out  # the final report
    accuracy = float(re.search(r"^test accuracy (\S+); most confused", out, re.M).group(1))
    assert accuracy > 0.5, out  # Chance is 0.1; the C++ tests see > 0.6 on this subset.
    assert re.search(r"step \d+, conv1/weight \(32, 1, 5, 5\)$", out, re.M), out
    ckpt = pstrain.load_checkpoint(ckpt_path)
    assert ckpt.spec.model.name == "fmnist-cnn" and ckpt.epoch == EPOCHS
    assert "ONNX: inputs ['input'], outputs ['logits', 'probabilities']" in out, out
    assert os.path.getsize(ckpt_path.replace(".ckpt", ".onnx")) > 0


def test_cli_exports_a_job_by_id(cluster, journey, tmp_path):
    """`pstrain export JOB` downloads the job's checkpoint and writes the same
    weights as the Python export of the downloaded file (numerical parity with
    onnxruntime: tests/tools/onnx_export_test.py)."""
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper
    _, job_id, ckpt_path = journey
    path = str(tmp_path / "by-id.onnx")
    cli = cluster.cli("export", job_id, "-o", path)
    assert cli.returncode == 0, cli.stderr
    assert "ONNX opset 13" in cli.stdout, cli.stdout
    assert not os.path.exists(path + ".ckpt")  # The download is removed.
    model = onnx.load(path)
    onnx.checker.check_model(model)
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    ckpt = pstrain.load_checkpoint(ckpt_path)
    assert weights.keys() == ckpt.weights.keys()
    for name, value in ckpt.weights.items():
        np.testing.assert_array_equal(weights[name].reshape(value.shape), value)


def test_status_and_metrics_are_the_clis(cluster, journey):
    _, job_id, _ = journey
    cli = cluster.cli("status", job_id, "--json")
    assert cli.returncode == 0, cli.stderr
    theirs = json.loads(cli.stdout.strip().splitlines()[-1])
    job = client_for(cluster).job(job_id)
    status = job.status()
    assert status.state == theirs["state"] == "SUCCEEDED"
    assert (status.epoch, status.step, status.epochs) == (
        theirs["epoch"], theirs["step"], theirs["epochs"])
    metrics = job.metrics()
    assert metrics.confusion.shape == (10, 10) and metrics.confusion.dtype == np.int64
    assert metrics.confusion.tolist() == theirs["confusion"]
    assert metrics.samples == theirs["test_samples"] == metrics.confusion.sum() == TEST
    assert metrics.accuracy == pytest.approx(theirs["test_accuracy"], abs=1e-6)
    assert metrics.accuracy == pytest.approx(np.trace(metrics.confusion) / TEST)
    assert metrics.f1 == pytest.approx(theirs["f1"], abs=1e-6)
    assert job_id in [s.job_id for s in client_for(cluster).jobs()]


def test_download_is_what_the_cli_downloads(cluster, journey, tmp_path):
    _, job_id, _ = journey
    cli_path, py_path = str(tmp_path / "cli.ckpt"), str(tmp_path / "py.ckpt")
    cli = cluster.cli("download", job_id, "-o", cli_path)
    assert cli.returncode == 0, cli.stderr
    ckpt = client_for(cluster).job(job_id).download(py_path)
    with open(cli_path, "rb") as a, open(py_path, "rb") as b:
        assert a.read() == b.read()
    from_cli = pstrain.load_checkpoint(cli_path)
    assert f"{len(from_cli.weights)} tensors, step {from_cli.step}, epoch {EPOCHS}" in cli.stdout
    assert ckpt.weights.keys() == from_cli.weights.keys()
    for name, w in ckpt.weights.items():
        np.testing.assert_array_equal(w, from_cli.weights[name])
    assert [(n, w.shape) for n, w in ckpt.weights.items()] == ckpt.model.parameters


def test_cancel(cluster, journey):
    model = pstrain.Sequential([layers.Dense(10)], input_shape=(1, 28, 28), name="to-cancel")
    client = client_for(cluster)
    job = client.submit(model, pstrain.datasets.FashionMNIST(), pstrain.optimizers.SGD(0.01),
                        epochs=50, workers=2)
    assert job.cancel().state == "CANCELLED"
    final = job.watch(progress=False, timeout=60)
    assert final.state == "CANCELLED" and final.reason == "cancelled by user"
    with pytest.raises(pstrain.FailedPreconditionError, match="is CANCELLED"):
        job.metrics()


def test_server_errors_become_exceptions(cluster, journey, tmp_path):
    client = client_for(cluster)
    with pytest.raises(pstrain.NotFoundError, match="unknown job 'job-999'"):
        client.job("job-999").status()
    # The server's own validation message for a bad job.
    model = pstrain.Sequential([layers.Dense(10)], input_shape=(1, 28, 28))
    with pytest.raises(pstrain.InvalidArgumentError, match=r"^epochs must be > 0, got 0$"):
        client.submit(model, pstrain.datasets.FashionMNIST(), pstrain.optimizers.SGD(0.01),
                      epochs=0)
    # Compression is for gradient pushes: the server refuses it in average mode.
    with pytest.raises(pstrain.InvalidArgumentError, match="compression applies to gradient"):
        client.submit(model, pstrain.datasets.FashionMNIST(), pstrain.optimizers.SGD(0.01),
                      epochs=1, mode="average", compression="topk", topk_ratio=0.01)
    with pytest.raises(ValueError, match="compression must be one of"):
        client.submit(model, pstrain.datasets.FashionMNIST(), pstrain.optimizers.SGD(0.01),
                      epochs=1, compression="gzip")
    # A bad model sent as it is: the server refuses it with the message
    # Python gives for it.
    with pytest.raises(pstrain.InvalidModelError) as local:
        pstrain.Sequential([layers.Dense(10)], input_shape=(1, 28, 28), num_classes=5)
    spec = pstrain.v1.job_pb2.JobSpec(
        name="bad", model=local.value.spec, dataset=pstrain.datasets.FashionMNIST().to_spec(),
        optimizer=pstrain.optimizers.SGD(0.01).to_spec(), epochs=1, batch_size=64)
    with pytest.raises(pstrain.InvalidArgumentError) as remote:
        client.submit_spec(spec)
    assert remote.value.message == "model: " + local.value.message
    # Credentials: a wrong token, and no client certificate (mTLS).
    wrong = tmp_path / "wrong.token"
    wrong.write_text("0123456789abcdef0123456789abcdef\n")
    with pytest.raises(pstrain.UnauthenticatedError):
        client_for(cluster, token_file=str(wrong)).jobs()
    no_cert = client_for(cluster, tls=pstrain.TLS(ca=f"{cluster.certs}/ca.pem"), timeout=2.0)
    with pytest.raises((pstrain.UnavailableError, pstrain.DeadlineExceededError)):
        no_cert.jobs()
