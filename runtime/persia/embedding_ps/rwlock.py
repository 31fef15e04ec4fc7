"""A readers-writer lock with writer preference, and ordered multi-lock helpers.

Lookups share an internal shard (readers); updates, inserts, evictions and growth own it
(writers). Writer preference keeps a stream of lookups from starving gradient updates. Deadlock
freedom comes from one rule: whoever holds more than one shard lock took them in ascending shard
order, and whoever waits while holding a lock holds only locks below the one it waits for.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence


class RWLock:
    """``_sleepers`` counts threads in ``wait()``: a release wakes them only when there are any
    (``notify_all`` on an empty condition still costs a Python-level call per release, and most
    releases of a 2-core job's PS have nobody waiting)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0
        self._sleepers = 0

    def _wait(self) -> None:
        self._sleepers += 1
        try:
            self._cond.wait()
        finally:
            self._sleepers -= 1

    def acquire_read(self) -> None:
        with self._cond:
            while self._writer or self._waiting_writers:
                self._wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0 and self._sleepers:
                self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self._waiting_writers += 1
            try:
                while self._writer or self._readers:
                    self._wait()
            finally:
                self._waiting_writers -= 1
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            if self._sleepers:
                self._cond.notify_all()

    @contextmanager
    def read(self) -> Iterator[None]:
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    @contextmanager
    def write(self) -> Iterator[None]:
        self.acquire_write()
        try:
            yield
        finally:
            self.release_write()


@contextmanager
def read_all(locks: Sequence[RWLock], which: Iterable[int]) -> Iterator[None]:
    """Share the given shards (ascending order) for the duration of the block."""
    taken: list[RWLock] = []
    try:
        for k in sorted(which):
            locks[k].acquire_read()
            taken.append(locks[k])
        yield
    finally:
        for lock in reversed(taken):
            lock.release_read()


@contextmanager
def write_some(locks: Sequence[RWLock], which: Iterable[int]) -> Iterator[None]:
    """Own the given shards (ascending order) for the duration of the block."""
    taken: list[RWLock] = []
    try:
        for k in sorted(which):
            locks[k].acquire_write()
            taken.append(locks[k])
        yield
    finally:
        for lock in reversed(taken):
            lock.release_write()


@contextmanager
def write_all(locks: Sequence[RWLock]) -> Iterator[None]:
    """Own every shard (ascending order): growth, clear, load's swap."""
    taken: list[RWLock] = []
    try:
        for lock in locks:
            lock.acquire_write()
            taken.append(lock)
        yield
    finally:
        for lock in reversed(taken):
            lock.release_write()
