"""Train from Spark: a DataFrame in, a Spark ML Transformer out.

In a notebook::

    from pstrain import layers, optimizers, Sequential
    from pstrain.spark import Estimator
    df = spark.read.format("binaryFile").load("s3://bucket/images/*/*.png")   # + a label column
    cnn = Sequential([layers.Conv2D(32, 3), layers.ReLU(), layers.Flatten(), layers.Dense(10)],
                     input_shape=(1, 28, 28))
    model = Estimator(cnn, store="s3://bucket/prepared", features="content", label="label",
                      optimizer=optimizers.SGD(0.05), epochs=3, workers=2).fit(df)
    model.transform(test_df).select("prediction", "probability").show()

What happens, on Spark's public APIs only:

* ``prepare(df, store, features=, label=)`` packs the DataFrame into pstrain
  packed shards (the files `pstrain prepare` writes) in `store`, a local or
  shared path or an s3:// prefix. A first, cheap pass (only the label column
  and numeric features are read) counts each partition's rows and takes the
  label set and the features' ranges; then every partition's task decodes
  and writes its own shards in parallel, each shard one atomic write at a
  place fixed by those counts (as RDD.zipWithIndex places rows); the driver
  writes the labels objects, classes.csv and, last, a manifest. The packing
  lives under a key that digests the DataFrame's plan, its input files and
  the options: a second prepare of the same data finds the manifest and
  reuses it. A failed or retried task never leaves a shard that a reader
  takes: a shard is written whole or not at all, and no job reads a packing
  before its manifest exists.
* ``Estimator(model, ...).fit(df)`` prepares the data, submits a job whose
  workers are bound to it (JobSpec.bound_workers) to the given server (or to
  a pstrain-server it starts on the driver for the fit), and runs the
  workers as ONE barrier-mode stage, one task per worker: a ModelSpec trains
  in the C++ trainer inside the task (pstrain._native.BoundWorker, the same
  code as pstrain-worker), a PyTorch module in pstrain.torch's loop. The
  driver shows the job's progress (console or notebook) while `pstrain
  status/watch` see it as any job. The result is a ``Model``: a Transformer
  whose transform() adds `prediction` and `probability` on the executors,
  saved and loaded with Spark ML's MLWritable/MLReadable conventions, and
  whose weights are the job's final checkpoint.
* ``run(train_fn, num_workers)`` runs a pstrain.torch training function as a
  barrier stage (TorchDistributor's shape); the same function runs under
  `pstrain run -n N` unchanged.

Failures: an executor lost mid-epoch (kill -9 of its JVM or its Python
worker) fails the barrier stage and Spark runs it again; its tasks join the
SAME pstrain job, which resumes from its latest checkpoint once the lost
workers are dropped (exactly-once pushes, every sample once per epoch).
When Spark's retries run out, or the Spark job is cancelled
(cancelAllJobs, Ctrl-C on the driver), the pstrain job is cancelled with
the cause and fit() raises SparkTrainingError. Nothing is left RUNNING.

Secrets: TLS keys and tokens stay in files. Tasks get the files' paths
(which must exist on the executors, as for any pstrain worker), never their
contents: nothing secret goes into the Spark conf, the UI, the event log or
a task's serialized closure.
"""

import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np

from pstrain import client as client_lib
from pstrain import datasets as datasets_lib
from pstrain import optimizers as optimizers_lib
from pstrain._proto import job_pb2
from pstrain.checkpoint import Checkpoint
from pstrain.model import Model as PstrainModel

try:
    import pyspark
    from pyspark import BarrierTaskContext
    from pyspark.ml import Estimator as _SparkEstimator
    from pyspark.ml import Transformer as _SparkTransformer
    from pyspark.ml.param.shared import HasFeaturesCol, HasLabelCol, HasPredictionCol, Param, Params
    from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
except ImportError as error:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"pstrain.spark needs PySpark 4 ({error}): pip install pyspark (the README's commands "
        "put it in <build>/venv-spark) and a Java 17 runtime (Debian's "
        "openjdk-17-jre-headless)") from error

__all__ = ["prepare", "Prepared", "Estimator", "Model", "run", "PrepareError",
           "SparkTrainingError"]

MANIFEST = "_pstrain_spark.json"  # Written last by prepare(): the packing is complete.
_MANIFEST_VERSION = 1
_SHARD_BYTES = 256 << 20  # Records per shard: about this many bytes.
_MAX_CLASSES = 1 << 20    # As a packed shard allows (kPackedMaxClasses).


class PrepareError(ValueError):
    """A DataFrame that cannot be packed: a null, a wrong column type, an
    undecodable image. The message names the column and the partition."""


class SparkTrainingError(RuntimeError):
    """The training stage failed (Spark's retries ran out, or it was
    cancelled); the pstrain job was cancelled with this cause."""


# --- Binaries ---------------------------------------------------------------------------


def _binary(name):
    """pstrain's programs: $PSTRAIN_BIN_DIR, else PATH, else the build tree
    beside this package (<build>/python/pstrain -> <build>/bin)."""
    candidates = []
    if os.environ.get("PSTRAIN_BIN_DIR"):
        candidates.append(os.path.join(os.environ["PSTRAIN_BIN_DIR"], name))
    found = shutil.which(name)
    if found:
        candidates.append(found)
    here = os.path.dirname(os.path.abspath(__file__))
    candidates.append(os.path.join(os.path.dirname(os.path.dirname(here)), "bin", name))
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(f"{name} was not found: set PSTRAIN_BIN_DIR to the directory of "
                            "pstrain's programs, or put them on PATH")


def _native():
    try:
        from pstrain import _native as native
    except ImportError as error:
        raise ImportError(
            f"pstrain.spark needs pstrain._native on the driver and the executors ({error}): "
            "the CMake build puts it in <build>/python; give the executors that PYTHONPATH "
            "(spark.executorEnv.PYTHONPATH)") from error
    return native


# --- Features -----------------------------------------------------------------------------


def _describe_features(df, features, image_size, channels):
    """What the feature column(s) are, checked against the schema on the driver:
    ("image", column) for binary image bytes or Spark's image struct,
    ("vector", column) for an array of numbers or a VectorUDT, and
    ("columns", [names]) for numeric columns."""
    schema = {f.name: f.dataType for f in df.schema.fields}
    if features is None:
        raise PrepareError("features= names the feature column(s)")
    names = [features] if isinstance(features, str) else list(features)
    for name in names:
        if name not in schema:
            raise PrepareError(f"features: the DataFrame has no column '{name}' (it has "
                               f"{', '.join(schema)})")
    if len(names) > 1:
        for name in names:
            if not isinstance(schema[name], T.NumericType):
                raise PrepareError(f"features: column '{name}' is {schema[name].simpleString()}; "
                                   "several feature columns must each be numeric")
        return "columns", names
    name = names[0]
    kind = schema[name]
    if isinstance(kind, T.BinaryType) or (
            isinstance(kind, T.StructType) and {"data", "height", "width", "nChannels"} <=
            set(kind.fieldNames())):
        if image_size is None:
            raise PrepareError(f"features: column '{name}' holds images: give image_size=(H, W) "
                               "(and channels=1 or 3) to decode them to")
        if channels not in (1, 3):
            raise PrepareError(f"channels must be 1 or 3 for images, got {channels!r}")
        return "image", name
    if isinstance(kind, T.ArrayType) and isinstance(kind.elementType, T.NumericType):
        return "vector", name
    if type(kind).__name__ == "VectorUDT":
        return "vector", name
    if isinstance(kind, T.NumericType):
        return "columns", [name]
    raise PrepareError(f"features: column '{name}' is {kind.simpleString()}: expected image bytes "
                       "(binary, as binaryFile gives), Spark's image struct, an array of "
                       "numbers, a Vector, or numeric columns")


def _vector_of(value):
    if hasattr(value, "toArray"):
        return np.asarray(value.toArray(), dtype=np.float64)
    return np.asarray(value, dtype=np.float64)


def _row_features(kind, names, row):
    """A row's features as float64 (vector and column kinds); None when null."""
    if kind == "vector":
        value = row[names]
        return None if value is None else _vector_of(value)
    values = [row[n] for n in names]
    if any(v is None for v in values):
        return None
    return np.asarray(values, dtype=np.float64)


def _image_struct_chw(value, channels, height, width):
    """Spark's image struct (BGR(A) rows, HWC) as CHW `channels` x height x width."""
    h, w, c = value["height"], value["width"], value["nChannels"]
    data = np.frombuffer(bytes(value["data"]), dtype=np.uint8)
    if c not in (1, 3, 4) or data.size != h * w * c:
        raise ValueError(f"an image struct of {h}x{w}x{c} with {data.size} bytes")
    hwc = data.reshape(h, w, c)
    if c >= 3:
        hwc = hwc[:, :, [2, 1, 0]]  # BGR -> RGB, alpha dropped.
    ys = np.minimum(((np.arange(height) + 0.5) * h / height).astype(np.int64), h - 1)
    xs = np.minimum(((np.arange(width) + 0.5) * w / width).astype(np.int64), w - 1)
    hwc = hwc[ys][:, xs]
    if channels == 1 and hwc.shape[2] == 3:
        gray = np.rint(0.299 * hwc[:, :, 0] + 0.587 * hwc[:, :, 1] + 0.114 * hwc[:, :, 2])
        hwc = gray.astype(np.uint8)[:, :, None]
    elif channels == 3 and hwc.shape[2] == 1:
        hwc = np.repeat(hwc, 3, axis=2)
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


# --- prepare() ---------------------------------------------------------------------------


class Prepared:
    """A packing of a DataFrame in a store (what prepare() returns).

    uri: the packed directory (train-*-of-*.pspack, test-*, *.labels,
    classes.csv, the manifest); shape (C, H, W); num_classes; classes: the
    label values in class order (strings or ints); train_samples,
    test_samples; reused: True when this call found it already there;
    scale: for numeric features, each feature's (low, high), mapped to
    pixels 0..255 (transform applies the same)."""

    def __init__(self, uri, manifest, reused):
        self.uri = uri
        self.manifest = manifest
        self.reused = reused
        self.shape = tuple(manifest["shape"])
        self.num_classes = manifest["num_classes"]
        self.classes = manifest["classes"]
        self.train_samples = manifest["train_samples"]
        self.test_samples = manifest["test_samples"]
        self.kind = manifest["kind"]
        self.features = manifest["features"]
        self.scale = manifest.get("scale")

    def dataset(self, **kwargs):
        """The packing as a job's dataset (pstrain.datasets.Packed)."""
        return datasets_lib.Packed(self.uri, **kwargs)

    def __repr__(self):
        return (f"<pstrain.spark.Prepared {self.uri}: {self.train_samples} train + "
                f"{self.test_samples} test samples of {self.shape}, {self.num_classes} classes"
                f"{', reused' if self.reused else ''}>")


def _plan_key(df, options):
    """A digest of the DataFrame's plan, its input files and the options."""
    try:
        files = sorted(df.inputFiles())
    except Exception:  # noqa: BLE001 - a source without files
        files = []
    text = json.dumps({"plan": df.semanticHash(), "files": files, "options": options,
                       "version": _MANIFEST_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read_manifest(uri):
    native = _native()
    path = _join(uri, MANIFEST)
    if not native.storage_exists(path):
        return None
    manifest = json.loads(native.storage_read(path, 16 << 20).decode())
    if manifest.get("version") != _MANIFEST_VERSION:
        return None
    return manifest


def _join(uri, name):
    return uri.rstrip("/") + "/" + name


def _is_test(index, every):
    return every > 0 and index % every == every - 1


def prepare(df, store, features=None, label=None, image_size=None, channels=1, test=0.1,
            records_per_shard=0):
    """Packs `df` into `store` (a path every executor and worker reaches, or
    an s3:// prefix) and returns a Prepared.

    features: the image column (JPEG/PNG bytes, as spark.read.format
      ("binaryFile") gives them in `content`, or Spark's image struct),
      decoded and resized on the executors by pstrain's codec to
      image_size=(H, W) with `channels` (1 or 3); or an array or Vector
      column; or a list of numeric columns. Numeric features are scaled
      to [0, 1] by each feature's range in the data and stored with 8 bits.
    label: an integer column (classes 0..max) or a string column (classes
      in sorted order, kept with the packing as classes.csv).
    test: the fraction of rows held out as the test split (every
      round(1/test)-th row of each partition), in (0, 0.5].
    records_per_shard: 0: about 256 MiB per shard.

    The DataFrame must give the same rows in the same partitions each time
    it is computed (as RDD.zipWithIndex requires); one that does not is
    caught and refused. Errors (PrepareError) name the column and partition.
    """
    native = _native()
    if label is None:
        raise PrepareError("label= names the label column")
    if not isinstance(test, (int, float)) or not 0 < test <= 0.5:
        raise PrepareError(f"test must be a fraction in (0, 0.5], got {test!r}")
    every = max(2, int(round(1.0 / test)))
    schema = {f.name: f.dataType for f in df.schema.fields}
    if label not in schema:
        raise PrepareError(f"label: the DataFrame has no column '{label}' (it has "
                           f"{', '.join(schema)})")
    label_type = schema[label]
    if isinstance(label_type, T.StringType):
        label_kind = "string"
    elif isinstance(label_type, (T.IntegerType, T.LongType, T.ShortType, T.ByteType)):
        label_kind = "int"
    else:
        raise PrepareError(f"label: column '{label}' is {label_type.simpleString()}; expected "
                           "an integer or a string column")
    kind, names = _describe_features(df, features, image_size, channels)
    height, width = (int(image_size[0]), int(image_size[1])) if kind == "image" else (0, 0)
    options = {"features": names, "label": label, "kind": kind, "image_size": [height, width],
               "channels": channels, "test_every": every, "records_per_shard": records_per_shard}
    uri = _join(store, f"spark-{_plan_key(df, options)}")
    manifest = _read_manifest(uri)
    if manifest is not None:
        return Prepared(uri, manifest, reused=True)

    # Pass 1: per partition, rows, nulls, labels and the features' ranges,
    # reading only the label and numeric feature columns.
    counted = df.select(*([label] + ([] if kind == "image" else
                                      ([names] if kind == "vector" else list(names)))))

    def count(index, rows):
        n, nulls, labels, low, high = 0, 0, set(), None, None
        width_seen = None
        for row in rows:
            value = row[0]
            if value is None:
                raise PrepareError(f"label: column '{label}' is null in row {n} of partition "
                                   f"{index}")
            labels.add(value)
            if kind != "image":
                x = _row_features(kind, names, row)
                if x is None:
                    raise PrepareError(f"features: a null in row {n} of partition {index} "
                                       f"(column{'s' if len(names) > 1 else ''} {names})")
                if width_seen is None:
                    width_seen = x.size
                elif x.size != width_seen:
                    raise PrepareError(f"features: column '{names}' has {x.size} values in row "
                                       f"{n} of partition {index}, {width_seen} before")
                if not np.all(np.isfinite(x)):
                    raise PrepareError(f"features: a NaN or infinity in row {n} of partition "
                                       f"{index} (column {names})")
                low = x if low is None else np.minimum(low, x)
                high = x if high is None else np.maximum(high, x)
            n += 1
            if len(labels) > _MAX_CLASSES:
                raise PrepareError(f"label: over {_MAX_CLASSES} distinct values")
        yield (index, n, sorted(labels), None if low is None else low.tolist(),
               None if high is None else high.tolist(), width_seen)

    stats = sorted(_collect(counted.rdd.mapPartitionsWithIndex(count), "count the rows"))
    partitions = len(stats)
    label_values = sorted(set(v for s in stats for v in s[2]))
    if not label_values:
        raise PrepareError("the DataFrame has no rows")
    if label_kind == "int":
        if label_values[0] < 0:
            raise PrepareError(f"label: column '{label}' holds {label_values[0]}; integer "
                               "labels are classes 0, 1, ...")
        num_classes = int(label_values[-1]) + 1
        classes = list(range(num_classes))
    else:
        classes = label_values
        num_classes = len(classes)
    scale = None
    if kind == "image":
        shape = (channels, height, width)
    else:
        widths = set(s[5] for s in stats if s[5] is not None)
        if len(widths) != 1:
            raise PrepareError(f"features: rows of different lengths across partitions: "
                               f"{sorted(widths)}")
        nf = widths.pop()
        low = np.min([s[3] for s in stats if s[3] is not None], axis=0)
        high = np.max([s[4] for s in stats if s[4] is not None], axis=0)
        scale = [low.tolist(), high.tolist()]
        shape = (1, 1, nf)
    sample_bytes = shape[0] * shape[1] * shape[2]
    per_shard = int(records_per_shard) or max(1, _SHARD_BYTES // (sample_bytes + 8))
    # Each partition's place: its train and test rows, shards and first samples.
    places, train_first, test_first, train_shards, test_shards = [], 0, 0, 0, 0
    for index, n, *_ in stats:
        n_test = n // every
        n_train = n - n_test
        places.append({"rows": n, "train": [train_shards, train_first, n_train],
                       "test": [test_shards, test_first, n_test]})
        train_first += n_train
        test_first += n_test
        train_shards += math.ceil(n_train / per_shard)
        test_shards += math.ceil(n_test / per_shard)
    if train_first == 0 or test_first == 0:
        raise PrepareError(f"{train_first} train and {test_first} test rows: the DataFrame is "
                           f"too small for test={test}")
    counts = {"train": train_shards, "test": test_shards}
    class_index = {v: i for i, v in enumerate(classes)}

    # Pass 2: every partition writes its shards.
    def write(index, rows):
        nat = _native()
        if index >= len(places):
            raise PrepareError(f"partition {index} was not there when the rows were counted "
                               f"({len(places)} partitions): the DataFrame is not "
                               "deterministic (cache or checkpoint it first)")
        place = places[index]
        buffers = {"train": ([], []), "test": ([], [])}
        written = {"train": 0, "test": 0}
        labels_out = {"train": [], "test": []}

        def flush(split):
            labels, pixels = buffers[split]
            if not labels:
                return
            first_shard, first_sample, _ = place[split]
            shard = first_shard + written[split] // per_shard
            nat.write_packed_shard(uri, split, shape[0], shape[1], shape[2], num_classes,
                                   shard, counts[split], first_sample + written[split],
                                   np.asarray(labels, dtype="<i4").tobytes(), b"".join(pixels))
            written[split] += len(labels)
            labels_out[split].extend(labels)
            buffers[split] = ([], [])

        n = 0
        for row in rows:
            if n >= place["rows"]:
                n += 1
                continue
            split = "test" if _is_test(n, every) else "train"
            value = row[label]
            if value is None:
                raise PrepareError(f"label: column '{label}' is null in row {n} of partition "
                                   f"{index}")
            y = class_index.get(value)
            if y is None:
                raise PrepareError(f"label: '{value}' in row {n} of partition {index} was not "
                                   "there when the rows were counted: the DataFrame is not "
                                   "deterministic (cache or checkpoint it first)")
            if kind == "image":
                value = row[names]
                if value is None:
                    raise PrepareError(f"features: column '{names}' is null in row {n} of "
                                       f"partition {index}")
                where = row["path"] if "path" in row.__fields__ else f"row {n}"
                try:
                    if isinstance(value, (bytes, bytearray)):
                        pixels = nat.decode_image(bytes(value), shape[0], shape[1], shape[2],
                                                  str(where))
                    else:
                        pixels = _image_struct_chw(value, *shape).tobytes()
                except Exception as error:  # noqa: BLE001 - named below
                    raise PrepareError(f"features: column '{names}', row {n} of partition "
                                       f"{index} ({where}): not an image pstrain decodes: "
                                       f"{error}") from None
            else:
                x = _row_features(kind, names, row)
                if x is None:
                    raise PrepareError(f"features: a null in row {n} of partition {index}")
                pixels = _quantize(x, scale).tobytes()
            labels, pix = buffers[split]
            labels.append(y)
            pix.append(pixels)
            if len(labels) == per_shard:
                flush(split)
            n += 1
        if n != place["rows"]:
            raise PrepareError(f"partition {index} gave {n} rows; {place['rows']} when they "
                               "were counted: the DataFrame is not deterministic (cache or "
                               "checkpoint it first)")
        flush("train")
        flush("test")
        yield index, labels_out["train"], labels_out["test"]

    columns = ([label] + [names] if kind in ("image", "vector") else [label] + list(names))
    if kind == "image" and "path" in schema:
        columns.append("path")
    written = sorted(_collect(df.select(*columns).rdd.mapPartitionsWithIndex(write),
                              "write the shards"))
    if len(written) != partitions:
        raise PrepareError(f"{len(written)} partitions were written, {partitions} counted")
    for split, at in (("train", 1), ("test", 2)):
        labels = [y for w in written for y in w[at]]
        native.write_packed_labels(uri, split, np.asarray(labels, dtype="<i4").tobytes(),
                                   num_classes)
    csv = "class,category_id,name\n" + "".join(
        f"{i},{_csv_field(v)},{_csv_field(v)}\n" for i, v in enumerate(classes))
    native.storage_write(_join(uri, "classes.csv"), csv.encode())
    manifest = {"version": _MANIFEST_VERSION, "shape": list(shape), "num_classes": num_classes,
                "classes": classes, "label_kind": label_kind, "kind": kind,
                "features": names, "scale": scale, "train_samples": train_first,
                "test_samples": test_first, "partitions": partitions,
                "created_unix_ms": int(time.time() * 1000)}
    native.storage_write(_join(uri, MANIFEST), json.dumps(manifest).encode())
    return Prepared(uri, manifest, reused=False)


def _csv_field(value):
    text = str(value)
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""').replace("\n", " ").replace("\r", " ") + '"'
    return text


def _quantize(x, scale):
    low, high = np.asarray(scale[0]), np.asarray(scale[1])
    span = np.where(high > low, high - low, 1.0)
    return np.clip(np.rint((x - low) / span * 255.0), 0, 255).astype(np.uint8)


def _collect(rdd, what):
    """rdd.collect(), with a task's PrepareError raised as itself."""
    try:
        return rdd.collect()
    except Exception as error:  # noqa: BLE001 - py4j's error carries the task's
        text = str(error)
        marker = "PrepareError: "
        if marker in text:
            message = text[text.index(marker) + len(marker):].split("\n")[0]
            raise PrepareError(message) from None
        raise


# --- Servers and credentials ----------------------------------------------------------


def _free_port(host):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _DriverServer:
    """A pstrain-server on the driver for one fit (no server given)."""

    def __init__(self, host, extra_args=()):
        self.workdir = tempfile.mkdtemp(prefix="pstrain-spark-server-")
        self.address = f"{host}:{_free_port(host)}"
        self.log_path = os.path.join(self.workdir, "server.log")
        argv = [_binary("pstrain-server"), "--listen", self.address,
                "--state-dir", os.path.join(self.workdir, "state"),
                "--heartbeat-timeout-ms", "3000", "--heartbeat-interval-ms", "250",
                "--checkpoint-interval-s", "5"] + list(extra_args)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            with open(self.log_path, "rb") as f:
                if b"listening on" in f.read():
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = self.log()
                self.stop()
                raise RuntimeError(f"pstrain-server did not start on {self.address}:\n{log}")
            time.sleep(0.05)

    def log(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _driver_server_host(sc, server_args):
    """Where a fit's own pstrain-server listens: 127.0.0.1 when the executors
    run on this machine (a local master, or a driver host that is loopback);
    else spark.driver.host, which a plaintext server may take only with
    --insecure in server_args (pstrain-server's listen policy)."""
    conf = sc.getConf()
    if (conf.get("spark.master", "") or "").startswith("local"):
        return "127.0.0.1"
    host = conf.get("spark.driver.host", "127.0.0.1")
    try:
        loopback = socket.gethostbyname(host).startswith("127.")
    except OSError:
        loopback = False
    if loopback:
        return host
    if "--insecure" not in server_args:
        raise ValueError(
            f"a fit without server= starts a pstrain-server on the driver, which the executors "
            f"reach at spark.driver.host={host}, not a loopback address: give server= (a "
            "pstrain-server with TLS and tokens, and tls=, token_file=, worker_credentials=), or "
            "server_args=['--insecure'] to accept a plaintext server on the network")
    return host


def _worker_credentials(credentials):
    """The workers' TLS and token file paths: a dict or a JSON file of
    {"tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file"}.
    Paths only: the files stay where they are, on every executor."""
    if credentials is None:
        return {}
    if isinstance(credentials, (str, os.PathLike)):
        with open(credentials, encoding="utf-8") as f:
            credentials = json.load(f)
    allowed = {"tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file"}
    unknown = set(credentials) - allowed
    if unknown:
        raise ValueError(f"worker_credentials: unknown keys {sorted(unknown)} (it takes "
                         f"{sorted(allowed)})")
    return {k: str(v) for k, v in credentials.items() if v}


def _hostname():
    return socket.gethostname()


# --- The barrier stage -------------------------------------------------------------------


def _spark_context():
    from pyspark.sql import SparkSession
    session = SparkSession.getActiveSession()
    if session is None:
        raise RuntimeError("pstrain.spark: no active SparkSession")
    return session.sparkContext


class _Stage:
    """One barrier-mode stage of `workers` tasks, each running `task(rank)`,
    in a thread of its own under a Spark job group (so that it can be
    cancelled alone)."""

    def __init__(self, sc, workers, task, description):
        self.sc = sc
        self.group = f"pstrain-{uuid.uuid4().hex[:12]}"
        self.error = None
        self.result = None
        self.done = threading.Event()

        def body():
            try:
                sc.setJobGroup(self.group, description, interruptOnCancel=True)
                rdd = sc.parallelize(range(workers), workers)
                # The barrier stage feeds a shuffle: Spark runs a failed barrier
                # ShuffleMapStage again (spark.stage.maxConsecutiveAttempts),
                # where a failed barrier ResultStage would end the job.
                self.result = rdd.barrier().mapPartitions(task).repartition(1).collect()
            except BaseException as error:  # noqa: BLE001 - handed to the driver's thread
                self.error = error
            finally:
                self.done.set()

        self.thread = pyspark.InheritableThread(target=body, daemon=True)
        self.thread.start()

    def cancel(self):
        self.sc.cancelJobGroup(self.group)

    def attempts(self):
        """How many times Spark ran the stage (1: no retry)."""
        tracker = self.sc.statusTracker()
        attempts = 0
        for job_id in tracker.getJobIdsForGroup(self.group):
            job = tracker.getJobInfo(job_id)
            for stage_id in (job.stageIds if job is not None else []):
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    attempts = max(attempts, stage.currentAttemptId + 1)
        return attempts


def _spark_error_text(error):
    """The cause in a failed Spark job's error: Spark's own reason (a stage
    abort, a cancellation) or the task's Python exception."""
    lines = [line.strip() for line in str(error).split("\n") if line.strip()]
    for pattern in ("Job aborted due to stage failure", "cancelled", "Could not recover"):
        for line in lines:
            if pattern in line:
                return line[line.index(pattern) if pattern[0].isupper() else 0:][:900]
    for line in reversed(lines):
        if not line.startswith("at ") and ("Error" in line or "Exception" in line):
            return line[:900]
    return lines[0][:900] if lines else type(error).__name__


class _Progress:
    """The job's progress line on the console, or a live line in a notebook."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.handle = None
        self.last = ""
        if enabled and "ipykernel" in sys.modules:
            try:
                from IPython.display import display
                self.handle = display("", display_id=True)
            except Exception:  # noqa: BLE001 - a console then
                self.handle = None

    def show(self, line):
        if not self.enabled or line == self.last:
            return
        if self.handle is not None:
            self.handle.update(line)
        else:
            # Padded over what the previous, longer line left.
            sys.stderr.write("\r" + line[:160].ljust(min(160, len(self.last))))
            sys.stderr.flush()
        self.last = line

    def close(self):
        if self.enabled and self.handle is None and self.last:
            sys.stderr.write("\n")


def _train(sc, client, job, workers, task, progress, description):
    """Runs the barrier stage while the driver follows the job; returns its
    final JobStatus, the tasks' results (None when the stage did not end
    by itself) and how many times Spark ran the stage. The job is cancelled, with the cause, when the stage fails
    for good or is cancelled, or on Ctrl-C."""
    bar = _Progress(progress)
    stage = _Stage(sc, workers, task, description)
    try:
        while True:
            status = job.status()
            bar.show(status.progress_line())
            if status.done:
                # The tasks end by themselves once the job ended.
                stage.done.wait(timeout=120)
                if not stage.done.is_set():
                    stage.cancel()
                return status, stage.result, stage.attempts()
            if stage.done.wait(timeout=0.5):
                if stage.error is not None:
                    cause = _spark_error_text(stage.error)
                    final = job.cancel(reason=f"the Spark stage failed: {cause}")
                    raise SparkTrainingError(
                        f"{job.id}: {final.state}: the Spark stage failed: {cause}") from None
                status = _wait_done(job, timeout=60)
                if not status.done:
                    job.cancel(reason="the Spark stage ended before the job")
                    raise SparkTrainingError(
                        f"{job.id}: the Spark stage ended but the job is {status.state}")
                return status, stage.result, stage.attempts()
    except KeyboardInterrupt:
        job.cancel(reason="interrupted on the Spark driver")
        stage.cancel()
        raise
    finally:
        bar.close()


def _wait_done(job, timeout):
    deadline = time.monotonic() + timeout
    while True:
        status = job.status()
        if status.done or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _model_spec_task(server, job_id, creds, data_root, threads):
    """A barrier task: the C++ trainer bound to the job, until it ends."""

    def task(iterator):
        ctx = BarrierTaskContext.get()
        list(iterator)
        from pstrain import _native as native
        worker = native.BoundWorker(server, job_id, device="cpu", threads=threads,
                                    data_roots=[data_root], hostname=_hostname(), **creds)
        finished = worker.run()
        yield {"partition": ctx.partitionId(), "attempt": ctx.attemptNumber(),
               "worker": worker.worker_id, "finished": finished}

    return task


def _torch_task(server, job_id, mode, creds, train_fn, args, kwargs):
    """A barrier task: the user's pstrain.torch function, with the launcher's
    environment (PSTRAIN_SERVER, PSTRAIN_JOB, PSTRAIN_MODE, PSTRAIN_CREDENTIALS:
    those `pstrain run` gives). The credentials file (paths only, the JSON
    pstrain.torch reads) is written on the executor and removed after."""

    def task(iterator):
        ctx = BarrierTaskContext.get()
        list(iterator)
        os.environ["PSTRAIN_SERVER"] = server
        os.environ["PSTRAIN_JOB"] = job_id
        os.environ["PSTRAIN_MODE"] = mode
        os.environ["PSTRAIN_LAUNCHER"] = ""
        path = None
        if creds:
            fd, path = tempfile.mkstemp(prefix="pstrain-credentials-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(creds, f)
            os.environ["PSTRAIN_CREDENTIALS"] = path
        else:
            os.environ.pop("PSTRAIN_CREDENTIALS", None)
        try:
            result = train_fn(*args, **kwargs)
        finally:
            if path is not None:
                os.unlink(path)
        yield {"partition": ctx.partitionId(), "attempt": ctx.attemptNumber(),
               "result": result}

    return task


# --- Estimator ------------------------------------------------------------------------------


_SUBMIT_KEYS = ("epochs", "batch_size", "mode", "staleness", "averaging_frequency",
                "average_optimizer_state", "compression", "topk_ratio", "min_compress_bytes",
                "pull_compression", "pull_topk_ratio", "seed", "name")


class Estimator(_SparkEstimator, HasFeaturesCol, HasLabelCol, HasPredictionCol):
    """A Spark ML Estimator that trains through pstrain's servers.

    model: a pstrain.Model (e.g. pstrain.Sequential), its JSON ModelSpec
      (str), or a torch.nn.Module (then give `loss`, a function of (output,
      labels), and a torch `optimizer` factory or pstrain optimizer for the
      servers).
    server: "host:port" of pstrain-server 0; None starts one on the driver for
      the fit (reached by the executors at spark.driver.host).
    store: where prepare() packs the DataFrame (shared path or s3://).
    features / label (or featuresCol / labelCol), image_size, channels, test,
      mean, std: as prepare() and pstrain.datasets.Packed take them.
    workers: barrier tasks, one pstrain worker each; threads: CPU threads each.
    optimizer: a pstrain.optimizers.* (the servers' optimizer).
    tls, token_file: the driver's client credentials (admin); worker_credentials:
      the workers' TLS and token file paths (dict or JSON file).
    The other keywords are Client.submit's: epochs, batch_size, mode, staleness,
    averaging_frequency, compression, seed, ...
    """

    def __init__(self, model, server=None, store=None, features=None, label=None,
                 featuresCol=None, labelCol=None, predictionCol="prediction", image_size=None,
                 channels=1, test=0.1, mean=None, std=None, workers=2, threads=1,
                 optimizer=None, loss=None, tls=None, token_file=None, worker_credentials=None,
                 progress=True, server_args=(), **submit):
        super().__init__()
        unknown = set(submit) - set(_SUBMIT_KEYS)
        if unknown:
            raise TypeError(f"Estimator: unknown keywords {sorted(unknown)}")
        features = features or featuresCol
        label = label or labelCol
        if features is not None:
            self._set(featuresCol=features if isinstance(features, str) else ",".join(features))
        if label is not None:
            self._set(labelCol=label)
        self._set(predictionCol=predictionCol)
        self.model, self.server, self.store = model, server, store
        self.features = features
        self.image_size, self.channels, self.test = image_size, channels, test
        self.mean, self.std = mean, std
        self.workers, self.threads = int(workers), int(threads)
        self.optimizer, self.loss = optimizer, loss
        self.tls, self.token_file = tls, token_file
        self.worker_credentials = worker_credentials
        self.progress, self.server_args = progress, tuple(server_args)
        self.submit = submit
        self.last_prepared = None  # The latest fit's Prepared (its `reused`, `uri`).
        self.last_tasks = None     # The latest fit's barrier tasks, as they ended.
        self.last_stage_attempts = 0  # How often Spark ran the latest fit's stage.
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if store is None:
            raise ValueError("store= names where the DataFrame is packed: a path every executor "
                             "reaches, or an s3:// prefix")

    def _features(self):
        if self.features is not None:
            return self.features
        value = self.getFeaturesCol()
        return value.split(",") if "," in value else value

    def _is_torch(self):
        try:
            import torch
        except ImportError:
            return False
        return isinstance(self.model, torch.nn.Module)

    def _model_spec(self):
        if isinstance(self.model, PstrainModel):
            return self.model.to_spec()
        if isinstance(self.model, str):
            return PstrainModel.from_json(self.model).to_spec()
        raise TypeError("model must be a pstrain.Model, a JSON ModelSpec or a torch.nn.Module, "
                        f"got {type(self.model).__name__}")

    def _spec(self, prepared, torch_model):
        s = dict(self.submit)
        dataset = prepared.dataset(mean=self.mean, std=self.std)
        optimizer = self.optimizer or optimizers_lib.SGD(0.01)
        spec = job_pb2.JobSpec(
            name=s.get("name") or "spark-fit", dataset=dataset.to_spec(),
            optimizer=optimizer.to_spec(), epochs=int(s.get("epochs", 1)),
            batch_size=int(s.get("batch_size", 64)), seed=int(s.get("seed", 0)),
            workers=self.workers, mode=client_lib.MODES[s.get("mode", "sync")],
            staleness=int(s.get("staleness", 0)),
            averaging_frequency=int(s.get("averaging_frequency", 0)),
            average_optimizer_state=bool(s.get("average_optimizer_state", False)),
            compression=job_pb2.CompressionSpec(
                method=client_lib.COMPRESSION[s.get("compression", "none")],
                topk_ratio=float(s.get("topk_ratio", 0.0))),
            pull_compression=job_pb2.CompressionSpec(
                method=client_lib.COMPRESSION[s.get("pull_compression", "none")],
                topk_ratio=float(s.get("pull_topk_ratio", 0.0))),
            bound_workers=True)
        if s.get("min_compress_bytes") is not None:
            spec.compression.min_compress_bytes = int(s["min_compress_bytes"])
        if torch_model:
            # The tasks read the packing themselves (_torch_fit).
            spec.ClearField("dataset")
            spec.external_model.framework = "torch"
        else:
            spec.model.CopyFrom(self._model_spec())
        return spec

    def _fit(self, df):
        sc = df.sparkSession.sparkContext
        prepared = prepare(df, self.store, features=self._features(), label=self.getLabelCol(),
                           image_size=self.image_size, channels=self.channels, test=self.test)
        torch_model = self._is_torch()
        local = None
        server = self.server
        if server is None:
            local = _DriverServer(_driver_server_host(sc, self.server_args), self.server_args)
            server = local.address
        try:
            client = client_lib.Client(server, token_file=self.token_file,
                                       tls=self.tls if local is None else False)
            job = client.submit_spec(self._spec(prepared, torch_model))
            creds = _worker_credentials(self.worker_credentials) if local is None else {}
            if torch_model:
                task = _torch_task(server, job.id, self.submit.get("mode", "sync"), creds,
                                   _torch_fit,
                                   (_TorchFit(self.model, self.loss, self.optimizer,
                                              prepared.uri),), {})
            else:
                task = _model_spec_task(server, job.id, creds, prepared.uri, self.threads)
            status, self.last_tasks, self.last_stage_attempts = _train(
                sc, client, job, self.workers, task, self.progress,
                f"pstrain {job.id}: {self.workers} workers")
            self.last_prepared = prepared
            if not status.succeeded:
                raise SparkTrainingError(f"{job.id} {status.state}: {status.reason}")
            with tempfile.TemporaryDirectory(prefix="pstrain-spark-") as tmp:
                checkpoint = job.download(os.path.join(tmp, "model.ckpt"))
                with open(os.path.join(tmp, "model.ckpt"), "rb") as f:
                    data = f.read()
            report = _html_report(server, job.id, self.token_file if local is None else None,
                                  self.tls if local is None else None)
            model = Model(data, prepared.manifest, job_id=job.id, server=server if local is None
                          else None, status=status.proto.SerializeToString(), report=report,
                          torch_module=self.model if torch_model else None)
            model._set(featuresCol=self.getFeaturesCol(), labelCol=self.getLabelCol(),
                       predictionCol=self.getPredictionCol())
            model.checkpoint = checkpoint
            return model
        finally:
            if local is not None:
                local.stop()


def _html_report(server, job_id, token_file, tls):
    """`pstrain report JOB -o F.html`'s page, read before a driver's server stops."""
    try:
        binary = _binary("pstrain")
    except FileNotFoundError:
        return None
    env = dict(os.environ, PSTRAIN_SERVER=server)
    if token_file:
        env["PSTRAIN_TOKEN_FILE"] = token_file
    if tls is not None:
        env.update({"PSTRAIN_TLS_CA": tls.ca or "", "PSTRAIN_TLS_CERT": tls.cert or "",
                    "PSTRAIN_TLS_KEY": tls.key or ""})
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.html")
        done = subprocess.run([binary, "report", job_id, "-o", out], env=env,
                              capture_output=True, timeout=120)
        if done.returncode != 0 or not os.path.exists(out):
            return None
        with open(out, encoding="utf-8") as f:
            return f.read()


# --- PyTorch modules through Estimator ------------------------------------------------


class _TorchFit:
    """The training loop a barrier task runs for a torch module: the packed
    shards of the task's share, read with pstrain's own packed reader order
    (pstrain.torch's DistributedSampler over the packing's train split)."""

    def __init__(self, module, loss, optimizer, uri):
        if loss is None:
            raise ValueError("a torch module needs loss=, a function of (outputs, labels)")
        self.module, self.loss, self.uri = module, loss, uri
        # Average mode trains with a local SGD of the servers' learning rate.
        self.lr = float(getattr(optimizer, "learning_rate", 0.01))


def _read_packed_split(uri, split):
    """A packed split's pixels (N, C, H, W uint8) and labels, read whole."""
    native = _native()
    manifest = _read_manifest(uri)
    if manifest is None:
        raise FileNotFoundError(f"{uri}: no {MANIFEST}: not a packing prepare() finished")
    c, h, w = manifest["shape"]
    record = c * h * w + 8
    count = manifest[f"{split}_samples"]
    pixels = np.empty((count, c, h, w), dtype=np.uint8)
    labels = np.empty(count, dtype=np.int64)
    shards = []
    for name in native.storage_list(uri):
        if name.startswith(f"{split}-") and name.endswith(".pspack"):
            shards.append(name)
    at = 0
    for name in sorted(shards):
        data = native.storage_read(_join(uri, name), 64 + record * count)
        n = (len(data) - 64) // record
        if n:
            body = np.frombuffer(data, dtype=np.uint8, offset=64, count=n * record)
            body = body.reshape(n, record)
            labels[at:at + n] = body[:, :4].copy().view("<i4").reshape(n)
            pixels[at:at + n] = body[:, 4:4 + c * h * w].reshape(n, c, h, w)
        at += n
    if at != count:
        raise ValueError(f"{uri}: {at} {split} samples in the shards, {count} in the manifest")
    return pixels, labels


def _torch_fit(fit):
    """Runs in a barrier task: trains `fit.module` through pstrain.torch."""
    import torch
    import pstrain.torch as pst
    pixels, labels = _read_packed_split(fit.uri, "train")
    images = torch.from_numpy(pixels.astype(np.float32) / 255.0)
    targets = torch.from_numpy(labels)
    dataset = torch.utils.data.TensorDataset(images, targets)
    worker = pst.init()
    module = fit.module
    local_optimizer = None
    if pst.mode() == "average":
        local_optimizer = torch.optim.SGD(module.parameters(), lr=fit.lr)
    opt = pst.DistributedOptimizer(module, optimizer=local_optimizer)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=pst.DistributedSampler(dataset))
    last = None
    for _epoch in pst.epochs():
        correct = seen = 0
        for x, y in loader:
            opt.zero_grad()
            out = module(x)
            loss = fit.loss(out, y)
            loss.backward()
            opt.step()
            correct += int((out.argmax(1) == y).sum())
            seen += len(y)
            last = float(loss)
        pst.report(loss=last, accuracy=correct / max(1, seen))
    worker.close()
    return last


# --- run() --------------------------------------------------------------------------------


def run(train_fn, num_workers, *args, server=None, spark=None, epochs=1, batch_size=64,
        mode="sync", optimizer=None, tls=None, token_file=None, worker_credentials=None,
        progress=True, name=None, server_args=(), **kwargs):
    """Runs `train_fn(*args, **kwargs)`, a pstrain.torch training function,
    on `num_workers` barrier tasks (one pstrain worker each), as
    TorchDistributor runs a PyTorch loop; returns the final JobStatus and
    every task's return value, in rank order: (status, results).

    The job (external model, the workers bound to it) takes the servers'
    optimizer (a pstrain.optimizers.*; default SGD(0.01)), epochs,
    batch_size and mode; the function finds the job through the launcher's
    environment (pst.init()), as under `pstrain run -n N`.
    """
    sc = spark.sparkContext if spark is not None else _spark_context()
    local = None
    if server is None:
        local = _DriverServer(_driver_server_host(sc, server_args), server_args)
        server = local.address
    try:
        client = client_lib.Client(server, token_file=token_file,
                                   tls=tls if local is None else False)
        optimizer = optimizer or optimizers_lib.SGD(0.01)
        spec = job_pb2.JobSpec(
            name=name or getattr(train_fn, "__name__", "spark-run"),
            optimizer=optimizer.to_spec(), epochs=int(epochs), batch_size=int(batch_size),
            workers=int(num_workers), mode=client_lib.MODES[mode], bound_workers=True)
        spec.external_model.framework = "torch"
        job = client.submit_spec(spec)
        creds = _worker_credentials(worker_credentials) if local is None else {}
        task = _torch_task(server, job.id, mode, creds, train_fn, args, kwargs)
        status, results, _ = _train(sc, client, job, int(num_workers), task, progress,
                                    f"pstrain {job.id}: {num_workers} workers")
        if not status.succeeded:
            raise SparkTrainingError(f"{job.id} {status.state}: {status.reason}")
        ranked = sorted(results or [], key=lambda r: r["partition"])
        return status, [r["result"] for r in ranked]
    finally:
        if local is not None:
            local.stop()


# --- Model ----------------------------------------------------------------------------------


class Model(_SparkTransformer, HasFeaturesCol, HasLabelCol, HasPredictionCol, MLWritable,
            MLReadable):
    """A fitted model: transform(df) adds `prediction` (the class: the label
    value, string or int, as in the training DataFrame) and `probability`
    (an array of the classes' probabilities), computed on the executors
    (pstrain's CPU engine for a ModelSpec, the module for PyTorch).

    checkpoint_bytes: the job's final checkpoint (Checkpoint.from_bytes);
    metrics: the job's test metrics (pstrain.Metrics); report_html: the
    job's HTML report; export_onnx(path) for a ModelSpec. save(path) /
    Model.load(path) follow Spark ML's MLWritable/MLReadable."""

    probabilityCol = Param(Params._dummy(), "probabilityCol", "the probabilities' column")

    def __init__(self, checkpoint_bytes=b"", manifest=None, job_id=None, server=None,
                 status=b"", report=None, torch_module=None):
        super().__init__()
        self._setDefault(probabilityCol="probability")
        self.checkpoint_bytes = bytes(checkpoint_bytes)
        self.manifest = manifest or {}
        self.job_id, self.server = job_id, server
        self.status_bytes = bytes(status)
        self.report_html = report
        self.torch_module = torch_module
        self.checkpoint = Checkpoint.from_bytes(self.checkpoint_bytes) if checkpoint_bytes else None

    @property
    def status(self):
        from pstrain._proto import service_pb2
        return client_lib.JobStatus(service_pb2.JobStatus.FromString(self.status_bytes))

    @property
    def metrics(self):
        return self.status.test

    def export_onnx(self, path):
        return self.checkpoint.export_onnx(path)

    def save_report(self, path):
        if not self.report_html:
            raise FileNotFoundError("no HTML report was taken for this model")
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.report_html)

    def _transform(self, df):
        features = self.getFeaturesCol()
        names = features.split(",") if "," in features else features
        manifest = self.manifest
        kind, classes, scale = manifest["kind"], manifest["classes"], manifest.get("scale")
        shape = manifest["shape"]
        ckpt = df.sparkSession.sparkContext.broadcast(self.checkpoint_bytes)
        module = self.torch_module
        prediction, probability = self.getPredictionCol(), self.getOrDefault("probabilityCol")
        label_type = T.StringType() if manifest.get("label_kind") == "string" else T.LongType()
        schema = T.StructType(df.schema.fields + [
            T.StructField(prediction, label_type, False),
            T.StructField(probability, T.ArrayType(T.DoubleType(), False), False)])

        def predict(rows):
            rows = list(rows)
            if not rows:
                return
            pixels = []
            for n, row in enumerate(rows):
                if kind == "image":
                    value = row[names]
                    if value is None:
                        raise PrepareError(f"features: column '{names}' is null in row {n}")
                    if isinstance(value, (bytes, bytearray)):
                        pixels.append(_native().decode_image(bytes(value), *shape, f"row {n}"))
                    else:
                        pixels.append(_image_struct_chw(value, *shape).tobytes())
                else:
                    x = _row_features(kind, names, row)
                    if x is None:
                        raise PrepareError(f"features: a null in row {n}")
                    pixels.append(_quantize(x, scale).tobytes())
            logits = _logits(ckpt.value, module, b"".join(pixels), shape)
            shifted = logits - logits.max(axis=1, keepdims=True)
            prob = np.exp(shifted)
            prob /= prob.sum(axis=1, keepdims=True)
            for row, p in zip(rows, prob):
                yield tuple(row) + (classes[int(p.argmax())], [float(v) for v in p])

        return df.sparkSession.createDataFrame(df.rdd.mapPartitions(predict), schema)

    def write(self):
        return _ModelWriter(self)

    @classmethod
    def read(cls):
        return _ModelReader()


def _logits(checkpoint_bytes, module, pixels, shape):
    n = len(pixels) // (shape[0] * shape[1] * shape[2])
    if module is None:
        with tempfile.NamedTemporaryFile(suffix=".ckpt") as f:
            f.write(checkpoint_bytes)
            f.flush()
            predictor = _native().Predictor(f.name, threads=1)
        logits = np.asarray(predictor.logits(pixels), dtype=np.float64)
        return logits.reshape(n, -1)
    import torch
    Checkpoint.from_bytes(checkpoint_bytes).load_into(module)
    module.eval()
    x = torch.from_numpy(np.frombuffer(pixels, dtype=np.uint8).reshape(n, *shape)
                         .astype(np.float32) / 255.0)
    with torch.no_grad():
        return module(x).double().numpy()


class _ModelWriter(MLWriter):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def saveImpl(self, path):
        m = self.model
        os.makedirs(path, exist_ok=True)
        metadata = {"class": "pstrain.spark.Model", "pyspark": pyspark.__version__,
                    "uid": m.uid, "timestamp": int(time.time() * 1000),
                    "paramMap": {p.name: m.getOrDefault(p) for p in m.params if m.isDefined(p)},
                    "manifest": m.manifest, "job_id": m.job_id, "server": m.server,
                    "torch": m.torch_module is not None}
        with open(os.path.join(path, "metadata.json"), "w", encoding="utf-8") as f:
            json.dump(metadata, f)
        with open(os.path.join(path, "model.ckpt"), "wb") as f:
            f.write(m.checkpoint_bytes)
        with open(os.path.join(path, "status.pb"), "wb") as f:
            f.write(m.status_bytes)
        if m.report_html:
            with open(os.path.join(path, "report.html"), "w", encoding="utf-8") as f:
                f.write(m.report_html)
        if m.torch_module is not None:
            import torch
            torch.save(m.torch_module, os.path.join(path, "module.pt"))


class _ModelReader(MLReader):
    def load(self, path):
        with open(os.path.join(path, "metadata.json"), encoding="utf-8") as f:
            metadata = json.load(f)
        if metadata.get("class") != "pstrain.spark.Model":
            raise ValueError(f"{path}: not a pstrain.spark.Model (class {metadata.get('class')})")
        with open(os.path.join(path, "model.ckpt"), "rb") as f:
            checkpoint = f.read()
        with open(os.path.join(path, "status.pb"), "rb") as f:
            status = f.read()
        report = None
        if os.path.exists(os.path.join(path, "report.html")):
            with open(os.path.join(path, "report.html"), encoding="utf-8") as f:
                report = f.read()
        module = None
        if metadata.get("torch"):
            import torch
            module = torch.load(os.path.join(path, "module.pt"), weights_only=False)
        model = Model(checkpoint, metadata["manifest"], metadata.get("job_id"),
                      metadata.get("server"), status, report, module)
        model._resetUid(metadata["uid"])
        for name, value in metadata["paramMap"].items():
            if model.hasParam(name):
                model._set(**{name: value})
        return model
