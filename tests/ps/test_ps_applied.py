"""Own-update replay on the PS engine (EmbeddingStore.update_tables / lookup_full), on both engine
paths (conftest): tagged updates recorded per source and applied whole, lookups that return the
rows' optimizer state, the positions without a row and the applied seqs read in one critical
section, checked under real concurrency against a replay with ``apply_step``."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from persia.embedding_ps import AdagradConfig, EmbeddingStore, HyperParameters
from persia.embedding_ps.applied import WINDOW
from persia.embedding_ps.optimizers import apply_step

CFG = AdagradConfig(lr=0.1, initial_accumulator_value=0.2, weight_decay=0.01)
BOUND = 10.0


def _store(shards: int = 4, capacity: int = 100_000, admit: float = 1.0, cfg=CFG) -> EmbeddingStore:
    store = EmbeddingStore(capacity, shards)
    store.configure(HyperParameters(admit_probability=admit, weight_bound=BOUND, init_lower=-0.5, init_upper=0.5))
    store.register_optimizer(cfg)
    return store


def _signs(n: int, seed: int) -> np.ndarray:
    return np.unique(np.random.default_rng(seed).integers(1, 2**64 - 1, n, dtype=np.uint64))


def _grads(n: int, dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def test_state_and_absent_positions_come_with_the_rows():
    store = _store()
    signs = _signs(300, 1)
    store.lookup(signs, 8, True)
    store.update(signs[::2], _grads(150, 8, 2))
    unknown = np.array([5, 6], dtype=np.uint64)
    query = np.concatenate([signs[:40], unknown[:1], signs[:3], unknown[1:]])  # repeats, misses
    got = store.lookup_full(query, 8, False, state=True)
    found, weights, state, _ = store.read_rows(signs[:40], 8)
    assert found.shape == (40,)
    np.testing.assert_array_equal(got.rows[:40], weights)
    np.testing.assert_array_equal(got.state[:40], state)
    np.testing.assert_array_equal(got.state[41:44], state[:3])
    assert got.state.dtype == np.float32 and got.state.shape == (45, 8)
    assert got.absent.dtype == np.int32
    np.testing.assert_array_equal(got.absent, [40, 44])
    assert not got.rows[[40, 44]].any() and not got.state[[40, 44]].any()
    assert got.applied is None
    np.testing.assert_array_equal(store.lookup(query, 8, False), got.rows)  # same rows as lookup
    assert len(store) == 300  # train=False created nothing


def test_a_training_lookup_creates_its_misses_and_reads_their_initial_state():
    store = _store()
    old = _signs(50, 3)
    store.lookup(old, 4, True)
    store.update(old, _grads(50, 4, 4))
    new = _signs(30, 5)
    got = store.lookup_full(np.concatenate([old, new]), 4, True, state=True)
    assert got.absent.shape == (0,)
    np.testing.assert_array_equal(got.state[50:], np.full((30, 4), 0.2, np.float32))  # initial accumulator
    np.testing.assert_array_equal(got.state[:50], store.read_rows(old, 4)[2])
    np.testing.assert_array_equal(got.rows[50:], store.read_rows(new, 4)[1])


def test_rows_not_admitted_are_absent_and_read_as_zeros():
    store = _store(admit=0.5)
    signs = _signs(400, 6)
    got = store.lookup_full(signs, 4, True, nonce=17, state=True)
    have = store.contains(signs, 4)
    assert 0 < got.absent.shape[0] < 400
    np.testing.assert_array_equal(got.absent, np.flatnonzero(~have))
    assert not got.rows[got.absent].any() and not got.state[got.absent].any()
    assert (got.state[have] == np.float32(0.2)).all()


def test_an_unseen_dim_reads_zeros_all_absent_with_the_optimizers_state_width():
    store = _store(cfg=AdagradConfig(lr=0.1, vectorwise_shared=True))
    got = store.lookup_full(np.array([1, 2, 3], np.uint64), 6, False, state=True, applied=(9, 0))
    assert got.rows.shape == (3, 6) and not got.rows.any()
    assert got.state.shape == (3, 1) and not got.state.any()
    np.testing.assert_array_equal(got.absent, [0, 1, 2])
    assert got.applied.shape == (0,) and got.applied.dtype == np.int64


def test_a_tagged_update_changes_the_rows_as_untagged_ones_and_records_its_seqs():
    tagged, plain = _store(), _store()
    a, b = _signs(200, 7), _signs(100, 8)
    gone = np.array([3], dtype=np.uint64)  # no row: counted missing either way
    for s in (tagged, plain):
        s.lookup(a, 4, True)
        s.lookup(b, 16, True)
    seen: list = []
    tagged.add_update_listener(lambda dim, signs: seen.append((dim, signs.shape[0])))
    tables = [(np.concatenate([a[:120], gone]), _grads(121, 4, 9)), (b, _grads(100, 16, 10)), (a[100:], _grads(100, 4, 11))]
    assert tagged.update_tables(tables, source=77, seqs=[4, 5]) == 1
    assert sum(plain.update(s, g) for s, g in tables) == 1
    assert sorted(seen) == [(4, 100), (4, 120), (16, 100)]  # listeners (incremental dumps) still hear
    for signs, dim in ((a, 4), (b, 16)):
        _, w_t, s_t, _ = tagged.read_rows(signs, dim)
        _, w_p, s_p, _ = plain.read_rows(signs, dim)
        np.testing.assert_array_equal(w_t, w_p)
        np.testing.assert_array_equal(s_t, s_p)
    np.testing.assert_array_equal(tagged.lookup_full(a, 4, False, applied=(77, 0)).applied, [4, 5])
    np.testing.assert_array_equal(tagged.lookup_full(a, 4, False, applied=(77, 5)).applied, [5])
    assert tagged.lookup_full(a, 4, False, applied=(78, 0)).applied.shape == (0,)
    assert plain.lookup_full(a, 4, False, applied=(77, 0)).applied.shape == (0,)  # untagged: nothing recorded
    tagged.update_tables([], source=77, seqs=[6])  # a replica with none of an update's rows still records it
    np.testing.assert_array_equal(tagged.lookup_full(a, 4, False, applied=(77, 5)).applied, [5, 6])
    stats = tagged.stats()
    assert stats["update_calls"] == 3 and stats["gradient_id_miss"] == 1


def test_bad_tags_are_refused_naming_the_field_and_nothing_is_applied():
    store = _store()
    signs = _signs(10, 12)
    store.lookup(signs, 4, True)
    before = store.lookup(signs, 4, False)
    with pytest.raises(ValueError, match=r"field 'seqs' \(\[1, 2\]\) needs field 'source'"):
        store.update_tables([(signs, _grads(10, 4, 1))], seqs=[1, 2])
    with pytest.raises(ValueError, match=r"field 'source' must be .* got -4"):
        store.update_tables([(signs, _grads(10, 4, 1))], source=-4, seqs=[1])
    with pytest.raises(ValueError, match=r"grads must have shape"):  # the 2nd table is bad: the 1st is not applied
        store.update_tables([(signs, _grads(10, 4, 1)), (signs, _grads(9, 4, 1))], source=1, seqs=[1])
    with pytest.raises(ValueError, match=r"field 'applied.since' must be .* got 'x'"):
        store.lookup_full(signs, 4, False, applied=(1, "x"))
    np.testing.assert_array_equal(store.lookup(signs, 4, False), before)
    assert store.lookup_full(signs, 4, False, applied=(1, 0)).applied.shape == (0,)


def test_a_query_below_the_horizon_names_the_field_value_and_horizon_and_creates_nothing():
    store = _store()
    store.update_tables([], source=3, seqs=range(1, WINDOW + 11))
    new = _signs(20, 13)
    with pytest.raises(ValueError) as err:
        store.lookup_full(new, 4, True, applied=(3, 5))
    assert "field 'applied.since' is 5" in str(err.value) and "from 11" in str(err.value)
    assert len(store) == 0
    got = store.lookup_full(new, 4, True, applied=(3, WINDOW + 9))
    np.testing.assert_array_equal(got.applied, [WINDOW + 9, WINDOW + 10])


def test_clear_and_a_loaded_checkpoint_forget_the_applied_seqs(tmp_path):
    store = _store()
    signs = _signs(20, 14)
    store.lookup(signs, 4, True)
    store.dump(tmp_path, 0, fsync=False)
    store.update_tables([(signs, _grads(20, 4, 1))], source=3, seqs=[1])
    store.load(tmp_path, 0, 1)  # the rows are the checkpoint's again: they reflect no update of source 3
    assert store.lookup_full(signs, 4, False, applied=(3, 0)).applied.shape == (0,)
    store.update_tables([], source=3, seqs=[2])
    store.clear()
    assert store.lookup_full(signs, 4, False, applied=(3, 0)).applied.shape == (0,)


@pytest.mark.parametrize("shards", [1, 4])
def test_a_tagged_update_between_the_two_passes_of_a_lookup_is_answered_whole(shards):
    """A training lookup reads, inserts its misses, then reads those again. A tagged update of the
    source that lands on the new rows in between must not be half reported: the whole batch is
    read again, and the answer lists the update."""
    store = _store(shards=shards)
    old, new = _signs(40, 15), _signs(30, 16)
    store.lookup(old, 4, True)
    grads = _grads(70, 4, 17)
    both = np.concatenate([old, new])
    real_insert = store._insert

    def insert_then_update(*args, **kwargs):
        written = real_insert(*args, **kwargs)
        store.update_tables([(both, grads)], source=5, seqs=[1])
        return written

    store._insert_all_shards = lambda *a, **k: False  # take the per-shard insert (the one patched)
    store._insert = insert_then_update
    got = store.lookup_full(both, 4, True, state=True, applied=(5, 1))
    np.testing.assert_array_equal(got.applied, [1])
    _, w, s, _ = store.read_rows(both, 4)
    np.testing.assert_array_equal(got.rows, w)  # every row after the update, old and new
    np.testing.assert_array_equal(got.state, s)
    assert (s[40:] != np.float32(0.2)).any()  # the new rows did get the update


def test_lookups_see_tagged_updates_whole_and_report_exactly_those_under_concurrency():
    """One thread applies tagged updates seq 1..N (each of two tables over every shard), one
    applies untagged updates to other rows, two look up with ``applied`` (training lookups with
    fresh rows too). Every answer must be the initial rows and state plus exactly the listed
    updates replayed with ``apply_step``, listed as 1..m. The writer waits after each update
    until three lookups end, so every m is seen; lookups overlap the updates meanwhile."""
    n_updates, dim = 40, 4
    store = _store(shards=8)
    mine, others = _signs(400, 18), _signs(300, 19)
    store.lookup(mine, dim, True)
    store.lookup(others, dim, True)
    _, w0, s0, _ = store.read_rows(mine, dim)
    rng = np.random.default_rng(20)
    updates = []
    for _ in range(n_updates):
        pos = np.sort(rng.choice(mine.shape[0], 250, replace=False))
        updates.append((pos, rng.standard_normal((250, dim)).astype(np.float32)))
    expected = [(w0.copy(), s0.copy())]
    for pos, g in updates:  # the replay the NN worker would do
        w, s = expected[-1][0].copy(), expected[-1][1].copy()
        wk, sk = w[pos], s[pos]
        apply_step(CFG, wk, sk, g, BOUND)
        w[pos], s[pos] = wk, sk
        expected.append((w, s))

    done = threading.Event()
    finished = [0]
    cond = threading.Condition()
    errors: list = []
    answers: list = []

    def writer():
        try:
            for seq, (pos, g) in enumerate(updates, start=1):
                half = pos.shape[0] // 2
                store.update_tables([(mine[pos[:half]], g[:half]), (mine[pos[half:]], g[half:])], source=11, seqs=[seq])
                with cond:
                    goal = finished[0] + 3
                    if not cond.wait_for(lambda: finished[0] >= goal or errors, timeout=60):
                        raise TimeoutError("readers stopped answering")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    def untagged():
        k = 0
        while not done.is_set():
            store.update(others, _grads(others.shape[0], dim, 1000 + k))
            k += 1

    def reader(r):
        k = 0
        try:
            while not done.is_set():
                train = k % 2 == 0
                fresh = np.arange(1, 21, dtype=np.uint64) + np.uint64(10_000 * (2 * k + r + 1))
                query = np.concatenate([mine, fresh]) if train else mine
                got = store.lookup_full(query, dim, train, state=True, applied=(11, 1))
                answers.append((got.applied, got.rows[: mine.shape[0]], got.state[: mine.shape[0]], got.absent))
                with cond:
                    finished[0] += 1
                    cond.notify_all()
                k += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            with cond:
                cond.notify_all()

    threads = [threading.Thread(target=writer), threading.Thread(target=untagged)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    seen = set()
    for applied, rows, state, absent in answers:
        m = applied.shape[0]
        np.testing.assert_array_equal(applied, np.arange(1, m + 1))
        np.testing.assert_array_equal(rows, expected[m][0], err_msg=f"rows after {m} updates")
        np.testing.assert_array_equal(state, expected[m][1], err_msg=f"state after {m} updates")
        assert absent.shape == (0,)
        seen.add(m)
    assert set(range(1, n_updates + 1)) <= seen
