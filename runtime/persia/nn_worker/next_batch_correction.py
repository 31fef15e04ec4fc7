"""Own-update replay of the next batch, on a thread of its own while the training thread steps.

Own-update replay (:mod:`persia.nn_worker.own_updates`) corrects a looked-up batch for the
updates its read missed. The lookup thread replays those already sent when the reply comes in;
the reply comes a step or more ahead of the batch's turn, so the ones sent in between were
replayed by the training thread, just before the batch's forward, with the tensors built ahead
rewritten (``embedding_tensors.patch``): on CPU about a tenth of the training thread's time
(MLP 400, docs/benchmarks.md, session 21).

The :class:`NextBatchCorrector` moves that off the critical path: each time the training thread
sends an update, the corrector replays everything missed so far on the ready batch ordered first
(the next one in the loader's order) and patches its tensors, while the training thread steps the
dense optimizer and fetches that batch. The training thread's own part then replays only what the
corrector did not reach (``replay["through"]`` says where it got to, so nothing is stepped
twice). Exclusive by batch: :meth:`take` waits for a correction of the same batch in progress,
and after it the corrector never touches that batch again. A failure in the corrector is raised
by :meth:`take` for its batch, on the training thread.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class NextBatchCorrector:
    """``correct(batch)`` runs here, after each update sent, for the ready batch that trains next:
    the lowest ``order(batch)`` (batches train in ascending order; ties in the order they came
    ready)."""

    def __init__(self, correct: Callable[[Any], None], order: Callable[[Any], int], name: str = "persia-replay"):
        self._correct = correct
        self._order = order
        self._name = name
        self._cond = threading.Condition()
        self._ready: list[tuple[int, Any]] = []  # (order, batch): built, not yet taken
        self._busy: Any = None  # the batch being corrected now
        self._failed: list[tuple[Any, BaseException]] = []  # (batch, what its correction raised)
        self._sent = False  # an update was sent since the last correction began
        self._stopped = False
        self._thread: threading.Thread | None = None

    def ready(self, batch: Any) -> None:
        """``batch`` is built (lookup thread): the corrector may work on it until it is taken."""
        with self._cond:
            if self._stopped:
                return
            self._ready.append((self._order(batch), batch))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def update_sent(self) -> None:
        """The training thread sent an update: the next batch has one more to replay."""
        with self._cond:
            if self._ready:
                self._sent = True
                self._cond.notify_all()

    @property
    def caught_up(self) -> bool:
        """No update sent waits for a correction, and none is in progress."""
        with self._cond:
            return self._busy is None and not (self._sent and self._ready)

    def take(self, batch: Any) -> None:
        """The training thread is about to train ``batch``: wait for a correction of it in progress
        and keep the corrector off it from now on, and off the batches ordered before it (they
        are not next; the training thread corrects one itself if it trains it after all). Raises
        what the corrector's work on ``batch`` raised."""
        with self._cond:
            while self._busy is batch:
                self._cond.wait()
            at = next((o for o, b in self._ready if b is batch), None)
            if at is not None:
                self._ready = [(o, b) for o, b in self._ready if b is not batch and o >= at]
            error = next((e for b, e in self._failed if b is batch), None)
            if error is not None:
                self._failed = [(b, e) for b, e in self._failed if b is not batch]
        if error is not None:
            raise error

    def stop(self) -> None:
        """End the thread (after a correction in progress); batches ready now are left as they are."""
        with self._cond:
            self._stopped = True
            self._ready.clear()
            self._failed.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not (self._sent and self._ready):
                    self._cond.wait()
                if self._stopped:
                    return
                self._sent = False
                batch = self._busy = min(self._ready, key=lambda ob: ob[0])[1]  # min keeps the first of ties
            try:
                self._correct(batch)
            except BaseException as exc:  # noqa: BLE001 - raised on the training thread by take()
                with self._cond:
                    self._failed.append((batch, exc))
                    self._ready = [(o, b) for o, b in self._ready if b is not batch]  # its rows may be part-stepped
            finally:
                with self._cond:
                    self._busy = None
                    self._cond.notify_all()
