"""All rows of one embedding ``dim`` on one PS: preallocated arrays split into shard regions.

Layout (``S`` internal shards, ``R`` rows per shard region, row ``g = 2 + shard * R + local``;
rows 0 and 1 are the sentinels that EMPTY and TOMBSTONE index slots point at):

* ``rows``   float32 ``(2 + S*R, width)``: the weights (``dim`` floats), then the row's *stamp*
  (one ``uint32`` cell: the store clock of the row's last training lookup, 0 = free), then the
  row's sign as two float32 cells (one ``uint64``; :func:`row_layout`). Keeping
  the sign and the stamp inside the row lets a training lookup confirm its index entry and stamp
  the row in the cache lines that bring the weights (76 bytes at dim 16): no separate stamp array,
  so no third random memory access per ID. ``stamps`` is a strided ``uint32`` view of that cell.
* ``state``  float32 ``(2 + S*R, state_width)``: optimizer state, gathered only by updates.
* ``index``  uint32 ``(S*M,)``: the open-addressing index (:mod:`persia.embedding_ps.index`).

A shard's rows occupy ``[0, high_water)`` of its region; evicted rows go to a per-shard free list
and are reused first. Regions grow together (x1.5, capped) when one fills, under every shard lock.
This class does no locking: :class:`~persia.embedding_ps.store.EmbeddingStore` holds the locks.

With ``use_kernel`` the probes (and the store's updates) run in the compiled kernel
(:mod:`persia.embedding_ps.kernels`); the numpy code below is the fallback and the reference.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from persia.embedding_ps import index as ix
from persia.embedding_ps import kernels
from persia.hashing import uniform_from_signs

CHUNK = 1 << 15  # IDs per vectorized pass: temporaries stay in cache (measured best of 2**13..2**17)
_ALIGN = 64  # cache line


class Located(NamedTuple):
    """Where a batch of signs is: ``rows`` (valid where ``hit``), the index ``slots`` holding them
    and each sign's ``home`` slot (the same array when every found sign is at home)."""

    rows: np.ndarray
    hit: np.ndarray
    slots: np.ndarray
    home: np.ndarray


def zeros_aligned(shape, dtype) -> np.ndarray:
    """``np.zeros`` starting on a 64-byte boundary (calloc'ed, so pages appear only when touched).
    numpy aligns to 16 bytes; at 64 a row of 16 floats of state is one cache line, not two, which
    saves a random memory access per row in every update."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    buf = np.zeros(count * dtype.itemsize + _ALIGN, dtype=np.uint8)
    start = -buf.ctypes.data % _ALIGN
    return buf[start : start + count * dtype.itemsize].view(dtype).reshape(shape)


def row_layout(dim: int) -> tuple[int, int, int]:
    """``(stamp_col, key_col, width)`` of a row of ``dim`` weights: the uint32 stamp right after the
    weights, then the uint64 sign in two cells. dim 16: 19 cells, 76 bytes; the stamp costs no
    memory (it replaced a separate 4-byte-per-row array) and an odd dim's former pad cell holds it."""
    return dim, dim + 1, dim + 3


def _void(a: np.ndarray) -> np.ndarray:
    """View a C-contiguous 2-D float32 array as one opaque item per row (fast row scatter)."""
    return a.view(np.dtype((np.void, a.shape[1] * a.itemsize))).reshape(a.shape[0])


class DimTable:
    """The arrays of one dim and their per-shard bookkeeping (high-water mark, live rows,
    tombstones, free list)."""

    def __init__(self, dim: int, num_shards: int, rows_per_region: int, state_width: int, state_init: float,
                 use_kernel: bool = False):
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.use_kernel = kernels.resolve_use_kernel(use_kernel)
        self.dim = dim
        self.num_shards = num_shards
        self.stamp_col, self.key_col, self.width = row_layout(dim)
        self.state_width = state_width
        self.state_init = float(state_init)
        self.state_code = 0  # optimizer code of the state columns (checkpoint header)
        self.high_water = np.zeros(num_shards, dtype=np.int64)
        self.live = np.zeros(num_shards, dtype=np.int64)
        self.tombstones = np.zeros(num_shards, dtype=np.int64)
        self.free: list[np.ndarray] = [np.empty(0, dtype=np.int64) for _ in range(num_shards)]
        self.rebuilds = 0  # index regions rebuilt (growth, tombstones)
        self._allocate(max(1, rows_per_region))

    # -- storage --------------------------------------------------------------------------------
    def _allocate(self, rows_per_region: int) -> None:
        self.M = ix.slots_for_region(rows_per_region, self.num_shards)
        self.R = rows_per_region
        n = self._total_rows()
        self.rows = zeros_aligned((n, self.width), np.float32)  # calloc: pages appear when touched
        self.state = zeros_aligned((n, self.state_width), np.float32)
        self.index = zeros_aligned(self.num_shards * self.M, ix.SLOT_DTYPE)
        self._views()

    def _total_rows(self) -> int:
        n = ix.FIRST_ROW + self.num_shards * self.R
        if n > ix.MAX_ROWS:
            raise ValueError(f"{n} rows of dim {self.dim} do not fit one PS table (at most {ix.MAX_ROWS})")
        return n

    def base(self, shard) -> int:
        """Row number of local row 0 of ``shard`` (an int or an int64 array)."""
        return ix.FIRST_ROW + shard * self.R

    def _views(self) -> None:
        self.signs_of_rows = self.rows[:, self.key_col : self.key_col + 2].view(np.uint64)[:, 0]
        self.stamps = self.rows[:, self.stamp_col].view(np.uint32)
        self._weights_item = np.dtype((np.void, 4 * self.dim))
        self._rows_v = _void(self.rows)
        self._state_v = _void(self.state) if self.state_width else None

    def nbytes(self) -> int:
        """Bytes of the preallocated arrays (resident once touched)."""
        return self.rows.nbytes + self.state.nbytes + self.index.nbytes

    def __len__(self) -> int:
        return int(self.live.sum())

    def room(self, shard: int) -> int:
        """Rows shard ``shard`` can take without growing its region."""
        return int(self.free[shard].shape[0] + self.R - self.high_water[shard])

    def _stored_signs(self, rows: np.ndarray) -> np.ndarray:
        return self.signs_of_rows[rows]

    # -- lookups --------------------------------------------------------------------------------
    def locate(self, signs: np.ndarray, h: np.ndarray | None = None, out: np.ndarray | None = None) -> Located:
        """Find the rows of ``signs`` (``h``: their :func:`~persia.embedding_ps.index.sign_hash`,
        computed here when not given); with ``out`` (n, dim) also copy their weights, zeros for
        misses. The caller holds the locks of the signs' shards.

        Compiled: one pass per sign (:func:`~persia.embedding_ps.kernels.locate`). numpy: each
        cache-sized chunk hashes its signs, reads their home slots and gathers those rows whole,
        comparing the sign stored in the row; only the few signs not in their home slot then take
        further probe rounds, vectorized over all of them."""
        if self.use_kernel:
            rows, hit, slots, home, _ = kernels.locate(self, signs, out)
            return Located(rows, hit, slots, home)
        n = signs.shape[0]
        rows = np.empty(n, dtype=np.int64)
        slots = np.empty(n, dtype=np.int64)
        hit = np.empty(n, dtype=bool)
        out_rows = None if out is None else _void(out)
        key = slice(self.key_col, self.key_col + 2)
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            hc = ix.sign_hash(signs[a:b]) if h is None else h[a:b]
            pos = ix.home_slots(hc, self.num_shards, self.M)
            slots[a:b] = pos
            g = np.take(self.index, pos)  # row numbers; sentinel rows 0/1 for EMPTY/TOMBSTONE
            rows[a:b] = g
            if out is None:
                np.equal(self.signs_of_rows[g], signs[a:b], out=hit[a:b])
            else:
                block = np.take(self.rows, g, axis=0)
                np.equal(block[:, key].view(np.uint64)[:, 0], signs[a:b], out=hit[a:b])
                out_rows[a:b] = self._weights_of(block)
        if n == 0 or (hit.all() and rows.min() >= ix.FIRST_ROW):
            return Located(rows, hit, slots, slots)
        hit &= rows >= ix.FIRST_ROW  # a sentinel row's sign (0) must not answer a query for sign 0
        pending = np.flatnonzero(~hit & (rows != ix.EMPTY))  # home slot holds another row: probe on
        home = slots
        if pending.size:
            home = slots.copy()
            self._probe_pending(signs, slots, rows, hit, pending, out_rows)
        if out is not None and not hit.all():
            out[~hit] = 0.0
        return Located(rows, hit, slots, home)

    def gather(self, signs: np.ndarray, out: np.ndarray, stamp: int | None, h: np.ndarray | None = None) -> np.ndarray:
        """Copy the weights of ``signs`` into ``out`` (zeros for misses) and, for a training lookup,
        stamp the found rows with ``stamp``; returns which signs were found. The caller holds the
        read locks of the signs' shards (concurrent stamps of one row are equally recent)."""
        if self.use_kernel:
            return kernels.locate(self, signs, out, positions=False, stamp=stamp)[1]
        rows, hit, _, _ = self.locate(signs, h, out)
        if stamp is not None:
            self.stamps[rows if hit.all() else rows[hit]] = stamp
        return hit

    def gather_state(self, signs: np.ndarray, out: np.ndarray, stamp: int | None,
                     h: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`gather`, also returning the found rows' optimizer state, float32
        ``(n, state_width)``, zeros for misses: ``(hit, state)``. One vectorized take."""
        if self.use_kernel:
            rows, hit, _, _, _ = kernels.locate(self, signs, out, stamp=stamp)
            found = hit.all()
        else:
            rows, hit, _, _ = self.locate(signs, h, out)
            found = hit.all()
            if stamp is not None:
                self.stamps[rows if found else rows[hit]] = stamp
        if found:
            return hit, np.take(self.state, rows, axis=0)
        state = np.take(self.state, np.where(hit, rows, 0), axis=0)
        state[~hit] = 0.0
        return hit, state

    def _probe_pending(self, signs, pos, g, hit, pending, out_rows) -> None:
        """Linear probe rounds for the signs not found at home, vectorized over all of them.
        Each round gathers whole rows, so a found row's weights are copied out at once."""
        p = pos[pending]
        q = signs[pending]
        key = slice(self.key_col, self.key_col + 2)
        for _ in range(self.M):  # bounded: a region always keeps EMPTY slots (needs_rebuild)
            p = ix.next_slots(p, self.M)
            r = np.take(self.index, p).astype(np.int64)
            if out_rows is None:
                found = self.signs_of_rows[r] == q
            else:
                block = np.take(self.rows, r, axis=0)
                found = block[:, key].view(np.uint64)[:, 0] == q
            found &= r >= ix.FIRST_ROW
            done = found | (r == ix.EMPTY)
            if done.any():
                at = pending[found]
                g[at] = r[found]
                hit[at] = True
                pos[at] = p[found]
                if out_rows is not None and at.size:
                    out_rows[at] = self._weights_of(block[found])
                if done.all():
                    return
                keep = ~done
                pending, p, q = pending[keep], p[keep], q[keep]
        raise RuntimeError("index region has no empty slot: invariant broken")

    def _weights_of(self, block: np.ndarray) -> np.ndarray:
        """The weights of gathered rows as one opaque item per row (a strided view, no copy)."""
        return np.ndarray(shape=(block.shape[0],), dtype=self._weights_item, buffer=block, strides=(block.strides[0],))

    # -- mutation -------------------------------------------------------------------------------
    def insert(self, shard: int, signs, h, stamp: int, lower: float, upper: float, weights=None, state=None,
               seed: int = 0) -> np.ndarray:
        """Add absent ``signs`` to ``shard`` (the caller checked absence and ``room``); returns the rows.

        New rows get ``weights`` or the deterministic uniform initial value, ``state`` or the
        optimizer's initial state value, and ``stamp``.
        """
        m = signs.shape[0]
        if m == 0:
            return np.empty(0, dtype=np.int64)
        free = self.free[shard]
        reuse = min(free.shape[0], m)
        local = np.concatenate([free[free.shape[0] - reuse :], np.arange(self.high_water[shard], self.high_water[shard] + m - reuse)])
        self.free[shard] = free[: free.shape[0] - reuse]
        self.high_water[shard] += m - reuse
        g = local + self.base(shard)
        if weights is None and state is None:
            self._init_rows(g, signs, stamp, lower, upper, seed)
        else:  # an upsert or a restore: the values given, initial ones for the rest
            self._write_rows(g, signs, stamp, uniform_from_signs(signs, self.dim, lower, upper, seed)
                             if weights is None else weights, state)
        reused = self._index_insert(h, g)
        self.tombstones[shard] -= reused
        self.live[shard] += m
        return g

    def _init_rows(self, g: np.ndarray, signs: np.ndarray, stamp: int, lower: float, upper: float, seed: int) -> None:
        """New rows ``g`` written whole: the deterministic initial weights of their ``signs``, the
        sign, ``stamp`` and the optimizer's initial state. Compiled: one pass, the same floats."""
        if self.use_kernel:
            kernels.init_rows(self, g, signs, stamp, lower, upper, seed)
        else:
            self._write_rows(g, signs, stamp, uniform_from_signs(signs, self.dim, lower, upper, seed), None)

    def _write_rows(self, g: np.ndarray, signs: np.ndarray, stamp: int, weights: np.ndarray,
                    state: np.ndarray | None) -> None:
        """Rows ``g`` written whole with ``weights`` and ``state`` (None: the initial state value)."""
        block = np.zeros((g.shape[0], self.width), dtype=np.float32)
        block[:, : self.dim] = weights
        block[:, self.key_col : self.key_col + 2].view(np.uint64)[:, 0] = signs
        self._rows_v[g] = _void(block)
        if self.state_width:
            st = (np.full((g.shape[0], self.state_width), self.state_init, dtype=np.float32) if state is None
                  else np.ascontiguousarray(state, dtype=np.float32))
            self._state_v[g] = _void(st)
        self.stamps[g] = stamp

    def _index_insert(self, h: np.ndarray, g: np.ndarray) -> int:
        """New entries ``(hash, row)`` into the index (absent signs; the caller owns their shards);
        returns the tombstones reused. Compiled: one pass (a few µs for a batch's new rows, where
        numpy's rounds took ~0.1 ms, and a region rebuild several times faster)."""
        if self.use_kernel:
            return kernels.insert(self.index, h, g, self.num_shards, self.M)
        return ix.insert(self.index, h, g, self.num_shards, self.M)

    def insert_across(self, shards: np.ndarray, signs, h, stamp: int, lower: float, upper: float,
                      seed: int = 0) -> np.ndarray:
        """:meth:`insert` of absent ``signs`` spread over several shards (``shards[i]`` is sign
        i's), with initial values. The caller owns those shards and checked ``room``. The index
        insert may reuse tombstoned slots; the shards' ``tombstones`` counts then stay as they
        were, an upper bound (one call does not tell which shard reused how many): a region is
        only rebuilt sooner, when the count says half its slots are taken. Returns the rows."""
        m = signs.shape[0]
        g = np.empty(m, dtype=np.int64)
        order = np.argsort(shards, kind="stable")
        ks, starts, counts = np.unique(shards[order], return_index=True, return_counts=True)
        if not any(self.free[k].shape[0] for k in ks.tolist()):
            # No freed rows to reuse (no eviction yet, the usual case): each shard's new rows
            # continue from its high-water mark, in the order a per-shard loop gives them.
            sorted_shards = shards[order]
            rank = np.arange(m) - np.repeat(starts, counts)
            g[order] = self.base(sorted_shards) + self.high_water[sorted_shards] + rank
            self.high_water[ks] += counts
            self.live[ks] += counts
        else:
            # freed rows first (the last ones freed), then rows past the high-water mark; at
            # capacity this loop runs for every shard a lookup touches, so it does little per shard
            bases = self.base(ks)
            for k, a, c, base in zip(ks.tolist(), starts.tolist(), counts.tolist(), bases.tolist()):
                free = self.free[k]
                nf = free.shape[0]
                if nf >= c:
                    local = free[nf - c :]
                    self.free[k] = free[: nf - c]
                else:
                    hw = int(self.high_water[k])
                    local = np.concatenate([free, np.arange(hw, hw + c - nf)])
                    self.free[k] = free[:0]
                    self.high_water[k] += c - nf
                g[order[a : a + c]] = local + base
            self.live[ks] += counts
        self._init_rows(g, signs, stamp, lower, upper, seed)
        self._index_insert(h, g)
        return g

    def overwrite(self, rows: np.ndarray, weights: np.ndarray, state: np.ndarray | None) -> None:
        """Replace the weights (and state, when given) of existing rows."""
        self.rows[rows, : self.dim] = weights
        if state is not None and self.state_width:
            self.state[rows] = state

    def remove(self, shard: int, local: np.ndarray) -> np.ndarray:
        """Evict rows of ``shard``; returns their signs."""
        g = local + self.base(shard)
        signs = self.signs_of_rows[g].copy()
        h = ix.sign_hash(signs)
        pos = ix.locate_rows(self.index, g, h, self.num_shards, self.M)
        self.index[pos] = ix.TOMBSTONE
        self.stamps[g] = 0
        self.free[shard] = np.concatenate([self.free[shard], local])
        self.live[shard] -= local.shape[0]
        self.tombstones[shard] += local.shape[0]
        if ix.needs_rebuild(int(self.live[shard]), int(self.tombstones[shard]), self.M):
            self.rebuild_region(shard)
        return signs

    def region_stamps(self, shard: int) -> np.ndarray:
        """Stamps of the shard's used rows (a view; index = local row)."""
        base = self.base(shard)
        return self.stamps[base : base + int(self.high_water[shard])]

    def rebuild_region(self, shard: int) -> None:
        """Re-insert the shard's live rows into a clean index region (drops tombstones). Rows go
        in oldest first: where several claim one home slot the last writer wins, so the most
        recently used rows get their home slots."""
        stamps = self.region_stamps(shard)
        live = np.flatnonzero(stamps != 0)
        g = live[np.argsort(stamps[live], kind="stable")] + self.base(shard)  # radix sort, newest last
        self.index[shard * self.M : (shard + 1) * self.M] = ix.EMPTY
        self._index_insert(ix.sign_hash(self.signs_of_rows[g]), g)
        self.tombstones[shard] = 0
        self.rebuilds += 1

    def promote(self, slots: np.ndarray, home: np.ndarray, rows: np.ndarray) -> int:
        """Move found rows whose index entry is not in its home slot into it when the row there is
        less recently used (the caller owns the rows' shards). Returns how many moved.

        Swapping two entries of one probe chain keeps every sign reachable (no slot becomes
        EMPTY, and the displaced entry moves further along a chain it already could reach), so
        hot signs drift home and most lookups need a single probe."""
        away = np.flatnonzero(slots != home)
        if away.size == 0:
            return 0
        home, slots, rows = home[away], slots[away], rows[away]
        occupant = np.take(self.index, home).astype(np.int64)  # a row, or TOMBSTONE (never EMPTY)
        older = self.stamps[occupant] < self.stamps[rows]  # sentinel row 1 has stamp 0: always older
        sel = np.flatnonzero(older)
        if sel.size == 0:
            return 0
        home, slots, rows, occupant = home[sel], slots[sel], rows[sel], occupant[sel]
        # keep pairs whose two slots no other pair touches: write a token per pair into both
        # slots, read back, restore
        saved_home = np.take(self.index, home)
        saved_slot = np.take(self.index, slots)
        token = np.arange(ix.FIRST_ROW, ix.FIRST_ROW + sel.size, dtype=ix.SLOT_DTYPE)
        self.index[home] = token
        self.index[slots] = token
        alone = (np.take(self.index, home) == token) & (np.take(self.index, slots) == token)
        self.index[home] = saved_home
        self.index[slots] = saved_slot
        self.index[home[alone]] = rows[alone].astype(ix.SLOT_DTYPE)
        self.index[slots[alone]] = occupant[alone].astype(ix.SLOT_DTYPE)
        return int(np.count_nonzero(alone))

    def grow(self, rows_per_region: int) -> None:
        """Enlarge every shard region (caller owns every shard); one array at a time to bound the peak."""
        old_r = self.R
        if rows_per_region <= old_r:
            return
        # sized (and refused) before anything changes: a refused growth leaves the table usable
        slots = ix.slots_for_region(rows_per_region, self.num_shards)
        n = ix.FIRST_ROW + self.num_shards * rows_per_region
        if n > ix.MAX_ROWS:
            raise ValueError(f"{n} rows of dim {self.dim} do not fit one PS table (at most {ix.MAX_ROWS})")
        hw = self.high_water
        self.signs_of_rows = self.stamps = self._rows_v = self._state_v = None  # drop views so old arrays can go
        self.R = rows_per_region
        self.M = slots
        first = ix.FIRST_ROW
        for name, width in (("rows", self.width), ("state", self.state_width)):  # stamps are in rows
            old = getattr(self, name)
            new = zeros_aligned((n, width), old.dtype)
            for k in range(self.num_shards):
                new[first + k * self.R : first + k * self.R + hw[k]] = old[first + k * old_r : first + k * old_r + hw[k]]
            setattr(self, name, new)
            del old, new  # peak memory: everything old plus one new array
        self.index = None
        self.index = zeros_aligned(self.num_shards * self.M, ix.SLOT_DTYPE)
        self._views()
        for k in range(self.num_shards):
            self.rebuild_region(k)

    def reset_state(self, state_width: int, state_init: float) -> None:
        """New optimizer state for every row (a different optimizer was registered). Only the
        rows below each shard's high-water mark are written: a row above it gets its state when it
        is created, and the preallocated arrays stay untouched (calloc), where filling them all
        made the whole preallocation resident (dim 1024, 100 shards: +420 MB for 1,000 rows)."""
        self.state_width = state_width
        self.state_init = float(state_init)
        self.state = zeros_aligned((self._total_rows(), state_width), np.float32)
        if self.state_init != 0.0 and state_width:
            for k in np.flatnonzero(self.high_water).tolist():
                base = self.base(k)
                self.state[base : base + int(self.high_water[k])] = self.state_init
        self._views()

    # -- optimizer ------------------------------------------------------------------------------
    def apply_gradients(self, rows: np.ndarray, grads: np.ndarray, step) -> int:
        """Apply ``step(weights, state, grads)`` to found rows; duplicates are summed first.

        The caller owns every shard of ``rows``. Returns the number of duplicate IDs folded.
        """
        n = rows.shape[0]
        if n == 0:
            return 0
        # Duplicate check without extra memory: borrow the rows' stamps as scratch (nobody else
        # reads them while we own the shard), write each position, read back: a position that
        # reads another one's number shares its row.
        saved = self.stamps[rows]
        order = np.arange(n, dtype=np.uint32)
        self.stamps[rows] = order
        distinct = np.array_equal(self.stamps[rows], order)
        self.stamps[rows] = saved
        folded = 0
        if not distinct:
            uniq, inverse = np.unique(rows, return_inverse=True)
            summed = np.zeros((uniq.shape[0], self.dim), dtype=np.float32)
            np.add.at(summed, inverse, grads)
            folded = n - uniq.shape[0]
            rows, grads, n = uniq, summed, uniq.shape[0]
        for a in range(0, n, CHUNK):
            r = rows[a : a + CHUNK]
            block = np.take(self.rows, r, axis=0)
            st = np.take(self.state, r, axis=0) if self.state_width else np.empty((r.shape[0], 0), np.float32)
            step(block[:, : self.dim], st, grads[a : a + CHUNK])
            self._rows_v[r] = _void(block)
            if self.state_width:
                self._state_v[r] = _void(st)
        return folded

    # -- export / import ------------------------------------------------------------------------
    def snapshot_region(self, shard: int):
        """Copies of the shard's used rows as ``(signs, weights, state, live)`` (``live`` None when
        every row is live). The only part of a dump done under the shard lock."""
        base = self.base(shard)
        end = base + int(self.high_water[shard])
        live = self.stamps[base:end] != 0
        signs = self.signs_of_rows[base:end].copy()
        weights = np.ascontiguousarray(self.rows[base:end, : self.dim])
        state = self.state[base:end].copy()
        return signs, weights, state, None if live.all() else live

    @staticmethod
    def compact_snapshot(snap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(signs, weights, state) of the live rows of a snapshot (outside the lock)."""
        signs, weights, state, live = snap
        if live is not None:
            signs, weights, state = signs[live], weights[live], state[live]
        return signs, weights, state

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Weights and state of found rows (copies)."""
        return self.rows[rows, : self.dim], self.state[rows]

    @classmethod
    def from_parts(
        cls,
        dim: int,
        num_shards: int,
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        state_width: int,
        state_init: float,
        region_floor: int,
        stamp: int,
        pool=None,
        use_kernel: bool = False,
    ) -> "DimTable":
        """A new table holding the rows of ``parts`` (``(signs, weights, state)`` each, e.g. the
        memory-mapped arrays of checkpoint files), copied once into place; parts run on ``pool``
        (an executor) when given. Duplicate signs raise ``ValueError``."""
        run = (lambda fn, items: list(pool.map(fn, items))) if pool is not None else (lambda fn, items: [fn(i) for i in items])

        def shards_of(part):
            sh = ix.shard_ids(ix.sign_hash(part[0]), num_shards)
            return sh, np.bincount(sh, minlength=num_shards)

        placed = run(shards_of, parts)
        totals = np.zeros(num_shards, dtype=np.int64)
        offsets = []
        for _, counts in placed:
            offsets.append(totals.copy())
            totals += counts
        biggest = int(totals.max()) if totals.size else 0
        table = cls(dim, num_shards, max(biggest, min(region_floor, math.ceil(biggest * 1.25)), 16), state_width, state_init,
                    use_kernel)
        key = slice(table.key_col, table.key_col + 2)

        def copy_part(i):
            (signs, weights, state), (sh, counts), offset = parts[i], placed[i], offsets[i]
            nonzero = np.flatnonzero(counts)
            if nonzero.size == 1:  # the whole part is one shard's (same shard count as the writer)
                segments = [(int(nonzero[0]), slice(None))]
            else:
                order = np.argsort(sh.astype(np.uint16 if num_shards <= 65536 else np.int64), kind="stable")
                ends = np.cumsum(counts)
                segments = [(int(k), order[ends[k] - counts[k] : ends[k]]) for k in nonzero]
            for k, sel in segments:
                cnt = int(counts[k])
                at = table.base(k) + int(offset[k])
                block = table.rows[at : at + cnt]
                block[:, :dim] = weights[sel]
                block[:, key].view(np.uint64)[:, 0] = signs[sel]
                if state_width:
                    table.state[at : at + cnt] = state[sel]
                table.stamps[at : at + cnt] = stamp

        run(copy_part, range(len(parts)))
        table.high_water[:] = totals
        table.live[:] = totals

        def index_region(k):
            base = table.base(k)
            g = np.arange(base, base + int(totals[k]))
            ix.insert(table.index, ix.sign_hash(table.signs_of_rows[g]), g, num_shards, table.M,
                      stored_signs=table._stored_signs, signs=table.signs_of_rows[g])

        run(index_region, range(num_shards))
        return table
