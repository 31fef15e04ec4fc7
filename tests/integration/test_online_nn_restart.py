"""An NN rank of an online job SIGKILLed and started again alone while its data loader streams on
(the operator's online mode: the NN worker is a Deployment, its pod restarts; the loader and the
servers run on). Real nats-server, real gRPC on loopback, real torch, real processes, SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .cluster import cluster

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

TRAINER = """import os, signal, sys, torch
from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import SGD
from tests.integration.test_training_path import Model
torch.manual_seed(0)
model = Model()
kill_at = int(os.environ.get("KILL_AT", "0"))
with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1), dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
              checkpoint_dir=sys.argv[1], checkpoint_interval_steps=100) as ctx:
    print("start", ctx.step, flush=True)
    for batch in DataLoader(StreamingDataset(4), embedding_staleness=1):
        o, labels = ctx.forward(batch)
        ctx.backward(torch.nn.functional.binary_cross_entropy(o, labels[0]))
        print("step", ctx.step, "batch", batch.batch_id, flush=True)
        if ctx.step == kill_at:  # SIGKILLed between two steps, 30 steps after its last checkpoint
            os.kill(os.getpid(), signal.SIGKILL)
print("final", ctx.step, flush=True)
"""


def _start(argv: list[str], log: Path, **env: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
                                         **env))


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_an_nn_rank_restarted_alone_makes_its_streaming_loader_resend_from_the_checkpoint(persia_env, tmp_path):
    """The rank trains to step 130 (checkpoint at 100) and is SIGKILLed; a new process resumes
    ckpt-100 while the data loader, which never stopped, goes on with its 131st batch. Before, the
    new rank took it: the 30 batches trained after the checkpoint (undone by the resume) and those
    the dead process had acknowledged were lost without a word, the next checkpoints recorded
    positions that were no prefix of what was trained, and when the stream ended the rank waited
    for batches that would never come. Now the rank refuses that process's batches, the loader
    stops (TrainerRestarted) without ending its stream, and, started again as its Deployment would,
    resends from the rank's position: every batch is trained once in the model that goes on."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    ckpt = tmp_path / "ckpt"
    n = 300
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "dl1", "dl2")}
    procs: list[subprocess.Popen] = []
    try:
        with cluster():
            a = _start([str(script), str(ckpt)], logs["a"], KILL_AT="130")
            loader = _start(["-m", "tests.integration.loader_process", "0", str(n)], logs["dl1"])
            procs += [a, loader]
            assert a.wait(120) == -signal.SIGKILL, logs["a"].read_text()[-3000:]
            b = _start([str(script), str(ckpt)], logs["b"])
            procs.append(b)
            # the loader that streamed on past the restart is refused and stops, its stream not ended
            loader.wait(120)
            dl1 = logs["dl1"].read_text(errors="replace")
            assert loader.returncode != 0 and "TrainerRestarted" in dl1, dl1[-3000:]
            assert "stream ended" not in dl1
            # restarted in place: it asks NN rank 0 where it is and resends from ckpt-100's position
            again = _start(["-m", "tests.integration.loader_process", "0", str(n)], logs["dl2"])
            procs.append(again)
            assert again.wait(180) == 0, logs["dl2"].read_text()[-3000:]
            assert b.wait(180) == 0, logs["b"].read_text()[-5000:]
    finally:
        _stop(*procs)
    b_out = logs["b"].read_text(errors="replace")
    assert re.search(r"resumed from .*ckpt-000000000100", b_out), b_out[-3000:]
    # every batch after the checkpoint's 100 trained once, in order of the stream: 100 .. n-1
    assert [int(x) for x in re.findall(r"^step \d+ batch (\d+)", b_out, re.M)] == list(range(100, n)), b_out[-3000:]
    assert re.findall(r"^final (\d+)", b_out, re.M) == [str(n)]
    assert "refusing that process's batches" in b_out
    assert "every acknowledged batch accounted for" in b_out, b_out[-3000:]
