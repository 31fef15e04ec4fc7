"""Readers-writer locks over a store's internal shards, taken a set of shards at a time.

Lookups share the shards their IDs fall in (readers); updates, inserts, evictions and growth own
them (writers). A training batch touches every shard, so most calls take all of them: one mutex
guards every shard's counters, a call takes its whole set at once (all or nothing), and "every
shard" is one counter, not one lock per shard (with 100 shards, a per-shard ``RWLock`` taken in
order cost a Step call of the synthetic benchmark 300 lock round trips, more than its kernels).

Writer preference keeps a stream of lookups from starving gradient updates: a writer waiting for
a shard (or for all of them) holds back new readers of it. No call waits while holding shards, so
there is no lock order to keep; the locks are not reentrant (a thread must not take shards it
holds).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable, Iterator


class ShardLocks:
    """``n`` readers-writer locks; ``which=None`` (or every shard) is the whole-store mode."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"ShardLocks needs at least one shard, got {n}")
        self.n = n
        self._cond = threading.Condition(threading.Lock())
        self._readers = [0] * n  # set-wise read holds per shard
        self._writer = [False] * n  # shard owned by a set-wise writer
        self._waiting = [0] * n  # set-wise writers waiting for the shard
        self._shard_reads = 0  # sum of _readers
        self._shard_writes = 0  # shards owned by set-wise writers
        self._shard_waiting = 0  # sum of _waiting
        self._all_readers = 0  # holders of every shard for reading
        self._all_writer = False
        self._all_waiting = 0  # writers waiting for every shard
        self._sleepers = 0  # threads in wait(): a release wakes them only when there are any

    def _shards(self, which: Iterable[int] | None) -> list[int] | None:
        if which is None:
            return None
        ks = sorted(set(which))
        if ks and (ks[0] < 0 or ks[-1] >= self.n):
            raise IndexError(f"shard out of range [0, {self.n}): {ks[0] if ks[0] < 0 else ks[-1]}")
        return None if len(ks) == self.n else ks

    def _wait(self) -> None:
        self._sleepers += 1
        try:
            self._cond.wait()
        finally:
            self._sleepers -= 1

    def _wake(self) -> None:
        if self._sleepers:
            self._cond.notify_all()

    # -- readers --------------------------------------------------------------------------------
    def _can_read(self, ks: list[int] | None) -> bool:
        if self._all_writer or self._all_waiting:
            return False
        if ks is None:
            return not self._shard_writes and not self._shard_waiting
        return not any(self._writer[k] or self._waiting[k] for k in ks)

    def acquire_read(self, which: Iterable[int] | None = None) -> list[int] | None:
        """Share ``which`` (None: every shard); returns the token :meth:`release_read` takes."""
        ks = self._shards(which)
        with self._cond:
            while not self._can_read(ks):
                self._wait()
            if ks is None:
                self._all_readers += 1
            else:
                for k in ks:
                    self._readers[k] += 1
                self._shard_reads += len(ks)
        return ks

    def release_read(self, ks: list[int] | None) -> None:
        with self._cond:
            if ks is None:
                self._all_readers -= 1
            else:
                for k in ks:
                    self._readers[k] -= 1
                self._shard_reads -= len(ks)
            self._wake()

    # -- writers --------------------------------------------------------------------------------
    def _can_write(self, ks: list[int] | None) -> bool:
        if self._all_writer or self._all_readers:
            return False
        if ks is None:
            return not self._shard_reads and not self._shard_writes
        return not any(self._writer[k] or self._readers[k] for k in ks)

    def acquire_write(self, which: Iterable[int] | None = None) -> list[int] | None:
        """Own ``which`` (None: every shard); returns the token :meth:`release_write` takes."""
        ks = self._shards(which)
        with self._cond:
            if ks is None:
                self._all_waiting += 1
            else:
                for k in ks:
                    self._waiting[k] += 1
                self._shard_waiting += len(ks)
            try:
                # a set-wise writer also lets a waiting whole-store writer go first
                while not self._can_write(ks) or (ks is not None and self._all_waiting):
                    self._wait()
            finally:
                if ks is None:
                    self._all_waiting -= 1
                else:
                    for k in ks:
                        self._waiting[k] -= 1
                    self._shard_waiting -= len(ks)
            if ks is None:
                self._all_writer = True
            else:
                for k in ks:
                    self._writer[k] = True
                self._shard_writes += len(ks)
        return ks

    def release_write(self, ks: list[int] | None) -> None:
        with self._cond:
            if ks is None:
                self._all_writer = False
            else:
                for k in ks:
                    self._writer[k] = False
                self._shard_writes -= len(ks)
            self._wake()

    # -- blocks ---------------------------------------------------------------------------------
    @contextmanager
    def read(self, which: Iterable[int] | None = None) -> Iterator[None]:
        """Share the given shards (None: all) for the duration of the block."""
        ks = self.acquire_read(which)
        try:
            yield
        finally:
            self.release_read(ks)

    @contextmanager
    def write(self, which: Iterable[int] | None = None) -> Iterator[None]:
        """Own the given shards (None: all) for the duration of the block."""
        ks = self.acquire_write(which)
        try:
            yield
        finally:
            self.release_write(ks)
