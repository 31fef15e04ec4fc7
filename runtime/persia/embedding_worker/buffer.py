"""Buffers of the embedding worker: ID batches waiting for a lookup, and looked-up batches waiting
for their gradients. Both are bounded, and both expire old entries with a count and a log line
(PERSIA's post-forward buffer never expired and leaked when an NN worker died)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

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
    ):
        if capacity_per_owner < 1:
            raise ValueError(f"{name}: capacity must be >= 1, got {capacity_per_owner}")
        if capacity_total is not None and capacity_total < 1:
            raise ValueError(f"{name}: total capacity must be >= 1, got {capacity_total}")
        self.name = name
        self.capacity = capacity_per_owner
        self.capacity_total = capacity_total
        self.expired_sec = expired_sec
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[int, tuple[float, int, Any]] = OrderedDict()
        self._per_owner: dict[int, int] = {}
        self._next_ref = random.getrandbits(40) << 16  # random base: refs differ across restarts
        self.expired = 0

    def __len__(self) -> int:
        return len(self._items)

    def _expire_locked(self, now: float) -> None:
        dropped = 0
        while self._items:
            ref, (t, owner, _) = next(iter(self._items.items()))
            if now - t < self.expired_sec:
                break
            self._items.popitem(last=False)
            self._forget_one(owner)
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

    def put(self, owner: int, item: Any, ref: int | None = None) -> int | None:
        """Store ``item``; returns its ref, or None when ``owner`` already holds ``capacity`` items
        or the buffer holds ``capacity_total``."""
        now = self._clock()
        with self._lock:
            self._expire_locked(now)
            if self._per_owner.get(owner, 0) >= self.capacity:
                return None
            if self.capacity_total is not None and len(self._items) >= self.capacity_total:
                return None
            if ref is None:
                ref = self._next_ref
                self._next_ref += 1
            self._items[ref] = (now, owner, item)
            self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
            return ref

    def take(self, ref: int) -> Any:
        with self._lock:
            entry = self._items.pop(ref, None)
            if entry is None:
                raise KeyError(
                    f"{self.name}: ref {ref} not found (never sent here, already consumed, or expired "
                    f"after {self.expired_sec:.0f}s; {self.expired} expired so far)"
                )
            self._forget_one(entry[1])
            return entry[2]

    def expire(self) -> None:
        with self._lock:
            self._expire_locked(self._clock())
