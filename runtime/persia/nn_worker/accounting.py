"""Where every batch went, for this NN worker process.

Every batch a data loader had acknowledged ends in exactly one of: trained, evaluated, or failed
with a reason (a non-finite loss or gradient, the uneven tail that DDP ranks cut so they stay in
step, ...). The counts go to the log, to ``/metrics`` and to the result line (``report_result``),
so a run that lost batches says so instead of exiting 0 in silence.

What was acknowledged is what the data loaders announce at the end of each epoch (``sent``), plus
what arrived from a loader *process* that never ended its stream: one killed (between the two
legs of a batch or not) and restarted in place while this rank trains on. Its own count died with
it, so this rank's count of what arrived from it stands in (``unannounced``), per loader process
(loader index and session): without it, such a run reported its batches as a false imbalance.

Online training restarts loader processes for weeks: the per-process entries are kept for the
``RETAINED_PROCESSES`` newest processes of each loader index (one index is held by one process at a
time, so an older one is long dead), and an older one's contribution is folded into per-loader
totals (``retired``), so the account stays bounded by the number of loader indices.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from persia.metrics import Metrics
from persia.recent_keys import RecentKeys
from persia.utils import RESULT_EXTRAS

log = logging.getLogger(__name__)

# per loader index, the newest processes whose counts are kept one by one: a process superseded by
# this many newer ones of its index is dead (a restarted one replaces it), and only its totals matter
RETAINED_PROCESSES = 8
# retired processes remembered (their counts), so a message of one still on its way adjusts the totals
RETIRED_MEMORY = 1024
RETIRED = "(earlier processes)"  # the session ``unannounced`` names a loader's retired processes by


@dataclass
class BatchAccount:
    sent: int = 0  # acknowledged by this rank, as the data loaders' end-of-epoch messages count them
    received: int = 0
    trained: int = 0
    evaluated: int = 0
    failed: Counter = field(default_factory=Counter)  # by reason, on this rank
    failed_sends: Counter = field(default_factory=Counter)  # never acknowledged, by reason (loaders')
    # per loader process, (loader index, session): batches it announced, batches that arrived from
    # it, the processes that ended their stream, and each one's latest failed-send counts
    announced_by: Counter = field(default_factory=Counter, repr=False)
    received_by: Counter = field(default_factory=Counter, repr=False)
    ended: set = field(default_factory=set, repr=False)
    failed_sends_by: dict = field(default_factory=dict, repr=False)
    # per loader index, its processes' sessions kept one by one, oldest first
    sessions_of: dict = field(default_factory=dict, repr=False)
    # per loader index, what its retired processes left: batches arrived beyond what they announced
    retired_unannounced: Counter = field(default_factory=Counter, repr=False)
    retired_failed_sends: Counter = field(default_factory=Counter, repr=False)
    # (loader, session) -> [received, announced, ended, failed sends] of a retired process
    retired: RecentKeys = field(default_factory=lambda: RecentKeys(RETIRED_MEMORY), repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    metrics: Metrics | None = field(default=None, repr=False)

    def _metric(self, name: str, n: int, feat: str = "") -> None:
        if self.metrics is not None:
            self.metrics.inc(name, n, feat=feat)

    def add(self, what: str, n: int = 1) -> None:
        """``what``: trained | evaluated (sent and received are counted per loader process:
        :meth:`announced`, :meth:`received_from`)."""
        with self.lock:
            setattr(self, what, getattr(self, what) + n)
        self._metric(f"batches_{what}", n)

    def fail(self, reason: str, n: int = 1) -> None:
        with self.lock:
            self.failed[reason] += n
        self._metric("batches_failed", n, feat=reason)

    @staticmethod
    def _excess(rec: list) -> int:
        """A retired process's part of ``unannounced``: what arrived beyond what it announced."""
        received, announced, ended, _ = rec
        return 0 if ended else max(0, received - announced)

    def _track(self, key: tuple) -> list | None:
        """Under the lock: the retired record of ``key`` (a message of a process already retired),
        or None after making sure the key is tracked, retiring the oldest process of its loader
        index past ``RETAINED_PROCESSES``."""
        rec = self.retired.get(key)
        if rec is not None:
            return rec
        loader, session = key
        if session is None:  # a sessionless sender: one entry per loader index, never retired
            return None
        sessions = self.sessions_of.setdefault(loader, {})
        if session not in sessions:
            sessions[session] = None  # a dict keeps insertion order: oldest first
            while len(sessions) > RETAINED_PROCESSES:
                self._retire((loader, next(iter(sessions))))
        return None

    def _retire(self, key: tuple) -> None:
        loader, session = key
        del self.sessions_of[loader][session]
        rec = [self.received_by.pop(key, 0), self.announced_by.pop(key, 0), key in self.ended,
               self.failed_sends_by.pop(key, Counter())]
        self.ended.discard(key)
        self.retired_unannounced[loader] += self._excess(rec)
        self.retired_failed_sends.update(rec[3])
        self.retired.add(key, rec)

    def _adjust_retired(self, key: tuple, rec: list, received: int = 0, announced: int = 0,
                        final: bool = False, failed_sends: Counter | None = None) -> None:
        before = self._excess(rec)
        rec[0] += received
        rec[1] += announced
        rec[2] = rec[2] or final
        if failed_sends is not None:
            self.retired_failed_sends.subtract(rec[3])
            self.retired_failed_sends.update(failed_sends)
            self.retired_failed_sends = +self.retired_failed_sends
            rec[3] = failed_sends
        self.retired_unannounced[key[0]] += self._excess(rec) - before

    def received_from(self, loader: int, session: str | None) -> None:
        """A streamed batch arrived from loader process ``(loader, session)``."""
        key = (loader, session)
        with self.lock:
            self.received += 1
            rec = self._track(key)
            if rec is None:
                self.received_by[key] += 1
            else:
                self._adjust_retired(key, rec, received=1)
        self._metric("batches_received", 1)

    def announced(self, loader: int, session: str | None, sent: int, final: bool,
                  failed_sends: dict[str, int]) -> None:
        """A loader process's end of an epoch (``sent`` batches acknowledged by this rank) or, with
        ``final``, of its stream; ``failed_sends`` is its own count of sends never acknowledged
        (replaces that process's previous report)."""
        key = (loader, session)
        with self.lock:
            self.sent += sent
            rec = self._track(key)
            if rec is None:
                self.announced_by[key] += sent
                if final:
                    self.ended.add(key)
                self.failed_sends_by[key] = Counter(failed_sends)
            else:
                self._adjust_retired(key, rec, announced=sent, final=final, failed_sends=Counter(failed_sends))
            self.failed_sends = sum(self.failed_sends_by.values(), Counter(self.retired_failed_sends))
        self._metric("batches_sent", sent)

    def unannounced(self) -> dict[tuple[int, str | None], int]:
        """Per loader process that has not ended its stream: batches that arrived from it beyond
        what it announced (it was killed before saying so; a live one has announced all of an
        ended epoch's)."""
        with self.lock:
            # a loader whose messages carry no session (an older sender) cannot be told apart by
            # process: its announcements stand for all of its batches, as before
            sessionless = {loader for loader, session in self.announced_by if session is None}
            live = {k: n - self.announced_by[k] for k, n in self.received_by.items()
                    if k not in self.ended and k[0] not in sessionless and n > self.announced_by[k]}
            # retired processes of each loader index, together (key: (loader, RETIRED))
            live.update({(loader, RETIRED): n for loader, n in self.retired_unannounced.items()
                         if n > 0 and loader not in sessionless})
            return live

    def unaccounted(self) -> int:
        """Acknowledged batches (announced, or arrived from a loader process that never ended its
        stream) not (yet) trained, evaluated or failed; negative: more finished than acknowledged."""
        acknowledged = self.sent + sum(self.unannounced().values())
        return acknowledged - self.trained - self.evaluated - sum(self.failed.values())

    def as_result(self) -> dict:
        unannounced = sum(self.unannounced().values())
        with self.lock:
            failed = dict(self.failed)
            for reason, n in self.failed_sends.items():
                failed[f"loader_{reason}"] = n
            return {"batches_sent": self.sent, "batches_unannounced": unannounced, "batches_trained": self.trained,
                    "batches_evaluated": self.evaluated, "batches_failed": failed}


ACCOUNT = BatchAccount()


def _result_fields() -> dict:
    # a rank whose loaders ended their streams empty reports its zeros too (the launcher says so)
    return ACCOUNT.as_result() if ACCOUNT.sent or ACCOUNT.received or ACCOUNT.ended else {}


RESULT_EXTRAS.append(_result_fields)


def reset() -> None:
    """Start counting afresh (tests that play several jobs in one process)."""
    global ACCOUNT
    ACCOUNT.__init__()


def attach_metrics(metrics: Metrics) -> None:
    ACCOUNT.metrics = metrics


def nothing_trained(account: BatchAccount) -> str | None:
    """Why a rank whose stream ended trained nothing, or None (pure): its data loaders ended their
    streams without a batch. The job still succeeds (a loader with nothing to send is not an error
    of this rank's), but a job that trained nothing is said so, not reported done in silence."""
    with account.lock:
        if account.sent or account.received or account.trained or account.evaluated or not account.ended:
            return None
        loaders = sorted({loader for loader, _session in account.ended})
    return (f"every data loader ended its stream without sending a batch (loaders {loaders}): nothing was trained; "
            "check what their datasets yield")


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
    unannounced = ACCOUNT.unannounced()
    if unannounced:  # say where they came from: a loader process that died while this rank trained on
        line += " (unannounced: " + ", ".join(
            f"{n} from earlier processes of data loader {loader}, which never ended their stream"
            if session == RETIRED else
            f"{n} from data loader {loader} process {session or '?'}, which never ended its stream"
            for (loader, session), n in sorted(unannounced.items(), key=str)) + ")"
    idle = nothing_trained(ACCOUNT)
    if idle:
        log.warning("NN rank %d: %s", rank, idle)
    left = ACCOUNT.unaccounted()
    if left:
        log.warning("NN rank %d batches: %s; %d acknowledged batches NOT accounted for", rank, line, left)
    else:
        log.info("NN rank %d batches: %s (every acknowledged batch accounted for)", rank, line)
