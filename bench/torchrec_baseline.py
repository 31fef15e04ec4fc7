"""TorchRec-on-CPU peer baseline: the same model with an ``EmbeddingBagCollection`` (one table per
slot) wrapped in ``DistributedModelParallel`` on a world of one (gloo), which is TorchRec's
production path: the tables become one fbgemm ``SplitTableBatchedEmbeddingBagsCodegen`` (CPU TBE)
with the Adagrad update fused into the backward pass.

Adagrad semantics: fbgemm's EXACT_ADAGRAD starts its accumulator at 0 and divides by
``sqrt(s_new) + eps``; PERSIA starts at 1e-2 and divides by ``sqrt(s_old + 1e-10)``. With
``eps = 0.1`` = sqrt(1e-2) both give ``lr * g / 0.1`` on a row's first small gradient and agree
asymptotically; that is the closest fbgemm allows.

Needs ``torchrec==1.8.0`` and ``fbgemm-gpu-cpu==1.8.0`` (see docs/benchmarks.md); if they do not
import, the run prints a PERSIA_RESULT with ``skipped`` set to the reason and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench import _paths  # noqa: F401
from bench.spec import RunSpec
from bench.trainloop import run_training
from synthetic_ctr.model import EMBEDDING_DIM, CTRTower, parse_hidden
from synthetic_ctr.reader import Batch, VocabIndex, load_vocab
from synthetic_ctr.results import format_result_line
from synthetic_ctr.schema import NUM_SLOTS, SLOT_NAMES
from synthetic_ctr.training import EMBEDDING_INIT, make_dense_optimizer

FBGEMM_ADAGRAD_EPS = 0.1


def torchrec_import_error() -> str | None:
    """None if TorchRec and fbgemm load with this torch, else why not (one line)."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
        from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "skip, with the reason"
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def _init_rows(oov_row: int):
    def init(weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            weight.uniform_(*EMBEDDING_INIT)
            weight[oov_row].zero_()  # unseen IDs look up zeros, as in PERSIA
        return weight

    return init


class _Model(nn.Module):
    def __init__(self, ebc: nn.Module, hidden: tuple[int, ...]):
        super().__init__()
        self.ebc = ebc
        self.tower = CTRTower(hidden)

    def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
        return self.tower.forward_flat(dense, self.ebc(kjt).values())


class TorchRecBaseline:
    def __init__(self, spec: RunSpec):
        import torch.distributed as dist
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.index = VocabIndex(load_vocab(spec.data_dir))
        tables = [
            EmbeddingBagConfig(
                name=f"table_{name}",
                embedding_dim=EMBEDDING_DIM,
                num_embeddings=int(self.index.slot_rows[s]),
                feature_names=[name],
                init_fn=_init_rows(int(self.index.slot_rows[s]) - 1),
            )
            for s, name in enumerate(SLOT_NAMES)
        ]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        apply_optimizer_in_backward(
            torch.optim.Adagrad, ebc.parameters(), {"lr": spec.embedding_lr, "eps": FBGEMM_ADAGRAD_EPS}
        )
        model = _Model(ebc, parse_hidden(spec.mlp))
        self.model = DistributedModelParallel(model, device=torch.device("cpu"))
        dense_params = [p for n, p in self.model.named_parameters() if ".ebc." not in f".{n}"]
        self.dense_opt = make_dense_optimizer(dense_params, spec.dense_optimizer, spec.dense_lr)
        self._keys = list(SLOT_NAMES)

    def _inputs(self, batch: Batch):
        from torchrec import KeyedJaggedTensor

        bs = batch.ids.shape[0]
        rows = self.index.local_rows(batch.ids)  # (bs, 26) per-table rows
        values = torch.from_numpy(np.ascontiguousarray(rows.T).reshape(-1))  # slot-major, as KJT wants
        lengths = torch.ones(NUM_SLOTS * bs, dtype=torch.int32)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=self._keys, values=values, lengths=lengths)
        return torch.from_numpy(batch.dense), kjt

    def prepare(self, batch: Batch):
        return (*self._inputs(batch), torch.from_numpy(batch.label))

    def train_step(self, inputs) -> float:
        dense, kjt, label = inputs
        loss = F.binary_cross_entropy(self.model(dense, kjt), label)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()  # the embedding Adagrad step runs fused inside backward
        self.dense_opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        dense, kjt = self._inputs(batch)
        return self.model(dense, kjt).numpy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", required=True, help="RunSpec as JSON")
    spec = RunSpec.model_validate_json(p.parse_args(argv).spec)
    reason = torchrec_import_error()
    if reason is not None:
        print(format_result_line({"system": spec.system, "label": spec.label, "skipped": f"torchrec not importable: {reason}"}))
        return 0
    try:
        result = run_training(
            spec,
            TorchRecBaseline,
            extra={"embedding_optimizer": f"fbgemm EXACT_ADAGRAD fused (eps={FBGEMM_ADAGRAD_EPS})"},
        )
    except Exception as e:  # noqa: BLE001 - report why TorchRec cannot run here instead of a bare crash
        traceback.print_exc()
        print(format_result_line({"system": spec.system, "label": spec.label, "skipped": f"torchrec failed: {type(e).__name__}: {e}".splitlines()[0]}))
        return 1
    print(format_result_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
