"""Online NN worker of the tiny job: trains on an endless stream and every ONLINE_CKPT_EVERY steps
publishes ``$ONLINE_CKPT_DIR/ckpt-<step>/`` (dense + jit model + embeddings, COMPLETE marker,
renamed into place) for the model server; stops after ONLINE_MAX_BATCHES (a bounded test run)."""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from persia.ctx import TrainCtx  # noqa: E402
from persia.data import DataLoader, StreamingDataset  # noqa: E402
from persia.embedding.optim import Adagrad  # noqa: E402
from persia.env import get_rank  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 + 4 + 4 + 3, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.lin(torch.cat([non_id[0], emb[0], emb[1], emb[2]], dim=1)))


def publish(ctx, root: Path, step: int) -> None:
    tmp = root / f".tmp-ckpt-{step:012d}"
    ctx.dump_checkpoint(str(tmp), with_jit_model=True)
    (tmp / "COMPLETE").write_text(json.dumps({"format": "online-example/1", "step": step, "time": time.time()}))
    tmp.rename(root / f"ckpt-{step:012d}")


root = Path(os.environ["ONLINE_CKPT_DIR"])
root.mkdir(parents=True, exist_ok=True)
every, limit = int(os.environ.get("ONLINE_CKPT_EVERY", "20")), int(os.environ.get("ONLINE_MAX_BATCHES", "200"))
torch.manual_seed(0)
model = Model()
with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
              dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
    for step, batch in enumerate(DataLoader(StreamingDataset(4), embedding_staleness=2), start=1):
        out, labels = ctx.forward(batch)
        ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
        if step % every == 0 and (get_rank() or 0) == 0:
            publish(ctx, root, step)
        if step >= limit:
            break
    print(f"online trainer: stopped after {step} batches", flush=True)
