"""Own-update replay on the NN side (persia.nn_worker.replay).

``applied_tables`` against the embedding worker's own ``check_gradients`` + ``split_gradients`` on
real ``prepare`` / ``lookup_reply`` output; ``correct_table`` against real PS stores (compiled
kernel and pure numpy) that apply the updates before a fresh read; ``UpdateHistory``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persia.embedding_ps import (
    AdagradConfig,
    AdamConfig,
    EmbeddingStore,
    HyperParameters,
    SGDConfig,
    kernels,
)
from persia.embedding_ps.optimizers import apply_step, initial_state_value, state_width
from persia.embedding_worker import pipeline
from persia.embedding_worker.pipeline import SlotSpec
from persia.hashing import shard_of
from persia.nn_worker.replay import SentUpdate, UpdateHistory, applied_tables, correct_table
from tests.ticker import Ticker

PREFIX_BIT = 8


# -- applied_tables ------------------------------------------------------------------------------
def _spec(name, dim, group, **kw):
    return SlotSpec(name=name, dim=dim, index_prefix=(group + 1) << (64 - PREFIX_BIT), **kw)


SLOTS = {  # a and r share a feature group (and so signs): a row dropped in r may be kept through a
    "a": _spec("a", 4, 0, sqrt_scaling=True),
    "b": _spec("b", 4, 1),  # sent one ID per sample
    "r": _spec("r", 4, 0, embedding_summation=False, sample_fixed_size=2),
    "c": _spec("c", 8, 2),
    "d": _spec("d", 8, 3),  # one ID per sample
    "h": _spec("h", 8, 4, hash_stack_rounds=2, hash_stack_embedding_size=50),
    "e": _spec("e", 2, 5, embedding_summation=False, sample_fixed_size=3, sqrt_scaling=True),
    "f": _spec("f", 2, 5),
    "u": _spec("u", 16, 6),  # one ID per sample, alone in its dim
}
ONE_ID = {"b", "d", "u"}


def _batch(rng, names, bs):
    features = []
    for name in names:
        if name in ONE_ID:
            values = rng.integers(0, 12, size=bs).astype(np.uint64)
            offsets = np.arange(bs + 1, dtype=np.int64)
        else:
            lengths = rng.integers(0, 5, size=bs)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            values = rng.integers(0, 15, size=int(offsets[-1])).astype(np.uint64)
        features.append({"name": name, "values": values, "offsets": offsets})
    return features


def _grads(rng, tables):
    """Per-dim gradients: some None (no gradient), some with a NaN or inf (the dim is dropped)."""
    out = []
    for d, signs in tables.items():
        if rng.random() < 0.1:
            out.append(None)
            continue
        g = (rng.standard_normal((signs.size, d)) * 100).astype(np.float32)
        if g.size and rng.random() < 0.2:
            g.flat[rng.integers(g.size)] = rng.choice([np.nan, np.inf, -np.inf])
        out.append(g)
    return out


def _reference(prepared, grads, scale, unused, replicas):
    """What the PS replicas receive, per dim, concatenated and sorted by sign."""
    checked = pipeline.check_gradients(prepared, grads, scale, unused)
    positions = pipeline.split_by_shard(prepared.tables, replicas)
    per_dim: dict[int, list] = {}
    for reqs in pipeline.split_gradients(prepared.tables, positions, checked):
        for r in reqs:
            per_dim.setdefault(r["dim"], []).append((r["signs"], r["grads"]))
    out = {}
    for d, parts in per_dim.items():
        signs = np.concatenate([s for s, _ in parts])
        grads = np.concatenate([g for _, g in parts])
        order = np.argsort(signs)
        out[d] = (signs[order], grads[order])
    return out, checked


def _nn_copy(prepared, reply):
    """The NN's copy of the reply: each table entry also carries its signs (read-only, as off the wire)."""
    tables = []
    for t in reply["tables"]:
        signs = prepared.tables[t["dim"]].copy()
        signs.flags.writeable = False
        tables.append({**t, "signs": signs})
    return tables


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for d in want:
        np.testing.assert_array_equal(got[d][0], want[d][0])
        assert got[d][0].dtype == np.uint64
        assert got[d][1].dtype == np.float32
        np.testing.assert_array_equal(got[d][1], want[d][1])  # the same float32 multiply: bit for bit


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), replicas=st.integers(1, 3), scale=st.sampled_from([1.0, 1024.0, 3.0, 0.5]))
def test_applied_tables_equal_what_the_embedding_worker_sends(seed, replicas, scale):
    rng = np.random.default_rng(seed)
    names = [n for n in SLOTS if rng.random() < 0.8] or ["a"]
    rng.shuffle(names)
    bs = int(rng.integers(1, 9))
    prepared = pipeline.prepare(_batch(rng, names, bs), bs, SLOTS, PREFIX_BIT)
    reply = pipeline.lookup_reply(prepared, {d: np.zeros((s.size, d), np.float32) for d, s in prepared.tables.items()})
    grads = _grads(rng, prepared.tables)
    unused = sorted(int(k) for k in np.flatnonzero(rng.random(len(names)) < 0.3))
    want, _ = _reference(prepared, grads, scale, unused, replicas)
    _assert_same(applied_tables(_nn_copy(prepared, reply), reply["slots"], grads, scale, unused), want)


def test_applied_tables_cover_drops_unused_slots_and_non_finite_dims():
    """Each rule once on a batch built by hand (the random test above may hit them by chance)."""
    slots = {"a": _spec("a", 4, 0), "r": _spec("r", 4, 0, embedding_summation=False, sample_fixed_size=2),
             "b": _spec("b", 2, 1), "n": _spec("n", 8, 2), "o": _spec("o", 4, 3)}
    features = [
        {"name": "a", "values": np.array([1, 2], np.uint64), "offsets": np.array([0, 1, 2])},
        {"name": "r", "values": np.array([2, 3, 4, 1], np.uint64), "offsets": np.array([0, 3, 4])},  # 4 dropped
        {"name": "b", "values": np.array([5, 6], np.uint64), "offsets": np.array([0, 1, 2])},
        {"name": "n", "values": np.array([7, 8], np.uint64), "offsets": np.array([0, 1, 2])},
        {"name": "o", "values": np.array([9, 9], np.uint64), "offsets": np.array([0, 1, 2])},  # unused
    ]
    prepared = pipeline.prepare(features, 2, slots, PREFIX_BIT)
    reply = pipeline.lookup_reply(prepared, {d: np.zeros((s.size, d), np.float32) for d, s in prepared.tables.items()})
    grads = [np.full((s.size, d), 2.0, np.float32) for d, s in prepared.tables.items()]
    grads[list(prepared.tables).index(8)][1, 3] = np.nan
    unused = [4]
    got = applied_tables(_nn_copy(prepared, reply), reply["slots"], grads, 4.0, unused)
    want, checked = _reference(prepared, grads, 4.0, unused, 2)
    _assert_same(got, want)
    assert sorted(got) == [2, 4]  # dim 8 non-finite: dropped whole
    assert checked.skipped_non_finite == ["n"]
    row4 = pipeline.add_index_prefix(np.array([4, 9], np.uint64), np.array([slots["r"].index_prefix, slots["o"].index_prefix], np.uint64), PREFIX_BIT)
    assert not np.isin(row4, got[4][0]).any()  # the dropped raw ID and the unused slot's ID get nothing
    assert got[4][0].size == 3 and (got[4][1] == np.float32(0.5)).all()  # 2.0 * float32(1/4)
    # a slot whose ID lies past sample_fixed_size but shares it with a used slot keeps it
    features[0]["values"] = np.array([4, 2], np.uint64)
    prepared = pipeline.prepare(features, 2, slots, PREFIX_BIT)
    reply = pipeline.lookup_reply(prepared, {d: np.zeros((s.size, d), np.float32) for d, s in prepared.tables.items()})
    grads = [np.ones((s.size, d), np.float32) for d, s in prepared.tables.items()]
    got = applied_tables(_nn_copy(prepared, reply), reply["slots"], grads, 1.0, [])
    _assert_same(got, _reference(prepared, grads, 1.0, [], 1)[0])
    assert row4[0] in got[4][0]


def test_applied_tables_reject_bad_input_naming_the_field():
    prepared = pipeline.prepare([{"name": "a", "values": np.array([3, 1], np.uint64), "offsets": np.array([0, 2])}],
                                1, {"a": _spec("a", 4, 0)}, PREFIX_BIT)
    reply = pipeline.lookup_reply(prepared, {4: np.zeros((2, 4), np.float32)})
    tables = _nn_copy(prepared, reply)
    with pytest.raises(ValueError, match="'grads'"):
        applied_tables(tables, reply["slots"], [], 1.0, [])
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        applied_tables(tables, reply["slots"], [np.zeros((3, 4), np.float32)], 1.0, [])
    with pytest.raises(ValueError, match="unused_slots"):
        applied_tables(tables, reply["slots"], [np.zeros((2, 4), np.float32)], 1.0, [1])
    tables[0]["signs"] = tables[0]["signs"][::-1]
    with pytest.raises(ValueError, match="sorted"):  # found when the update is kept
        SentUpdate(1, applied_tables(tables, reply["slots"], [np.zeros((2, 4), np.float32)], 1.0, []))


# -- correct_table against a real PS -------------------------------------------------------------
OPTIMIZERS = {
    "sgd": SGDConfig(lr=0.3),
    "sgd-momentum-wd": SGDConfig(lr=0.2, momentum=0.9, weight_decay=0.05),
    "adagrad-wd": AdagradConfig(lr=0.1, initial_accumulator_value=0.3, weight_decay=0.02, eps=1e-6),
    "adagrad-vectorwise-gsm": AdagradConfig(lr=0.1, vectorwise_shared=True, g_square_momentum=0.5),
    "adam-wd": AdamConfig(lr=0.05, betas=(0.8, 0.95), weight_decay=0.03, eps=1e-5),
    "adam-defaults": AdamConfig(),
}
DIM = 8
BOUND = 0.3  # initial values reach 0.5: clipping engages


def _engines():
    return [False, True] if kernels.available() else [False]


class Replicas:
    """Real PS stores, one per replica, each getting the signs ``shard_of`` routes to it."""

    def __init__(self, n, cfg, use_kernel, universe):
        self.n = n
        self.stores = []
        for r in range(n):
            s = EmbeddingStore(10_000, 3, seed=r, use_kernel=use_kernel)
            s.configure(HyperParameters(init_lower=-0.5, init_upper=0.5, weight_bound=BOUND, seed=7))
            s.register_optimizer(cfg)
            self.stores.append(s)
        self.route(universe, lambda s, q, _: s.lookup(q, DIM, train=True))
        self.route(universe, lambda s, q, _: s.lookup(q, 4, train=True))

    def route(self, signs, fn, grads=None):
        owner = shard_of(signs, self.n)
        for r, s in enumerate(self.stores):
            m = owner == r
            if m.any():
                fn(s, signs[m], None if grads is None else grads[m])

    def apply(self, u: SentUpdate, replica: int | None = None):
        for d, (signs, grads) in u.tables.items():
            owner = shard_of(signs, self.n)
            for r, s in enumerate(self.stores):
                m = owner == r
                if (replica is None or r == replica) and m.any():
                    s.update(signs[m], grads[m])

    def read(self, q, cfg):
        """Rows, state, replica and absent positions of sorted ``q``, as the lookup reply gives them."""
        rows = np.zeros((q.size, DIM), np.float32)
        state = np.zeros((q.size, state_width(cfg, DIM)), np.float32)
        replica = shard_of(q, self.n).astype(np.uint8)
        found = np.zeros(q.size, bool)
        for r, s in enumerate(self.stores):
            pos = np.flatnonzero(replica == r)
            got, w, st_, _ = s.read_rows(q[pos], DIM)
            at = pos[np.searchsorted(q[pos], got)]
            rows[at], state[at], found[at] = w, st_, True
        for a in (rows, state, replica):
            a.flags.writeable = False
        return rows, state, replica, np.flatnonzero(~found).astype(np.int32)


def _updates(rng, universe, count, first_seq=1):
    out = []
    for i in range(count):
        tables = {}
        for d in (DIM, 4):
            signs = np.sort(rng.choice(universe, size=int(rng.integers(1, universe.size)), replace=False))
            grads = rng.standard_normal((signs.size, d)).astype(np.float32)
            signs.flags.writeable = grads.flags.writeable = False
            tables[d] = (signs, grads)
        out.append(SentUpdate(seq=first_seq + i, tables=tables))
    return out


def _sign_set(rng, n):
    return np.unique(rng.integers(1, 2**64 - 1, size=n, dtype=np.uint64))


@pytest.mark.parametrize("use_kernel", _engines(), ids=lambda k: "kernel" if k else "numpy")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_replicas=st.integers(1, 3))
def test_corrected_stale_read_equals_a_fresh_read(name, use_kernel, seed, num_replicas):
    """Updates 1..k reach every replica; then each replica applies some of the rest (out of seq
    order too) before a stale read; the read corrected with the rest (minus what each replica had
    applied) equals a read after every replica applied everything."""
    cfg = OPTIMIZERS[name]
    rng = np.random.default_rng(seed)
    universe = _sign_set(rng, 40)
    ps = Replicas(num_replicas, cfg, use_kernel, universe)
    never = _sign_set(rng, 6)  # updated, looked up, never created: absent
    updates = _updates(rng, np.concatenate([universe, never]), 7)
    k = int(rng.integers(0, 4))
    for u in updates[:k]:
        ps.apply(u)
    since = k + 1
    rest = updates[k:]
    early = [[u for u in rest if rng.random() < 0.4] for _ in range(num_replicas)]  # applied before the read
    for r in range(num_replicas):
        for u in reversed(early[r]):  # latest first: the PS may apply concurrent updates in any order
            ps.apply(u, r)
    q = np.unique(np.concatenate([rng.choice(universe, size=25, replace=False), never[:3]]))
    rows, state, replica, absent = ps.read(q, cfg)
    applied = [np.array(sorted(u.seq for u in early[r] if u.seq >= since), np.int64) for r in range(num_replicas)]
    for r in range(num_replicas):
        for u in rest:
            if u not in early[r]:
                ps.apply(u, r)
    fresh_rows, fresh_state, _, fresh_absent = ps.read(q, cfg)

    new_rows, new_state, replayed, touched = correct_table(DIM, rows, state, q, replica, absent, applied, rest, cfg, BOUND,
                                                           use_kernel=use_kernel)

    np.testing.assert_array_equal(absent, fresh_absent)
    np.testing.assert_allclose(new_rows, fresh_rows, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new_state, fresh_state, rtol=1e-6, atol=1e-7)
    changed = (new_rows != rows).any(axis=1)
    assert (np.abs(new_rows[changed]) <= np.float32(BOUND)).all()  # replayed rows are clipped
    # the rows touched are ascending and hold every row that changed (and no absent one)
    assert (np.diff(touched) > 0).all() and set(np.flatnonzero(changed)) <= set(touched.tolist())
    assert not set(touched.tolist()) & set(np.asarray(absent).tolist())
    expect = 0  # row-steps, counted row by row
    present = np.setdiff1d(np.arange(q.size), absent)
    for u in rest:
        for i in present:
            if q[i] in u.tables[DIM][0] and u not in early[replica[i]]:
                expect += 1
    assert replayed == expect


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are not built")
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_replicas=st.integers(1, 3))
def test_the_compiled_replay_is_bit_identical_to_the_numpy_reference(name, seed, num_replicas):
    """Same rows, state, row-steps and touched positions, bit for bit, from both paths: updates
    that overlap each other, absent rows, replicas that applied some updates."""
    cfg = OPTIMIZERS[name]
    rng = np.random.default_rng(seed)
    q = _sign_set(rng, 60)
    updates = _updates(rng, np.concatenate([q, _sign_set(rng, 20)]), int(rng.integers(1, 6)))
    rows = rng.uniform(-0.5, 0.5, (q.size, DIM)).astype(np.float32)
    state = np.abs(rng.standard_normal((q.size, state_width(cfg, DIM)))).astype(np.float32)
    if isinstance(cfg, AdamConfig):
        state[:, -1] = rng.integers(0, 5, q.size)  # per-row step counts
    replica = rng.integers(0, num_replicas, q.size).astype(np.uint16)
    absent = np.flatnonzero(rng.random(q.size) < 0.1).astype(np.int32)
    applied = [np.array(sorted(u.seq for u in updates if rng.random() < 0.3), np.int64) for _ in range(num_replicas)]
    args = (DIM, rows, state, q, replica, absent, applied, updates, cfg, BOUND)
    compiled, reference = correct_table(*args, use_kernel=True), correct_table(*args, use_kernel=False)
    np.testing.assert_array_equal(compiled.rows, reference.rows)
    np.testing.assert_array_equal(compiled.state, reference.state)
    assert compiled.replayed == reference.replayed
    np.testing.assert_array_equal(compiled.touched, reference.touched)
    assert compiled.replayed == 0 or (compiled.rows != rows).any()
    released = correct_table(*args, use_kernel=True, release_gil=True)  # a lookup thread's call
    np.testing.assert_array_equal(released.rows, compiled.rows)
    np.testing.assert_array_equal(released.state, compiled.state)
    np.testing.assert_array_equal(released.touched, compiled.touched)


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are not built")
def test_a_lookup_threads_replay_runs_beside_other_threads_and_the_training_threads_does_not():
    """``release_gil``: while a lookup thread's replay runs, other Python threads (the training
    thread) run too; the training thread's own replay keeps the GIL. A ticker thread stamps the
    clock as fast as it can: with the GIL held, no stamp falls inside the call, so some gap between
    stamps spans the call's whole CPU time (certain, whatever else the machine runs); with it
    released, the ticker keeps stamping through the call (retried while other work starves it)."""
    cfg = AdagradConfig(lr=0.01)
    n = 2_000_000  # about 20 ms a call: long against the scheduler's slices
    signs = np.arange(1, n + 1, dtype=np.uint64)
    grads = np.full((n, DIM), 0.01, np.float32)
    args = kernels.optimizer_args(cfg) | {"weight_bound": BOUND}
    rows, state = np.zeros((n, DIM), np.float32), np.full((n, state_width(cfg, DIM)), 0.01, np.float32)
    replica, done, touched = np.zeros(n, np.uint16), np.zeros(1, bool), np.zeros(n, bool)
    gbuf = np.empty(2 * DIM, np.float32)

    def longest_gap_in_a_call(release: bool) -> tuple[float, float]:
        """(the longest time inside the call with no stamp of the ticker, the call's CPU time)."""
        with Ticker() as ticker:
            t0, c0 = time.perf_counter(), time.thread_time()
            kernels.replay(rows, state, signs, replica, None, done, signs, grads, touched, args, gbuf, release)
            cpu, t1 = time.thread_time() - c0, time.perf_counter()
        return ticker.longest_gap(t0, t1), cpu

    gap, cpu = longest_gap_in_a_call(False)
    assert gap >= 0.95 * cpu > 0, (gap, cpu)  # held: the ticker stood still for the whole call
    deadline = time.monotonic() + 30
    while (got := longest_gap_in_a_call(True))[0] > 0.5 * got[1]:  # released: it kept stamping
        assert time.monotonic() < deadline, got


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are not built")
def test_the_compiled_replay_refuses_what_its_merge_finds_wrong():
    """The kernel checks what the O(1) checks cannot: signs out of order, and replica numbers
    (already uint16, not range-checked in Python) past the replicas that answered."""
    cfg = SGDConfig(lr=1.0)
    rows, state = np.ones((3, 2), np.float32), np.zeros((3, 0), np.float32)
    upd = SentUpdate(seq=1, tables={2: (np.array([10, 20, 30], np.uint64), np.ones((3, 2), np.float32))})
    ok = dict(dim=2, rows=rows, state=state, signs=np.array([10, 20, 30], np.uint64), replica=np.zeros(3, np.uint16),
              absent=np.zeros(0, np.int32), applied=[np.zeros(0, np.int64)], missed=[upd], cfg=cfg, weight_bound=0.0,
              use_kernel=True)
    assert correct_table(**ok).replayed == 3
    with pytest.raises(ValueError, match="'signs'.*sorted"):
        correct_table(**{**ok, "signs": np.array([20, 10, 30], np.uint64)})
    with pytest.raises(ValueError, match="'replica'.*len\\(applied\\) = 1"):
        correct_table(**{**ok, "replica": np.array([0, 1, 0], np.uint16)})


def test_rows_a_replica_already_applied_are_not_stepped_again_and_absent_rows_stay():
    cfg = SGDConfig(lr=1.0)
    signs = np.array([10, 20, 30], np.uint64)
    rows = np.ones((3, 2), np.float32)
    state = np.zeros((3, 0), np.float32)
    replica = np.array([0, 1, 1], np.uint8)
    upd = SentUpdate(seq=5, tables={2: (np.array([10, 20, 30, 40], np.uint64), np.full((4, 2), 0.25, np.float32))})
    new_rows, _, n, touched = correct_table(2, rows, state, signs, replica, np.array([2], np.int32),
                                            [np.array([5], np.int64), np.array([4], np.int64)], [upd], cfg, 0.0)
    np.testing.assert_array_equal(new_rows, [[1, 1], [0.75, 0.75], [1, 1]])  # replica 0 had it; row 30 absent
    assert n == 1 and touched.tolist() == [1]


def test_inputs_are_not_written_and_empty_missed_returns_equal_new_arrays():
    cfg = AdamConfig(lr=0.1)
    rng = np.random.default_rng(3)
    signs = np.array([1, 5, 9], np.uint64)
    rows = rng.standard_normal((3, 4)).astype(np.float32)
    state = np.abs(rng.standard_normal((3, 9))).astype(np.float32)
    replica = np.zeros(3, np.uint8)
    keep = rows.copy(), state.copy()
    for a in (signs, rows, state, replica):
        a.flags.writeable = False
    upd = SentUpdate(seq=1, tables={4: (np.array([5], np.uint64), np.ones((1, 4), np.float32))})
    new_rows, new_state, n, _ = correct_table(4, rows, state, signs, replica, np.zeros(0, np.int32),
                                              [np.zeros(0, np.int64)], [upd], cfg, 0.0)
    assert n == 1 and new_rows.flags.writeable and new_state.flags.writeable
    np.testing.assert_array_equal(rows, keep[0])
    np.testing.assert_array_equal(state, keep[1])
    w, s = keep[0][1:2].copy(), keep[1][1:2].copy()
    apply_step(cfg, w, s, np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(new_rows[[0, 2]], keep[0][[0, 2]])
    np.testing.assert_array_equal(new_rows[1:2], w)
    np.testing.assert_array_equal(new_state[1:2], s)

    same_rows, same_state, n, none = correct_table(4, rows, state, signs, replica, np.zeros(0, np.int32),
                                                   [np.zeros(0, np.int64)], [], cfg, 0.0)
    assert n == 0 and none.size == 0 and same_rows is not rows and same_state is not state and same_rows.flags.writeable
    np.testing.assert_array_equal(same_rows, rows)
    np.testing.assert_array_equal(same_state, state)
    # an update of another dim only, and an empty table
    other = SentUpdate(seq=2, tables={8: (np.array([5], np.uint64), np.ones((1, 8), np.float32))})
    assert correct_table(4, rows, state, signs, replica, np.zeros(0, np.int32), [np.zeros(0, np.int64)],
                         [other], cfg, 0.0)[2] == 0
    empty = correct_table(4, rows[:0], state[:0], signs[:0], replica[:0], np.zeros(0, np.int32),
                          [np.zeros(0, np.int64)], [upd], cfg, 0.0)
    assert empty[0].shape == (0, 4) and empty[2] == 0


def test_correct_table_rejects_bad_input_naming_the_field():
    cfg = AdagradConfig()
    signs = np.array([1, 2], np.uint64)
    rows = np.zeros((2, 4), np.float32)
    state = np.full((2, 4), initial_state_value(cfg), np.float32)
    ok = dict(dim=4, rows=rows, state=state, signs=signs, replica=np.zeros(2, np.uint8), absent=np.zeros(0, np.int32),
              applied=[np.zeros(0, np.int64)], missed=[], cfg=cfg, weight_bound=0.0)
    u = [SentUpdate(seq=s, tables={}) for s in (3, 2)]
    seq1 = SentUpdate(seq=1, tables={4: (signs, np.ones((2, 4), np.float32))})
    for field, bad, extra in [("signs", signs.astype(np.int64), {}), ("rows", rows[:, :3], {}),
                              ("state", state[:, :1], {}), ("absent", np.array([2], np.int32), {}),
                              ("missed", u, {}),
                              # replica 1 of one: found out when replica 0 has applied the update
                              ("replica", np.array([0, 1], np.uint8), {"applied": [np.array([1])], "missed": [seq1]})]:
        with pytest.raises(ValueError, match=f"'{field}'"):
            correct_table(**{**ok, field: bad, **extra})
    with pytest.raises(ValueError, match="'seq'"):
        SentUpdate(seq=-1, tables={})
    with pytest.raises(ValueError, match="grads"):
        SentUpdate(seq=1, tables={4: (signs, np.zeros((2, 4), np.float64))})
    with pytest.raises(ValueError, match="sorted"):
        SentUpdate(seq=1, tables={4: (signs[::-1].copy(), np.zeros((2, 4), np.float32))})


# -- UpdateHistory -------------------------------------------------------------------------------
def _u(seq):
    return SentUpdate(seq=seq, tables={})


def test_history_since_and_forget_below():
    h = UpdateHistory()
    assert h.since(1) == []
    for s in (1, 2, 3, 5, 8):
        h.add(_u(s))
    assert [u.seq for u in h.since(3)] == [3, 5, 8]
    assert [u.seq for u in h.since(4)] == [5, 8]
    assert h.since(9) == []
    h.forget_below(5)
    assert len(h) == 2 and [u.seq for u in h.since(5)] == [5, 8]
    with pytest.raises(ValueError, match="forgotten"):
        h.since(4)  # those updates cannot be replayed any more: an error, not a short list
    with pytest.raises(ValueError, match="'seq'"):
        h.add(_u(8))
    h.forget_below(3)  # never lowers the horizon
    with pytest.raises(ValueError, match="forgotten"):
        h.since(4)
    h.forget_below(100)
    assert len(h) == 0 and h.since(100) == []
    h.add(_u(100))
    assert [u.seq for u in h.since(100)] == [100]


def test_history_is_consistent_under_concurrent_use():
    """One writer adds and forgets while readers ask: every answer is a gap-free ascending run
    starting at the asked seq, or the 'forgotten' error."""
    h = UpdateHistory()
    done = threading.Event()
    errors: list = []

    def read():
        i = 0
        while not done.is_set():
            i += 1
            want = max(1, (len(h) and i % 3000) or 1)
            try:
                got = [u.seq for u in h.since(want)]
            except ValueError as e:
                if "forgotten" not in str(e):
                    errors.append(e)
                continue
            if got and (got[0] != want or got != list(range(got[0], got[0] + len(got)))):
                errors.append(got[:5])

    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    for s in range(1, 3001):
        h.add(_u(s))
        if s % 7 == 0:
            h.forget_below(s - 50)
    done.set()
    for t in readers:
        t.join()
    assert not errors
    assert [u.seq for u in h.since(2951)] == list(range(2951, 3001))


@pytest.mark.parametrize("use_kernel", _engines(), ids=lambda k: "kernel" if k else "numpy")
def test_in_place_steps_the_given_arrays_to_what_a_copy_gets_and_refuses_wire_views(use_kernel):
    """The second part of a batch's correction steps the arrays the first part returned, without
    copying them; the result is the same, and read-only (wire) arrays are refused, not written."""
    cfg = AdagradConfig(lr=0.1)
    rng = np.random.default_rng(5)
    q = _sign_set(rng, 50)
    updates = _updates(rng, q, 3)
    rows = rng.uniform(-0.5, 0.5, (q.size, DIM)).astype(np.float32)
    state = np.full((q.size, DIM), 0.1, np.float32)
    args = (DIM, rows, state, q, np.zeros(q.size, np.uint16), np.zeros(0, np.int32), [np.zeros(0, np.int64)])
    copied = correct_table(*args, updates, cfg, BOUND, use_kernel=use_kernel)
    first = correct_table(*args, updates[:1], cfg, BOUND, use_kernel=use_kernel)
    second = correct_table(DIM, first.rows, first.state, *args[3:], updates[1:], cfg, BOUND, use_kernel=use_kernel,
                           in_place=True)
    assert second.rows is first.rows and second.state is first.state
    np.testing.assert_array_equal(second.rows, copied.rows)
    np.testing.assert_array_equal(second.state, copied.state)
    assert first.replayed + second.replayed == copied.replayed
    rows.flags.writeable = False
    with pytest.raises(ValueError, match="field 'rows': in_place needs a writable .* read-only"):
        correct_table(*args, updates, cfg, BOUND, use_kernel=use_kernel, in_place=True)
