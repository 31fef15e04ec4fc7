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


def test_a_loop_left_early_stops_its_pipeline_and_the_next_loop_gets_the_rest(persia_env, caplog):
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
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=2):
                first.append(batch.batch_id)
                train_step(ctx, batch)
                if len(first) == 2:
                    break
            # the loop's iterator is dropped at the break: its threads end, its subscriptions go
            poll_until(lambda: not pipeline_threads(before), "the left loop's threads to end", deadline_s=30)
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=2):
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
