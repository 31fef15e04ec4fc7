"""A fixed bijective 64-bit mix (the SplitMix64 finaliser), vectorised over numpy uint64 arrays.

Feature IDs are ``mix64(key)`` with ``key = (slot + 1) << 40 | rank``: frequent and rare IDs are
spread over the whole uint64 range (top bits included), as hashed production IDs are, while the map
stays invertible, so a test can recover (slot, rank) exactly.
"""

from __future__ import annotations

import numpy as np

_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_M1_INV = pow(_M1, -1, 1 << 64)
_M2_INV = pow(_M2, -1, 1 << 64)
RANK_BITS = 40


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser; uint64 in, uint64 out, wrapping arithmetic."""
    z = np.asarray(x, dtype=np.uint64).copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z


def _unxorshift(z: np.ndarray, shift: int) -> np.ndarray:
    """Inverse of ``z ^= z >> shift`` (apply until every bit is recovered)."""
    out = z.copy()
    s = shift
    while s < 64:
        out = z ^ (out >> np.uint64(shift))
        s += shift
    return out


def unmix64(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`mix64`."""
    x = np.asarray(z, dtype=np.uint64).copy()
    x = _unxorshift(x, 31)
    x *= np.uint64(_M2_INV)
    x = _unxorshift(x, 27)
    x *= np.uint64(_M1_INV)
    x = _unxorshift(x, 30)
    return x


def slot_rank_key(slot: int, ranks: np.ndarray) -> np.ndarray:
    """Key for ``rank`` (0-based) in ``slot``: distinct across slots, so IDs are globally unique."""
    return (np.uint64(slot + 1) << np.uint64(RANK_BITS)) | np.asarray(ranks, dtype=np.uint64)


def ids_for(slot: int, ranks: np.ndarray) -> np.ndarray:
    return mix64(slot_rank_key(slot, ranks))


def slot_rank_of(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(slot, rank) of IDs made by :func:`ids_for`."""
    key = unmix64(ids)
    slot = (key >> np.uint64(RANK_BITS)).astype(np.int64) - 1
    rank = (key & np.uint64((1 << RANK_BITS) - 1)).astype(np.int64)
    return slot, rank
