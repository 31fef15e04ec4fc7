"""The engine against a dict-based reference model on random sequences of lookups, updates and
evictions (several dims sharing the capacity, one or more internal shards)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persia.embedding_ps import EmbeddingStore, HyperParameters, SGDConfig

from .model import StoreModel

# edge-case signs on purpose: 0 (the sign stored in the engine's sentinel rows), all ones, top bit
UNIVERSE = np.array([0, 1, 2, 3, 2**63, 2**64 - 1, 2**64 - 2, 12345678901234567890]
                    + [i * 7919 + 11 for i in range(22)], dtype=np.uint64)
DIMS = (2, 5)
LR = 0.5
BOUND = 3.0
MAX_BATCH = 6

op = st.one_of(
    st.tuples(st.just("lookup"), st.sampled_from(DIMS), st.lists(st.integers(0, len(UNIVERSE) - 1), min_size=1, max_size=MAX_BATCH), st.booleans()),
    st.tuples(st.just("update"), st.sampled_from(DIMS), st.lists(st.integers(0, len(UNIVERSE) - 1), min_size=1, max_size=MAX_BATCH), st.integers(0, 2**16)),
)


def _run(ops, num_shards: int, per_shard: int) -> None:
    capacity = num_shards * per_shard
    store = EmbeddingStore(capacity, num_shards, evict_fraction=0.0)
    store.configure(HyperParameters(weight_bound=BOUND, init_lower=-1.0, init_upper=1.0))
    store.register_optimizer(SGDConfig(lr=LR))
    model = StoreModel(capacity, num_shards, LR, BOUND, lower=-1.0, upper=1.0)
    for kind, dim, picks, extra in ops:
        signs = UNIVERSE[picks]
        if kind == "lookup":
            expected = model.lookup(signs, dim, extra)
            got = store.lookup(signs, dim, extra)
            if extra:  # evictions happen during training lookups: learn which, check they were legal
                present = {(d, int(s)) for d in DIMS for s, ok in zip(UNIVERSE, store.contains(UNIVERSE, d)) if ok}
                model.reconcile_evictions(present)
            np.testing.assert_array_equal(got, expected)
        else:
            grads = np.random.default_rng(extra).standard_normal((len(signs), dim)).astype(np.float32)
            assert store.update(signs, grads) == model.update(signs, grads)
        for d in DIMS:  # the whole table, read without side effects
            np.testing.assert_array_equal(store.lookup(UNIVERSE, d, False), model.lookup(UNIVERSE, d, False))
    assert len(store) == len(model.rows)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=25), num_shards=st.sampled_from([1, 2, 3]),
       per_shard=st.integers(MAX_BATCH, 10))
def test_engine_matches_reference_model(ops, num_shards, per_shard):
    _run(ops, num_shards, per_shard)


def test_long_random_sequence_with_heavy_eviction():
    rng = np.random.default_rng(3)
    ops = []
    for _ in range(300):
        picks = rng.integers(0, len(UNIVERSE), rng.integers(1, MAX_BATCH + 1)).tolist()
        dim = int(rng.choice(DIMS))
        if rng.random() < 0.6:
            ops.append(("lookup", dim, picks, bool(rng.random() < 0.8)))
        else:
            ops.append(("update", dim, picks, int(rng.integers(0, 2**16))))
    _run(ops, num_shards=2, per_shard=MAX_BATCH)


def test_statistics_count_what_happened():
    store = EmbeddingStore(4, 1, evict_fraction=0.0)
    store.register_optimizer(SGDConfig(lr=0.1))
    signs = np.arange(6, dtype=np.uint64)
    store.lookup(signs[:4], 3, True)
    store.lookup(signs[4:], 3, True)  # two evictions
    missing = store.update(signs, np.ones((6, 3), np.float32))
    s = store.stats()
    assert (missing, s["evictions"], s["gradient_id_miss"], s["rows"]) == (2, 2, 2, 4)
    assert (s["lookup_ids"], s["index_miss"], s["inserted"], s["update_ids"]) == (6, 6, 6, 6)
    assert s["capacity"] == 4 and s["memory_bytes"] > 0


def test_the_store_runs_on_the_engine_path_under_test(engine_path):
    """conftest runs every engine test on both paths; make sure the switch reaches the store."""
    store = EmbeddingStore(10)
    assert store.use_kernel == (engine_path == "compiled")
    store.lookup(np.array([1, 2], np.uint64), 3, True)
    assert store._tables[3].use_kernel == store.use_kernel
