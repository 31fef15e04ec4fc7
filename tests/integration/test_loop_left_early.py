"""A training loop that leaves a DataLoader early (``break``): real nats-server, embedding worker
and PS on loopback, a real DataCtx in a thread, a real TrainCtx with torch. Before, the loop's
dispatcher and lookup threads and its NATS subscriptions lived on for the life of the process,
one set per loop left, and the batches it had pulled were never accounted for."""

from __future__ import annotations

import threading

import pytest
import torch

from persia.ctx import DataCtx, TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.data_loader import stream as loader_stream
from persia.data_loader.stream import end_of_stream
from persia.embedding.optim import SGD
from persia.errors import PersiaError
from persia.nn_worker.accounting import ACCOUNT
from tests.polling import poll_until

from .cluster import cluster
from .test_training_path import Model, make_batch, train_step

pytestmark = pytest.mark.integration

BATCHES = 12


def pipeline_threads(before: frozenset = frozenset()) -> list[str]:
    """The DataLoader pipelines' threads alive now, but for those in ``before``."""
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("persia-dispatch", "persia-forward")) and t not in before]


def start_loader(epochs: int, per_epoch: int) -> threading.Thread:
    """A data loader in a thread: ``epochs`` DataCtx of ``per_epoch`` batches, then the stream's end."""
    loader_stream.reset()

    def run():
        for e in range(epochs):
            with DataCtx() as ctx:
                for i in range(per_epoch):
                    ctx.send_data(make_batch(100 * e + i))
        end_of_stream()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def sgd_ctx(model) -> TrainCtx:
    return TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                    dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("dataset", ["new", "same"])
def test_a_loop_left_early_stops_its_pipeline_and_the_next_loop_gets_the_rest(persia_env, caplog, dataset):
    """The next loop starts at once after the ``break`` (over a new StreamingDataset, or the same
    one): it waits for the left loop's view to hand the stream over. Before, it subscribed beside
    it and took the stream's carry before the left loop had put its queue there: batches
    acknowledged to the left loop were lost (or, with a job secret, the second delivery of each
    message was refused as a replay and the data loader failed); over the same dataset every
    batch was answered busy for good."""
    before = frozenset(threading.enumerate())  # an earlier test's, ending on their own time
    with cluster():
        loader_stream.reset()

        def loader():
            with DataCtx() as ctx:
                for i in range(BATCHES):
                    ctx.send_data(make_batch(i))
            end_of_stream()

        t = threading.Thread(target=loader, daemon=True)
        t.start()
        model = Model()
        first, rest = [], []
        with sgd_ctx(model) as ctx:
            ds = StreamingDataset(4)
            for batch in DataLoader(ds, embedding_staleness=2):
                first.append(batch.batch_id)
                train_step(ctx, batch)
                if len(first) == 2:
                    break
            # the loop's iterator is dropped at the break: its threads end, its subscriptions go
            for batch in DataLoader(ds if dataset == "same" else StreamingDataset(4), embedding_staleness=2):
                rest.append(batch.batch_id)
                train_step(ctx, batch)
        t.join(60)
        assert not t.is_alive(), "the data loader could not send every batch"
    result = ACCOUNT.as_result()
    abandoned = result["batches_failed"].get("abandoned", 0)
    # every batch once: trained by the first loop, handed back by it, or trained by the second
    assert len(first) == 2 and not set(first) & set(rest), (first, rest)
    assert result["batches_sent"] == BATCHES and result["batches_trained"] == len(first) + len(rest)
    assert len(first) + len(rest) + abandoned == BATCHES, (first, rest, result)
    assert result["batches_unannounced"] == 0
    assert not pipeline_threads(before)
    # the old loop's subscriptions were drained, not cut: a send that reached them was answered
    # (busy: retried on the new loop's), not left to wait out its 10 s request timeout
    assert "no successful reply after" not in caplog.text


def test_a_loop_still_held_at_the_contexts_exit_is_closed_and_its_batches_counted(persia_env):
    """A loop kept (a reference held past the context) is closed at the context's exit, which
    waits for its lookups: every batch it pulled is trained or handed back, counted."""
    before = frozenset(threading.enumerate())
    with cluster():
        loader_stream.reset()

        def loader():
            with DataCtx() as ctx:
                for i in range(6):
                    ctx.send_data(make_batch(i))

        t = threading.Thread(target=loader, daemon=True)
        t.start()
        model = Model()
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            kept = iter(DataLoader(StreamingDataset(4), embedding_staleness=2))
            train_step(ctx, next(kept))
            poll_until(lambda: ACCOUNT.received >= 3, "the loop to pull batches beyond the one trained")
        assert not pipeline_threads(before), "the kept loop's threads outlived its context"
        result = ACCOUNT.as_result()
        assert result["batches_trained"] == 1
        assert result["batches_trained"] + result["batches_failed"].get("abandoned", 0) == ACCOUNT.received
        del kept
        t.join(60)


def test_one_data_loader_iterated_once_per_epoch_trains_every_epoch(persia_env):
    """``loader = DataLoader(StreamingDataset(4, until="epoch"))`` looped over once per epoch:
    before, the dataset stayed closed after its first loop and answered every batch of epoch 2
    busy (2 of 10 trained, then a timeout)."""
    with cluster():
        t = start_loader(epochs=2, per_epoch=6)
        trained = []
        with sgd_ctx(Model()) as ctx:
            loader = DataLoader(StreamingDataset(4, until="epoch"), embedding_staleness=2)
            for _epoch in range(2):
                ids = []
                for batch in loader:
                    ids.append(batch.batch_id)
                    train_step(ctx, batch)
                trained.append(len(ids))
        t.join(60)
        assert not t.is_alive()
    assert trained == [6, 6] and ACCOUNT.as_result()["batches_trained"] == 12


def test_a_second_loop_while_the_first_is_still_open_is_refused_naming_it(persia_env):
    """A kept iterator (a batch peeked, the loop not closed) and a new loop over the same stream:
    two views would split the stream's messages between them. The second loop says so at once;
    closing the first lets the next one take the stream over, every batch accounted for."""
    with cluster():
        t = start_loader(epochs=1, per_epoch=8)
        with sgd_ctx(Model()) as ctx:
            kept = iter(DataLoader(StreamingDataset(4), embedding_staleness=2))
            train_step(ctx, next(kept))
            with pytest.raises(PersiaError, match="a DataLoader loop over this stream is still open"):
                for batch in DataLoader(StreamingDataset(4), embedding_staleness=2):
                    train_step(ctx, batch)
            kept.close()
            rest = 0
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=2):
                train_step(ctx, batch)
                rest += 1
        t.join(60)
        assert not t.is_alive()
    result = ACCOUNT.as_result()
    assert result["batches_trained"] == 1 + rest
    assert result["batches_trained"] + result["batches_failed"].get("abandoned", 0) == 8, result
