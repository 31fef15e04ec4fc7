import numpy as np
import pytest

from persia.wire.codec import WireError, decode, encode


def test_round_trip_keeps_dtypes_shapes_and_scalars():
    tree = {
        "ids": np.arange(7, dtype=np.uint64),
        "emb": np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32),
        "mask": np.array([[True, False]]),
        "empty": np.empty((0, 4), np.float16),
        "meta": b"\x00\x01",
        "nested": [{"name": "x", "n": 3, "f": 0.5, "none": None}],
        "scalar": np.int64(9),
    }
    out = decode(encode(tree))
    for k in ("ids", "emb", "mask", "empty"):
        assert out[k].dtype == tree[k].dtype and out[k].shape == tree[k].shape
        np.testing.assert_array_equal(out[k], tree[k])
    assert out["meta"] == b"\x00\x01" and out["nested"] == tree["nested"] and out["scalar"] == 9


def test_non_contiguous_arrays_are_encoded_by_value():
    a = np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2]
    np.testing.assert_array_equal(decode(encode({"a": a}))["a"], a)


def test_object_arrays_are_refused():
    with pytest.raises(WireError, match="dtype object"):
        encode({"a": np.array([object()])})


def test_foreign_and_truncated_payloads_are_rejected():
    payload = encode({"a": np.arange(100, dtype=np.float64)})
    with pytest.raises(WireError, match="bad magic"):
        decode(b"\x80\x04pickle")
    with pytest.raises(WireError, match="truncated"):
        decode(payload[: len(payload) // 2])


def test_header_cannot_request_unsupported_dtypes():
    import msgpack
    import struct

    header = msgpack.packb({"a": {"__nd__": 0, "dt": "|O", "sh": [1], "off": 0}})
    payload = b"PW1\x00" + struct.pack("<I", len(header)) + header + b"\0" * 64
    with pytest.raises(WireError, match="unsupported dtype"):
        decode(payload)
