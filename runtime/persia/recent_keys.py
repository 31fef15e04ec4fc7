"""How many recent message keys a receiver remembers to answer a retried send once.

A data loader retries a send until its deadline (600 s by default), so a receiver needs the keys
of that window, not of the whole run: remembered for ever, they grew without bound (an NN rank's
set of every batch key it had seen: about 180 B a batch, half a GB a day at 36 batches a second).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Iterator

# 600 s of retries at 160 batches a second (batch 128 at 20k samples/s) per receiver
RETRY_MEMORY = 100_000


class RecentKeys:
    """The last ``capacity`` keys added, each with an optional value, the oldest forgotten first
    (O(1) a key). Shared by every receiver that answers retries: the embedding worker (refs of
    recent sends, refs that left its buffer) and the NN rank (batch keys it has queued)."""

    def __init__(self, capacity: int = RETRY_MEMORY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, Any] = OrderedDict()

    def add(self, key: Hashable, value: Any = None) -> None:
        """Remember ``key`` (with ``value``) as the newest; past the capacity the oldest goes."""
        if key in self._keys:
            self._keys.move_to_end(key)
        self._keys[key] = value
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def get(self, key: Hashable, default: Any = None) -> Any:
        return self._keys.get(key, default)

    def discard(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
