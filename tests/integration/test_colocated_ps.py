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
                errors = []
                for client in (local, remote):
                    with pytest.raises(RemoteError) as got:
                        client.call("Update", request)
                    errors.append(got.value)
                assert errors[0].kind == errors[1].kind == kind
                assert errors[0].remote_message == errors[1].remote_message

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
