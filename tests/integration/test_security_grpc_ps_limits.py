"""What a PS computes for one gRPC request is bounded, and what it applies is finite, with a real
PS on loopback: a Lookup, Step or Update whose tables together ask for more than
``PERSIA_MAX_ARRAY_ELEMENTS`` (sum of len(signs) x dim; sign arrays may alias each other's bytes)
is refused naming the field and the value before anything is allocated; gradients that are not
all finite are refused naming the table and its dim before any row changes (before, NaN
gradients returned ok and the rows became NaN)."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

import grpc
import msgpack
import numpy as np
import pytest

from persia import messages as M
from persia import rpc
from persia.embedding_ps.service import SERVICE as PS_SERVICE
from persia.embedding_worker.colocated import InProcessPs
from persia.errors import RemoteError
from persia.wire import codec

from .cluster import cluster

pytestmark = pytest.mark.integration

SIGNS = np.arange(1, 6, dtype=np.uint64)


@pytest.fixture
def ps(persia_env):
    with cluster(1, 0) as (server,):
        server.configure({})
        server.register_optimizer({"type": "Adagrad", "lr": 0.1})
        for dim in (4, 8):
            server.lookup({"train": True, "tables": [{"dim": dim, "signs": SIGNS}]})
        yield server


@pytest.fixture
def client(ps):
    c = rpc.Client(ps.address, PS_SERVICE)
    yield c
    c.close()


def _refused(client, method, request, *needles) -> str:
    with pytest.raises(RemoteError) as err:
        client.call(method, request, timeout=60)
    assert err.value.kind == "INVALID_ARGUMENT", err.value
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))
    return str(err.value)


def _snapshot(ps):
    return {dim: (ps.store.lookup_full(SIGNS, dim, False, state=True).rows.copy(),
                  ps.store.lookup_full(SIGNS, dim, False, state=True).state.copy()) for dim in (4, 8)}


def _same(a, b) -> None:
    for dim in a:
        for x, y in zip(a[dim], b[dim]):
            np.testing.assert_array_equal(x, y)


# -- non-finite gradients ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradients_are_refused_before_any_row_changes(ps, client, bad):
    before = _snapshot(ps)
    good = np.ones((5, 4), np.float32)
    poisoned = np.ones((5, 8), np.float32)
    poisoned[3, 6] = bad
    update = {"tables": [{"dim": 4, "signs": SIGNS, "grads": good}, {"dim": 8, "signs": SIGNS, "grads": poisoned}]}
    _refused(client, "Update", update, "tables[1]", "dim 8", "grads[3, 6]", "not finite")
    _refused(client, "Update", dict(update, source=7, seqs=[1]), "tables[1]")  # a tagged update too
    new = SIGNS + 1000  # a Step's lookup does not run either
    _refused(client, "Step", {"update": update, "lookup": {"train": True, "tables": [{"dim": 4, "signs": new}]}},
             "tables[1]", "dim 8")
    _same(_snapshot(ps), before)
    assert ps.store.stats()["update_calls"] == 0 and not ps.store.contains(new, 4).any()
    assert np.isfinite(ps.store.lookup(SIGNS, 8, False)).all()
    # the in-process path of a colocated embedding worker answers the same
    local = InProcessPs(ps.address, PS_SERVICE, ps.methods)
    with pytest.raises(RemoteError) as err:
        local.call("Update", update)
    assert err.value.kind == "INVALID_ARGUMENT" and "tables[1]" in str(err.value)
    _same(_snapshot(ps), before)
    # finite gradients still apply
    poisoned[3, 6] = 0.5
    assert client.call("Update", update, timeout=10)["missing"] == 0
    assert not np.array_equal(ps.store.lookup(SIGNS, 8, False), before[8][0])


def test_float64_gradients_past_the_float32_range_are_refused(ps, client):
    """1e39 is finite in float64 and infinite once the PS converts it to its float32 rows."""
    before = _snapshot(ps)
    grads = np.zeros((5, 4), np.float64)
    grads[0, 0] = 1e39
    _refused(client, "Update", {"tables": [{"dim": 4, "signs": SIGNS, "grads": grads}]}, "tables[0]", "dim 4")
    _same(_snapshot(ps), before)


# -- size of a request -------------------------------------------------------------------------------
def _aliased_lookup(tables: int, signs: int, dim: int, train: bool = False) -> bytes:
    """A Lookup whose ``tables`` sign arrays all reference the same bytes of the payload (the wire
    codec allows it): a few KB asking for tables x signs x dim rows."""
    ref = {"__nd__": 0, "dt": "<u8", "sh": [signs], "off": 0}
    header = msgpack.packb({"m": {"train": train, "tables": [{"dim": dim, "signs": ref}] * tables}}, use_bin_type=True)
    head = codec.MAGIC + struct.pack("<I", len(header)) + header
    return head + b"\0" * codec._pad(len(head)) + np.arange(1, signs + 1, dtype=np.uint64).tobytes()


def _raw_lookup(ps, payload: bytes):
    secret = os.environ["PERSIA_JOB_SECRET"].encode()
    token = hmac.new(secret, b"persia grpc v1", hashlib.sha256).hexdigest()  # the job's credential
    channel = grpc.insecure_channel(ps.address)
    try:
        fn = channel.unary_unary(f"/{PS_SERVICE}/Lookup", request_serializer=lambda b: b,
                                 response_deserializer=rpc._unpack)
        with pytest.raises(grpc.RpcError) as err:
            fn(payload, timeout=120, metadata=(("persia-auth", token),))
        return err.value
    finally:
        channel.close()


def test_aliased_sign_arrays_cannot_ask_for_more_than_the_limit(ps):
    """17 tables of dim 65536 over one 2 KB sign array: 285,212,672 rows' elements (1.06 GiB of
    float32) from a 2.6 KB payload, refused before any of it is allocated."""
    payload = _aliased_lookup(17, 256, 65536)
    assert len(payload) < 4096
    err = _raw_lookup(ps, payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "field 'tables' asks for 285212672 elements" in err.details() and str(M.MAX_ARRAY_ELEMENTS) in err.details()
    assert ps.store.dims() == [4, 8] and ps.store.stats()["lookup_calls"] == 2


def test_lookup_total_is_bounded(ps, client, monkeypatch):
    monkeypatch.setattr(M, "MAX_ARRAY_ELEMENTS", 1 << 20)
    signs = np.arange(1, 257, dtype=np.uint64)
    at_limit = {"train": True, "tables": [{"dim": 1024, "signs": signs}] * 4}  # 4 x 256 x 1024 = 2^20
    assert [r.shape for r in client.call("Lookup", at_limit, timeout=30)["rows"]] == [(256, 1024)] * 4
    over = {"train": True, "tables": [{"dim": 1025, "signs": signs}] * 4}
    _refused(client, "Lookup", over, "field 'tables' asks for 1049600 elements", "1048576")
    assert 1025 not in ps.store.dims()  # nothing created
    err = _raw_lookup(ps, _aliased_lookup(64, 256, 1024, train=True))  # 2^24, aliased
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "16777216" in err.details(), err
    # a Step's lookups are one reply: bounded together
    half = {"train": True, "tables": [{"dim": 1024, "signs": signs}] * 2}  # 2^19 each
    assert len(client.call("Step", {"lookups": [half, None, half]}, timeout=30)["lookups"]) == 3
    _refused(client, "Step", {"lookups": [half, half, half]}, "field 'lookups' asks for 1572864 elements")
    _refused(client, "Step", {"lookup": over}, "1049600")


def test_update_total_is_bounded(ps, client, monkeypatch):
    monkeypatch.setattr(M, "MAX_ARRAY_ELEMENTS", 1 << 16)
    before = _snapshot(ps)
    signs = np.arange(1, 257, dtype=np.uint64)
    grads = np.zeros((256, 256), np.float32)  # 2^16: one table is at the limit, two are over it
    table = {"dim": 256, "signs": signs, "grads": grads}
    _refused(client, "Update", {"tables": [table, table]}, "field 'tables' carries gradients of 131072 elements")
    _refused(client, "Step", {"update": {"tables": [table, table]}}, "131072")
    _same(_snapshot(ps), before)
    assert ps.store.stats()["update_calls"] == 0
    assert client.call("Update", {"tables": [table]}, timeout=30)["missing"] == 256  # no rows of dim 256
