"""The PS at capacity: training lookups that bring new IDs into a store whose internal shards are
full, so that each insert evicts, against the same lookups below capacity (the baseline, measured
in the same run on the same store). A huge-model job runs at capacity all the time.

Each lookup reads ``--ids`` IDs, ``--new`` of them never seen (10 %, spread over every internal
shard). Prints the median of each and their ratio (below / at: 1.0 means no cost at capacity) and
writes ``bench/results/ps_capacity.json``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from persia.embedding_ps.store import EmbeddingStore, HyperParameters

RESULTS = Path(__file__).resolve().parent / "results" / "ps_capacity.json"


def measure(per_shard: int, shards: int, ids: int, new: int, dim: int, rounds: int) -> dict:
    store = EmbeddingStore(capacity=per_shard * shards, num_internal_shards=shards, seed=0)
    store.configure(HyperParameters())
    rng = np.random.default_rng(0)
    hot = rng.integers(1, 2**63, size=ids - new, dtype=np.uint64)
    counter = [1 << 40]

    def lookup() -> float:
        fresh = np.arange(counter[0], counter[0] + new, dtype=np.uint64) * np.uint64(2654435761)
        counter[0] += new
        batch = np.concatenate([hot, fresh])
        t = time.perf_counter()
        store.lookup(batch, dim, train=True)
        return time.perf_counter() - t

    to_fill = per_shard * shards // new  # lookups that bring as many new rows as the capacity
    for _ in range(to_fill // 4):  # a quarter full: the tables have grown past their first sizes
        lookup()
    below = [lookup() for _ in range(min(rounds, to_fill // 4))]
    for _ in range(to_fill + 50):  # past capacity
        lookup()
    evictions_before = store.stats().get("evictions", 0)
    at = [lookup() for _ in range(rounds)]
    below_ms, at_ms = float(np.median(below)) * 1e3, float(np.median(at)) * 1e3
    return {"rows_per_shard": per_shard, "internal_shards": shards, "ids": ids, "new": new, "dim": dim,
            "below_capacity_ms": round(below_ms, 4), "at_capacity_ms": round(at_ms, 4),
            "ratio": round(below_ms / at_ms, 3),
            "evictions_per_lookup": round((store.stats().get("evictions", 0) - evictions_before) / rounds, 1)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows-per-shard", type=int, nargs="+", default=[2_000, 20_000])
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--ids", type=int, default=3_000)
    ap.add_argument("--new", type=int, default=300)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--output", default=str(RESULTS))
    args = ap.parse_args(argv)
    runs = []
    for per_shard in args.rows_per_shard:
        r = measure(per_shard, args.shards, args.ids, args.new, args.dim, args.rounds)
        runs.append(r)
        print(f"PS at capacity, {args.shards} internal shards of {per_shard:,} rows, lookups of {args.ids:,} IDs "
              f"({args.new} new): median {r['below_capacity_ms']:.3f} ms below capacity, {r['at_capacity_ms']:.3f} ms "
              f"at capacity ({r['evictions_per_lookup']} evictions a lookup) -> ratio {r['ratio']:.2f}", flush=True)
    result = {"capacity_lookup_ratio": min(r["ratio"] for r in runs), "runs": runs}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
