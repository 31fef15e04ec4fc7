"""The model's per-slot embedding tensors, built in torch from the embedding worker's lookup reply.

The reply carries each dim's distinct rows once and, per slot, the index of every ID occurrence
into them (``persia.embedding_worker.pipeline.lookup_reply``). Each dim's rows become one leaf
tensor; pooling (``embedding_bag``), the plain gather of one-ID slots and the raw slots' padded
gather run in torch, so backward leaves one gradient row per distinct ID in ``leaf.grad``: the
worker neither pools nor reduces gradients, and half the bytes travel each way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from persia.nn_worker.row_sums import GatherRows


@dataclass
class SlotTensors:
    leaves: list[torch.Tensor]  # one per entry of the reply's tables (per dim), in that order
    emb: list[torch.Tensor]  # what the model receives, one per slot
    used: list[bool]  # per slot: backward reached its tensor (set during backward)
    # per table: rewrites what the model receives where rows changed after the build (patch)
    patchers: list[Callable[[np.ndarray, np.ndarray], None]] = field(default_factory=list, repr=False)


def patch(tensors: SlotTensors, table: int, rows: np.ndarray, changed: np.ndarray) -> None:
    """Rows ``changed`` (positions) of reply table ``table`` now read ``rows[changed]`` (own-update
    replay corrected them after the lookup thread built the tensors): rewrite the leaf and every
    slot tensor that read them, in place and exactly as :func:`build` would have made them from
    ``rows``, before any forward has used them. Backward needs none of these values (a gather's,
    an ``embedding_bag``'s and a padded gather's gradients depend only on the indices)."""
    if changed.size:
        with torch.no_grad():
            tensors.patchers[table](rows, changed)


@dataclass
class PreparedTensors:
    """What ``ctx.prepare_features`` returns for one batch, with the grad setting it was built for."""

    requires_grad: bool
    non_id: list[torch.Tensor]
    labels: list[torch.Tensor] | None
    slots: SlotTensors


def _tensor(arr: np.ndarray, device) -> torch.Tensor:
    # decoded arrays are read-only views of the message buffer: torch wants its own copy
    return torch.from_numpy(np.array(arr, copy=True)).to(device, non_blocking=True)


def _index(arr: np.ndarray, device) -> torch.Tensor:
    # int32 on the wire (half the bytes); torch's CPU gathers and embedding_bag are several times
    # slower with int32 indices than with int64 (measured: 0.35 vs 0.10 ms for a 6,656-ID gather
    # and its backward), so they are widened here (a copy, which the read-only view needs anyway)
    return torch.from_numpy(np.asarray(arr).astype(np.int64)).to(device, non_blocking=True)


def sqrt_scale(offsets: np.ndarray) -> np.ndarray:
    """Per sample ``1/sqrt(number of IDs)`` (1 for an empty sample), float32."""
    return (1.0 / np.sqrt(np.maximum(np.diff(offsets), 1))).astype(np.float32)


def build(tables: list[dict], slots: list[dict], device, requires_grad: bool) -> SlotTensors:
    """Summed slots give ``(bs, dim)``; raw slots ``(bs, sample_fixed_size, dim + 1)`` whose last
    channel is the mask (1 where an ID is, 0 for padding), as in PERSIA."""
    by_dim: dict[int, torch.Tensor] = {}
    gathered: dict[int, tuple[torch.Tensor, ...]] = {}  # dim -> its one-ID slots' tensors
    gather_base: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # dim -> (the one gather those are views of, its index)
    leaves = []
    for t in tables:
        d = int(t["dim"])
        leaf = _tensor(t["rows"], device).requires_grad_(requires_grad)
        by_dim[d] = leaf
        leaves.append(leaf)
        if "gather" in t:  # one gather (one index_add in backward) for all; unbind's backward stacks
            k, bs = t["gather"].shape
            index = _index(t["gather"], device).view(-1)
            gather_base[d] = (GatherRows.apply(leaf, index) if requires_grad else leaf.index_select(0, index), index)
            gathered[d] = gather_base[d][0].view(k, bs, d).unbind(0)
    emb = []
    remake: dict[int, list[tuple[int, Callable, Callable]]] = {}  # dim -> (slot, rows it reads, value)
    for i, slot in enumerate(slots):
        d = int(slot["dim"])
        leaf = by_dim[d]
        if "gather" in slot:
            emb.append(gathered[d][slot["gather"]])
            continue
        make = _raw_slot(slot, d, device) if "raw_index" in slot else _summed_slot(slot, device)
        emb.append(make(leaf))
        reads = (lambda s=slot: s["raw_index"][s["raw_index"] > 0] - 1) if "raw_index" in slot \
            else (lambda s=slot: s["index"])
        remake.setdefault(d, []).append((i, reads, make))
    used = [False] * len(slots)
    if requires_grad and emb:
        # raw slots' tensors were never views, so a model may modify them in place: they get copies
        copies = tuple("raw_index" in slot for slot in slots)
        emb = list(_MarkUsed.apply(used, copies, *emb))
    out = SlotTensors(leaves=leaves, emb=emb, used=used)
    for t, leaf in zip(tables, leaves):
        d = int(t["dim"])
        out.patchers.append(_patcher(out, leaf, gather_base.get(d), remake.get(d, [])))
    return out


def _summed_slot(slot: dict, device) -> Callable[[torch.Tensor], torch.Tensor]:
    index, offsets = _index(slot["index"], device), _index(slot["offsets"], device)
    scale = _tensor(sqrt_scale(slot["offsets"]), device)[:, None] if slot["sqrt_scaling"] else None

    def make(leaf: torch.Tensor) -> torch.Tensor:
        pooled = F.embedding_bag(index, leaf, offsets, mode="sum", include_last_offset=True)
        return pooled * scale if scale is not None else pooled

    return make


def _raw_slot(slot: dict, d: int, device) -> Callable[[torch.Tensor], torch.Tensor]:
    index = _index(slot["raw_index"], device)
    mask = (index != 0).to(torch.float32).unsqueeze(-1)

    def make(leaf: torch.Tensor) -> torch.Tensor:
        rows = torch.cat([leaf.new_zeros(1, d), leaf])[index]  # row 0: the padding row (zeros, no gradient)
        if slot["scale"] != 1.0:
            rows = rows * slot["scale"]
        return torch.cat([rows, mask.to(rows.dtype)], dim=-1)

    return make


def _patcher(out: SlotTensors, leaf: torch.Tensor, gather: tuple[torch.Tensor, torch.Tensor] | None,
             remake: list) -> Callable[[np.ndarray, np.ndarray], None]:
    """What :func:`patch` runs for one table: the leaf's rows, the one-ID slots' gather, and every
    other slot of the dim that reads a changed row, made again.

    The whole leaf is copied and the whole gather redone rather than only the changed positions:
    a replayed update changes about half of a batch's rows and three quarters of its one-ID
    positions (MLP 400 bench), where one copy and one ``index_select`` cost a quarter of the
    scatters (about 50 against 220 µs for 26 slots of 256)."""

    def run(rows: np.ndarray, changed: np.ndarray) -> None:
        if leaf.device.type == "cpu":
            np.copyto(leaf.detach().numpy(), rows)
        else:
            leaf.data.copy_(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(leaf.device))
        if gather is not None:
            base, index = gather
            # into .data: its own version counter, so the slot views of base stay valid for autograd
            torch.index_select(leaf.data, 0, index, out=base.data)
        if remake:
            hit = np.zeros(rows.shape[0], dtype=bool)
            hit[changed] = True
            for i, reads, make in remake:
                if hit[reads()].any():
                    out.emb[i].data.copy_(make(leaf.detach()))

    return run


class _MarkUsed(torch.autograd.Function):
    """Identity on every slot tensor; its backward notes which of them received a gradient (an
    output the loss does not depend on gets None). One Python call per backward, where a hook per
    slot cost about 0.2 ms per batch of 26 slots."""

    @staticmethod
    def forward(ctx, used, copies, *tensors):
        ctx.used = used
        ctx.set_materialize_grads(False)
        return tuple(t.clone() if copy else t.view_as(t) for t, copy in zip(tensors, copies))

    @staticmethod
    def backward(ctx, *grads):
        for i, g in enumerate(grads):
            if g is not None:
                ctx.used[i] = True
        return (None, None, *grads)
