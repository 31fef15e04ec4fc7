"""``bench/ps_capacity.py`` on a tiny store: its two phases run, the store reaches capacity and
evicts, and the report says so. Plumbing only, never speed."""

from __future__ import annotations

import json

from bench.ps_capacity import main


def test_the_capacity_bench_measures_below_and_at_capacity(tmp_path):
    out = tmp_path / "ps_capacity.json"
    result = main(["--rows-per-shard", "200", "--shards", "4", "--ids", "60", "--new", "10", "--rounds", "5",
                   "--output", str(out)])
    assert json.loads(out.read_text()) == result
    (run,) = result["runs"]
    assert run["below_capacity_ms"] > 0 and run["at_capacity_ms"] > 0
    assert run["evictions_per_lookup"] > 0  # at capacity every new row evicts one
    assert result["capacity_lookup_ratio"] == run["ratio"]
