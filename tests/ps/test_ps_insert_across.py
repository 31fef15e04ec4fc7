"""Training lookups insert their new rows across shards in one pass when no shard needs a
decision of its own (a shard at capacity evicts first, in the same pass); the result is the
per-shard path's, row for row."""

from __future__ import annotations

import numpy as np

from persia.embedding_ps import EmbeddingStore, HyperParameters, SGDConfig


def _pair(capacity, shards, monkeypatch):
    fast, slow = EmbeddingStore(capacity, shards), EmbeddingStore(capacity, shards)
    monkeypatch.setattr(slow, "_insert_all_shards", lambda *a, **k: False)  # always the per-shard path
    taken = []
    original = fast._insert_all_shards
    monkeypatch.setattr(fast, "_insert_all_shards", lambda *a, **k: taken.append(original(*a, **k)) or taken[-1])
    for s in (fast, slow):
        s.configure(HyperParameters())
        s.register_optimizer(SGDConfig(lr=0.5))
    return fast, slow, taken


def _steps(fast, slow, rng, batches, universe, dim=8):
    for _ in range(batches):
        signs = rng.choice(universe, size=300).astype(np.uint64)  # repeats and rows seen before
        a, b = fast.lookup(signs, dim, train=True), slow.lookup(signs, dim, train=True)
        np.testing.assert_array_equal(a, b)
        uniq = np.unique(signs)
        grads = rng.standard_normal((uniq.shape[0], dim)).astype(np.float32)
        assert fast.update(uniq, grads) == slow.update(uniq, grads)
    probe = np.unique(universe).astype(np.uint64)
    np.testing.assert_array_equal(fast.lookup(probe, dim, train=False), slow.lookup(probe, dim, train=False))
    assert len(fast) == len(slow)
    assert fast.stats()["inserted"] == slow.stats()["inserted"]


def test_one_pass_insert_gives_the_per_shard_result(monkeypatch):
    rng = np.random.default_rng(0)
    fast, slow, taken = _pair(100_000, 8, monkeypatch)
    _steps(fast, slow, rng, 20, rng.integers(1, 2**63, size=3000, dtype=np.int64))
    assert taken and all(taken)  # plenty of room: the one-pass path did every insert


def test_full_shards_evict_in_the_one_pass_and_agree_with_the_per_shard_path(monkeypatch):
    """At capacity every insert evicts and every index region holds tombstones. The one pass used
    to step aside for both, so a PS at capacity (a huge-model job's steady state) took the
    per-shard path for every lookup: 3.3 ms against 0.33 below capacity (bench/ps_capacity.py).
    It now evicts shard by shard under the locks it holds, and reuses tombstoned slots, with the
    per-shard path's rows, evictions and results."""
    rng = np.random.default_rng(1)
    fast, slow, taken = _pair(800, 4, monkeypatch)  # far fewer rows than IDs: evictions, tombstones
    _steps(fast, slow, rng, 30, rng.integers(1, 2**63, size=5000, dtype=np.int64))
    assert taken and all(taken)  # the one pass, at capacity too
    assert fast.stats()["evictions"] == slow.stats()["evictions"] > 0


def test_a_lookup_that_overfills_a_shard_still_takes_the_per_shard_path(monkeypatch):
    """More new rows for one shard than it can hold even after evicting: the per-shard path keeps
    what fits (``capacity_rejected``), as before."""
    rng = np.random.default_rng(2)
    fast, slow, taken = _pair(40, 2, monkeypatch)  # 20 rows a shard; 300 new IDs a lookup
    _steps(fast, slow, rng, 5, rng.integers(1, 2**63, size=5000, dtype=np.int64))
    assert False in taken
    assert fast.stats()["capacity_rejected"] == slow.stats()["capacity_rejected"] > 0


def test_insert_across_takes_freed_rows_first_and_otherwise_continues_each_shards_high_water():
    """The vectorized case (no freed rows) and the per-shard loop (freed rows) number rows by one
    reference rule: per shard, in the signs' order, the last freed rows of its free list first,
    then rows from its high-water mark on."""
    from persia.embedding_ps import index as ix
    from persia.embedding_ps.table import DimTable

    def expected(table, shards):
        out = np.empty(shards.size, dtype=np.int64)
        for k in range(table.num_shards):
            mine = np.flatnonzero(shards == k)
            free = table.free[k]
            reuse = min(free.size, mine.size)
            hw = int(table.high_water[k])
            local = list(free[free.size - reuse :]) + list(range(hw, hw + mine.size - reuse))
            out[mine] = np.array(local, dtype=np.int64) + table.base(k)
        return out.tolist()

    rng = np.random.default_rng(3)
    table = DimTable(4, 4, 64, 0, 0.0)
    for freed in (False, True):
        if freed:  # as eviction leaves them (the caller rules out tombstones; the rows are what matters)
            table.free[1] = np.array([5, 2], dtype=np.int64)
        signs = rng.integers(1, 2**63, size=40, dtype=np.int64).astype(np.uint64)
        shards = rng.integers(0, 4, size=40)
        want = expected(table, shards)
        live_before, hw_before = table.live.copy(), table.high_water.copy()
        got = table.insert_across(shards, signs, ix.sign_hash(signs), 1, -0.1, 0.1)
        assert got.tolist() == want
        np.testing.assert_array_equal(table.live - live_before, np.bincount(shards, minlength=4))
        assert (table.high_water >= hw_before).all() and table.free[1].size == 0
        np.testing.assert_array_equal(table.signs_of_rows[got], signs)
