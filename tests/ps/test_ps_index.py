"""The vectorized index and the table under it: probing, tombstones and rebuilds, growth,
promotion of hot rows to their home slot, and concurrent use from many threads."""

from __future__ import annotations

import threading

import numpy as np

from persia.embedding_ps import EmbeddingStore, SGDConfig
from persia.embedding_ps import index as ix
from persia.embedding_ps.table import DimTable
from persia.hashing import uniform_from_signs


def test_index_functions_against_a_dict():
    rng = np.random.default_rng(2)
    shards, slots = 3, 40
    index = np.zeros(shards * slots, dtype=ix.SLOT_DTYPE)
    signs = np.unique(rng.integers(0, 2**64 - 1, 40, dtype=np.uint64, endpoint=True))
    rows = np.arange(ix.FIRST_ROW, ix.FIRST_ROW + len(signs))
    stored = np.zeros(ix.FIRST_ROW + len(signs), dtype=np.uint64)
    stored[rows] = signs
    h = ix.sign_hash(signs)
    shard = ix.shard_ids(h, shards)
    assert ix.insert(index, h, rows, shards, slots) == 0
    home = ix.home_slots(h, shards, slots)
    assert ((home // slots) == shard).all()  # a sign's home slot lies in its shard's region

    def lookup(q):  # the obvious sequential probe, one sign at a time
        out = []
        for sign, p in zip(q.tolist(), ix.home_slots(ix.sign_hash(q), shards, slots).tolist()):
            while True:
                g = int(index[p])
                if g == ix.EMPTY or (g >= ix.FIRST_ROW and int(stored[g]) == sign):
                    out.append(g)
                    break
                p = int(ix.next_slots(np.array([p]), slots)[0])
        return np.array(out)

    np.testing.assert_array_equal(lookup(signs), rows)
    absent = np.array([123, 456, 0], dtype=np.uint64)
    np.testing.assert_array_equal(lookup(absent), 0)
    # delete every other entry: tombstones keep the others reachable
    gone = rows[::2]
    pos = ix.locate_rows(index, gone, h[::2], shards, slots)
    index[pos] = ix.TOMBSTONE
    expect = rows.copy()
    expect[::2] = 0
    np.testing.assert_array_equal(lookup(signs), expect)
    assert ix.insert(index, h[::2], gone, shards, slots) > 0  # reinserted into tombstones
    np.testing.assert_array_equal(lookup(signs), rows)


def test_tombstones_trigger_region_rebuilds_and_lookups_stay_right():
    store = EmbeddingStore(200, 2, evict_fraction=0.0)
    store.register_optimizer(SGDConfig(lr=0.5))
    rng = np.random.default_rng(4)
    for step in range(60):
        batch = np.unique(rng.integers(0, 5000, 40)).astype(np.uint64)
        store.lookup(batch, 3, True)
        grads = np.full((len(batch), 3), 0.25, np.float32)
        store.update(batch, grads)
    table = store._tables[3]
    assert store.stats()["evictions"] > 1000
    assert table.R == 100 and table.rebuilds > 0  # no growth here: tombstones forced the rebuilds
    live = np.concatenate([table.signs_of_rows[table.base(k) + np.flatnonzero(table.region_stamps(k) != 0)]
                           for k in range(2)])
    assert len(live) == len(store) and store.contains(live, 3).all()


def test_growth_keeps_every_row():
    store = EmbeddingStore(100_000, 4)
    store.register_optimizer(SGDConfig(lr=1.0))
    signs = np.arange(1, 30_001, dtype=np.uint64) * 2654435761
    first_r = None
    for a in range(0, len(signs), 3000):
        store.lookup(signs[a:a + 3000], 2, True)
        first_r = first_r or store._tables[2].R
    assert store._tables[2].R > first_r  # the regions grew
    store.update(signs[::2], np.ones((len(signs[::2]), 2), np.float32))
    got = store.lookup(signs, 2, False)
    init = uniform_from_signs(signs, 2, -0.01, 0.01)
    np.testing.assert_array_equal(got[1::2], init[1::2])
    np.testing.assert_array_equal(got[::2], init[::2] - 1)


def test_updates_promote_hot_rows_to_their_home_slot():
    store = EmbeddingStore(100_000, 1)
    store.register_optimizer(SGDConfig(lr=0.0001))
    signs = np.arange(50_000, dtype=np.uint64)
    store.lookup(signs, 2, True)
    table: DimTable = store._tables[2]

    def at_home(q):
        g = np.take(table.index, ix.home_slots(ix.sign_hash(q), 1, table.M)).astype(np.int64)
        return table.signs_of_rows[g] == q

    hot = signs[~at_home(signs)][:2000]  # rows that lost their home slot to an older row
    assert len(hot) == 2000
    store.lookup(hot, 2, True)  # now more recently used than the rows in their home slots
    before = store.lookup(signs, 2, False)
    store.update(hot, np.ones((len(hot), 2), np.float32))
    assert store.stats()["index_promotions"] > 1500
    assert at_home(hot).mean() > 0.75
    after = store.lookup(signs, 2, False)  # every row still found, with the right value
    changed = np.isin(signs, hot)
    np.testing.assert_allclose(after[changed], before[changed] - 0.0001, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(after[~changed], before[~changed])


def test_concurrent_lookups_updates_and_growth():
    """Threads train disjoint ID sets (their final values are then known exactly) while others
    read; the store grows its regions meanwhile."""
    store = EmbeddingStore(200_000, 4)
    store.register_optimizer(SGDConfig(lr=0.5))
    errors: list[BaseException] = []
    sets = [np.arange(i * 1_000_000, i * 1_000_000 + 8000, dtype=np.uint64) for i in range(4)]
    steps = 6

    def trainer(signs):
        try:
            for _ in range(steps):
                for part in np.array_split(signs, 4):
                    store.lookup(part, 4, True)
                    store.update(part, np.ones((len(part), 4), np.float32))
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    def reader(stop):
        try:
            while not stop.is_set():
                out = store.lookup(np.concatenate(sets), 4, False)
                assert np.isfinite(out).all()
        except BaseException as exc:
            errors.append(exc)

    stop = threading.Event()
    readers = [threading.Thread(target=reader, args=(stop,)) for _ in range(2)]
    trainers = [threading.Thread(target=trainer, args=(s,)) for s in sets]
    for t in readers + trainers:
        t.start()
    for t in trainers:
        t.join(120)
    stop.set()
    for t in readers:
        t.join(120)
    assert not errors, errors
    everything = np.concatenate(sets)
    expected = np.clip(uniform_from_signs(everything, 4, -0.01, 0.01) - 0.5 * steps, -10, 10)
    np.testing.assert_allclose(store.lookup(everything, 4, False), expected, rtol=0, atol=1e-5)
    assert len(store) == len(everything)


def test_internal_hash_is_the_shared_mix64():
    signs = np.random.default_rng(0).integers(0, 2**64 - 1, 1000, dtype=np.uint64, endpoint=True)
    from persia.hashing import INTERNAL_SHARD_SALT, mix64

    np.testing.assert_array_equal(ix.sign_hash(signs), mix64(signs ^ np.uint64(INTERNAL_SHARD_SALT)))


def test_rebuilds_give_home_slots_to_the_most_recently_used_rows():
    store = EmbeddingStore(100_000, 1)
    signs = np.arange(40_000, dtype=np.uint64)
    store.lookup(signs, 2, True)
    recent = signs[1::2]
    store.lookup(recent, 2, True)
    table: DimTable = store._tables[2]
    table.rebuild_region(0)

    def at_home(q):
        g = np.take(table.index, ix.home_slots(ix.sign_hash(q), 1, table.M)).astype(np.int64)
        return (table.signs_of_rows[g] == q).mean()

    assert at_home(recent) > 0.93 and at_home(recent) > at_home(signs[::2]) + 0.05
    assert store.contains(signs, 2).all()
