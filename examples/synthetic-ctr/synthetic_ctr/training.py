"""Pieces every trainer of this benchmark shares (our PERSIA example and the bench baselines), so
the systems differ only in how embeddings are stored, looked up and updated."""

from __future__ import annotations

import math
import resource

import numpy as np
import torch

from synthetic_ctr.metrics import binary_log_loss, rank_auc
from synthetic_ctr.settings import DenseOptimizer

DEFAULT_DENSE_OPTIMIZER: DenseOptimizer = "adam"
DEFAULT_DENSE_LR = {"adam": 1e-3, "sgd": 0.1}
EMBEDDING_LR = 1e-2  # PERSIA's Adagrad default, as in its adult-income example
EMBEDDING_INIT = (-0.01, 0.01)  # PERSIA's EmbeddingConfig default (BoundedUniform)
EMBEDDING_WEIGHT_BOUND = 10.0  # PERSIA's EmbeddingConfig default


def make_dense_optimizer(
    params, name: DenseOptimizer = DEFAULT_DENSE_OPTIMIZER, lr: float | None = None, fused: bool = False
) -> torch.optim.Optimizer:
    """``fused``: torch's fused kernel (same formula, one pass over all parameters)."""
    lr = DEFAULT_DENSE_LR[name] if lr is None else lr
    extra = {"fused": True} if fused else {}
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **extra)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, **extra)
    raise ValueError(f"dense_optimizer must be 'adam' or 'sgd', got dense_optimizer={name!r}")


def eval_schedule(total_batches: int, points: int) -> list[int]:
    """Batch counts after which to evaluate: ``points`` evenly spaced, the last one at the end."""
    if total_batches < 1 or points < 1:
        return []
    marks = sorted({max(1, math.ceil(total_batches * k / points)) for k in range(1, points + 1)})
    return marks


def auc_and_logloss(labels: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Test AUC (NaN with one class only) and log loss, probabilities clipped to [1e-7, 1 - 1e-7]."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.clip(np.asarray(probs, dtype=np.float64).reshape(-1), 1e-7, 1 - 1e-7)
    return rank_auc(y, p), binary_log_loss(y, p)


def peak_rss_mb() -> float:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def gpu_memory_mb(device: torch.device) -> dict[str, float] | None:
    """Peak GPU memory torch allocated and reserved on ``device``, MB; None on the CPU."""
    if device.type != "cuda":
        return None
    mb = 1024 * 1024
    return {"allocated": torch.cuda.max_memory_allocated(device) / mb,
            "reserved": torch.cuda.max_memory_reserved(device) / mb}


def set_threads(threads: int | None) -> int:
    """Pin torch's intra-op threads (one per core share: on 2 cores two processes with 2 threads
    each ran at less than half the speed of 1 thread each). Returns the count in effect."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
