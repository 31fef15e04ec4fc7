"""Test-set metrics in numpy: the NN worker and the baselines evaluate several times per run, and
importing scikit-learn for them cost each process about 2 s of CPU (on 2 cores shared by every
role). Both equal scikit-learn's ``roc_auc_score`` and ``log_loss`` (tests/bench/test_metrics.py)."""

from __future__ import annotations

import numpy as np


def rank_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC as the Mann-Whitney statistic, tied scores sharing their average rank; NaN when
    only one class is present."""
    labels = np.asarray(labels).reshape(-1)
    scores = np.asarray(scores).reshape(-1)
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [len(scores)]))
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends - 1) / 2.0 + 1.0, ends - starts)
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def binary_log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities the caller has clipped away from 0 and 1."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))
