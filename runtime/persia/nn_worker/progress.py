"""What an NN worker says about its training while it runs: loss, AUC so far, embedding staleness.

Published in every ``nn.progress`` event (``persia-launcher local`` prints them as its live line)
and exported as gauges (``persia_nn_loss``, ``persia_nn_auc``, ``persia_nn_embedding_staleness``;
docs/metrics.md). Outputs and losses are kept as tensors until a report is due, so a GPU trainer
synchronises once per report, not once per batch.
"""

from __future__ import annotations

import numpy as np
import torch

from persia.metrics import Metrics, start_exporter

BINS = 1000
_MAX_KEPT = 512  # batches kept between two reports (reports come every 0.5 s)


def binned_auc(pos: np.ndarray, neg: np.ndarray) -> float | None:
    """Pure: ROC AUC from per-score-bin counts of positives and negatives (ties within a bin count
    half). None until both classes were seen."""
    p, n = float(pos.sum()), float(neg.sum())
    if p == 0 or n == 0:
        return None
    neg_below = np.cumsum(neg) - neg
    return float((pos * (neg_below + 0.5 * neg)).sum() / (p * n))


class TrainingProgress:
    def __init__(self, rank: int):
        self.pos = np.zeros(BINS)
        self.neg = np.zeros(BINS)
        self.loss: float | None = None
        self._losses: list[torch.Tensor] = []
        self._outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._metrics = Metrics("nn_worker", rank)
        start_exporter()  # /metrics when PERSIA_METRICS_PORT is set (per local rank: docs/metrics.md)

    def saw(self, output: torch.Tensor, labels) -> None:
        """A training forward's output and labels; only a one-column probability output against a
        0/1 label of the same size is scored (anything else just has no AUC)."""
        if not labels or len(self._outputs) >= _MAX_KEPT or not isinstance(output, torch.Tensor):
            return
        label = labels[0]
        if output.numel() != label.numel() or output.dim() > 2 or (output.dim() == 2 and output.shape[1] != 1):
            return
        self._outputs.append((output.detach(), label.detach()))

    def trained(self, loss: torch.Tensor) -> None:
        if len(self._losses) < _MAX_KEPT:
            self._losses.append(loss.detach())

    def report(self, rank: int, trained: int, staleness: int) -> dict:
        """The ``nn.progress`` message; folds what was kept since the last report."""
        if self._losses:
            self.loss = float(torch.stack([x.float().reshape(()) for x in self._losses]).mean())
            self._losses.clear()
        for o, y in _on_host(self._outputs):
            if o.size == 0 or o.min() < 0 or o.max() > 1 or not np.isin(y, (0.0, 1.0)).all():
                continue
            bins = np.minimum((o * BINS).astype(np.int64), BINS - 1)
            self.pos += np.bincount(bins[y == 1], minlength=BINS)
            self.neg += np.bincount(bins[y == 0], minlength=BINS)
        self._outputs.clear()
        auc = binned_auc(self.pos, self.neg)
        msg = {"rank": rank, "trained": trained, "staleness": staleness}
        if self.loss is not None and np.isfinite(self.loss):
            msg["loss"] = self.loss
            self._metrics.set("nn_loss", self.loss)
        if auc is not None:
            msg["auc"] = auc
            self._metrics.set("nn_auc", auc)
        self._metrics.set("nn_embedding_staleness", staleness)
        return msg


def _on_host(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each kept (output, label) pair as flat float32 arrays, copied from the device in one
    transfer per device and kind rather than two per batch (each a wait on a GPU)."""
    if not pairs:
        return []
    outs = [o.float().reshape(-1) for o, _ in pairs]
    labels = [y.float().reshape(-1) for _, y in pairs]
    if len({t.device for t in outs + labels}) > 1:
        return [(o.cpu().numpy(), y.cpu().numpy()) for o, y in zip(outs, labels)]
    cuts = np.cumsum([t.numel() for t in outs])[:-1]
    return list(zip(np.split(torch.cat(outs).cpu().numpy(), cuts), np.split(torch.cat(labels).cpu().numpy(), cuts)))
