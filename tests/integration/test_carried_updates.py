"""Updates riding on lookups (persia.nn_worker.outbox): one call per hop for a lookup and the
earlier batches' gradients, applied in that order, with results identical to separate calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia import rpc
from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import Adagrad
from persia.errors import PersiaValidationError
from persia.nn_worker.outbox import UpdateOutbox

from .cluster import cluster
from .test_training_path import Model, eval_embeddings, make_batch, send_in_thread

pytestmark = pytest.mark.integration


def _train(model, n_batches, staleness):
    """Train like test_training_path.train, returning the context's outbox counters."""
    errors: list = []
    sender = send_in_thread([make_batch(i) for i in range(n_batches)], errors)
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        for batch in DataLoader(StreamingDataset(4), embedding_staleness=staleness, reproducible=True):
            out, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
        ctx.wait_for_pending_updates()
        counts = (ctx._outbox.carried, ctx._outbox.sent_alone)
    sender.join(30)
    assert not errors, errors
    return counts


def _run(monkeypatch, carry: bool):
    if carry:
        monkeypatch.setenv("PERSIA_UPDATE_HOLD_MS", "60000")  # only a lookup or the end sends one
    else:  # nothing is ever claimed: every update goes alone, at once (stays patched to the end)
        monkeypatch.setattr(UpdateOutbox, "claim_for", lambda self, worker: [])
        monkeypatch.setattr(UpdateOutbox, "claim_permit", lambda self: None)
        monkeypatch.setattr(UpdateOutbox, "reserve_permit", lambda self: None)  # the same, with replay
        monkeypatch.setenv("PERSIA_UPDATE_HOLD_MS", "0")
    torch.manual_seed(0)
    model = Model()
    with cluster(num_ps=2, num_workers=1):
        counts = _train(model, 12, staleness=1)
        emb = eval_embeddings(model, [make_batch(77, requires_grad=False)])
    return counts, [p.detach().clone() for p in model.parameters()], emb


def test_synchronous_training_carries_each_update_on_the_next_lookup_with_identical_results(persia_env, monkeypatch):
    (carried, alone), params_a, emb_a = _run(monkeypatch, carry=True)
    assert (carried, alone) == (11, 1)  # the last batch's update is sent at the end
    (carried_b, alone_b), params_b, emb_b = _run(monkeypatch, carry=False)
    assert (carried_b, alone_b) == (0, 12)
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for x, y in zip(emb_a[0], emb_b[0]):
        np.testing.assert_array_equal(x, y)


def test_ps_step_applies_the_update_before_the_lookup(persia_env):
    with cluster(num_ps=1, num_workers=0) as (ps,):
        ps.configure({})
        ps.register_optimizer({"type": "SGD", "lr": 0.5})
        signs = np.array([3, 5, 9], dtype=np.uint64)
        before = ps.lookup({"train": True, "tables": [{"dim": 4, "signs": signs}]})["rows"][0]
        grads = np.ones((2, 4), dtype=np.float32)
        client = rpc.Client(f"127.0.0.1:{ps.port}", "persia.EmbeddingParameterServer")
        try:
            out = client.call("Step", {"update": {"tables": [{"dim": 4, "signs": signs[:2], "grads": grads}]},
                                       "lookup": {"train": True, "tables": [{"dim": 4, "signs": signs}]}})
        finally:
            client.close()
    assert out["missing"] == 0
    np.testing.assert_allclose(out["rows"][0][:2], before[:2] - 0.5, rtol=1e-6)
    np.testing.assert_array_equal(out["rows"][0][2], before[2])  # no gradient: unchanged


@pytest.mark.parametrize("raw", ["soon", "-1", "1e9"])
def test_a_bad_update_hold_is_refused_naming_the_value(persia_env, monkeypatch, raw):
    monkeypatch.setenv("PERSIA_UPDATE_HOLD_MS", raw)
    model = Model()
    with pytest.raises(PersiaValidationError, match=f"PERSIA_UPDATE_HOLD_MS .* got '{raw}'"):
        TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                 dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
