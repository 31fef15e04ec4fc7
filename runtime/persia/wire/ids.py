"""All ID features of one batch as one packed record on the wire (data loader -> embedding worker).

A batch's ID features used to travel as one ``{"name", "values", "offsets"}`` entry per feature:
the codec then walked and mapped ~52 small arrays per batch and the worker checked each feature on
its own (together ~0.5 ms per 256-row batch of 26 features). Packed, a batch is four fields:

* ``names``: the features' names, in order;
* ``single``: bool per feature, True where the feature has exactly one ID per sample
  (``IDTypeFeatureWithSingleID``): it sends no offsets;
* ``values``: uint64, every feature's IDs one after the other (a single-ID feature: batch_size IDs);
* ``offsets``: int64 ``(n_multi, batch_size + 1)``, the CSR offsets of the other features, in
  order, each row starting at 0 (relative to the feature's own IDs).

:func:`unpack` checks the whole record in a few numpy passes and names the feature and the value
that is wrong. It never copies ``values``; each feature's IDs are a view into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

_ID = np.dtype(np.uint64)
_OFF = np.dtype(np.int64)


def pack(names: Sequence[str], values: Sequence[np.ndarray], offsets: Sequence[np.ndarray | None],
         batch_size: int) -> dict:
    """The packed record of features given as parallel lists (``offsets[i]`` None: one ID per
    sample). ``values`` must already be 1-D uint64 (the data API converts and checks them)."""
    single = np.fromiter((o is None for o in offsets), dtype=bool, count=len(names))
    multi = [o for o in offsets if o is not None]
    return {
        "names": list(names),
        "single": single,
        "values": np.concatenate(values) if len(values) else np.empty(0, _ID),
        "offsets": np.stack(multi).astype(_OFF, copy=False) if multi else np.empty((0, batch_size + 1), _OFF),
    }


def pack_csr(features: Sequence[dict], batch_size: int) -> dict:
    """``[{"name", "values", "offsets"}]`` (the per-feature form) packed; for tests and tools.
    Each feature's dtype and rank are checked first, so nothing is cast silently."""
    for f in features:
        v, o = np.asarray(f["values"]), np.asarray(f["offsets"])
        if v.dtype != _ID or v.ndim != 1:
            raise ValueError(f"ID feature {f['name']!r}: values must be 1-D uint64, got dtype {v.dtype} "
                             f"ndim {v.ndim}")
        if o.dtype.kind not in "iu" or o.shape != (batch_size + 1,):
            raise ValueError(f"ID feature {f['name']!r}: offsets must be integers of shape ({batch_size + 1},) "
                             f"(batch size {batch_size}), got dtype {o.dtype} shape {o.shape}")
    return pack([f["name"] for f in features], [np.asarray(f["values"]) for f in features],
                [np.asarray(f["offsets"]) for f in features], batch_size)


@dataclass
class PackedIds:
    """An unpacked record: feature ``i``'s IDs are ``values[starts[i]:starts[i] + sizes[i]]``;
    ``row[i]`` is its row of ``offsets`` (-1 for a single-ID feature)."""

    names: list[str]
    single: np.ndarray  # bool (n,)
    values: np.ndarray  # uint64 (nnz,)
    offsets: np.ndarray  # int64 (n_multi, bs + 1)
    sizes: np.ndarray  # int64 (n,)
    starts: np.ndarray  # int64 (n,)
    row: np.ndarray  # int64 (n,)

    def feature(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Feature ``i``'s IDs and its offsets (None: one ID per sample)."""
        s = int(self.starts[i])
        vals = self.values[s : s + int(self.sizes[i])]
        return vals, (None if self.single[i] else self.offsets[int(self.row[i])])


def unpack(record: dict, batch_size: int, check: bool = True) -> PackedIds:
    """The record's features located in ``values``. ``check`` (the record came from outside and was
    not checked yet): dtypes, shapes, offsets and sizes are validated; ValueError names the field,
    the feature and the value."""
    names, single, values, offsets = record["names"], record["single"], record["values"], record["offsets"]
    n = len(names)
    if check:
        if not isinstance(single, np.ndarray) or single.dtype != np.bool_ or single.shape != (n,):
            raise ValueError(f"field 'single': expected a bool array of shape ({n},) (one per name), "
                             f"got {getattr(single, 'dtype', type(single).__name__)} "
                             f"shape {getattr(single, 'shape', None)}")
        if not isinstance(values, np.ndarray) or values.dtype != _ID or values.ndim != 1:
            raise ValueError(f"field 'values': expected 1-D uint64 IDs, got dtype "
                             f"{getattr(values, 'dtype', type(values).__name__)} ndim {getattr(values, 'ndim', None)}")
        n_multi = n - int(single.sum())
        if (not isinstance(offsets, np.ndarray) or offsets.dtype.kind not in "iu"
                or offsets.shape != (n_multi, batch_size + 1)):
            raise ValueError(f"field 'offsets': expected integers of shape ({n_multi}, {batch_size + 1}) "
                             f"({n_multi} features with offsets, batch size {batch_size}), got dtype "
                             f"{getattr(offsets, 'dtype', None)} shape {getattr(offsets, 'shape', None)}")
    multi = np.flatnonzero(~single)
    if check and multi.size:
        if offsets.dtype.kind == "u" and int(offsets.max()) > np.iinfo(np.int64).max:
            raise ValueError("field 'offsets': values overflow int64")
        offsets = offsets.astype(_OFF, copy=False)
        bad_first = np.flatnonzero(offsets[:, 0] != 0)
        if bad_first.size:
            r = int(bad_first[0])
            raise ValueError(f"ID feature {names[multi[r]]!r}: offsets must start at 0, got {int(offsets[r, 0])}")
        over = np.flatnonzero(offsets[:, -1] > values.size)
        if over.size:
            r = int(over[0])
            raise ValueError(f"ID feature {names[multi[r]]!r}: offsets end at {int(offsets[r, -1])}, past the "
                             f"{values.size} IDs sent")
        steps = np.diff(offsets, axis=1)
        bad = np.argwhere(steps < 0)
        if bad.size:
            r, j = (int(x) for x in bad[0])
            raise ValueError(f"ID feature {names[multi[r]]!r}: offsets must be non-decreasing, but "
                             f"offsets[{j + 1}] = {int(offsets[r, j + 1])} < offsets[{j}] = {int(offsets[r, j])}")
    offsets = offsets.astype(_OFF, copy=False)
    sizes = np.full(n, batch_size, dtype=np.int64)
    sizes[multi] = offsets[:, -1]
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    total = int(starts[-1] + sizes[-1]) if n else 0
    if check and total != values.size:
        raise ValueError(f"field 'values': the features' sizes add up to {total} IDs "
                         f"({int(single.sum())} single-ID features of {batch_size} and the offsets' ends), "
                         f"but {values.size} IDs were sent")
    row = np.full(n, -1, dtype=np.int64)
    row[multi] = np.arange(multi.size)
    return PackedIds(names=list(names), single=single, values=values, offsets=offsets, sizes=sizes,
                     starts=starts, row=row)
