"""Two NN ranks (real processes, gloo over loopback) that each train in two TrainCtx one after the
other, against real PS and embedding-worker servers and a real nats-server. Before, the second
context hung for good: rank 0's first context still answered ``nn.master`` with the first store's
port, so rank 1 joined the old store while rank 0 waited on a new one. Now the second context
reuses the group the first one joined, or, if the script destroyed it, joins the ranks afresh
through the second context's answer only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .cluster import cluster

pytestmark = pytest.mark.integration

_RANK_SCRIPT = r"""
import json
import sys
import weakref
import torch
from persia.ctx import TrainCtx
from persia.embedding.optim import Adagrad

grads, wrappers = [], []
for round_ in range(2):
    torch.manual_seed(round_)
    model = torch.nn.Linear(3, 1)
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        torch.manual_seed(100 + 10 * round_ + ctx.rank)  # each rank its own input
        ctx.model(torch.randn(4, 3)).sum().backward()  # DDP averages the gradients over the ranks
        grads.append(model.weight.grad.flatten().tolist())
        ddp = weakref.ref(ctx.model)
    # ``ctx`` is still held here: its DDP wrapper must be gone before the group may be destroyed
    wrappers.append({"freed": ddp() is None, "model_is_users": ctx.model is model})
    if sys.argv[1] == "destroy":
        torch.distributed.destroy_process_group()
print("RESULT " + json.dumps({"grads": grads, "wrappers": wrappers}), flush=True)
"""


def _own_gradient(round_: int, rank: int) -> list[float]:
    """What rank ``rank``'s gradient would be alone (the script's model and input, no DDP)."""
    import torch

    torch.manual_seed(round_)
    model = torch.nn.Linear(3, 1)
    torch.manual_seed(100 + 10 * round_ + rank)
    model(torch.randn(4, 3)).sum().backward()
    return model.weight.grad.flatten().tolist()


@pytest.mark.parametrize("between", ["keep", "destroy"])
def test_two_ranks_train_in_two_contexts_one_after_the_other(persia_env, tmp_path, between):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    env = dict(os.environ, WORLD_SIZE="2", PERSIA_BIND_ADDRESS="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1", PERSIA_TORCH_THREADS="1")
    with cluster():
        procs = [subprocess.Popen([sys.executable, str(script), between], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        try:
            outs = [p.communicate(timeout=60)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError("a rank hung:\n" + "\n".join(p.communicate()[0][-3000:] for p in procs)) from None
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    results = [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]) for out in outs]
    for result in results:  # each context let go of its DDP wrapper at its exit, with ``ctx`` still held
        assert result["wrappers"] == [{"freed": True, "model_is_users": True}] * 2
    results = [r["grads"] for r in results]
    assert results[0] == results[1]  # both ranks hold the same, averaged, gradient in both contexts
    for round_, grad in enumerate(results[0]):
        mean = [(a + b) / 2 for a, b in zip(_own_gradient(round_, 0), _own_gradient(round_, 1))]
        assert grad == pytest.approx(mean, rel=1e-5), round_
