"""Several batches looked up in one ``Step`` (persia.nn_worker.lookup_group), through real PS
replicas and embedding workers: each batch gets what a lone lookup gets, one batch's failure is
its own, and hybrid training with groups ends where synchronous training ends."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from persia.bus import shared_bus, subject
from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.data_loader.ctx import batch_ref
from persia.data_loader.wire import _named_arrays, id_features_to_wire
from persia.embedding.optim import Adagrad
from persia.embedding_worker.service import MAX_WAITING_LOOKUPS, SERVICE
from persia.errors import BatchLost, RemoteError
from persia.nn_worker.accounting import ACCOUNT
from persia.nn_worker.training_batch import PersiaTrainingBatch
from persia.rpc import Client

from .cluster import cluster
from .test_concurrent_legs import start_waiting_lookups
from .test_own_update_replay import N_BATCHES, _same, _train
from .test_training_path import BS, Model, eval_embeddings, make_batch, send_in_thread

pytestmark = pytest.mark.integration


def _forward(bus, session: str, batch_id: int, seed: int) -> dict:
    """Send batch ``seed``'s ID features to embedding worker 0 as a data loader does; the message
    its NN rank would get for it."""
    b = make_batch(seed)
    ref = batch_ref(session, 0, batch_id)
    bus.request(subject("ew", "forward", 0), {"loader": 0, "session": session, "batch_id": batch_id, "ref": ref,
                                              "batch_size": BS, "features": id_features_to_wire(b)})
    return {"batch_id": batch_id, "loader": 0, "session": session, "ref": ref, "worker": 0, "requires_grad": True,
            "non_id": _named_arrays(b.non_id_type_features), "labels": _named_arrays(b.labels), "meta": None}


def test_each_batch_of_a_group_gets_what_a_lone_lookup_gets_and_a_lost_one_fails_alone(persia_env):
    model = Model()
    with cluster(num_ps=2, num_workers=1):
        bus = shared_bus()
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.5),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            msgs = [_forward(bus, "g", i, seed=i) for i in range(3)]
            bus.request(subject("ew", "release", 0), {"refs": [msgs[1]["ref"]]})  # its loader gave up on it
            looked = ctx._lookup_messages(msgs, [False] * 3, [None] * 3)
            assert isinstance(looked[1], BatchLost)
            assert "batch 1 of data loader 0" in str(looked[1]) and "released before its lookup" in str(looked[1])
            assert [b.batch_id for b in (looked[0], looked[2])] == [0, 2]
            # the same features again, each looked up alone: the rows the group created, table by table
            for seed, grouped in ((0, looked[0]), (2, looked[2])):
                alone = ctx._lookup_message(_forward(bus, "a", 10 + seed, seed=seed), False)
                assert isinstance(alone, PersiaTrainingBatch)
                assert len(alone.emb_tables) == len(grouped.emb_tables) > 0
                for a, g in zip(alone.emb_tables + alone.embeddings, grouped.emb_tables + grouped.embeddings):
                    assert a.keys() == g.keys()
                    for key in a:
                        np.testing.assert_array_equal(a[key], g[key], err_msg=key)


def test_too_many_waiting_fails_the_call_on_its_first_lookup_and_only_that_lookup_after(persia_env):
    """A lookup past MAX_WAITING_LOOKUPS waiting ones is refused RESOURCE_EXHAUSTED. First in a
    group, nothing has been done yet: the whole call is refused, to be sent again. Later in a
    group, the lookups before it have run: only it is answered so, and the NN rank sends it alone."""
    with cluster() as servers:
        worker = servers[-1]
        bus = shared_bus()
        client = Client(worker.address, SERVICE)
        missing = [batch_ref("w", 0, 100 + i) for i in range(MAX_WAITING_LOOKUPS + 2)]
        waiting = start_waiting_lookups(worker, missing[:MAX_WAITING_LOOKUPS],
                                        lambda r: _swallow(client.call, "Lookup", {"ref": r, "train": False}))
        here = [_forward(bus, "w", i, seed=i)["ref"] for i in range(2)]
        try:
            with pytest.raises(RemoteError) as refused:
                client.call("Step", {"lookups": [{"ref": missing[-1], "train": False}, {"ref": here[0], "train": False}]})
            assert refused.value.kind == "RESOURCE_EXHAUSTED"
            assert len(worker.forward_buffer) == 2  # nothing was taken: the same call may come again
            out = client.call("Step", {"lookups": [{"ref": here[0], "train": False},
                                                   {"ref": missing[-2], "train": False},
                                                   {"ref": here[1], "train": False}]})
            first, refused_one, last = out["lookups"]
            assert first["tables"] and last["tables"] and "error" not in first and "error" not in last
            assert refused_one["kind"] == "RESOURCE_EXHAUSTED" and "ask again" in refused_one["error"]
            assert len(worker.forward_buffer) == 0
        finally:
            bus.request(subject("ew", "release", 0), {"refs": missing})  # the waiting lookups end now
            for t in waiting:
                t.join(30)
            client.close()


def _swallow(call, *args):
    try:
        call(*args)
    except RemoteError:
        pass  # released by the test


def test_hybrid_training_with_grouped_lookups_ends_where_synchronous_training_ends(persia_env, monkeypatch):
    """Own-update replay corrects every read of one NN rank, so reading a batch one step early in a
    group changes nothing: the same embeddings and dense parameters as synchronous training."""
    monkeypatch.setenv("PERSIA_UPDATE_HOLD_MS", "60000")  # updates wait for a lookup to carry them
    sync = _train(staleness=1, replay=True)
    groups: list[int] = []
    original = TrainCtx._lookup_messages

    def counted(self, msgs, holds, transferred):
        groups.append(len(msgs))
        return original(self, msgs, holds, transferred)

    monkeypatch.setattr(TrainCtx, "_lookup_messages", counted)
    monkeypatch.setenv("PERSIA_LOOKUP_GROUP", "2")
    torch.manual_seed(0)
    model = Model()
    errors: list = []
    ACCOUNT.__init__()
    with cluster(num_ps=2, num_workers=1):
        sender = send_in_thread([make_batch(i) for i in range(N_BATCHES)], errors)
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.5),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            seen = []
            dataset = StreamingDataset(8)
            # not reproducible: one data loader thread sends in order
            for batch in DataLoader(dataset, embedding_staleness=8, staleness_warmup_steps=0):
                # each step waits (polled, with a deadline) until batches queue up behind this one,
                # as they do when the data loaders are ahead of training: groups form from those
                end = time.monotonic() + 10
                while dataset._queue.qsize() < 2 and sender.is_alive() and time.monotonic() < end:
                    time.sleep(0.002)
                seen.append(batch.batch_id)
                out, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
            ctx.wait_for_pending_updates()
        sender.join(30)
        assert not errors, errors
        emb = eval_embeddings(model, [make_batch(1000 + i, requires_grad=False) for i in range(3)])
    assert seen == list(range(N_BATCHES))  # every batch, in stream order
    assert groups and all(g == 2 for g in groups), groups  # some batches went two to a call
    result = ACCOUNT.as_result()
    assert result["batches_trained"] == N_BATCHES and result["batches_failed"] == {}
    assert _same(([p.detach().clone() for p in model.parameters()], emb, None), sync)
