"""Pure, vectorized batch processing of the embedding worker (no I/O, testable alone).

``prepare`` turns one batch of ID features into distinct signs per embedding dim (after hash stack
and feature-group prefix); ``split_by_shard`` routes them to PS replicas; ``lookup_reply`` is what
the NN worker gets: each dim's distinct rows once plus the index of every ID occurrence into them
(the NN builds the per-slot tensors with torch, so its autograd sums each occurrence's
gradient into its distinct row); ``check_gradients`` validates those per-dim gradients and picks the
rows the PS must update. No pooling, no gradient reduction and no per-ID Python loop here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from persia.config import UnknownSlotError
from persia.hashing import add_index_prefix, hash_stack, shard_of
from persia.unique import unique_inverse
from persia.wire import ids


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
    table_inverse: np.ndarray  # int32 (nnz,), row of each occurrence in the dim table
    one_per_sample: bool = False  # every sample has exactly one ID (its tensor is a plain gather)
    # raw (non-summed) slots only:
    raw_rows: np.ndarray | None = None  # int64, the table rows the slot keeps (its gradient's rows)
    raw_index: np.ndarray | None = None  # int32 (bs, sample_fixed_size), table row + 1, 0 = padding
    raw_dropped: bool = False  # some IDs lay past sample_fixed_size (their rows get no gradient)


@dataclass
class PreparedBatch:
    batch_size: int
    slots: list[PreparedSlot]
    tables: dict[int, np.ndarray] = field(default_factory=dict)  # dim -> distinct signs (uint64)

    @property
    def num_signs(self) -> int:
        return int(sum(t.size for t in self.tables.values()))


def _packed(features: dict | list, batch_size: int) -> dict:
    """The packed record (:mod:`persia.wire.ids`) of ``features``: as it came off the wire, or
    packed from the per-feature form ``[{"name", "values", "offsets"}]`` (tests, tools)."""
    return features if isinstance(features, dict) else ids.pack_csr(features, batch_size)


def num_ids(features: dict | list) -> int:
    """IDs in a batch's features (either form), for the lookup metrics."""
    if isinstance(features, dict):
        return int(features["values"].size)
    return sum(int(np.asarray(f["values"]).size) for f in features)


def validate_features(features: dict | list, batch_size: int, slots: dict[str, "SlotSpec"]) -> ids.PackedIds:
    """Checks done when a batch arrives, so a bad batch is rejected to its sender: the packed
    record's arrays (:func:`persia.wire.ids.unpack`), and that every name is a distinct slot."""
    if not 1 <= batch_size <= 65535:
        raise ValueError(f"batch_size must be in 1..65535, got {batch_size}")
    packed = ids.unpack(_packed(features, batch_size), batch_size, check=True)
    seen = set()
    for name in packed.names:
        if name in seen:
            raise ValueError(f"ID feature {name!r} appears twice in one batch")
        seen.add(name)
        if name not in slots:
            raise UnknownSlotError(name, list(slots))
    return packed


def prepare(
    features: dict | list,
    batch_size: int,
    slots: dict[str, SlotSpec],
    prefix_bit: int,
    checked: bool = False,
) -> PreparedBatch:
    """``features``: the packed record of a batch's ID features (:mod:`persia.wire.ids`), or the
    per-feature form ``[{"name", "values": uint64[nnz], "offsets": int64[bs+1]}]``.

    ``checked``: the record already passed :func:`validate_features` (when the batch arrived),
    so it is not checked a second time on the lookup path.
    """
    packed = validate_features(features, batch_size, slots) if not checked else \
        ids.unpack(_packed(features, batch_size), batch_size, check=False)
    one_id_offsets = np.arange(batch_size + 1, dtype=np.int64)
    specs = []
    for name in packed.names:
        spec = slots.get(name)
        if spec is None:
            raise UnknownSlotError(name, list(slots))
        specs.append(spec)

    by_dim: dict[int, list[int]] = {}
    for i, spec in enumerate(specs):
        by_dim.setdefault(spec.dim, []).append(i)

    # Whole dims at once (one prefix, one unique, one "one ID per sample" test): per-slot numpy
    # calls were most of this function's time (26 slots of 256 IDs: 0.66 ms per batch). A dim
    # whose features lie side by side in the record (the usual case) reads its IDs as one view.
    prepared: list[PreparedSlot | None] = [None] * len(specs)
    tables: dict[int, np.ndarray] = {}
    for dim, idxs in by_dim.items():
        per_slot = []  # (values, offsets, one ID per sample)
        for i in idxs:
            spec = specs[i]
            values, offsets = packed.feature(i)
            one = offsets is None
            if one:
                offsets = one_id_offsets
            if spec.hash_stack_rounds > 0:
                values = hash_stack(values, spec.hash_stack_rounds, spec.hash_stack_embedding_size).ravel()
                offsets = offsets * spec.hash_stack_rounds
                one = False
            per_slot.append((values, offsets, one))
        sizes = [v.size for v, _, _ in per_slot]
        contiguous = (idxs == list(range(idxs[0], idxs[-1] + 1))
                      and not any(specs[i].hash_stack_rounds > 0 for i in idxs))
        if contiguous:
            start = int(packed.starts[idxs[0]])
            values = packed.values[start : start + sum(sizes)]
        else:
            values = np.concatenate([v for v, _, _ in per_slot])
        prefixes = np.repeat(np.array([specs[i].index_prefix for i in idxs], dtype=np.uint64), sizes)
        # sorted, as np.unique (own-update replay merges sorted signs); int32 positions go on the
        # wire (tables stay far below 2**31 rows)
        uniq, inverse = unique_inverse(add_index_prefix(values, prefixes, prefix_bit))
        tables[dim] = uniq
        maybe = [k for k, (_, _, one) in enumerate(per_slot) if not one and sizes[k] == batch_size]
        if maybe:  # features sent with offsets that still hold one ID per sample
            same = (np.stack([per_slot[k][1] for k in maybe]) == one_id_offsets).all(axis=1)
            for k, ok in zip(maybe, same.tolist()):
                if ok:
                    per_slot[k] = (per_slot[k][0], per_slot[k][1], True)
        start = 0
        for k, i in enumerate(idxs):
            spec = specs[i]
            _, offsets, one = per_slot[k]
            inv = inverse[start : start + sizes[k]]
            start += sizes[k]
            slot = PreparedSlot(spec=spec, offsets=offsets, table_inverse=inv, one_per_sample=one)
            if not spec.embedding_summation:
                slot.raw_rows, slot.raw_index, slot.raw_dropped = _raw_layout(inv, offsets, spec.sample_fixed_size)
            prepared[i] = slot
    return PreparedBatch(batch_size=batch_size, slots=prepared, tables=tables)  # type: ignore[arg-type]


def _raw_layout(inv: np.ndarray, offsets: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """A raw slot's kept table rows, its ``(bs, k)`` index (table row + 1; 0 pads) and whether
    IDs past ``k`` were dropped."""
    bs = offsets.size - 1
    lengths = np.diff(offsets)
    sample_of = np.repeat(np.arange(bs), lengths)
    pos = np.arange(inv.size) - np.repeat(offsets[:-1], lengths)
    keep = pos < k  # IDs past sample_fixed_size are dropped, as in PERSIA
    index = np.zeros((bs, k), dtype=np.int32)
    index[sample_of[keep], pos[keep]] = inv[keep] + 1
    return np.unique(inv[keep]).astype(np.int64), index, not bool(keep.all())


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


def raw_scale(spec: SlotSpec) -> float:
    """A raw slot's row factor: ``1/sqrt(hash_stack_rounds)`` for a sqrt-scaled hash-stacked slot."""
    if spec.sqrt_scaling and spec.hash_stack_rounds > 0:
        return float(np.float32(1.0 / np.sqrt(spec.hash_stack_rounds)))
    return 1.0


def lookup_reply(batch: PreparedBatch, rows: dict[int, np.ndarray]) -> dict:
    """What a Lookup answers: how the NN builds the model's tensors from each dim's distinct rows
    (all indices int32, into the rows of the slot's dim).

    ``tables``: per dim ``{"dim", "rows": (n_distinct, dim) float32}`` in the order of
    ``batch.tables[dim]``, plus ``"gather": (k, bs)``, the index of the dim's k slots that have
    exactly one ID per sample (one array for all of them: one decode, one gather on the NN).
    ``slots``, one entry per slot: ``{"name", "dim"}`` and either ``"gather": r`` (its row of the
    table's gather), or ``"index": (nnz,)``, ``"offsets": (bs+1,)`` and ``"sqrt_scaling"`` (summed
    slot), or ``"raw_index": (bs, sample_fixed_size)`` (table row + 1, 0 for padding) and
    ``"scale"`` (raw slot: the model gets the rows times ``scale`` and the mask).
    """
    tables = {d: {"dim": d, "rows": rows[d]} for d in batch.tables}
    gathers: dict[int, list[np.ndarray]] = {}
    slots = []
    for slot in batch.slots:
        spec = slot.spec
        entry: dict = {"name": spec.name, "dim": spec.dim}
        if not spec.embedding_summation:
            entry.update(raw_index=slot.raw_index, scale=raw_scale(spec))
        elif slot.one_per_sample:
            members = gathers.setdefault(spec.dim, [])
            entry["gather"] = len(members)
            members.append(slot.table_inverse)
        else:  # embedding_bag wants offsets of the index's dtype
            entry.update(index=slot.table_inverse, offsets=slot.offsets.astype(np.int32),
                         sqrt_scaling=spec.sqrt_scaling)
        slots.append(entry)
    for d, members in gathers.items():
        tables[d]["gather"] = np.stack(members)
    return {"tables": list(tables.values()), "slots": slots}


def assemble_rows(tables: dict[int, np.ndarray], positions: list[dict[int, np.ndarray]],
                  replies: list[list[np.ndarray] | None]) -> dict[int, np.ndarray]:
    """Each dim's rows in table order from the PS replicas' answers (``replies[s]``: the rows of
    ``positions[s]``, dim by dim). A dim wholly on one replica is taken as it came (no copy)."""
    return _assemble(tables, positions, replies, width=lambda d: d)


def _assemble(tables: dict[int, np.ndarray], positions: list[dict[int, np.ndarray]],
              replies: list[list[np.ndarray] | None], width) -> dict[int, np.ndarray]:
    """Per-row arrays of each dim in table order from the replicas' per-position answers;
    ``width(dim)``: the columns of a dim with no row at all."""
    out: dict[int, np.ndarray] = {}
    for s, reply in enumerate(replies):
        if reply is None:
            continue
        for (d, p), r in zip(positions[s].items(), reply):
            if p.size == tables[d].size:  # the whole table (positions are then 0..n-1, in order)
                out[d] = r
                continue
            if d not in out:
                out[d] = np.empty((tables[d].size, r.shape[1]), dtype=r.dtype)
            out[d][p] = r
    for d, signs in tables.items():
        if d not in out:
            if signs.size:
                raise ValueError(f"no PS replica answered for the {signs.size} rows of dim {d}")
            out[d] = np.empty((0, width(d)), dtype=np.float32)
    return out


def replay_reply(tables: dict[int, np.ndarray], positions: list[dict[int, np.ndarray]],
                 replies: list[dict | None]) -> dict:
    """What the NN worker needs to re-apply its own updates a lookup missed
    (:mod:`persia.nn_worker.replay`), from the PS replicas' answers to a lookup asked with
    ``state`` and ``applied``: per table (in ``tables`` order) the distinct ``signs``, their
    optimizer ``state``, the PS ``replica`` of each row, the ``absent`` rows (no row on the PS)
    and, per replica, the seqs of the NN worker's updates ``applied`` when the rows were read."""
    n_replicas = len(replies)
    state = _assemble(tables, positions, [None if r is None else r["state"] for r in replies], width=lambda d: 0)
    out = []
    for i, (d, signs) in enumerate(tables.items()):
        replica = np.zeros(signs.size, dtype=np.uint16)
        applied = [np.empty(0, dtype=np.int64)] * n_replicas
        absent = []
        for s, reply in enumerate(replies):
            p = positions[s].get(d)
            if reply is None or p is None:
                continue
            k = list(positions[s]).index(d)  # the replica's answers come dim by dim, in its order
            replica[p] = s
            applied[s] = np.asarray(reply["applied"][k], dtype=np.int64)
            gone = np.asarray(reply["absent"][k])
            if gone.size:
                absent.append(p[gone])
        out.append({"signs": signs, "state": state[d], "replica": replica, "applied": applied,
                    "absent": np.sort(np.concatenate(absent)).astype(np.int32) if absent
                    else np.empty(0, dtype=np.int32)})
    return {"tables": out, "replicas": n_replicas}


@dataclass
class DimGradients:
    grads: dict[int, np.ndarray]  # dim -> (n_distinct, dim) float32, loss scale undone; absent: none
    touched: dict[int, np.ndarray | None]  # dim -> bool mask of rows to update; None: every row
    skipped_non_finite: list[str]  # slots of the dims whose gradient had NaN/inf (dropped whole)


def check_gradients(batch: PreparedBatch, grads: list[np.ndarray | None], scale: float = 1.0,
                    unused_slots: list[int] = ()) -> DimGradients:
    """Validate the NN's per-dim gradients (``grads[i]`` belongs to the i-th dim of the lookup
    reply's ``tables``, None: no gradient) and decide which rows the PS updates.

    ``unused_slots``: positions of the slots whose tensor got no gradient (the model did not use
    them); their rows are updated only where a used slot shares them, as when each slot had its
    own gradient. Rows of raw-slot IDs past ``sample_fixed_size`` get no update either. ``scale``
    undoes an AMP loss scale. A dim with any non-finite gradient is skipped whole (and its slots
    reported). Wrong shapes raise ValueError naming the field and the value.
    """
    dims = list(batch.tables)
    if len(grads) != len(dims):
        raise ValueError(f"field 'grads': expected {len(dims)} per-dim gradients (dims {dims}), got {len(grads)}")
    unused = set()
    for x in unused_slots:
        if not 0 <= x < len(batch.slots):
            raise ValueError(f"field 'unused_slots': slot position {x} out of range 0..{len(batch.slots) - 1}")
        unused.add(x)
    inv_scale = np.float32(1.0 / scale) if scale != 1.0 else None
    out = DimGradients(grads={}, touched={}, skipped_non_finite=[])
    for i, (d, g) in enumerate(zip(dims, grads)):
        if g is None:
            continue
        expect = (batch.tables[d].size, d)
        if g.shape != expect:
            raise ValueError(f"field 'grads[{i}]': expected shape {expect} (the distinct rows of dim {d} "
                             f"in this batch), got {tuple(g.shape)}")
        g = np.asarray(g, dtype=np.float32)
        if not np.isfinite(g).all():
            out.skipped_non_finite += [s.spec.name for s in batch.slots if s.spec.dim == d]
            continue
        out.grads[d] = g * inv_scale if inv_scale is not None else g
        members = [(k, s) for k, s in enumerate(batch.slots) if s.spec.dim == d]
        if not any(k in unused or s.raw_dropped for k, s in members):
            out.touched[d] = None
            continue
        mask = np.zeros(expect[0], dtype=bool)
        for k, s in members:
            if k not in unused:
                mask[s.table_inverse if s.raw_rows is None else s.raw_rows] = True
        out.touched[d] = mask
    return out


def split_gradients(tables: dict[int, np.ndarray], positions: list[dict[int, np.ndarray]],
                    checked: DimGradients) -> list[list[dict]]:
    """Per PS replica, its ``{"dim", "signs", "grads"}`` update tables (rows without an update left
    out); a dim wholly on one replica with every row updated is sent as it is (no copy)."""
    out: list[list[dict]] = []
    for part in positions:
        reqs = []
        for d, p in part.items():
            g = checked.grads.get(d)
            if g is None:
                continue
            mask = checked.touched[d]
            if mask is None and p.size == tables[d].size:
                reqs.append({"dim": d, "signs": tables[d], "grads": g})
                continue
            sel = p if mask is None else p[mask[p]]
            if sel.size:
                reqs.append({"dim": d, "signs": tables[d][sel], "grads": g[sel]})
        out.append(reqs)
    return out
