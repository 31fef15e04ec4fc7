"""The NN ranks of an online job rescaled while a data loader streams on (the operator's online
mode scales the NN worker Deployment in place; the loader Deployment is not restarted, so its
DataCtx still counts the old number of ranks). Real nats-server, gRPC on loopback, torch with two
DDP ranks (gloo) under the real ``persia-launcher nn-worker``, real processes, SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .cluster import cluster

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

TRAINER = """import os, signal, torch
from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import SGD
from persia.env import get_rank
from tests.integration.test_training_path import Model
torch.manual_seed(0)
model = Model()
kill_at = int(os.environ.get("KILL_AT", "0"))
rank = get_rank() or 0
out = open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}-{os.getpid()}.txt"), "w")
with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1), dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
              checkpoint_dir=os.environ["CKPT_DIR"], checkpoint_interval_steps=100) as ctx:
    for batch in DataLoader(StreamingDataset(4), embedding_staleness=1):
        o, labels = ctx.forward(batch)
        ctx.backward(torch.nn.functional.binary_cross_entropy(o, labels[0]))
        print(rank, ctx.step, batch.batch_id, file=out, flush=True)
        if ctx.step == kill_at:  # right after ckpt-100
            os.kill(os.getpid(), signal.SIGKILL)
print(rank, "final", ctx.step, file=out, flush=True)
"""


def _start(argv: list[str], log: Path, **env: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                    filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])), **env))


def test_a_loader_that_counts_the_ranks_of_before_a_rescale_is_refused_and_resends_to_the_new_ranks(
        persia_env, tmp_path):
    """One NN rank trains to step 100 (ckpt-100) and is SIGKILLed; two ranks start in its place and
    resume ckpt-100 (positions mapped onto two ranks). The loader, started for one rank, streams on
    and sends every batch to rank 0. Before, rank 0 trained them (odd batch ids, which are rank 1's)
    while rank 1 got nothing and the two DDP ranks waited on each other until the loop timed out.
    Now rank 0 refuses the process, the loader stops (TrainerRestarted), and restarted it finds two
    ranks and sends each its share of what ckpt-100 has not trained."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    n = 300
    runs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for d in runs.values():
        d.mkdir()
    env = {"CKPT_DIR": str(tmp_path / "ckpt"), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "dl1", "dl2")}
    procs: list[subprocess.Popen] = []
    try:
        with cluster():
            a = _start([str(script)], logs["a"], KILL_AT="100", OUT_DIR=str(runs["a"]), **env)
            # batches go in pairs (2k, 2k+1), never alone after a hold, so its first message to the new
            # rank 0 holds a batch of rank 1 and is refused whole (a lone even batch is rank 0's under
            # either count: it would be taken before the next, odd, one is refused)
            loader = _start(["-m", "tests.integration.loader_process", "0", str(n)], logs["dl1"],
                            PERSIA_DATA_GROUP="2", PERSIA_DATA_GROUP_HOLD_MS="60000")
            procs += [a, loader]
            assert a.wait(120) == -signal.SIGKILL, logs["a"].read_text()[-3000:]
            b = _start(["-m", "persia.launcher", "nn-worker", str(script), "--nproc-per-node", "2"], logs["b"],
                       OUT_DIR=str(runs["b"]), **env)
            procs.append(b)
            loader.wait(180)
            dl1 = logs["dl1"].read_text(errors="replace")
            assert loader.returncode != 0 and "TrainerRestarted" in dl1 and "another number of NN ranks" in dl1, \
                dl1[-3000:] + logs["b"].read_text(errors="replace")[-3000:]
            again = _start(["-m", "tests.integration.loader_process", "0", str(n)], logs["dl2"])
            procs.append(again)
            assert again.wait(180) == 0, logs["dl2"].read_text()[-3000:]
            assert b.wait(180) == 0, logs["b"].read_text()[-5000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = logs["b"].read_text(errors="replace")
    lines = {int(p.name[4]): p.read_text().split("\n") for p in runs["b"].glob("rank*.txt")}
    trained = {r: [int(line.split()[2]) for line in lines.get(r, []) if line and "final" not in line] for r in (0, 1)}
    # every batch after ckpt-100 once, each on the rank of two it belongs to
    assert trained[0] == list(range(100, n, 2)) and trained[1] == list(range(101, n, 2)), (trained, out[-3000:])
    assert [line for r in (0, 1) for line in lines[r] if "final" in line] == ["0 final 200", "1 final 200"]
    assert "the loader sends to another number of NN ranks" in out
