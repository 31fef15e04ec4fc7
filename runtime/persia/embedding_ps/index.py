"""A vectorized open-addressing index ``uint64 sign -> row``: one flat ``uint32`` array of row
numbers, no per-ID Python object, every operation a handful of numpy passes over the whole batch.

The array is split into ``S`` equal *regions* of ``M`` slots, one per internal shard. A sign's
64-bit internal hash ``h`` picks both its shard and its home slot from its high 32 bits
("fastrange"): ``shard = hi * S >> 32`` and ``home = hi * (S*M) >> 32``, so the home slot always
lies in the shard's region and a lookup needs no per-shard offset. Collisions probe linearly and
wrap inside the region, so shards can be locked, rebuilt and dumped independently.

A slot holds ``EMPTY`` (0), ``TOMBSTONE`` (1) or a row number ``>= FIRST_ROW``. The sign is not in
the index: it is stored inside the row, so the gather that fetches a row's weights also confirms
that the row is the sign's (one random memory access per lookup for the index, one for the row).
Rows 0 and 1 of a table are sentinels, so any slot value is a valid row index. The index is kept
sparse (at most :data:`MAX_LOAD` live entries per slot, 4 bytes a slot = 20 bytes per row) so that
most signs sit in their home slot and a second probe is rare.

Deleted entries become tombstones, reused by later inserts; a region is rebuilt when tombstones
pile up (:func:`needs_rebuild`).
"""

from __future__ import annotations

import numpy as np

from persia.hashing import INTERNAL_SHARD_SALT, mix64_salted

EMPTY = 0
TOMBSTONE = 1
FIRST_ROW = 2  # rows 0 and 1 are the EMPTY / TOMBSTONE sentinels
MAX_ROWS = (1 << 32) - 1  # row numbers are uint32
# Slots of all regions together, S*M: the home slot ``hi * (S*M) >> 32`` (numpy and the kernel,
# uint64 arithmetic) must not wrap, or a home slot leaves its shard's region.
MAX_SLOTS = 1 << 32
MAX_LOAD = 0.2
SLOT_DTYPE = np.uint32
_S32 = np.uint64(32)


def sign_hash(signs: np.ndarray) -> np.ndarray:
    """The internal 64-bit hash of each sign, ``mix64(sign ^ INTERNAL_SHARD_SALT)`` (independent
    of the PS-replica hash by its salt)."""
    return mix64_salted(signs, INTERNAL_SHARD_SALT)


def _fastrange(h: np.ndarray, n: int) -> np.ndarray:
    """``floor(hi * n / 2**32)`` for the high 32 bits ``hi`` of ``h``: uniform in ``[0, n)``."""
    return (((h >> _S32) * np.uint64(n)) >> _S32).view(np.int64)


def shard_ids(h: np.ndarray, num_shards: int) -> np.ndarray:
    """Internal shard of each hashed sign (int64)."""
    if num_shards == 1:
        return np.zeros(h.shape, dtype=np.int64)
    return _fastrange(h, num_shards)


def home_slots(h: np.ndarray, num_shards: int, slots: int) -> np.ndarray:
    """First slot probed for each hash: inside region ``shard_ids(h)`` (int64 flat positions)."""
    return _fastrange(h, num_shards * slots)


def slots_for_rows(rows: int) -> int:
    """Slots a region needs to hold ``rows`` live entries at :data:`MAX_LOAD`."""
    return max(8, int(rows / MAX_LOAD) + 1)


def slots_for_region(rows: int, num_shards: int) -> int:
    """Slots per region for regions of ``rows`` rows: :func:`slots_for_rows`, except that all
    ``num_shards`` regions together keep to :data:`MAX_SLOTS`. Past ``0.2 * 2**32`` rows in all
    (859M rows of one dim on one PS), ``hi * (S*M)`` overflowed 64 bits and wrapped, so ~14% of
    the home slots of a 1e9-row table fell in another shard's region (an entry then lived under
    another shard's lock, and that region's rebuild dropped it). The load then rises above
    :data:`MAX_LOAD`, up to 1/2 (the most that keeps every probe sequence short of a full lap);
    a region that would need more raises ``ValueError``."""
    slots = slots_for_rows(rows)
    if num_shards * slots <= MAX_SLOTS:
        return slots
    slots = MAX_SLOTS // num_shards
    if rows > slots // 2:
        raise ValueError(
            f"{num_shards} internal shards of {rows} rows each ({num_shards * rows} rows of one dim) do not fit one "
            f"PS table's index (at most {slots // 2} rows per shard, {num_shards * (slots // 2)} rows of one dim): "
            f"lower embedding_parameter_server_config.capacity or run more PS replicas")
    return slots


def next_slots(pos: np.ndarray, slots: int) -> np.ndarray:
    """Next slot of a linear probe, wrapping inside each position's region (a new array)."""
    nxt = pos + 1
    wrap = nxt % slots == 0
    if wrap.any():
        nxt[wrap] -= slots
    return nxt


def insert(
    index: np.ndarray,
    h: np.ndarray,
    rows: np.ndarray,
    num_shards: int,
    slots: int,
    stored_signs=None,
    signs: np.ndarray | None = None,
) -> int:
    """Insert absent entries ``(hash, row)``; returns how many tombstones were reused.

    Each entry claims the first EMPTY or TOMBSTONE slot of its probe sequence; entries racing for
    one slot in the same round are settled by writing and reading back (last writer wins, the
    others probe on). With ``stored_signs`` (rows -> their signs) and ``signs``, every occupied
    slot passed is checked for the same sign, and a duplicate raises ``ValueError`` instead of
    silently creating a second entry (used when building from a checkpoint).
    """
    n = h.shape[0]
    if n == 0:
        return 0
    values = np.asarray(rows).astype(SLOT_DTYPE)
    pos = home_slots(h, num_shards, slots)
    pending = np.arange(n)
    reused = 0
    for _ in range(slots + 1):
        cur = np.take(index, pos)
        claim = np.flatnonzero(cur <= TOMBSTONE)
        won_mask = np.zeros(pending.shape[0], dtype=bool)
        if claim.size:
            cpos = pos[claim]
            cval = values[pending[claim]]
            index[cpos] = cval
            now = np.take(index, cpos)
            won = now == cval
            won_mask[claim[won]] = True
            reused += int(np.count_nonzero(cur[claim][won] == TOMBSTONE))
            cur[claim] = now  # what a loser now finds in the slot it wanted
        if stored_signs is not None:
            check = np.flatnonzero(~won_mask & (cur >= FIRST_ROW))
            if check.size:
                same = stored_signs(cur[check].astype(np.int64)) == signs[pending[check]]
                if same.any():
                    dup = signs[pending[check[same]]][0]
                    raise ValueError(f"sign {int(dup)} is already in the index (duplicate sign)")
        keep = ~won_mask
        if not keep.any():
            return reused
        pending = pending[keep]
        pos = next_slots(pos[keep], slots)
    raise RuntimeError("index region is full: invariant broken")


def locate_rows(index: np.ndarray, rows: np.ndarray, h: np.ndarray, num_shards: int, slots: int) -> np.ndarray:
    """Slot positions holding ``rows`` (entries known to be present, ``h`` their signs' hashes)."""
    values = np.asarray(rows).astype(SLOT_DTYPE)
    pos = home_slots(h, num_shards, slots)
    found = np.take(index, pos) == values
    if found.all():
        return pos
    pending = np.flatnonzero(~found)
    p = pos[pending]
    vals = values[pending]
    for _ in range(slots):
        p = next_slots(p, slots)
        hit = np.take(index, p) == vals
        if hit.any():
            pos[pending[hit]] = p[hit]
            keep = ~hit
            pending, p, vals = pending[keep], p[keep], vals[keep]
            if pending.size == 0:
                return pos
    raise KeyError("entry not found in index: invariant broken")


def needs_rebuild(live: int, tombstones: int, slots: int) -> bool:
    """Tombstones lengthen probes; rebuild once live entries and tombstones fill half the slots."""
    return live + tombstones > 0.5 * slots
