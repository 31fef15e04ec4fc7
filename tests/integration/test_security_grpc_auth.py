"""gRPC authentication with the job secret, with a real PS and embedding worker on loopback: with
PERSIA_JOB_SECRET set (``persia_env`` sets one), a call without the job's credential, or with
another job's, is answered UNAUTHENTICATED before its payload is decoded and changes nothing;
PERSIA's own clients (embedding worker -> PS, NN worker and model server -> embedding worker)
carry it. Before, any client reaching the ports read and wrote embeddings and took batches."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time

import grpc
import numpy as np
import pytest

from persia import rpc
from persia.embedding_ps.service import SERVICE as PS_SERVICE
from persia.embedding_worker.service import SERVICE as EW_SERVICE
from persia.errors import RemoteError

from .cluster import cluster

pytestmark = pytest.mark.integration

SIGNS = np.arange(1, 6, dtype=np.uint64)
# another job's credential: the right key name, the right form, the wrong secret
FOREIGN = (("persia-auth", hmac.new(b"another job", b"persia grpc v1", hashlib.sha256).hexdigest()),)
NOT_OURS = [None, FOREIGN, (("persia-auth", "0" * 64),), (("persia-auth", ""),), (("other", "x"),)]


def _ours():
    """This job's credential, made as the docs describe it (metadata persia-auth)."""
    secret = os.environ["PERSIA_JOB_SECRET"].encode()
    return (("persia-auth", hmac.new(secret, b"persia grpc v1", hashlib.sha256).hexdigest()),)


def _raw(address: str, service: str, method: str, request, metadata=None, packed: bool = True):
    """A client that is not PERSIA's: a plain channel, our codec, the metadata it chooses."""
    channel = grpc.insecure_channel(address)
    try:
        fn = channel.unary_unary(f"/{service}/{method}",
                                 request_serializer=rpc._pack if packed else (lambda b: b),
                                 response_deserializer=rpc._unpack)
        return fn(request, timeout=10, metadata=metadata)["m"]
    finally:
        channel.close()


def _unauthenticated(address, service, method, request, metadata=None, packed=True) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _raw(address, service, method, request, metadata, packed)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, metadata, err.value)
    return err.value.details()


def _trained_ps(ps):
    ps.configure({})
    ps.register_optimizer({"type": "SGD", "lr": 0.1})
    ps.lookup({"train": True, "tables": [{"dim": 4, "signs": SIGNS}]})
    return ps.store.lookup(SIGNS, 4, False).copy()


def test_ps_refuses_calls_without_the_job_credential(persia_env):
    with cluster(1, 0) as (ps,):
        before = _trained_ps(ps)
        rows_before = len(ps.store)
        nan = np.full((5, 4), np.nan, np.float32)
        calls = [
            ("Lookup", {"train": False, "tables": [{"dim": 4, "signs": SIGNS}]}),  # reads embeddings
            ("Lookup", {"train": True, "tables": [{"dim": 4, "signs": SIGNS + 100}]}),  # creates rows
            ("Update", {"tables": [{"dim": 4, "signs": SIGNS, "grads": nan}]}),  # writes rows
            ("Step", {"update": {"tables": [{"dim": 4, "signs": SIGNS, "grads": nan}]}}),
            ("Stats", None),
        ]
        for method, request in calls:
            for metadata in NOT_OURS:
                detail = _unauthenticated(ps.address, PS_SERVICE, method, request, metadata)
                assert f"{PS_SERVICE}/{method}" in detail and "credential" in detail
        np.testing.assert_array_equal(ps.store.lookup(SIGNS, 4, False), before)
        assert len(ps.store) == rows_before
        assert ps.store.stats()["update_calls"] == 0
        # PERSIA's client carries the credential (from PERSIA_JOB_SECRET)
        client = rpc.Client(ps.address, PS_SERVICE)
        try:
            got = client.call("Lookup", {"train": False, "tables": [{"dim": 4, "signs": SIGNS}]}, timeout=10)
            np.testing.assert_array_equal(got["rows"][0], before)
        finally:
            client.close()


def test_refused_before_the_payload_is_decoded(persia_env, monkeypatch):
    """Undecodable bytes from a client without the credential are UNAUTHENTICATED, not
    INVALID_ARGUMENT: the decoder never sees them (with the credential they are still
    INVALID_ARGUMENT, and the server keeps serving)."""
    decoded = []
    real_decode = rpc.decode
    monkeypatch.setattr(rpc, "decode", lambda buf: decoded.append(len(buf)) or real_decode(buf))
    with cluster(1, 0) as (ps,):
        ps.configure({})
        aliased = rpc._pack({"train": True, "tables": [{"dim": 4, "signs": SIGNS}]})
        for blob in (b"", b"garbage", b"PW1\x00\xff\xff\xff\xff", aliased):
            for metadata in NOT_OURS:
                _unauthenticated(ps.address, PS_SERVICE, "Lookup", blob, metadata, packed=False)
        assert decoded == []
        assert len(ps.store) == 0
        ours = _ours()
        with pytest.raises(grpc.RpcError) as err:
            _raw(ps.address, PS_SERVICE, "Lookup", b"garbage", ours, packed=False)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert decoded == [len(b"garbage")]


def test_embedding_worker_refuses_calls_without_the_job_credential(persia_env):
    """Without the credential nobody takes (Lookup), drops (Release), feeds (Update) or queries a
    batch; the NN worker's client (and the model server's, InferCtx) carry it."""
    from persia.nn_worker.infer_ctx import InferCtx

    with cluster(1, 1) as (ps, ew):
        ps.configure({})
        ps.register_optimizer({"type": "SGD", "lr": 0.1})
        batch = {"batch_size": 3, "features": [{"name": "user", "values": np.array([5, 6, 5], np.uint64),
                                                 "offsets": np.array([0, 1, 2, 3], np.int64)}]}
        ref = ew.on_forward(batch)["ref"]
        address = f"127.0.0.1:{ew.port}"
        stats = ew.stats()
        calls = [("Lookup", {"ref": ref}), ("Release", {"refs": [ref]}),
                 ("Update", {"ref": ref, "grads": [np.full((2, 4), np.nan, np.float32)]}),
                 ("Step", {"ref": ref}), ("LookupDirect", batch), ("Stats", None), ("Ready", None)]
        for method, request in calls:
            for metadata in NOT_OURS:
                _unauthenticated(address, EW_SERVICE, method, request, metadata)
        assert ew.stats() == stats
        assert len(ps.store) == 0
        client = rpc.Client(address, EW_SERVICE)  # the NN worker's
        try:
            reply = client.call("Lookup", {"ref": ref}, timeout=10)  # the batch is still there
            assert [t["rows"].shape for t in reply["tables"]] == [(2, 4)]
            assert client.call("Update", {"ref": ref, "grads": [np.ones((2, 4), np.float32)]}, timeout=10)["missing"] == 0
        finally:
            client.close()
        ctx = InferCtx([address])  # the model server's (persia.serving.predictor)
        assert ctx._workers[0].call("Ready", None, timeout=10)["ready"] is True
        stranger = rpc.Client(address, EW_SERVICE, secret=None)
        try:
            with pytest.raises(RemoteError) as err:
                stranger.call("Ready", None, timeout=10)
            assert err.value.kind == "UNAUTHENTICATED"
        finally:
            stranger.close()


def test_refusals_are_logged_at_most_once_a_second(persia_env, caplog, monkeypatch):
    monkeypatch.setattr(rpc, "_refusals", rpc._Refusals())  # the process's pace: not an earlier test's
    with cluster(1, 0) as (ps,):
        caplog.set_level(logging.WARNING, logger="persia.rpc")
        start = time.monotonic()
        for _ in range(40):
            _unauthenticated(ps.address, PS_SERVICE, "Stats", None)
        elapsed = time.monotonic() - start
        lines = [r.getMessage() for r in caplog.records if "refused a gRPC call" in r.getMessage()]
        assert 1 <= len(lines) <= 1 + int(elapsed), (elapsed, lines)
        assert f"{PS_SERVICE}/Stats" in lines[0] and "127.0.0.1" in lines[0]
        assert all("more refused since the last line" in line for line in lines[1:])


def test_only_the_secret_decides(persia_env):
    """A server with a secret serves the clients that have it; a server without one serves every
    client as before (a credential it does not expect is ignored)."""
    echo = {"Echo": (lambda r: {"echo": r["x"]}, None)}
    with_secret, port_a = rpc.serve("persia.Echo", echo, 0, host="127.0.0.1", secret=b"s1")
    without, port_b = rpc.serve("persia.Echo", echo, 0, host="127.0.0.1", secret=None)
    try:
        for port, secret, ok in [(port_a, b"s1", True), (port_a, None, False), (port_a, b"s2", False),
                                 (port_b, None, True), (port_b, b"s1", True)]:
            client = rpc.Client(f"127.0.0.1:{port}", "persia.Echo", secret=secret)
            try:
                if ok:
                    assert client.call("Echo", {"x": np.arange(3)}, timeout=10)["echo"].tolist() == [0, 1, 2]
                    assert client.result("Echo", client.future("Echo", {"x": 1}, timeout=10))["echo"] == 1
                else:
                    with pytest.raises(RemoteError) as err:
                        client.call("Echo", {"x": 1}, timeout=10)
                    assert err.value.kind == "UNAUTHENTICATED", (port, secret)
            finally:
                client.close()
        assert _raw(f"127.0.0.1:{port_b}", "persia.Echo", "Echo", {"x": 2})["echo"] == 2
    finally:
        with_secret.stop(None)
        without.stop(None)
