"""The example's numpy metrics give scikit-learn's values, ties and one-class sets included."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "synthetic-ctr"


@pytest.mark.parametrize("levels", [None, 7])  # continuous scores, and scores with many ties
def test_auc_and_logloss_equal_sklearn(levels):
    from synthetic_ctr.training import auc_and_logloss

    rng = np.random.default_rng(3)
    y = (rng.random(5000) < 0.25).astype(np.float32)
    p = np.clip(0.25 + 0.3 * (y - 0.25) + 0.2 * rng.standard_normal(5000), 0.0, 1.0)
    if levels:
        p = np.round(p * levels) / levels  # exact 0 and 1 among them: the clip matters
    auc, loss = auc_and_logloss(y, p)
    clipped = np.clip(p.astype(np.float64), 1e-7, 1 - 1e-7)
    assert auc == pytest.approx(roc_auc_score(y, p), abs=1e-12)
    assert loss == pytest.approx(log_loss(y, clipped, labels=[0.0, 1.0]), rel=1e-12)


def test_one_class_gives_nan_auc_and_a_finite_loss():
    from synthetic_ctr.training import auc_and_logloss

    auc, loss = auc_and_logloss(np.zeros(10), np.full(10, 0.1))
    assert math.isnan(auc) and loss == pytest.approx(-math.log(0.9))


def test_evaluating_does_not_import_sklearn():
    code = ("import sys, numpy as np; from synthetic_ctr.training import auc_and_logloss; "
            "auc_and_logloss(np.array([0., 1.]), np.array([.2, .7])); print('sklearn' in sys.modules)")
    got = subprocess.run([sys.executable, "-c", code], cwd=EXAMPLE_DIR, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "False", got.stderr[-2000:]
