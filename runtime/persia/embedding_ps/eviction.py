"""Which rows an internal shard evicts: batched LRU at the granularity of training lookups.

Every training lookup gets the next value of the store clock and stamps the rows it reads (stamp 0
marks a free row). When a shard must make room it evicts the ``goal`` rows with the oldest stamps,
never a row stamped by the calling lookup or a later one. ``goal`` is at least the store's
eviction batch (a fraction of the shard capacity), so the O(rows) scan that finds the oldest
stamps runs once per batch of inserts, not once per insert.

Guarantee (per internal shard, proved in docs/ps-storage.md): with shard capacity ``C`` and
eviction batch ``B``, a row read by one of the last ``N`` training lookups is never evicted as long
as those ``N`` lookups read at most ``C - B`` distinct rows of that shard.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def choose_victims(stamps: Sequence[np.ndarray], goal: int, clock: int) -> list[np.ndarray]:
    """Local rows to evict from each table of one shard.

    ``stamps[t]`` holds the stamps of table ``t``'s used rows of the shard. Candidates are rows
    with ``0 < stamp < clock``; the ``goal`` oldest of them are chosen (all when fewer), ties at
    the threshold stamp broken by table order then row order.
    """
    eligible = [np.flatnonzero((s != 0) & (s < clock)) for s in stamps]
    total = sum(e.shape[0] for e in eligible)
    if goal <= 0 or total == 0:
        return [np.empty(0, dtype=np.int64) for _ in stamps]
    if total <= goal:
        return [e.astype(np.int64) for e in eligible]
    values = np.concatenate([s[e] for s, e in zip(stamps, eligible)])
    threshold = np.partition(values, goal - 1)[goal - 1]
    older = int(np.count_nonzero(values < threshold))
    ties_left = goal - older
    out = []
    for s, e in zip(stamps, eligible):
        v = s[e]
        chosen = e[v < threshold]
        tie = e[v == threshold]
        take = min(ties_left, tie.shape[0])
        ties_left -= take
        out.append(np.concatenate([chosen, tie[:take]]).astype(np.int64))
    return out
