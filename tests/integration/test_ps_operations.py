"""Dumps and stages run on the PS's own thread (``ps.start``), followed with short ``ps.status``
polls: a PS that restarts meanwhile is an error within a poll, and a repeated start of one
operation (a retry after a lost reply) runs it once. Real nats-server, PS replicas in-process."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from persia.bus import NatsBus, subject
from persia.config import load_global_config_from_dict
from persia.ctx import TrainCtx
from persia.embedding.optim import Adagrad
from persia.embedding_ps.service import EmbeddingParameterServer
from persia.embedding_ps.store import EmbeddingStore
from persia.nn_worker.checkpoint import PsRestarted
from tests.polling import poll_until

from .cluster import GLOBAL_CONFIG, cluster
from .test_training_path import Model, train

pytestmark = pytest.mark.integration


@pytest.fixture
def slow_dumps(monkeypatch):
    """Every PS dump waits for ``release`` after saying it started."""
    started, release = threading.Event(), threading.Event()
    real = EmbeddingStore.dump

    def dump(self, *args, **kwargs):
        started.set()
        assert release.wait(60), "the test never released the dump"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EmbeddingStore, "dump", dump)
    yield started, release
    release.set()


def test_a_ps_restarted_during_a_dump_is_an_error_within_seconds(persia_env, tmp_path, slow_dumps):
    started, release = slow_dumps
    model = Model()
    with cluster() as servers:
        train(model, 2, staleness=1)
        ps = servers[0]
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            failure: list[BaseException] = []
            dumping = threading.Thread(target=lambda: _catch(failure, ctx.dump_embedding, str(tmp_path / "ckpt")))
            dumping.start()
            assert started.wait(30)
            # the replica's process ends and another takes its place (its index, its subjects)
            ps.stop()
            ps.bus.close()
            bus = NatsBus(name="ps0-again")
            again = EmbeddingParameterServer(load_global_config_from_dict(GLOBAL_CONFIG), 0, 1, port=0, bus=bus)
            try:
                t0 = time.monotonic()
                dumping.join(30)
                assert not dumping.is_alive()
                assert time.monotonic() - t0 < 10
                assert len(failure) == 1 and isinstance(failure[0], PsRestarted), failure
                assert "PS replica 0 restarted during the dump" in str(failure[0])
                assert not (tmp_path / "ckpt" / "embedding_dump_done").exists()
            finally:
                release.set()
                again.stop()
                bus.close()


def test_starting_one_operation_twice_runs_it_once(persia_env, tmp_path, slow_dumps):
    """A retried ``ps.start`` (its first reply lost) is answered again, not run again."""
    started, release = slow_dumps
    with cluster() as servers:
        ps = servers[0]
        calls = []
        real_dump = ps.dump
        ps.dump = lambda req: (calls.append(req), real_dump(req))[1]
        bus = NatsBus(name="caller")
        try:
            request = {"op": "dump", "dir": str(tmp_path / "ckpt"), "id": "op-1"}
            first = bus.request_retry(subject("ps", "start", 0), request, deadline_s=10)
            assert started.wait(30)
            again = bus.request_retry(subject("ps", "start", 0), request, deadline_s=10)
            assert first == again == {"incarnation": ps.incarnation}
            status = bus.request_retry(subject("ps", "status", 0), {"id": "op-1"}, deadline_s=10)
            assert status["state"] == "dumping" and status["operation"] == {"state": "running"}
            release.set()
            poll_until(lambda: bus.request_retry(subject("ps", "status", 0), {"id": "op-1"},
                                                 deadline_s=10)["operation"]["state"] == "done",
                       "the dump ends", deadline_s=30)
            assert len(calls) == 1
            done = bus.request_retry(subject("ps", "status", 0), {"id": "op-1"}, deadline_s=10)["operation"]
            assert done["result"]["done"] is True
            assert bus.request_retry(subject("ps", "status", 0), {"id": "unknown"}, deadline_s=10)["operation"] is None
        finally:
            release.set()
            bus.close()


def _catch(into: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        into.append(exc)
