"""Reading the UCI Adult CSVs into PERSIA batches (shared by the data loader and the trainer)."""

from __future__ import annotations

import csv
import hashlib
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from persia.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch

DATA_DIR = Path(os.environ.get("ADULT_DATA_DIR", Path(__file__).parent / "data"))
COLUMNS = [
    "age", "workclass", "fnlwgt", "education", "education_num", "marital_status", "occupation",
    "relationship", "race", "gender", "capital_gain", "capital_loss", "hours_per_week",
    "native_country", "income",
]
CATEGORICAL = ["workclass", "education", "marital_status", "occupation", "relationship", "race",
               "gender", "native_country"]
CONTINUOUS = ["age", "education_num", "capital_gain", "capital_loss", "hours_per_week"]


def _stable_id(column: str, value: str) -> np.uint64:
    """A fixed 64-bit ID per (column, value): full uint64 range, same in every process."""
    digest = hashlib.blake2b(f"{column}={value}".encode(), digest_size=8).digest()
    return np.frombuffer(digest, dtype=np.uint64)[0]


def read_split(name: str) -> dict[str, np.ndarray]:
    """``name`` is "train" or "test": categorical IDs, dense features and the label."""
    path = DATA_DIR / ("adult.data" if name == "train" else "adult.test")
    rows = []
    with open(path, newline="") as f:
        for row in csv.reader(f, skipinitialspace=True):
            if len(row) != len(COLUMNS):
                continue  # blank lines and the test file's "|1x3 Cross validator" header
            rows.append(row)
    table = {c: [r[i] for r in rows] for i, c in enumerate(COLUMNS)}
    ids = np.empty((len(rows), len(CATEGORICAL)), dtype=np.uint64)
    for j, col in enumerate(CATEGORICAL):
        values = np.asarray(table[col])
        uniq, inv = np.unique(values, return_inverse=True)
        ids[:, j] = np.array([_stable_id(col, v) for v in uniq], dtype=np.uint64)[inv]
    dense = np.stack([np.asarray(table[c], dtype=np.float32) for c in CONTINUOUS], axis=1)
    label = np.asarray([">50K" in v for v in table["income"]], dtype=np.float32).reshape(-1, 1)
    return {"ids": ids, "dense": normalize_dense(dense), "label": label}


def normalize_dense(dense: np.ndarray) -> np.ndarray:
    """log1p on the heavy-tailed money columns, then fixed scaling (no statistics leak from test)."""
    out = dense.copy()
    out[:, 2] = np.log1p(out[:, 2])
    out[:, 3] = np.log1p(out[:, 3])
    scale = np.array([100.0, 16.0, 12.0, 9.0, 100.0], dtype=np.float32)
    return out / scale


def batches(split: dict[str, np.ndarray], batch_size: int, requires_grad: bool,
            replica_index: int = 0, replica_size: int = 1) -> Iterator[PersiaBatch]:
    """Consecutive batches; batch ``k`` belongs to data-loader replica ``k % replica_size``."""
    n = split["label"].shape[0]
    for k, start in enumerate(range(0, n, batch_size)):
        if k % replica_size != replica_index:
            continue
        end = min(start + batch_size, n)
        yield PersiaBatch(
            [IDTypeFeatureWithSingleID(col, np.ascontiguousarray(split["ids"][start:end, j]))
             for j, col in enumerate(CATEGORICAL)],
            non_id_type_features=[NonIDTypeFeature(split["dense"][start:end], name="dense")],
            labels=[Label(split["label"][start:end], name="income")],
            requires_grad=requires_grad,
        )
