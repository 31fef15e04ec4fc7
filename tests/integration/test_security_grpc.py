"""gRPC security with real servers on loopback: TLS and mutual TLS round trips (throwaway
certificates made with the openssl CLI), plaintext or certificate-less clients refused, and
malformed or oversized requests answered INVALID_ARGUMENT while the server keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from persia import rpc
from persia import messages as M
from persia.wire import ids
from persia.errors import RemoteError
from persia.security import GRPC_AUTH_METADATA, GrpcTls, grpc_token, job_secret

from .certs import certs  # noqa: F401 - fixture
from .cluster import cluster

pytestmark = pytest.mark.integration


def _tls(d, ca=True, cert=None) -> GrpcTls:
    return GrpcTls(ca=(d / "ca.pem").read_bytes() if ca else None,
                   cert=(d / f"{cert}.pem").read_bytes() if cert else None,
                   key=(d / f"{cert}.key").read_bytes() if cert else None)


def _echo_server(tls: GrpcTls):
    return rpc.serve("persia.Echo", {"Echo": (lambda r: {"echo": r["x"]}, None)}, 0, host="127.0.0.1", tls=tls)


def _call(port: int, tls: GrpcTls):
    client = rpc.Client(f"127.0.0.1:{port}", "persia.Echo", tls=tls)
    try:
        return client.call("Echo", {"x": np.arange(3)}, timeout=10)
    finally:
        client.close()


def _refused(port: int, tls: GrpcTls) -> None:
    with pytest.raises(RemoteError) as err:
        _call(port, tls)
    assert err.value.kind == "UNAVAILABLE", err.value


def test_tls_round_trip_and_plaintext_refused(certs):
    server, port = _echo_server(_tls(certs, ca=False, cert="server"))
    try:
        assert _call(port, _tls(certs))["echo"].tolist() == [0, 1, 2]
        _refused(port, GrpcTls())  # plaintext client
        _refused(port, GrpcTls(ca=(certs / "other.pem").read_bytes()))  # does not trust our CA
    finally:
        server.stop(None)


def test_tls_server_name_override(certs, monkeypatch):
    """PERSIA_GRPC_TLS_SERVER_NAME: clients verify that name instead of the dialled address."""
    server, port = _echo_server(_tls(certs, ca=False, cert="server"))
    try:
        monkeypatch.setenv("PERSIA_GRPC_TLS_SERVER_NAME", "localhost")  # in the certificate
        assert _call(port, _tls(certs))["echo"].tolist() == [0, 1, 2]
        monkeypatch.setenv("PERSIA_GRPC_TLS_SERVER_NAME", "persia-grpc")  # not in it
        _refused(port, _tls(certs))
    finally:
        server.stop(None)


def test_mutual_tls_requires_a_client_certificate_from_the_ca(certs):
    server, port = _echo_server(_tls(certs, ca=True, cert="server"))
    try:
        assert _call(port, _tls(certs, cert="client"))["echo"].tolist() == [0, 1, 2]
        _refused(port, _tls(certs))  # no client certificate
        _refused(port, GrpcTls(ca=(certs / "ca.pem").read_bytes(), cert=(certs / "other.pem").read_bytes(),
                               key=(certs / "other.key").read_bytes()))  # a certificate from another CA
    finally:
        server.stop(None)


def test_ps_and_worker_under_mutual_tls_from_env(certs, persia_env, monkeypatch):
    """The real services take their certificates from PERSIA_GRPC_TLS_* (the operator's contract)."""
    monkeypatch.setenv("PERSIA_GRPC_TLS_CA", str(certs / "ca.pem"))
    monkeypatch.setenv("PERSIA_GRPC_TLS_CERT", str(certs / "server.pem"))
    monkeypatch.setenv("PERSIA_GRPC_TLS_KEY", str(certs / "server.key"))
    with cluster(1, 1) as (ps, ew):
        ps.configure({})
        # the embedding worker reached the PS over mutual TLS (it presented the server pair as its client certificate)
        req = {"batch_size": 2, "features": ids.pack_csr([{"name": "user", "values": np.array([1, 2], np.uint64),
                                                           "offsets": np.array([0, 1, 2], np.int64)}], 2)}
        client = rpc.Client(f"127.0.0.1:{ew.port}", "persia.EmbeddingWorker")
        try:
            out = client.call("LookupDirect", req, timeout=10)
            assert len(out["slots"]) == 1 and ps.stats()["replica_index"] == 0
        finally:
            client.close()
        plain = rpc.Client(f"127.0.0.1:{ps.port}", "persia.EmbeddingParameterServer", tls=GrpcTls())
        with pytest.raises(RemoteError) as err:
            plain.call("Stats", None, timeout=5)
        assert err.value.kind == "UNAVAILABLE", err.value
        plain.close()


@pytest.mark.parametrize("method, request_", [
    ("LookupDirect", {"batch_size": 10**12, "features": ids.pack(["user"], [np.arange(4, dtype=np.uint64)], [None], 4)}),
    ("LookupDirect", {"batch_size": 4, "features": {"names": ["user"], "single": np.array([False]),
                                                    "values": np.zeros(2, np.float64),
                                                    "offsets": np.array([[0, 1, 2, 2, 2]])}}),
    ("LookupDirect", {"batch_size": 4, "features": {"names": ["user"], "single": np.array([False]),
                                                    "values": np.zeros(2, np.uint64),
                                                    "offsets": np.array([[0, 2, 1, 2, 2]])}}),
    ("LookupDirect", {"batch_size": 4, "features": [{"name": "user", "values": np.zeros(4, np.uint64),
                                                     "offsets": np.array([0, 1, 2, 3, 4])}]}),  # the old form
    ("Lookup", {"ref": -1}),
    ("Lookup", {}),
    ("Update", {"ref": 1, "grads": "x"}),
    ("Step", {"ref": 1, "updates": [{"ref": 2, "grads": "x"}]}),
    ("Step", {"ref": 1, "updates": "all"}),
    ("Release", {"refs": ["a"]}),
    ("Stats", {"x": 1}),
])
def test_malformed_worker_requests_are_invalid_argument(persia_env, method, request_):
    with cluster(1, 1) as (ps, ew):
        client = rpc.Client(f"127.0.0.1:{ew.port}", "persia.EmbeddingWorker")
        try:
            with pytest.raises(RemoteError) as err:
                client.call(method, request_, timeout=10)
            assert err.value.kind == "INVALID_ARGUMENT", err.value
            assert client.call("Stats", None, timeout=10)["pending"] == 0  # still serving
        finally:
            client.close()


def test_undecodable_and_oversized_ps_requests_are_invalid_argument(persia_env):
    with cluster(1, 0) as (ps,):
        ps.configure({})
        channel = grpc.insecure_channel(f"127.0.0.1:{ps.port}")
        raw = channel.unary_unary("/persia.EmbeddingParameterServer/Lookup",
                                  request_serializer=lambda b: b, response_deserializer=lambda b: b)
        for blob in (b"", b"garbage", b"PW1\x00\xff\xff\xff\xff", rpc._pack([1, 2])):
            with pytest.raises(grpc.RpcError) as err:
                # with the job's credential: undecodable bytes are the message's fault, not the caller's
                raw(blob, timeout=10, metadata=((GRPC_AUTH_METADATA, grpc_token(job_secret())),))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (blob, err.value)
        channel.close()
        client = rpc.Client(f"127.0.0.1:{ps.port}", "persia.EmbeddingParameterServer")
        try:
            too_wide = {"train": True, "tables": [{"dim": M.MAX_DIM + 1, "signs": np.arange(3, dtype=np.uint64)}]}
            with pytest.raises(RemoteError, match="INVALID_ARGUMENT|dim"):
                client.call("Lookup", too_wide, timeout=10)
            assert len(ps.store) == 0
            assert client.call("Stats", None, timeout=10)["replica_index"] == 0
        finally:
            client.close()


def test_malformed_grpc_requests_never_change_state_or_stop_a_server(persia_env):
    """Hypothesis over every gRPC request schema, against a real PS and embedding worker."""
    from hypothesis import HealthCheck, given, settings

    from .test_security_nats import message_for

    with cluster(1, 1) as (ps, ew):
        ps.configure({})
        ps.register_optimizer({"type": "SGD", "lr": 0.1})
        ps.lookup({"train": True, "tables": [{"dim": 4, "signs": np.arange(1, 6, dtype=np.uint64)}]})
        clients = {"ps": rpc.Client(f"127.0.0.1:{ps.port}", "persia.EmbeddingParameterServer"),
                   "ew": rpc.Client(f"127.0.0.1:{ew.port}", "persia.EmbeddingWorker")}
        methods = [("ps", "Lookup", M.PsLookup), ("ps", "Update", M.PsUpdate), ("ps", "Step", M.PsStep),
                   ("ps", "Stats", M.NoPayload),
                   ("ew", "Lookup", M.WorkerLookup), ("ew", "LookupDirect", M.WorkerLookupDirect),
                   ("ew", "Update", M.WorkerUpdate), ("ew", "Step", M.WorkerStep), ("ew", "Release", M.WorkerRelease)]
        before = (len(ps.store), ew.stats())
        refused = set()
        try:
            for role, method, schema in methods:
                @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
                @given(message_for(schema))
                def send(msg):
                    try:
                        M.validate(schema, msg)
                        return  # well-formed: not this test's subject
                    except M.MessageError:
                        pass
                    with pytest.raises(RemoteError) as err:
                        clients[role].call(method, msg, timeout=10)
                    assert err.value.kind == "INVALID_ARGUMENT", (method, msg, err.value)
                    refused.add((role, method))

                send()
            assert refused == {(role, method) for role, method, _ in methods}
            assert (len(ps.store), ew.stats()) == before
            assert clients["ps"].call("Stats", None, timeout=10)["replica_index"] == 0
        finally:
            for c in clients.values():
                c.close()


def test_gradients_of_the_wrong_shape_are_refused_naming_field_and_value(persia_env):
    """Update carries one (n_distinct, dim) gradient per dim of the Lookup reply; a gradient shaped
    for another batch is refused with the field, the expected and the received shape."""
    with cluster(1, 1) as (ps, ew):
        ps.configure({})
        ps.register_optimizer({"type": "SGD", "lr": 0.1})
        batch = {"batch_size": 3, "features": [{"name": "user", "values": np.array([5, 6, 5], np.uint64),
                                                 "offsets": np.array([0, 1, 2, 3], np.int64)}]}
        ref = ew.on_forward(batch)["ref"]
        client = rpc.Client(f"127.0.0.1:{ew.port}", "persia.EmbeddingWorker")
        try:
            reply = client.call("Lookup", {"ref": ref}, timeout=10)
            assert [t["rows"].shape for t in reply["tables"]] == [(2, 4)]  # IDs 5 and 6, once each
            assert reply["tables"][0]["gather"].tolist() == [[0, 1, 0]]
            with pytest.raises(RemoteError) as err:
                client.call("Update", {"ref": ref, "grads": [np.zeros((3, 4), np.float32)]}, timeout=10)
            assert err.value.kind == "INVALID_ARGUMENT"
            assert "field 'grads[0]': expected shape (2, 4)" in str(err.value) and "got (3, 4)" in str(err.value)
            ref = ew.on_forward(batch)["ref"]
            client.call("Lookup", {"ref": ref}, timeout=10)
            assert client.call("Update", {"ref": ref, "grads": [np.ones((2, 4), np.float32)]}, timeout=10)["missing"] == 0
        finally:
            client.close()
