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
import shutil
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import json_format

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
    """`pstrain status --json` is the proto3 JSON mapping of the JobStatus the
    Python client gets: the same dict as json_format.MessageToDict."""
    _, job_id, _ = journey
    cli = cluster.cli("status", job_id, "--json")
    assert cli.returncode == 0, cli.stderr
    theirs = json.loads(cli.stdout.strip().splitlines()[-1])
    job = client_for(cluster).job(job_id)
    status = job.status()
    assert theirs == json_format.MessageToDict(
        status.proto, preserving_proto_field_name=True, including_default_value_fields=True)
    assert status.state == "SUCCEEDED" and theirs["state"] == "JOB_STATE_SUCCEEDED"
    assert (status.epoch, status.step, status.epochs) == (
        theirs["epoch"], int(theirs["step"]), theirs["spec"]["epochs"])
    metrics = job.metrics()
    assert metrics.confusion.shape == (10, 10) and metrics.confusion.dtype == np.int64
    assert metrics.confusion.flatten().tolist() == [int(c) for c in theirs["test"]["confusion"]]
    assert metrics.samples == int(theirs["test"]["samples"]) == metrics.confusion.sum() == TEST
    assert metrics.accuracy == theirs["test"]["accuracy"]
    assert metrics.accuracy == pytest.approx(np.trace(metrics.confusion) / TEST)
    assert metrics.f1 == theirs["test"]["f1"]
    assert job_id in [s.job_id for s in client_for(cluster).jobs()]
    listed = cluster.cli("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert theirs in json.loads(listed.stdout)["jobs"]


def colour_regions(rows, width, channels, classes):
    """{name: (pixels, first row, last row)} of the pixels each classifier
    in `classes` ({name: predicate(r, g, b)}) accepts, in one pass."""
    found = {name: [0, None, None] for name in classes}
    for y, row in enumerate(rows):
        for x in range(0, width * channels, channels):
            r, g, b = row[x], row[x + 1], row[x + 2]
            if r > 235 and g > 235 and b > 235:
                continue  # Background.
            for name, accepts in classes.items():
                if accepts(r, g, b):
                    f = found[name]
                    f[0] += 1
                    f[1] = y if f[1] is None else f[1]
                    f[2] = y
    return {name: tuple(f) for name, f in found.items()}


def near(rgb, tolerance):
    return lambda r, g, b: (abs(r - rgb[0]) <= tolerance and abs(g - rgb[1]) <= tolerance
                            and abs(b - rgb[2]) <= tolerance)


def test_history_and_the_html_report_render_in_chromium(cluster, journey, tmp_path):
    """The job's history (GetJobHistory) from Python, and `pstrain report`
    rendered by headless Chromium: the DOM holds one polyline point per
    history point in each curve, and the screenshot shows the curves' and
    the heat map's colours where the page puts them."""
    _, job_id, _ = journey
    job = client_for(cluster).job(job_id)
    status = job.status()
    history = job.history()
    steps = history["step"]
    assert len(steps) >= 3, history
    assert (np.diff(steps) > 0).all() and steps[-1] <= status.step, history
    assert np.isfinite(history["loss"]).all() and (history["loss"] > 0).all(), history
    assert ((history["train_accuracy"] >= 0) & (history["train_accuracy"] <= 1)).all(), history
    assert history["loss"][-1] < history["loss"][0], history  # It trained.
    assert (history["run"] == 1).all() and (np.diff(history["unix_ms"]) >= 0).all(), history

    page = str(tmp_path / "report.html")
    cli = cluster.cli("report", job_id, "-o", page)
    assert cli.returncode == 0, cli.stderr
    assert f"{job_id} SUCCEEDED: report written to {page}" in cli.stdout, cli.stdout
    also = str(tmp_path / "status-report.html")
    cli = cluster.cli("status", job_id, "--report", also)
    assert cli.returncode == 0 and f"{job_id} SUCCEEDED" in cli.stdout, cli.stderr
    with open(page) as a, open(also) as b:
        strip = lambda text: re.sub(r"Written by pstrain at [^<]*", "", text)
        assert strip(a.read()) == strip(b.read())

    chromium = shutil.which("chromium")
    assert chromium, "chromium is not installed (PSTRAIN_TEST_TOOLS=1 deploy/local/install-deps.sh)"
    chrome = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--hide-scrollbars", "--force-device-scale-factor=1",
              f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1360,2000"]
    dom = subprocess.run(chrome + ["--dump-dom", "file://" + page], capture_output=True,
                         text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for plot in ("loss-plot", "accuracy-plot", "throughput-plot"):
        match = re.search(rf'<svg id="{plot}".*?<polyline [^>]*points="([^"]*)"', dom.stdout,
                          re.S)
        assert match, plot
        assert len(match.group(1).split()) == len(steps), plot
    assert len(re.findall(r'<rect class="cell"', dom.stdout)) == 100  # 10 x 10 classes
    per_class = re.findall(r"<tr><td>\d+</td><td>[01]\.\d{4}</td>", dom.stdout)
    assert len(per_class) == 10, per_class

    shot = str(tmp_path / "report.png")
    run = subprocess.run(chrome + [f"--screenshot={shot}", "file://" + page],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and os.path.exists(shot), run.stderr[-2000:]
    sys.path.insert(0, os.path.join(REPO, "tests", "deploy"))
    from png_stats import decode_png
    with open(shot, "rb") as f:
        width, height, channels, rows = decode_png(f.read())
    found = colour_regions(rows, width, channels, {
        "loss": near((0xd6, 0x27, 0x28), 40),
        "accuracy": near((0x1f, 0x77, 0xb4), 25),
        "throughput": near((0x2c, 0xa0, 0x2c), 40)})
    for name in ("loss", "accuracy", "throughput"):
        assert found[name][0] > 200, f"the {name} curve is not drawn: {found} ({shot})"
    # The curves come first (loss beside accuracy, throughput below), then
    # the heat map: its blue cells fill a 10 x 10 grid below the curves.
    curves_end = max(found[name][2] for name in ("loss", "accuracy", "throughput"))
    # The heat map's cells from about half a row's share up are blue.
    heat = colour_regions(rows[curves_end + 1:], width, channels,
                          {"heat": lambda r, g, b: b - r >= 50 and r < 140})["heat"]
    assert heat[0] > 5000, f"the heat map is not drawn: {heat} below row {curves_end} ({shot})"


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


def test_mixed_precision_on_cpu_workers_fails_the_job_saying_why(cluster, journey):
    client = client_for(cluster)
    model = pstrain.Sequential([layers.Flatten(), layers.Dense(10)], input_shape=(1, 28, 28))
    with pytest.raises(ValueError, match="precision must be one of"):
        client.submit(model, pstrain.datasets.FashionMNIST(), pstrain.optimizers.SGD(0.01),
                      epochs=1, precision="fp8")
    job = client.submit(model, pstrain.datasets.FashionMNIST(), pstrain.optimizers.SGD(0.01),
                        epochs=1, precision="bf16")
    final = job.watch(progress=False, timeout=120)
    assert final.state == "FAILED"
    assert "precision bf16 needs a CUDA device" in final.reason


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
    # Pull compression is for sync mode: the server refuses it in async.
    with pytest.raises(pstrain.InvalidArgumentError, match="pull_compression applies to"):
        client.submit(model, pstrain.datasets.FashionMNIST(), pstrain.optimizers.SGD(0.01),
                      epochs=1, mode="async", pull_compression="fp16")
    with pytest.raises(ValueError, match="pull_compression must be one of"):
        client.submit(model, pstrain.datasets.FashionMNIST(), pstrain.optimizers.SGD(0.01),
                      epochs=1, pull_compression="zstd")
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
