"""The distinct IDs of a batch, sorted, and where each ID is among them (the embedding worker's
dedup: ``np.unique(values, return_inverse=True)`` with an int32 inverse).

The compiled kernel (``_unique.c``, built by ``pip install``) hashes the IDs and sorts only the
distinct ones: a batch of 256 samples x 26 slots holds 6,656 IDs and about 2,500 distinct ones,
and numpy's argsort of all of them was most of the worker's ``prepare``. numpy stays as the
fallback (a source tree without a build) and as the reference the tests hold the kernel to.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

ABI = 1  # the _unique.c interface this module calls

try:
    from persia import _unique
except ImportError:  # a source tree without a build: numpy
    _unique = None
_STALE = None
if _unique is not None and getattr(_unique, "ABI", None) != ABI:
    _STALE = (f"persia._unique was built from another _unique.c (interface {getattr(_unique, 'ABI', None)}, this "
              f"code needs {ABI}): rebuild it (make venv, or pip install -e .)")
    log.warning("%s; numpy dedups meanwhile", _STALE)
    _unique = None


def available() -> bool:
    """Whether the compiled kernel was built and imports."""
    return _unique is not None


def unavailable_reason() -> str | None:
    """Why the compiled kernel is not in use (stale or not built), or None when it is."""
    if _unique is not None:
        return None
    return _STALE or "persia._unique is not built (make venv, or pip install -e .)"


def unique_inverse(values: np.ndarray, use_kernel: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct values ascending, int32 position of each element among them)`` of a 1-D uint64
    array. ``use_kernel``: None = the kernel when built; False = numpy."""
    values = np.ascontiguousarray(values, dtype=np.uint64)
    if values.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {values.shape}")
    if use_kernel is None:
        use_kernel = _unique is not None
    if not use_kernel:
        uniq, inverse = np.unique(values, return_inverse=True)
        return uniq, inverse.astype(np.int32).reshape(-1)
    if _unique is None:
        raise RuntimeError("use_kernel=True but persia._unique is not built (make venv, or pip install -e .)")
    uniq = np.empty(values.size, dtype=np.uint64)
    inverse = np.empty(values.size, dtype=np.int32)
    k = _unique.unique_inverse(values, uniq, inverse)
    # a view, not a copy: the batch keeps the whole n-element buffer (8 bytes an ID) for its short
    # life, where a copy would cost every call; with many repeats most of that buffer is unused
    return uniq[:k], inverse
