"""Inference without NATS: an Infer-mode PS loads a checkpoint at start, an Infer-mode embedding
worker talks to it by address, InferCtx talks to the worker by address (PERSIA's serving path)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from persia.config import load_embedding_config_from_dict, load_global_config_from_dict
from persia.ctx import InferCtx, TrainCtx
from persia.embedding.optim import Adagrad
from persia.embedding_ps.service import SERVICE as PS_SERVICE
from persia.embedding_ps.service import EmbeddingParameterServer
from persia.embedding_ps.store import EmbeddingStore
from persia.embedding_worker.service import EmbeddingWorker
from persia.errors import RemoteError, ServersMisplaced
from persia.rpc import Client

from tests.polling import poll_until
from tests.ports import free_ports
from .cluster import EMBEDDING_CONFIG, GLOBAL_CONFIG, cluster
from .test_training_path import Model, eval_embeddings, make_batch, train

pytestmark = pytest.mark.integration


def test_infer_ctx_serves_the_trained_embeddings(persia_env, tmp_path):
    probe = make_batch(4242, requires_grad=False)
    model = Model()
    with cluster(num_ps=2):
        train(model, 6, staleness=1)
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            expected = eval_embeddings(model, [probe])[0]
            ctx.dump_checkpoint(str(tmp_path / "ckpt"))

    infer_global = dict(GLOBAL_CONFIG, common_config={
        "job_type": "Infer", "infer_config": {"embedding_checkpoint": str(tmp_path / "ckpt")}})
    gc = load_global_config_from_dict(infer_global)
    ec = load_embedding_config_from_dict(EMBEDDING_CONFIG)
    servers = [EmbeddingParameterServer(gc, i, 2, port=0) for i in range(2)]  # no NATS at all
    worker = EmbeddingWorker(ec, gc, 0, 1, port=0, ps_addresses=[s.address for s in servers])
    try:
        with InferCtx([worker.address], model=model) as ctx:
            ctx.wait_for_serving()
            batch = ctx.get_embedding_from_bytes(probe.to_bytes())
            _, emb, _ = ctx.prepare_features(batch)
            for got, want in zip(emb, expected):
                np.testing.assert_array_equal(got.detach().numpy(), want)
            out, _ = ctx.forward(batch)
            assert out.shape == (probe.batch_size, 1)
            with pytest.raises(ValueError, match=r"device_id=0: this context's tensors go to cpu"):
                ctx.get_embedding_from_bytes(probe.to_bytes(), device_id=0)  # PERSIA ignored it
    finally:
        worker.stop()
        for s in servers:
            s.stop()


def _infer_config(checkpoint: str | None = None):
    common = {"job_type": "Infer", "infer_config": {"embedding_checkpoint": checkpoint}}
    return load_global_config_from_dict(dict(GLOBAL_CONFIG, common_config=common))


def test_static_servers_out_of_replica_order_are_refused(persia_env):
    """``infer_config.servers`` listing the PS replicas in another order, or only some of them,
    would send IDs to replicas that do not own them and serve zeros: the worker answers not ready,
    ``wait_for_serving`` raises at once, and a lookup fails naming the list's entry."""
    gc, ec = _infer_config(), load_embedding_config_from_dict(EMBEDDING_CONFIG)
    servers = [EmbeddingParameterServer(gc, i, 2, port=0) for i in range(2)]
    workers = {
        "reversed": EmbeddingWorker(ec, gc, 0, 1, port=0, ps_addresses=[s.address for s in reversed(servers)]),
        "short": EmbeddingWorker(ec, gc, 0, 1, port=0, ps_addresses=[servers[0].address]),
        "right": EmbeddingWorker(ec, gc, 0, 1, port=0, ps_addresses=[s.address for s in servers]),
    }
    probe = make_batch(7, requires_grad=False)
    try:
        answer = workers["reversed"].ready()
        assert (answer["ready"], answer["misplaced"]) == (False, True)
        assert f"infer_config.servers[0] = '{servers[1].address}' is PS replica 1 of 2" in answer["why"]
        assert "servers[0]" in workers["short"].ready()["why"] and "position 0 of 1" in workers["short"].ready()["why"]
        assert workers["right"].ready()["ready"] is True

        started = time.monotonic()
        with InferCtx([workers["reversed"].address], model=Model()) as ctx:
            with pytest.raises(ServersMisplaced, match=r"infer_config.servers\[0\]"):
                ctx.wait_for_serving(deadline_s=30)
            assert time.monotonic() - started < 10  # not the deadline: a wrong list does not heal
            with pytest.raises(RemoteError) as lookup:
                ctx.get_embedding_from_bytes(probe.to_bytes())
            assert lookup.value.kind == "FAILED_PRECONDITION" and "replica order" in str(lookup.value)
        with InferCtx([workers["right"].address], model=Model()) as ctx:
            ctx.wait_for_serving(deadline_s=30)
            ctx.get_embedding_from_bytes(probe.to_bytes())
    finally:
        for w in workers.values():
            w.stop()
        for s in servers:
            s.stop()


def test_inference_ps_opens_its_port_only_once_its_checkpoint_is_loaded(persia_env, tmp_path, monkeypatch):
    """Rows not loaded yet read as zeros, so an inference PS that answered during its load would
    serve zeros, and its pod's readiness (its port) would say it serves: nothing answers on the
    port until the load is done, and the embedding worker's ``Ready`` says why."""
    port = free_ports(1)
    loading, release = threading.Event(), threading.Event()
    real_load = EmbeddingStore.load

    def slow_load(self, *args, **kwargs):
        loading.set()
        assert release.wait(30)
        return real_load(self, *args, **kwargs)

    trained = EmbeddingStore(1000, 4)
    signs = np.arange(1, 51, dtype=np.uint64)
    want = trained.lookup(signs, 8, train=True)
    trained.dump(tmp_path / "ckpt", 0, replica_size=1)
    monkeypatch.setattr(EmbeddingStore, "load", slow_load)
    gc = _infer_config(str(tmp_path / "ckpt"))
    made: list = []
    starting = threading.Thread(target=lambda: made.append(EmbeddingParameterServer(gc, 0, 1, port=port)))
    starting.start()
    worker = EmbeddingWorker(load_embedding_config_from_dict(EMBEDDING_CONFIG), gc, 0, 1, port=0,
                             ps_addresses=[f"127.0.0.1:{port}"])
    client = Client(f"127.0.0.1:{port}", PS_SERVICE)
    try:
        assert loading.wait(30)
        with pytest.raises(RemoteError) as early:
            client.call("Stats", None, timeout=2.0)
        assert early.value.kind == "UNAVAILABLE"
        answer = worker.ready()
        assert (answer["ready"], answer["misplaced"]) == (False, False) and f"127.0.0.1:{port}" in answer["why"]
        release.set()
        starting.join(30)
        assert made, "the PS did not start"
        # the channels that failed reconnect within their backoff (capped at 2 s: persia.rpc)
        poll_until(lambda: worker.ready()["ready"], "the embedding worker reaches the loaded PS", deadline_s=10)
        assert client.call("Stats", None, timeout=5.0)["replica_index"] == 0
        got = client.call("Lookup", {"train": False, "tables": [{"signs": signs, "dim": 8}]}, timeout=5.0)
        np.testing.assert_array_equal(got["rows"][0], want)
    finally:
        release.set()
        starting.join(30)
        client.close()
        worker.stop()
        for s in made:
            s.stop()
