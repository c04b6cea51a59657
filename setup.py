"""Builds tracekit's one C++ extension (the fused sparse SGD of tracekit/dlrm/csrc).

Metadata lives in pyproject.toml. The extension needs torch at build time, so the
project installs with --no-build-isolation after requirements.txt (`make venv`).
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension("tracekit.dlrm._sparse_update", ["tracekit/dlrm/csrc/sparse_update.cpp"],
                     extra_compile_args=["-O3", "-fopenmp-simd"]),
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
