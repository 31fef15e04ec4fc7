"""Where every batch went, for this NN worker process.

Every batch a data loader had acknowledged ends in exactly one of: trained, evaluated, or failed
with a reason (a non-finite loss or gradient, the uneven tail that DDP ranks cut so they stay in
step, ...). The counts go to the log, to ``/metrics`` and to the result line (``report_result``),
so a run that lost batches says so instead of exiting 0 in silence.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from persia.metrics import Metrics
from persia.utils import RESULT_EXTRAS

log = logging.getLogger(__name__)


@dataclass
class BatchAccount:
    sent: int = 0  # acknowledged by this rank, as the data loaders' end-of-epoch messages count them
    received: int = 0
    trained: int = 0
    evaluated: int = 0
    failed: Counter = field(default_factory=Counter)  # by reason, on this rank
    failed_sends: Counter = field(default_factory=Counter)  # never acknowledged, by reason (loaders')
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    metrics: Metrics | None = field(default=None, repr=False)

    def _metric(self, name: str, n: int, feat: str = "") -> None:
        if self.metrics is not None:
            self.metrics.inc(name, n, feat=feat)

    def add(self, what: str, n: int = 1) -> None:
        """``what``: sent | received | trained | evaluated."""
        with self.lock:
            setattr(self, what, getattr(self, what) + n)
        self._metric(f"batches_{what}", n)

    def fail(self, reason: str, n: int = 1) -> None:
        with self.lock:
            self.failed[reason] += n
        self._metric("batches_failed", n, feat=reason)

    def loader_failed_sends(self, loader: int, counts: dict[str, int]) -> None:
        """A data loader's own count of sends never acknowledged (replaces its previous report)."""
        with self.lock:
            self._by_loader = getattr(self, "_by_loader", {})
            self._by_loader[loader] = Counter(counts)
            self.failed_sends = sum(self._by_loader.values(), Counter())

    def unaccounted(self) -> int:
        """Acknowledged batches not (yet) trained, evaluated or failed."""
        return self.sent - self.trained - self.evaluated - sum(self.failed.values())

    def as_result(self) -> dict:
        with self.lock:
            failed = dict(self.failed)
            for reason, n in self.failed_sends.items():
                failed[f"loader_{reason}"] = n
            return {"batches_sent": self.sent, "batches_trained": self.trained,
                    "batches_evaluated": self.evaluated, "batches_failed": failed}


ACCOUNT = BatchAccount()


def _result_fields() -> dict:
    return ACCOUNT.as_result() if ACCOUNT.sent or ACCOUNT.received else {}


RESULT_EXTRAS.append(_result_fields)


def reset() -> None:
    """Start counting afresh (tests that play several jobs in one process)."""
    global ACCOUNT
    ACCOUNT.__init__()


def attach_metrics(metrics: Metrics) -> None:
    ACCOUNT.metrics = metrics


def log_summary(rank: int, complete: bool) -> None:
    """The balance when training ends. ``complete``: the stream was trained to its end, so every
    acknowledged batch must be accounted for; otherwise (stopped, failed) the batches of the epoch
    in progress are not announced yet, and what arrived but was not finished is reported instead."""
    result = ACCOUNT.as_result()
    line = ", ".join(f"{k.removeprefix('batches_')} {v}" for k, v in result.items())
    if not complete:
        done = ACCOUNT.trained + ACCOUNT.evaluated + sum(ACCOUNT.failed.values())
        log.info("NN rank %d stopped before the end of its stream; batches: %s; received %d, %d of them "
                 "not finished", rank, line, ACCOUNT.received, max(0, ACCOUNT.received - done))
        return
    left = ACCOUNT.unaccounted()
    if left:
        log.warning("NN rank %d batches: %s; %d acknowledged batches NOT accounted for", rank, line, left)
    else:
        log.info("NN rank %d batches: %s (every acknowledged batch accounted for)", rank, line)
