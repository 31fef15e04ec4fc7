"""Declares the embedding PS's compiled kernel; all other metadata lives in pyproject.toml.

The kernel reads arrays through the buffer protocol, so building it needs only a C compiler and
the Python headers (no numpy headers). ``-ffp-contract=off`` keeps its float32 arithmetic
operation-by-operation identical to numpy's (no fused multiply-add).
"""

import sys

from setuptools import Extension, setup

# -fno-math-errno only lets sqrtf vectorize (results are the same IEEE square roots)
flags = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno"]

setup(
    ext_modules=[
        Extension(
            "persia.embedding_ps._kernels",
            sources=["runtime/persia/embedding_ps/_kernels.c"],
            extra_compile_args=flags,
        )
    ]
)
