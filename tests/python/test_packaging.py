"""`pip install ./python` works with Debian's python3, setuptools, grpcio,
protobuf and numpy, offline: the package's build step generates pstrain.v1
from proto/ (gen_stubs.py), and the installed package imports on its own."""

import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pip_install_generates_the_stubs(tmp_path):
    # A copy of the sources: pip builds in the tree it is given.
    src = tmp_path / "src"
    shutil.copytree(os.path.join(REPO, "python"), src / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    shutil.copytree(os.path.join(REPO, "proto"), src / "proto")
    assert not (src / "python" / "pstrain" / "v1").exists()  # Nothing generated is committed.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index",
         "--no-build-isolation", "--disable-pip-version-check", str(src / "python")],
        env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    def installed_python(code):  # Its output, run outside the sources.
        run = subprocess.run([str(venv / "bin" / "python"), "-c", code], env=env,
                             cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stdout

    installed, stub = installed_python(
        "import pstrain, pstrain.v1.service_pb2_grpc as g; print(pstrain.__file__); "
        "print(g.CoordinatorStub.__name__)").split()
    assert installed.startswith(str(venv)) and stub == "CoordinatorStub"
    # The optional features are declared as extras (pip install 'pstrain[onnx]',
    # 'pstrain[torch]', 'pstrain[spark]').
    provides, requires = json.loads(installed_python(
        "import importlib.metadata as m, json; d = m.metadata('pstrain'); "
        "print(json.dumps([d.get_all('Provides-Extra'), d.get_all('Requires-Dist')]))"))
    assert sorted(provides) == ["onnx", "spark", "torch"], provides
    # Spelled "onnx (>=1.13) ; extra == 'onnx'" or 'onnx>=1.13; extra == "onnx"'.
    onnx = [r.replace(" ", "").replace('"', "'") for r in requires if r.startswith("onnx")]
    assert onnx and all(r.endswith(";extra=='onnx'") for r in onnx), requires
    torch = [r.replace(" ", "").replace('"', "'") for r in requires if r.startswith("torch")]
    assert torch and all(r.endswith(";extra=='torch'") for r in torch), requires
    spark = [r.replace(" ", "").replace('"', "'") for r in requires if r.startswith("pyspark")]
    assert spark and all(r.endswith(";extra=='spark'") for r in spark), requires
