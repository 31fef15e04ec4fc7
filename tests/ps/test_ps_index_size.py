"""The index of a very large table: every home slot lies in its shard's region.

A sign's home slot is ``hi * (S*M) >> 32`` in uint64 arithmetic (numpy and the kernel alike), which
wraps once ``S*M`` passes 2^32 slots, i.e. past 0.2 * 2^32 = 859M rows of one dim on one PS (the
default capacity is 1e9 rows over 100 internal shards). Before, ~14% of a 1e9-row table's home
slots then fell in another shard's region (an index entry under another shard's lock, dropped by
that region's next rebuild). The tables here are only sized, never allocated at that scale."""

from __future__ import annotations

import numpy as np
import pytest

from persia.embedding_ps import index as ix
from persia.embedding_ps.table import DimTable


def _hashes() -> np.ndarray:
    rng = np.random.default_rng(7)
    h = rng.integers(0, 2**64 - 1, 200_000, dtype=np.uint64, endpoint=True)
    top = np.array([2**64 - 1, (2**32 - 1) << 32, 0, 1 << 32, 2**63], dtype=np.uint64)  # extremes of hi
    return np.concatenate([h, top, ix.sign_hash(np.array([0, 1, 2**64 - 1, 2**63], dtype=np.uint64))])


@pytest.mark.parametrize("shards, rows", [(100, 10_000_000), (100, 8_600_000), (1, 2**31), (7, 300_000_000),
                                          (1000, 2_000_000), (3, 5)])
def test_home_slots_stay_in_their_shards_region(shards, rows):
    slots = ix.slots_for_region(rows, shards)
    assert shards * slots <= ix.MAX_SLOTS and rows <= slots // 2
    h = _hashes()
    home = ix.home_slots(h, shards, slots)
    assert (home >= 0).all() and (home < shards * slots).all()
    np.testing.assert_array_equal(home // slots, ix.shard_ids(h, shards))


def test_tables_below_the_wrap_keep_their_sizing():
    for shards, rows in ((100, 1024), (100, 8_000_000), (1, 858_993_459)):
        assert ix.slots_for_region(rows, shards) == ix.slots_for_rows(rows)


def test_a_region_the_index_cannot_hold_is_refused_naming_the_limit():
    with pytest.raises(ValueError, match="capacity"):
        ix.slots_for_region(2**31 // 100 + 1, 100)
    ix.slots_for_region(2**31 // 100 - 1, 100)


def test_a_refused_growth_leaves_the_table_usable():
    table = DimTable(1, 1 << 16, 1, 0, 0.0)
    signs = np.array([3], dtype=np.uint64)
    h = ix.sign_hash(signs)
    shard = int(ix.shard_ids(h, table.num_shards)[0])
    table.insert(shard, signs, h, 1, 0.5, 0.5)
    with pytest.raises(ValueError):
        table.grow((1 << 16) + 10)  # 2^32 rows and more: refused before anything changed
    out = np.empty((1, 1), dtype=np.float32)
    assert table.gather(signs, out, None).all() and out[0, 0] == 0.5
    assert table.R == 1
