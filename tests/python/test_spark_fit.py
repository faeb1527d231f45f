"""pstrain.spark on a real Spark standalone cluster on 127.0.0.1
(spark_cluster.py: a Master and two 1-core Workers, each executor its own
JVM), against real pstrain servers (cluster.py's, with TLS, mTLS and
tokens; or one a fit starts on the driver):

* Estimator.fit on a DataFrame of Fashion-MNIST PNGs (binaryFile), sync and
  average mode, the second fit reusing the packing; transform against
  `pstrain-worker --evaluate` on the same checkpoint; save/load; no secret
  in Spark's UI, event log or a task's closure.
* bad DataFrames refused naming the column and partition;
* a vector column and a small MLP; a PyTorch module through Estimator and
  through run();
* kill -9 of an executor JVM mid-epoch (the stage retried once, the same
  job SUCCEEDED with every sample once); the retries exhausted (the job
  CANCELLED with the cause); cancelAllJobs on the driver.

Bounded: 4,000 training images, 2 or 3 epochs a fit.

    PYTHONPATH=build/python build/venv-spark/bin/python3 -m pytest tests/python/test_spark_fit.py \\
        -p no:cacheprovider -q -m spark --bin-dir=build/bin
"""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pyspark = pytest.importorskip("pyspark")

import pstrain  # noqa: E402
from pstrain import layers  # noqa: E402
from pstrain.spark import (MANIFEST, Estimator, PrepareError, SparkTrainingError,  # noqa: E402
                           prepare, run)
from pstrain.spark import Model as SparkModel  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from cluster import LocalCluster  # noqa: E402
from spark_cluster import read_fashion_mnist, write_fashion_mnist_pngs  # noqa: E402

pytestmark = pytest.mark.spark

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One Spark application for these tests, with a stage allowed two attempts:
# one lost executor is retried once, a second loss exhausts the retries.

TRAIN_IMAGES = 4000
TEST_IMAGES = 1000


@pytest.fixture(scope="module")
def spark(spark_cluster):
    session = spark_cluster.session("pstrain-spark-fit", conf={
        "spark.stage.maxConsecutiveAttempts": "2",
        # A killed task's Python worker goes at once (the C++ trainer does
        # not return to Python until its job ends).
        "spark.python.task.killTimeout": "1s",
    })
    yield session
    spark_cluster.stop_session()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("fmnist-png")
    write_fashion_mnist_pngs(str(root / "train"), "train", TRAIN_IMAGES)
    write_fashion_mnist_pngs(str(root / "test"), "test", TEST_IMAGES)
    return root


def png_frame(spark, directory, partitions=4):
    """Fashion-MNIST PNGs as binaryFile gives them, with the label from the folder."""
    return (spark.read.format("binaryFile").load(f"{directory}/*/*.png")
            .withColumn("label", F.regexp_extract("path", r"/(\d+)/[^/]+$", 1).cast("int"))
            .repartition(partitions, "path").sortWithinPartitions("path"))


@pytest.fixture(scope="module")
def secured(bin_dir, source_dir, tmp_path_factory):
    """A pstrain-server with TLS, mTLS and per-role tokens, and no workers
    of its own: the Spark tasks are its workers."""
    with LocalCluster(bin_dir, source_dir, str(tmp_path_factory.mktemp("secured")),
                      workers=0, server_args=["--heartbeat-timeout-ms", "3000",
                                              "--checkpoint-interval-s", "3"]) as cluster:
        yield cluster


def worker_credentials(cluster):
    c = cluster.certs
    return {"tls_ca": f"{c}/ca.pem", "tls_cert": f"{c}/worker.pem",
            "tls_key": f"{c}/worker-key.pem", "token_file": f"{c}/worker.token"}


def mlp():
    return pstrain.Sequential([layers.Flatten(), layers.Dense(64), layers.ReLU(),
                               layers.Dense(10)], input_shape=(1, 28, 28), name="spark-mlp")


@pytest.mark.spark
def test_fit_with_tls_and_tokens_then_average_mode_reuses_the_packing(
        spark, spark_cluster, images, secured, bin_dir, tmp_path):
    """Estimator.fit on a DataFrame of Fashion-MNIST PNGs, sync then average
    mode, 2 workers as one barrier stage, against a server with TLS and
    tokens: both SUCCEEDED above 0.72 test accuracy in 3 epochs (0.77-0.80
    seen in 2); the second
    fit reuses the packing; transform on the packed test rows predicts what
    `pstrain-worker --evaluate` predicts from the same checkpoint; no
    secret reaches Spark's UI, its event log or a task's closure."""
    df = png_frame(spark, images / "train")
    store = str(tmp_path / "store")
    common = dict(server=secured.address, store=store, features="content", label="label",
                  image_size=(28, 28), channels=1, workers=2, epochs=3, batch_size=32,
                  optimizer=pstrain.optimizers.SGD(0.05, momentum=0.9), progress=False,
                  worker_credentials=worker_credentials(secured),
                  **secured.admin_credentials())
    sync = Estimator(mlp(), mode="sync", **common)
    fitted = sync.fit(df)
    assert not sync.last_prepared.reused
    assert fitted.status.state == "SUCCEEDED", fitted.status.report()
    assert fitted.metrics.accuracy > 0.72, fitted.status.report()
    # Every member's samples once in each epoch.
    for e in fitted.status.proto.epoch_samples:
        assert e.samples == e.expected == sync.last_prepared.train_samples, e

    average = Estimator(mlp(), mode="average", averaging_frequency=4, **common)
    averaged = average.fit(df)
    assert average.last_prepared.reused and average.last_prepared.uri == sync.last_prepared.uri
    assert averaged.metrics.accuracy > 0.72, averaged.status.report()

    # transform on the packed test rows (every 10th row of each partition)
    # against the C++ evaluation of the same checkpoint on the packing.
    every = 10
    test_rows = df.rdd.mapPartitions(
        lambda rows: (r for i, r in enumerate(rows) if i % every == every - 1))
    test_df = spark.createDataFrame(test_rows, df.schema)
    predicted = fitted.transform(test_df).select("prediction", "probability", "label").collect()
    ckpt = tmp_path / "fitted.ckpt"
    ckpt.write_bytes(fitted.checkpoint_bytes)
    logits = tmp_path / "logits.npy"
    done = subprocess.run([os.path.join(bin_dir, "pstrain-worker"), "--evaluate", str(ckpt),
                           "--logits_out", str(logits), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    evaluated = np.load(logits).argmax(axis=1)
    assert len(evaluated) == len(predicted) == sync.last_prepared.test_samples
    assert [r.prediction for r in predicted] == evaluated.tolist()
    accuracy = np.mean([r.prediction == r.label for r in predicted])
    assert abs(accuracy - fitted.metrics.accuracy) < 1e-9, (accuracy, fitted.metrics.accuracy)
    assert all(abs(sum(r.probability) - 1) < 1e-6 for r in predicted)

    # Saved and loaded with Spark ML's conventions, it predicts the same.
    fitted.write().overwrite().save(str(tmp_path / "saved"))
    loaded = SparkModel.load(str(tmp_path / "saved"))
    again = loaded.transform(test_df).select("prediction").collect()
    assert [r.prediction for r in again] == [r.prediction for r in predicted]
    assert loaded.metrics.accuracy == fitted.metrics.accuracy
    assert "<html" in loaded.report_html.lower()
    onnx_path = tmp_path / "model.onnx"
    loaded.export_onnx(str(onnx_path))
    assert onnx_path.stat().st_size > 1000

    # No secret in the UI's environment, the event log or a task's closure.
    secrets = [open(path).read().strip() for path in (
        f"{secured.certs}/admin.token", f"{secured.certs}/worker.token")]
    secrets.append(open(f"{secured.certs}/worker-key.pem").read().split("\n")[1])
    import urllib.request
    app = spark.sparkContext.applicationId
    ui = spark.sparkContext.uiWebUrl
    environment = urllib.request.urlopen(f"{ui}/api/v1/applications/{app}/environment",
                                         timeout=30).read().decode()
    page = urllib.request.urlopen(f"{ui}/environment/", timeout=30).read().decode()
    events = "".join(open(os.path.join(spark_cluster.event_log_dir, name), errors="replace").read()
                     for name in os.listdir(spark_cluster.event_log_dir))
    from pstrain import spark as pspark
    from pyspark import cloudpickle
    closure = cloudpickle.dumps(pspark._model_spec_task(
        secured.address, "job-1", pspark._worker_credentials(worker_credentials(secured)),
        store, 1))
    for secret in secrets:
        assert len(secret) > 16
        for where, text in (("the UI's environment", environment), ("the environment page", page),
                            ("the event log", events)):
            assert secret not in text, f"a secret in {where}"
        assert secret.encode() not in closure, "a secret in the task closure"


@pytest.mark.spark
def test_bad_dataframes_are_refused_naming_the_column_and_partition(spark, images, tmp_path):
    store = str(tmp_path / "store")
    rows = [(i % 10 if i != 7 else None, [float(i), 1.0]) for i in range(40)]
    df = spark.createDataFrame(rows, "label int, x array<double>").repartition(2)
    with pytest.raises(PrepareError, match=r"label: column 'label' is null in row \d+ of "
                                           r"partition \d"):
        prepare(df, store, features="x", label="label")
    wrong = spark.createDataFrame([(1, "a")], "label int, x string")
    with pytest.raises(PrepareError, match="column 'x' is string"):
        prepare(wrong, store, features="x", label="label")
    floats = spark.createDataFrame([(1.5, [1.0])], "label double, x array<double>")
    with pytest.raises(PrepareError, match="column 'label' is double"):
        prepare(floats, store, features="x", label="label")
    good = png_frame(spark, images / "test", partitions=2).limit(60)
    broken = good.withColumn("content", F.when(F.col("path").endswith("7.png"),
                                               F.lit(b"not a png")).otherwise(F.col("content")))
    with pytest.raises(PrepareError, match=r"column 'content', row \d+ of partition \d+ "
                                           r"\(.*7\.png\): not an image"):
        prepare(broken, store, features="content", label="label", image_size=(28, 28))
    # Nothing was left that a job would read: no manifest anywhere.
    assert not any(MANIFEST in files for _, _, files in os.walk(store))


@pytest.mark.spark
def test_a_vector_column_trains_a_small_mlp(spark, tmp_path):
    """Fashion-MNIST as 14x14 mean-pooled feature vectors (VectorUDT), 2 workers."""
    from pyspark.ml.linalg import Vectors
    raw, labels = read_fashion_mnist("train", 3000)
    images = np.frombuffer(b"".join(raw), dtype=np.uint8).astype(np.float64)
    pooled = images.reshape(-1, 14, 2, 14, 2).mean(axis=(2, 4)).reshape(-1, 196) / 255.0
    df = spark.createDataFrame([(int(y), Vectors.dense(x)) for x, y in zip(pooled, labels)],
                               ["label", "features"]).repartition(2)
    model = pstrain.Sequential([layers.Dense(64), layers.ReLU(), layers.Dense(10)],
                               input_shape=(196,), name="vector-mlp")
    estimator = Estimator(model, store=str(tmp_path / "store"), featuresCol="features",
                          labelCol="label", workers=2, epochs=3, batch_size=32,
                          optimizer=pstrain.optimizers.SGD(0.1, momentum=0.9), progress=False)
    fitted = estimator.fit(df)
    assert estimator.last_prepared.shape == (1, 1, 196)
    assert fitted.metrics.accuracy > 0.7, fitted.status.report()
    out = fitted.transform(df.limit(200)).collect()
    assert np.mean([r.prediction == r.label for r in out]) > 0.7


@pytest.mark.spark
def test_a_pytorch_module_trains_through_estimator_and_run(spark, images, secured, tmp_path):
    """A torch module through Estimator (a server the fit starts on the
    driver), then examples/spark/torch_run.train through run() against the
    server with TLS, mTLS and tokens (the credentials file written on each
    executor)."""
    import torch
    import torch.nn.functional as TF
    module = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(),
                                 torch.nn.Linear(64, 10))
    df = png_frame(spark, images / "train")
    estimator = Estimator(module, loss=TF.cross_entropy, store=str(tmp_path / "store"),
                          features="content", label="label", image_size=(28, 28), workers=2,
                          epochs=2, batch_size=32, mode="sync",
                          optimizer=pstrain.optimizers.SGD(0.05, momentum=0.9), progress=False)
    fitted = estimator.fit(df)
    assert fitted.status.state == "SUCCEEDED", fitted.status.report()
    out = fitted.transform(png_frame(spark, images / "test").limit(300)).collect()
    assert np.mean([r.prediction == r.label for r in out]) > 0.7

    sys.path.insert(0, os.path.join(REPO_ROOT, "examples", "spark"))
    import torch_run
    # Executors cannot import the example's module: its functions travel by
    # value (as a spark-submit script's own functions do).
    from pyspark import cloudpickle
    cloudpickle.register_pickle_by_value(torch_run)
    status, losses = run(torch_run.train, 2, 2000, spark=spark, epochs=1, batch_size=32,
                         optimizer=pstrain.optimizers.SGD(0.05, momentum=0.9), progress=False,
                         server=secured.address, worker_credentials=worker_credentials(secured),
                         **secured.admin_credentials())
    assert status.state == "SUCCEEDED", status.report()
    assert len(losses) == 2 and all(0 < v < 2.3 for v in losses), losses
    assert [(e.samples, e.expected) for e in status.proto.epoch_samples] == [(2000, 2000)]


def python_workers_of(executor):
    """The Python workers an executor JVM's pyspark.daemon forked (they run
    its tasks)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))

    def cmdline(pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    daemons = [c for c in children.get(executor, []) if "pyspark.daemon" in cmdline(c)]
    return [w for d in daemons for w in children.get(d, [])]


def kill_an_executor_when(spark_cluster, client, predicate, timeout=120, what="executor JVM"):
    """kill -9 of one executor JVM (or of its Python workers) once the
    running job satisfies `predicate`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = [j for j in client.jobs() if j.state == "RUNNING"]
        if jobs and predicate(jobs[0]):
            executor = spark_cluster.executor_pids()[0]
            pids = [executor] if what == "executor JVM" else python_workers_of(executor)
            assert pids, f"no {what} to kill under executor {executor}"
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return jobs[0].job_id
        time.sleep(0.1)
    raise AssertionError("the job never got there")


@pytest.mark.spark
@pytest.mark.parametrize("what", ["executor JVM", "Python worker"])
def test_an_executor_killed_mid_epoch_is_retried_and_the_job_goes_on(
        spark, spark_cluster, images, secured, tmp_path, what):
    """kill -9 of one executor JVM, or of its Python worker, mid-epoch:
    Spark runs the barrier stage again once, its tasks join the same job,
    and it SUCCEEDED with every sample once per epoch."""
    df = png_frame(spark, images / "train")
    client = pstrain.Client(secured.address, **secured.admin_credentials())
    estimator = Estimator(mlp(), server=secured.address, store=str(tmp_path / "store"),
                          features="content", label="label", image_size=(28, 28), workers=2,
                          epochs=3, batch_size=16, progress=False,
                          optimizer=pstrain.optimizers.SGD(0.05, momentum=0.9),
                          worker_credentials=worker_credentials(secured),
                          **secured.admin_credentials())
    killed = {}
    killer = threading.Thread(target=lambda: killed.update(job=kill_an_executor_when(
        spark_cluster, client, lambda j: j.epoch == 1 and j.step > j.total_steps // 2,
        what=what)))
    killer.start()
    fitted = estimator.fit(df)
    killer.join(timeout=150)
    status = fitted.status
    assert status.job_id == killed["job"]
    assert status.state == "SUCCEEDED", status.report()
    assert status.runs == 2, status.report()  # Resumed once, as the same job.
    for e in status.proto.epoch_samples:
        assert e.samples == e.expected, status.report()
    assert estimator.last_stage_attempts == 2  # One retry.


@pytest.mark.spark
def test_when_the_retries_run_out_the_job_is_cancelled_with_the_cause(
        spark, spark_cluster, images, secured, tmp_path):
    df = png_frame(spark, images / "train")
    client = pstrain.Client(secured.address, **secured.admin_credentials())
    estimator = Estimator(mlp(), server=secured.address, store=str(tmp_path / "store"),
                          features="content", label="label", image_size=(28, 28), workers=2,
                          epochs=20, batch_size=16, progress=False,
                          worker_credentials=worker_credentials(secured),
                          **secured.admin_credentials())

    def kill_twice():
        first = kill_an_executor_when(spark_cluster, client, lambda j: j.step > 20)
        # The retried stage's run of the same job (run 2), then the second loss.
        kill_an_executor_when(spark_cluster, client,
                              lambda j: j.job_id == first and j.runs == 2 and j.step > 20)

    killer = threading.Thread(target=kill_twice)
    killer.start()
    with pytest.raises(SparkTrainingError, match="the Spark stage failed"):
        estimator.fit(df)
    killer.join(timeout=150)
    job = [j for j in client.jobs() if j.name == "spark-fit"][0]
    assert job.state == "CANCELLED", job.report()
    assert "the Spark stage failed" in job.reason
    assert not [j for j in client.jobs() if j.state == "RUNNING"]


@pytest.mark.spark
def test_cancel_all_jobs_or_ctrl_c_on_the_driver_cancels_the_pstrain_job(
        spark, images, secured, tmp_path):
    df = png_frame(spark, images / "train")
    client = pstrain.Client(secured.address, **secured.admin_credentials())
    estimator = Estimator(mlp(), server=secured.address, store=str(tmp_path / "store"),
                          features="content", label="label", image_size=(28, 28), workers=2,
                          epochs=50, batch_size=16, progress=False, name="to-cancel",
                          worker_credentials=worker_credentials(secured),
                          **secured.admin_credentials())

    def when_running(name, action):
        """A thread that calls `action` once job `name` is 5 steps into its run."""
        def wait():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if any(j.name == name and j.state == "RUNNING" and j.step > 5
                       for j in client.jobs()):
                    action()
                    return
                time.sleep(0.1)
        return threading.Thread(target=wait)

    # cancelAllJobs, then Ctrl-C on the driver (SIGINT's KeyboardInterrupt
    # in its main thread).
    import _thread
    for name, action, raised in (("to-cancel", spark.sparkContext.cancelAllJobs,
                                  SparkTrainingError),
                                 ("interrupted", _thread.interrupt_main, KeyboardInterrupt)):
        estimator.submit["name"] = name
        trigger = when_running(name, action)
        trigger.start()
        with pytest.raises(raised):
            estimator.fit(df)
        trigger.join(timeout=130)
        job = [j for j in client.jobs() if j.name == name][0]
        assert job.state == "CANCELLED", job.report()
    assert "interrupted on the Spark driver" in job.reason
    # The session goes on: its barrier stage was cancelled with the job.
    assert spark.range(10).count() == 10
