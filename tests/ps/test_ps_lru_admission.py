"""Capacity, batched LRU eviction and its guarantee, admission, inference lookups, initial values."""

from __future__ import annotations

import numpy as np
import pytest

from persia.embedding_ps import EmbeddingStore, HyperParameters, SGDConfig
from persia.embedding_ps import index as ix
from persia.embedding_ps.eviction import choose_victims
from persia.hashing import uniform_from_signs


def _shards(signs: np.ndarray, num_shards: int) -> np.ndarray:
    return ix.shard_ids(ix.sign_hash(signs), num_shards)


@pytest.mark.parametrize("num_shards, fraction", [(1, 1 / 8), (4, 1 / 16), (3, 1 / 64)])
def test_rows_used_in_recent_batches_are_never_evicted(num_shards, fraction):
    """Guarantee: a row read by one of the last N training lookups stays resident as long as those
    N lookups read at most C - B distinct rows of its shard (C shard capacity, B eviction batch)."""
    capacity = 600
    store = EmbeddingStore(capacity, num_shards, evict_fraction=fraction)
    bound = store.shard_capacity - store.evict_batch
    rng = np.random.default_rng(11)
    hot = np.arange(1000, 1100, dtype=np.uint64)  # a hot set reused often, plus a long cold stream
    history: list[np.ndarray] = []
    checked = 0
    for step in range(150):
        batch = np.concatenate([rng.choice(hot, 15), rng.integers(10**6, 10**9, 25).astype(np.uint64)])
        store.lookup(batch, 4, train=True)
        history.append(batch)
        per_shard: dict[int, set] = {k: set() for k in range(num_shards)}
        protected: set[int] = set()
        for past in reversed(history):  # widen the window while every shard stays within the bound
            grown = {k: set(v) for k, v in per_shard.items()}
            for s, k in zip(past.tolist(), _shards(past, num_shards).tolist()):
                grown[k].add(s)
            if any(len(v) > bound for v in grown.values()):
                break
            per_shard = grown
            protected.update(past.tolist())
        keys = np.array(sorted(protected), dtype=np.uint64)
        assert store.contains(keys, 4).all(), f"step {step}: a recently used row was evicted"
        checked += len(keys)
    assert store.stats()["evictions"] > 2000  # the cold stream did force evictions
    assert checked > 0 and len(store) <= capacity


def test_eviction_happens_in_batches_and_counts():
    store = EmbeddingStore(1000, 1, evict_fraction=0.1)
    store.lookup(np.arange(1000, dtype=np.uint64), 2, True)
    assert store.stats()["evictions"] == 0 and len(store) == 1000
    store.lookup(np.array([5000], np.uint64), 2, True)  # one new row frees a whole batch
    assert store.stats()["evictions"] == 100 and len(store) == 901
    for s in range(5001, 5099):
        store.lookup(np.array([s], np.uint64), 2, True)  # these fit without evicting again
    assert store.stats()["evictions"] == 100


def test_capacity_is_shared_by_all_dims():
    store = EmbeddingStore(10, 1, evict_fraction=0.0)
    store.lookup(np.arange(6, dtype=np.uint64), 8, True)
    store.lookup(np.arange(100, 104, dtype=np.uint64), 3, True)
    assert len(store) == 10
    store.lookup(np.arange(200, 202, dtype=np.uint64), 3, True)  # evicts the two oldest rows: dim 8
    assert len(store) == 10
    assert store.contains(np.arange(6, dtype=np.uint64), 8).sum() == 4
    assert store.contains(np.arange(100, 104, dtype=np.uint64), 3).all()


def test_choose_victims_takes_the_oldest_and_spares_the_current_call():
    stamps = [np.array([5, 0, 9, 2, 7], np.uint32), np.array([3, 9, 1], np.uint32)]
    got = choose_victims(stamps, goal=3, clock=9)
    assert [sorted(v.tolist()) for v in got] == [[3], [0, 2]]  # stamps 2, 3 and 1
    everything = choose_victims(stamps, goal=100, clock=9)
    assert [sorted(v.tolist()) for v in everything] == [[0, 3, 4], [0, 2]]  # never stamp 0 or 9


def test_a_batch_larger_than_a_shard_keeps_what_fits():
    store = EmbeddingStore(5, 1, evict_fraction=0.0)
    out = store.lookup(np.arange(8, dtype=np.uint64), 2, True)
    assert len(store) == 5 and store.stats()["capacity_rejected"] == 3
    assert (np.abs(out).sum(axis=1) > 0).sum() == 5  # rows that could not be kept read as zeros


def test_admit_probability():
    store = EmbeddingStore(100_000, 4, seed=5)
    store.configure(HyperParameters(admit_probability=0.3))
    signs = np.arange(1, 20_001, dtype=np.uint64)
    out = store.lookup(signs, 4, True)
    admitted = store.contains(signs, 4)
    assert 0.28 < admitted.mean() < 0.32
    np.testing.assert_array_equal(out[~admitted], 0.0)  # not admitted: zeros, nothing stored
    np.testing.assert_array_equal(out[admitted], uniform_from_signs(signs[admitted], 4, -0.01, 0.01))
    assert store.stats()["not_admitted"] == (~admitted).sum()
    store.lookup(signs, 4, True)  # each unseen ID gets another chance
    assert 0.48 < store.contains(signs, 4).mean() < 0.54


def test_initial_values_are_a_function_of_the_sign_only():
    hp = HyperParameters(init_lower=-0.2, init_upper=0.4)
    signs = np.array([0, 7, 2**64 - 1, 123456789], dtype=np.uint64)
    a = EmbeddingStore(2, 1, seed=1, evict_fraction=0.0)
    b = EmbeddingStore(1000, 5, seed=2)
    a.configure(hp)
    b.configure(hp)
    first = a.lookup(signs[:2], 6, True)
    a.lookup(signs[2:], 6, True)  # evicts the first two
    assert not a.contains(signs[:2], 6).any()
    np.testing.assert_array_equal(a.lookup(signs[:2], 6, True), first)  # re-created identically
    np.testing.assert_array_equal(b.lookup(signs, 6, True), uniform_from_signs(signs, 6, -0.2, 0.4))
    assert (first >= -0.2).all() and (first < 0.4).all()


def test_inference_lookups_never_create_and_never_refresh():
    store = EmbeddingStore(4, 1, evict_fraction=0.0)
    store.register_optimizer(SGDConfig(lr=1.0))
    old = np.array([1, 2], dtype=np.uint64)
    store.lookup(old, 3, True)
    store.lookup(np.array([3, 4], dtype=np.uint64), 3, True)
    unseen = np.array([77, 1], dtype=np.uint64)
    out = store.lookup(unseen, 3, False)
    np.testing.assert_array_equal(out[0], 0.0)
    assert len(store) == 4 and not store.contains(unseen[:1], 3).any()
    assert store.lookup(np.array([1], np.uint64), 9, False).shape == (1, 9)  # an unknown dim: zeros
    for _ in range(3):
        store.lookup(old, 3, False)  # reading the oldest rows for inference does not save them
    store.lookup(np.array([5, 6], dtype=np.uint64), 3, True)
    assert not store.contains(old, 3).any()
    assert store.contains(np.array([3, 4, 5, 6], dtype=np.uint64), 3).all()


def test_updates_to_missing_rows_are_counted_not_errors():
    store = EmbeddingStore(10)
    store.register_optimizer(SGDConfig(lr=1.0))
    assert store.update(np.array([1, 2], np.uint64), np.ones((2, 4), np.float32)) == 2
    assert store.stats()["gradient_id_miss"] == 2 and len(store) == 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.lookup(np.array([[1]], np.uint64), 2, True), r"signs must be a 1-D array"),
        (lambda s: s.lookup(np.array([-1]), 2, True), r"signs must be non-negative IDs, got -1"),
        (lambda s: s.lookup(np.array([1.5]), 2, True), r"signs must hold unsigned 64-bit integer IDs, got dtype float64"),
        (lambda s: s.lookup(np.array([1], np.uint64), 0, True), r"dim must be an integer in \[1, 65536\], got 0"),
        (lambda s: s.update(np.array([1], np.uint64), np.ones((2, 3), np.float32)), r"grads must have shape \(len\(signs\)=1, dim\), got \(2, 3\)"),
        (lambda s: s.update(np.array([1], np.uint64), np.ones((1, 3), np.int32)), r"grads must be floating point, got dtype int32"),
    ],
)
def test_bad_input_names_the_field_and_value(call, match):
    store = EmbeddingStore(10)
    store.register_optimizer(SGDConfig(lr=1.0))
    store.lookup(np.array([1], np.uint64), 3, True)
    with pytest.raises(ValueError, match=match):
        call(store)
    assert len(store) == 1  # nothing stored was lost


def test_hyperparameters_validation_names_fields():
    with pytest.raises(ValueError, match="init_lower 0.5 > init_upper 0.1"):
        HyperParameters(init_lower=0.5, init_upper=0.1)
    with pytest.raises(ValueError, match="admit_probability"):
        HyperParameters(admit_probability=0)
    with pytest.raises(ValueError, match="weight_bound"):
        HyperParameters(weight_bound=-1)
    with pytest.raises(ValueError, match="learning_rate"):
        HyperParameters(learning_rate=1)


def test_clock_rebase_keeps_the_lru_order(monkeypatch):
    import persia.embedding_ps.store as store_module

    monkeypatch.setattr(store_module, "_CLOCK_LIMIT", 60)
    monkeypatch.setattr(store_module, "_CLOCK_KEEP", 10)
    store = EmbeddingStore(10, 1, evict_fraction=0.0)
    for step in range(200):  # the clock passes the limit several times
        store.lookup(np.array([step % 30], np.uint64), 2, True)
    assert store._clock < 60
    recent = np.array([s % 30 for s in range(190, 200)], np.uint64)
    assert store.contains(recent, 2).all() and len(store) == 10
    store.lookup(np.array([999], np.uint64), 2, True)
    assert not store.contains(np.array([190 % 30], np.uint64), 2).any()  # the oldest went first
