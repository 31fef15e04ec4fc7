"""Buffers of the embedding worker: ID batches waiting for a lookup, and looked-up batches waiting
for their gradients. Both are bounded, and both expire old entries with a count and a log line
(PERSIA's post-forward buffer never expired and leaked when an NN worker died).

A data loader sends a batch's ID features and its dense part at once, so the NN worker's lookup
may come first: ``take(ref, wait_s=...)`` waits for the ref on a condition (bounded in time and in
the number of waiters), and fails at once for a ref that is known to be gone (looked up already,
expired, or released by a data loader that gave up on its batch)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from persia.errors import BatchLost, TooManyWaiting
from persia.recent_keys import RecentKeys

log = logging.getLogger(__name__)


class ExpiringBuffer:
    """``ref -> item`` in insertion order, per-owner and total capacity, age-based expiry."""

    def __init__(
        self,
        name: str,
        capacity_per_owner: int,
        expired_sec: float,
        clock: Callable[[], float] = time.monotonic,
        capacity_total: int | None = None,
        remember: int = 0,
        max_waiters: int = 0,
        on_wait: Callable[[], None] | None = None,
    ):
        """``remember``: how many refs that left the buffer are remembered (and why), so that a
        waiting ``take`` or a late ``put`` of one fails at once; ``max_waiters``: ``take`` calls
        that may wait at the same time (0: none waits); ``on_wait``: called when a ``take``
        starts waiting (a metric)."""
        if capacity_per_owner < 1:
            raise ValueError(f"{name}: capacity must be >= 1, got {capacity_per_owner}")
        if capacity_total is not None and capacity_total < 1:
            raise ValueError(f"{name}: total capacity must be >= 1, got {capacity_total}")
        if max_waiters and not remember:
            raise ValueError(f"{name}: waiting takes need remembered refs (a release must reach them)")
        self.name = name
        self.capacity = capacity_per_owner
        self.capacity_total = capacity_total
        self.expired_sec = expired_sec
        self._clock = clock
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._items: OrderedDict[int, tuple[float, int, Any]] = OrderedDict()
        self._per_owner: dict[int, int] = {}
        self._next_ref = random.getrandbits(40) << 16  # random base: refs differ across restarts
        self.expired = 0
        self._gone = RecentKeys(remember) if remember else None  # ref -> (lost, why)
        self.max_waiters = max_waiters
        self._on_wait = on_wait
        self._waiting: dict[int, int] = {}  # ref -> takes waiting for it
        self._n_waiting = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def waiting(self) -> int:
        """``take`` calls waiting for their ref right now."""
        return self._n_waiting

    def would_refuse(self, ref: int) -> bool:
        """Whether a ``put`` under ``ref`` fails: it is held, or remembered as gone."""
        with self._lock:
            return ref in self._items or (self._gone is not None and self._gone.get(ref) is not None)

    def _expire_locked(self, now: float) -> None:
        dropped = 0
        while self._items:
            ref, (t, owner, _) = next(iter(self._items.items()))
            if now - t < self.expired_sec:
                break
            self._items.popitem(last=False)
            self._forget_one(owner)
            self._left(ref, False, f"expired after {self.expired_sec:.0f}s")
            dropped += 1
        if dropped:
            self.expired += dropped
            log.warning(
                "%s: expired %d entries older than %.0fs (total expired %d)",
                self.name, dropped, self.expired_sec, self.expired,
            )

    def _forget_one(self, owner: int) -> None:
        left = self._per_owner[owner] - 1
        if left:
            self._per_owner[owner] = left
        else:  # no count kept for owners that hold nothing (ids are chosen by senders)
            del self._per_owner[owner]

    def _left(self, ref: int, lost: bool, why: str) -> None:
        """Remember that ``ref`` left the buffer (``lost``: it will never be looked up)."""
        if self._gone is not None:
            self._gone.add(ref, (lost, why))

    def _check_gone(self, ref: int) -> None:
        gone = None if self._gone is None else self._gone.get(ref)
        if gone is None:
            return
        lost, why = gone
        if lost:
            raise BatchLost(f"{self.name}: ref {ref} {why}")
        raise KeyError(f"{self.name}: ref {ref} {why}")

    def put(self, owner: int, item: Any, ref: int | None = None) -> int | None:
        """Store ``item``; returns its ref, or None when ``owner`` already holds ``capacity`` items
        or the buffer holds ``capacity_total``. A ref somebody waits for is taken whatever the
        capacity (its lookup consumes it at once, and the waiters are bounded): otherwise a full
        buffer could hold back the very batch the NN worker needs before it frees any space.
        A ``ref`` given by the caller that is buffered or gone is refused (BatchLost for one
        released or given up on, ValueError otherwise)."""
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            if ref is not None:
                if ref in self._items:
                    raise ValueError(f"{self.name}: ref {ref} is already buffered (for another batch)")
                self._check_gone(ref)
            waited = ref is not None and ref in self._waiting
            if not waited:
                if self._per_owner.get(owner, 0) >= self.capacity:
                    return None
                if self.capacity_total is not None and len(self._items) >= self.capacity_total:
                    return None
            if ref is None:
                ref = self._next_ref
                self._next_ref += 1
            self._items[ref] = (now, owner, item)
            self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
            if waited:
                self._arrived.notify_all()
            return ref

    def take(self, ref: int, wait_s: float = 0.0) -> Any:
        """The item of ``ref``, removed. With ``wait_s``, a ref not here yet is waited for that
        long (BatchLost after that, or at once when it is released meanwhile); TooManyWaiting when
        ``max_waiters`` takes wait already."""
        with self._lock:
            entry = self._items.pop(ref, None)
            if entry is None and wait_s > 0 and self.max_waiters:
                entry = self._wait_locked(ref, wait_s)
            if entry is None:
                self._check_gone(ref)
                raise KeyError(
                    f"{self.name}: ref {ref} not found (never sent here, already consumed, or expired "
                    f"after {self.expired_sec:.0f}s; {self.expired} expired so far)"
                )
            self._forget_one(entry[1])
            self._left(ref, False, "was already looked up")
            return entry[2]

    def _wait_locked(self, ref: int, wait_s: float) -> tuple:
        self._check_gone(ref)
        if self._n_waiting >= self.max_waiters:
            raise TooManyWaiting(f"{self.name}: {self._n_waiting} lookups already wait for their ID features "
                                 f"(at most {self.max_waiters}); ask again")
        self._n_waiting += 1
        self._waiting[ref] = self._waiting.get(ref, 0) + 1
        if self._on_wait is not None:
            self._on_wait()
        end = time.monotonic() + wait_s
        try:
            while True:
                entry = self._items.pop(ref, None)
                if entry is not None:
                    return entry
                self._check_gone(ref)
                left = end - time.monotonic()
                if left <= 0:
                    why = f"did not arrive within the lookup wait of {wait_s:g}s (lookup_wait_sec); a late copy is refused"
                    self._left(ref, True, why)
                    raise BatchLost(f"{self.name}: ref {ref} {why}")
                self._arrived.wait(left)
        finally:
            self._n_waiting -= 1
            if self._waiting[ref] == 1:
                del self._waiting[ref]
            else:
                self._waiting[ref] -= 1

    def release(self, ref: int, why: str) -> bool:
        """Drop ``ref`` (True if it was here) and remember it as lost for ``why``: a take waiting
        for it fails now, a later put or take of it fails at once."""
        with self._lock:
            entry = self._items.pop(ref, None)
            if entry is not None:
                self._forget_one(entry[1])
            self._left(ref, True, why)
            if ref in self._waiting:
                self._arrived.notify_all()
            return entry is not None

    def expire(self) -> None:
        with self._lock:
            self._expire_locked(self._clock())
