"""Registering another optimizer once rows exist writes the new state of the rows in use only:
before, ``DimTable.reset_state`` filled the whole preallocated state array, which made all of it
resident (calloc'ed pages appear when written; dim 1024 over 100 internal shards: +420 MB of
resident memory for 1,000 rows)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from persia.embedding_ps.optimizers import AdagradConfig, AdamConfig
from persia.embedding_ps.store import EmbeddingStore

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_new_optimizers_state_touches_only_the_rows_in_use():
    store = EmbeddingStore(16 * 4096, 16)  # regions of 1024 rows: a 67 MB state array at dim 1024
    signs = np.array([5, 2**64 - 1], dtype=np.uint64)
    store.lookup(signs, 1024, True)  # rows before any optimizer: no state
    before = _rss()
    store.register_optimizer(AdagradConfig(initial_accumulator_value=0.25))
    grown = _rss() - before
    assert grown < 24 << 20, f"registering the optimizer made {grown >> 20} MiB resident"
    st = store.lookup_full(signs, 1024, False, state=True).state
    np.testing.assert_array_equal(st, np.full((2, 1024), 0.25, np.float32))
    new = np.array([77], dtype=np.uint64)  # a row created afterwards starts from the initial value too
    np.testing.assert_array_equal(store.lookup_full(new, 1024, True, state=True).state, 0.25)
    store.register_optimizer(AdamConfig())  # zeros: nothing to write at all
    np.testing.assert_array_equal(store.lookup_full(signs, 1024, False, state=True).state, 0.0)
