"""The embedding worker's vectorized pipeline against a per-ID Python reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persia.embedding_worker import pipeline
from persia.embedding_worker.pipeline import SlotSpec, UnknownSlotError
from persia.hashing import add_index_prefix, hash_stack, shard_of

PREFIX_BIT = 8


def spec(name, dim, group, **kw):
    return SlotSpec(name=name, dim=dim, index_prefix=(group + 1) << (64 - PREFIX_BIT), **kw)


def csr(samples):
    values = np.concatenate([np.asarray(s, dtype=np.uint64) for s in samples]) if samples else np.empty(0, np.uint64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in samples])
    return values.astype(np.uint64), offsets


def row_of(sign, dim):
    """A deterministic fake PS row for a sign."""
    rng = np.random.default_rng(int(sign) % (2**32))
    return rng.standard_normal(dim).astype(np.float32)


def lookup_rows(batch):
    return {d: np.stack([row_of(s, d) for s in signs]) if signs.size else np.zeros((0, d), np.float32)
            for d, signs in batch.tables.items()}


samples_st = st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=6), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(a=samples_st, b_seed=st.integers(0, 1000), sqrt=st.booleans())
def test_sum_pooling_matches_reference(a, b_seed, sqrt):
    bs = len(a)
    rng = np.random.default_rng(b_seed)
    b = [list(rng.integers(0, 50, size=rng.integers(0, 4), dtype=np.uint64)) for _ in range(bs)]
    slots = {"a": spec("a", 4, 0, sqrt_scaling=sqrt), "b": spec("b", 4, 1)}
    va, oa = csr(a)
    vb, ob = csr(b)
    prepared = pipeline.prepare(
        [{"name": "a", "values": va, "offsets": oa}, {"name": "b", "values": vb, "offsets": ob}], bs, slots, PREFIX_BIT
    )
    pooled = pipeline.pool(prepared, lookup_rows(prepared))
    for out, samples, s in zip(pooled, (a, b), (slots["a"], slots["b"])):
        for i, ids in enumerate(samples):
            signs = add_index_prefix(np.asarray(ids, dtype=np.uint64), s.index_prefix, PREFIX_BIT)
            expect = sum((row_of(x, 4) for x in signs), np.zeros(4, np.float32))
            if s.sqrt_scaling and len(ids):
                expect = expect / np.sqrt(len(ids))
            np.testing.assert_allclose(out["emb"][i], expect, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(a=samples_st, seed=st.integers(0, 1000), sqrt=st.booleans())
def test_gradient_reduction_is_the_adjoint_of_pooling(a, seed, sqrt):
    """<pool(E), G> == <E, reduce(G)> for every E, G: the reduced gradient is exactly d(loss)/d(row)."""
    bs = len(a)
    slots = {"a": spec("a", 3, 0, sqrt_scaling=sqrt)}
    va, oa = csr(a)
    prepared = pipeline.prepare([{"name": "a", "values": va, "offsets": oa}], bs, slots, PREFIX_BIT)
    rng = np.random.default_rng(seed)
    rows = {3: rng.standard_normal((prepared.tables[3].size, 3)).astype(np.float32)}
    g = rng.standard_normal((bs, 3)).astype(np.float32)
    pooled = pipeline.pool(prepared, rows)[0]["emb"]
    reduced = pipeline.reduce_gradients(prepared, [g])
    lhs = float((pooled.astype(np.float64) * g).sum())
    rhs = float((rows[3].astype(np.float64) * reduced.grads[3]).sum())
    assert lhs == pytest.approx(rhs, rel=1e-4, abs=1e-4)
    # only signs that occur are touched (IDs folding onto one sign under the prefix count once)
    assert reduced.touched[3].sum() == np.unique(add_index_prefix(va, slots["a"].index_prefix, PREFIX_BIT)).size


def test_raw_slot_layout_and_gradients():
    slots = {"r": spec("r", 2, 0, embedding_summation=False, sample_fixed_size=2)}
    samples = [[5, 6, 7], [], [6]]  # 7 is past sample_fixed_size and dropped
    v, o = csr(samples)
    prepared = pipeline.prepare([{"name": "r", "values": v, "offsets": o}], 3, slots, PREFIX_BIT)
    rows = lookup_rows(prepared)
    out = pipeline.pool(prepared, rows)[0]
    distinct, index = out["distinct"], out["index"]
    assert distinct.shape == (3, 2)  # padding + {5, 6}
    np.testing.assert_array_equal(distinct[0], 0)
    assert index.shape == (3, 2)
    assert index[1].tolist() == [0, 0]
    signs = add_index_prefix(np.array([5, 6], np.uint64), slots["r"].index_prefix, PREFIX_BIT)
    np.testing.assert_allclose(distinct[index[0, 0]], row_of(signs[0], 2))
    np.testing.assert_allclose(distinct[index[0, 1]], row_of(signs[1], 2))
    np.testing.assert_allclose(distinct[index[2, 0]], row_of(signs[1], 2))
    grad = np.arange(6, dtype=np.float32).reshape(3, 2)
    reduced = pipeline.reduce_gradients(prepared, [grad])
    # 7 was dropped: its row is not touched, so no optimizer step is applied to it
    assert reduced.touched[2].sum() == 2


def test_hash_stack_expands_ids():
    slots = {"h": spec("h", 2, 0, hash_stack_rounds=2, hash_stack_embedding_size=10)}
    v, o = csr([[123], [456, 789]])
    prepared = pipeline.prepare([{"name": "h", "values": v, "offsets": o}], 2, slots, PREFIX_BIT)
    assert prepared.slots[0].offsets.tolist() == [0, 2, 6]
    buckets = hash_stack(v, 2, 10)
    assert (buckets[:, 0] < 10).all() and ((buckets[:, 1] >= 10) & (buckets[:, 1] < 20)).all()
    assert prepared.tables[2].size <= 6


def test_unknown_slot_and_bad_csr_are_rejected_with_names():
    slots = {"a": spec("a", 4, 0)}
    v, o = csr([[1]])
    with pytest.raises(UnknownSlotError, match="unknown slot 'nope': not in embedding_config.yml slots_config"):
        pipeline.validate_features([{"name": "nope", "values": v, "offsets": o}], 1, slots)
    with pytest.raises(ValueError, match="expected dtype uint64, got int64"):
        pipeline.validate_features([{"name": "a", "values": v.astype(np.int64), "offsets": o}], 1, slots)
    with pytest.raises(ValueError, match="expected batch size 2, got 1"):
        pipeline.validate_features([{"name": "a", "values": v, "offsets": o}], 2, slots)


def test_non_finite_gradient_skips_the_slot_only():
    slots = {"a": spec("a", 2, 0), "b": spec("b", 2, 1)}
    v, o = csr([[1], [2]])
    prepared = pipeline.prepare(
        [{"name": "a", "values": v, "offsets": o}, {"name": "b", "values": v, "offsets": o}], 2, slots, PREFIX_BIT
    )
    bad = np.array([[np.nan, 0], [0, 0]], np.float32)
    good = np.ones((2, 2), np.float32)
    reduced = pipeline.reduce_gradients(prepared, [bad, good])
    assert reduced.skipped_non_finite == ["a"]
    assert reduced.touched[2].sum() == 2  # only b's two signs


def test_split_by_shard_partitions_every_sign():
    signs = np.random.default_rng(0).integers(0, 2**63, size=1000, dtype=np.uint64)
    parts = pipeline.split_by_shard({8: signs}, 3)
    seen = np.concatenate([p[8] for p in parts if 8 in p])
    assert sorted(seen.tolist()) == list(range(1000))
    for s, p in enumerate(parts):
        assert (shard_of(signs[p[8]], 3) == s).all()


def test_one_id_per_sample_fast_path_matches_the_per_id_reference():
    """Single-ID slots (every sample one ID, as in Criteo-style data) pool by a plain gather and
    reduce all slots of a dim at once; repeated IDs within and across slots must still add up."""
    slots = {"a": spec("a", 3, 0, sqrt_scaling=True), "b": spec("b", 3, 1)}
    a, b = [[7], [7], [9], [7]], [[1], [2], [1], [1]]
    (va, oa), (vb, ob) = csr(a), csr(b)
    features = [{"name": "a", "values": va, "offsets": oa}, {"name": "b", "values": vb, "offsets": ob}]
    prepared = pipeline.prepare(features, 4, slots, PREFIX_BIT)
    assert all(s.one_per_sample for s in prepared.slots)
    rows = lookup_rows(prepared)
    pooled = pipeline.pool(prepared, rows)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(2)]
    reduced = pipeline.reduce_gradients(prepared, grads)
    expect = {}
    for out, samples, s, g in zip(pooled, (a, b), (slots["a"], slots["b"]), grads):
        for i, (x,) in enumerate(samples):
            sign = int(add_index_prefix(np.array([x], np.uint64), s.index_prefix, PREFIX_BIT)[0])
            np.testing.assert_allclose(out["emb"][i], row_of(sign, 3))
            expect[sign] = expect.get(sign, np.zeros(3)) + g[i]
    table = prepared.tables[3].tolist()
    assert reduced.touched[3].all() and len(table) == len(expect) == 4  # 7, 9 in a; 1, 2 in b
    for sign, total in expect.items():
        np.testing.assert_allclose(reduced.grads[3][table.index(sign)], total, rtol=1e-6, atol=1e-6)
    vr, or_ = csr([[1], [], [2, 1], [1]])  # same nnz as the batch size, but not one per sample
    ragged = pipeline.prepare([{"name": "b", "values": vr, "offsets": or_}], 4, slots, PREFIX_BIT)
    assert not ragged.slots[0].one_per_sample
