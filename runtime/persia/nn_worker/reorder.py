"""Reproducible mode: release streamed batches in batch-id order, whatever their arrival order."""

from __future__ import annotations

import heapq
from typing import Any, Iterator


class BatchReorderer:
    """Releases batch ids in the order ``rank, rank + world_size, ...`` (reproducible mode).

    Unlike PERSIA (which gave up after 1 s and lost the order), it never times out: ids that will
    never come are known from the loaders' end-of-stream counts.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.next_id = rank
        self._heap: list[tuple[int, int, Any]] = []
        self._seq = 0

    def push(self, batch_id: int, item: Any) -> list[Any]:
        heapq.heappush(self._heap, (batch_id, self._seq, item))
        self._seq += 1
        return self._pop_ready()

    def _pop_ready(self) -> list[Any]:
        out = []
        while self._heap and self._heap[0][0] == self.next_id:
            out.append(heapq.heappop(self._heap)[2])
            self.next_id += self.world_size
        return out

    def skip_to(self, batch_id: int) -> list[Any]:
        """The next expected id will never arrive: move past it (end of a loader's stream)."""
        if self._heap and self._heap[0][0] > self.next_id:
            self.next_id = self._heap[0][0]
        return self._pop_ready()

    def drain(self) -> list[Any]:
        out = [item for _, _, item in sorted(self._heap)]
        self._heap.clear()
        return out


def _reordered(source: Iterator[dict], rank: int, world_size: int) -> Iterator[dict]:
    r = BatchReorderer(rank, world_size)
    try:
        for msg in source:
            yield from r.push(int(msg["batch_id"]), msg)
        yield from r.drain()  # stream ended: everything still held is in order
    finally:
        close = getattr(source, "close", None)
        if close is not None:  # a loop closed early: the stream's view unsubscribes now
            close()
