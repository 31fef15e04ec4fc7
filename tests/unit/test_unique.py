"""The embedding worker's dedup (``persia.unique``): the compiled kernel returns exactly what
``np.unique(values, return_inverse=True)`` does, and refuses arrays it cannot use by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persia import unique as U

needs_kernel = pytest.mark.skipif(not U.available(), reason="persia._unique is not built")


def _same(values: np.ndarray) -> None:
    got, reference = U.unique_inverse(values, use_kernel=True), U.unique_inverse(values, use_kernel=False)
    np.testing.assert_array_equal(got[0], reference[0])
    np.testing.assert_array_equal(got[1], reference[1])
    assert got[0].dtype == np.uint64 and got[1].dtype == np.int32
    np.testing.assert_array_equal(got[0][got[1]], values)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 5000), distinct=st.integers(1, 3000),
       narrow=st.booleans())
def test_the_kernel_equals_numpy(seed, n, distinct, narrow):
    """Many repeats or few, IDs spread over the whole uint64 range or packed into a few low bits
    (the radix sort skips the bytes every key shares)."""
    rng = np.random.default_rng(seed)
    pool = (rng.integers(0, 300, distinct, dtype=np.uint64) if narrow
            else rng.integers(0, 2**64 - 1, distinct, dtype=np.uint64, endpoint=True))
    _same(pool[rng.integers(0, distinct, n)])


@needs_kernel
def test_edges_of_the_range_and_of_the_sizes():
    top = np.uint64(2**64 - 1)
    for values in ([], [7], [top, 0, top, 1, 0], [2**63, 2**63 - 1, 2**63], [5] * 1000,
                   list(range(10_000, 0, -1))):
        _same(np.array(values, dtype=np.uint64))
    batch = np.random.default_rng(3).integers(0, 2**64 - 1, 2_500, dtype=np.uint64, endpoint=True)
    _same(batch[np.random.default_rng(4).zipf(1.1, 6_656) % 2_500])  # a batch's IDs, Zipf-distributed


@needs_kernel
@pytest.mark.parametrize(("field", "bad", "message"), [
    ("values", np.zeros(4, np.int64), "values must be a 1-D array of uint64"),
    ("values", np.zeros((2, 2), np.uint64), "values must be a 1-D array of uint64, got 2-D"),
    ("uniq", np.zeros(4, np.uint32), "uniq must be a 1-D array of uint64"),
    ("inverse", np.zeros(4, np.int64), "inverse must be a 1-D array of int32"),
    ("inverse", np.zeros(3, np.int32), "as many elements as values"),
    ("uniq", np.zeros(8, np.uint64)[::2], "uniq must be a C-contiguous writable"),
])
def test_the_kernel_names_the_array_it_refuses(field, bad, message):
    args = {"values": np.arange(4, dtype=np.uint64), "uniq": np.zeros(4, np.uint64), "inverse": np.zeros(4, np.int32)}
    args[field] = bad
    with pytest.raises(ValueError, match=message):
        U._unique.unique_inverse(args["values"], args["uniq"], args["inverse"])
    read_only = np.zeros(4, np.int32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="inverse must be a C-contiguous writable"):
        U._unique.unique_inverse(np.arange(4, dtype=np.uint64), np.zeros(4, np.uint64), read_only)


def test_numpy_path_and_the_wrapper_checks():
    uniq, inverse = U.unique_inverse(np.array([3, 1, 3, 2], np.uint64), use_kernel=False)
    assert uniq.tolist() == [1, 2, 3] and inverse.tolist() == [2, 0, 2, 1] and inverse.dtype == np.int32
    with pytest.raises(ValueError, match="values must be 1-D"):
        U.unique_inverse(np.zeros((2, 2), np.uint64))


@needs_kernel
def test_calls_from_many_threads_leave_no_memory_behind():
    """Each call frees its scratch: 100 short-lived threads deduping 200k IDs each (about 12 MB of
    scratch apiece) leave the process about where one of them did, with every result right."""
    import threading

    values = np.random.default_rng(5).integers(0, 2**64 - 1, 200_000, dtype=np.uint64, endpoint=True)
    want = U.unique_inverse(values, use_kernel=False)
    wrong: list[int] = []

    def dedup(i: int) -> None:
        got = U.unique_inverse(values, use_kernel=True)
        if not (np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])):
            wrong.append(i)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    for i in range(3):  # the allocator's own growth first
        t = threading.Thread(target=dedup, args=(i,))
        t.start()
        t.join()
    before = rss()
    for i in range(100):
        t = threading.Thread(target=dedup, args=(i,))
        t.start()
        t.join()
    assert not wrong
    assert rss() - before < 200 * 2**20  # 100 scratches kept would be about 1.2 GB
