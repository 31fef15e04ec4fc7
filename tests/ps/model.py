"""A dict-based reference model of the embedding store: what every row should hold, and the
batched-LRU rules an eviction must respect. Slow and obvious on purpose."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from persia.embedding_ps import index as ix
from persia.hashing import uniform_from_signs


@dataclass
class ModelRow:
    weights: np.ndarray
    last_use: int


@dataclass
class StoreModel:
    capacity: int
    num_shards: int
    lr: float
    weight_bound: float
    lower: float = -0.01
    upper: float = 0.01
    rows: dict[tuple[int, int], ModelRow] = field(default_factory=dict)
    clock: int = 0

    @property
    def shard_capacity(self) -> int:
        return -(-self.capacity // self.num_shards)

    def shard_of(self, sign: int) -> int:
        return int(ix.shard_ids(ix.sign_hash(np.array([sign], dtype=np.uint64)), self.num_shards)[0])

    def lookup(self, signs: np.ndarray, dim: int, train: bool) -> np.ndarray:
        """Expected result; for training, also the rows that must now exist (created here)."""
        if train:
            self.clock += 1
        out = np.zeros((len(signs), dim), np.float32)
        for i, s in enumerate(int(x) for x in signs):
            row = self.rows.get((dim, s))
            if row is None and train:
                init = uniform_from_signs(np.array([s], np.uint64), dim, self.lower, self.upper)[0]
                row = self.rows[(dim, s)] = ModelRow(init.copy(), self.clock)
            if row is not None:
                out[i] = row.weights
                if train:
                    row.last_use = self.clock
        return out

    def update(self, signs: np.ndarray, grads: np.ndarray) -> int:
        dim = grads.shape[1]
        summed: dict[int, np.ndarray] = {}
        missing = 0
        for s, g in zip((int(x) for x in signs), grads):
            if (dim, s) not in self.rows:
                missing += 1
                continue
            summed[s] = summed[s] + g if s in summed else g.copy()
        for s, g in summed.items():
            w = self.rows[(dim, s)].weights
            w -= np.float32(self.lr) * g
            if self.weight_bound > 0:
                np.clip(w, -self.weight_bound, self.weight_bound, out=w)
        return missing

    def reconcile_evictions(self, still_there: set[tuple[int, int]]) -> list[tuple[int, int]]:
        """Drop the rows the engine evicted, after checking the eviction was a legal LRU choice:
        per shard, nothing used by the current call was evicted, and every evicted row is at
        least as old as every surviving row that could have been evicted instead."""
        evicted = [key for key in self.rows if key not in still_there]
        by_shard: dict[int, list] = {}
        for key in evicted:
            by_shard.setdefault(self.shard_of(key[1]), []).append(key)
        for shard, keys in by_shard.items():
            newest_evicted = max(self.rows[k].last_use for k in keys)
            assert newest_evicted < self.clock, f"evicted {keys} although used by the current call"
            survivors = [self.rows[k].last_use for k in self.rows
                         if k not in evicted and self.shard_of(k[1]) == shard and self.rows[k].last_use < self.clock]
            if survivors:
                assert newest_evicted <= min(survivors), (
                    f"shard {shard}: evicted a row last used at {newest_evicted} but kept one last used at {min(survivors)}"
                )
        for key in evicted:
            del self.rows[key]
        for shard in range(self.num_shards):
            live = sum(1 for k in self.rows if self.shard_of(k[1]) == shard)
            assert live <= self.shard_capacity, f"shard {shard} holds {live} rows, capacity {self.shard_capacity}"
        return evicted
