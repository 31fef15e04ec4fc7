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


def test_encoding_is_byte_for_byte_stable():
    """What a peer of the previous release sends and expects: a fixed tree's exact bytes."""
    import hashlib

    tree = {"a": np.arange(5, dtype=np.int32), "t": (1, 2.5, "x", None, True), "g": np.float32(0.5),
            "n": [{"b": b"\x01", "e": np.zeros((0, 3), np.float64)}]}
    payload = encode(tree)
    assert hashlib.sha256(payload).hexdigest()[:16] == "545224d7ae404bc5"  # the encoding before the msgpack hooks
    out = decode(payload)
    assert out["t"] == [1, 2.5, "x", None, True] and out["g"] == 0.5 and out["n"][0]["e"].shape == (0, 3)


def test_malformed_array_references_are_wire_errors():
    import struct

    import msgpack

    def payload(ref):
        header = msgpack.packb({"a": ref})
        head = b"PW1\x00" + struct.pack("<I", len(header)) + header
        return head + b"\0" * ((-len(head)) % 64) + b"\0" * 64

    good = {"__nd__": 0, "dt": "<f4", "sh": [4], "off": 0}
    assert decode(payload(good))["a"].shape == (4,)
    for bad, match in (({**good, "sh": [-1]}, "negative array shape"),
                       ({**good, "sh": [1000]}, "out of range"),
                       ({**good, "off": -64}, "out of range"),
                       ({k: v for k, v in good.items() if k != "sh"}, "corrupt payload header"),
                       ({**good, "sh": ["x"]}, "corrupt payload header")):
        with pytest.raises(WireError, match=match):
            decode(payload(bad))


def test_unknown_objects_are_refused_by_name():
    with pytest.raises(TypeError, match="'object'"):
        encode({"a": object()})
