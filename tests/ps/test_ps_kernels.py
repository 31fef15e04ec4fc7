"""The compiled kernel against the pure-numpy engine: the same operations give the same rows bit for
bit (lookups, creation, eviction, every optimizer with clipping, repeated signs), the kernel
rejects bad arguments with an error naming them, and a corrupt index raises instead of reading
out of bounds."""

from __future__ import annotations

import time

import numpy as np
import pytest

from persia.embedding_ps import (
    AdagradConfig,
    AdamConfig,
    EmbeddingStore,
    HyperParameters,
    SGDConfig,
    kernels,
)
from persia.embedding_ps import index as ix
from persia.hashing import INTERNAL_SHARD_SALT, uniform_from_signs
from tests.ticker import Ticker

_kernels = kernels._kernels


@pytest.fixture(autouse=True)
def engine_path(monkeypatch) -> str:
    """This module builds one store per path itself (overrides the conftest parametrization)."""
    if not kernels.available():
        pytest.fail("persia.embedding_ps._kernels is not built: reinstall the package (pip install -e .)")
    monkeypatch.delenv(kernels.ENV_PURE_NUMPY, raising=False)
    return "both"


def _pair(capacity, shards, cfg, hp=None, **kw) -> tuple[EmbeddingStore, EmbeddingStore]:
    stores = (EmbeddingStore(capacity, shards, use_kernel=True, **kw), EmbeddingStore(capacity, shards, use_kernel=False, **kw))
    for s in stores:
        s.configure(hp or HyperParameters())
        s.register_optimizer(cfg)
    return stores


OPTIMIZERS = {
    "sgd": SGDConfig(lr=0.3),
    "sgd-momentum-wd": SGDConfig(lr=0.2, momentum=0.9, weight_decay=0.05),
    "adagrad-wd": AdagradConfig(lr=0.1, initial_accumulator_value=0.3, weight_decay=0.02, eps=1e-6),
    "adagrad-gsm": AdagradConfig(lr=0.1, g_square_momentum=0.9),
    "adagrad-vectorwise": AdagradConfig(lr=0.1, vectorwise_shared=True, g_square_momentum=0.5, weight_decay=0.01),
    "adam-wd": AdamConfig(lr=0.05, betas=(0.8, 0.95), weight_decay=0.03, eps=1e-5),
    "adam-defaults": AdamConfig(),
}


def _same(a: np.ndarray, b: np.ndarray, cfg) -> None:
    if isinstance(cfg, AdamConfig):  # bias corrections use libm pow, numpy may use its own: allow 1 ulp
        np.testing.assert_allclose(a, b, rtol=2e-7, atol=0)
    else:
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("cfg", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
@pytest.mark.parametrize("dim", [1, 3, 16, 33, 200])
def test_optimizer_steps_match_numpy_bit_for_bit(cfg, dim):
    """Several steps with repeated signs (summed first), clipping, and a few absent signs."""
    kernel, numpy_ = _pair(100_000, 3, cfg, HyperParameters(weight_bound=0.05, init_lower=-0.05, init_upper=0.05))
    rng = np.random.default_rng(dim)
    signs = rng.integers(0, 2**64 - 1, 600, dtype=np.uint64, endpoint=True)
    for s in (kernel, numpy_):
        s.lookup(signs, dim, True)
    absent = np.array([7, 8, 9], dtype=np.uint64)
    for _ in range(4):
        batch = np.concatenate([signs[rng.integers(0, len(signs), 400)], absent])
        grads = rng.standard_normal((len(batch), dim)).astype(np.float32)
        assert kernel.update(batch, grads) == numpy_.update(batch, grads) == 3
    _, w_k, s_k, _ = kernel.read_rows(signs, dim)
    _, w_n, s_n, _ = numpy_.read_rows(signs, dim)
    _same(w_k, w_n, cfg)
    _same(s_k, s_n, cfg)
    assert np.abs(w_k).max() <= 0.05
    counters = ("update_ids", "gradient_id_miss", "duplicate_update_ids")
    assert [kernel.stats()[c] for c in counters] == [numpy_.stats()[c] for c in counters]
    assert kernel.stats()["duplicate_update_ids"] > 0


@pytest.mark.parametrize("seed, shards, admit", [(0, 1, 1.0), (1, 3, 1.0), (2, 4, 0.6), (3, 2, 0.9)])
def test_random_operation_sequences_agree(seed, shards, admit):
    """Lookups (train and inference), updates, inserts with eviction, upserts, contains and
    read_rows on both paths, compared after every operation (rows, stats, listeners)."""
    rng = np.random.default_rng(seed)
    universe = np.concatenate([np.array([0, 1, 2**63, 2**64 - 1], np.uint64),
                               rng.integers(0, 2**64 - 1, 400, dtype=np.uint64, endpoint=True)])
    hp = HyperParameters(admit_probability=admit, weight_bound=2.0, init_lower=-1, init_upper=1)
    kernel, numpy_ = _pair(shards * 60, shards, AdagradConfig(lr=0.3), hp, seed=seed, evict_fraction=0.05)
    heard = ([], [])
    kernel.add_update_listener(lambda dim, s: heard[0].append((dim, np.sort(s))))
    numpy_.add_update_listener(lambda dim, s: heard[1].append((dim, np.sort(s))))
    for _ in range(150):
        dim = int(rng.choice([2, 5, 16]))
        picks = universe[rng.integers(0, len(universe), int(rng.integers(1, 90)))]
        kind = rng.random()
        if kind < 0.5:
            train = bool(rng.random() < 0.8)
            np.testing.assert_array_equal(kernel.lookup(picks, dim, train), numpy_.lookup(picks, dim, train))
        elif kind < 0.85:
            grads = rng.standard_normal((len(picks), dim)).astype(np.float32)
            assert kernel.update(picks, grads) == numpy_.update(picks, grads)
        elif kind < 0.95:
            uniq = np.unique(picks)
            weights = rng.standard_normal((len(uniq), dim)).astype(np.float32)
            assert kernel.upsert(uniq, dim, weights) == numpy_.upsert(uniq, dim, weights)
        else:
            np.testing.assert_array_equal(kernel.contains(picks, dim), numpy_.contains(picks, dim))
        for d in (2, 5, 16):
            a, b = kernel.read_rows(universe, d), numpy_.read_rows(universe, d)
            for x, y in zip(a[:3], b[:3]):
                np.testing.assert_array_equal(x, y)
    sk, sn = kernel.stats(), numpy_.stats()
    sk.pop("index_promotions"), sn.pop("index_promotions")  # the two promote in a different order
    assert sk == sn and sk["evictions"] > 0 and sk["update_ids"] > 0
    assert len(heard[0]) == len(heard[1])
    for (dk, a), (dn, b) in zip(*heard):
        assert dk == dn
        np.testing.assert_array_equal(a, b)


def _unmix64(h: int) -> int:
    """Inverse of persia.hashing.mix64 (splitmix64's finalizer is a bijection)."""
    m = (1 << 64) - 1

    def unxorshift(z, s):
        x = z
        for _ in range(64 // s + 1):
            x = z ^ (x >> s)
        return x

    z = unxorshift(h, 31)
    z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & m
    z = unxorshift(z, 27)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & m
    z = unxorshift(z, 30)
    return (z - 0x9E3779B97F4A7C15) & m


def test_a_fingerprint_collision_only_takes_the_exact_path():
    """Two distinct signs whose hashes share the kernel's 32-bit fingerprint and set slot: the
    kernel suspects a repeat, the exact fold finds none, and the rows are stepped once each."""
    low, hi_a, hi_b = 0x2468ACE1, 0x00012345, 0x80012345  # same fingerprint, same set slot
    pair = np.array([_unmix64((hi << 32) | low) ^ INTERNAL_SHARD_SALT for hi in (hi_a, hi_b)], dtype=np.uint64)
    hashes = ix.sign_hash(pair)
    assert (hashes & np.uint64(0xFFFFFFFF) == low).all() and pair[0] != pair[1]
    signs = np.concatenate([pair, np.arange(10, 20, dtype=np.uint64)])
    kernel, numpy_ = _pair(1000, 1, AdagradConfig(lr=0.5))
    for s in (kernel, numpy_):
        s.lookup(signs, 4, True)
    grads = np.random.default_rng(0).standard_normal((len(signs), 4)).astype(np.float32)
    assert kernel.update(signs, grads) == numpy_.update(signs, grads) == 0
    np.testing.assert_array_equal(kernel.lookup(signs, 4, False), numpy_.lookup(signs, 4, False))
    assert kernel.stats()["duplicate_update_ids"] == 0


def test_kernel_hash_is_the_engine_hash():
    signs = np.concatenate([np.array([0, 1, 2**63, 2**64 - 1], np.uint64),
                            np.random.default_rng(0).integers(0, 2**64 - 1, 1000, dtype=np.uint64, endpoint=True)])
    np.testing.assert_array_equal(kernels.sign_hash(signs), ix.sign_hash(signs))


@pytest.mark.parametrize("cfg", [OPTIMIZERS["adagrad-wd"], OPTIMIZERS["adam-wd"]], ids=["adagrad", "adam"])
@pytest.mark.parametrize("by_shard", [False, True])
def test_one_update_call_across_shards_equals_a_call_per_shard(cfg, by_shard, monkeypatch):
    """The store steps a batch in one kernel call over every shard it touches (a big batch: shard
    by shard, ``by_shard``, here forced on a small one); a stable partition then one call per
    shard leaves the same weights, state and index, promotions included: rows of different
    shards never interact."""
    import persia.embedding_ps.store as store_module

    monkeypatch.setattr(store_module, "_BY_SHARD_MIN", 1 if by_shard else 1 << 30)
    by_shard_calls = []
    real_by_shard = EmbeddingStore._update_by_shard
    monkeypatch.setattr(EmbeddingStore, "_update_by_shard",
                        lambda self, *a, **k: by_shard_calls.append(1) or real_by_shard(self, *a, **k))
    rng = np.random.default_rng(7)
    signs = np.unique(rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64, endpoint=True))
    one, per_shard = (EmbeddingStore(20_000, 16, use_kernel=True) for _ in range(2))
    for s in (one, per_shard):
        s.configure(HyperParameters(weight_bound=0.5))
        s.register_optimizer(cfg)
        s.lookup(signs, 8, train=True)
        s.lookup(signs[::3], 8, train=True)  # newer stamps: promotions have something to do
    for _ in range(3):
        batch = rng.permutation(signs)[:2000]
        grads = rng.standard_normal((batch.shape[0], 8)).astype(np.float32)
        assert one.update(batch, grads) == 0
        table = per_shard._tables[8]
        bounds, q, g = kernels.partition(batch, grads, 16)
        args = kernels.update_args(cfg, 0.5)
        hit = np.zeros(batch.shape[0], dtype=bool)
        for k in range(16):
            kernels.update(table, q[bounds[k]:bounds[k + 1]], g[bounds[k]:bounds[k + 1]], args, hit[bounds[k]:bounds[k + 1]])
        assert hit.all()
    assert one.stats()["index_promotions"] > 0
    assert len(by_shard_calls) == (3 if by_shard else 0)  # the path under test is the one taken
    a, b = one._tables[8], per_shard._tables[8]
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_array_equal(a.state, b.state)
    np.testing.assert_array_equal(a.index, b.index)


def test_partition_is_a_stable_sort_by_shard():
    rng = np.random.default_rng(1)
    signs = rng.integers(0, 2**64 - 1, 5000, dtype=np.uint64, endpoint=True)
    grads = rng.standard_normal((5000, 3)).astype(np.float32)
    bounds, q, g = kernels.partition(signs, grads, 7)
    shard = ix.shard_ids(ix.sign_hash(signs), 7)
    order = np.argsort(shard, kind="stable")
    np.testing.assert_array_equal(q, signs[order])
    np.testing.assert_array_equal(g, grads[order])
    np.testing.assert_array_equal(bounds, np.concatenate([[0], np.cumsum(np.bincount(shard, minlength=7))]))


def test_the_kernel_lets_other_threads_run_while_it_works():
    """The GIL is released inside the kernel: another Python thread makes progress in the middle
    of one long lookup call (with the GIL held it could not run there at all). Retried under a
    deadline while other work on the machine keeps the ticker off every CPU during the call."""
    store = EmbeddingStore(300_000, 4, use_kernel=True)
    signs = np.arange(1, 200_001, dtype=np.uint64) * np.uint64(2654435761)
    store.lookup(signs, 16, True)
    batch = np.tile(signs, 15)  # 3M IDs: one call of tens of milliseconds

    def stamps_in_the_middle_of_a_call() -> tuple[int, int, float]:
        """(the ticker's stamps in the middle 40% of one lookup call, all its stamps, the call's time)."""
        with Ticker() as ticker:
            begin = time.perf_counter()
            out = store.lookup(batch, 16, False)
            end = time.perf_counter()
        assert out.shape == (len(batch), 16) and np.any(out)
        middle = ticker.between(begin + 0.3 * (end - begin), end - 0.3 * (end - begin))
        return len(middle), len(ticker.stamps), end - begin

    deadline = time.monotonic() + 30
    while (got := stamps_in_the_middle_of_a_call())[0] <= 100:
        assert time.monotonic() < deadline, got


# -- arguments and safety -------------------------------------------------------------------------
def _table():
    store = EmbeddingStore(1000, 2, use_kernel=True)
    store.register_optimizer(AdagradConfig())
    signs = np.arange(1, 50, dtype=np.uint64)
    store.lookup(signs, 4, True)
    return store, store._tables[4], signs


def _locate_args(table, signs):
    n = len(signs)
    return dict(index=table.index, rows=table.rows, signs=signs, num_shards=table.num_shards,
                slots_per_region=table.M, key_col=table.key_col, stamp_col=table.stamp_col, dim=table.dim,
                salt=INTERNAL_SHARD_SALT, hit=np.empty(n, bool), out=np.empty((n, table.dim), np.float32), stamp=True,
                clock=3)


@pytest.mark.parametrize(
    "field, bad, match",
    [
        ("signs", np.arange(5, dtype=np.float64), r"signs must be a 1-D array of 8-byte unsigned integer"),
        ("signs", np.arange(10, dtype=np.uint64)[::2], r"signs must be a C-contiguous"),
        ("hit", np.empty(3, bool), r"hit has 3 elements, expected 49"),
        ("out", np.empty((49, 5), np.float32), r"out has 5 columns, expected 4"),
        ("out", np.empty((49, 4), np.float64), r"out must be a 2-D array of 4-byte float"),
        ("stamp_col", 2, r"stamp_col 2 must be a cell of the row \(width 7\) past the 4 weights"),
        ("stamp_col", 5, r"stamp_col 5 must be a cell of the row .* off the sign at key_col 5"),
        ("stamp_col", 7, r"stamp_col 7 must be a cell of the row \(width 7\)"),
        ("index", np.zeros(5, np.uint32), r"index has 5 slots, expected num_shards \* slots_per_region"),
        ("key_col", 1, r"cannot hold dim 4 and a sign at column key_col 1"),
        ("clock", 2**33, r"clock 8589934592 does not fit a uint32"),
    ],
)
def test_locate_refuses_bad_arguments_naming_them(field, bad, match):
    _, table, signs = _table()
    args = _locate_args(table, signs)
    args[field] = bad
    with pytest.raises(ValueError, match=match):
        _kernels.locate(**args)


def test_read_only_output_is_refused():
    _, table, signs = _table()
    args = _locate_args(table, signs)
    args["out"].flags.writeable = False
    with pytest.raises(ValueError, match=r"out must be a C-contiguous writable"):
        _kernels.locate(**args)


@pytest.mark.parametrize(
    "field, bad, match",
    [
        ("code", 7, r"code must be 1 \(SGD\), 2 \(Adagrad\) or 3 \(Adam\), got 7"),
        ("vectorwise", True, r"state has 4 columns for this optimizer, expected 1"),
        ("grads", np.zeros((5, 4), np.float32), r"grads has 5 rows, expected 49"),
        ("gbuf", np.zeros(4, np.float32), r"gbuf has 4 elements, expected 8"),
        ("scratch", np.zeros(100, np.uint32), r"scratch must hold a power of two >= 2 \* 49 elements, got 100"),
        ("stamp_col", 0, r"stamp_col 0 must be a cell of the row"),
    ],
)
def test_update_refuses_bad_arguments_naming_them(field, bad, match):
    store, table, signs = _table()
    before = table.rows.copy()
    args = dict(kernels.update_args(store.optimizer, 0.0), index=table.index, rows=table.rows, state=table.state,
                signs=signs, grads=np.ones((len(signs), 4), np.float32), num_shards=table.num_shards,
                slots_per_region=table.M, key_col=table.key_col, stamp_col=table.stamp_col, dim=4,
                hit=np.empty(len(signs), bool), gbuf=np.empty(8, np.float32), scratch=kernels.scratch_for(len(signs)))
    args[field] = bad
    with pytest.raises(ValueError, match=match):
        _kernels.update(**args)
    np.testing.assert_array_equal(table.rows, before)  # nothing was touched


def test_a_corrupt_index_raises_instead_of_reading_past_the_table():
    store, table, signs = _table()
    home = ix.home_slots(ix.sign_hash(signs[:1]), table.num_shards, table.M)[0]
    table.index[home] = table.rows.shape[0] + 5  # a row number past the table
    with pytest.raises(RuntimeError, match="invariant broken"):
        store.lookup(signs[:1], 4, False)


def test_a_region_without_an_empty_slot_ends_the_probe():
    store, table, _ = _table()
    table.index[:] = ix.TOMBSTONE  # every chain endless: the probe must stop after one lap
    with pytest.raises(RuntimeError, match="invariant broken"):
        store.lookup(np.array([123456789], np.uint64), 4, False)


# -- choosing the path ----------------------------------------------------------------------------
def test_env_var_forces_the_numpy_path(monkeypatch):
    monkeypatch.setenv(kernels.ENV_PURE_NUMPY, "1")
    assert EmbeddingStore(10).use_kernel is False
    assert EmbeddingStore(10, use_kernel=True).use_kernel is True  # an explicit choice wins
    monkeypatch.setenv(kernels.ENV_PURE_NUMPY, "0")
    assert EmbeddingStore(10).use_kernel is True


def test_asking_for_a_kernel_that_is_not_built_is_an_error(monkeypatch):
    monkeypatch.setattr(kernels, "_kernels", None)
    assert EmbeddingStore(10).use_kernel is False  # the default falls back to numpy
    with pytest.raises(RuntimeError, match=r"use_kernel=True but persia.embedding_ps._kernels is not built"):
        EmbeddingStore(10, use_kernel=True)


def test_an_extension_built_from_an_older_source_is_refused_with_the_fix():
    """A checkout updated without rebuilding keeps an old _kernels.so: it must not be called with
    arguments it does not know, and the error says how to rebuild."""
    assert kernels.stale_reason(_kernels) is None  # the one built here is current
    old = type("OldKernels", (), {})()  # an old build has no ABI constant
    reason = kernels.stale_reason(old)
    assert f"interface 1, this code needs {kernels.ABI}" in reason and "make venv" in reason
    assert kernels.stale_reason(type("K", (), {"ABI": kernels.ABI})()) is None


def test_a_training_lookup_stamps_the_row_itself_on_both_paths():
    """The recency stamp is a uint32 cell of the row (after the weights, before the sign), so a
    training lookup stamps the row in the cache lines it reads; both paths leave the very same
    bytes (weights, stamps, signs) and an inference lookup stamps nothing."""
    kernel, numpy_ = _pair(10_000, 3, AdagradConfig())
    signs = np.arange(1, 301, dtype=np.uint64)
    for s in (kernel, numpy_):
        s.lookup(signs, 16, True)  # creates, clock 1
        s.lookup(signs[::3], 16, True)  # clock 2
        s.lookup(signs[1::3], 16, False)  # inference: no stamp
    t_k, t_n = kernel._tables[16], numpy_._tables[16]
    assert (t_k.stamp_col, t_k.key_col, t_k.width) == (16, 17, 19)  # 76 bytes a row
    np.testing.assert_array_equal(t_k.rows.view(np.uint32), t_n.rows.view(np.uint32))
    rows, hit, _, _ = t_k.locate(signs)
    assert hit.all()
    stamps = t_k.rows[rows, 16].view(np.uint32)
    assert np.array_equal(stamps, t_k.stamps[rows])
    expected = np.ones(len(signs), np.uint32)
    expected[::3] = 2
    np.testing.assert_array_equal(stamps, expected)
    np.testing.assert_array_equal(t_k.signs_of_rows[rows], signs)


# -- index inserts --------------------------------------------------------------------------------
def _crowded_inserts(seed: int, shards: int = 3, slots: int = 64):
    """An index region a third full of rows and tombstones, and new entries crowding a few home
    slots (so probes collide, wrap and reuse tombstones)."""
    rng = np.random.default_rng(seed)
    index = np.zeros(shards * slots, np.uint32)
    taken = rng.choice(index.shape[0], index.shape[0] // 3, replace=False)
    index[taken[: len(taken) // 2]] = ix.TOMBSTONE
    index[taken[len(taken) // 2 :]] = rng.integers(ix.FIRST_ROW, 1000, len(taken) - len(taken) // 2)
    homes = rng.integers(0, 2**32, 6, dtype=np.uint64) << np.uint64(32)
    h = rng.choice(homes, 40) | rng.integers(0, 2**32, 40, dtype=np.uint64)  # 40 entries, 6 home slots
    rows = np.arange(5000, 5040, dtype=np.int64)
    return index, h, rows


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_insert_leaves_every_entry_reachable_as_numpy_does(seed):
    index, h, rows = _crowded_inserts(seed)
    compiled, reference = index.copy(), index.copy()
    reused = kernels.insert(compiled, h, rows, 3, 64)
    assert reused == ix.insert(reference, h, rows, 3, 64)  # the same tombstones get used up
    assert sorted(compiled.tolist()) == sorted(reference.tolist())  # the same entries, maybe other slots
    for idx in (compiled, reference):  # every new entry found along its own probe chain
        pos = ix.locate_rows(idx, rows, h, 3, 64)
        np.testing.assert_array_equal(idx[pos], rows.astype(np.uint32))
    home = ix.home_slots(h, 3, 64)
    last = {int(p): int(r) for p, r in zip(home, rows) if index[p] <= ix.TOMBSTONE}  # the last entry wins a free home
    for p, r in last.items():
        assert compiled[p] == reference[p] == r


@pytest.mark.parametrize(
    "rows, slots, match",
    [
        (np.array([5, 1], np.int64), 64, r"rows\[1\] = 1 is not a row number \(2\.\.4294967295\)"),
        (np.array([5, 2**32], np.int64), 64, r"rows\[1\] = 4294967296 is not a row number"),
        (np.array([5], np.int64), 64, r"rows has 1 elements, expected 2"),
        (np.array([5, 6], np.int64), 50, r"index has 192 slots, expected num_shards \* slots_per_region = 3 \* 50"),
        (np.array([5, 6], np.float64), 64, r"rows must be a 1-D array of 8-byte signed integer"),
    ],
)
def test_the_compiled_insert_refuses_bad_arguments_and_writes_nothing(rows, slots, match):
    index = np.zeros(192, np.uint32)
    h = np.array([1 << 40, 7 << 40], np.uint64)
    with pytest.raises(ValueError, match=match):
        _kernels.insert(index, h, rows, 3, slots)
    assert not index.any()


def test_the_compiled_insert_stops_at_a_full_region():
    index = np.full(128, 7, np.uint32)  # both regions full of other rows
    with pytest.raises(RuntimeError, match="index region is full: invariant broken"):
        kernels.insert(index, np.array([3 << 40], np.uint64), np.array([9], np.int64), 2, 64)


def test_a_store_rebuild_puts_the_most_recent_rows_home_on_both_paths():
    """Region rebuilds (growth, tombstones) insert oldest first and the compiled insert takes the
    last entry first, so a sign looked up more recently keeps its home slot on either path."""
    kernel, numpy_ = _pair(100_000, 2, AdagradConfig())
    signs = np.arange(1, 3001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    for s in (kernel, numpy_):
        s.lookup(signs, 8, True)
        s.lookup(signs[::2], 8, True)  # half of them more recent
        table = s._tables[8]
        table.grow(table.R * 4)  # every region rebuilt
        rows, hit, slots, home = table.locate(signs)
        assert hit.all()
        away = slots != home
        # a sign away from home has a home slot held by a row at least as recent
        assert (table.stamps[table.index[home[away]]] >= table.stamps[rows[away]]).all()
    np.testing.assert_array_equal(numpy_.lookup(signs, 8, False), kernel.lookup(signs, 8, False))


@pytest.mark.parametrize("cfg", [SGDConfig(lr=0.1), AdagradConfig(initial_accumulator_value=0.25), AdamConfig()],
                         ids=["sgd-no-state", "adagrad", "adam"])
@pytest.mark.parametrize("dim, seed, bounds", [(1, 0, (-0.01, 0.01)), (3, 7, (-1.0, 2.5)), (16, 0, (-0.05, 0.05)),
                                               (33, 2**40 + 3, (0.0, 1e-3))])
def test_new_rows_are_written_whole_with_numpys_initial_values_to_the_bit(cfg, dim, seed, bounds):
    rng = np.random.default_rng(dim)
    signs = rng.integers(0, 2**64 - 1, 500, dtype=np.uint64, endpoint=True)
    tables = []
    for use_kernel in (True, False):
        store = EmbeddingStore(10_000, 3, use_kernel=use_kernel)
        store.register_optimizer(cfg)
        store.lookup(signs[:10], dim, True)  # makes the table
        table = store._tables[dim]
        table.rows[:] = np.float32(np.nan)  # whatever was there must be overwritten
        table._init_rows(np.arange(2, 502), signs, 9, *bounds, seed)
        tables.append(table)
    kernel, numpy_ = tables
    np.testing.assert_array_equal(kernel.rows[2:502].view(np.uint32), numpy_.rows[2:502].view(np.uint32))
    np.testing.assert_array_equal(kernel.state[2:502], numpy_.state[2:502])
    np.testing.assert_array_equal(kernel.rows[2:502, :dim], uniform_from_signs(signs, dim, *bounds, seed))
    assert (kernel.stamps[2:502] == 9).all() and np.array_equal(kernel.signs_of_rows[2:502], signs)


@pytest.mark.parametrize(
    "field, bad, match",
    [
        ("at", np.array([2, 1], np.int64), r"at\[1\] = 1 is not a row of the table \(2\.\."),
        ("at", np.array([2, 10**6], np.int64), r"at\[1\] = 1000000 is not a row of the table"),
        ("signs", np.array([5], np.uint64), r"signs has 1 elements, expected 2"),
        ("stamp", 2**32, r"stamp 4294967296 does not fit a uint32"),
        ("stamp_col", 1, r"stamp_col 1 must be a cell of the row \(width \d+\) past the 4 weights"),
        ("key_col", 2, r"cannot hold dim 4 and a sign at column key_col 2"),
        ("state", np.zeros((3, 4), np.float32), r"state has 3 rows, expected"),
    ],
)
def test_init_rows_refuses_bad_arguments_and_writes_nothing(field, bad, match):
    _, table, _ = _table()
    before = table.rows.copy()
    args = dict(rows=table.rows, state=table.state, at=np.array([2, 3], np.int64), signs=np.array([5, 6], np.uint64),
                dim=4, key_col=table.key_col, stamp_col=table.stamp_col, stamp=3, lower=-0.1, upper=0.1, seed_salt=0,
                state_init=0.5)
    args[field] = bad
    with pytest.raises(ValueError, match=match):
        _kernels.init_rows(*args.values())
    np.testing.assert_array_equal(table.rows, before)
