"""pytest set-up for the Python package's tests (tests/python/).

The tests run against real binaries: `pstrain` (summary, download),
`pstrain-worker` (standalone training that writes a checkpoint) and, for the
`cluster` tests, a server and two CPU workers (cluster.py). They are found
in --bin-dir, else $PSTRAIN_BIN_DIR, else <repo>/build/bin; ctest passes the
suite's own build (tests/CMakeLists.txt, test `python_client_*`). The
package itself is imported from PYTHONPATH: the CMake build's <build>/python
(python/CMakeLists.txt), or an installed one.

    PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python [--bin-dir=build/bin] [-m cluster]

(the test directory before --bin-dir: pytest reads this file's options only
once it knows the directory).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)  # cluster.py


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
