"""Silent corruption that must not happen: a failed send reusing its batch id, non-finite steps
applied to the model. Real NATS, real gRPC servers on loopback, real torch."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from persia.ctx import DataCtx, TrainCtx
from persia.data_loader import stream as loader_stream
from persia.data_loader.stream import end_of_stream
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import SGD
from persia.nn_worker.accounting import ACCOUNT
from persia.nn_worker.train_ctx import NonFiniteModel
from tests.integration.cluster import GLOBAL_CONFIG, cluster
from tests.integration.test_training_path import Model, make_batch, send_in_thread

pytestmark = pytest.mark.integration


def train_all(model, batches, lr=0.1):
    errors: list = []
    sender = send_in_thread(batches, errors)
    seen = []
    with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=lr)) as ctx:
        for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, reproducible=True):
            seen.append(batch.batch_id)
            out, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.mse_loss(out, labels[0]))  # NaN in, NaN loss out
    sender.join(60)
    return seen, errors


def train_through_failed_sends(batches, lookup_wait_sec: float = 120.0, **train_ctx):
    """Train ``batches`` sent by one data loader (a thread that goes on after a failed send);
    ``train_ctx``: more TrainCtx arguments (checkpoints)."""
    config = {**GLOBAL_CONFIG, "embedding_worker_config": {**GLOBAL_CONFIG["embedding_worker_config"],
                                                           "lookup_wait_sec": lookup_wait_sec}}
    errors, seen = [], []
    with cluster(global_config=config) as servers:
        loader_stream.reset()

        def loader():
            with DataCtx() as ctx:
                for b in batches:
                    try:
                        ctx.send_data(b)
                    except Exception as exc:  # noqa: BLE001
                        errors.append(exc)
            end_of_stream()

        t = threading.Thread(target=loader, daemon=True)
        t.start()
        model = Model()
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **train_ctx) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, reproducible=True):
                seen.append(batch.batch_id)
                out, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
        t.join(60)
        worker = servers[-1]
        return seen, errors, worker


def test_a_batch_whose_dense_leg_fails_spends_its_id(persia_env):
    batches = [make_batch(i) for i in range(4)]
    batches[1].meta = b"x" * (65 * 1024 * 1024)  # over NATS max_payload: the dense leg fails
    seen, errors, worker = train_through_failed_sends(batches)
    assert len(errors) == 1 and "max_payload" in str(errors[0])
    # batch 1's id is not handed to batch 2 (which the worker would answer with batch 1's features)
    assert seen == [0, 2, 3]
    assert len(worker.forward_buffer) == 0  # the failed batch's ID features were handed back
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 3 and result["batches_trained"] == 3
    assert result["batches_failed"] == {"loader_send_dense": 1}


def test_non_finite_steps_are_skipped_and_counted(persia_env):
    batches = [make_batch(i) for i in range(6)]
    for i in (1, 4):
        batches[i].non_id_type_features[0].data[0, 0] = np.nan
    torch.manual_seed(0)
    model = Model()
    with cluster():
        seen, errors = train_all(model, batches)
    assert not errors and len(seen) == 6
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    result = ACCOUNT.as_result()
    assert result["batches_trained"] == 4
    assert result["batches_failed"] == {"non_finite_loss": 2}
    assert ACCOUNT.unaccounted() == 0


def test_a_diverging_model_fails_loudly(persia_env):
    model = Model()
    with cluster(), pytest.raises(NonFiniteModel, match="dense parameter '.*' became non-finite"):
        train_all(model, [make_batch(i) for i in range(25)], lr=float("inf"))
