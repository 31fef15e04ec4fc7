"""Single-process PyTorch baseline, the best a torch user would write: one fused ``nn.EmbeddingBag``
over all 26 slots (slot ``s`` owns rows ``[offset_s, offset_s + V_s]``, IDs mapped to rows through
the training vocabulary once, before training), the shared dense tower, the epoch in memory as
tensors. Embeddings: the embedding PS's sparse Adagrad (torch's formula plus the PS's weight clip,
the AUC reference), or with ``fused`` torch's own ``Adagrad`` on the sparse gradient and
``Adam(fused=True)`` for the dense part.

Run: ``python -m bench.torch_baseline --spec '{"system": "torch", "data_dir": ...}'``; prints one
``PERSIA_RESULT {json}`` line (the same contract as our system's trainer).
"""

from __future__ import annotations

import argparse
import sys
import warnings

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
from synthetic_ctr.schema import NUM_SLOTS
from synthetic_ctr.training import (
    EMBEDDING_INIT,
    EMBEDDING_WEIGHT_BOUND,
    gpu_memory_mb,
    make_dense_optimizer,
)


class SparseAdagrad(torch.optim.Optimizer):
    """The embedding PS's Adagrad on sparse row gradients, which is ``torch.optim.Adagrad``'s
    (``persia.embedding_ps.optimizers``): ``s += g**2`` first, then ``w -= lr * g / (sqrt(s) + eps)``
    with ``s`` starting at ``initial_accumulator_value``, then clip ``w`` to ``[-bound, bound]``
    (the PS's ``weight_bound``). Same numbers as ``torch.optim.Adagrad`` on a sparse gradient (the
    tests check it) but only the touched rows are read and written, and it adds the clip; PERSIA's
    own formula (old accumulator inside the square root) is *not* what our PS does, so it is not
    what the baseline does either."""

    def __init__(self, params, lr=1e-2, initial_accumulator_value=1e-2, eps=1e-10, weight_bound=EMBEDDING_WEIGHT_BOUND):
        super().__init__(params, dict(lr=lr, initial_accumulator_value=initial_accumulator_value, eps=eps, weight_bound=weight_bound))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"] = torch.full_like(p, group["initial_accumulator_value"], memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if not grad.is_sparse:
                    raise ValueError("SparseAdagrad expects sparse gradients (EmbeddingBag(sparse=True))")
                grad = grad.coalesce()
                rows, values = grad.indices()[0], grad.values()
                acc = self.state[p]["sum"]
                new_acc = acc.index_select(0, rows).addcmul_(values, values)
                new_w = p.index_select(0, rows).addcdiv_(values, new_acc.sqrt().add_(group["eps"]), value=-group["lr"])
                if group["weight_bound"] > 0:
                    new_w.clamp_(-group["weight_bound"], group["weight_bound"])
                p.index_copy_(0, rows, new_w)
                acc.index_copy_(0, rows, new_acc)
        return None


class FusedEmbeddingModel(nn.Module):
    def __init__(self, num_rows: int, hidden: tuple[int, ...], oov_rows: np.ndarray):
        super().__init__()
        self.embedding = nn.EmbeddingBag(num_rows, EMBEDDING_DIM, mode="sum", sparse=True)
        with torch.no_grad():
            self.embedding.weight.uniform_(*EMBEDDING_INIT)
            self.embedding.weight[torch.from_numpy(oov_rows)] = 0.0  # unseen IDs look up zeros, as in PERSIA
        self.tower = CTRTower(hidden)

    def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        bs = rows.shape[0]
        flat = rows.reshape(-1)
        offsets = torch.arange(0, flat.numel(), dtype=torch.int64, device=flat.device)  # one ID per (sample, slot) bag
        pooled = self.embedding(flat, offsets).reshape(bs, NUM_SLOTS * EMBEDDING_DIM)
        return self.tower.forward_flat(dense, pooled)


def embedding_optimizer(weight: torch.Tensor, lr: float, fused: bool) -> torch.optim.Optimizer:
    """The PS's formula (the AUC reference), or torch's own sparse Adagrad: the same formula
    without the weight clip at +-10 (which these weights never reach)."""
    if not fused:
        return SparseAdagrad([weight], lr=lr)
    return torch.optim.Adagrad([weight], lr=lr, initial_accumulator_value=1e-2, eps=1e-10)


class TorchBaseline:
    def __init__(self, spec: RunSpec):
        if spec.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("device='cuda' but torch sees no CUDA device")
        self.device = torch.device(spec.device)
        self.index = VocabIndex(load_vocab(spec.data_dir))
        self.model = FusedEmbeddingModel(self.index.num_rows, parse_hidden(spec.mlp), self.index.oov_rows).to(self.device)
        self.sparse_opt = embedding_optimizer(self.model.embedding.weight, spec.embedding_lr, spec.fused)
        self.dense_opt = make_dense_optimizer(self.model.tower.parameters(), spec.dense_optimizer, spec.dense_lr, fused=spec.fused)

    def _tensors(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.from_numpy(batch.dense).to(self.device),
                torch.from_numpy(self.index.rows(batch.ids)).to(self.device))

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The epoch in the device's memory before the clock starts."""
        return (*self._tensors(batch), torch.from_numpy(batch.label).to(self.device))

    def train_step(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
        dense, rows, label = inputs
        prob = self.model(dense, rows)
        loss = F.binary_cross_entropy(prob, label)
        self.sparse_opt.zero_grad(set_to_none=True)
        self.dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.sparse_opt.step()
        self.dense_opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        dense, rows = self._tensors(batch)
        return self.model(dense, rows).cpu().numpy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", required=True, help="RunSpec as JSON")
    spec = RunSpec.model_validate_json(p.parse_args(argv).spec)
    if spec.fused:
        warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch's Adagrad, every step
        optimizer = "torch.optim.Adagrad (sparse) + Adam(fused=True)"
    else:
        optimizer = "SparseAdagrad (torch.optim.Adagrad formula + weight clip, as the PS)"
    result = run_training(spec, TorchBaseline, extra={"embedding_optimizer": optimizer, "device": spec.device})
    result["gpu_memory_mb"] = gpu_memory_mb(torch.device(spec.device))
    print(format_result_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
