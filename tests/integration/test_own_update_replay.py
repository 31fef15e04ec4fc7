"""Own-update replay (persia.nn_worker.own_updates): with one NN rank, hybrid training re-applies
the updates its lookups missed, so it trains on what synchronous training reads: the same
embeddings and the same dense parameters, through real PS replicas and embedding workers."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import Adagrad

from .cluster import cluster
from .test_training_path import Model, eval_embeddings, make_batch, send_in_thread

pytestmark = pytest.mark.integration

N_BATCHES = 24


def _train(staleness: int, replay: bool, num_ps: int = 2, corrector_first: bool = False):
    """``corrector_first``: after each step, wait until the next batch's corrector caught up, so
    that it, not the training thread, replays what was sent after each reply."""
    torch.manual_seed(0)
    model = Model()
    errors: list = []
    with cluster(num_ps=num_ps, num_workers=1):
        sender = send_in_thread([make_batch(i) for i in range(N_BATCHES)], errors)
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.5),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      replay_own_updates=replay) as ctx:
            loader = DataLoader(StreamingDataset(4), embedding_staleness=staleness, reproducible=True,
                                staleness_warmup_steps=0)
            for batch in loader:
                out, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
                if corrector_first:
                    deadline = time.monotonic() + 10
                    while not ctx._corrector.caught_up:
                        assert time.monotonic() < deadline, "the corrector did not catch up within 10 s"
                        time.sleep(0.001)
            ctx.wait_for_pending_updates()
            # row-steps replayed: all, the lookup thread's (before the batch's turn), the corrector's
            own = ctx._own
            replayed = (0, 0, 0) if own is None else (own.replayed_row_steps, own.replayed_ahead_row_steps,
                                                      own.replayed_next_row_steps)
        sender.join(30)
        assert not errors, errors
        emb = eval_embeddings(model, [make_batch(1000 + i, requires_grad=False) for i in range(3)])
    return [p.detach().clone() for p in model.parameters()], emb, replayed


def _same(a, b) -> bool:
    params_a, emb_a, _ = a
    params_b, emb_b, _ = b
    # the PS's compiled step and the replay's numpy step agree to the bit on Adagrad; stale reads
    # move these by 1e-2
    return (all(torch.allclose(p, q, rtol=1e-6, atol=1e-7) for p, q in zip(params_a, params_b))
            and all(np.allclose(x, y, rtol=1e-6, atol=1e-7) for xs, ys in zip(emb_a, emb_b) for x, y in zip(xs, ys)))


@pytest.mark.parametrize("num_ps", [1, 2])
def test_hybrid_training_with_replay_ends_where_synchronous_training_ends(persia_env, monkeypatch, num_ps):
    # updates wait for a lookup to carry them: every lookup ahead of training misses some
    monkeypatch.setenv("PERSIA_UPDATE_HOLD_MS", "60000")
    sync = _train(staleness=1, replay=True, num_ps=num_ps)
    assert sync[2] == (0, 0, 0)  # synchronous lookups never miss an update: nothing to replay
    hybrid = _train(staleness=4, replay=True, num_ps=num_ps)
    total, ahead, _ = hybrid[2]
    # both kinds of part ran: the lookup thread's (updates sent before the reply came in) and
    # the later ones (sent after: the next batch's corrector's, or the training thread's, which
    # of them depends on timing); else the test would not prove that they add up
    assert 0 < ahead < total, f"replayed {total} row-steps, {ahead} of them ahead: the test would prove less"
    assert _same(hybrid, sync)
    settled = _train(staleness=4, replay=True, num_ps=num_ps, corrector_first=True)
    total, ahead, by_corrector = settled[2]
    assert 0 < by_corrector <= total - ahead  # the corrector's part ran, with the training thread's after it
    assert _same(settled, sync)
    stale = _train(staleness=4, replay=False, num_ps=num_ps)
    assert not _same(stale, sync)  # without replay the stale reads change the result


def test_replay_drops_the_ramp_and_starts_over_when_the_ps_rows_are_replaced(persia_env, monkeypatch):
    monkeypatch.delenv("PERSIA_STALENESS_WARMUP_STEPS", raising=False)
    model = Model()
    with cluster(num_ps=1, num_workers=1):
        for replay, ramp in ((True, 0), (False, 200)):
            with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.5),
                          dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          replay_own_updates=replay) as ctx:
                it = iter(DataLoader(StreamingDataset(4), embedding_staleness=4))
                try:  # stale reads cost nothing with replay: no synchronous warm-up by default
                    assert it._permits.warmup_steps == ramp
                finally:
                    it._finish()
                if replay:
                    before = ctx._own.source
                    ctx.clear_embeddings()  # the PS forgot which of our updates it applied
                    assert ctx._own.source != before and ctx._own.since() == 1
