"""Requests to the model server, pure functions: JSON bodies to ``PersiaBatch``, merging several
requests into one model batch and splitting the output back.

JSON body (``POST /v1/predict``, ``Content-Type: application/json``)::

    {"id_type_features": {"<slot>": [<id> | [<id>, ...], ...]},      one entry per sample
     "non_id_type_features": {"<name>": [[<float>, ...], ...]}}     in the order the model takes

IDs are unsigned 64-bit integers, as JSON numbers or decimal strings (JavaScript clients lose
precision above 2^53). The binary form (``application/x-persia-batch``) is
``PersiaBatch.to_bytes()``: versioned, pickle-free (``persia.wire.codec``).
Every error names the field and the value, and becomes a 400. Dense features reach the model as
float32 and finite: the binary form's float16 and 8/16-bit integer columns are widened (exact);
float64, 32/64-bit integers and bool are refused naming the feature, as are NaN and infinities.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import numpy as np

from persia.data_loader.batch import (
    IDTypeFeature,
    IDTypeFeatureWithSingleID,
    NonIDTypeFeature,
    PersiaBatch,
    PersiaDataError,
)

MAX_JSON_DEPTH = 64  # a request nests 4 deep; json.loads recursed to the limit on "[[[[..."
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth_over(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``body``'s arrays and objects nest deeper than ``limit`` (brackets inside strings
    do not count). Checked before ``json.loads``, whose recursion to the interpreter's limit left
    no stack for anything else on that thread (a garbage collection's finalizers failed there)."""
    if body.count(b"[") + body.count(b"{") <= limit:  # cannot nest deeper: no scan (small requests)
        return False
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)  # C speed; then only these
    opening = (np.frombuffer(brackets, dtype=np.uint8) & 0x02) != 0  # "[" 0x5b, "{" 0x7b; "]" 0x5d, "}" 0x7d
    return bool(opening.size) and int(np.cumsum(opening.astype(np.int32) * 2 - 1).max()) > limit


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``' object hook: a key given twice is refused (the last one won silently, so
    ``{"user": [...], "user": [...]}`` served the second list as if the first had not been sent)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise RequestError(key, "given twice in one JSON object")
        out[key] = value
    return out


def parse_json(body: bytes) -> Any:
    """A JSON request body, parsed: too deep, invalid, or with a key twice in one object is a
    RequestError naming it."""
    if json_depth_over(body):
        raise RequestError("body", f"not valid JSON: nested more than {MAX_JSON_DEPTH} deep")
    try:
        return json.loads(body, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as exc:  # > 4300-digit numbers too (RequestError passes)
        if isinstance(exc, RequestError):
            raise
        raise RequestError("body", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError("body", "not valid JSON: nested too deeply") from None


_U64_MAX = (1 << 64) - 1
_U64_DIGITS = len(str(_U64_MAX))
#: dense dtypes widened to float32 without changing a value; others are refused (the model takes float32)
_EXACT_IN_FLOAT32 = frozenset(np.dtype(t) for t in (np.float16, np.int8, np.int16, np.uint8, np.uint16))


class RequestError(ValueError):
    """A request the server will not run; ``field`` names what is wrong (answered 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _id(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise RequestError(field, f"an ID must be an unsigned 64-bit integer, got {_short(value)}")
    # ASCII digits only: "²" and other Unicode digits pass str.isdigit() yet int() refuses them, and
    # a long string would reach int()'s 4300-digit limit (ValueError) or cost quadratic time
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= _U64_DIGITS:
        value = int(value)
    if not isinstance(value, int) or not 0 <= value <= _U64_MAX:
        raise RequestError(field, f"an ID must be an unsigned 64-bit integer, got {_short(value)}")
    return value


def _name(name: str, field: str) -> str:
    if not name:
        raise RequestError(field, "a feature name must not be empty")
    return name


def _id_feature(name: str, samples: Any, field: str) -> IDTypeFeature | IDTypeFeatureWithSingleID:
    _name(name, "id_type_features")
    if not isinstance(samples, list) or not samples:
        raise RequestError(field, f"expected a non-empty list with one entry per sample, got {_short(samples)}")
    if all(not isinstance(s, list) for s in samples):
        ids = np.array([_id(s, f"{field}[{i}]") for i, s in enumerate(samples)], dtype=np.uint64)
        return IDTypeFeatureWithSingleID(name, ids)
    per_sample = []
    for i, s in enumerate(samples):
        ids = s if isinstance(s, list) else [s]
        per_sample.append(np.array([_id(v, f"{field}[{i}][{j}]") for j, v in enumerate(ids)], dtype=np.uint64))
    return IDTypeFeature(name, per_sample)


def _dense(samples: Any, field: str) -> np.ndarray:
    if not isinstance(samples, list) or not samples:
        raise RequestError(field, f"expected a non-empty list with one row per sample, got {_short(samples)}")
    for i, row in enumerate(samples):
        items = row if isinstance(row, list) else [row]
        for j, v in enumerate(items):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RequestError(f"{field}[{i}]" + (f"[{j}]" if isinstance(row, list) else ""),
                                   f"expected a number, got {_short(v)}")
    try:
        with np.errstate(over="ignore"):  # a value beyond float32 becomes inf: refused just below
            arr = np.asarray(samples, dtype=np.float32)
    except OverflowError:  # an integer beyond float64 (10**400)
        raise RequestError(field, "values must be finite float32 numbers") from None
    except ValueError as exc:
        raise RequestError(field, f"rows must all have the same length ({exc})") from None
    if not np.isfinite(arr).all():
        raise RequestError(field, "values must be finite float32 numbers (no NaN, no infinity, "
                                  f"at most {float(np.finfo(np.float32).max):.4g} in magnitude)")
    return arr.reshape(-1, 1) if arr.ndim == 1 else arr


def check_dense(batch: PersiaBatch) -> PersiaBatch:
    """A binary request's dense features as the model takes them: float32 and finite. Exact
    widening (float16, 8/16-bit integers) is done; anything else is a RequestError naming the
    feature. The JSON path builds float32 itself (:func:`_dense`)."""
    for part in batch.non_id_type_features:
        field = f"non_id_type_features.{part.name}"
        dtype = part.data.dtype
        if dtype != np.float32:
            if dtype not in _EXACT_IN_FLOAT32:
                raise RequestError(field, f"dtype {dtype} is not accepted: the model takes float32 (send float32; "
                                          f"float16 and 8/16-bit integers are widened exactly)")
            part.data = part.data.astype(np.float32)
        if not np.isfinite(part.data).all():
            raise RequestError(field, "values must be finite (no NaN, no infinity)")
    return batch


def batch_from_json(body: Any) -> PersiaBatch:
    """A JSON request body (already parsed) as a ``PersiaBatch``; RequestError names the field."""
    if not isinstance(body, dict):
        raise RequestError("body", f"expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - {"id_type_features", "non_id_type_features"})
    if unknown:
        raise RequestError(unknown[0], "unknown field (expected id_type_features, non_id_type_features)")
    ids = body.get("id_type_features")
    if not isinstance(ids, dict) or not ids:
        raise RequestError("id_type_features", f"expected an object of slot name -> per-sample IDs, got {_short(ids)}")
    dense = body.get("non_id_type_features", {})
    if not isinstance(dense, dict):
        raise RequestError("non_id_type_features", f"expected an object of name -> rows, got {_short(dense)}")
    features = [_id_feature(name, s, f"id_type_features.{name}") for name, s in ids.items()]
    non_id = []
    for name, samples in dense.items():
        _name(name, "non_id_type_features")
        non_id.append(NonIDTypeFeature(_dense(samples, f"non_id_type_features.{name}"), name=name))
    sizes = {f"id_type_features.{f.name}": f.batch_size for f in features}
    sizes.update({f"non_id_type_features.{p.name}": p.data.shape[0] for p in non_id})
    first = next(iter(sizes.values()))
    for field, n in sizes.items():
        if n != first:
            raise RequestError(field, f"has {n} samples, but {next(iter(sizes))} has {first}")
    try:
        return PersiaBatch(features, non_id_type_features=non_id, requires_grad=False)
    except PersiaDataError as exc:
        raise RequestError("body", str(exc)) from None


def batch_from_bytes(buf: bytes) -> PersiaBatch:
    """``PersiaBatch.to_bytes()`` from a client; labels and gradients flags are ignored; dense
    features as :func:`check_dense` leaves them."""
    try:
        batch = PersiaBatch.from_bytes(buf)
    except PersiaDataError as exc:
        raise RequestError("body", str(exc)) from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # any decoding failure is the payload's
        raise RequestError("body", f"not a PersiaBatch payload: {type(exc).__name__}: {exc}") from None
    return check_dense(batch)


def signature(batch: PersiaBatch) -> tuple:
    """Requests merge into one model batch only when slots and dense columns agree."""
    return (
        tuple(f.name for f in batch.id_type_features),
        tuple((p.name, p.data.dtype.str, p.data.shape[1:]) for p in batch.non_id_type_features),
    )


def merge(batches: Sequence[PersiaBatch]) -> PersiaBatch:
    """One batch with every sample of ``batches`` in order (all of the same :func:`signature`)."""
    if len(batches) == 1:
        return batches[0]
    features = []
    for j, first in enumerate(batches[0].id_type_features):
        parts = [b.id_type_features[j] for b in batches]
        if all(isinstance(p, IDTypeFeatureWithSingleID) for p in parts):
            features.append(IDTypeFeatureWithSingleID(first.name, np.concatenate([p.data for p in parts])))
            continue
        values, offsets, base = [], [np.zeros(1, dtype=np.int64)], 0
        for p in parts:
            v, o = p.to_csr()
            values.append(v)
            offsets.append(np.asarray(o[1:], dtype=np.int64) + base)
            base += int(v.shape[0])
        features.append(IDTypeFeature.from_csr(first.name, np.concatenate(values), np.concatenate(offsets)))
    non_id = [
        NonIDTypeFeature(np.concatenate([b.non_id_type_features[j].data for b in batches]), name=p.name)
        for j, p in enumerate(batches[0].non_id_type_features)
    ]
    return PersiaBatch(features, non_id_type_features=non_id, requires_grad=False)


def split(output: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """The model's output rows back to the requests they came from."""
    if output.shape[0] != sum(sizes):
        raise ValueError(f"model returned {output.shape[0]} rows for {sum(sizes)} samples")
    bounds = np.cumsum([0, *sizes])
    return [output[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]


def rows(batch: PersiaBatch, start: int, stop: int) -> PersiaBatch:
    """Samples ``start:stop`` of ``batch`` (ID and dense features; a request larger than
    ``max_batch_size`` runs in such chunks)."""
    features = []
    for f in batch.id_type_features:
        if isinstance(f, IDTypeFeatureWithSingleID):
            features.append(IDTypeFeatureWithSingleID(f.name, f.data[start:stop]))
            continue
        values, offsets = f.to_csr()
        offsets = np.asarray(offsets, dtype=np.int64)
        features.append(IDTypeFeature.from_csr(f.name, values[offsets[start]:offsets[stop]],
                                               offsets[start:stop + 1] - offsets[start]))
    non_id = [NonIDTypeFeature(p.data[start:stop], name=p.name) for p in batch.non_id_type_features]
    return PersiaBatch(features, non_id_type_features=non_id, requires_grad=False)


def describe(sig: tuple) -> str:
    """A :func:`signature` in words: what a request must send to match it."""
    slots, dense = sig
    text = f"ID slots {list(slots)}"
    if dense:
        text += " and dense features " + ", ".join(
            f"{name} ({'x'.join(map(str, shape)) or 'scalar'} per sample)" for name, _, shape in dense)
    else:
        text += " and no dense features"
    return text
