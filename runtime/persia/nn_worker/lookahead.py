"""How far ahead of training the NN worker looks embeddings up."""

from __future__ import annotations

import threading

import numpy as np


class Lookahead:
    """How many batches to look up ahead of training: just enough to hide the lookup latency.

    The staleness bound caps how far ahead lookups *may* run; looking up earlier than needed
    only makes every embedding older when it is trained on (on the synthetic CTR benchmark,
    AUC fell by 0.009 at staleness 10 against 0.0006 at staleness 2, at the same speed once the
    lookup latency was hidden). So the dispatcher keeps ``ceil(lookup_time / step_time) + 1``
    batches in flight, measured as it goes (EMAs), between 1 and ``limit``.

    ``limit`` is also capped at ``MAX_DEPTH``: on shared cores a lookup's time is mostly waiting for
    CPU, and more lookups in flight make each one wait longer, so the measured ratio can feed on
    itself and the staleness bound becomes the only limit (on a loaded 2-core machine staleness 10
    lost up to 0.012 AUC in 235 steps), while a deeper pipeline buys no throughput when CPU, not
    latency, is what is short. Four batches in flight hide a lookup three steps long.
    """

    MAX_DEPTH = 4

    def __init__(self, limit: int, alpha: float = 0.2, max_depth: int = MAX_DEPTH):
        self.limit = max(1, min(limit, max_depth))
        self.alpha = alpha
        self.lookup_s: float | None = None
        self.step_s: float | None = None
        self.outstanding = 0
        self._cond = threading.Condition()

    @staticmethod
    def depth(lookup_s: float | None, step_s: float | None, limit: int) -> int:
        if lookup_s is None or step_s is None:
            return limit  # nothing measured yet: fill the pipeline
        return max(1, min(limit, int(np.ceil(lookup_s / max(step_s, 1e-6))) + 1))

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def record_lookup(self, seconds: float) -> None:
        self._record("lookup_s", seconds)

    def record_step(self, seconds: float) -> None:
        self._record("step_s", seconds)

    def _record(self, name: str, seconds: float) -> None:
        with self._cond:
            before = self.depth(self.lookup_s, self.step_s, self.limit)
            setattr(self, name, self._ema(getattr(self, name), seconds))
            if self.depth(self.lookup_s, self.step_s, self.limit) > before:
                self._cond.notify_all()  # a deeper pipeline frees a waiting dispatcher; else nothing does

    def acquire(self, stop: threading.Event) -> bool:
        with self._cond:
            while self.outstanding >= self.depth(self.lookup_s, self.step_s, self.limit):
                if stop.is_set():
                    return False
                self._cond.wait(0.1)
            self.outstanding += 1
            return True

    def add(self) -> None:
        """One batch more in flight without waiting: the second batch of a lookup group, which
        goes when its first would have gone alone (``persia.nn_worker.lookup_group``)."""
        with self._cond:
            self.outstanding += 1

    def release(self) -> None:
        with self._cond:
            self.outstanding = max(0, self.outstanding - 1)
            self._cond.notify_all()

