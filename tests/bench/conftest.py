"""Make ``bench`` (the repo root) and ``synthetic_ctr`` (examples/synthetic-ctr) importable, and
share one tiny generated dataset between the tests that only read it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_DIR = REPO_ROOT / "examples" / "synthetic-ctr"
for _p in (str(REPO_ROOT), str(EXAMPLE_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory):
    """2,500 train rows in 3 chunks, 1,500 test rows in 2 chunks."""
    from synthetic_ctr.generate import generate_dataset
    from synthetic_ctr.manifest import GeneratorConfig

    out = tmp_path_factory.mktemp("sctr")
    cfg = GeneratorConfig(train_rows=2500, test_rows=1500, chunk_rows=1000, scale=0.001, seed=7)
    return out, generate_dataset(out, cfg)
