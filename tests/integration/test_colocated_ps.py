"""An embedding worker calling its PS replica in its own process (persia.embedding_worker.colocated):
the same training, bit for bit, as over gRPC, and the same answers to bad requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia import rpc
from persia.embedding_ps.service import SERVICE as PS_SERVICE
from persia.embedding_worker.colocated import InProcessPs
from persia.errors import BatchLost, RemoteError, TooManyWaiting, answered_with
from persia.messages import MessageError

from .cluster import cluster
from .test_carried_updates import _train
from .test_training_path import Model, eval_embeddings, make_batch

pytestmark = pytest.mark.integration


def _run(colocate: bool):
    torch.manual_seed(0)
    model = Model()
    # two replicas, one worker: replica 0 in the worker's process, replica 1 over gRPC
    with cluster(num_ps=2, num_workers=1, colocate_ps=colocate) as servers:
        worker = servers[-1]
        kinds = [type(c).__name__ for c in worker.ps]
        _train(model, 12, staleness=1)
        emb = eval_embeddings(model, [make_batch(77, requires_grad=False)])
        rows = [s.store.stats()["rows"] for s in servers[:2]]
    return kinds, [p.detach().clone() for p in model.parameters()], emb, rows


def test_training_through_a_colocated_replica_is_identical_to_grpc(persia_env):
    kinds, params_a, emb_a, rows_a = _run(colocate=True)
    assert kinds == ["InProcessPs", "Client"]
    kinds_b, params_b, emb_b, rows_b = _run(colocate=False)
    assert kinds_b == ["Client", "Client"]
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for a, b in zip(emb_a, emb_b):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert rows_a == rows_b


def test_a_colocated_replica_answers_errors_as_grpc_does(persia_env):
    with cluster(num_ps=1, num_workers=0) as (ps,):
        local = InProcessPs(ps.address, PS_SERVICE, ps.methods)
        remote = rpc.Client(ps.address, PS_SERVICE)
        try:
            signs = np.array([1, 2], dtype=np.uint64)

            def both_refuse(request, kind):
                _both_refuse((local, remote), "Update", request, kind)

            grads = {"tables": [{"dim": 4, "signs": signs, "grads": np.zeros((2, 4), np.float32)}]}
            both_refuse(grads, "INTERNAL")  # before an optimizer is registered
            ps.configure({})
            ps.register_optimizer({"type": "Adagrad", "lr": 0.1})
            ps.lookup({"train": True, "tables": [{"dim": 4, "signs": signs}]})
            bad = {"tables": [{"dim": 4, "signs": signs, "grads": np.zeros((3, 4), np.float32)}]}  # 3 rows, 2 IDs
            both_refuse(bad, "INVALID_ARGUMENT")
            with pytest.raises(RemoteError) as missing:
                local.call("NoSuchMethod", {})
            assert missing.value.kind == "UNIMPLEMENTED"
            # future/result: settled at once, raising what call raises
            fut = local.future("Update", bad)
            with pytest.raises(RemoteError):
                local.result("Update", fut)
            ok = local.result("Lookup", local.future("Stats"))
            assert ok == remote.call("Stats")
        finally:
            remote.close()


def _both_refuse(clients, method: str, request: dict, kind: str) -> str:
    """Each client (in-process, gRPC) refuses ``request`` with ``kind`` and the same message."""
    errors = []
    for client in clients:
        with pytest.raises(RemoteError) as got:
            client.call(method, request)
        errors.append(got.value)
    assert [e.kind for e in errors] == [kind] * len(clients), errors
    assert len({e.remote_message for e in errors}) == 1, errors
    return errors[0].remote_message


def _contents(ps, signs: np.ndarray) -> dict:
    """Every row of ``signs`` in every dim (weights and optimizer state) and the update counters."""
    out = {}
    for dim in ps.store.dims():
        found, weights, state, _ = ps.store.read_rows(signs, dim)
        out[dim] = (found.tolist(), weights.tolist(), state.tolist())
    stats = ps.store.stats()
    return {"rows": out, "len": len(ps.store), "update_calls": stats["update_calls"],
            "gradient_id_miss": stats["gradient_id_miss"]}


def test_a_gradient_wider_than_its_dim_is_refused_whole_by_both_paths(persia_env):
    """A table declaring dim 4 with 8-wide gradients used to update the dim-8 rows of its IDs (or
    count them missing there). Now the request is refused naming dim, 4 and 8, over gRPC and in
    process alike, and nothing of it is applied: not its valid first table, not a Step's lookup."""
    with cluster(num_ps=1, num_workers=0) as (ps,):
        local = InProcessPs(ps.address, PS_SERVICE, ps.methods)
        remote = rpc.Client(ps.address, PS_SERVICE)
        try:
            ps.configure({})
            ps.register_optimizer({"type": "Adagrad", "lr": 0.1})
            a, fresh = np.array([1, 2, 3], np.uint64), np.array([40, 41], np.uint64)
            ps.lookup({"train": True, "tables": [{"dim": 4, "signs": a}, {"dim": 8, "signs": a}]})
            good = {"dim": 4, "signs": a, "grads": np.ones((3, 4), np.float32)}
            wide = {"dim": 4, "signs": a, "grads": np.ones((3, 8), np.float32)}  # dim 8's width
            before = _contents(ps, np.concatenate([a, fresh]))
            assert sorted(before["rows"]) == [4, 8] and before["len"] == 6

            update = {"tables": [good, wide]}
            message = _both_refuse((local, remote), "Update", update, "INVALID_ARGUMENT")
            assert "tables.1" in message and "field 'dim' is 4" in message and "8 columns" in message
            step = {"update": update, "lookup": {"train": True, "tables": [{"dim": 4, "signs": fresh}]}}
            assert "update.tables.1" in _both_refuse((local, remote), "Step", step, "INVALID_ARGUMENT")
            with pytest.raises(ValueError, match=r"tables\[1\]: field 'dim' is 4 but field 'grads' has 8"):
                ps.update(update)  # the handler itself, called past any schema, checks every table first
            assert _contents(ps, np.concatenate([a, fresh])) == before

            local.call("Update", {"tables": [good]})  # the valid table alone is applied
            after = _contents(ps, np.concatenate([a, fresh]))
            assert after["update_calls"] == before["update_calls"] + 1
            assert after["rows"][4] != before["rows"][4] and after["rows"][8] == before["rows"][8]
        finally:
            remote.close()


def test_the_in_process_path_refuses_what_the_wire_schema_refuses(persia_env):
    """Requests the gRPC schema refuses used to reach a colocated replica's handlers: signed IDs,
    a non-boolean ``train`` (both would have created rows), an unknown field."""
    with cluster(num_ps=1, num_workers=0) as (ps,):
        local = InProcessPs(ps.address, PS_SERVICE, ps.methods)
        remote = rpc.Client(ps.address, PS_SERVICE)
        try:
            ps.configure({})
            signs = np.array([7, 8], np.uint64)
            for request in (
                {"train": True, "tables": [{"dim": 4, "signs": signs.astype(np.int64)}]},
                {"train": 1, "tables": [{"dim": 4, "signs": signs}]},
                {"train": True, "tables": [{"dim": 4, "signs": signs}], "tracing": True},
            ):
                message = _both_refuse((local, remote), "Lookup", request, "INVALID_ARGUMENT")
                assert message.startswith(f"{PS_SERVICE}/Lookup: field")
            assert len(ps.store) == 0
            assert local.call("Lookup", {"train": True, "tables": [{"dim": 4, "signs": signs}]})["rows"][0].shape == (2, 4)
            assert len(ps.store) == 2
        finally:
            remote.close()


@pytest.mark.parametrize("exc, code", [
    (MessageError("PsLookup: field 'tables' missing"), "INVALID_ARGUMENT"),
    (BatchLost("batch 3 was released"), BatchLost.grpc_status),
    (TooManyWaiting("4 lookups wait"), TooManyWaiting.grpc_status),
    (KeyError("ref"), "INVALID_ARGUMENT"),
    (RuntimeError("disk full"), "INTERNAL"),
])
def test_error_status_is_what_callers_act_on(exc, code):
    got, detail = rpc.error_status(exc)
    assert got == code and str(exc).strip("'") in detail
    err = RemoteError("x", detail, kind=got)
    assert answered_with(err, BatchLost) == (code == BatchLost.grpc_status)
