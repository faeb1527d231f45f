"""What pstrain.spark stands on, against a real Spark standalone cluster on
127.0.0.1 (spark_cluster.py: a Master and two 1-core Workers): a barrier
stage runs one task per executor JVM, its tasks find each other
(BarrierTaskContext.allGather) and import pstrain; images written as PNG
files read back through Spark's binaryFile source byte for byte.

pyspark comes from PyPI, in <build>/venv-spark (deploy/local/test.sh);
without it, or without java, the tests skip.

    PYTHONPATH=build/python build/venv-spark/bin/python3 -m pytest tests/python/test_spark.py \\
        -p no:cacheprovider -q -m spark --bin-dir=build/bin
"""

import os
import struct
import urllib.parse
import zlib

import pytest

from spark_cluster import read_fashion_mnist, write_fashion_mnist_pngs

pytestmark = pytest.mark.spark

PNG_LIMIT = 200  # Fashion-MNIST test images written as PNG files.


def barrier_task(_):
    """One barrier task: (partition id, Python pid, executor JVM pid, every
    task's partition id from allGather, where pstrain came from or the
    ImportError). Executors import this module to find it (by name): it
    imports pstrain only here, so a missing one is reported, not fatal."""
    from pyspark import BarrierTaskContext

    from spark_cluster import executor_jvm_pid
    context = BarrierTaskContext.get()
    gathered = context.allGather(str(context.partitionId()))
    try:
        import pstrain as imported
        origin = imported.__file__
    except ImportError as e:
        origin = f"ImportError: {e}"
    yield context.partitionId(), os.getpid(), executor_jvm_pid(), sorted(gathered), origin


def test_a_barrier_stage_runs_one_task_per_executor_jvm(spark_cluster, spark_session):
    import pstrain
    sc = spark_session.sparkContext
    results = sc.parallelize(range(2), 2).barrier().mapPartitions(barrier_task).collect()

    assert sorted(r[0] for r in results) == [0, 1]
    jvms = [r[2] for r in results]
    assert None not in jvms, results
    assert len(set(jvms)) == 2, f"both tasks ran in one executor JVM: {results}"
    assert set(jvms) == set(spark_cluster.executor_pids(sc.applicationId))
    assert len({r[1] for r in results}) == 2
    for r in results:
        assert r[3] == ["0", "1"], r  # allGather: each task saw both.
        assert r[4] == pstrain.__file__, r  # The driver's pstrain (PYTHONPATH).


def decode_png_gray8(data):
    """The pixels of an unfiltered 8-bit grayscale PNG: (width, height, bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, idat, header = 8, b"", None
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset:offset + 4]), data[offset + 4:offset + 8]
        body = data[offset + 8:offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length:offset + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        offset += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert (depth, colour, interlace) == (8, 0, 0), header
    raw = zlib.decompress(idat)
    rows = [raw[y * (width + 1):(y + 1) * (width + 1)] for y in range(height)]
    assert all(row[0] == 0 for row in rows)  # Filter type None.
    return width, height, b"".join(row[1:] for row in rows)


def test_png_files_read_back_through_binary_file_as_the_idx_pixels(spark_session, tmp_path):
    root = tmp_path / "png"
    paths, labels = write_fashion_mnist_pngs(str(root), "test", PNG_LIMIT)
    images, idx_labels = read_fashion_mnist("test", PNG_LIMIT)
    assert labels == idx_labels and set(labels) == set(range(10))

    frame = (spark_session.read.format("binaryFile")
             .option("pathGlobFilter", "*.png").option("recursiveFileLookup", "true")
             .load(str(root)))
    assert frame.count() == PNG_LIMIT
    rows = {urllib.parse.urlparse(row.path).path: row
            for row in frame.select("path", "length", "content").collect()}

    assert sorted(rows) == sorted(paths)
    for index, (path, label) in enumerate(zip(paths, labels)):
        assert os.path.relpath(path, root) == f"{label}/{index}.png"
        content = bytes(rows[path].content)
        assert rows[path].length == len(content) == os.path.getsize(path)
        assert decode_png_gray8(content) == (28, 28, images[index]), path
