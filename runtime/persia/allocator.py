"""glibc malloc settings for every role: keep the memory a batch frees for the next batch.

Every batch moves buffers of a few hundred KB through each role (gRPC messages, decoded arrays,
gathered rows). Under glibc's defaults a freed buffer's pages often go back to the kernel (its
trim threshold is twice the largest buffer freed so far, its mmap threshold moves with them), and
the next batch's buffer faults them in again, zero-filled by the kernel: about 200 page faults per
batch in the embedding worker, a quarter of its CPU, and 50 in the NN worker (docs/benchmarks.md,
issue 15, session 16). A fixed mmap threshold (allocations below it come from the heap) and a
higher trim threshold (free memory at the top of a heap is kept up to it) stop that churn, at the
price of at most the trim threshold of free memory kept per heap. Allocations of the mmap threshold
and more (a PS's tables) are still mapped and returned to the kernel when freed.

``PERSIA_MALLOC_TUNING=0`` leaves glibc's defaults; glibc's own ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` (or ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_``), when set, win: the process
already runs with the operator's choice.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV_SWITCH = "PERSIA_MALLOC_TUNING"
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 32 << 20

_applied: str | None = None


def allocator_plan(environ: Mapping[str, str], libc: str) -> tuple[dict[int, int], str]:
    """The ``mallopt`` settings to make (parameter -> value) and why, or none and why not.
    Pure, so every case is tested without touching the process's allocator. A value of
    ``PERSIA_MALLOC_TUNING`` other than on/off raises an error naming it."""
    raw = environ.get(ENV_SWITCH, "").strip().lower()
    if raw not in ("", "1", "on", "true", "0", "off", "false"):
        raise ValueError(f"environment variable {ENV_SWITCH} must be 1/on or 0/off, got {environ[ENV_SWITCH]!r}")
    if raw in ("0", "off", "false"):
        return {}, f"{ENV_SWITCH}={environ[ENV_SWITCH]}: glibc's defaults"
    if libc != "glibc":
        return {}, f"not glibc ({libc or 'unknown C library'}): nothing to tune"
    own = [k for k in GLIBC_ENV if environ.get(k)]
    if own:
        return {}, f"{', '.join(own)} set in the environment: glibc applies those"
    return ({M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_TRIM_THRESHOLD: TRIM_THRESHOLD},
            f"mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB")


def tune_allocator(environ: Mapping[str, str] | None = None) -> str:
    """Apply :func:`allocator_plan` to this process, once (later calls return the first result).
    Called by ``persia-launcher`` (the servers run in its process) and by every context
    (``BaseCtx``): a script is a new process image, started by the launcher or not, and an exec
    starts over with glibc's defaults."""
    global _applied
    if _applied is not None:
        return _applied
    settings, why = allocator_plan(os.environ if environ is None else environ, platform.libc_ver()[0])
    if settings:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        refused = [param for param, value in settings.items() if mallopt(param, value) != 1]
        if refused:
            why = f"glibc refused mallopt parameter(s) {refused}; allocator left as it was"
            log.warning("%s", why)
    log.debug("malloc: %s", why)
    _applied = why
    return why
