"""The live summary without processes: binned AUC against sklearn, the NN worker's progress
report, its schema, and the line `persia-launcher local` prints."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import roc_auc_score

from persia.local import _Progress
from persia.messages import Progress, validate
from persia.nn_worker.progress import BINS, TrainingProgress, binned_auc


def test_binned_auc_matches_sklearn_to_the_bin_width():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 5000)
    p = np.clip(0.3 * y + rng.random(5000) * 0.7, 0, 1)
    bins = np.minimum((p * BINS).astype(int), BINS - 1)
    got = binned_auc(np.bincount(bins[y == 1], minlength=BINS).astype(float),
                     np.bincount(bins[y == 0], minlength=BINS).astype(float))
    assert abs(got - roc_auc_score(y, p)) < 2e-3
    assert binned_auc(np.ones(BINS), np.zeros(BINS)) is None


def test_progress_report_carries_loss_auc_and_staleness():
    prog = TrainingProgress(rank=0)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        labels = (torch.rand(64, 1, generator=g) > 0.5).float()
        output = (0.6 * labels + 0.4 * torch.rand(64, 1, generator=g)).clamp(0, 1)
        prog.saw(output, [labels])
        prog.trained(torch.nn.functional.binary_cross_entropy(output, labels))
    msg = prog.report(rank=0, trained=3, staleness=2)
    assert msg["trained"] == 3 and msg["staleness"] == 2
    assert 0 < msg["loss"] < 1 and msg["auc"] > 0.9
    assert validate(Progress, msg) is msg
    # a multi-column output has no AUC, but still a loss
    other = TrainingProgress(rank=1)
    other.saw(torch.rand(8, 3), [torch.ones(8, 3)])
    other.trained(torch.tensor(0.5))
    msg = other.report(rank=1, trained=1, staleness=0)
    assert "auc" not in msg and msg["loss"] == 0.5



def test_progress_scores_each_batch_on_its_own_after_one_transfer():
    """Batches of several sizes; one whose outputs are logits (beyond [0, 1]) and one whose labels
    are not 0/1 are left out of the AUC, the others are binned exactly as one by one."""
    g = torch.Generator().manual_seed(7)
    batches = []
    for n in (5, 64, 17, 30):
        labels = (torch.rand(n, 1, generator=g) > 0.5).float()
        batches.append(((0.5 * labels + 0.5 * torch.rand(n, 1, generator=g)).clamp(0, 1), labels))
    batches.insert(2, (torch.randn(9, 1, generator=g) * 4, torch.ones(9, 1)))  # logits
    batches.insert(4, (torch.rand(6, 1, generator=g), torch.full((6, 1), 0.5)))  # soft labels
    prog = TrainingProgress(rank=0)
    for output, labels in batches:
        prog.saw(output, [labels])
    prog.report(rank=0, trained=len(batches), staleness=1)
    pos, neg = np.zeros(BINS), np.zeros(BINS)
    for i, (output, labels) in enumerate(batches):
        if i in (2, 4):
            continue
        o, y = output.reshape(-1).numpy(), labels.reshape(-1).numpy()
        b = np.minimum((o * BINS).astype(np.int64), BINS - 1)
        pos += np.bincount(b[y == 1], minlength=BINS)
        neg += np.bincount(b[y == 0], minlength=BINS)
    assert np.array_equal(prog.pos, pos) and np.array_equal(prog.neg, neg)
    assert prog.pos.sum() + prog.neg.sum() == 5 + 64 + 17 + 30

def test_summary_line():
    line = _Progress.summary({0: {"rank": 0, "trained": 100, "loss": 0.4, "auc": 0.8, "staleness": 3},
                              1: {"rank": 1, "trained": 50, "loss": 0.2, "auc": 0.9, "staleness": 7}}, 12.34)
    assert line == "trained 150 batches (12.3 batch/s), loss 0.3000, AUC so far 0.8500, staleness 7"
    assert _Progress.summary({0: {"rank": 0, "trained": 5}}, 1.0) == "trained 5 batches (1.0 batch/s)"
