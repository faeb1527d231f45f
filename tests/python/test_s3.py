"""Datasets in an S3 object store, against a real S3 server: moto's, started
for these tests on 127.0.0.1 with IAM authentication on (every request's
SigV4 signature is checked), behind the project's own fault-injecting proxy
(tests/tools/s3_fault_proxy.py: connection resets, 503 SlowDown, truncated
and corrupted bodies).

Fashion-MNIST is packed by `pstrain prepare` twice, into a local directory
and into s3://pstrain-data/fmnist (multipart uploads); a 2-worker sync job
then trains from each, the workers reading the bucket through the proxy.
Also: wrong credentials, a prefix the store forbids, a prefix the workers'
--data-root forbids and a missing bucket each fail with the bucket and key
named and no secret shown.

moto and boto3 come from PyPI (deploy/local/test.sh puts them in
<build>/venv-tools); the tests run them with that interpreter
($PSTRAIN_TOOLS_PYTHON, else <repo>/build/venv-tools/bin/python3).
"""

import json
import os
import re
import shlex
import subprocess
import time

import pytest

import pstrain
from pstrain import layers

pytestmark = pytest.mark.s3

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tests", "tools")
BUCKET = "pstrain-data"
CKPT_BUCKET = "pstrain-ckpt"
# Bounded work: 20000 training samples, 1 epoch, the whole test split.
TRAIN_LIMIT, EPOCHS = 20000, 1


def start_proxy(moto, work, *flags):
    """s3_fault_proxy.py in front of moto with `flags`: (Popen, endpoint, stats())."""
    port_file, stats = str(work / "port"), str(work / "stats.json")
    proc = subprocess.Popen(
        [tools_python(), os.path.join(TOOLS, "s3_fault_proxy.py"),
         "--upstream", moto["AWS_ENDPOINT_URL"], "--port-file", port_file, "--stats", stats,
         "--log", str(work / "proxy.log")] + list(flags),
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not (os.path.exists(port_file) and os.path.getsize(port_file) > 0):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the fault proxy did not start")
        time.sleep(0.05)
    port = int(open(port_file).read())
    return (proc, f"http://127.0.0.1:{port}",
            lambda: json.load(open(stats)) if os.path.exists(stats) else {})


def tools(moto, *code_args, code):
    """Runs Python `code` with boto3 (the tools interpreter) against moto; its stdout."""
    result = subprocess.run([tools_python(), "-c", code] + list(code_args),
                            env=dict(os.environ, **s3_env(moto)), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def tools_python():
    path = os.environ.get("PSTRAIN_TOOLS_PYTHON") or os.path.join(
        REPO, "build", "venv-tools", "bin", "python3")
    if not os.access(path, os.X_OK):
        pytest.fail(f"no Python with moto and boto3 at {path}: run deploy/local/test.sh (it "
                    "installs them in <build>/venv-tools) or set PSTRAIN_TOOLS_PYTHON")
    return path


def read_env_file(path, timeout_s, proc):
    deadline = time.monotonic() + timeout_s
    while not (os.path.exists(path) and os.path.getsize(path) > 0):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the S3 harness did not start (exit {proc.poll()})")
        time.sleep(0.1)
    env = {}
    for line in open(path):
        if line.startswith("export "):
            name, _, value = line[len("export "):].strip().partition("=")
            env[name] = shlex.split(value)[0] if value else ""
    return env


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """moto's S3 with auth on; its AWS_* variables, and a user allowed only
    s3://pstrain-data/allowed/."""
    work = tmp_path_factory.mktemp("moto")
    env_file = str(work / "s3.env")
    proc = subprocess.Popen(
        [tools_python(), os.path.join(TOOLS, "s3_harness.py"), "serve", "--env-file", env_file,
         "--log", str(work / "moto.log"), "--bucket", BUCKET, "--bucket", CKPT_BUCKET,
         "--restricted-bucket", BUCKET, "--restricted-prefix", "allowed/"],
        stdout=subprocess.DEVNULL, stderr=open(work / "harness.log", "wb"))
    try:
        yield read_env_file(env_file, 60, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def proxy(moto, tmp_path_factory):
    """The fault proxy in front of moto: about 3% of GETs and HEADs each reset,
    answered 503 SlowDown, truncated, or (ranged reads) corrupted."""
    proc, endpoint, stats = start_proxy(
        moto, tmp_path_factory.mktemp("proxy"), "--seed", "7", "--methods", "GET,HEAD",
        "--reset-rate", "0.03", "--slowdown-rate", "0.03", "--truncate-rate", "0.03",
        "--corrupt-rate", "0.03", "--first-n-faults", "4")
    try:
        yield {"endpoint": endpoint, "stats": stats}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def s3_env(moto, **overrides):
    keep = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION")
    env = {k: moto[k] for k in keep}
    env.update(overrides)
    return env


def prepare(bin_dir, out, env=None):
    return subprocess.run(
        [os.path.join(bin_dir, "pstrain"), "prepare", "--format", "idx",
         "--path", "/usr/share/datasets/fashion-mnist", "-o", out, "--records-per-shard", "25000"],
        env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def packed(bin_dir, fashion_mnist, moto, tmp_path_factory):
    """Fashion-MNIST packed locally and into the bucket (3 train shards of
    ~20 MB each: multipart uploads of 8 MiB parts)."""
    local = str(tmp_path_factory.mktemp("packed") / "fmnist")
    for out, env in ((local, None), (f"s3://{BUCKET}/fmnist", s3_env(moto))):
        result = prepare(bin_dir, out, env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "train 60000 samples in 3 shards, test 10000 samples in 1 shards" in result.stdout
    listing = subprocess.run(
        [tools_python(), os.path.join(TOOLS, "s3_harness.py"), "ls", f"s3://{BUCKET}/fmnist"],
        env=dict(os.environ, **s3_env(moto)), capture_output=True, text=True, timeout=60)
    assert listing.stdout.split() == [
        "fmnist/test-00000-of-00001.pspack", "fmnist/test.labels",
        "fmnist/train-00000-of-00003.pspack", "fmnist/train-00001-of-00003.pspack",
        "fmnist/train-00002-of-00003.pspack", "fmnist/train.labels"], listing
    return {"local": local, "s3": f"s3://{BUCKET}/fmnist"}


@pytest.fixture(scope="module")
def s3_cluster(bin_dir, source_dir, moto, proxy, packed, tmp_path_factory):
    """A server and two CPU workers that reach the bucket through the proxy,
    allowed the local copy, s3://pstrain-data/fmnist and a missing bucket."""
    from cluster import LocalCluster
    workdir = str(tmp_path_factory.mktemp("s3cluster"))
    roots = ["--data-root", os.path.dirname(packed["local"]), "--data-root", packed["s3"],
             "--data-root", "s3://no-such-bucket-pstrain", "--data-root", f"s3://{BUCKET}/dump"]
    env = s3_env(moto, AWS_ENDPOINT_URL=proxy["endpoint"])
    with LocalCluster(bin_dir, source_dir, workdir, workers=2, worker_args=roots,
                      worker_env=env) as running:
        yield running


def mlp():
    return pstrain.Sequential([layers.Flatten(), layers.Dense(128, activation="relu"),
                               layers.Dense(10)], input_shape=(1, 28, 28), name="fmnist-mlp")


def train(cluster, path, timeout=600, **dataset):
    client = pstrain.Client(cluster.address, timeout=10.0, **cluster.admin_credentials())
    job = client.submit(
        mlp(), pstrain.datasets.Packed(path, mean=[0.2860], std=[0.3530], train_limit=TRAIN_LIMIT,
                                       **dataset),
        pstrain.optimizers.SGD(0.05, momentum=0.9), epochs=EPOCHS, batch_size=64, workers=2,
        mode="sync", seed=1)
    return job.wait(timeout=timeout)


def test_a_job_from_the_bucket_matches_the_local_copy_through_store_faults(s3_cluster, packed, moto,
                                                                           proxy):
    before = proxy["stats"]()
    from_s3 = train(s3_cluster, packed["s3"])
    faults = {k: proxy["stats"]().get(k, 0) - before.get(k, 0)
              for k in ("requests", "reset", "slowdown", "truncate", "corrupt")}
    assert from_s3.state == "SUCCEEDED", f"{from_s3.reason}\n{s3_cluster.logs()}"
    local = train(s3_cluster, packed["local"])
    assert local.state == "SUCCEEDED", f"{local.reason}\n{s3_cluster.logs()}"
    print(f"test accuracy after {EPOCHS} epoch(s) on {TRAIN_LIMIT} samples: s3:// "
          f"{from_s3.test.accuracy:.4f}, local {local.test.accuracy:.4f}; proxy: {faults}")
    # The same samples, as many steps, the whole test split.
    assert from_s3.total_steps == local.total_steps
    assert from_s3.test.samples == local.test.samples == 10000
    assert abs(from_s3.test.accuracy - local.test.accuracy) <= 0.003
    assert from_s3.test.accuracy > 0.75  # Chance is 0.10.
    # The workers' reads met faults, and went on: every kind was injected at
    # least once over the run, retried (the log says so) or, for damaged
    # bytes, caught by the records' checksums and fetched again.
    assert faults["reset"] + faults["slowdown"] + faults["truncate"] + faults["corrupt"] >= 4, \
        faults
    logs = s3_cluster.log("worker0") + s3_cluster.log("worker1")
    assert re.search(r"S3 (GET|HEAD) s3://pstrain-data/fmnist/.*; retry 1 of 7", logs), logs
    assert moto["AWS_SECRET_ACCESS_KEY"] not in logs


def test_with_a_small_shuffle_window_each_worker_streams_about_its_share(s3_cluster, packed,
                                                                         proxy):
    """Packed shards in a bucket are streamed in ~8 MiB chunks: with a 4 MiB
    shuffle window (one chunk a window) each of the 2 workers reads the
    chunks of its half of the epoch (and of its half of the test split), not
    the whole objects; the job still trains every sample once, through the
    proxy's faults."""
    before = proxy["stats"]().get("get_body_bytes", 0)
    job = train(s3_cluster, packed["s3"], shuffle_window_mib=4)
    read = proxy["stats"]().get("get_body_bytes", 0) - before
    assert job.state == "SUCCEEDED", f"{job.reason}\n{s3_cluster.logs()}"
    record = 28 * 28 + 8
    # Reading the objects whole: 2 workers x (60000 + 10000) records.
    whole = 2 * 70000 * record
    print(f"bytes the workers read from the bucket: {read} ({read / whole:.2f} of reading "
          f"every object whole); test accuracy {job.test.accuracy:.4f}")
    # Streamed: the limit's 20000 train samples lie in 2 chunks of 10591
    # records; a worker's 10000 positions touch one or both (3 chunk reads in
    # all, about 0.23 of `whole`). The test split is one chunk, read by both
    # (0.14). Headers and labels are small: about 0.37 in all.
    assert read < 0.45 * whole, read
    assert job.test.samples == 10000
    assert job.test.accuracy > 0.75  # Chance is 0.10; chunk order, not the local one.


def write_png(path, pixels, width, height):
    """A gray 8-bit PNG (zlib and struct: no imaging library needed)."""
    import struct
    import zlib

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))
    rows = b"".join(b"\x00" + bytes(pixels[r * width:(r + 1) * width]) for r in range(height))
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0,
                                                                    0, 0, 0))
                + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def test_an_image_folder_in_the_bucket_packs_like_the_same_folder_on_disk(bin_dir, moto,
                                                                         tmp_path):
    """Fashion-MNIST PNGs as <split>/<class>/<file> objects: `pstrain prepare
    --format image_folder --path s3://...` reads them (one listing, the images
    on the decoder threads) and writes the same shards, byte for byte, as
    from the same folder on disk."""
    import gzip
    import numpy as np
    folder = tmp_path / "folder"
    for split, prefix, count in (("train", "train", 300), ("test", "t10k", 100)):
        raw = "/usr/share/datasets/fashion-mnist"
        images = np.frombuffer(gzip.open(f"{raw}/{prefix}-images-idx3-ubyte.gz").read()[16:],
                               dtype=np.uint8).reshape(-1, 28 * 28)
        labels = np.frombuffer(gzip.open(f"{raw}/{prefix}-labels-idx1-ubyte.gz").read()[8:],
                               dtype=np.uint8)
        for i in range(count):
            d = folder / split / f"class{labels[i]}"
            d.mkdir(parents=True, exist_ok=True)
            write_png(d / f"{i:05d}.png", images[i].tolist(), 28, 28)
    env = dict(os.environ, **s3_env(moto))
    upload = subprocess.run([tools_python(), os.path.join(TOOLS, "s3_harness.py"), "upload",
                             str(folder), f"s3://{BUCKET}/folder"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert upload.returncode == 0, upload.stderr
    outs = {}
    for label, source in (("local", str(folder)), ("s3", f"s3://{BUCKET}/folder")):
        out = tmp_path / f"packed-{label}"
        result = subprocess.run(
            [os.path.join(bin_dir, "pstrain"), "prepare", "--format", "image_folder", "--path",
             source, "--image-size", "28x28", "-o", str(out)],
            env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert "train 300 samples in 1 shards, test 100 samples in 1 shards" in result.stdout
        outs[label] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert outs["s3"] == outs["local"]
    assert sorted(outs["s3"]) == ["test-00000-of-00001.pspack", "test.labels",
                                  "train-00000-of-00001.pspack", "train.labels"]


FMNIST_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                "Sneaker", "Bag", "Ankle boot"]


def test_a_bson_dump_streams_into_the_bucket_and_its_category_names_reach_the_report(
        s3_cluster, bin_dir, moto, tmp_path):
    """A Cdiscount-layout dump made from Fashion-MNIST's images, with its
    category_names.csv, put in the bucket and packed from there by `pstrain
    prepare --format bson` into the bucket; a 2-worker job trains from the
    shards and its test metrics carry the category names (the Python report
    and `pstrain status`)."""
    dump = tmp_path / "dump"
    dump.mkdir()
    subprocess.run([os.path.join(bin_dir, "make_bson_dump"), "/usr/share/datasets/fashion-mnist",
                    str(dump), "6000"], check=True, capture_output=True, timeout=120)
    with open(dump / "category_names.csv", "w") as f:
        f.write("category_id,category_level1,category_level2,category_level3\n")
        for c, name in enumerate(FMNIST_NAMES):  # tests/testing/bson_dump.h's ids.
            f.write(f"{1000010653 + 7919 * c},MODE,VETEMENTS,{name}\n")
    # The dump itself goes into the bucket too: prepare reads it from there.
    upload = subprocess.run([tools_python(), os.path.join(TOOLS, "s3_harness.py"), "upload",
                             str(dump), f"s3://{BUCKET}/rawdump"],
                            env=dict(os.environ, **s3_env(moto)), capture_output=True, text=True,
                            timeout=120)
    assert upload.returncode == 0, upload.stderr
    result = subprocess.run(
        [os.path.join(bin_dir, "pstrain"), "prepare", "--format", "bson", "--path",
         f"s3://{BUCKET}/rawdump", "--image-size", "28x28", "-o", f"s3://{BUCKET}/dump"],
        env=dict(os.environ, **s3_env(moto)), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "classes in s3://pstrain-data/dump/classes.csv" in result.stdout, result.stdout
    client = pstrain.Client(s3_cluster.address, timeout=10.0, **s3_cluster.admin_credentials())
    model = pstrain.Sequential([layers.Flatten(), layers.Dense(64, activation="relu"),
                                layers.Dense(10)], input_shape=(3, 28, 28), name="dump-mlp")
    job = client.submit(model, pstrain.datasets.Packed(f"s3://{BUCKET}/dump"),
                        pstrain.optimizers.SGD(0.05, momentum=0.9), epochs=1, workers=2,
                        mode="sync", seed=1)
    status = job.wait(timeout=300)
    assert status.state == "SUCCEEDED", f"{status.reason}\n{s3_cluster.logs()}"
    assert status.test.class_names == FMNIST_NAMES
    assert status.test.confusion_text().splitlines()[-1].endswith("  Ankle boot")
    cli = subprocess.run([os.path.join(bin_dir, "pstrain"), "status", job.id],
                         env=dict(os.environ, **s3_cluster.admin_env()), capture_output=True,
                         text=True, timeout=60)
    assert re.search(r"^ +2  +[0-9.]+  +[0-9.]+  +[0-9.]+  Pullover$", cli.stdout, re.M), cli.stdout


def test_forbidden_and_missing_places_fail_the_job_naming_them(s3_cluster, moto):
    outside = train(s3_cluster, f"s3://{BUCKET}/elsewhere", timeout=120)
    assert outside.state == "FAILED"
    assert "--data-root allow-list" in outside.reason, outside.reason
    missing = train(s3_cluster, "s3://no-such-bucket-pstrain/fmnist", timeout=120)
    assert missing.state == "FAILED"
    assert "s3://no-such-bucket-pstrain/" in missing.reason, missing.reason
    assert "404 NoSuchBucket" in missing.reason, missing.reason
    print(f"outside: {outside.reason}\nmissing: {missing.reason}")
    for status in (outside, missing):
        assert moto["AWS_SECRET_ACCESS_KEY"] not in status.reason


def test_wrong_keys_and_a_forbidden_prefix_are_refused_by_the_store(bin_dir, moto, packed):
    wrong = prepare(bin_dir, f"s3://{BUCKET}/again",
                    s3_env(moto, AWS_SECRET_ACCESS_KEY="wrong-secret-not-to-print"))
    assert wrong.returncode != 0
    assert f"s3://{BUCKET}/" in wrong.stderr and "403 SignatureDoesNotMatch" in wrong.stderr, \
        wrong.stderr
    assert "wrong-secret-not-to-print" not in wrong.stdout + wrong.stderr
    # A user whose IAM policy allows only s3://pstrain-data/allowed/.
    restricted = s3_env(moto, AWS_ACCESS_KEY_ID=moto["PSTRAIN_S3_RESTRICTED_ACCESS_KEY_ID"],
                        AWS_SECRET_ACCESS_KEY=moto["PSTRAIN_S3_RESTRICTED_SECRET_ACCESS_KEY"])
    denied = prepare(bin_dir, f"s3://{BUCKET}/not-allowed", restricted)
    assert denied.returncode != 0
    assert re.search(r"S3 (PUT|POST) s3://pstrain-data/not-allowed/\S+: 403 AccessDenied",
                     denied.stderr), denied.stderr
    allowed = prepare(bin_dir, f"s3://{BUCKET}/allowed/fmnist", restricted)
    assert allowed.returncode == 0, allowed.stderr


LIST_CKPT = """
import sys, boto3
s3 = boto3.client("s3")
keys = [o["Key"] for o in s3.list_objects_v2(Bucket=sys.argv[1]).get("Contents", [])]
uploads = s3.list_multipart_uploads(Bucket=sys.argv[1]).get("Uploads", [])
print(" ".join(keys)); print(len(uploads))
"""


def test_checkpoints_in_the_bucket_survive_a_kill_mid_upload(bin_dir, source_dir, moto, packed,
                                                            tmp_path_factory):
    """Server 0 checkpoints to s3://pstrain-ckpt/runs through a slow store (every
    PUT and POST held 400 ms); it is killed (-9) while a multipart upload of a
    checkpoint is half done, after at least one checkpoint was committed, and
    started again: it aborts the unfinished upload, resumes from the last
    committed checkpoint, and the job SUCCEEDS."""
    from cluster import LocalCluster
    work = tmp_path_factory.mktemp("ckpt")
    proc, endpoint, _ = start_proxy(moto, work, "--delay-ms", "400", "--delay-methods",
                                    "PUT,POST")
    try:
        with LocalCluster(bin_dir, source_dir, str(work), workers=2,
                          server_args=["--checkpoint-dir", f"s3://{CKPT_BUCKET}/runs",
                                       "--checkpoint-interval-s", "1"],
                          server_env=s3_env(moto, AWS_ENDPOINT_URL=endpoint),
                          worker_args=["--data-root", os.path.dirname(packed["local"])]) as c:
            client = pstrain.Client(c.address, timeout=10.0, **c.admin_credentials())
            # ~26 MB of parameters and momentum: multipart uploads of 4 parts.
            model = pstrain.Sequential([layers.Flatten(), layers.Dense(4096, activation="relu"),
                                        layers.Dense(10)], input_shape=(1, 28, 28),
                                       name="fmnist-wide")
            job = client.submit(
                model, pstrain.datasets.Packed(packed["local"], mean=[0.2860], std=[0.3530],
                                               train_limit=6000, test_limit=2000),
                pstrain.optimizers.SGD(0.02, momentum=0.9), epochs=3, batch_size=64, workers=2,
                mode="sync", seed=1)
            # A committed checkpoint, then the next one's second part in flight.
            deadline = time.monotonic() + 240
            log = work / "proxy.log"
            while True:
                assert time.monotonic() < deadline, (c.logs(), log.read_text())
                text = log.read_text() if log.exists() else ""
                committed = text.find(".manifest:")
                if committed >= 0 and re.search(r"delay PUT /pstrain-ckpt/runs/job-\d+/"
                                                r"ckpt-\d+\.ckpt\?partNumber=2&",
                                                text[committed:]):
                    break
                assert job.status().state in ("QUEUED", "RUNNING"), job.status().reason
                time.sleep(0.05)
            c.restart_server()  # kill -9, then the same server again.
            status = job.wait(timeout=400)
            assert status.state == "SUCCEEDED", f"{status.reason}\n{c.logs()}"
            server_log = c.log("server")
            assert re.search(r"aborted 1 unfinished upload\(s\) under s3://pstrain-ckpt/runs/",
                             server_log), server_log
            assert status.test.accuracy > 0.7
            # The model to the bucket, and its ONNX export from there to there.
            env = dict(os.environ, **c.admin_env(), **s3_env(moto))
            pstrain_cli = os.path.join(bin_dir, "pstrain")
            down = subprocess.run([pstrain_cli, "download", job.id, "-o",
                                   f"s3://{CKPT_BUCKET}/exports/wide.ckpt"],
                                  env=env, capture_output=True, text=True, timeout=120)
            assert down.returncode == 0, down.stderr
            assert re.search(r"^s3://pstrain-ckpt/exports/wide.ckpt: \d+ bytes, 4 tensors",
                             down.stdout), down.stdout
            export = subprocess.run([pstrain_cli, "export", f"s3://{CKPT_BUCKET}/exports/wide.ckpt",
                                     "-o", f"s3://{CKPT_BUCKET}/exports/wide.onnx"],
                                    env=env, capture_output=True, text=True, timeout=120)
            assert export.returncode == 0, export.stderr
            assert "ONNX opset 13" in export.stdout, export.stdout
        keys, uploads = tools(moto, CKPT_BUCKET, code=LIST_CKPT).splitlines()
        assert "exports/wide.ckpt" in keys.split() and "exports/wide.onnx" in keys.split(), keys
        # Every checkpoint object has its manifest, no part is left behind,
        # and no more than --keep-checkpoints (3) are kept.
        objects = [k for k in keys.split() if k.startswith("runs/") and k.endswith(".ckpt")]
        manifests = [k for k in keys.split() if k.endswith(".manifest")]
        assert objects and len(objects) <= 3, keys
        assert sorted(k[:-len(".ckpt")] for k in objects) == \
            sorted(k[:-len(".manifest")] for k in manifests), keys
        assert uploads == "0"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
