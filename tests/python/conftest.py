"""pytest set-up for the Python package's tests (tests/python/).

The tests run against real binaries: `pstrain` (summary, download),
`pstrain-worker` (standalone training that writes a checkpoint) and, for the
`cluster` tests, a server and two CPU workers (cluster.py); the `spark` tests
also start a Spark standalone cluster (spark_cluster.py) with the running
interpreter's pyspark (<build>/venv-spark). They are found
in --bin-dir, else $PSTRAIN_BIN_DIR, else <repo>/build/bin; ctest passes the
suite's own build (tests/CMakeLists.txt, test `python_client_*`). The
package itself is imported from PYTHONPATH: the CMake build's <build>/python
(python/CMakeLists.txt), or an installed one.

    PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python [--bin-dir=build/bin] [-m cluster]

(the test directory before --bin-dir: pytest reads this file's options only
once it knows the directory).
"""

import os
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)  # cluster.py, spark_cluster.py


def pytest_addoption(parser):
    parser.addoption("--bin-dir", default=None,
                     help="directory of pstrain, pstrain-server and pstrain-worker "
                          "(default: $PSTRAIN_BIN_DIR, else <repo>/build/bin)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cluster: starts a real server and CPU workers")
    config.addinivalue_line("markers", "torch: trains PyTorch models through a real server "
                                       "(pstrain.torch; ctest python_torch)")
    config.addinivalue_line("markers", "s3: datasets in moto's S3 behind a fault proxy "
                                       "(ctest python_client_s3)")
    config.addinivalue_line("markers", "spark: a real Spark standalone cluster (pyspark from "
                                       "<build>/venv-spark; ctest python_client_spark)")


@pytest.fixture(scope="session")
def source_dir():
    return REPO


@pytest.fixture(scope="session")
def bin_dir(request):
    path = (request.config.getoption("--bin-dir") or os.environ.get("PSTRAIN_BIN_DIR")
            or os.path.join(REPO, "build", "bin"))
    for name in ("pstrain", "pstrain-server", "pstrain-worker"):
        if not os.access(os.path.join(path, name), os.X_OK):
            pytest.fail(f"{name} is not in {path}: build the project (deploy/local/build.sh) or "
                        "give --bin-dir / PSTRAIN_BIN_DIR")
    return path


@pytest.fixture(scope="session")
def fashion_mnist():
    path = "/usr/share/datasets/fashion-mnist"
    if not os.path.exists(os.path.join(path, "train-images-idx3-ubyte.gz")):
        pytest.fail(f"Fashion-MNIST is not in {path}: install Debian's dataset-fashion-mnist "
                    "(deploy/local/install-deps.sh)")
    return path


@pytest.fixture(scope="session")
def cluster(bin_dir, source_dir, tmp_path_factory):
    """One server (TLS, mTLS, tokens) and two CPU workers for the session."""
    from cluster import LocalCluster
    workdir = str(tmp_path_factory.mktemp("cluster"))
    with LocalCluster(bin_dir, source_dir, workdir, workers=2) as running:
        yield running


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory):
    """A Spark Master and two Workers (1 core, 1 GiB each) on 127.0.0.1 for
    the session; executors run this interpreter. Skips without pyspark
    (deploy/local/test.sh installs it in <build>/venv-spark) or java. Tests
    take their session from it (spark_session), one at a time. Executors can
    import this directory's modules: a task function defined at a test
    module's top level reaches them by name (cloudpickle pickles by
    reference what it can import), as do spark_cluster.py's helpers."""
    from spark_cluster import SparkStandalone, spark_home
    if spark_home() is None:
        pytest.skip(f"no pyspark (with bin/spark-class) for {sys.executable}: run the Spark "
                    "tests with <build>/venv-spark/bin/python3 (deploy/local/test.sh makes it)")
    # spark-class runs $JAVA_HOME/bin/java, else the java on PATH.
    java_home = os.environ.get("JAVA_HOME")
    java = os.path.join(java_home, "bin", "java") if java_home else shutil.which("java")
    if not (java and os.access(java, os.X_OK)):
        pytest.skip("no java for Spark: install openjdk-17-jre-headless "
                    "(deploy/local/install-deps.sh)")
    workdir = str(tmp_path_factory.mktemp("spark"))
    with SparkStandalone(workdir, python=sys.executable, workers=2,
                         extra_pythonpath=[HERE]) as running:
        yield running


@pytest.fixture
def spark_session(spark_cluster, request):
    """A SparkSession on spark_cluster named after the test, stopped after it
    (with its driver JVM and, by the Workers, its executors)."""
    yield spark_cluster.session(request.node.name)
    spark_cluster.stop_session()
