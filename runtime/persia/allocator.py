"""glibc malloc settings for every role: keep the memory a batch frees for the next batch.

Every batch moves buffers of a few hundred KB to tens of MB through each role (gRPC messages,
decoded arrays, gathered rows, a large model's activations and gradients). glibc's defaults adapt
to that: each time a mapped buffer is freed, the mmap threshold rises to its size (up to 32 MiB)
and the trim threshold to twice that. Until they have risen, and whenever a batch frees more than
the trim threshold at once, freed pages go back to the kernel and the next batch faults them in
again, zero-filled: about 200 page faults per batch in the embedding worker (a quarter of its CPU)
and 50 in the NN worker at batch 256, 12,000 in the FFNN's NN worker (docs/benchmarks.md, issue 15,
session 16). Starting at glibc's own maxima instead, a fixed mmap threshold of 32 MiB (buffers
below it come from the heap) and a trim threshold of 64 MiB (free memory at the top of a heap is
kept up to that), stops the churn below 32 MiB, at the price of at most 64 MiB of freed memory
kept per heap. Buffers of 32 MiB and more (a PS's tables) are mapped and returned to the kernel
when freed, as before; glibc does not take a larger mmap threshold.

While a CPU NN worker trains it goes one step further (:class:`LargeBuffers`): a large model's
weight gradient can be 32 MiB or more (the FFNN's 4096 x 2048 layer: exactly 32 MiB plus malloc's
header), so it was mapped and unmapped every step, 8,192 page faults and their zero-filling each
time. With ``mmap`` off (``M_MMAP_MAX`` 0) every buffer comes from the heap, and once the heap has
settled (a few dozen steps: a freed gradient is a little too small for the next, 64-byte aligned
one until free neighbours merge) a freed gradient serves the next step. The FFNN's dense step alone
ran 110-124 ms against 134-138 over 44 steps, with 15-19 ms of system time a step against 36-37
and a peak RSS 20-60 MiB higher (docs/benchmarks.md, issue 15, session 26). Only while training,
and only there: large buffers freed meanwhile stay in the heap instead of going back to the
kernel, which a PS's regrown tables, or a script's data loaded after training, must not do. And
only for a model with a parameter of 32 MiB or more: the MLP 400's largest is 640 KB.

``PERSIA_MALLOC_TUNING=0`` leaves glibc's defaults; glibc's own ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` (or ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_``), when set, win: the process
already runs with the operator's choice.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from collections.abc import Iterable, Mapping

from persia.env import switch_on

log = logging.getLogger(__name__)

ENV_SWITCH = "PERSIA_MALLOC_TUNING"
GLIBC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
DEFAULT_MMAP_MAX = 65536  # glibc's own, restored when the last trainer stops

MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, the most it takes
TRIM_THRESHOLD = 64 << 20  # twice that, where its dynamic trim threshold ends

_applied: str | None = None


def allocator_plan(environ: Mapping[str, str], libc: str) -> tuple[dict[int, int], str]:
    """The ``mallopt`` settings to make (parameter -> value) and why, or none and why not.
    Pure, so every case is tested without touching the process's allocator. A value of
    ``PERSIA_MALLOC_TUNING`` other than on/off raises an error naming it."""
    if not switch_on(ENV_SWITCH, environ):
        return {}, f"{ENV_SWITCH}={environ[ENV_SWITCH]}: glibc's defaults"
    if libc != "glibc":
        return {}, f"not glibc ({libc or 'unknown C library'}): nothing to tune"
    own = [k for k in GLIBC_ENV if environ.get(k)]
    if own:
        return {}, f"{', '.join(own)} set in the environment: glibc applies those"
    return ({M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_TRIM_THRESHOLD: TRIM_THRESHOLD},
            f"mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB")


def large_buffer_plan(environ: Mapping[str, str], libc: str) -> tuple[dict[int, int], str]:
    """The NN worker's extra ``mallopt`` setting (no ``mmap``: large buffers from the heap too),
    under the same switch and the same deference to glibc's own variables as
    :func:`allocator_plan`. Pure."""
    settings, why = allocator_plan(environ, libc)
    if not settings:
        return {}, why
    return {M_MMAP_MAX: 0}, "no mmap: buffers of 32 MiB and more come from the heap, kept for the next step"


def _mallopt(settings: dict[int, int], why: str) -> str:
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    refused = [param for param, value in settings.items() if mallopt(param, value) != 1]
    if refused:
        why = f"glibc refused mallopt parameter(s) {refused} of {why}; the others took effect"
        log.warning("%s", why)
    return why


def has_large_buffers(parameter_bytes: Iterable[int]) -> bool:
    """Whether a model with parameters of these sizes makes gradients glibc would map (pure): one
    of :data:`MMAP_THRESHOLD` or more. A smaller model has nothing to gain from
    :class:`LargeBuffers` and keeps glibc's mapping of large buffers."""
    return any(n >= MMAP_THRESHOLD for n in parameter_bytes)


_large_lock = threading.Lock()
_large_holders = 0


class LargeBuffers:
    """:func:`large_buffer_plan` for a span of this process (a CPU NN worker's training, from
    ``TrainCtx``'s entry to its exit); nested spans keep it until the outermost stops. The plan is
    read (and a bad switch value refused) when this is made."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        self.settings, self.why = large_buffer_plan(os.environ if environ is None else environ,
                                                    platform.libc_ver()[0])
        self._held = False

    def start(self) -> str:
        global _large_holders
        if not self.settings or self._held:
            return self.why
        with _large_lock:
            if _large_holders == 0:
                self.why = _mallopt(self.settings, self.why)
            _large_holders += 1
            self._held = True
        log.debug("malloc while training: %s", self.why)
        return self.why

    def stop(self) -> None:
        global _large_holders
        if not self._held:
            return
        with _large_lock:
            self._held = False
            _large_holders -= 1
            if _large_holders == 0:
                _mallopt({M_MMAP_MAX: DEFAULT_MMAP_MAX}, "mmap back on after training")


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
        why = _mallopt(settings, why)
    log.debug("malloc: %s", why)
    _applied = why
    return why
