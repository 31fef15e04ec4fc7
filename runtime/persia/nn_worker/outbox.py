"""Embedding-gradient updates waiting to ride on the next lookup.

A Python gRPC call costs about 0.3 ms of CPU on each end before its payload, and an update used to
be two of them (NN worker -> embedding worker -> PS) besides the lookup's two. So backward leaves
its update here, and the next lookup to the same embedding worker carries it: the worker applies
it first, then looks up, in one call per hop. The staleness bound is unchanged: an update is
applied before any lookup that was dispatched after it was claimed.

Two things keep an update from waiting forever:

* **permit transfer**: a lookup that needs a staleness permit when none is free claims the oldest
  update that holds one; that update is applied first, in the same call, so its permit passes to
  the new batch (this is how synchronous mode, staleness 1, gets one round trip per step);
* **hold limit**: an update nobody has claimed within ``max_hold_s`` is sent alone by a flusher
  thread (end of stream, eval in between, a worker no lookup goes to).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class PendingUpdate:
    """One batch's gradients for its embedding worker; ``holds_permit``: a staleness permit is
    released (or passed on) once they are applied."""

    worker: int
    ref: int
    grads: list
    scale: float
    holds_permit: bool
    unused_slots: list = field(default_factory=list)  # slots whose tensor got no gradient
    queued_at: float = field(default_factory=time.monotonic)
    source: int | None = None  # the NN worker's number for its updates (persia.nn_worker.own_updates)
    seq: int | None = None
    reserved: bool = False  # its permit went to a lookup (reserve_permit): not released when applied

    def message(self) -> dict:
        msg = {"ref": self.ref, "grads": self.grads, "scale": self.scale, "unused_slots": self.unused_slots}
        if self.seq is not None:
            msg.update(source=self.source, seq=self.seq)
        return msg


class UpdateOutbox:
    """FIFO of :class:`PendingUpdate`; ``send_alone(update)`` is called (from the flusher thread)
    for updates held longer than ``max_hold_s``, and for every update on :meth:`flush`."""

    def __init__(self, send_alone: Callable[[PendingUpdate], None], max_hold_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, start_flusher: bool = True,
                 send_lock: threading.RLock | None = None):
        """``send_lock``: held from taking updates out until ``send_alone`` returns, by whoever
        sends them (the owner's lookups too), so that they reach the PS in the order they were
        put (own-update replay needs that, ``persia.nn_worker.own_updates``)."""
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s must be >= 0, got {max_hold_s}")
        self._send_alone = send_alone
        self._send_lock = send_lock
        self.max_hold_s = max_hold_s
        self._clock = clock
        self._items: deque[PendingUpdate] = deque()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # The flusher's own condition on the same lock: the staleness permits share ``_cond`` and
        # notify it on every release and step, which would wake the flusher about ten times a
        # training step for nothing (each wake a GIL hand-off beside the training thread).
        self._flusher_cond = threading.Condition(lock)
        self._flusher_idle = False  # waiting for an update to be put, not for one's deadline
        self.flusher_notified = 0  # times the flusher was woken by a notify (not a timeout)
        self._closed = False
        self.carried = 0  # updates that rode on a lookup
        self.sent_alone = 0
        self._flusher = None
        if start_flusher:
            self.start()

    def start(self) -> None:
        """Start the flusher thread (once): a TrainCtx starts it when it is entered, so one that
        is made and never entered leaves no thread behind."""
        with self._cond:
            if self._flusher is not None or self._closed:
                return
            self._flusher = threading.Thread(target=self._flush_loop, name="persia-update-flusher", daemon=True)
        self._flusher.start()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def put(self, update: PendingUpdate) -> None:
        update.queued_at = self._clock()
        with self._cond:
            if self._closed:
                raise RuntimeError("update outbox is closed")
            self._items.append(update)
            self._cond.notify_all()
            if self._flusher_idle:
                # A flusher waiting for an earlier update's deadline wakes by then anyway and looks
                # again (that deadline comes first); only an idle one must hear of this update.
                self._flusher_cond.notify()

    def claim_for(self, worker: int) -> list[PendingUpdate]:
        """Every pending update of ``worker``, oldest first, to carry on a lookup to it."""
        with self._cond:
            mine = [u for u in self._items if u.worker == worker]
            if mine:
                self._items = deque(u for u in self._items if u.worker != worker)
                self.carried += len(mine)
            return mine

    def claim_permit(self) -> PendingUpdate | None:
        """The oldest pending update holding a staleness permit (removed), or None."""
        with self._cond:
            for i, u in enumerate(self._items):
                if u.holds_permit:
                    del self._items[i]
                    self.carried += 1
                    return u
            return None

    def reserve_permit(self) -> PendingUpdate | None:
        """The oldest pending update holding a staleness permit not yet reserved, marked reserved
        and left in place (None: there is none). For an outbox whose updates must reach the PS in
        order: the update goes out with the others, in order, and its permit passes to the lookup
        that reserved it, which sees to it that it is applied before its own read."""
        with self._cond:
            for u in self._items:
                if u.holds_permit and not u.reserved:
                    u.reserved = True
                    return u
            return None

    def take(self, update: PendingUpdate) -> bool:
        """Remove ``update`` if it is still pending (True), to send it now."""
        with self._cond:
            for i, u in enumerate(self._items):
                if u is update:
                    del self._items[i]
                    self.carried += 1
                    return True
            return False

    @property
    def condition(self) -> threading.Condition:
        """Notified on every put; the staleness permits share it (``TrainCtx._permit_condition``).
        The flusher does not wait on it."""
        return self._cond

    def due(self, now: float) -> list[PendingUpdate]:
        """Pure-ish decision of the flusher: the updates held past ``max_hold_s`` (removed)."""
        with self._cond:
            out = []
            while self._items and now - self._items[0].queued_at >= self.max_hold_s:
                out.append(self._items.popleft())
            return out

    def flush(self) -> None:
        """Send every pending update alone now (before a checkpoint, at the end of training)."""
        with self._send_lock or nullcontext():
            with self._cond:
                items, self._items = list(self._items), deque()
            self._send(items)

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._flusher_cond.notify()

    def _send(self, items: list[PendingUpdate]) -> None:
        for u in items:
            self.sent_alone += 1
            self._send_alone(u)

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                if not self._items:
                    self._flusher_idle = True
                    try:
                        # no timeout: only put() and close() can end this wait, and both notify
                        self.flusher_notified += self._flusher_cond.wait()
                    finally:
                        self._flusher_idle = False
                    continue
                wait = self._items[0].queued_at + self.max_hold_s - self._clock()
                if wait > 0:
                    self.flusher_notified += self._flusher_cond.wait(wait)
                    continue
            with self._send_lock or nullcontext():
                self._send(self.due(self._clock()))
