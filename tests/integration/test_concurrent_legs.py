"""A data loader sends a batch's ID features (to an embedding worker) and its dense part (to an NN
rank) at once, so the NN worker's lookup may reach the embedding worker before the IDs do. Real
nats-server, real gRPC on loopback, real torch; the ID leg is held back deterministically by
holding the worker's forward handler until the NN worker's lookup waits for it."""

from __future__ import annotations

import logging
import time

import pytest

from persia.bus import shared_bus, subject
from persia.ctx import id_features_to_wire
from persia.data_loader.ctx import batch_ref
from persia.embedding_worker.service import EmbeddingWorker
from persia.errors import RemoteError
from persia.nn_worker.accounting import ACCOUNT

from .cluster import cluster
from .test_batch_integrity import train_through_failed_sends
from .test_training_path import BS, make_batch

pytestmark = pytest.mark.integration


def hold_forward(monkeypatch, batch_id: int, then_fail: bool) -> dict:
    """Hold the embedding worker's forward of ``batch_id`` until an NN lookup waits for it, then
    buffer it (or refuse it, as a worker that rejects the batch would)."""
    seen = {"waited": False}
    original = EmbeddingWorker.on_forward

    def on_forward(self, req):
        if req.get("batch_id") == batch_id:
            end = time.monotonic() + 30
            while not self.forward_buffer.waiting and time.monotonic() < end:
                time.sleep(0.001)  # polled with a deadline: the NN worker's lookup comes on its own
            seen["waited"] = bool(self.forward_buffer.waiting)
            if then_fail:
                raise ValueError(f"batch {batch_id} refused for the test")
        return original(self, req)

    monkeypatch.setattr(EmbeddingWorker, "on_forward", on_forward)
    return seen


def start_waiting_lookups(worker, refs, lookup) -> list:
    """``lookup(ref)`` for each of ``refs`` (never sent), each in its own thread; returns the
    threads once the worker holds MAX_WAITING_LOOKUPS lookups waiting (polled with a deadline)."""
    import threading

    from persia.embedding_worker.service import MAX_WAITING_LOOKUPS

    threads = [threading.Thread(target=lookup, args=(r,), daemon=True) for r in refs]
    for t in threads:
        t.start()
    end = time.monotonic() + 30
    while worker.forward_buffer.waiting < MAX_WAITING_LOOKUPS and time.monotonic() < end:
        time.sleep(0.005)
    assert worker.forward_buffer.waiting == MAX_WAITING_LOOKUPS
    return threads


def test_a_lookup_that_comes_before_the_ids_waits_for_them(persia_env, monkeypatch):
    held = hold_forward(monkeypatch, batch_id=1, then_fail=False)
    seen, errors, worker = train_through_failed_sends([make_batch(i) for i in range(4)])
    assert held["waited"]  # the NN worker's lookup of batch 1 was on the worker before its IDs
    assert errors == [] and seen == [0, 1, 2, 3]
    assert len(worker.forward_buffer) == 0 and worker.forward_buffer.waiting == 0
    assert worker.metrics.get("lookup_waited") >= 1 and worker.metrics.get("lookup_lost") == 0
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 4 and result["batches_trained"] == 4 and result["batches_failed"] == {}


def test_an_id_leg_that_fails_after_the_nn_got_the_batch_fails_its_lookup_at_once(persia_env, monkeypatch, caplog):
    held = hold_forward(monkeypatch, batch_id=1, then_fail=True)
    caplog.set_level(logging.ERROR, logger="persia.nn_worker.loader")
    # a lookup wait far longer than the test: only the loader's release can end it in time
    seen, errors, worker = train_through_failed_sends([make_batch(i) for i in range(4)], lookup_wait_sec=600)
    assert held["waited"]
    assert len(errors) == 1 and "refused for the test" in str(errors[0])
    assert seen == [0, 2, 3]
    assert len(worker.forward_buffer) == 0
    assert worker.metrics.get("lookup_lost") == 1  # on /metrics: persia_lookup_lost
    lost = [r.getMessage() for r in caplog.records
            if r.name == "persia.nn_worker.loader" and "lost_id_features" in r.getMessage()]
    assert len(lost) == 1 and "batch 1 of data loader 0" in lost[0] and "released before its lookup" in lost[0]
    # the NN rank had the batch, so it is in that rank's count, failed with a reason
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 4 and result["batches_trained"] == 3
    assert result["batches_failed"] == {"lost_id_features": 1}


def test_a_lost_batch_counts_in_its_loaders_resume_position(persia_env, monkeypatch, tmp_path):
    """Batch 1's ID leg fails after the NN rank got it (lost_id_features); the checkpoint at step 2
    (batches 0 and 2 trained) records 3 of loader 0's batches consumed, so a job resumed from it is
    sent batch 3 only. Before, the position was 2: the resumed loader skipped batches 0 and 1 and
    sent batch 2, already trained, again."""
    import json

    hold_forward(monkeypatch, batch_id=1, then_fail=True)
    ckpt = {"checkpoint_dir": str(tmp_path), "checkpoint_interval_steps": 2}
    seen, errors, _ = train_through_failed_sends([make_batch(i) for i in range(4)], lookup_wait_sec=600, **ckpt)
    assert seen == [0, 2, 3] and len(errors) == 1
    progress = json.loads((tmp_path / "ckpt-000000000002" / "progress.json").read_text())
    assert progress["loaders"] == {"0": {"0": 3}}
    ACCOUNT.__init__()
    seen, errors, _ = train_through_failed_sends([make_batch(i) for i in range(4)], **ckpt)
    assert errors == [] and seen == [3]


def test_a_retried_forward_keeps_its_ref_and_a_ref_is_never_shared(persia_env):
    with cluster() as servers:
        worker = servers[-1]
        bus = shared_bus()
        ref = batch_ref("s1", 0, 7)
        req = {"loader": 0, "session": "s1", "batch_id": 7, "ref": ref, "batch_size": BS,
               "features": id_features_to_wire(make_batch(7))}
        assert bus.request(subject("ew", "forward", 0), req) == {"ref": ref, "worker": 0}
        assert bus.request(subject("ew", "forward", 0), req) == {"ref": ref, "worker": 0}  # a retry
        assert len(worker.forward_buffer) == 1
        with pytest.raises(RemoteError, match="already buffered"):  # another batch claiming that ref
            bus.request(subject("ew", "forward", 0), {**req, "batch_id": 8})
        # released (its loader gave up): a late copy of another send is refused, not buffered
        assert bus.request(subject("ew", "release", 0), {"refs": [ref]}) == {"released": 1}
        with pytest.raises(RemoteError, match="released before its lookup"):
            bus.request(subject("ew", "forward", 0), {**req, "session": "s2"})
        assert len(worker.forward_buffer) == 0


def test_waiting_lookups_are_bounded_and_the_nn_worker_asks_again(persia_env):
    """At most MAX_WAITING_LOOKUPS lookups wait on a worker (the rest of its gRPC threads stay free
    for updates and releases); one more is answered RESOURCE_EXHAUSTED before anything is done, and
    the NN worker's call asks again until it gets through."""
    import threading

    from persia.embedding_worker.service import MAX_WAITING_LOOKUPS, SERVICE
    from persia.nn_worker.embedding_ctx import EmbeddingCtx, PreprocessMode
    from persia.rpc import Client

    with cluster() as servers:
        worker = servers[-1]
        client = Client(worker.address, SERVICE)
        refs = [batch_ref("s", 0, i) for i in range(MAX_WAITING_LOOKUPS + 1)]
        replies: dict = {}

        def lookup(ref, call):
            try:
                replies[ref] = call("Lookup", {"ref": ref, "train": False})
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                replies[ref] = exc

        waiting = start_waiting_lookups(worker, refs[:-1], lambda r: lookup(r, client.call))
        with pytest.raises(RemoteError) as refused:
            client.call("Lookup", {"ref": refs[-1], "train": False})
        assert refused.value.kind == "RESOURCE_EXHAUSTED" and "ask again" in str(refused.value)
        assert worker.metrics.get("lookup_wait_refused") == 1
        assert worker.metrics.get("lookup_waited") == MAX_WAITING_LOOKUPS
        ctx = EmbeddingCtx(PreprocessMode.EVAL)
        ctx._workers = [client]
        again = threading.Thread(target=lookup, args=(refs[-1], lambda m, r: ctx._call_worker(0, m, r)), daemon=True)
        again.start()
        for i, ref in enumerate(refs):  # the ID features arrive: every lookup gets its batch
            worker.on_forward({"loader": 0, "session": "s", "batch_id": i, "ref": ref, "batch_size": BS,
                               "features": id_features_to_wire(make_batch(i))})
        for t in [*waiting, again]:
            t.join(30)
        assert all(isinstance(replies.get(r), dict) and "slots" in replies[r] for r in refs), replies
        client.close()
