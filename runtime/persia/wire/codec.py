"""Pickle-free binary codec for trees of dict/list/scalars/bytes/numpy arrays.

Layout: ``MAGIC | u32 header_len | msgpack header | padding | raw array buffers``. The header is the
tree with every array replaced by ``{"__nd__": i, "dt": dtype, "sh": shape, "off": offset}``; array
bytes follow 64-byte aligned, and decoding maps them with ``np.frombuffer`` (no copy). Only a fixed
set of plain dtypes is accepted, so a payload can never make us build arbitrary objects.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import numpy as np

MAGIC = b"PW1\x00"
_ALIGN = 64
_ALLOWED_DTYPES = frozenset(
    np.dtype(t).str
    for t in (
        np.bool_, np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64,
    )
)
_DTYPES = {s: np.dtype(s) for s in _ALLOWED_DTYPES}
_ND_KEY = "__nd__"


class WireError(ValueError):
    """A payload that is not ours, truncated, or asks for something we do not decode."""


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def encode(obj: Any) -> bytes:
    """Serialize ``obj``; arrays are written once, contiguous, in native little-endian layout.
    msgpack walks the tree in C and calls back only for arrays and numpy scalars (a Python walk of
    every node cost 4x as much on a lookup reply)."""
    buffers: list[memoryview] = []
    offset = 0

    def array_ref(x: Any) -> Any:
        nonlocal offset
        if isinstance(x, np.ndarray):
            if x.dtype.str not in _ALLOWED_DTYPES:
                raise WireError(f"cannot encode array of dtype {x.dtype}")
            arr = np.ascontiguousarray(x)
            ref = {_ND_KEY: len(buffers), "dt": arr.dtype.str, "sh": list(arr.shape), "off": offset}
            buffers.append(memoryview(arr).cast("B") if arr.nbytes else memoryview(b""))
            offset += arr.nbytes + _pad(arr.nbytes)
            return ref
        if isinstance(x, np.generic):
            return x.item()
        raise TypeError(f"cannot encode {type(x).__name__!r} object")

    header = msgpack.packb(obj, use_bin_type=True, default=array_ref)
    head_len = len(MAGIC) + 4 + len(header)
    parts: list[bytes | memoryview] = [MAGIC, struct.pack("<I", len(header)), header, b"\0" * _pad(head_len)]
    for mv in buffers:
        parts.append(mv)
        parts.append(b"\0" * _pad(mv.nbytes))
    return b"".join(parts)


def decode(buf: bytes | bytearray | memoryview) -> Any:
    """Inverse of :func:`encode`. Arrays are read-only views into ``buf`` (copy to mutate). Array
    references are resolved as msgpack builds each map (no second walk over the tree)."""
    mv = memoryview(buf)
    if len(mv) < len(MAGIC) + 4 or bytes(mv[: len(MAGIC)]) != MAGIC:
        raise WireError("not a persia wire payload (bad magic)")
    (hlen,) = struct.unpack_from("<I", mv, len(MAGIC))
    hstart = len(MAGIC) + 4
    if hstart + hlen > len(mv):
        raise WireError(f"truncated payload: header needs {hlen} bytes, {len(mv) - hstart} present")
    body_start = hstart + hlen + _pad(hstart + hlen)
    total = len(mv)

    def array_of(x: dict) -> Any:
        if _ND_KEY not in x:
            return x
        dtype = _DTYPES.get(x.get("dt"))
        if dtype is None:
            raise WireError(f"payload asks for unsupported dtype {x.get('dt')!r}")
        shape = tuple(int(s) for s in x["sh"])
        if any(s < 0 for s in shape):
            raise WireError(f"payload asks for a negative array shape {shape}")
        count = math.prod(shape)
        start = body_start + int(x["off"])
        end = start + count * dtype.itemsize
        if start < body_start or end > total:
            raise WireError("truncated payload: array data out of range")
        return np.frombuffer(mv[start:end], dtype=dtype, count=count).reshape(shape)

    try:
        return msgpack.unpackb(mv[hstart : hstart + hlen], raw=False, strict_map_key=False, object_hook=array_of)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several types; a malformed array reference too
        raise WireError(f"corrupt payload header: {exc}") from None
