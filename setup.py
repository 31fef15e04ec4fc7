"""Declares the compiled kernels (the embedding PS's, the embedding worker's dedup, the NN worker's
gather backward); all other metadata lives in pyproject.toml.

The kernels read arrays through the buffer protocol, so building them needs only a C compiler and
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
        ),
        # the embedding worker's dedup of a batch's IDs (persia/unique.py)
        Extension("persia._unique", sources=["runtime/persia/_unique.c"], extra_compile_args=flags),
        # the backward of the NN worker's one-ID slots' gather (persia/nn_worker/row_sums.py)
        Extension("persia._rows", sources=["runtime/persia/_rows.c"], extra_compile_args=flags),
    ]
)
