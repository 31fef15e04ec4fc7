"""CPU per training sample of each role of our system (``make bench-path``; part of ``make bench``).

Two runs of the same configuration that differ only in training rows; per role, the difference
of their CPU seconds divided by the difference of rows is that role's *marginal* CPU per sample:
start-up, discovery and evaluation are the same in both runs and cancel. The embedding path is
what the disaggregated embedding costs beside the NN worker: data loader + embedding worker + PS
+ nats-server (issue 15's item 3, target <= 20 µs).

Beside it, the same difference taken over each run's training window only (the trainer reports
the unix times of its first batch and its last step; the sampler's CPU series is read at both):
start-up and shutdown then leave no noise in it, so a pair that moves in one figure and not the
other moved outside training.

    python -m bench.path_cpu                       # 40k and 160k rows, hybrid st=2, nn-threads 2
    python -m bench.path_cpu --pairs 3 --system persia-sync
    python -m bench.path_cpu --mlp ffnn --small-rows 5000 --large-rows 20000
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from bench._paths import RESULTS_DIR, write_results
from bench.persia_local import find_launcher, launcher_unavailable_reason
from bench.spec import RunSpec

EMBEDDING_PATH_ROLES = ("data-loader", "embedding-worker", "ps", "nats")


def marginal_us_per_sample(small: dict[str, dict], large: dict[str, dict], rows: int,
                           colocate_ps: bool = False) -> dict[str, float]:
    """Per role present in both runs: (CPU large - CPU small) / rows, in µs; plus the embedding
    path's sum and every role's sum. Pure, so the arithmetic is tested without running anything.
    ``colocate_ps``: the PS ran inside the embedding worker's process, whose figure holds both."""
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    expected = tuple(r for r in EMBEDDING_PATH_ROLES if not (colocate_ps and r == "ps"))
    missing = [r for r in expected + ("nn-worker",)
               if small.get(r, {}).get("cpu_s") is None or large.get(r, {}).get("cpu_s") is None]
    if missing:
        raise ValueError(f"no CPU figure for role(s) {missing} in one of the two runs")
    out = {}
    for role in sorted(set(small) & set(large)):
        a, b = small[role].get("cpu_s"), large[role].get("cpu_s")
        if a is not None and b is not None:
            out[role] = (b - a) / rows * 1e6
    out["embedding_path"] = sum(out.get(r, 0.0) for r in EMBEDDING_PATH_ROLES)
    out["all_roles"] = sum(v for k, v in out.items() if k not in ("embedding_path", "all_roles"))
    return out


def training_marginal(small: dict[str, Any], large: dict[str, Any], rows: int,
                      colocate_ps: bool = False) -> dict[str, float] | None:
    """:func:`marginal_us_per_sample` of two run records' CPU inside their training windows
    (``training_cpu_s``, set by ``bench.e2e_bench.execute``); None when either run has none."""
    if not small.get("training_cpu_s") or not large.get("training_cpu_s"):
        return None
    return marginal_us_per_sample(*({role: {"cpu_s": s} for role, s in run["training_cpu_s"].items()}
                                    for run in (small, large)), rows, colocate_ps)


def median_by_role(pairs: list[dict[str, float]]) -> dict[str, float]:
    roles = sorted(set().union(*pairs)) if pairs else []
    return {r: statistics.median(p[r] for p in pairs if r in p) for r in roles}


def measure_pairs(launcher: str, data_dir: Path, small_rows: int, large_rows: int, pairs: int, logs_dir: Path,
                  system: str = "persia-hybrid", staleness: int | None = 2, nn_threads: int | str = "auto",
                  batch_size: int = 256, log=print, colocate_ps: bool = False, mlp: str = "mlp400") -> dict[str, Any]:
    """``pairs`` (small, large) runs of our system; per pair the marginal CPU per sample by role."""
    from bench.e2e_bench import command_for, execute  # late: e2e_bench reports through this module

    runs = []
    for i in range(pairs):
        got = {}
        for rows in (small_rows, large_rows):
            spec = RunSpec(system=system, data_dir=str(data_dir), mlp=mlp, batch_size=batch_size, seed=i,
                           train_rows=rows, test_rows=2_000, eval_points=1, curve_eval_rows=1_000,
                           staleness=staleness if system == "persia-hybrid" else None, nn_threads=nn_threads,
                           colocate_ps=colocate_ps)
            argv, env = command_for(spec, launcher)
            rec = execute(argv, env, spec.timeout_s, logs_dir / f"path-cpu-{mlp}-b{batch_size}{'-colocated' if colocate_ps else ''}-{i}-{rows}.log",
                          sample_interval_s=0.1)
            if rec["status"] != "ok":
                raise RuntimeError(f"path CPU run of {rows} rows failed: {rec.get('reason')}")
            got[rows] = rec
        per = marginal_us_per_sample(got[small_rows]["memory"], got[large_rows]["memory"], large_rows - small_rows,
                                     colocate_ps)
        training = training_marginal(got[small_rows], got[large_rows], large_rows - small_rows, colocate_ps)
        load = max(r[k] for r in got.values() for k in ("loadavg_start", "loadavg_end"))
        runs.append({"us_per_sample": per, "training_us_per_sample": training, "load": load,
                     "samples_per_sec": got[large_rows]["result"].get("samples_per_sec")})
        log(f"path CPU pair {i + 1}/{pairs} (load {load:.1f}): " + ", ".join(f"{k} {v:.1f}" for k, v in per.items()))
        if training is not None:
            log("  training window only: " + ", ".join(f"{k} {v:.1f}" for k, v in training.items()))
    label = f"{system} st={staleness}" if system == "persia-hybrid" else system
    return {
        "configuration": f"{label} ps=1 ew=1{' colocated' if colocate_ps else ''} nn-threads={nn_threads}",
        "mlp": mlp, "batch_size": batch_size, "colocate_ps": colocate_ps,
        "rows": [small_rows, large_rows], "pairs": runs,
        "median_us_per_sample": median_by_role([r["us_per_sample"] for r in runs]),
        "median_training_us_per_sample": (median_by_role([r["training_us_per_sample"] for r in runs])
                                          if all(r["training_us_per_sample"] for r in runs) else None),
    }


def measure(system: str, staleness: int | None, small_rows: int, large_rows: int, pairs: int,
            nn_threads: int | str, batch_size: int, results_dir: Path, log=print, colocate_ps: bool = False,
            mlp: str = "mlp400") -> dict[str, Any]:
    from bench.e2e_bench import profile_data

    reason = launcher_unavailable_reason()
    if reason:
        raise SystemExit(f"cannot measure our system: {reason}")
    return measure_pairs(find_launcher(), profile_data(results_dir), small_rows, large_rows, pairs, results_dir / "logs",
                         system, staleness, nn_threads, batch_size, log, colocate_ps, mlp)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=["persia-hybrid", "persia-sync"], default="persia-hybrid")
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--small-rows", type=int, default=40_000)
    p.add_argument("--large-rows", type=int, default=160_000)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--nn-threads", default="auto", help="a count or 'auto' (persia-launcher local --nn-threads)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--mlp", default="mlp400", help="the synthetic-CTR model (mlp400, ffnn or 'a,b,c')")
    p.add_argument("--colocate-ps", action="store_true", help="the PS inside the embedding worker's process")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--output", type=Path, help="JSON file (default: <results>/path_cpu.json)")
    a = p.parse_args(argv)
    if not 0 < a.small_rows < a.large_rows:
        p.error(f"need 0 < --small-rows < --large-rows, got {a.small_rows} and {a.large_rows}")
    if a.pairs < 1:
        p.error(f"--pairs must be >= 1, got {a.pairs}")
    doc = measure(a.system, a.staleness, a.small_rows, a.large_rows, a.pairs, a.nn_threads, a.batch_size,
                  a.results_dir, colocate_ps=a.colocate_ps, mlp=a.mlp)
    out = write_results(doc, a.output or a.results_dir / "path_cpu.json")
    med = doc["median_us_per_sample"]
    print("µs CPU per training sample (median of pairs): " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    if doc["median_training_us_per_sample"]:
        print("  the same over the training windows only: "
              + ", ".join(f"{k} {v:.1f}" for k, v in doc["median_training_us_per_sample"].items()))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
