"""A small scriptable model trained on the in-process cluster, its checkpoint, and a model server
with an inference PS and embedding worker in this process (real gRPC on loopback, no NATS)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from persia.config import load_embedding_config_from_dict, load_global_config_from_dict
from persia.ctx import TrainCtx, eval_ctx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import Adagrad
from persia.embedding_ps.service import EmbeddingParameterServer
from persia.embedding_worker.service import EmbeddingWorker
from persia.serving import ModelServer, ServeConfig

from tests.integration.cluster import EMBEDDING_CONFIG, GLOBAL_CONFIG
from tests.integration.test_training_path import Eval, make_batch, send_in_thread


class ServedModel(torch.nn.Module):
    """Like the training-path test's model, but batch-size agnostic and scriptable."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 + 4 + 4 + 3 * 4, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.lin(torch.cat([non_id[0], emb[0], emb[1], emb[2].flatten(1)], dim=1)))


def train_batches(model: torch.nn.Module, seeds, lr: float = 0.1) -> None:
    errors: list = []
    sender = send_in_thread([make_batch(s) for s in seeds], errors)
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=lr),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=lr)) as ctx:
        for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, reproducible=True):
            out, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
        ctx.wait_for_pending_updates()
    sender.join(30)
    assert not errors, errors


def evaluate(model: torch.nn.Module, batch) -> np.ndarray:
    """The training job's own prediction of ``batch`` (eval_ctx, model in eval mode)."""
    model.eval()
    with eval_ctx(model=model) as ctx, torch.no_grad():
        outs = [ctx.forward(tb)[0].numpy().copy() for tb in DataLoader(Eval([batch]))]
    model.train()
    return outs[0]


def dump(model: torch.nn.Module, directory: Path) -> None:
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        ctx.dump_checkpoint(str(directory), with_jit_model=True)


@contextmanager
def serving(checkpoint: Path, model: Path, ps_config: dict | None = None, embedding_config: dict | None = None,
            **serve):
    """Inference PS + embedding worker (no NATS) + ModelServer, all on loopback in this process
    (``embedding_config``: the worker's, default the training's ``EMBEDDING_CONFIG``)."""
    gc = load_global_config_from_dict(dict(
        GLOBAL_CONFIG, common_config={"job_type": "Infer", "infer_config": {"embedding_checkpoint": str(checkpoint)}},
        embedding_parameter_server_config=dict(GLOBAL_CONFIG["embedding_parameter_server_config"], **(ps_config or {}))))
    ec = load_embedding_config_from_dict(embedding_config or EMBEDDING_CONFIG)
    ps = EmbeddingParameterServer(gc, 0, 1, port=0, host="127.0.0.1")
    worker = EmbeddingWorker(ec, gc, 0, 1, port=0, host="127.0.0.1", ps_addresses=[ps.address])
    server = None
    try:
        server = ModelServer(ServeConfig(embedding_workers=[worker.address], model=str(model), http_port=0,
                                         grpc_port=0, **serve))
        server.test_ps = ps  # for the tests' look at the inference PS's counters
        yield server
    finally:
        if server is not None:
            server.stop()
        worker.stop()
        ps.stop()
