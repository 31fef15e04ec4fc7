"""``make bench-smoke``: the whole benchmark pipeline on a few thousand rows, into a temporary
directory (generator, every system that is available, report). Checks plumbing, not speed.

    python -m bench.smoke [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench.e2e_bench import PROFILES, install_interrupt_handler, run_profile

REQUIRED_KEYS = (
    "ratio_mlp400", "ratio_mlp400_b1024", "ratio_ffnn", "auc_gap_hybrid_sync", "auc_gap_30steps", "adult_auc",
    "baseline_sps_mlp400", "hybrid_sps_mlp400",
    "latency_hybrid_keep_2ms", "latency_hybrid_over_sync_2ms", "latency_auc_gap_2ms",
)  # fmt: skip


def run_smoke(root: Path, log=print) -> dict:
    """Run the smoke profile under ``root``; return the headline (e2e.json) after checking that the
    report, its plots and every required key were produced."""
    run_profile(PROFILES["smoke"], root / "results", root / "docs", log=log)
    head = json.loads((root / "results" / "e2e.json").read_text())
    missing = [k for k in REQUIRED_KEYS if k not in head]
    if missing:
        raise RuntimeError(f"e2e.json lacks keys {missing}")
    for img in ("e2e_throughput.png", "e2e_auc_curve.png", "e2e_memory.png", "e2e_latency.png"):
        if not (root / "docs" / "img" / img).is_file():
            raise RuntimeError(f"report did not write docs/img/{img}")
    return head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory and print its path")
    a = p.parse_args(argv)
    install_interrupt_handler()
    root = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    try:
        head = run_smoke(root)
        if head.get("baseline_sps_mlp400") is None:
            print("bench-smoke: the torch baseline produced no throughput", file=sys.stderr)
            return 1
        print(f"bench-smoke ok ({root if a.keep else 'temporary output removed'})")
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
