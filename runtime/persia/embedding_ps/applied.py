"""Which tagged updates a PS replica has applied, per update source (docs/ps-storage.md,
"Tagged updates and consistent lookups").

An NN worker tags each update with its *source* (one random integer per TrainCtx) and a *seq*
(1, 2, 3, ... per source). The store records a tagged update's seqs in the same critical section
that applies it, and a lookup can ask which seqs >= ``since`` of a source its rows reflect: the NN
worker then re-applies only its own updates the rows miss.

Seqs are kept as disjoint half-open ranges ``[start, end)`` (each replica usually sees every seq,
so a source is one range), only those above ``max seen - WINDOW``, for the ``MAX_SOURCES`` most
recently used sources; a query about seqs that a dropped source had recorded is refused. Worst
case (every other seq missing, every source full): 16 bytes per range, 32,768 ranges per source,
128 MiB in all; one range per source in the usual case.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from typing import Iterable

import numpy as np

__all__ = ["WINDOW", "MAX_SOURCES", "MAX_DROPPED", "horizon", "AppliedLog"]

WINDOW = 65_536
"""Seqs kept per source: those > (highest recorded seq - WINDOW)."""
MAX_SOURCES = 256
"""Sources kept (least recently recorded or queried dropped first)."""
MAX_DROPPED = 65_536
"""Dropped sources remembered (with the highest seq each had recorded), so that a query about
seqs a dropped source had recorded is refused instead of answered "none applied"."""


def horizon(max_seen: int) -> int:
    """The lowest ``since`` a query may ask for a source whose highest recorded seq is
    ``max_seen``: seqs at or below ``max_seen - WINDOW`` are not kept."""
    return max(0, max_seen - WINDOW + 1)


class _Ranges:
    """Sorted disjoint, non-adjacent ranges ``[starts[i], ends[i])`` of one source's seqs."""

    __slots__ = ("starts", "ends", "max_seen", "version", "floor")

    def __init__(self, floor: int = 0) -> None:
        self.starts = array("q")
        self.ends = array("q")
        self.max_seen = -1
        self.version = 0
        self.floor = floor  # seqs below it were recorded before the source was dropped, then forgotten

    def add(self, s: int) -> None:
        starts, ends = self.starts, self.ends
        if ends and s == ends[-1]:  # the usual case: the next seq
            ends[-1] = s + 1
            return
        i = bisect_right(starts, s) - 1  # the range starting at or before s
        if i >= 0 and s < ends[i]:
            return  # recorded already
        joins_left = i >= 0 and ends[i] == s
        joins_right = i + 1 < len(starts) and starts[i + 1] == s + 1
        if joins_left and joins_right:
            ends[i] = ends[i + 1]
            del starts[i + 1], ends[i + 1]
        elif joins_left:
            ends[i] = s + 1
        elif joins_right:
            starts[i + 1] = s
        else:
            starts.insert(i + 1, s)
            ends.insert(i + 1, s + 1)

    def prune(self) -> None:
        low = horizon(self.max_seen)
        if not self.starts or self.starts[0] >= low:
            return
        cut = bisect_right(self.ends, low)  # ranges wholly below low
        del self.starts[:cut], self.ends[:cut]
        if self.starts and self.starts[0] < low:
            self.starts[0] = low

    def since(self, since: int) -> np.ndarray:
        i = bisect_right(self.ends, since)  # the first range with end > since
        if i == len(self.starts):
            return np.zeros(0, dtype=np.int64)
        # copies of the slices: a view of the arrays themselves would pin them against resizing
        st = np.frombuffer(self.starts[i:], dtype=np.int64).copy()
        en = np.frombuffer(self.ends[i:], dtype=np.int64)
        st[0] = max(int(st[0]), since)
        lens = en - st
        offsets = np.cumsum(lens) - lens
        return np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(st - offsets, lens)


class AppliedLog:
    """Thread-safe record of applied seqs per source. The store calls :meth:`record` while it owns
    every shard, and :meth:`query` while it shares the shards a lookup reads; the log's own lock
    only guards its dict (concurrent lookups query at once)."""

    def __init__(self, max_sources: int = MAX_SOURCES, max_dropped: int = MAX_DROPPED) -> None:
        self.max_sources = int(max_sources)
        self.max_dropped = int(max_dropped)
        self._sources: OrderedDict[int, _Ranges] = OrderedDict()
        # a dropped source -> the lowest seq it can still be asked about (above all it had recorded)
        self._dropped: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()
        self._versions = 0

    def _drop_oldest(self) -> None:
        source, entry = self._sources.popitem(last=False)
        floor = max(entry.floor, entry.max_seen + 1)
        if floor > 0:  # it had recorded seqs: asking about them would now read "none applied"
            self._dropped[source] = floor
            while len(self._dropped) > self.max_dropped:
                self._dropped.popitem(last=False)

    def __len__(self) -> int:
        return len(self._sources)

    def record(self, source: int, seqs: Iterable[int]) -> None:
        """Note ``seqs`` as applied for ``source`` (repeats are ignored)."""
        seqs = sorted(int(s) for s in seqs)
        with self._lock:
            entry = self._sources.get(source)
            if entry is None:
                entry = self._sources[source] = _Ranges(floor=self._dropped.pop(source, 0))
                while len(self._sources) > self.max_sources:
                    self._drop_oldest()
            else:
                self._sources.move_to_end(source)
            if seqs:
                entry.max_seen = max(entry.max_seen, seqs[-1])
            low = horizon(entry.max_seen)
            for s in seqs:
                if s >= low:
                    entry.add(s)
            entry.prune()
            self._versions += 1
            entry.version = self._versions

    def _check(self, entry: _Ranges | None, source: int, since: int) -> None:
        floor = entry.floor if entry is not None else self._dropped.get(source, 0)
        if since < floor:
            raise ValueError(
                f"field 'applied.since' is {since} but this PS replica forgot which seqs below {floor} "
                f"source {source} had applied: more than {self.max_sources} update sources (NN worker "
                "contexts) used it since, and the least recently used was dropped"
            )
        low = horizon(entry.max_seen) if entry is not None else 0
        if since < low:
            raise ValueError(
                f"field 'applied.since' is {since} but source {source} keeps applied seqs only from {low} "
                f"(the horizon: its highest applied seq minus {WINDOW - 1}); older ones were pruned"
            )

    def check(self, source: int, since: int) -> None:
        """ValueError naming ``applied.since`` when seqs at or above it may have been pruned."""
        with self._lock:
            self._check(self._sources.get(source), source, since)

    def query(self, source: int, since: int) -> tuple[np.ndarray, int]:
        """``(sorted int64 seqs >= since recorded for source, version)``; an unknown source: nothing
        applied yet, version 0. The version changes whenever the source records anything.
        ValueError (as :meth:`check`) when ``since`` lies below the source's horizon, or below
        the seqs it had recorded when it was dropped (an answer would wrongly say "not applied",
        and the NN worker would replay them a second time)."""
        with self._lock:
            entry = self._sources.get(source)
            self._check(entry, source, since)
            if entry is None:
                return np.zeros(0, dtype=np.int64), 0
            self._sources.move_to_end(source)
            return entry.since(since), entry.version

    def version(self, source: int) -> int:
        with self._lock:
            entry = self._sources.get(source)
            return 0 if entry is None else entry.version

    def clear(self) -> None:
        with self._lock:
            self._sources.clear()
            self._dropped.clear()
            self._versions += 1  # a lookup in flight sees every source's version change
