"""Builds tracekit's one optional C++ extension (the fused sparse SGD of tracekit/dlrm/csrc).

Metadata lives in pyproject.toml. Everything `record`, `analyze` and `report` need is pure
Python; the extension only speeds up the reference trainer's sparse SGD, and
tracekit/dlrm/optim.py falls back to torch's index_add_ without it. So it is built when it
can be and skipped, with a warning, when it can't:
- `pip install PATH` (build isolation): torch is not importable in the isolated build
  environment, so this is a pure-Python install that leaves the user's torch alone;
- `make venv` (`pip install --no-build-isolation -e .` after requirements.txt): torch is
  importable, so the kernel is compiled (~1 min), unless no C++ compiler works.
"""

import subprocess
import sys

from setuptools import setup
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # build isolation, or no torch: a pure-Python install
    BuildExtension = CppExtension = None

SKIPPED = "tracekit: not building the optional C++ kernel tracekit/dlrm/_sparse_update ({}); " \
          "the trainer's sparse SGD uses torch's index_add_ instead"


def optional_build_ext():
    """BuildExtension that warns and carries on when compiling fails (no compiler, no headers)."""

    class OptionalBuildExtension(BuildExtension.with_options(use_ninja=False)):
        def run(self):
            try:
                super().run()
            except (PlatformError, OSError) as e:
                print(SKIPPED.format(e), file=sys.stderr)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except (CCompilerError, CompileError, ExecError, LinkError, OSError, RuntimeError,
                    subprocess.CalledProcessError) as e:
                print(SKIPPED.format(e), file=sys.stderr)

    return OptionalBuildExtension


if CppExtension is None:
    print(SKIPPED.format("torch is not importable at build time"), file=sys.stderr)
    setup()
else:
    setup(
        ext_modules=[
            CppExtension("tracekit.dlrm._sparse_update", ["tracekit/dlrm/csrc/sparse_update.cpp"],
                         extra_compile_args=["-O3", "-fopenmp-simd"]),
        ],
        cmdclass={"build_ext": optional_build_ext()},
    )
