"""What a data-loader process has sent, across every ``DataCtx`` it opens.

A process may open one ``DataCtx`` and loop over its epochs, or open one per epoch (PERSIA's users
do both). Batch ids therefore come from one counter per process, never from the context (a second
context starting again at 0 made the embedding worker answer with the first epoch's buffered
batch), and the stream has two kinds of end: leaving a ``DataCtx`` ends an *epoch*; the *stream*
ends when the process is done (``end_of_stream()``, called at exit) or a context fails.
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
    epoch: int = 0  # epochs ended so far (DataCtx exits)
    sent_per_rank: dict[int, int] = field(default_factory=dict)  # acknowledged, this epoch
    sent_total: int = 0  # acknowledged, all epochs
    failed: Counter = field(default_factory=Counter)  # sends that failed, by reason
    ended: bool = False
    trainers: TrainerNews = field(default_factory=TrainerNews)  # NN ranks that left training (nn.done)
    watching_trainers: bool = False
    # Tells this process's sends from a restarted loader's, which counts batch ids from 0 again:
    # the embedding worker recognises a *retried* send by (loader, session, batch id).
    session: str = field(default_factory=lambda: secrets.token_hex(8))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_id(self, replica_index: int, replica_size: int) -> int:
        """Claim the next batch id; claimed even if the send then fails."""
        with self.lock:
            batch_id = self.counter * replica_size + replica_index
            self.counter += 1
            return batch_id

    def acknowledged(self, rank: int) -> None:
        with self.lock:
            self.sent_per_rank[rank] = self.sent_per_rank.get(rank, 0) + 1
            self.sent_total += 1

    def end_epoch(self) -> tuple[int, dict[int, int]]:
        """The epoch that just ended and what it sent to each rank; starts the next epoch."""
        with self.lock:
            epoch, sent = self.epoch, self.sent_per_rank
            self.epoch += 1
            self.sent_per_rank = {}
            return epoch, sent


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
