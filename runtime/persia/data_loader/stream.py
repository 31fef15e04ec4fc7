"""What a data-loader process has sent, across every ``DataCtx`` it opens.

A process may open one ``DataCtx`` and loop over its epochs, or open one per epoch (PERSIA's users
do both). Batch ids therefore come from one counter per process, never from the context (a second
context starting again at 0 made the embedding worker answer with the first epoch's buffered
batch), and the stream has two kinds of end: leaving a ``DataCtx`` ends an *epoch*; the *stream*
ends when the process is done (``end_of_stream()``, called at exit) or a context fails.

Each batch carries the epoch it was sent in (stamped by ``send_data``) and is counted in that
epoch when acknowledged, however late: with two ``DataCtx`` open at once, one's exit ends an epoch
while the other may still hold or send batches stamped with it, and an epoch's end waits for them
(``end_epoch``). Counting them in the epoch current at their acknowledgement made the next epoch
announce a batch its NN ranks had received as the previous one's, and wait for it for ever.
"""

from __future__ import annotations

import atexit
import logging
import secrets
import threading
from collections import Counter
from dataclasses import dataclass, field

from persia.data_loader.trainers import TrainerNews

log = logging.getLogger(__name__)


@dataclass
class LoaderStream:
    counter: int = 0  # batches this process attempted to send (ids are never reused)
    epoch: int = 0  # epochs ended so far (DataCtx exits): the one new batches are stamped with
    sent: dict[int, dict[int, int]] = field(default_factory=dict)  # epoch -> rank -> acknowledged
    unsettled: Counter = field(default_factory=Counter)  # epoch -> stamped, not yet acknowledged nor failed
    sent_total: int = 0  # acknowledged, all epochs
    failed: Counter = field(default_factory=Counter)  # sends that failed, by reason
    ended: bool = False
    trainers: TrainerNews = field(default_factory=TrainerNews)  # NN ranks that left training (nn.done)
    watching_trainers: bool = False
    # Tells this process's sends from a restarted loader's, which counts batch ids from 0 again:
    # the embedding worker recognises a *retried* send by (loader, session, batch id).
    session: str = field(default_factory=lambda: secrets.token_hex(8))
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled_cond: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.settled_cond = threading.Condition(self.lock)

    def next_id(self, replica_index: int, replica_size: int) -> int:
        """Claim the next batch id; claimed even if the send then fails."""
        with self.lock:
            batch_id = self.counter * replica_size + replica_index
            self.counter += 1
            return batch_id

    def stamp(self) -> int:
        """The epoch of a batch about to be held or sent; it must then be ``acknowledged`` or
        ``settled`` (its send failed), or its epoch's end waits for ever."""
        with self.lock:
            self.unsettled[self.epoch] += 1
            return self.epoch

    def acknowledged(self, rank: int, epoch: int) -> None:
        """A batch stamped ``epoch`` reached NN rank ``rank``: counted in that epoch."""
        with self.lock:
            per_rank = self.sent.setdefault(epoch, {})
            per_rank[rank] = per_rank.get(rank, 0) + 1
            self.sent_total += 1
            self._settle(epoch)

    def settled(self, epoch: int) -> None:
        """A batch stamped ``epoch`` will not reach its rank (its send failed, counted as such)."""
        with self.lock:
            self._settle(epoch)

    def _settle(self, epoch: int) -> None:
        self.unsettled[epoch] -= 1
        if self.unsettled[epoch] <= 0:
            del self.unsettled[epoch]
            self.settled_cond.notify_all()

    def end_epoch(self) -> tuple[int, dict[int, int]]:
        """End the current epoch: later batches are stamped with the next. Waits until every
        batch stamped with it is acknowledged or failed (another ``DataCtx`` of the process may
        still hold some: its hold thread sends them within a hold, and every send ends by its
        deadline), then returns the epoch and what it sent to each rank."""
        with self.lock:
            epoch = self.epoch
            self.epoch += 1
            while self.unsettled[epoch] > 0:
                self.settled_cond.wait()
            self.unsettled.pop(epoch, None)
            return epoch, self.sent.pop(epoch, {})


_stream = LoaderStream()
_finisher = None  # sends the stream's end; set by the first DataCtx of the process
_registered = False


def current() -> LoaderStream:
    return _stream


def set_finisher(fn) -> None:
    """Remember how to end the stream (the DataCtx knows the bus and the ranks); at exit, do it."""
    global _finisher, _registered
    _finisher = fn
    if not _registered:
        atexit.register(end_of_stream)
        _registered = True


def end_of_stream() -> None:
    """Tell every NN rank this data loader will send nothing more (once; also run at exit).

    Call it explicitly when the process lives on after its last ``DataCtx`` (a notebook, a test,
    a loader that waits for something else).
    """
    with _stream.lock:
        if _stream.ended or _finisher is None:
            return
        _stream.ended = True
    try:
        _finisher()
    except Exception as exc:  # noqa: BLE001 - at exit: say it, never hide it behind a traceback storm
        log.warning("could not send end of stream: %s", exc)


def reset() -> None:
    """Forget this process's stream (tests that play several data loaders in one process)."""
    global _stream, _finisher
    _stream = LoaderStream()
    _finisher = None
