"""persia.helper: PERSIA's one-``with`` service for tests and notebooks, on local mode's roles.

Real nats-server, real PS and embedding-worker processes, data-loader functions in forked children.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import torch

from persia.ctx import DataCtx, TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia.embedding.optim import Adagrad
from persia.helper import PersiaServiceCtx, ServiceFailed, ensure_persia_service

pytestmark = pytest.mark.integration

EMBEDDING_CONFIG = {"slots_config": {"age": {"dim": 8}}}
BATCHES = 6


def _batch(i: int) -> PersiaBatch:
    rng = np.random.default_rng(i)
    return PersiaBatch(
        [IDTypeFeatureWithSingleID("age", rng.integers(0, 100, size=4, dtype=np.uint64))],
        non_id_type_features=[NonIDTypeFeature(rng.standard_normal((4, 2)).astype(np.float32))],
        labels=[Label(rng.integers(0, 2, size=(4, 1)).astype(np.float32))],
    )


def _data_loader():
    with DataCtx() as ctx:
        for i in range(ctx.replica_index, BATCHES, ctx.replica_size):
            ctx.send_data(_batch(i))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 + 8, 1)

    def forward(self, non_id, emb):
        return torch.sigmoid(self.lin(torch.cat([non_id[0], emb[0]], dim=1)))


def test_service_ctx_runs_a_training_job_in_one_with(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "REPLICA_INDEX", "REPLICA_SIZE"):
        monkeypatch.delenv(var, raising=False)
    before = os.environ.get("PERSIA_NATS_URL")
    model = _Model()
    with ensure_persia_service(data_loader_func=_data_loader, embedding_config=EMBEDDING_CONFIG,
                               data_loader_replica_num=2, embedding_parameter_replica_num=2):
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            trained = 0
            for batch in DataLoader(StreamingDataset(4), timeout_ms=60_000):
                out, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
                trained += 1
            ctx.wait_for_pending_updates()
            assert sum(ctx.get_embedding_size()) > 0
    assert trained == BATCHES
    assert os.environ.get("PERSIA_NATS_URL") == before  # this process's environment is restored


def _crash_as_rank_0():
    ranked = (os.environ.get("RANK"), os.environ.get("LOCAL_RANK"), os.environ.get("WORLD_SIZE")) == ("0", "0", "1")
    raise SystemExit(3 if ranked else 4)  # 3: the NN-worker child got PERSIA's rank variables


def test_a_dead_child_interrupts_the_block_with_its_name():
    blocked = threading.Event()
    with pytest.raises(ServiceFailed, match="nn-worker-0 exited with code 3"):
        with PersiaServiceCtx(data_loader_func=_data_loader, nn_worker_func=_crash_as_rank_0,
                              embedding_config=EMBEDDING_CONFIG):
            blocked.wait(120)  # what a training loop waiting for batches does; the helper wakes it


def test_a_dead_child_interrupts_the_block_whatever_sigint_handler_the_process_has():
    # An earlier test or the user's own code may have replaced SIGINT's handler; the helper's
    # interrupt must still end the block (in the full suite it once waited the whole 120 s).
    blocked, waited = threading.Event(), []
    def quiet(*_):
        pass

    before = signal.signal(signal.SIGINT, quiet)
    try:
        with pytest.raises(ServiceFailed, match="nn-worker-0 exited with code 3"):
            with PersiaServiceCtx(data_loader_func=_data_loader, nn_worker_func=_crash_as_rank_0,
                                  embedding_config=EMBEDDING_CONFIG):
                waited.append(blocked.wait(120))  # never reached when the interrupt works
        assert waited == []
        assert signal.getsignal(signal.SIGINT) is quiet  # the user's handler is back
    finally:
        signal.signal(signal.SIGINT, before)


def test_bad_arguments_fail_before_anything_starts():
    with pytest.raises(AssertionError, match="needs embedding_config"):
        PersiaServiceCtx()
    with pytest.raises(ValueError, match="nproc_per_node must be an integer >= 1, got 0"):
        PersiaServiceCtx(embedding_config=EMBEDDING_CONFIG, nproc_per_node=0)
    with pytest.raises(ValueError, match="slots_config"):
        with PersiaServiceCtx(embedding_config={"slots_config": {"age": {"dimm": 8}}}):
            pass
