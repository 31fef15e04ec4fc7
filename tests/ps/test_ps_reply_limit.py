"""A PS request whose reply cannot be sent in one gRPC message is refused before anything is done,
with a real PS on loopback. The request's element limit (``PERSIA_MAX_ARRAY_ELEMENTS``, 2^28)
bounds a lookup's rows, whose reply alone is then 1 GiB (``rpc.MAX_MESSAGE_BYTES``) plus framing,
and a lookup with ``state`` (own-update replay) also carries up to ``2*dim + 1`` floats of
optimizer state per ID. Before, the PS ran such a Step (gradients applied, rows created) and gRPC
then refused the reply ("Sent message larger than max"): the caller saw an error for a step that
had happened, and sending it again applied the gradients twice.

The gRPC tests shrink the message limit (client and server) to a few MiB so they stay small."""

from __future__ import annotations

import numpy as np
import pytest

from persia import messages as M
from persia import rpc
from persia.config import load_global_config_from_dict
from persia.embedding_ps import service as ps_service
from persia.embedding_ps.service import SERVICE, EmbeddingParameterServer
from persia.errors import RemoteError

LIMIT = 4 << 20


@pytest.fixture
def small_messages(monkeypatch):
    opts = [("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)]
    monkeypatch.setattr(rpc, "MAX_MESSAGE_BYTES", LIMIT)
    monkeypatch.setattr(rpc, "SERVER_OPTIONS", opts + [("grpc.so_reuseport", 0)])
    monkeypatch.setattr(rpc, "CLIENT_OPTIONS", opts)


@pytest.fixture
def ps(small_messages):
    server = EmbeddingParameterServer(load_global_config_from_dict({}), 0, 1, port=0)
    server.configure({})
    server.register_optimizer({"type": "Adam"})
    yield server
    server.stop()


@pytest.fixture
def client(ps):
    c = rpc.Client(f"127.0.0.1:{ps.port}", SERVICE)
    yield c
    c.close()


HOT = np.arange(1, 101, dtype=np.uint64)


def _step(lookup_signs, state=True):
    return {"update": {"tables": [{"dim": 8, "signs": HOT, "grads": np.ones((HOT.size, 8), np.float32)}]},
            "lookup": {"train": True, "tables": [{"dim": 8, "signs": lookup_signs}], "state": state}}


def test_a_step_whose_reply_is_too_big_is_refused_before_its_update_is_applied(ps, client):
    client.call("Lookup", {"train": True, "tables": [{"dim": 8, "signs": HOT}]})
    before = ps.store.lookup(HOT, 8, False).copy()
    rows = len(ps.store)
    big = np.arange(1000, 51000, dtype=np.uint64)  # 50,000 x (8 rows + 17 Adam state) floats: 5 MB > 4 MiB
    with pytest.raises(RemoteError) as err:
        client.call("Step", _step(big))
    assert err.value.kind == "INVALID_ARGUMENT", err.value
    assert "'lookup'" in str(err.value) and "optimizer state" in str(err.value) and "nothing was applied" in str(err.value)
    np.testing.assert_array_equal(ps.store.lookup(HOT, 8, False), before)  # the gradients were not applied
    assert len(ps.store) == rows  # and the lookup created nothing
    # the same IDs without state fit (1.6 MB), and a Step that fits runs as before
    out = client.call("Step", _step(big, state=False))
    assert out["rows"][0].shape == (big.size, 8) and out["missing"] == 0
    assert (ps.store.lookup(HOT, 8, False) != before).all()


def test_grouped_lookups_and_a_plain_lookup_are_sized_together(ps, client):
    part = np.arange(1000, 23000, dtype=np.uint64)  # 22,000 x 25 x 4 = 2.2 MB of rows and state each
    lookup = {"train": True, "tables": [{"dim": 8, "signs": part}], "state": True}
    with pytest.raises(RemoteError) as err:
        client.call("Step", {"lookups": [lookup, dict(lookup, tables=[{"dim": 8, "signs": part + 22000}])]})
    assert err.value.kind == "INVALID_ARGUMENT" and "'lookups'" in str(err.value)
    assert len(ps.store) == 0
    with pytest.raises(RemoteError) as err:
        client.call("Lookup", dict(lookup, tables=[{"dim": 8, "signs": np.arange(1, 50001, dtype=np.uint64)}]))
    assert err.value.kind == "INVALID_ARGUMENT" and "'tables'" in str(err.value)
    assert len(ps.store) == 0
    assert client.call("Lookup", lookup)["state"][0].shape == (part.size, 17)


class _Len:
    """A sign array's length without its bytes (the sizing reads only ``len``)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def test_at_the_real_limits_a_lookup_allowed_by_the_element_limit_is_sized_by_its_reply():
    server = EmbeddingParameterServer(load_global_config_from_dict({}), 0, 1, port=0)
    try:
        server.register_optimizer({"type": "Adam"})
        n = M.MAX_ARRAY_ELEMENTS // 16  # exactly the element limit at dim 16: a 1 GiB reply of rows alone
        with pytest.raises(ValueError, match="reply of"):
            server._check_reply_fits([{"tables": [{"dim": 16, "signs": _Len(n)}]}], "tables")
        with pytest.raises(ValueError, match="optimizer state"):  # a third of it, with Adam's state
            server._check_reply_fits([{"tables": [{"dim": 16, "signs": _Len(n // 3)}], "state": True}], "tables")
        server._check_reply_fits([{"tables": [{"dim": 16, "signs": _Len(n // 3)}]}], "tables")
        assert ps_service._REPLY_SLACK < rpc.MAX_MESSAGE_BYTES // 64
    finally:
        server.stop()
