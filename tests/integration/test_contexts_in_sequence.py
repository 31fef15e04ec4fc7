"""Contexts one after another in one NN-worker process, over one data-loader stream: the stream
goes on where the last context left it (its epoch, the batches held for later, its counts). Real
nats-server, real gRPC PS and embedding worker on loopback, a real DataCtx in a thread, real
TrainCtx and eval_ctx with torch. Before, each context started the stream afresh: the batches the
last one held were lost and the next loop waited for loaders that had connected long before."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from persia.ctx import DataCtx, TrainCtx, eval_ctx
from persia.data import DataLoader, StreamingDataset
from persia.data_loader import stream as loader_stream
from persia.data_loader.stream import end_of_stream
from persia.embedding.optim import Adagrad
from persia.nn_worker.accounting import ACCOUNT
from tests.polling import poll_until

from .cluster import cluster
from .test_training_path import Model, make_batch, train_step

pytestmark = pytest.mark.integration

PER_EPOCH = 8


def start_loader(epochs: int, train_epochs: int) -> threading.Thread:
    """A data loader in a thread: ``epochs`` DataCtx of PER_EPOCH batches, the first
    ``train_epochs`` of them for training, the rest for evaluation; then the stream's end."""
    loader_stream.reset()

    def run():
        for e in range(epochs):
            with DataCtx() as ctx:
                for i in range(PER_EPOCH):
                    ctx.send_data(make_batch(100 * e + i, requires_grad=e < train_epochs))
        end_of_stream()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def train_ctx(model: Model) -> TrainCtx:
    return TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                    dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def one_epoch(ctx) -> int:
    n = 0
    for batch in DataLoader(StreamingDataset(4, until="epoch"), embedding_staleness=2, timeout_ms=30_000):
        if ctx.is_training:
            train_step(ctx, batch)
        else:
            with torch.no_grad():
                ctx.forward(batch)
        n += 1
    return n


def test_an_eval_ctx_after_the_train_ctx_evaluates_the_next_epoch(persia_env):
    with cluster():
        t = start_loader(epochs=2, train_epochs=1)
        model = Model()
        with train_ctx(model) as ctx:
            trained = one_epoch(ctx)
        with eval_ctx(model=model) as ctx:
            evaluated = one_epoch(ctx)
        t.join(60)
        assert not t.is_alive()
    result = ACCOUNT.as_result()
    assert (trained, evaluated) == (PER_EPOCH, PER_EPOCH)
    assert (result["batches_trained"], result["batches_evaluated"]) == (PER_EPOCH, PER_EPOCH), result


def test_a_train_ctx_per_epoch_trains_every_epoch(persia_env):
    with cluster():
        t = start_loader(epochs=3, train_epochs=3)
        model = Model()
        per_ctx = []
        for _epoch in range(3):
            with train_ctx(model) as ctx:
                per_ctx.append(one_epoch(ctx))
        t.join(60)
        assert not t.is_alive()
    assert per_ctx == [PER_EPOCH] * 3 and ACCOUNT.as_result()["batches_trained"] == 3 * PER_EPOCH


def test_a_train_ctx_left_early_and_the_next_one_account_for_every_batch(persia_env):
    """The loader ends its stream between the two contexts (every batch acknowledged by the first):
    its end of stream is kept for the second. Before, nobody answered it and the rank had said
    nn.done, so the loader skipped it and the second context's loop waited until its timeout."""
    with cluster():
        loader_stream.reset()
        release, errors = threading.Event(), []

        def run():
            try:
                with DataCtx(trainer_grace_s=3) as dctx:
                    for i in range(PER_EPOCH):
                        dctx.send_data(make_batch(i))
                    release.wait(30)
                end_of_stream()  # the epoch's end and the stream's, while no context is open
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        model = Model()
        first = rest = 0
        with train_ctx(model) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=2, timeout_ms=30_000):
                train_step(ctx, batch)
                first += 1
                if first == 3:
                    poll_until(lambda: loader_stream.current().sent_total == PER_EPOCH, "every batch acknowledged")
                    break
        poll_until(lambda: loader_stream.current().trainers.done_at(0) is not None, "the loader hearing nn.done")
        release.set()
        poll_until(lambda: not t.is_alive(), "the loader ending its stream between the contexts")
        assert not errors, errors
        with train_ctx(model) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=2, timeout_ms=30_000):
                train_step(ctx, batch)
                rest += 1
        t.join(60)
        assert not t.is_alive()
    result = ACCOUNT.as_result()
    assert first == 3 and result["batches_trained"] == first + rest
    assert first + rest + result["batches_failed"].get("abandoned", 0) == PER_EPOCH, result


def test_two_data_ctx_open_at_once_count_each_batch_in_the_epoch_it_was_sent_in(persia_env, monkeypatch):
    """One loader process with two DataCtx open at once: the outer one holds a batch for its group
    (stamped epoch 0) while the inner one's exit ends epoch 0. That epoch's end waits for the held
    batch and counts it. Before, it was counted in epoch 1, when it was acknowledged: epoch 0's
    count missed it and epoch 1's announced a batch its rank never got stamped 1, so the second
    per-epoch loop waited for it until its timeout."""
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    monkeypatch.setenv("PERSIA_DATA_GROUP_HOLD_MS", "3000")  # held well past the inner context's exit
    with cluster():
        loader_stream.reset()
        errors = []

        def run():
            try:
                with DataCtx() as outer:
                    outer.send_data(make_batch(0))  # held for a second batch that never comes
                    with DataCtx() as inner:
                        inner.send_data(make_batch(1))
                        inner.send_data(make_batch(2))  # a full group: sent now
                end_of_stream()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        model = Model()
        with train_ctx(model) as ctx:
            per_epoch = []
            for _epoch in range(2):
                n = 0
                for batch in DataLoader(StreamingDataset(4, until="epoch"), embedding_staleness=2, timeout_ms=15_000):
                    train_step(ctx, batch)
                    n += 1
                per_epoch.append(n)
        t.join(60)
        assert not t.is_alive() and not errors, errors
    assert per_epoch == [3, 0]
    assert ACCOUNT.as_result()["batches_trained"] == 3


@pytest.mark.parametrize("gap_s", [0.0, 1.0])
def test_one_train_ctx_over_per_epoch_loops_gives_every_staleness_permit_back_where_it_came_from(
        persia_env, monkeypatch, gap_s):
    """One TrainCtx, a loop per epoch: the last loop's updates are applied while the next loop
    runs (carried by its lookups, or sent alone by the flusher). Each permit must go back to the
    bound that gave it out. Before, each loop had a bound of its own and the context released
    into the newest: the first loop's permits never came back, and the next loop's bound was
    released more often than it gave out (raised, and lost in the flusher's sends, or counted
    free a permit one of its lookups held). ``gap_s``: the loader's pause before the second
    epoch, so that the flusher, not a lookup, applies the first loop's last updates."""
    from persia.nn_worker import staleness

    given: dict[int, int] = {}
    back: dict[int, int] = {}
    acquire, release = staleness.RampedStalenessBound.acquire, staleness.RampedStalenessBound.release

    def counted_acquire(self, *args, **kwargs):
        got = acquire(self, *args, **kwargs)
        given[id(self)] = given.get(id(self), 0) + got
        return got

    def counted_release(self):
        back[id(self)] = back.get(id(self), 0) + 1
        release(self)

    monkeypatch.setattr(staleness.RampedStalenessBound, "acquire", counted_acquire)
    monkeypatch.setattr(staleness.RampedStalenessBound, "release", counted_release)
    with cluster():
        loader_stream.reset()

        def run():
            for e in range(2):
                with DataCtx() as dctx:
                    if e == 1:
                        time.sleep(gap_s)  # the scenario: a loader slow to start its second epoch
                    for i in range(PER_EPOCH):
                        dctx.send_data(make_batch(100 * e + i))
            end_of_stream()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        model = Model()
        with train_ctx(model) as ctx:
            per_epoch = [one_epoch(ctx), one_epoch(ctx)]
            ctx.wait_for_pending_updates()
            held = ctx._permits.held
        t.join(60)
        assert not t.is_alive()
    assert per_epoch == [PER_EPOCH, PER_EPOCH]
    assert held == 0 and given and given == back, (held, given, back)
