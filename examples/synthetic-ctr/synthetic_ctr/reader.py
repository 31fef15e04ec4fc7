"""Stream a generated dataset as fixed-size batches, chunk by chunk (one chunk in memory at a time)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from synthetic_ctr.manifest import load_manifest
from synthetic_ctr.schema import NUM_DENSE, NUM_SLOTS


class Batch(NamedTuple):
    dense: np.ndarray  # float32 (n, 13)
    ids: np.ndarray  # uint64 (n, 26)
    label: np.ndarray  # float32 (n, 1)


def load_chunk(path: str | Path) -> Batch:
    """Read one chunk and check its schema, naming the file and the field that is wrong."""
    with np.load(path, allow_pickle=False) as z:
        missing = {"dense", "ids", "label"} - set(z.files)
        if missing:
            raise ValueError(f"chunk {str(path)!r} lacks arrays {sorted(missing)}")
        batch = Batch(dense=z["dense"], ids=z["ids"], label=z["label"])
    n = batch.dense.shape[0]
    expected = {
        "dense": (np.float32, (n, NUM_DENSE)),
        "ids": (np.uint64, (n, NUM_SLOTS)),
        "label": (np.float32, (n, 1)),
    }
    for field, (dtype, shape) in expected.items():
        arr = getattr(batch, field)
        if arr.dtype != dtype or arr.shape != shape:
            raise ValueError(
                f"chunk {str(path)!r} field {field!r} has dtype={arr.dtype} shape={arr.shape}, "
                f"expected dtype={np.dtype(dtype)} shape={shape}"
            )
    return batch


def iter_chunks(data_dir: str | Path, split: str = "train") -> Iterator[Batch]:
    manifest = load_manifest(data_dir)
    for f in manifest.split(split).files:
        yield load_chunk(Path(data_dir) / f.path)


def read_chunks(
    data_dir: str | Path,
    batch_size: int,
    split: str = "train",
    *,
    max_rows: int | None = None,
    drop_last: bool = False,
    replica_index: int = 0,
    replica_size: int = 1,
) -> Iterator[Batch]:
    """Yield batches of ``batch_size`` rows in file order (batches span chunk boundaries; only the
    last may be shorter, unless ``drop_last``). ``max_rows`` stops after that many rows. With
    ``replica_size > 1`` replica ``i`` gets batches ``i, i + size, ...`` (data-loader sharding)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got batch_size={batch_size!r}")
    if not (0 <= replica_index < replica_size):
        raise ValueError(f"need 0 <= replica_index < replica_size, got {replica_index}, {replica_size}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got max_rows={max_rows!r}")
    remaining = max_rows
    pending: list[Batch] = []
    pending_rows = 0
    batch_index = 0

    def take(parts: list[Batch]) -> Batch:
        if len(parts) == 1:
            return parts[0]
        return Batch(*(np.concatenate([getattr(p, f) for p in parts]) for f in Batch._fields))

    for chunk in iter_chunks(data_dir, split):
        if remaining is not None:
            if remaining <= 0:
                break
            chunk = Batch(*(a[:remaining] for a in chunk))
            remaining -= chunk.dense.shape[0]
        start, n = 0, chunk.dense.shape[0]
        while start < n:
            need = batch_size - pending_rows
            piece = Batch(*(a[start : start + need] for a in chunk))
            start += piece.dense.shape[0]
            pending.append(piece)
            pending_rows += piece.dense.shape[0]
            if pending_rows == batch_size:
                if batch_index % replica_size == replica_index:
                    yield take(pending)
                batch_index += 1
                pending, pending_rows = [], 0
    if pending_rows and not drop_last and batch_index % replica_size == replica_index:
        yield take(pending)


def load_vocab(data_dir: str | Path) -> list[np.ndarray]:
    """Sorted distinct training IDs per slot (see ``generate.VOCAB_NAME``)."""
    manifest = load_manifest(data_dir)
    with np.load(Path(data_dir) / manifest.vocab_file, allow_pickle=False) as z:
        return [z[name] for name in manifest.slot_names]


class VocabIndex:
    """Maps uint64 IDs to rows of a fused table: slot ``s`` owns rows ``[offset_s, offset_s + V_s]``;
    row ``offset_s + V_s`` is that slot's out-of-vocabulary row (kept at zero by the trainers, like a
    PERSIA lookup of an unseen ID at evaluation time)."""

    def __init__(self, vocab: list[np.ndarray]):
        self.vocab = vocab
        sizes = np.array([len(v) + 1 for v in vocab], dtype=np.int64)
        self.slot_rows = sizes
        self.offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        self.num_rows = int(sizes.sum())
        self.oov_rows = self.offsets + sizes - 1

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """(n, 26) uint64 IDs -> (n, 26) int64 global rows."""
        out = np.empty(ids.shape, dtype=np.int64)
        for s, v in enumerate(self.vocab):
            col = ids[:, s]
            pos = np.searchsorted(v, col)
            pos_c = np.minimum(pos, len(v) - 1)
            found = v[pos_c] == col
            out[:, s] = np.where(found, pos_c, len(v)) + self.offsets[s]
        return out

    def local_rows(self, ids: np.ndarray) -> np.ndarray:
        """Like :meth:`rows` but per-slot (no offsets), for per-table lookups (TorchRec)."""
        return self.rows(ids) - self.offsets
