"""The embedding worker's vectorized pipeline and the NN's tensors built from its lookup reply,
against a per-ID Python reference (what the model receives, and the gradient each distinct ID
gets, equal the old per-slot pooling and gradient reduction)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from persia.embedding_worker import pipeline
from persia.embedding_worker.pipeline import SlotSpec, UnknownSlotError
from persia.hashing import add_index_prefix, hash_stack, shard_of
from persia.nn_worker import embedding_tensors

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


def signs_of(ids, s):
    return add_index_prefix(np.asarray(ids, dtype=np.uint64), s.index_prefix, PREFIX_BIT)


def run(features, bs, slots, upstream=None, unused=()):
    """Worker lookup -> NN tensors -> backward of sum(emb_i * upstream_i) -> worker's checked grads."""
    prepared = pipeline.prepare(features, bs, slots, PREFIX_BIT)
    reply = pipeline.lookup_reply(prepared, lookup_rows(prepared))
    built = embedding_tensors.build(reply["tables"], reply["slots"], "cpu", requires_grad=upstream is not None)
    checked = None
    if upstream is not None:
        loss = sum((e * torch.from_numpy(g)).sum() for i, (e, g) in enumerate(zip(built.emb, upstream))
                   if i not in unused)
        loss.backward()
        grads = [None if leaf.grad is None else leaf.grad.numpy() for leaf in built.leaves]
        unused_slots = [i for i, u in enumerate(built.used) if not u]
        checked = pipeline.check_gradients(prepared, grads, 1.0, unused_slots)
    return prepared, [e.detach().numpy() for e in built.emb], checked


def reference_sum(samples, s):
    """Per-ID reference of one summed slot: (pooled tensor, sample -> list of (sign, factor))."""
    out, occ = [], []
    for ids in samples:
        signs = signs_of(ids, s)
        f = 1.0 / np.sqrt(len(ids)) if s.sqrt_scaling and len(ids) else 1.0
        out.append(sum((row_of(x, s.dim) for x in signs), np.zeros(s.dim, np.float32)) * np.float32(f))
        occ.append([(int(x), f) for x in signs])
    return np.stack(out), occ


def grad_of_sign(prepared, checked, dim, sign):
    table = prepared.tables[dim].tolist()
    return checked.grads[dim][table.index(sign)]


samples_st = st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=6), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(a=samples_st, b_seed=st.integers(0, 1000), sqrt=st.booleans())
def test_sum_pooling_and_gradients_match_the_per_id_reference(a, b_seed, sqrt):
    bs = len(a)
    rng = np.random.default_rng(b_seed)
    b = [list(rng.integers(0, 50, size=rng.integers(0, 4), dtype=np.uint64)) for _ in range(bs)]
    slots = {"a": spec("a", 4, 0, sqrt_scaling=sqrt), "b": spec("b", 4, 1)}
    (va, oa), (vb, ob) = csr(a), csr(b)
    features = [{"name": "a", "values": va, "offsets": oa}, {"name": "b", "values": vb, "offsets": ob}]
    upstream = [rng.standard_normal((bs, 4)).astype(np.float32) for _ in range(2)]
    prepared, emb, checked = run(features, bs, slots, upstream)
    expect: dict[int, np.ndarray] = {}  # the old reduction: each occurrence's gradient into its sign
    for out, samples, s, g in zip(emb, (a, b), (slots["a"], slots["b"]), upstream):
        ref, occ = reference_sum(samples, s)
        assert out.shape == (bs, 4) and out.dtype == np.float32
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        for i, pairs in enumerate(occ):
            for sign, f in pairs:
                expect[sign] = expect.get(sign, np.zeros(4)) + g[i] * f
    assert checked.touched[4] is None  # every row occurs in a used slot
    assert len(expect) == prepared.tables[4].size
    for sign, total in expect.items():
        np.testing.assert_allclose(grad_of_sign(prepared, checked, 4, sign), total, rtol=1e-4, atol=1e-5)


def test_one_id_per_sample_slots_gather_together_and_add_up_repeats():
    """Single-ID slots (Criteo-style) are one gather per dim; repeated IDs within and across
    slots must still add up, and mixed dims keep their own tables."""
    slots = {"a": spec("a", 3, 0, sqrt_scaling=True), "b": spec("b", 3, 1), "c": spec("c", 2, 2),
             "d": spec("d", 3, 1)}  # d: ragged, in b's feature group (shares its signs)
    a, b, c, d = [[7], [7], [9], [7]], [[1], [2], [1], [1]], [[4], [4], [4], [5]], [[1, 2], [], [2], [8]]
    features = [{"name": n, "values": v, "offsets": o} for n, (v, o) in zip("abcd", map(csr, (a, b, c, d)))]
    rng = np.random.default_rng(0)
    upstream = [rng.standard_normal((4, s.dim)).astype(np.float32) for s in slots.values()]
    prepared, emb, checked = run(features, 4, slots, upstream)
    assert [s.one_per_sample for s in prepared.slots] == [True, True, True, False]
    assert list(prepared.tables) == [3, 2] and prepared.tables[3].size == 5 and prepared.tables[2].size == 2
    expect: dict[int, np.ndarray] = {}
    for out, samples, s, g in zip(emb, (a, b, c, d), slots.values(), upstream):
        ref, occ = reference_sum(samples, s)
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
        for i, pairs in enumerate(occ):
            for sign, f in pairs:
                expect[sign] = expect.get(sign, np.zeros(s.dim)) + g[i] * f
    for sign, total in expect.items():
        dim = 2 if sign in prepared.tables[2].tolist() else 3
        np.testing.assert_allclose(grad_of_sign(prepared, checked, dim, sign), total, rtol=1e-6, atol=1e-6)
    reply = pipeline.lookup_reply(prepared, lookup_rows(prepared))
    assert [t["gather"].shape for t in reply["tables"]] == [(2, 4), (1, 4)]  # one index per dim
    assert [e.get("gather") for e in reply["slots"]] == [0, 1, 0, None]
    ragged = pipeline.prepare([{"name": "b", "values": csr([[1], [], [2, 1], [1]])[0],
                                "offsets": csr([[1], [], [2, 1], [1]])[1]}], 4, slots, PREFIX_BIT)
    assert not ragged.slots[0].one_per_sample  # same nnz as the batch size, but not one per sample


def test_raw_slot_tensor_mask_and_gradients():
    slots = {"r": spec("r", 2, 0, embedding_summation=False, sample_fixed_size=2), "s": spec("s", 2, 1)}
    samples = [[5, 6, 7], [], [6]]  # 7 is past sample_fixed_size and dropped
    (v, o), (vs, os_) = csr(samples), csr([[1], [1], [2]])
    features = [{"name": "r", "values": v, "offsets": o}, {"name": "s", "values": vs, "offsets": os_}]
    upstream = [np.arange(18, dtype=np.float32).reshape(3, 2, 3), np.ones((3, 2), np.float32)]
    prepared, emb, checked = run(features, 3, slots, upstream)
    raw = emb[0]
    assert raw.shape == (3, 2, 3) and raw.dtype == np.float32  # (bs, sample_fixed_size, dim + mask)
    s5, s6, s7 = (int(x) for x in signs_of([5, 6, 7], slots["r"]))
    np.testing.assert_array_equal(raw[0, 0], np.append(row_of(s5, 2), 1))
    np.testing.assert_array_equal(raw[0, 1], np.append(row_of(s6, 2), 1))
    np.testing.assert_array_equal(raw[1], 0)  # padding: zero rows, mask 0
    np.testing.assert_array_equal(raw[2, 0], np.append(row_of(s6, 2), 1))
    np.testing.assert_array_equal(raw[2, 1], 0)
    np.testing.assert_allclose(grad_of_sign(prepared, checked, 2, s5), upstream[0][0, 0, :2])
    np.testing.assert_allclose(grad_of_sign(prepared, checked, 2, s6), upstream[0][0, 1, :2] + upstream[0][2, 0, :2])
    # 7 was dropped: its row gets no update at all (not even a zero gradient)
    mask = checked.touched[2]
    table = prepared.tables[2].tolist()
    assert not mask[table.index(s7)] and mask.sum() == len(table) - 1
    parts = pipeline.split_gradients(prepared.tables, pipeline.split_by_shard(prepared.tables, 1), checked)
    assert s7 not in parts[0][0]["signs"].tolist() and len(parts[0][0]["signs"]) == len(table) - 1


def test_raw_slot_tensor_can_be_modified_in_place_in_training():
    """A raw slot's tensor was never a view: a model that scales it in place still trains."""
    slots = {"r": spec("r", 2, 0, embedding_summation=False, sample_fixed_size=2)}
    v, o = csr([[5, 6], [6]])
    prepared = pipeline.prepare([{"name": "r", "values": v, "offsets": o}], 2, slots, PREFIX_BIT)
    reply = pipeline.lookup_reply(prepared, lookup_rows(prepared))
    built = embedding_tensors.build(reply["tables"], reply["slots"], "cpu", requires_grad=True)
    built.emb[0].mul_(2.0)
    built.emb[0].sum().backward()
    assert built.used == [True]
    np.testing.assert_array_equal(built.leaves[0].grad.numpy(), [[2, 2], [4, 4]])  # 5 once, 6 twice


def test_raw_hash_stack_sqrt_scaling_scales_rows_not_the_mask():
    slots = {"r": spec("r", 2, 0, embedding_summation=False, sample_fixed_size=4, sqrt_scaling=True,
                       hash_stack_rounds=4, hash_stack_embedding_size=100)}
    v, o = csr([[11], [12]])
    prepared, emb, _ = run([{"name": "r", "values": v, "offsets": o}], 2, slots)
    buckets = hash_stack(v, 4, 100)
    for i in range(2):
        for k in range(4):
            sign = int(signs_of([buckets[i, k]], slots["r"])[0])
            np.testing.assert_allclose(emb[0][i, k, :2], row_of(sign, 2) * np.float32(0.5), rtol=1e-6)
    np.testing.assert_array_equal(emb[0][:, :, 2], 1)


def test_hash_stack_expands_ids():
    slots = {"h": spec("h", 2, 0, hash_stack_rounds=2, hash_stack_embedding_size=10)}
    v, o = csr([[123], [456, 789]])
    prepared = pipeline.prepare([{"name": "h", "values": v, "offsets": o}], 2, slots, PREFIX_BIT)
    assert prepared.slots[0].offsets.tolist() == [0, 2, 6]
    buckets = hash_stack(v, 2, 10)
    assert (buckets[:, 0] < 10).all() and ((buckets[:, 1] >= 10) & (buckets[:, 1] < 20)).all()
    assert prepared.tables[2].size <= 6


def test_unused_slot_rows_get_no_update_unless_shared():
    """A slot the model does not use gets no gradient (PERSIA skips it); a row it shares with a
    used slot of the same dim is still updated."""
    slots = {"a": spec("a", 2, 0), "b": spec("b", 2, 0)}  # one feature group: shared signs
    (va, oa), (vb, ob) = csr([[1], [2]]), csr([[2], [3]])
    features = [{"name": "a", "values": va, "offsets": oa}, {"name": "b", "values": vb, "offsets": ob}]
    upstream = [np.ones((2, 2), np.float32)] * 2
    prepared, _, checked = run(features, 2, slots, upstream, unused={1})
    table = prepared.tables[2].tolist()
    s1, s2, s3 = (int(x) for x in signs_of([1, 2, 3], slots["a"]))
    assert [bool(checked.touched[2][table.index(s)]) for s in (s1, s2, s3)] == [True, True, False]
    np.testing.assert_allclose(grad_of_sign(prepared, checked, 2, s2), [1, 1])


def test_unknown_slot_and_bad_csr_are_rejected_with_names():
    slots = {"a": spec("a", 4, 0), "b": spec("b", 4, 0)}
    v, o = csr([[1]])
    with pytest.raises(UnknownSlotError, match="unknown slot 'nope': not in embedding_config.yml slots_config"):
        pipeline.validate_features([{"name": "nope", "values": v, "offsets": o}], 1, slots)
    with pytest.raises(ValueError, match="ID feature 'a': values must be 1-D uint64, got dtype int64"):
        pipeline.validate_features([{"name": "a", "values": v.astype(np.int64), "offsets": o}], 1, slots)
    with pytest.raises(ValueError, match=r"ID feature 'a': offsets must be integers of shape \(3,\) "
                                         r"\(batch size 2\), got dtype int64 shape \(2,\)"):
        pipeline.validate_features([{"name": "a", "values": v, "offsets": o}], 2, slots)
    with pytest.raises(ValueError, match="ID feature 'a' appears twice"):
        pipeline.validate_features([{"name": "a", "values": v, "offsets": o}] * 2, 1, slots)


def packed(**change):
    """A valid packed record of three features (a: two samples' CSR, s: single-ID, b: CSR), batch 2,
    with ``change`` applied."""
    rec = {"names": ["a", "s", "b"], "single": np.array([False, True, False]),
           "values": np.arange(1, 8, dtype=np.uint64),  # a: [1], [2, 3]; s: 4, 5; b: [], [6, 7]
           "offsets": np.array([[0, 1, 3], [0, 0, 2]], dtype=np.int64)}
    rec.update(change)
    return rec


def test_packed_features_unpack_to_each_features_ids_without_copies():
    slots = {n: spec(n, 4, 0) for n in "asb"}
    rec = packed()
    got = pipeline.validate_features(rec, 2, slots)
    a, s, b = (got.feature(i) for i in range(3))
    assert a[0].tolist() == [1, 2, 3] and a[1].tolist() == [0, 1, 3]
    assert s[0].tolist() == [4, 5] and s[1] is None
    assert b[0].tolist() == [6, 7] and b[1].tolist() == [0, 0, 2]
    assert np.shares_memory(b[0], rec["values"])
    assert pipeline.num_ids(rec) == 7
    # the per-feature form and the packed record give the same lookup
    per_feature = [{"name": "a", "values": a[0], "offsets": a[1]},
                   {"name": "s", "values": s[0], "offsets": np.arange(3)},
                   {"name": "b", "values": b[0], "offsets": b[1]}]
    one, two = pipeline.prepare(rec, 2, slots, PREFIX_BIT), pipeline.prepare(per_feature, 2, slots, PREFIX_BIT)
    assert [t.tolist() for t in one.tables.values()] == [t.tolist() for t in two.tables.values()]
    assert [x.one_per_sample for x in one.slots] == [x.one_per_sample for x in two.slots] == [False, True, False]
    assert all((x.table_inverse == y.table_inverse).all() for x, y in zip(one.slots, two.slots))


@pytest.mark.parametrize("change, message", [
    ({"single": np.array([False, True])}, r"field 'single': expected a bool array of shape \(3,\)"),
    ({"single": np.array([0, 1, 0], np.uint8)}, "field 'single': expected a bool array"),
    ({"values": np.arange(7, dtype=np.int64)}, "field 'values': expected 1-D uint64 IDs, got dtype int64"),
    ({"values": np.arange(6, dtype=np.uint64)}, "features' sizes add up to 7 IDs .* but 6 IDs were sent"),
    ({"offsets": np.array([[0, 1, 3]])}, r"field 'offsets': expected integers of shape \(2, 3\)"),
    ({"offsets": np.array([[0, 1, 3], [1, 1, 2]])}, "ID feature 'b': offsets must start at 0, got 1"),
    ({"offsets": np.array([[0, 3, 1], [0, 0, 2]])},
     r"ID feature 'a': offsets must be non-decreasing, but offsets\[2\] = 1 < offsets\[1\] = 3"),
    ({"offsets": np.array([[0, 1, 3], [0, 0, 2**62]])}, "ID feature 'b': offsets end at 4611686018427387904, past"),
    ({"offsets": np.array([[0, 1, 3], [0, 0, 2**63]], dtype=np.uint64)}, "overflow int64"),
])
def test_malformed_packed_features_are_refused_naming_field_feature_and_value(change, message):
    slots = {n: spec(n, 4, 0) for n in "asb"}
    with pytest.raises(ValueError, match=message):
        pipeline.validate_features(packed(**change), 2, slots)
    with pytest.raises(ValueError, match=message):  # a direct lookup checks the same way
        pipeline.prepare(packed(**change), 2, slots, PREFIX_BIT)


def test_malformed_gradients_are_refused_naming_field_and_value():
    slots = {"a": spec("a", 2, 0), "b": spec("b", 3, 1)}
    (v, o) = csr([[1], [2]])
    prepared = pipeline.prepare([{"name": "a", "values": v, "offsets": o}, {"name": "b", "values": v, "offsets": o}],
                                2, slots, PREFIX_BIT)
    good = [np.zeros((2, 2), np.float32), np.zeros((2, 3), np.float32)]
    with pytest.raises(ValueError, match=r"field 'grads\[1\]': expected shape \(2, 3\) .*dim 3.*got \(2, 2\)"):
        pipeline.check_gradients(prepared, [good[0], good[0]])
    with pytest.raises(ValueError, match=r"field 'grads': expected 2 per-dim gradients \(dims \[2, 3\]\), got 1"):
        pipeline.check_gradients(prepared, good[:1])
    with pytest.raises(ValueError, match=r"field 'unused_slots': slot position 5 out of range 0..1"):
        pipeline.check_gradients(prepared, good, unused_slots=[5])
    checked = pipeline.check_gradients(prepared, [good[0], None], scale=4.0)
    assert set(checked.grads) == {2}  # a dim without gradient sends nothing


def test_non_finite_gradient_skips_its_dim_only_and_names_its_slots():
    slots = {"a": spec("a", 2, 0), "a2": spec("a2", 2, 2), "b": spec("b", 3, 1)}
    v, o = csr([[1], [2]])
    prepared = pipeline.prepare([{"name": n, "values": v, "offsets": o} for n in slots], 2, slots, PREFIX_BIT)
    bad = np.zeros((prepared.tables[2].size, 2), np.float32)
    bad[0, 1] = np.nan
    good = np.full((2, 3), 8.0, np.float32)
    checked = pipeline.check_gradients(prepared, [bad, good], scale=2.0)
    assert checked.skipped_non_finite == ["a", "a2"]
    assert set(checked.grads) == {3}
    np.testing.assert_array_equal(checked.grads[3], 4.0)  # the loss scale undone


def test_split_by_shard_partitions_every_sign():
    signs = np.random.default_rng(0).integers(0, 2**63, size=1000, dtype=np.uint64)
    parts = pipeline.split_by_shard({8: signs}, 3)
    seen = np.concatenate([p[8] for p in parts if 8 in p])
    assert sorted(seen.tolist()) == list(range(1000))
    for s, p in enumerate(parts):
        assert (shard_of(signs[p[8]], 3) == s).all()


@pytest.mark.parametrize("shards", [1, 3])
def test_rows_and_gradients_travel_to_and_from_the_right_replica(shards):
    rng = np.random.default_rng(1)
    tables = {4: np.unique(rng.integers(0, 2**63, size=300, dtype=np.uint64)), 2: np.empty(0, np.uint64)}
    positions = pipeline.split_by_shard(tables, shards)
    truth = {d: rng.standard_normal((s.size, d)).astype(np.float32) for d, s in tables.items()}
    replies = [[truth[d][p] for d, p in part.items()] if part else None for part in positions]
    rows = pipeline.assemble_rows(tables, positions, replies)
    np.testing.assert_array_equal(rows[4], truth[4])
    assert rows[2].shape == (0, 2)
    touched = rng.random(tables[4].size) < 0.5
    checked = pipeline.DimGradients(grads={4: truth[4]}, touched={4: touched}, skipped_non_finite=[])
    sent = {}
    for s, reqs in enumerate(pipeline.split_gradients(tables, positions, checked)):
        for r in reqs:
            assert (shard_of(r["signs"], shards) == s).all()
            sent.update({int(x): g for x, g in zip(r["signs"], r["grads"])})
    assert sorted(sent) == sorted(tables[4][touched].tolist())
    for i in np.flatnonzero(touched):
        np.testing.assert_array_equal(sent[int(tables[4][i])], truth[4][i])


@pytest.mark.parametrize("shards", [1, 3])
def test_the_replay_part_of_a_reply_puts_each_replicas_answer_on_its_rows(shards):
    """State, replica, absent rows and applied seqs, from per-replica answers back in table order."""
    rng = np.random.default_rng(2)
    tables = {4: np.unique(rng.integers(0, 2**63, size=200, dtype=np.uint64)), 2: np.empty(0, np.uint64),
              3: np.unique(rng.integers(0, 2**63, size=50, dtype=np.uint64))}
    positions = pipeline.split_by_shard(tables, shards)
    state = {d: rng.standard_normal((s.size, 5)).astype(np.float32) for d, s in tables.items()}
    gone = {d: rng.random(s.size) < 0.1 for d, s in tables.items()}
    replies = []
    for s, part in enumerate(positions):
        if not part:
            replies.append(None)
            continue
        replies.append({"state": [state[d][p] for d, p in part.items()],
                        "absent": [np.flatnonzero(gone[d][p]).astype(np.int32) for d, p in part.items()],
                        "applied": [np.array([10 + s, 20 + s], dtype=np.int64) for _ in part]})
    out = pipeline.replay_reply(tables, positions, replies)
    assert out["replicas"] == shards and len(out["tables"]) == len(tables)
    for entry, (d, signs) in zip(out["tables"], tables.items()):
        np.testing.assert_array_equal(entry["signs"], signs)
        assert entry["state"].shape == (signs.size, 5 if signs.size else 0)
        if signs.size:
            np.testing.assert_array_equal(entry["state"], state[d])
        np.testing.assert_array_equal(entry["replica"], shard_of(signs, shards))
        np.testing.assert_array_equal(entry["absent"], np.flatnonzero(gone[d]))
        for s in range(shards):
            owns = d in positions[s]
            expect = [10 + s, 20 + s] if owns else []
            assert entry["applied"][s].tolist() == expect


@pytest.mark.parametrize("requires_grad", [True, False])
def test_patched_tensors_equal_tensors_built_from_the_changed_rows(requires_grad):
    """Own-update replay corrects rows after the lookup thread built the tensors: patching them at
    the changed rows gives what building from the corrected rows gives, to the bit, and the same
    gradients."""
    rng = np.random.default_rng(5)
    slots = {"u": spec("u", 4, 0), "v": spec("v", 4, 1), "bag": spec("bag", 4, 2, sqrt_scaling=True),
             "raw": spec("raw", 3, 3, embedding_summation=False, sample_fixed_size=2),
             "other": spec("other", 2, 4)}
    bs = 16
    feats = []
    for name in ("u", "v", "other"):
        feats.append({"name": name, "values": rng.integers(0, 6, bs).astype(np.uint64),
                      "offsets": np.arange(bs + 1, dtype=np.int64)})
    for name in ("bag", "raw"):
        v, o = csr([rng.integers(0, 5, rng.integers(0, 4)).tolist() for _ in range(bs)])
        feats.append({"name": name, "values": v, "offsets": o})
    prepared = pipeline.prepare(feats, bs, slots, PREFIX_BIT)
    reply = pipeline.lookup_reply(prepared, lookup_rows(prepared))
    fixed = [dict(t) for t in reply["tables"]]
    changed = []
    for t in fixed:
        n = t["rows"].shape[0]
        pick = np.flatnonzero(rng.random(n) < 0.4)
        t["rows"] = t["rows"].copy()
        t["rows"][pick] += rng.standard_normal((pick.size, t["dim"])).astype(np.float32)
        changed.append(pick)
    patched = embedding_tensors.build(reply["tables"], reply["slots"], "cpu", requires_grad)
    for i, (t, pick) in enumerate(zip(fixed, changed)):
        embedding_tensors.patch(patched, i, t["rows"], pick)
    fresh = embedding_tensors.build(fixed, reply["slots"], "cpu", requires_grad)
    for a, b in zip(patched.emb, fresh.emb):
        np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())
    for a, b in zip(patched.leaves, fresh.leaves):
        np.testing.assert_array_equal(a.detach().numpy(), b.detach().numpy())
    if requires_grad:
        weights = [torch.from_numpy(rng.standard_normal(tuple(e.shape)).astype(np.float32)) for e in fresh.emb]
        for built in (patched, fresh):
            sum((e * w).sum() for e, w in zip(built.emb, weights)).backward()
        for a, b in zip(patched.leaves, fresh.leaves):
            np.testing.assert_array_equal(a.grad.numpy(), b.grad.numpy())
        assert patched.used == fresh.used == [True] * len(slots)
