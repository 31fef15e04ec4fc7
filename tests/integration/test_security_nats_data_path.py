"""The data path against another job on the same NATS (an "outsider": NATS credentials, another job
secret), with a real nats-server and a real embedding worker: a forged ``ew.forward`` cannot take
a batch's place (refs are keyed with the job secret), ``ew.release`` is signed, capped and served
off the bus loop, and a forged ``nn.done`` does not make a data loader give up on a rank."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
from persia import bus as bus_module
from persia import messages as M
from persia.bus import NatsBus, shared_bus, subject
from persia.ctx import id_features_to_wire
from persia.data_loader import stream as loader_stream
from persia.data_loader.ctx import DataCtx, batch_ref
from persia.embedding_worker.service import EmbeddingWorker
from persia.errors import RemoteError
from persia.security import new_secret
from persia.wire.codec import encode

from tests.polling import poll_until

from .cluster import cluster
from .test_training_path import BS, make_batch

pytestmark = pytest.mark.integration


def _unkeyed_ref(session: str, loader: int, batch_id: int) -> int:
    """What anyone can compute of a batch's ref without the job secret (the ref before the fix)."""
    import hashlib

    digest = hashlib.blake2b(f"{session}/{loader}/{batch_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def _forward(session: str, batch_id: int, ref: int | None, seed: int) -> dict:
    req = {"loader": 0, "session": session, "batch_id": batch_id, "batch_size": BS,
           "features": id_features_to_wire(make_batch(seed))}
    return req if ref is None else {**req, "ref": ref}


@pytest.fixture
def outsider(persia_env):
    bus = NatsBus(name="other-job", secret=new_secret().encode())
    try:
        yield bus
    finally:
        bus.close()


def _fresh_refusal_log() -> None:
    bus_module._rejections._last = float("-inf")  # the once-a-second refusal log line is due now


def test_a_forged_forward_cannot_take_a_future_batchs_place(persia_env, outsider, caplog):
    """The outsider sends batch 5's ID features first, under the ref it can compute; the loader's
    own send must buffer the loader's IDs under the loader's ref. Before: the forged one was
    buffered, the loader's send answered as a retry of it, and the NN rank trained the loader's
    dense part on the outsider's IDs."""
    session = "visible-session"
    with cluster() as servers:
        worker = servers[-1]
        member = shared_bus()
        _fresh_refusal_log()
        with caplog.at_level(logging.WARNING, logger="persia.bus"):
            for forged in (_forward(session, 5, _unkeyed_ref(session, 0, 5), seed=99),
                           # the ref of a batch already sent, claimed for a future one
                           _forward(session, 6, batch_ref(session, 0, 4), seed=99)):
                with pytest.raises(RemoteError) as refused:
                    outsider.request(subject("ew", "forward", 0), forged)
                assert refused.value.kind == "Unauthorized" and "keyed with PERSIA_JOB_SECRET" in str(refused.value)
            with pytest.raises(RemoteError) as refused:  # in a group: the whole group
                outsider.request(subject("ew", "forward_group", 0),
                                 {"batches": [_forward(session, 7, _unkeyed_ref(session, 0, 7), seed=99)]})
            assert refused.value.kind == "Unauthorized"
        assert any("refused message" in r.getMessage() and "not this job's ref" in r.getMessage()
                   for r in caplog.records), caplog.text
        assert len(worker.forward_buffer) == 0
        # a forward without a ref (the worker picks one) does not claim the batch's retry key either
        outsider.request(subject("ew", "forward", 0), _forward(session, 5, None, seed=99))
        ref = batch_ref(session, 0, 5)
        assert member.request(subject("ew", "forward", 0), _forward(session, 5, ref, seed=5)) == {"ref": ref, "worker": 0}
        buffered = worker.forward_buffer.take(ref)
        genuine = id_features_to_wire(make_batch(5))
        np.testing.assert_array_equal(buffered["features"]["values"], genuine["values"])
        # and a retry of the loader's send is still answered with its ref
        assert member.request(subject("ew", "forward", 0), _forward(session, 5, ref, seed=5)) == {"ref": ref, "worker": 0}


def test_without_a_job_secret_refs_are_unkeyed_and_not_checked(persia_env, monkeypatch):
    monkeypatch.delenv("PERSIA_JOB_SECRET")
    with cluster() as servers:
        bus = NatsBus(name="no-secret")
        try:
            assert batch_ref("s", 0, 3) == _unkeyed_ref("s", 0, 3)
            assert bus.request(subject("ew", "forward", 0), _forward("s", 3, 12345, seed=3))["ref"] == 12345
            assert len(servers[-1].forward_buffer) == 1
        finally:
            bus.close()


def test_release_is_signed(persia_env, outsider):
    session = "s"
    with cluster() as servers:
        worker = servers[-1]
        member = shared_bus()
        ref = batch_ref(session, 0, 1)
        member.request(subject("ew", "forward", 0), _forward(session, 1, ref, seed=1))
        with pytest.raises(RemoteError, match="bad signature"):
            outsider.request(subject("ew", "release", 0), {"refs": [ref, batch_ref(session, 0, 2)]})
        raw = outsider.run(outsider.nc.request(subject("ew", "release", 0), encode({"refs": [ref]}), timeout=10))
        assert b"unsigned" in raw.data and b"Unauthorized" in raw.data
        assert len(worker.forward_buffer) == 1
        # the next batch is still accepted (not remembered as released)
        member.request(subject("ew", "forward", 0), _forward(session, 2, batch_ref(session, 0, 2), seed=2))
        assert member.request(subject("ew", "release", 0), {"refs": [ref]}) == {"released": 1}


def test_a_release_is_capped_and_runs_off_the_bus_loop(persia_env, monkeypatch):
    """More refs than MAX_RELEASE_REFS are refused naming the field; a release being handled does
    not hold up forwards (before: a 2^20-ref release ran on the worker's NATS loop for seconds)."""
    entered, go = threading.Event(), threading.Event()
    original = EmbeddingWorker.release

    def slow_release(self, req):
        entered.set()
        go.wait(30)
        return original(self, req)

    monkeypatch.setattr(EmbeddingWorker, "release", slow_release)
    cap = getattr(M, "MAX_RELEASE_REFS", 4096)
    with cluster():
        member = shared_bus()
        with pytest.raises(RemoteError) as refused:
            member.request(subject("ew", "release", 0), {"refs": list(range(cap + 1))})
        assert refused.value.kind == "MessageError" and "'refs'" in str(refused.value)
        assert not entered.is_set()
        released: list = []
        t = threading.Thread(target=lambda: released.append(
            member.request(subject("ew", "release", 0), {"refs": list(range(1, cap + 1))})))
        t.start()
        try:
            poll_until(entered.is_set, "the release handler running")
            ref = batch_ref("s", 0, 0)
            assert member.request(subject("ew", "forward", 0), _forward("s", 0, ref, seed=0), timeout=5)["ref"] == ref
        finally:
            go.set()
            t.join(30)
        assert released == [{"released": 0}]


def test_a_forged_nn_done_does_not_make_a_loader_give_up_on_a_rank(persia_env, outsider, caplog):
    """A data loader drops an ``nn.done`` not signed with its job's secret (before: rank 0 was
    taken for finished, and a send to it failed with TrainerGone after the grace instead of
    waiting for the rank to come back); the job's own is heard."""
    with cluster():
        member = NatsBus(name="nn-side")
        try:
            member.serve(subject("nn", "info"), lambda _o: {"world_size": 2}, blocking=False, schema=M.NoPayload)
            for rank in (0, 1):  # the ends of epoch and stream, taken
                member.serve(subject("nn", "eos", rank), lambda _o: {"queued": True}, blocking=False)
            member.flush()
            loader_stream.reset()
            with DataCtx(discovery_deadline_s=20):
                trainers = loader_stream.current().trainers
                _fresh_refusal_log()
                with caplog.at_level(logging.WARNING, logger="persia.bus"):
                    outsider.publish(subject("nn", "done"), {"rank": 0})  # signed with another secret
                    outsider.run(outsider.nc.publish(subject("nn", "done"), encode({"rank": 0})))  # unsigned
                    outsider.flush()  # the server has them before the genuine one below
                    member.publish(subject("nn", "done"), {"rank": 1})
                    poll_until(lambda: trainers.done_at(1) is not None, "the job's own nn.done heard")
                assert trainers.done_at(0) is None
                assert any("dropped event" in r.getMessage() and ".nn.done" in r.getMessage()
                           for r in caplog.records), caplog.text
            loader_stream.end_of_stream()
        finally:
            loader_stream.reset()
            member.close()
