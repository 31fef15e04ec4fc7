"""A data-loader process SIGKILLed between the two legs of a batch (the NN rank acknowledged the
dense part, the ID features never left) and restarted in place while the NN rank trains on, as
Kubernetes does with ``restartPolicy: OnFailure``. Real nats-server, real gRPC on loopback, real
torch, real processes and a real signal."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import SGD
from persia.nn_worker.accounting import ACCOUNT
from tests.polling import poll_until

from .cluster import GLOBAL_CONFIG, cluster
from .test_training_path import Model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _loader(*args: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.loader_process", *map(str, args)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))  # PERSIA_DATA_GROUP too


@pytest.mark.parametrize("group", [1, 2])
def test_a_loader_killed_between_its_legs_is_accounted_once_without_a_false_imbalance(persia_env, caplog,
                                                                                      monkeypatch, group):
    """``group`` 2 (the default): batch 3 travels with batch 2, so both lose their ID features."""
    monkeypatch.setenv("PERSIA_DATA_GROUP", str(group))
    lost_ids = [3] if group == 1 else [2, 3]
    caplog.set_level(logging.INFO)
    config = {**GLOBAL_CONFIG, "embedding_worker_config": {**GLOBAL_CONFIG["embedding_worker_config"],
                                                           "lookup_wait_sec": 1}}
    out: dict = {}

    def harm():
        try:
            first = _loader(0, 6, 3)  # batches 0-2 go through; batch 3's ID leg is held in the process
            out["first"] = [first.stdout.readline()]
            while "holding 3" not in out["first"][-1] and out["first"][-1]:
                out["first"].append(first.stdout.readline())
            poll_until(lambda: ACCOUNT.received >= 4, "the NN rank acknowledging batch 3's dense part", deadline_s=60.0)
            first.send_signal(signal.SIGKILL)  # between the legs: the loader never counted batch 3
            out["first_rc"] = first.wait(30)
            # restarted in place: a new process (session) replaying the whole stream; it asks every
            # NN rank what it already has of this loader (nn.position) and skips that
            second = _loader(0, 6)
            out["second"] = second.communicate(timeout=120)[0]
            out["second_rc"] = second.returncode
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    with cluster(global_config=config):
        t = threading.Thread(target=harm, daemon=True)
        t.start()
        model = Model()
        seen = []
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1):
                seen.append(batch.batch_id)
                o, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(o, labels[0]))
        t.join(60)
    assert "error" not in out, out
    assert "holding 3" in out["first"][-1] and out["first_rc"] == -signal.SIGKILL
    assert out["second_rc"] == 0 and "stream ended" in out["second"], out["second"]
    # the first process's batches 0-2 trained and batch 3 lost (with batch 2, in a group); the second
    # process skips those four (the rank acknowledged them) and sends 4 and 5. Before: it replayed
    # all six, 0-3 again
    assert seen == [b for b in range(6) if b not in lost_ids]
    lost = [r.getMessage() for r in caplog.records
            if r.name == "persia.nn_worker.loader" and "lost_id_features" in r.getMessage()]
    assert len(lost) == len(lost_ids) and all("lookup wait" in m for m in lost)
    assert all(any(f"batch {b} of data loader 0" in m for m in lost) for b in lost_ids)
    assert "the NN ranks already have 4 of this loader's batches" in out["second"], out["second"]
    # every batch once: announced 2 (the second process), 4 arrived from the killed one (3 trained,
    # batch 3 failed), nothing unaccounted; before, the summary said "-4 ... NOT accounted for"
    result = ACCOUNT.as_result()
    assert result == {"batches_sent": 2, "batches_unannounced": 4, "batches_trained": 6 - len(lost_ids),
                      "batches_evaluated": 0, "batches_failed": {"lost_id_features": len(lost_ids)}}
    assert ACCOUNT.unaccounted() == 0
    summary = [r for r in caplog.records if r.name == "persia.nn_worker.accounting"]
    assert len(summary) == 1 and summary[0].levelno == logging.INFO, [r.getMessage() for r in summary]
    text = summary[0].getMessage()
    assert "4 from data loader 0 process" in text and "never ended its stream" in text
    assert "every acknowledged batch accounted for" in text
