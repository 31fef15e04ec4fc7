"""Reproducible mode: release streamed batches in batch-id order, whatever their arrival order."""

from __future__ import annotations

import heapq
import logging
from typing import Any, Iterator

log = logging.getLogger(__name__)

HOLD_LIMIT = 64  # later batches held for a missing id before it is given up on


class BatchReorderer:
    """Releases batch ids in the order ``rank, rank + world_size, ...`` (reproducible mode).

    PERSIA gave up on a missing id after 1 s, which lost the order whenever a send was slow. Here
    an id is waited for while fewer than ``hold_limit`` later batches wait: some ids never come
    (a resumed stream skips its trained batches, a failed send spends its id, a restarted loader
    counts from 0 again), and waiting for them held every later batch, in memory and untrained,
    until the stream ended. Given up on, with a warning naming them; one that comes after all is
    released at once, out of order.
    """

    def __init__(self, rank: int, world_size: int, hold_limit: int = HOLD_LIMIT):
        self.rank = rank
        self.world_size = world_size
        self.hold_limit = hold_limit
        self.next_id = rank
        self._heap: list[tuple[int, int, Any]] = []
        self._seq = 0

    def push(self, batch_id: int, item: Any) -> list[Any]:
        if batch_id < self.next_id:  # given up on before it came: released now, out of order
            log.warning("reproducible mode: batch %d came after its turn (given up on); trained out of order",
                        batch_id)
            return [item]
        heapq.heappush(self._heap, (batch_id, self._seq, item))
        self._seq += 1
        out = self._pop_ready()
        if len(self._heap) > self.hold_limit:
            first = self._heap[0][0]
            log.warning("reproducible mode: batch ids %d to %d (every %d) not come while %d later batches wait: "
                        "going on from %d (a resumed stream skips its trained batches; a failed send spends "
                        "its id)", self.next_id, first - self.world_size, self.world_size, len(self._heap), first)
            self.next_id = first
            out += self._pop_ready()
        return out

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
