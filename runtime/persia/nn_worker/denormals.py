"""Flush denormal floats to zero in the NN worker's compute threads, as TensorFlow's CPU runtime does.

Why: Adam's first moment of a parameter whose gradient stays zero (a ReLU unit that stopped
firing) shrinks by beta1 every step and falls below float32's smallest normal number (1.2e-38)
after a few hundred steps. From then on every optimizer step computes on denormals, which x86
CPUs handle in microcode assists, many times slower than normal numbers. On `make bench`'s
MLP 400 at batch 256 torch's fused Adam took 28.6 % of the training thread's CPU (about 3.7 ms a
step) with denormals and 3.3 % flushed; the AUC did not change (docs/benchmarks.md, issue 15).

The flush-to-zero and denormals-are-zero bits live in each thread's MXCSR register, and a new
thread starts with its creator's. So :class:`FlushDenormals` sets them, for the span of the
outermost NN worker context, on the thread that enters it (every thread it starts meanwhile
inherits them: the lookup threads, and torch's OpenMP threads made later) and on the threads of
that thread's OpenMP team that already exist (a model built before the context made them): one
parallel region of the OpenMP runtime in which each team thread sets its own register. On exit
it clears them there again, so code after the ``with`` block (a notebook, a test process) computes
with IEEE denormals as before. A thread that flushed already keeps flushing, its team with it.

``PERSIA_FLUSH_DENORMAL=0`` keeps IEEE denormals (any other value than on/off is an error naming
it). Only the CPU is affected; CUDA kernels choose their own mode.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from persia.env import switch_on
from persia.nn_worker.openmp_team import on_each_team_thread

log = logging.getLogger(__name__)

ENV_SWITCH = "PERSIA_FLUSH_DENORMAL"


def denormal_plan(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether to flush denormals, and why. Pure: every case is tested without touching a
    thread's register."""
    if switch_on(ENV_SWITCH, environ):
        return True, "flush to zero"
    return False, f"{ENV_SWITCH}={environ[ENV_SWITCH]}: IEEE denormals kept"


def flushing() -> bool:
    """Whether the calling thread flushes denormals now (a one-element product runs on it)."""
    import torch

    return bool((torch.tensor(1e-39, dtype=torch.float32) * 1.0).item() == 0.0)


def set_flush(on: bool) -> str:
    """Set (or clear) flushing on the calling thread and on the threads of its OpenMP team; what
    was reached."""
    import torch

    if not torch.set_flush_denormal(on) and on:
        return "this CPU cannot flush denormals (torch.set_flush_denormal returned False)"
    threads = torch.get_num_threads()
    if threads <= 1:
        return "the calling thread"
    answers = on_each_team_thread(lambda: bool(torch.set_flush_denormal(on)), threads)
    if answers is None:
        return "the calling thread (no OpenMP runtime loaded: threads made later inherit it)"
    if len(answers) != threads or not all(answers):
        return f"the calling thread and {sum(answers)} of its OpenMP team's {threads} threads"
    return f"the calling thread and its OpenMP team's {threads} threads"


class FlushDenormals:
    """Denormals flushed on the entering thread and its OpenMP team from :meth:`start` to
    :meth:`stop` (or for a ``with`` block); the setting is read (and a bad value refused) when it
    is made."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        self.enabled, self.why = denormal_plan(os.environ if environ is None else environ)
        self._set = False

    def start(self) -> str:
        if not self.enabled:
            return self.why
        # a thread that flushes already (the user's choice, or an enclosing span's) keeps it after
        # stop; its OpenMP team is made to agree with it
        self._set = not flushing()
        self.why = f"flush to zero on {set_flush(True)}" + ("" if self._set else " (the thread flushed already)")
        log.debug("denormals: %s", self.why)
        return self.why

    def stop(self) -> None:
        if self._set:
            self._set = False
            set_flush(False)

    def __enter__(self) -> "FlushDenormals":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
