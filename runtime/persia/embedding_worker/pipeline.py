"""Pure, vectorized batch processing of the embedding worker (no I/O, testable alone).

``prepare`` turns one batch of ID features into distinct signs per embedding dim (after hash stack
and feature-group prefix); ``split_by_shard`` routes them to PS replicas; ``pool`` builds the
per-slot tensors the model gets; ``reduce_gradients`` turns the model's gradients back into one
gradient per distinct sign. No per-ID Python loop anywhere: loops run over slots and PS replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from persia.config import UnknownSlotError
from persia.hashing import add_index_prefix, hash_stack, shard_of


@dataclass(frozen=True)
class SlotSpec:
    """What the worker needs of one ``slots_config`` entry."""

    name: str
    dim: int
    index_prefix: int
    embedding_summation: bool = True
    sqrt_scaling: bool = False
    sample_fixed_size: int = 10
    hash_stack_rounds: int = 0
    hash_stack_embedding_size: int = 0


@dataclass
class PreparedSlot:
    spec: SlotSpec
    offsets: np.ndarray  # int64 (bs+1,), after hash-stack expansion
    table_inverse: np.ndarray  # int64 (nnz,), row of each occurrence in the dim table
    one_per_sample: bool = False  # every sample has exactly one ID (pooling is a plain gather)
    # raw (non-summed) slots only:
    raw_rows: np.ndarray | None = None  # int64 (n_local,), table rows of the slot's distinct signs
    raw_index: np.ndarray | None = None  # int64 (bs, sample_fixed_size), local row + 1, 0 = padding


@dataclass
class PreparedBatch:
    batch_size: int
    slots: list[PreparedSlot]
    tables: dict[int, np.ndarray] = field(default_factory=dict)  # dim -> distinct signs (uint64)

    @property
    def num_signs(self) -> int:
        return int(sum(t.size for t in self.tables.values()))


def _check_csr(name: str, values: np.ndarray, offsets: np.ndarray, batch_size: int) -> None:
    if values.dtype != np.uint64:
        raise ValueError(f"ID feature {name!r}: expected dtype uint64, got {values.dtype}")
    if values.ndim != 1:
        raise ValueError(f"ID feature {name!r}: expected 1-D values, got ndim {values.ndim}")
    if offsets.shape != (batch_size + 1,):
        raise ValueError(
            f"ID feature {name!r}: expected batch size {batch_size}, got {offsets.shape[0] - 1}"
        )
    if offsets[0] != 0 or offsets[-1] != values.size or np.any(np.diff(offsets) < 0):
        raise ValueError(f"ID feature {name!r}: malformed offsets (not a monotone CSR index)")


def validate_features(features: list[dict], batch_size: int, slots: dict[str, "SlotSpec"]) -> None:
    """Cheap checks done when a batch arrives, so a bad batch is rejected to its sender."""
    if not 1 <= batch_size <= 65535:
        raise ValueError(f"batch_size must be in 1..65535, got {batch_size}")
    seen = set()
    for feat in features:
        name = feat["name"]
        if name in seen:
            raise ValueError(f"ID feature {name!r} appears twice in one batch")
        seen.add(name)
        if name not in slots:
            raise UnknownSlotError(name, list(slots))
        _check_csr(name, np.asarray(feat["values"]), np.asarray(feat["offsets"]), batch_size)


def prepare(
    features: list[dict],
    batch_size: int,
    slots: dict[str, SlotSpec],
    prefix_bit: int,
    checked: bool = False,
) -> PreparedBatch:
    """``features``: ``[{"name", "values": uint64[nnz], "offsets": int64[bs+1]}]`` from a data loader.

    ``checked``: the CSR arrays already passed :func:`validate_features` (when the batch arrived),
    so they are not checked a second time on the lookup path.
    """
    per_slot: list[tuple[SlotSpec, np.ndarray, np.ndarray]] = []
    for feat in features:
        name = feat["name"]
        spec = slots.get(name)
        if spec is None:
            raise UnknownSlotError(name, list(slots))
        values = np.asarray(feat["values"])
        offsets = np.asarray(feat["offsets"], dtype=np.int64)
        if not checked:
            _check_csr(name, values, offsets, batch_size)
        if spec.hash_stack_rounds > 0:
            values = hash_stack(values, spec.hash_stack_rounds, spec.hash_stack_embedding_size).ravel()
            offsets = offsets * spec.hash_stack_rounds
        signs = add_index_prefix(values, spec.index_prefix, prefix_bit)
        per_slot.append((spec, signs, offsets))

    by_dim: dict[int, list[int]] = {}
    for i, (spec, _, _) in enumerate(per_slot):
        by_dim.setdefault(spec.dim, []).append(i)

    prepared: list[PreparedSlot | None] = [None] * len(per_slot)
    tables: dict[int, np.ndarray] = {}
    for dim, idxs in by_dim.items():
        all_signs = np.concatenate([per_slot[i][1] for i in idxs]) if idxs else np.empty(0, np.uint64)
        uniq, inverse = np.unique(all_signs, return_inverse=True)
        tables[dim] = uniq
        start = 0
        for i in idxs:
            spec, signs, offsets = per_slot[i]
            inv = inverse[start : start + signs.size].astype(np.int64, copy=False)
            start += signs.size
            one = inv.size == offsets.size - 1 and bool(np.array_equal(offsets, np.arange(offsets.size)))
            slot = PreparedSlot(spec=spec, offsets=offsets, table_inverse=inv, one_per_sample=one)
            if not spec.embedding_summation:
                slot.raw_rows, slot.raw_index = _raw_layout(inv, offsets, spec.sample_fixed_size)
            prepared[i] = slot
    return PreparedBatch(batch_size=batch_size, slots=prepared, tables=tables)  # type: ignore[arg-type]


def _raw_layout(inv: np.ndarray, offsets: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of one raw slot and its ``(bs, k)`` index (local row + 1; 0 pads)."""
    bs = offsets.size - 1
    lengths = np.diff(offsets)
    sample_of = np.repeat(np.arange(bs), lengths)
    pos = np.arange(inv.size) - np.repeat(offsets[:-1], lengths)
    keep = pos < k  # IDs past sample_fixed_size are dropped, as in PERSIA
    local_rows, local_inv = np.unique(inv[keep], return_inverse=True)
    index = np.zeros((bs, k), dtype=np.int64)
    index[sample_of[keep], pos[keep]] = local_inv + 1
    return local_rows.astype(np.int64), index


def split_by_shard(tables: dict[int, np.ndarray], num_shards: int) -> list[dict[int, np.ndarray]]:
    """For each PS replica: dim -> positions (into ``tables[dim]``) of the signs it owns."""
    out: list[dict[int, np.ndarray]] = [dict() for _ in range(num_shards)]
    for dim, signs in tables.items():
        owner = shard_of(signs, num_shards)
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(num_shards + 1))
        for s in range(num_shards):
            pos = order[bounds[s] : bounds[s + 1]]
            if pos.size:
                out[s][dim] = pos
    return out


def _segment_sum(rows: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum ``rows`` over CSR segments; empty segments give zeros."""
    bs = offsets.size - 1
    out = np.zeros((bs, rows.shape[1]), dtype=np.float32)
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    if rows.shape[0]:
        out[nonempty] = np.add.reduceat(rows, offsets[:-1][nonempty], axis=0)
    return out


def _sqrt_scale(lengths: np.ndarray) -> np.ndarray:
    return (1.0 / np.sqrt(np.maximum(lengths, 1))).astype(np.float32)


def pool(batch: PreparedBatch, rows: dict[int, np.ndarray]) -> list[dict]:
    """Per slot, what the NN worker's model receives (float32).

    Summed slot: ``{"name", "emb": (bs, dim)}``. Raw slot: ``{"name", "distinct": (n+1, dim),
    "index": (bs, sample_fixed_size)}`` where row 0 of ``distinct`` is the zero padding row.
    """
    out = []
    for slot in batch.slots:
        spec = slot.spec
        table = rows[spec.dim]
        if spec.embedding_summation:
            emb = table[slot.table_inverse]  # a new array: one row per occurrence
            if not slot.one_per_sample:  # with one ID per sample the sum is that row (and scale 1)
                emb = _segment_sum(emb, slot.offsets)
            if spec.sqrt_scaling and not slot.one_per_sample:
                emb *= _sqrt_scale(np.diff(slot.offsets))[:, None]
            out.append({"name": spec.name, "emb": emb})
        else:
            distinct = np.zeros((slot.raw_rows.size + 1, spec.dim), dtype=np.float32)
            distinct[1:] = table[slot.raw_rows]
            if spec.sqrt_scaling and spec.hash_stack_rounds > 0:
                distinct *= np.float32(1.0 / np.sqrt(spec.hash_stack_rounds))
            out.append({"name": spec.name, "distinct": distinct, "index": slot.raw_index})
    return out


@dataclass
class ReducedGradients:
    grads: dict[int, np.ndarray]  # dim -> (n_distinct, dim) float32
    touched: dict[int, np.ndarray]  # dim -> bool mask of signs that received a gradient
    skipped_non_finite: list[str]  # slots whose gradient had NaN/inf and was dropped


def reduce_gradients(batch: PreparedBatch, slot_grads: list[np.ndarray | None], scale: float = 1.0) -> ReducedGradients:
    """Sum each occurrence's gradient into its distinct sign (per dim table).

    ``slot_grads[i]`` is ``(bs, dim)`` for a summed slot, ``(n+1, dim)`` (padding row first) for a
    raw slot, or ``None`` when the model did not use the slot. ``scale`` undoes an AMP loss scale.
    A slot with any non-finite gradient is skipped whole (and reported), as PERSIA did, but on
    every batch.
    """
    if len(slot_grads) != len(batch.slots):
        raise ValueError(f"expected {len(batch.slots)} slot gradients, got {len(slot_grads)}")
    rows_of: dict[int, list[np.ndarray]] = {d: [] for d in batch.tables}  # table row of each occurrence
    grads_of: dict[int, list[np.ndarray]] = {d: [] for d in batch.tables}  # its gradient
    skipped: list[str] = []
    inv_scale = np.float32(1.0 / scale) if scale != 1.0 else None
    for slot, g in zip(batch.slots, slot_grads):
        if g is None:
            continue
        spec = slot.spec
        g = np.asarray(g, dtype=np.float32)
        if not np.isfinite(g).all():
            skipped.append(spec.name)
            continue
        if inv_scale is not None:
            g = g * inv_scale
        if spec.embedding_summation:
            if g.shape != (batch.batch_size, spec.dim):
                raise ValueError(
                    f"gradient of slot {spec.name!r}: expected shape {(batch.batch_size, spec.dim)}, got {g.shape}"
                )
            if slot.one_per_sample:
                occ = g  # occurrence i is sample i, scale 1
            else:
                lengths = np.diff(slot.offsets)
                if spec.sqrt_scaling:
                    g = g * _sqrt_scale(lengths)[:, None]
                occ = np.repeat(g, lengths, axis=0)
            rows_of[spec.dim].append(slot.table_inverse)
            grads_of[spec.dim].append(occ)
        else:
            expect = (slot.raw_rows.size + 1, spec.dim)
            if g.shape != expect:
                raise ValueError(f"gradient of raw slot {spec.name!r}: expected shape {expect}, got {g.shape}")
            g = g[1:]
            if spec.sqrt_scaling and spec.hash_stack_rounds > 0:
                g = g * np.float32(1.0 / np.sqrt(spec.hash_stack_rounds))
            rows_of[spec.dim].append(slot.raw_rows)
            grads_of[spec.dim].append(g)
    grads, touched = {}, {}
    for d, signs in batch.tables.items():
        grads[d] = np.zeros((signs.size, d), dtype=np.float32)
        touched[d] = np.zeros(signs.size, dtype=bool)
        if rows_of[d]:
            rows = np.concatenate(rows_of[d])
            _scatter_add_rows(grads[d], rows, np.concatenate(grads_of[d]))
            touched[d][rows] = True
    return ReducedGradients(grads=grads, touched=touched, skipped_non_finite=skipped)


def _scatter_add_rows(out: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """``out[rows[k]] += values[k]`` for every k, repeated rows accumulating (in float64, then
    rounded once). One ``np.bincount`` per column: for a batch of 256 x 26 IDs of dim 16 this is
    about 4x faster than ``np.add.at`` on the rows."""
    if rows.size == 0:
        return
    n = out.shape[0]
    for j in range(out.shape[1]):
        out[:, j] += np.bincount(rows, weights=values[:, j], minlength=n).astype(np.float32)
