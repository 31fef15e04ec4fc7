"""Inference without NATS: an Infer-mode PS loads a checkpoint at start, an Infer-mode embedding
worker talks to it by address, InferCtx talks to the worker by address (PERSIA's serving path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia.config import load_embedding_config_from_dict, load_global_config_from_dict
from persia.ctx import InferCtx, TrainCtx
from persia.embedding.optim import Adagrad
from persia.embedding_ps.service import EmbeddingParameterServer
from persia.embedding_worker.service import EmbeddingWorker

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
    finally:
        worker.stop()
        for s in servers:
            s.stop()
