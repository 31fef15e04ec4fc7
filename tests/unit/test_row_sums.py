"""The backward of the one-ID slots' gather (persia.nn_worker.row_sums and its kernel, _rows.c):
the same floats as torch's index_add_, in the same order, and errors that name what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia.nn_worker import embedding_tensors, row_sums

needs_kernel = pytest.mark.skipif(not row_sums.available(), reason="persia._rows is not built")


@pytest.fixture(params=[1, 2])
def torch_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("dim", [16, 8, 3])
def test_the_kernel_adds_what_index_add_adds_to_the_bit(dim, torch_threads):
    rng = np.random.default_rng(dim)
    rows, n = 500, 20_000  # every row read about 40 times: the order of the additions matters
    index = torch.from_numpy(rng.integers(0, rows, n))
    grad = torch.from_numpy((rng.standard_normal((n, dim)) * 10.0 ** rng.integers(-3, 4, (n, 1))).astype(np.float32))
    want = torch.zeros(rows, dim).index_add_(0, index, grad)
    got = row_sums.index_add_rows(rows, index, grad)
    assert torch.equal(got, want)
    assert torch.equal(row_sums.index_add_rows(rows, index, grad, use_kernel=False), want)


@needs_kernel
def test_no_index_gives_zeros():
    got = row_sums.index_add_rows(4, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 16))
    assert torch.equal(got, torch.zeros(4, 16))


@needs_kernel
@pytest.mark.parametrize("bad", [-1, 7])
def test_an_index_out_of_range_is_named_and_nothing_is_added(bad):
    out = np.ones((7, 2), np.float32)
    index = np.array([0, 3, bad, 1], np.int64)
    with pytest.raises(ValueError, match=rf"index\[2\] = {bad} is not a row of out \(0 to 6\)"):
        row_sums._rows.index_add_rows(out, index, np.ones((4, 2), np.float32))
    assert (out == 1).all()


@needs_kernel
def test_arrays_of_the_wrong_kind_are_named():
    out, index, src = np.zeros((3, 2), np.float32), np.zeros(2, np.int64), np.zeros((2, 2), np.float32)
    with pytest.raises(ValueError, match="out must be a 2-D float32 array"):
        row_sums._rows.index_add_rows(np.zeros((3, 2)), index, src)
    with pytest.raises(ValueError, match="index must be a 1-D int64 array"):
        row_sums._rows.index_add_rows(out, index.astype(np.int32), src)
    with pytest.raises(ValueError, match=r"src must be \(2, 2\)"):
        row_sums._rows.index_add_rows(out, index, np.zeros((2, 3), np.float32))
    read_only = np.zeros((3, 2), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a C-contiguous writable"):
        row_sums._rows.index_add_rows(read_only, index, src)


def test_the_slots_gradients_are_index_selects_to_the_bit(monkeypatch):
    """Through ``embedding_tensors.build``: the leaf's gradient with the gather's own backward
    equals the one with torch's ``index_select`` backward (and the kernel, where built, ran)."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((300, 16)).astype(np.float32)
    gather = rng.integers(0, 300, size=(26, 64)).astype(np.int32)
    slots = [{"dim": 16, "gather": i} for i in range(26)]
    weights = torch.from_numpy(rng.standard_normal((26, 64, 16)).astype(np.float32))

    def leaf_grad():
        built = embedding_tensors.build([{"dim": 16, "rows": rows, "gather": gather}], slots, "cpu", True)
        (torch.stack(built.emb) * weights).sum().backward()
        return built.leaves[0].grad

    calls = []
    real = row_sums.index_add_rows
    monkeypatch.setattr(row_sums, "index_add_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = leaf_grad()
    assert calls == [1]
    leaf = torch.from_numpy(rows).requires_grad_(True)
    (leaf.index_select(0, torch.from_numpy(gather.astype(np.int64)).view(-1)).view(26, 64, 16) * weights).sum().backward()
    assert torch.equal(got, leaf.grad)
