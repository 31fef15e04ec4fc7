"""Own-update replay through the real PS service over real gRPC on loopback (and through the
colocated in-process client, which calls the same handlers): tagged Update/Step, Lookup with
``state`` and ``applied``, and the refusals, on both engine paths (conftest)."""

from __future__ import annotations

import numpy as np
import pytest

from persia import rpc
from persia.config import load_global_config_from_dict
from persia.embedding_ps.applied import WINDOW
from persia.embedding_ps.service import SERVICE, EmbeddingParameterServer
from persia.embedding_worker.colocated import InProcessPs
from persia.errors import RemoteError


@pytest.fixture
def ps():
    server = EmbeddingParameterServer(load_global_config_from_dict({}), 0, 1, port=0)
    server.configure({})
    server.register_optimizer({"type": "Adagrad", "lr": 0.1})
    yield server
    server.stop()


@pytest.fixture
def client(ps):
    c = rpc.Client(f"127.0.0.1:{ps.port}", SERVICE)
    yield c
    c.close()


def _table(signs, dim=4, seed=0):
    return {"dim": dim, "signs": signs, "grads": np.random.default_rng(seed).standard_normal((len(signs), dim)).astype(np.float32)}


def test_tagged_step_and_lookup_carry_state_absent_and_applied_over_grpc(ps, client):
    signs = np.array([11, 12, 13, 14], dtype=np.uint64)
    client.call("Lookup", {"train": True, "tables": [{"dim": 4, "signs": signs}, {"dim": 8, "signs": signs[:2]}]})
    update = {"tables": [_table(signs[:3], 4, 1), _table(signs[:2], 8, 2)], "source": 2**62, "seqs": [1, 2]}
    assert client.call("Update", update) == {"missing": 0}
    out = client.call("Step", {
        "update": {"tables": [_table(signs[1:], 4, 3)], "source": 2**62, "seqs": [3]},
        "lookup": {"train": False, "tables": [{"dim": 4, "signs": np.append(signs, np.uint64(99))},
                                              {"dim": 8, "signs": signs[:2]}],
                   "state": True, "applied": {"source": 2**62, "since": 2}},
    })
    assert out["missing"] == 0
    assert set(out) == {"rows", "state", "absent", "applied", "missing"}
    for i, (dim, n) in enumerate(((4, 4), (8, 2))):
        found, weights, state, _ = ps.store.read_rows(signs[:n], dim)
        np.testing.assert_array_equal(out["rows"][i][:n], weights)
        np.testing.assert_array_equal(out["state"][i][:n], state)
        assert out["state"][i].dtype == np.float32 and out["state"][i].shape[1] == dim  # Adagrad: one per weight
    np.testing.assert_array_equal(out["absent"][0], [4])
    assert out["absent"][0].dtype == np.int32 and out["absent"][1].shape == (0,)
    assert not out["rows"][0][4].any() and not out["state"][0][4].any()
    np.testing.assert_array_equal(out["applied"][0], [2, 3])
    np.testing.assert_array_equal(out["applied"][1], [2, 3])
    assert out["applied"][0].dtype == np.int64
    # without the new fields: the reply is what it always was
    plain = client.call("Lookup", {"train": False, "tables": [{"dim": 4, "signs": signs}]})
    assert set(plain) == {"rows"}
    np.testing.assert_array_equal(plain["rows"][0], out["rows"][0][:4])
    assert set(client.call("Step", {"lookup": {"train": False, "tables": []}})) == {"rows", "missing"}


def test_refusals_name_the_field_and_change_nothing(ps, client):
    signs = np.array([5, 6], dtype=np.uint64)
    client.call("Lookup", {"train": True, "tables": [{"dim": 4, "signs": signs}]})
    before = ps.store.lookup(signs, 4, False)
    with pytest.raises(RemoteError) as err:
        client.call("Update", {"tables": [_table(signs)], "seqs": [1]})
    assert err.value.kind == "INVALID_ARGUMENT" and "'seqs'" in str(err.value) and "'source'" in str(err.value)
    np.testing.assert_array_equal(ps.store.lookup(signs, 4, False), before)
    client.call("Update", {"tables": [], "source": 7, "seqs": list(range(1, 1025))})
    ps.store.update_tables([], source=7, seqs=range(1025, WINDOW + 40))
    with pytest.raises(RemoteError) as err:
        client.call("Lookup", {"train": True, "tables": [{"dim": 4, "signs": np.array([77], np.uint64)}],
                               "applied": {"source": 7, "since": 3}})
    assert err.value.kind == "INVALID_ARGUMENT"
    assert "'applied.since' is 3" in str(err.value) and "from 40" in str(err.value)
    assert not ps.store.contains(np.array([77], np.uint64), 4).any()


def test_the_colocated_client_answers_alike(ps):
    local = InProcessPs(ps.address, SERVICE, ps.methods)
    signs = np.array([1, 2, 3], dtype=np.uint64)
    local.call("Lookup", {"train": True, "tables": [{"dim": 2, "signs": signs}]})
    local.call("Update", {"tables": [_table(signs, 2)], "source": 4, "seqs": [1]})
    out = local.call("Lookup", {"train": True, "tables": [{"dim": 2, "signs": signs}], "state": True,
                                "applied": {"source": 4, "since": 1}})
    np.testing.assert_array_equal(out["applied"][0], [1])
    np.testing.assert_array_equal(out["state"][0], ps.store.read_rows(signs, 2)[2])
    with pytest.raises(RemoteError, match="'seqs'"):
        local.call("Update", {"tables": [], "seqs": [2]})
