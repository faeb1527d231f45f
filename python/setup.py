"""setuptools glue: build_py also generates pstrain/v1 from ../proto (gen_stubs.py).

Everything else is in pyproject.toml. PSTRAIN_PROTO_DIR overrides where the
.proto files are (default: the repository's proto/ beside this directory).
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_stubs  # noqa: E402  (beside this file)


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        proto_dir = os.environ.get("PSTRAIN_PROTO_DIR", os.path.join(HERE, "..", "proto"))
        gen_stubs.generate(os.path.abspath(proto_dir), self.build_lib)


setup(cmdclass={"build_py": BuildPyWithStubs})
