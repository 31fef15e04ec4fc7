"""Fixed 64-bit hashing of IDs: feature-group prefixes, hash stacks, and PS sharding.

Everything here is vectorized over ``np.uint64`` arrays and *fixed*: a checkpoint written today is
re-sharded by the same function tomorrow, so never change these constants.
"""

from __future__ import annotations

import numpy as np

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)

# Salts that make the PS-shard hash and the internal-shard hash independent: otherwise every row
# that lands on PS i would also land on the same few internal shards.
PS_SHARD_SALT = 0x5045_5253_4941_5053  # "PERSIAPS"
INTERNAL_SHARD_SALT = 0x494E_5445_524E_414C  # "INTERNAL"


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a bijection on uint64 with full avalanche (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _S30)) * _C1
        z = (z ^ (z >> _S27)) * _C2
        return z ^ (z >> _S31)


def shard_of(signs: np.ndarray, num_shards: int, salt: int = PS_SHARD_SALT) -> np.ndarray:
    """Which of ``num_shards`` shards owns each sign (int64 array)."""
    if num_shards <= 0:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    signs = np.asarray(signs, dtype=np.uint64)
    if num_shards == 1:
        return np.zeros(signs.shape, dtype=np.int64)
    h = mix64(signs ^ np.uint64(salt))
    return (h % np.uint64(num_shards)).astype(np.int64)


def add_index_prefix(ids: np.ndarray, index_prefix: int, prefix_bit: int) -> np.ndarray:
    """Put a feature group's prefix in the top ``prefix_bit`` bits, as PERSIA does.

    PERSIA folds the ID into the low bits with ``id % (2**(64 - prefix_bit) - 1)`` and adds the
    prefix; we keep that exact mapping so IDs of one group never collide with another group's.
    """
    ids = np.asarray(ids, dtype=np.uint64)
    if prefix_bit <= 0:
        return ids
    modulus = np.uint64((1 << (64 - prefix_bit)) - 1)
    return (ids % modulus) + np.uint64(index_prefix)


def hash_stack(ids: np.ndarray, rounds: int, embedding_size: int) -> np.ndarray:
    """Replace each ID by ``rounds`` bucket IDs (PERSIA's hash stack), shape ``(n, rounds)``.

    Round ``r`` hashes the previous round's hash and maps it into ``[r*size, (r+1)*size)``, so a
    huge vocabulary shares ``rounds * embedding_size`` rows while distinct IDs rarely share all
    their buckets.
    """
    ids = np.asarray(ids, dtype=np.uint64)
    if rounds <= 0:
        return ids.reshape(-1, 1)
    if embedding_size <= 0:
        raise ValueError(f"hash_stack_config.embedding_size must be positive, got {embedding_size}")
    out = np.empty((ids.shape[0], rounds), dtype=np.uint64)
    h = ids
    size = np.uint64(embedding_size)
    for r in range(rounds):  # loop over rounds (a handful), vectorized over IDs
        h = mix64(h)
        out[:, r] = h % size + np.uint64(r * embedding_size)
    return out


def seed_salt(*parts: int) -> np.uint64:
    """One 64-bit salt from the user's seed (and a nonce): 0 for seed 0, so seed 0 keeps the
    initial values every earlier checkpoint was created with."""
    if not any(parts):
        return np.uint64(0)
    acc = np.uint64(0)
    with np.errstate(over="ignore"):
        for p in parts:
            acc = mix64(np.array([acc ^ np.uint64(int(p) & 0xFFFFFFFFFFFFFFFF)], dtype=np.uint64))[0]
    return acc


def uniform_from_signs(signs: np.ndarray, dim: int, lower: float, upper: float, seed: int = 0) -> np.ndarray:
    """Deterministic per-ID initial rows: element ``j`` of row ``sign`` is a pure function of both
    (and of the user's ``seed``).

    A row that is evicted and re-created comes back with the same initial value, and every PS
    replica agrees on it regardless of sharding.
    """
    signs = np.asarray(signs, dtype=np.uint64)
    if seed:
        signs = signs ^ seed_salt(seed)
    cols = np.arange(dim, dtype=np.uint64) * _GOLDEN
    with np.errstate(over="ignore"):
        h = mix64(mix64(signs)[:, None] ^ cols[None, :])
    unit = (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return (lower + (upper - lower) * unit).astype(np.float32)


def unit_from_signs(signs: np.ndarray, seed: int, nonce: int) -> np.ndarray:
    """A uniform draw in ``[0, 1)`` per sign, a pure function of ``(sign, seed, nonce)``: the PS
    admits new IDs with it, so which IDs get a row does not depend on how IDs are sharded."""
    h = mix64_salted(np.asarray(signs, dtype=np.uint64), int(seed_salt(seed, nonce + 1, 0xAD317)))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def mix64_salted(x: np.ndarray, salt: int) -> np.ndarray:
    """``mix64(x ^ salt)`` computed in place on one new array (fewer temporaries on hot paths)."""
    z = np.asarray(x, dtype=np.uint64) ^ np.uint64(salt)
    with np.errstate(over="ignore"):
        z += _GOLDEN
        t = z >> _S30
        z ^= t
        z *= _C1
        np.right_shift(z, _S27, out=t)
        z ^= t
        z *= _C2
        np.right_shift(z, _S31, out=t)
        z ^= t
    return z
