"""A data loader and an NN rank that said it finished training (``nn.done``): the rank may come
back (a second ``TrainCtx`` in the same process), or be gone while the loader still has batches
for it. Real nats-server, real gRPC PS and embedding worker on loopback, a real ``DataCtx`` in a
thread, real ``TrainCtx`` with torch. The rule itself: ``persia.data_loader.trainers``."""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch

from persia.ctx import DataCtx, TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.data_loader import stream as loader_stream
from persia.data_loader.stream import end_of_stream
from persia.data_loader.trainers import TrainerNews, rank_gone
from persia.embedding.optim import Adagrad
from persia.nn_worker.accounting import ACCOUNT
from tests.polling import poll_until

from .cluster import cluster
from .test_training_path import Model, make_batch, train_step

pytestmark = pytest.mark.integration


def adagrad_ctx(model: Model) -> TrainCtx:
    return TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                    dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def loader_thread(body: Callable[[DataCtx], None], errors: list, **ctx_kwargs) -> threading.Thread:
    """A data loader in a thread, started: ``body`` in one DataCtx, then the end of its stream;
    what it raises goes to ``errors``."""
    loader_stream.reset()

    def run() -> None:
        try:
            with DataCtx(**ctx_kwargs) as dctx:
                body(dctx)
            end_of_stream()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def told_done(rank: int) -> bool:
    """The loader process has the rank's ``nn.done`` and nothing answered for the rank since."""
    return loader_stream.current().trainers.done_at(rank) is not None


def test_the_rule_a_rank_is_gone_only_after_done_silence_and_nobody_listening() -> None:
    assert not rank_gone(None, 100.0, 0.0, nobody_listens=True)  # never said nn.done: keeps its deadline
    assert not rank_gone(10.0, 100.0, 0.0, nobody_listens=False)  # a busy or slow listener is somebody
    assert not rank_gone(10.0, 39.9, 30.0, nobody_listens=True)  # within the grace: may come back
    assert rank_gone(10.0, 40.0, 30.0, nobody_listens=True)
    now = [0.0]
    news = TrainerNews(clock=lambda: now[0])
    news.done(0)
    now[0] = 31.0
    assert news.gone(0, 30.0, nobody_listens=True) and not news.gone(1, 30.0, nobody_listens=True)
    news.answered(0)  # it came back: not gone, whatever the time
    assert not news.gone(0, 0.0, nobody_listens=True)
    news.done(0)  # left again: the grace counts from this nn.done
    assert not news.gone(0, 30.0, nobody_listens=True)
    assert "NN rank 0 finished training (nn.done 0.0s ago)" in str(news.gone_error(0, "2 batches"))


def test_a_rank_back_after_nn_done_trains_the_whole_stream_and_gets_its_end(persia_env) -> None:
    """TrainCtx #1 exits while the loader is connected (its nn.done reaches the loader), the loader
    sends while nobody listens for rank 0, then TrainCtx #2 of the same process trains everything.
    Before: the loader kept rank 0 as done for good and skipped its final end of stream, so #2's
    loop waited for it until its timeout (``data loaders [0] have not ended their stream``)."""
    with cluster():
        connected, go, errors = threading.Event(), threading.Event(), []
        holder: dict = {}

        def send(dctx: DataCtx) -> None:
            holder["ctx"] = dctx
            connected.set()
            go.wait(30)
            for i in range(10):
                dctx.send_data(make_batch(i))

        model = Model()
        with adagrad_ctx(model):  # e.g. a context that only loads a checkpoint
            loader = loader_thread(send, errors)
            assert connected.wait(30), errors
        poll_until(lambda: told_done(0), "the loader hearing rank 0's nn.done")
        with adagrad_ctx(model) as ctx:
            go.set()
            # a send under way while nobody listens for rank 0 (the next loop is not open yet):
            # retried within the grace, not failed
            poll_until(lambda: holder["ctx"]._in_flight > 0 or errors, "a send to rank 0 under way")
            trained = 0
            for batch in DataLoader(StreamingDataset(4), timeout_ms=10_000):
                train_step(ctx, batch)
                trained += 1
            assert not told_done(0)  # #2's answers cleared #1's nn.done (#2's own comes at its exit)
        loader.join(30)
        assert not loader.is_alive() and not errors, errors
        assert trained == 10
        assert ACCOUNT.as_result()["batches_trained"] == 10


def test_a_loader_whose_trainer_left_fails_at_once_naming_the_rank(persia_env) -> None:
    """The trainer breaks after 3 steps and leaves; the loader has 97 batches more. Before: it
    retried each send for ``send_deadline_s`` (600 s), though rank 0 had said nn.done. Now the
    send fails one grace after the nn.done, and every batch stays accounted for."""
    with cluster():
        errors: list = []
        given = [0]

        def send(dctx: DataCtx) -> None:
            for i in range(100):
                given[0] += 1
                dctx.send_data(make_batch(i))

        loader = loader_thread(send, errors, send_deadline_s=120.0, trainer_grace_s=1.0)
        with adagrad_ctx(Model()) as ctx:
            for step, batch in enumerate(DataLoader(StreamingDataset(4))):
                train_step(ctx, batch)
                if step == 2:
                    break
        left = time.monotonic()
        poll_until(lambda: not loader.is_alive(), "the loader ending after its trainer left", deadline_s=30.0)
        ended_after = time.monotonic() - left
        assert len(errors) == 1, errors
        message = str(errors[0])
        assert type(errors[0]).__name__ == "TrainerGone", errors
        assert "NN rank 0 finished training (nn.done" in message and "no NN worker answers for it" in message
        assert "not sent" in message
        assert ended_after < 20.0, f"the loader took {ended_after:.1f}s after the trainer left"
        stream = loader_stream.current()
        # every batch given to send_data took an id and was acknowledged or counted as failed
        assert stream.counter == given[0] < 100
        assert stream.sent_total + sum(stream.failed.values()) == stream.counter, (stream.sent_total, stream.failed)
        assert stream.failed["send_dense"] >= 1


@pytest.mark.parametrize("trainer", ["process alive", "process gone"])
def test_an_epoch_end_to_a_rank_that_left_is_kept_or_fails_instead_of_waiting_the_send_deadline(
        persia_env, trainer) -> None:
    """The trainer takes exactly the loader's 4 batches and leaves before the loader ends its
    epoch. Its process still alive, the rank keeps the end for a later context (it is answered at
    once); its process gone (played by forgetting its streams, which stops their answers), the end
    fails with TrainerGone. Before: the end (which carries the count) was retried for
    ``send_deadline_s``."""
    from persia.nn_worker import datasets

    with cluster():
        loader_stream.reset()
        errors: list = []
        trainer_left = threading.Event()
        timing: dict = {}

        def run() -> None:
            try:
                with DataCtx(send_deadline_s=120.0, trainer_grace_s=1.0) as dctx:
                    for i in range(4):
                        dctx.send_data(make_batch(i))
                    trainer_left.wait(60)
                    timing["closing"] = time.monotonic()
            except BaseException as exc:  # noqa: BLE001
                timing["raised"] = time.monotonic()
                errors.append(exc)

        loader = threading.Thread(target=run, daemon=True)
        loader.start()
        with adagrad_ctx(Model()) as ctx:
            for step, batch in enumerate(DataLoader(StreamingDataset(4))):
                train_step(ctx, batch)
                if step == 3:
                    break
        poll_until(lambda: told_done(0), "the loader hearing rank 0's nn.done")
        if trainer == "process gone":
            datasets.reset_streams()
        trainer_left.set()
        poll_until(lambda: not loader.is_alive(), "the loader's epoch end", deadline_s=30.0)
        assert loader_stream.current().sent_total == 4
        if trainer == "process alive":
            assert not errors and timing["closing"]
            return
        assert len(errors) == 1 and type(errors[0]).__name__ == "TrainerGone", errors
        assert "the end of epoch 0 not sent" in str(errors[0])
        assert timing["raised"] - timing["closing"] < 20.0


def test_only_a_context_that_ends_without_a_failure_says_nn_done(persia_env) -> None:
    """A rank whose TrainCtx failed may be restarted in place and resume: its data loaders must
    wait for it (their send deadline), so it says nothing; one that finished says ``nn.done``."""
    from persia.bus import NatsBus, subject

    heard: list[dict] = []
    listener = NatsBus(name="done-listener")
    try:
        listener.serve(subject("nn", "done"), lambda msg: heard.append(msg) or None, blocking=False)
        listener.flush()
        with cluster():
            with pytest.raises(ValueError, match="a failing step"):
                with adagrad_ctx(Model()):
                    raise ValueError("a failing step")
            with adagrad_ctx(Model()):
                pass
            # one connection publishes both in order: once the second arrived, the first would have
            poll_until(lambda: heard, "the clean exit's nn.done")
        assert heard == [{"rank": 0}]
    finally:
        listener.close()
