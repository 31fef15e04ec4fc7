"""The embedding PS storage engine: rows per ``dim``, internal shards with their own locks,
capacity with batched LRU eviction, optimizers, checkpoints. No networking here.

Concurrency: lookups share the shards they touch (read locks, taken in ascending order) for the
whole probe-and-copy, so a row is never read half-evicted; updates, inserts and evictions own one
shard at a time; growth, ``load``'s swap, ``clear`` and optimizer changes own every shard. The
compiled kernels (and numpy, in its big gathers) release the GIL, so concurrent RPC threads on
different shards overlap. See docs/ps-storage.md.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from persia.embedding_ps import checkpoint as ckpt
from persia.embedding_ps import index as ix
from persia.embedding_ps import kernels
from persia.embedding_ps.applied import AppliedLog
from persia.embedding_ps.eviction import choose_victims
from persia.embedding_ps.optimizers import (
    OptimizerConfig,
    apply_step,
    initial_state_value,
    optimizer_code,
    state_width,
)
from persia.embedding_ps.rwlock import ShardLocks
from persia.embedding_ps.table import DimTable
from persia.hashing import unit_from_signs

log = logging.getLogger(__name__)

__all__ = ["HyperParameters", "EmbeddingStore", "LookupResult", "MAX_DIM"]

MAX_DIM = 1 << 16
_INITIAL_REGION_ROWS = 1024
_GROWTH = 1.5
_CLOCK_LIMIT = (1 << 32) - (1 << 24)  # stamps are uint32; rebased (rarely) before they could wrap
_CLOCK_KEEP = 1 << 24  # a rebase keeps this many lookups of recency apart; older rows tie as oldest
_BY_SHARD_MIN = 1024  # IDs per internal shard from which an update goes shard by shard (_update_by_shard)


class HyperParameters(BaseModel):
    """What the trainer pushes at start (PERSIA's EmbeddingConfig, flattened)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    init_lower: float = Field(default=-0.01, allow_inf_nan=False)
    init_upper: float = Field(default=0.01, allow_inf_nan=False)
    admit_probability: float = Field(default=1.0, gt=0, le=1)
    weight_bound: float = Field(default=10.0, ge=0, allow_inf_nan=False)
    # the user's seed: initial values and admission draws are functions of (ID, seed) only
    seed: int = Field(default=0, ge=0, lt=1 << 63)

    @model_validator(mode="after")
    def _bounds_in_order(self) -> "HyperParameters":
        if self.init_lower > self.init_upper:
            raise ValueError(f"init_lower {self.init_lower} > init_upper {self.init_upper}")
        return self


def _as_signs(signs, field: str = "signs") -> np.ndarray:
    arr = np.asarray(signs)
    if arr.ndim != 1:
        raise ValueError(f"{field} must be a 1-D array of uint64 IDs, got shape {arr.shape}")
    if arr.dtype == np.uint64:
        return arr
    if arr.size == 0:
        return arr.astype(np.uint64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{field} must hold unsigned 64-bit integer IDs, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.min() < 0:
        raise ValueError(f"{field} must be non-negative IDs, got {int(arr.min())}")
    return arr.astype(np.uint64)


def _as_dim(dim) -> int:
    if isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)) or not 0 < int(dim) <= MAX_DIM:
        raise ValueError(f"dim must be an integer in [1, {MAX_DIM}], got {dim!r}")
    return int(dim)


def _as_grads(grads, n: int) -> np.ndarray:
    arr = np.asarray(grads)
    if arr.ndim != 2 or arr.shape[0] != n:
        raise ValueError(f"grads must have shape (len(signs)={n}, dim), got {arr.shape}")
    _as_dim(arr.shape[1])
    if arr.dtype.kind != "f":
        raise ValueError(f"grads must be floating point, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _as_tag(value, field: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= 1 << 62:
        raise ValueError(f"field {field!r} must be an integer in [0, 2**62], got {value!r}")
    return int(value)


class LookupResult(NamedTuple):
    """What :meth:`EmbeddingStore.lookup_full` read, all in the critical section of the rows.

    ``rows`` float32 (n, dim); with ``state``: ``state`` float32 (n, state_width) (zeros where no
    row) and ``absent`` int32 positions with no row after the lookup; with ``applied``: sorted int64
    seqs >= since of that source which the rows (and state) reflect. Unrequested fields are None."""

    rows: np.ndarray
    state: np.ndarray | None = None
    absent: np.ndarray | None = None
    applied: np.ndarray | None = None


class EmbeddingStore:
    """Embedding rows of one PS replica.

    ``capacity`` bounds the live rows of all dims together; it is split evenly over the
    ``num_internal_shards`` shards, each evicting its own least recently used rows (batches of
    ``evict_fraction`` of the shard capacity; 0 evicts exactly what is needed).

    ``use_kernel``: probe and update in the compiled kernel (``None``: when it is built and
    ``PERSIA_PS_PURE_NUMPY`` is not set; ``False``: the pure-numpy path, same results).
    """

    def __init__(self, capacity: int, num_internal_shards: int = 1, *, seed: int = 0, evict_fraction: float = 1 / 64,
                 use_kernel: bool | None = None):
        if int(capacity) <= 0:
            raise ValueError(f"capacity must be a positive number of rows, got {capacity}")
        if int(num_internal_shards) <= 0:
            raise ValueError(f"num_internal_shards must be positive, got {num_internal_shards}")
        if not 0 <= evict_fraction < 1:
            raise ValueError(f"evict_fraction must be in [0, 1), got {evict_fraction}")
        self.use_kernel = kernels.resolve_use_kernel(use_kernel)
        self.capacity = int(capacity)
        self.num_shards = int(num_internal_shards)
        self.shard_capacity = math.ceil(self.capacity / self.num_shards)
        self.evict_batch = max(1, int(self.shard_capacity * evict_fraction))
        self._locks = ShardLocks(self.num_shards)
        self._rngs = [np.random.default_rng([int(seed), k]) for k in range(self.num_shards)]
        self._tables: dict[int, DimTable] = {}
        self._tables_lock = threading.Lock()
        self._hp = HyperParameters()
        self._configured = False
        self._optimizer: OptimizerConfig | None = None
        self._clock = 0
        self._clock_lock = threading.Lock()
        self._stats: Counter = Counter()
        self._stats_lock = threading.Lock()
        self._listeners: list[Callable[[int, np.ndarray], None]] = []
        self._staged: tuple[dict, int] | None = None  # a checkpoint staged for commit (stage/commit_staged)
        self._applied = AppliedLog()  # tagged updates' seqs per source (update_tables, lookup_full)

    # -- configuration --------------------------------------------------------------------------
    @property
    def hyperparameters(self) -> HyperParameters:
        return self._hp

    @property
    def configured(self) -> bool:
        """Whether the trainer pushed its hyperparameters (defaults apply until then)."""
        return self._configured

    @property
    def optimizer(self) -> OptimizerConfig | None:
        return self._optimizer

    def configure(self, hp: HyperParameters) -> None:
        if not isinstance(hp, HyperParameters):
            raise TypeError(f"configure expects HyperParameters, got {type(hp).__name__}")
        self._hp = hp
        self._configured = True

    def register_optimizer(self, cfg: OptimizerConfig) -> None:
        """Set the optimizer. Rows keep their weights; their state is kept when the new optimizer
        has the same type and state width (re-registration, or state loaded from a checkpoint),
        and reset to the optimizer's initial value otherwise."""
        code = optimizer_code(cfg)
        with self._locks.write():
            for table in self._tables.values():
                width = state_width(cfg, table.dim)
                if (table.state_code, table.state_width) != (code, width):
                    table.reset_state(width, initial_state_value(cfg))
                table.state_code = code
                table.state_init = initial_state_value(cfg)
            self._optimizer = cfg

    def add_update_listener(self, fn: Callable[[int, np.ndarray], None]) -> None:
        """Call ``fn(dim, signs)`` after every update with the signs whose rows changed."""
        self._listeners.append(fn)

    def remove_update_listener(self, fn: Callable[[int, np.ndarray], None]) -> None:
        self._listeners.remove(fn)

    # -- bookkeeping ----------------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            self._stats.update(deltas)

    def _tick(self) -> int:
        with self._clock_lock:
            self._clock += 1
            clock = self._clock
        if clock >= _CLOCK_LIMIT:
            self._rebase_clock()
            with self._clock_lock:
                self._clock += 1
                clock = self._clock
        return clock

    def _rebase_clock(self) -> None:
        """Shift every stamp down so the uint32 clock never wraps (once per ~4e9 lookups)."""
        with self._locks.write():
            with self._clock_lock:
                if self._clock < _CLOCK_LIMIT:
                    return
                shift = self._clock - _CLOCK_KEEP
                for table in self._tables.values():
                    st = table.stamps
                    live = st != 0
                    st[live] = np.maximum(st[live].astype(np.int64) - shift, 1).astype(np.uint32)
                self._clock -= shift

    def _table(self, dim: int) -> DimTable:
        table = self._tables.get(dim)
        if table is not None:
            return table
        with self._tables_lock:
            table = self._tables.get(dim)
            if table is None:
                cfg = self._optimizer
                table = DimTable(
                    dim,
                    self.num_shards,
                    min(_INITIAL_REGION_ROWS, self.shard_capacity),
                    state_width(cfg, dim),
                    initial_state_value(cfg),
                    self.use_kernel,
                )
                table.state_code = optimizer_code(cfg)
                self._tables = {**self._tables, dim: table}
        return table

    def _touched(self, h: np.ndarray) -> list[int] | None:
        """Shards a batch touches, ascending; None for every shard (a big batch: locking an
        untouched shard costs nothing but a little concurrency, and all of them is one count)."""
        if self.num_shards == 1 or h.shape[0] >= 32 * self.num_shards:
            return None
        return np.unique(ix.shard_ids(h, self.num_shards)).tolist()

    def _groups(self, h: np.ndarray):
        """(shard, positions) per touched shard; positions None means every sign (one shard)."""
        if self.num_shards == 1:
            return [(0, None)]
        shard = ix.shard_ids(h, self.num_shards)
        small = shard.astype(np.uint8 if self.num_shards <= 256 else np.uint16 if self.num_shards <= 65536 else np.int64)
        order = np.argsort(small, kind="stable")  # radix sort for small integer keys
        ends = np.cumsum(np.bincount(shard, minlength=self.num_shards))
        out, start = [], 0
        for k in range(self.num_shards):
            end = int(ends[k])
            if end > start:
                out.append((k, order[start:end]))
            start = end
        return out

    # -- data path ------------------------------------------------------------------------------
    def lookup(self, signs: np.ndarray, dim: int, train: bool, nonce: int | None = None) -> np.ndarray:
        """Rows of ``signs`` as float32 ``(n, dim)``.

        ``train``: missing rows are created (each with probability ``admit_probability``, with the
        deterministic initial value of its sign; a row not admitted reads as zeros) and every row
        read becomes most recently used. Not ``train``: nothing is created or refreshed; misses
        read as zeros. ``nonce`` (the batch id): admission draws are then a pure function of
        ``(sign, seed, nonce)``, the same on any number of PS replicas; without it, this store's
        random generator decides.
        """
        return self._lookup(_as_signs(signs), _as_dim(dim), train, nonce, False, None).rows

    def lookup_full(self, signs: np.ndarray, dim: int, train: bool, nonce: int | None = None, *,
                    state: bool = False, applied: tuple[int, int] | None = None) -> LookupResult:
        """:meth:`lookup`, reading more in the same critical section as the rows (own-update
        replay: the NN worker corrects the rows with its updates they miss).

        ``state``: the rows' optimizer state, and the positions with no row after the lookup
        (not admitted, or a miss of ``train=False``). ``applied=(source, since)``: the seqs >=
        ``since`` of that source's tagged updates (:meth:`update_tables`) the rows reflect. That
        answer is exact: a tagged update owns every shard, so none runs while a pass reads; and
        if one of the source's tagged updates ran between the first pass and the re-read of the
        rows this lookup inserted, the whole batch is read again with a fresh answer. ValueError
        naming ``applied.since`` when the source's seqs that old were pruned (nothing is created
        then)."""
        q = _as_signs(signs)
        dim = _as_dim(dim)
        query = None
        if applied is not None:
            source, since = applied
            query = (_as_tag(source, "applied.source"), _as_tag(since, "applied.since"))
            self._applied.check(*query)
        return self._lookup(q, dim, train, nonce, bool(state), query)

    def _lookup(self, q: np.ndarray, dim: int, train: bool, nonce: int | None, want_state: bool,
                query: tuple[int, int] | None) -> LookupResult:
        n = q.shape[0]
        out = np.empty((n, dim), dtype=np.float32)
        if n == 0 or (dim not in self._tables and not train):
            out.fill(0.0)
            if n:
                self._count(lookup_calls=1, lookup_ids=n, index_miss=n)
            seqs = self._applied.query(*query)[0] if query is not None else None
            st = self._zero_state(dim, n) if want_state else None
            return self._result(out, np.zeros(n, dtype=bool), st, want_state, seqs)
        self._table(dim)
        big = self.num_shards == 1 or n >= 32 * self.num_shards
        h = None if big else ix.sign_hash(q)  # a big batch hashes chunk by chunk inside locate
        touched = None if big else self._touched(h)
        clock = self._tick() if train else 0
        seqs = version = None
        with self._locks.read(touched):
            hit, st = self._gather(dim, q, out, clock if train else None, h, want_state)
            if query is not None:
                seqs, version = self._applied.query(*query)
        misses = n - int(np.count_nonzero(hit))
        self._count(lookup_calls=1, lookup_ids=n, index_miss=misses)
        if not train or misses == 0:
            return self._result(out, hit, st, want_state, seqs)
        # Rows read above stay valid answers even if evicted later (the lookup happened first);
        # only the misses need a second pass once they are inserted.
        miss = np.flatnonzero(~hit)
        mq = q[miss]
        mh = ix.sign_hash(mq) if h is None else h[miss]
        new_signs, first = np.unique(mq, return_index=True)
        if not self._insert_all_shards(dim, new_signs, mh[first], clock):
            self._insert(dim, new_signs, mh[first], clock, admit=True, nonce=nonce)
        sub = np.empty((miss.shape[0], dim), dtype=np.float32)
        with self._locks.read(self._touched(mh) if query is None else touched):
            table = self._tables.get(dim)
            if (query is not None and self._applied.version(query[0]) != version) or (
                    want_state and table is not None and table.state_width != st.shape[1]):
                # a tagged update of the source (or a new optimizer) came between the passes
                hit, st = self._gather(dim, q, out, clock, h, want_state)
                if query is not None:
                    seqs, version = self._applied.query(*query)
                return self._result(out, hit, st, want_state, seqs)
            sub_hit, sub_st = self._gather(dim, mq, sub, clock, mh, want_state)
        out[miss] = sub
        hit[miss] = sub_hit
        if want_state:
            st[miss] = sub_st
        return self._result(out, hit, st, want_state, seqs)

    def _gather(self, dim: int, q: np.ndarray, out: np.ndarray, stamp: int | None, h: np.ndarray | None,
                want_state: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """``(hit, state or None)`` of ``q``, weights into ``out``; the caller holds the read locks."""
        table = self._tables.get(dim)
        if table is None:  # cleared meanwhile
            out.fill(0.0)
            return np.zeros(q.shape[0], dtype=bool), self._zero_state(dim, q.shape[0]) if want_state else None
        if want_state:
            return table.gather_state(q, out, stamp, h)
        return table.gather(q, out, stamp, h), None

    def _zero_state(self, dim: int, n: int) -> np.ndarray:
        table = self._tables.get(dim)
        width = table.state_width if table is not None else state_width(self._optimizer, dim)
        return np.zeros((n, width), dtype=np.float32)

    @staticmethod
    def _result(rows, hit, st, want_state, seqs) -> LookupResult:
        absent = np.flatnonzero(~hit).astype(np.int32) if want_state else None
        return LookupResult(rows, st, absent, seqs)

    def update(self, signs: np.ndarray, grads: np.ndarray) -> int:
        """Apply one optimizer step to the rows of ``signs``; returns how many signs had no row.

        A missing row (evicted, never admitted) is counted in ``gradient_id_miss``, not an error.
        A sign repeated within one call gets the sum of its gradients in a single step (the
        embedding worker already reduces per distinct ID, so this is the rare path).
        """
        return self._apply_and_notify(*self._prepare_update(signs, grads))

    def update_tables(self, tables: Sequence[tuple[np.ndarray, np.ndarray]], *, source: int | None = None,
                      seqs: Sequence[int] = ()) -> int:
        """:meth:`update` of each ``(signs, grads)`` in turn; returns the signs without a row.

        With ``source`` (an update tagged for own-update replay): every table is applied while
        this store owns every shard, and ``seqs`` are recorded as applied for ``source`` before
        it lets go, so a lookup (:meth:`lookup_full`) sees all of the update or none of it, and
        is told which. Every table is checked before any is applied. Without ``source``: the
        per-shard locking of :meth:`update` (``seqs`` must then be empty)."""
        if source is None:
            if len(seqs):
                raise ValueError(f"field 'seqs' ({list(seqs)[:8]}) needs field 'source', which is None")
            prepared = [self._prepare_update(s, g) for s, g in tables]
            return sum(self._apply_and_notify(q, g, cfg) for q, g, cfg in prepared)
        source = _as_tag(source, "source")
        seqs = [_as_tag(s, "seqs") for s in seqs]
        prepared = [self._prepare_update(s, g) for s, g in tables]
        missing, changed = 0, []
        with self._locks.write():
            for q, g, cfg in prepared:
                if q.shape[0]:
                    m, c = self._apply_update(q, g, cfg, held=True)
                    missing += m
                    changed.append(c)
            self._applied.record(source, seqs)
        self._notify(changed)
        return missing

    def _apply_and_notify(self, q, g, cfg) -> int:
        if q.shape[0] == 0:
            return 0
        missing, changed = self._apply_update(q, g, cfg, held=False)
        self._notify([changed])
        return missing

    def _prepare_update(self, signs, grads) -> tuple[np.ndarray, np.ndarray, OptimizerConfig]:
        q = _as_signs(signs)
        g = _as_grads(grads, q.shape[0])
        cfg = self._optimizer
        if cfg is None:
            raise RuntimeError("update before register_optimizer: the trainer registers the embedding optimizer first")
        return q, g, cfg

    def _apply_update(self, q, g, cfg, held: bool) -> tuple[int, tuple[int, np.ndarray | None]]:
        """One table's step (``held``: the caller owns every shard). Returns (missing, (dim,
        updated signs or None)) for :meth:`_notify`, which runs once the locks are released."""
        n, dim = g.shape
        bound = self._hp.weight_bound
        apply = self._update_compiled if self.use_kernel else self._update_numpy
        missing, folded, promoted, updated = apply(q, g, dim, cfg, bound, held)
        self._count(update_calls=1, update_ids=n, gradient_id_miss=missing, duplicate_update_ids=folded,
                    index_promotions=promoted)
        return missing, (dim, updated)

    def _notify(self, changed: list[tuple[int, np.ndarray | None]]) -> None:
        for dim, updated in changed:
            if updated is not None and updated.shape[0]:
                for fn in list(self._listeners):
                    fn(dim, updated)

    def _shard_lock(self, k: int, held: bool):
        return nullcontext() if held else self._locks.write([k])

    def _update_compiled(self, q, g, dim, cfg, bound, held=False):
        """One kernel call, under the write locks of every shard the batch touches, locates the
        rows, steps the optimizer, clips and promotes (the kernel finds each sign's shard region
        itself; rows of different shards never interact, so this equals a call per shard, which
        with 100 shards cost more in calls and locks than the steps). A batch of at least
        ``_BY_SHARD_MIN`` IDs per shard goes shard by shard instead (:meth:`_update_by_shard`).
        Returns (missing, folded, promoted, updated signs)."""
        q = np.ascontiguousarray(q)  # g is already contiguous float32 (_as_grads)
        if 1 < self.num_shards and q.shape[0] >= _BY_SHARD_MIN * self.num_shards:
            return self._update_by_shard(q, g, dim, cfg, bound, held)
        hit = np.zeros(q.shape[0], dtype=bool)
        small = not held and 1 < self.num_shards and q.shape[0] < 32 * self.num_shards
        which = self._touched(ix.sign_hash(q)) if small else None
        with nullcontext() if held else self._locks.write(which):
            table = self._tables.get(dim)
            if table is None:
                return q.shape[0], 0, 0, None
            r = kernels.update(table, q, g, kernels.update_args(cfg, bound), hit)
        return r.missing, r.folded, r.promoted, (q[hit] if self._listeners else None)

    def _update_by_shard(self, q, g, dim, cfg, bound, held=False):
        """A big batch sorted by shard in one pass, then one kernel call per shard under that
        shard's write lock: each call's index region and repeat check then stay in cache (one call
        over a 1M-ID batch of a 10M-row table probed the whole index and an 8 MB repeat set at
        random: ``bench/ps_bench.py``'s update ratio 0.38-0.60 against 0.74-0.76 this way)."""
        bounds, q, g = kernels.partition(q, g, self.num_shards)
        args = kernels.update_args(cfg, bound)
        scratch = kernels.scratch_for(max(b - a for a, b in zip(bounds, bounds[1:])))
        hit = np.zeros(q.shape[0], dtype=bool)
        missing = folded = promoted = 0
        for k in range(self.num_shards):
            a, b = bounds[k], bounds[k + 1]
            if a == b:
                continue
            with self._shard_lock(k, held):
                table = self._tables.get(dim)
                if table is None:
                    missing += b - a
                    continue
                r = kernels.update(table, q[a:b], g[a:b], args, hit[a:b], scratch)
            missing += r.missing
            folded += r.folded
            promoted += r.promoted
        return missing, folded, promoted, (q[hit] if self._listeners else None)

    def _update_numpy(self, q, g, dim, cfg, bound, held=False):
        """Shard by shard under its write lock: locate, sum duplicates, gather, step, scatter,
        promote. Returns (missing, folded, promoted, updated signs)."""

        def step(w, s, gr):
            apply_step(cfg, w, s, gr, bound)

        h = ix.sign_hash(q)
        missing = folded = promoted = 0
        changed: list[np.ndarray] = []
        for k, sel in self._groups(h):
            qk = q if sel is None else q[sel]
            hk = h if sel is None else h[sel]
            gk = g if sel is None else np.take(g, sel, axis=0)
            with self._shard_lock(k, held):
                table = self._tables.get(dim)
                if table is None:
                    missing += qk.shape[0]
                    continue
                rows, hit, slots, home = table.locate(qk, hk)
                if not hit.all():
                    keep = np.flatnonzero(hit)
                    missing += qk.shape[0] - keep.shape[0]
                    rows, gk, qk, slots, home = rows[keep], np.take(gk, keep, axis=0), qk[keep], slots[keep], home[keep]
                folded += table.apply_gradients(rows, gk, step)
                promoted += table.promote(slots, home, rows)
            if self._listeners and qk.shape[0]:
                changed.append(qk)
        updated = (np.concatenate(changed) if len(changed) > 1 else changed[0]) if changed else None
        return missing, folded, promoted, updated

    # -- inserts, eviction, growth --------------------------------------------------------------
    def _insert_all_shards(self, dim: int, signs: np.ndarray, h: np.ndarray, clock: int) -> bool:
        """A lookup's new rows in one pass over every shard they fall in, when nothing needs a
        per-shard decision: every sign is admitted, and each touched shard takes its rows without
        growing (a shard at capacity evicts first, here, under the locks already held). Most
        training lookups insert a few rows spread over every shard, and the per-shard path's fixed
        cost (lock, locate, insert, ~0.1 ms each) was half the PS's CPU on the synthetic
        benchmark; at capacity every lookup took it (an evicting shard, or any shard's
        tombstones, ruled this path out: 3.3 ms a lookup of 3,000 IDs over 100 shards, against
        0.33 below capacity). False: no row was inserted (a shard may have evicted)."""
        if self.num_shards == 1 or self._hp.admit_probability < 1.0:
            return False
        shard = ix.shard_ids(h, self.num_shards)
        counts = np.bincount(shard, minlength=self.num_shards)
        touched = np.flatnonzero(counts)
        with self._locks.write(touched.tolist()):
            table = self._tables.get(dim)
            if table is None:
                return False
            _, hit, _, _ = table.locate(signs, h)
            if hit.any():  # another request inserted some meanwhile
                new = np.flatnonzero(~hit)
                signs, h, shard = signs[new], h[new], shard[new]
                counts = np.bincount(shard, minlength=self.num_shards)
                touched = np.flatnonzero(counts)
            m = counts[touched]
            live = sum(t.live[touched] for t in self._tables.values())
            for i in np.flatnonzero(live + m > self.shard_capacity).tolist():
                k, want = int(touched[i]), int(m[i])  # as the per-shard path: a batch of evictions
                excess = int(live[i]) + want - self.shard_capacity
                left = int(live[i]) - self._evict(k, max(excess, self.evict_batch), clock)
                if left + want > self.shard_capacity:
                    return False  # this very call overfills the shard: the per-shard path keeps what fits
            # room beyond the high-water mark first (vectorised); freed rows only where short
            short = np.flatnonzero(table.R - table.high_water[touched] < m)
            if any(table.room(int(touched[i])) < int(m[i]) for i in short.tolist()):
                return False
            if signs.shape[0]:
                table.insert_across(shard, signs, h, clock, self._hp.init_lower, self._hp.init_upper, self._hp.seed)
                self._count(inserted=int(signs.shape[0]))
        return True

    def _insert(self, dim, signs, h, clock, *, admit: bool, weights=None, state=None, state_code=None,
                nonce: int | None = None) -> int:
        """Insert absent signs shard by shard; with ``weights``, also overwrite present rows
        (``upsert``). Returns the number of rows written."""
        written = 0
        for k, sel in self._groups(h):
            pick = (lambda a: a) if sel is None else (lambda a, sel=sel: None if a is None else a[sel])
            written += self._insert_shard(
                dim, k, pick(signs), pick(h), clock, admit, pick(weights), pick(state), state_code, nonce
            )
        return written

    def _insert_shard(self, dim, k, signs, h, clock, admit, weights, state, state_code, nonce=None) -> int:
        """Insert into shard ``k`` under its lock; returns rows written. Admission and capacity
        decisions are taken once per sign: a retry after growing the table keeps them."""
        hp = self._hp
        written = 0
        while True:
            with self._locks.write([k]):
                table = self._table(dim)
                rows, hit, _, _ = table.locate(signs, h)
                keep_state = state is not None and state_code == table.state_code and state.shape[1] == table.state_width
                if weights is not None and hit.any():  # upsert: overwrite what is there
                    table.overwrite(rows[hit], weights[hit], state[hit] if keep_state else None)
                    table.stamps[rows[hit]] = clock
                    written += int(np.count_nonzero(hit))
                new = np.flatnonzero(~hit)
                if admit and hp.admit_probability < 1.0 and new.size:
                    draw = (self._rngs[k].random(new.shape[0]) if nonce is None
                            else unit_from_signs(signs[new], hp.seed, nonce))
                    chosen = draw < hp.admit_probability
                    self._count(not_admitted=int(new.shape[0] - np.count_nonzero(chosen)))
                    new = new[chosen]
                admit = False
                m = new.shape[0]
                if m:
                    live = sum(int(t.live[k]) for t in self._tables.values())
                    excess = live + m - self.shard_capacity
                    if excess > 0:
                        live -= self._evict(k, max(excess, self.evict_batch), clock)
                        room = max(self.shard_capacity - live, 0)
                        if m > room:  # rows of this very call fill the shard: keep what fits
                            self._count(capacity_rejected=m - room)
                            new, m = new[:room], room
                if m == 0:
                    return written
                if table.room(k) >= m:
                    table.insert(k, signs[new], h[new], clock, hp.init_lower, hp.init_upper,
                                 None if weights is None else weights[new], state[new] if keep_state else None,
                                 hp.seed)
                    self._count(inserted=m)
                    return written + m
                grow_to = int(table.high_water[k]) + m - int(table.free[k].shape[0])
                # retry with only the rows still to insert (decisions above are final)
                signs, h = signs[new], h[new]
                weights = None if weights is None else weights[new]
                state = None if state is None else state[new]
            self._grow(dim, grow_to)

    def _evict(self, k: int, goal: int, clock: int) -> int:
        """Evict up to ``goal`` least recently used rows of shard ``k`` (caller owns the shard)."""
        tables = list(self._tables.values())
        stamps = [t.region_stamps(k) for t in tables]
        victims = choose_victims(stamps, goal, clock)
        evicted = 0
        for table, local in zip(tables, victims):
            if local.shape[0]:
                table.remove(k, local)
                evicted += local.shape[0]
        if evicted:
            self._count(evictions=evicted)
        return evicted

    def _grow(self, dim: int, needed_rows: int) -> None:
        with self._locks.write():
            table = self._tables.get(dim)
            if table is None or table.R >= needed_rows:
                return
            cap = max(needed_rows, self.shard_capacity)
            table.grow(min(cap, max(needed_rows, math.ceil(table.R * _GROWTH))))

    # -- other row access -----------------------------------------------------------------------
    def contains(self, signs: np.ndarray, dim: int) -> np.ndarray:
        """Which signs have a row of ``dim`` (no recency change)."""
        q = _as_signs(signs)
        dim = _as_dim(dim)
        if dim not in self._tables or q.shape[0] == 0:
            return np.zeros(q.shape[0], dtype=bool)
        h = ix.sign_hash(q)
        with self._locks.read(self._touched(h)):
            table = self._tables.get(dim)
            if table is None:
                return np.zeros(q.shape[0], dtype=bool)
            return table.locate(q, h).hit

    def read_rows(self, signs: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``(found_signs, weights, state, state_code)`` of the present rows (incremental dumps)."""
        q = _as_signs(signs)
        dim = _as_dim(dim)
        if dim not in self._tables or q.shape[0] == 0:
            return q[:0], np.zeros((0, dim), np.float32), np.zeros((0, 0), np.float32), 0
        h = ix.sign_hash(q)
        with self._locks.read(self._touched(h)):
            table = self._tables.get(dim)
            if table is None:
                return q[:0], np.zeros((0, dim), np.float32), np.zeros((0, 0), np.float32), 0
            rows, hit, _, _ = table.locate(q, h)
            rows = rows[hit]
            weights, state = table.read(rows)
            return q[hit], weights, state, table.state_code

    def upsert(self, signs: np.ndarray, dim: int, weights: np.ndarray, state: np.ndarray | None = None, state_code: int | None = None) -> int:
        """Write rows as given (insert or overwrite), evicting LRU rows if needed (inference side of
        incremental updates). ``state`` is kept only if ``state_code`` and its width match the
        registered optimizer's. Returns the number of rows written."""
        q = _as_signs(signs)
        dim = _as_dim(dim)
        w = np.asarray(weights, dtype=np.float32)
        if w.shape != (q.shape[0], dim):
            raise ValueError(f"weights must have shape ({q.shape[0]}, {dim}), got {w.shape}")
        if q.shape[0] == 0:
            return 0
        if np.unique(q).shape[0] != q.shape[0]:
            raise ValueError("upsert: signs must be distinct")
        h = ix.sign_hash(q)
        return self._insert(dim, q, h, self._tick(), admit=False, weights=w, state=state, state_code=state_code)

    # -- whole-store operations -----------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(t) for t in self._tables.values())

    def dims(self) -> list[int]:
        return sorted(self._tables)

    def clear(self) -> None:
        """Drop every row, and the record of applied tagged updates (the rows no longer reflect them)."""
        with self._locks.write():
            self._tables = {}
            self._applied.clear()

    def memory_bytes(self) -> int:
        """Bytes of every preallocated array (the resident size once rows are written)."""
        return sum(t.nbytes() for t in self._tables.values())

    def stats(self) -> dict:
        """Counters (monotonic) and gauges, flat and Prometheus-friendly."""
        with self._stats_lock:
            s = dict(self._stats)
        out = {
            key: int(s.get(key, 0))
            for key in (
                "lookup_calls", "lookup_ids", "index_miss", "inserted", "not_admitted", "capacity_rejected",
                "evictions", "update_calls", "update_ids", "gradient_id_miss", "duplicate_update_ids",
                "loaded_rows", "dumped_rows", "index_promotions",
            )
        }
        out["index_miss_ratio"] = out["index_miss"] / out["lookup_ids"] if out["lookup_ids"] else 0.0
        out.update(
            rows=len(self),
            capacity=self.capacity,
            internal_shards=self.num_shards,
            dims=len(self._tables),
            memory_bytes=self.memory_bytes(),
        )
        return out

    # -- checkpoints ----------------------------------------------------------------------------
    def _snapshot_shard(self, k: int) -> list[tuple[DimTable, tuple]]:
        """Copy shard ``k``'s rows of every dim; training waits for this copy only."""
        with self._locks.read([k]):
            return [(t, t.snapshot_region(k)) for t in self._tables.values()]

    def dump(self, directory: str | Path, replica_index: int, num_workers: int = 4, *, replica_size: int | None = None, fsync: bool = True) -> None:
        """Write this replica's rows to ``directory/s<replica_index>/`` plus its done marker.

        One job per internal shard on a pool of ``num_workers`` threads; each job holds its
        shard's lock only while copying the shard, then writes the copy."""
        rows = ckpt.dump_store(self, Path(directory), int(replica_index), int(num_workers), replica_size, fsync)
        self._count(dumped_rows=rows)

    def load(self, directory: str | Path, replica_index: int, replica_size: int, num_workers: int = 4) -> None:
        """Replace the store's rows by a checkpoint's rows that belong to this replica.

        Works whatever number of replicas wrote it (rows are re-sharded with
        ``shard_of(sign, replica_size)``). Every file is validated, and the new tables are built
        beside the current ones, before anything changes: a refused checkpoint leaves the store as
        it was. Peak memory is the current tables plus the new ones."""
        self.stage(directory, replica_index, replica_size, num_workers)
        self.commit_staged()

    def stage(self, directory: str | Path, replica_index: int, replica_size: int, num_workers: int = 4) -> int:
        """First half of ``load``: validate the checkpoint and build its tables beside the live
        ones (nothing live changes); returns the staged rows. ``commit_staged`` swaps them in,
        ``discard_staged`` drops them: the trainer stages on every replica, then commits on every
        replica only when all staged (all-or-nothing across replicas)."""
        if not 0 <= int(replica_index) < int(replica_size):
            raise ValueError(f"replica_index {replica_index} is not in [0, replica_size={replica_size})")
        self.discard_staged()
        files = ckpt.open_checkpoint(Path(directory), int(replica_index), int(replica_size), int(num_workers))
        try:
            total = sum(f.rows for f in files)
            if total > self.capacity:
                raise ValueError(
                    f"checkpoint {directory} holds {total} rows for replica {replica_index}/{replica_size}, "
                    f"more than this PS's capacity of {self.capacity} rows"
                )
            tables = self._build_tables(files, max(1, int(num_workers)))
        finally:
            for f in files:
                f.close()
        self._staged = (tables, total)
        return total

    def commit_staged(self) -> int:
        """Swap the staged tables in; returns their rows. Without a staged checkpoint: an error."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise RuntimeError("no staged checkpoint to commit (stage it first)")
        tables, total = staged
        with self._locks.write():
            self._tables = tables
            self._applied.clear()  # the loaded rows reflect none of the updates recorded so far
        self._count(loaded_rows=total)
        return total

    def discard_staged(self) -> bool:
        """Drop a staged checkpoint (if any); the live rows are untouched."""
        had, self._staged = self._staged is not None, None
        return had

    def _build_tables(self, files: list, num_workers: int) -> dict[int, DimTable]:
        stamp = self._tick()
        cfg = self._optimizer
        by_dim: dict[int, list] = {}
        for f in files:
            by_dim.setdefault(f.header.dim, []).append(f)
        tables: dict[int, DimTable] = {}
        with ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="ps-build") as pool:
            for dim, group in by_dim.items():
                code, width = group[0].header.state_code, group[0].header.state_width
                parts = [f.part() for f in group]
                if cfg is not None and (code, width) != (optimizer_code(cfg), state_width(cfg, dim)):
                    log.warning(
                        "checkpoint rows of dim %d carry state of optimizer code %d (width %d); the registered "
                        "optimizer differs, so their state starts from its initial value", dim, code, width,
                    )
                    code, width = optimizer_code(cfg), state_width(cfg, dim)
                    parts = [(s, w, np.full((s.shape[0], width), initial_state_value(cfg), np.float32)) for s, w, _ in parts]
                init = initial_state_value(cfg) if cfg is not None else 0.0
                table = DimTable.from_parts(dim, self.num_shards, parts, width, init, self.shard_capacity, stamp, pool,
                                            self.use_kernel)
                table.state_code = code
                tables[dim] = table
        return tables
