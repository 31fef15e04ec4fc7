"""Linear weight gradients on a thread of their own (persia.nn_worker.weight_grads) inside real
training: a TrainCtx on one torch thread, through a real nats-server, PS and embedding worker,
ends bit for bit where it ends with the thread switched off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import Adagrad

from .cluster import cluster
from .test_training_path import BS, eval_embeddings, make_batch, send_in_thread

pytestmark = pytest.mark.integration

N_BATCHES = 12


class Tower(torch.nn.Module):
    """The training path's inputs into two hidden Linear layers (the NN worker's usual shape)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Sequential(torch.nn.Linear(2 + 4 + 4 + 3 * 4, 32), torch.nn.ReLU(),
                                          torch.nn.Linear(32, 16), torch.nn.ReLU())
        self.out = torch.nn.Linear(16, 1)

    def forward(self, non_id, emb):
        user, item, tags = emb
        x = torch.cat([non_id[0], user, item, tags.flatten(1)], dim=1)
        assert x.shape[0] == BS
        return torch.sigmoid(self.out(self.hidden(x)))


def _train(monkeypatch, switch: str):
    monkeypatch.setenv("PERSIA_WEIGHT_GRAD_THREAD", switch)
    monkeypatch.setenv("PERSIA_TORCH_THREADS", "1")
    torch.manual_seed(0)
    model = Tower()
    errors: list = []
    with cluster(num_ps=1, num_workers=1):
        sender = send_in_thread([make_batch(i) for i in range(N_BATCHES)], errors)
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.Adam(model.parameters(), lr=1e-2)) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, reproducible=True):
                out, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
            products = (0, 0) if ctx._weight_grads is None else (ctx._weight_grads.by_worker,
                                                                  ctx._weight_grads.taken_back)
            trained = ctx.trained_batches
        sender.join(30)
        assert not errors, errors
        emb = eval_embeddings(model, [make_batch(1000 + i, requires_grad=False) for i in range(3)])
    return [p.detach().clone() for p in model.parameters()], emb, products, trained


def test_training_with_the_thread_ends_where_training_without_it_ends(persia_env, monkeypatch):
    before = torch.get_num_threads()
    try:
        off = _train(monkeypatch, "0")
        on = _train(monkeypatch, "1")
    finally:
        torch.set_num_threads(before)
    assert off[3] == on[3] == N_BATCHES
    assert off[2] == (0, 0)
    # every Linear weight of every step went through it (which thread computed each depends on
    # timing; test_weight_grads.py holds the worker to check both)
    assert sum(on[2]) == 3 * N_BATCHES
    assert all(torch.equal(p, q) for p, q in zip(off[0], on[0]))
    assert all(np.array_equal(x, y) for xs, ys in zip(off[1], on[1]) for x, y in zip(xs, ys))
    torch.manual_seed(0)
    initial = [p.detach() for p in Tower().parameters()]
    assert not any(torch.equal(p, q) for p, q in zip(on[0], initial))  # it trained
