"""The backward of the one-ID slots' gather: each looked-up row's gradient is the sum of the
gradients of the batch positions that read it.

torch's own backward of ``index_select`` (``index_add_``) runs on the CPU as a generic scatter,
about 33 ns per 16-float row: 0.9 ms of the training thread's step at batch 1024 on the MLP 400
(26 slots x 1,024 positions), where the compiled loop (``persia/_rows.c``, built by ``pip
install``) takes a few. It adds in the order ``index_add_`` does with one thread, so the gradients
are the same floats (``tests/unit/test_row_sums.py``); ``index_add_`` stays the fallback (a source
tree without a build, another device or dtype) and the reference.
"""

from __future__ import annotations

import logging

import torch
from torch.autograd.function import once_differentiable

log = logging.getLogger(__name__)

ABI = 1  # the _rows.c interface this module calls

try:
    from persia import _rows
except ImportError:  # a source tree without a build: index_add_
    _rows = None
if _rows is not None and getattr(_rows, "ABI", None) != ABI:
    log.warning("persia._rows was built from another _rows.c (interface %s, this code needs %s): rebuild it "
                "(make venv, or pip install -e .); index_add_ sums the gather's gradients meanwhile",
                getattr(_rows, "ABI", None), ABI)
    _rows = None


def available() -> bool:
    """Whether the compiled kernel was built and imports."""
    return _rows is not None


def index_add_rows(rows: int, index: torch.Tensor, grad: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    """``zeros(rows, dim)`` with ``grad[i]`` added to row ``index[i]`` for each ``i`` in order.
    ``use_kernel``: None = the kernel where it applies (CPU, float32, int64 index); False =
    ``index_add_``."""
    if use_kernel is None:
        use_kernel = (_rows is not None and grad.device.type == "cpu" and grad.dtype == torch.float32
                      and index.dtype == torch.int64 and grad.dim() == 2)
    if not use_kernel:
        return grad.new_zeros(rows, grad.shape[1]).index_add_(0, index, grad)
    out = torch.zeros(rows, grad.shape[1], dtype=torch.float32)
    _rows.index_add_rows(out.numpy(), index.detach().contiguous().numpy(), grad.detach().contiguous().numpy())
    return out


class GatherRows(torch.autograd.Function):
    """``leaf.index_select(0, index)`` whose backward sums through :func:`index_add_rows`."""

    @staticmethod
    def forward(ctx, leaf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = leaf.shape[0]
        return leaf.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return index_add_rows(ctx.rows, index, grad), None
