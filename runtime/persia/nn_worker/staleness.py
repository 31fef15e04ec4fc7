"""The embedding-staleness bound of a training stream: synchronous at first, then growing.

Why a ramp: a lookup that misses the last k updates of a row costs most while the model still
moves fast, which is early in training: the PS applies Adagrad, whose first updates of a row are
its largest (the first is ``lr·g/√(ε+g²)``, up to ~10x later ones; about ``lr/√n`` at the n-th),
and the frequent rows are updated in nearly every early batch. So the bound starts at 1 (the
synchronous reference: each update applied before the next lookup) and grows like √step, which
keeps ``k/√n`` about constant: ``bound(step) = max(1, ⌊2·√(step / W)⌋)``, capped by the user's
``embedding_staleness``. With the default ``W = 200``: 1 for steps 0-199, 2 from 200, 3 from 450,
4 from 800, 5 from 1,250, 10 from 5,000. Measured on the synthetic CTR data at 235 steps of batch
256 (docs/benchmarks.md, "Short and long runs"): staleness 10 lost 0.0045 AUC against synchronous
training without a ramp, 0.0049 with W = 50, 0.0021 with W = 100 and 0.0003 with W = 200.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Any, Callable

ENV_WARMUP = "PERSIA_STALENESS_WARMUP_STEPS"
DEFAULT_WARMUP_STEPS = 200


def ramped_bound(step: int, target: int | None, warmup_steps: int) -> int | None:
    """The staleness bound after ``step`` trained steps; ``None`` means unbounded.

    ``warmup_steps`` (W) is how many steps run synchronously; 0 turns the ramp off (the full
    ``target`` from the first step). ``target=None`` (no user bound) grows without limit.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if target is not None and target < 1:
        raise ValueError(f"embedding_staleness must be >= 1 or None, got {target}")
    if warmup_steps < 0:
        raise ValueError(f"staleness warm-up steps must be >= 0, got {warmup_steps}")
    if warmup_steps == 0:
        return target
    ramp = max(1, math.isqrt(4 * step // warmup_steps))  # ⌊2·√(step/W)⌋ in integers
    return ramp if target is None else min(target, ramp)


def warmup_steps_setting(value: int | None, environ: dict[str, str] | None = None,
                         default: int | None = DEFAULT_WARMUP_STEPS) -> int | None:
    """The warm-up length: the DataLoader argument if given, else ``PERSIA_STALENESS_WARMUP_STEPS``,
    else ``default``; an error names the bad value and where it came from."""
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"staleness_warmup_steps must be an integer >= 0, got {value!r}")
        return value
    raw = (os.environ if environ is None else environ).get(ENV_WARMUP, "").strip()
    if raw == "":
        return default
    try:
        steps = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {ENV_WARMUP} must be an integer >= 0, got {raw!r}") from None
    if steps < 0:
        raise ValueError(f"environment variable {ENV_WARMUP} must be an integer >= 0, got {raw!r}")
    return steps


class RampedStalenessBound:
    """Staleness permits whose number grows with the trained steps (see ``ramped_bound``).

    Same interface as the ``threading.BoundedSemaphore`` it replaces (``acquire(timeout=) -> bool``,
    ``release()``, ValueError on releasing more than was acquired); ``set_step`` tells it how many
    steps the training loop has done, which can only raise the bound (waiters wake up then).
    """

    def __init__(self, target: int | None, warmup_steps: int = DEFAULT_WARMUP_STEPS, step: int = 0,
                 cond: threading.Condition | None = None):
        """``cond``: a condition (on a reentrant lock) shared with the update outbox, so that a
        dispatcher can wait for a free permit or a pending update to take one over, whichever
        comes first (``persia.nn_worker.loader``)."""
        ramped_bound(step, target, warmup_steps)  # validates the three
        self.target = target
        self.warmup_steps = warmup_steps
        self.step = step
        self.held = 0
        self.cond = cond or threading.Condition()

    @property
    def limit(self) -> int | None:
        return ramped_bound(self.step, self.target, self.warmup_steps)

    def set_step(self, step: int) -> None:
        with self.cond:
            if step > self.step:
                before = self.limit
                self.step = step
                after = self.limit
                if before is not None and (after is None or after > before):
                    # only a raised bound can free a waiter; past the ramp the bound stays put
                    # and a notify every step would wake the dispatcher and flusher for nothing
                    self.cond.notify_all()

    def retarget(self, target: int | None, warmup_steps: int, step: int) -> None:
        """A new training loop's bound (its ``embedding_staleness`` and warm-up) over the same
        permits: those still held (updates of the last loop not applied yet) keep counting."""
        ramped_bound(step, target, warmup_steps)  # validates the three
        with self.cond:
            self.target, self.warmup_steps, self.step = target, warmup_steps, max(step, self.step)
            self.cond.notify_all()  # the bound may have grown

    def _free(self) -> bool:
        limit = self.limit
        return limit is None or self.held < limit

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        with self.cond:
            if not blocking:
                timeout = 0.0
            if not self.cond.wait_for(self._free, timeout):
                return False
            self.held += 1
            return True

    def acquire_or_take_over(self, claim: Callable[[], Any], stop: threading.Event,
                             poll_s: float = 0.1) -> tuple[bool, Any]:
        """``(True, None)`` for a free permit, ``(True, x)`` when ``claim()`` hands over ``x`` (a
        pending update whose permit the caller takes over), whichever comes first; ``(False,
        None)`` once ``stop`` is set. Wakes on a release, a raised bound and, when the outbox
        shares ``cond``, on every update put; ``poll_s`` only bounds how late ``stop`` is seen."""
        with self.cond:
            while True:
                if self.acquire(blocking=False):
                    return True, None
                taken = claim()
                if taken is not None:
                    return True, taken
                if stop.is_set():
                    return False, None
                self.cond.wait(poll_s)

    def try_acquire_or_take_over(self, claim: Callable[[], Any]) -> tuple[bool, Any]:
        """:meth:`acquire_or_take_over` without waiting: ``(False, None)`` when neither a free
        permit nor an update to take over is there right now."""
        with self.cond:
            if self.acquire(blocking=False):
                return True, None
            taken = claim()
            return (True, taken) if taken is not None else (False, None)

    def release(self) -> None:
        with self.cond:
            if self.held <= 0:
                raise ValueError("staleness permit released more times than acquired")
            self.held -= 1
            self.cond.notify_all()


def staleness_bound(target: int | None, warmup_steps: int, step: int = 0,
                    cond: threading.Condition | None = None) -> RampedStalenessBound | None:
    """The permits of one training stream; ``None`` when nothing would ever bound it (no user
    bound and no warm-up): then only the buffers limit how far lookups run ahead."""
    if target is None and warmup_steps == 0:
        return None
    return RampedStalenessBound(target, warmup_steps, step, cond)
