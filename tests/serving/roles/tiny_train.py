"""NN worker of the metrics test's tiny job: trains, evaluates one batch, then (every role still
up) reads every local metrics port and writes what it got to $METRICS_OUT."""

import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from tiny_data import make_batch  # noqa: E402

from persia.ctx import TrainCtx, eval_ctx  # noqa: E402
from persia.data import DataLoader, StreamingDataset  # noqa: E402
from persia.embedding.optim import Adagrad  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 + 4 + 4 + 3, 1)

    def forward(self, non_id, emb):
        return torch.sigmoid(self.lin(torch.cat([non_id[0], *emb], dim=1)))


model = Model()
with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
              dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
    for batch in DataLoader(StreamingDataset(4), embedding_staleness=2):
        out, labels = ctx.forward(batch)
        ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
    ctx.wait_for_pending_updates()
    with eval_ctx(model=model) as ectx:
        ectx.forward(ectx.get_embedding_from_data(make_batch(999, requires_grad=False)))
    base = int(os.environ["PERSIA_METRICS_PORT"])
    scraped = {}
    for port in range(base, base + 4):  # PS, embedding worker, this NN rank, data loader (none)
        try:
            scraped[port] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError as exc:
            scraped[port] = f"# unreachable: {exc}"
    with open(os.environ["METRICS_OUT"], "w") as f:
        json.dump(scraped, f)
