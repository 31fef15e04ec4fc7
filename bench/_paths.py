"""Where things are, relative to this file (no machine paths), and how child runs find the code."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_DIR = REPO_ROOT / "examples" / "synthetic-ctr"
RESULTS_DIR = REPO_ROOT / "bench" / "results"
DOCS_DIR = REPO_ROOT / "docs"


def ensure_example_importable() -> None:
    """Make ``import synthetic_ctr`` work (the package lives beside the PERSIA example scripts)."""
    path = str(EXAMPLE_DIR)
    if path not in sys.path:
        sys.path.insert(0, path)


# Our system's roles share the cores: OpenMP's default spin-waiting makes a 2-thread torch process
# several times slower as soon as another process wants a core (measured here: 4-7k instead of 20k
# samples/s), so local mode waits passively (the launcher sets it too). A lone baseline process
# gets torch's default threading instead: passive waiting cost it a third of its speed (14.9k
# against 23.4k samples/s at batch 256).
SHARED_CORES_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def child_env(extra: dict[str, str] | None = None, shared_cores: bool = True) -> dict[str, str]:
    """Environment for a benchmark subprocess: repo root and the example on PYTHONPATH;
    SHARED_CORES_ENV (unless the caller's environment sets those variables) when the run's
    processes share the cores, none of it (torch's defaults) for a single-process baseline."""
    env = dict(os.environ)
    for key, value in SHARED_CORES_ENV.items():
        if shared_cores:
            env.setdefault(key, value)
        else:
            env.pop(key, None)
    parts = [str(REPO_ROOT), str(EXAMPLE_DIR)]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


ensure_example_importable()


def write_results(doc: dict, path: Path) -> Path:
    """A benchmark's JSON results at ``path`` (its folder made); the path, to print."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path
