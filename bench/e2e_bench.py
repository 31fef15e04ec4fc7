"""End-to-end benchmark runner (``make bench``; ``make bench-smoke`` = ``--profile smoke``).

Generates the synthetic Criteo-schema data once, then runs every configuration as its own
subprocess (so peak memory is per run), interleaved: for each model, repeat ``repeats`` times a
round over all systems, with seed = repeat index. Throughput is the median over repeats; AUC is
the mean over seeds. Writes ``runs.json`` (every run) and, through bench/report.py, the headline
``e2e.json``, ``docs/benchmarks.md`` and its plots.

    python -m bench.e2e_bench                       # full profile, results in bench/results, docs/
    python -m bench.e2e_bench --profile smoke --output-root DIR   # few-thousand-row pipeline check
    python -m bench.e2e_bench --smoke               # the same into a temporary directory (make bench-smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench._paths import DOCS_DIR, RESULTS_DIR, child_env
from bench.persia_local import adult_income_command, find_launcher, launcher_unavailable_reason, synthetic_command
from bench.procmem import PeakMemorySampler
from bench.spec import DEFAULT_HYBRID_STALENESS, RunSpec
from synthetic_ctr.generate import generate_dataset
from synthetic_ctr.manifest import GeneratorConfig
from synthetic_ctr.results import parse_result_line

BASELINE_MODULES = {"torch": "bench.torch_baseline", "torchrec": "bench.torchrec_baseline"}


@dataclass(frozen=True)
class SystemPlan:
    system: str
    repeats: int | None = None  # None: the profile's repeats
    num_ps: int = 1
    num_embedding_workers: int = 1
    threads: int | None = None  # None: the profile's baseline_threads (our launcher sets its own)
    staleness: int | None = None  # persia-hybrid only; None: the profile's hybrid_staleness
    nn_threads: int | None = None  # our system only; None: the profile's persia_nn_threads


LAUNCHER_BUDGET = 0  # SystemPlan.nn_threads: leave the NN worker's threads to the launcher's budget


@dataclass(frozen=True)
class ModelPlan:
    mlp: str
    train_rows: int
    test_rows: int
    systems: tuple[SystemPlan, ...]
    curve_eval_rows: int | None = None  # None: the profile's


@dataclass(frozen=True)
class Profile:
    name: str
    data: GeneratorConfig
    models: tuple[ModelPlan, ...]
    batch_size: int = 1024
    repeats: int = 3
    baseline_threads: int = 2
    eval_points: int = 4
    curve_eval_rows: int = 20000
    run_timeout_s: float = 600.0
    adult_income: bool = True
    # the headline hybrid configuration (ratio_*, auc_gap_hybrid_sync): its staleness bound, and
    # the torch threads of our NN worker in every run (None: the launcher's thread budget)
    hybrid_staleness: int = DEFAULT_HYBRID_STALENESS
    persia_nn_threads: int | None = None
    notes: tuple[str, ...] = field(default=())


_SYSTEMS_MLP400 = (
    # One process gets the whole machine: 2 torch threads (with OMP_WAIT_POLICY=PASSIVE as fast as 1
    # thread or faster). The headline baseline is always the fastest torch configuration measured.
    SystemPlan("torch", threads=2),
    SystemPlan("torchrec", threads=2),
    SystemPlan("persia-hybrid"),  # the profile's hybrid_staleness: the headline configuration
    SystemPlan("persia-hybrid", staleness=10),  # PERSIA's examples' bound, for comparison
    SystemPlan("persia-sync"),
    SystemPlan("persia-hybrid", repeats=1, num_ps=2, num_embedding_workers=2),
    SystemPlan("persia-sync", repeats=1, num_ps=2, num_embedding_workers=2),
    SystemPlan("persia-hybrid", repeats=1, nn_threads=LAUNCHER_BUDGET),  # what the default budget gives
)
_SYSTEMS_FFNN = (
    SystemPlan("torch", threads=2),  # large GEMMs: 2 threads beat 1 by ~1.7x
    SystemPlan("torchrec", threads=2, repeats=1),
    SystemPlan("persia-hybrid"),
    SystemPlan("persia-hybrid", repeats=1, nn_threads=LAUNCHER_BUDGET),
)

PROFILES: dict[str, Profile] = {
    # Sized so that `make bench` (this plus the PS benchmark) stays under 20 minutes on 2 cores; see
    # docs/benchmarks.md, "Sizes". Batch 256: 1,563 steps for the MLP-400 epoch (with 390 steps of
    # 1024 the hybrid-vs-sync AUC gap was a short-run effect: -0.017 at staleness 10). Staleness 2
    # is the headline: the best bound found (AUC 0.0003 below sync over 3 seeds against 0.0007-0.0009
    # for staleness 10, and no slower on 2 cores); staleness 10 is measured beside it.
    "full": Profile(
        name="full",
        data=GeneratorConfig(train_rows=400_000, test_rows=50_000, seed=0, scale=0.01),
        models=(
            ModelPlan("mlp400", train_rows=400_000, test_rows=50_000, systems=_SYSTEMS_MLP400),
            ModelPlan("ffnn", train_rows=20_000, test_rows=10_000, systems=_SYSTEMS_FFNN, curve_eval_rows=5_000),
        ),
        batch_size=256,
        curve_eval_rows=10_000,
        hybrid_staleness=2,
        # our NN worker gets both cores' worth of torch threads (OMP passive waiting keeps them from
        # starving the other roles): FFNN 1,355 vs 845 samples/s with the launcher's 1 thread
        persia_nn_threads=2,
    ),
    # A few thousand rows through every stage (generator, each system, report); checks plumbing only.
    "smoke": Profile(
        name="smoke",
        data=GeneratorConfig(train_rows=4_000, test_rows=2_000, seed=0, scale=0.001, chunk_rows=1_500),
        models=(
            ModelPlan(
                "mlp400",
                train_rows=4_000,
                test_rows=2_000,
                systems=(  # TorchRec has its own test (tests/bench/test_bench_baselines.py)
                    SystemPlan("torch", threads=1),
                    SystemPlan("persia-hybrid"),
                    SystemPlan("persia-sync"),
                ),
            ),
            ModelPlan("ffnn", train_rows=512, test_rows=512, systems=(SystemPlan("torch", threads=1),)),
        ),
        batch_size=256,
        repeats=1,
        eval_points=2,
        curve_eval_rows=1_000,
        run_timeout_s=300.0,
        adult_income=False,
    ),
}


def _nn_threads(s: SystemPlan, profile: Profile) -> int | None:
    if not s.system.startswith("persia"):
        return None
    if s.nn_threads == LAUNCHER_BUDGET:
        return None
    return s.nn_threads or profile.persia_nn_threads


def plan_runs(profile: Profile, data_dir: str, systems: set[str] | None = None) -> list[RunSpec]:
    """Every run, in execution order: per model, round r runs each system once with seed r, so
    the repeats of different systems interleave (drift in machine load hits all of them alike)."""
    specs: list[RunSpec] = []
    for model in profile.models:
        chosen = [s for s in model.systems if systems is None or s.system in systems]
        rounds = max((s.repeats or profile.repeats for s in chosen), default=0)
        for r in range(rounds):
            for s in chosen:
                if r >= (s.repeats or profile.repeats):
                    continue
                specs.append(
                    RunSpec(
                        system=s.system,
                        data_dir=data_dir,
                        mlp=model.mlp,
                        batch_size=profile.batch_size,
                        seed=r,
                        threads=s.threads or profile.baseline_threads,
                        train_rows=model.train_rows,
                        test_rows=model.test_rows,
                        eval_points=profile.eval_points,
                        curve_eval_rows=min(model.curve_eval_rows or profile.curve_eval_rows, model.test_rows),
                        num_ps=s.num_ps,
                        num_embedding_workers=s.num_embedding_workers,
                        staleness=(s.staleness or profile.hybrid_staleness) if s.system == "persia-hybrid" else None,
                        nn_threads=_nn_threads(s, profile),
                        timeout_s=profile.run_timeout_s,
                    )
                )
    return specs


def command_for(spec: RunSpec, launcher: str | None) -> tuple[list[str], dict[str, str]]:
    if spec.system in BASELINE_MODULES:
        return [sys.executable, "-m", BASELINE_MODULES[spec.system], "--spec", spec.model_dump_json()], child_env()
    if launcher is None:
        raise ValueError(f"system={spec.system!r} needs persia-launcher, which is not available")
    return synthetic_command(spec, launcher)


def execute(argv: list[str], env: dict[str, str], timeout_s: float, log_path: Path) -> dict[str, Any]:
    """Run one command in its own session, sample its tree's memory, parse its PERSIA_RESULT."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()[0]  # other work on the machine shows up here (ours adds ~2)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        sampler = PeakMemorySampler(proc.pid).start()
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group we created for this run, nothing else
            stdout, _ = proc.communicate()
            timed_out = True
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): take this run's processes down too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            sampler.stop()
            raise
        memory = sampler.stop()
        log.write("\n--- stdout ---\n" + (stdout or ""))
    record: dict[str, Any] = {
        "returncode": proc.returncode,
        "wall_seconds": time.perf_counter() - started,
        "loadavg_start": load_at_start,
        "loadavg_end": os.getloadavg()[0],
        "memory": memory,
        "log": log_path.name,
    }
    try:
        result = parse_result_line(stdout or "")
    except ValueError as e:
        result, record["reason"] = None, str(e)
    record["result"] = result
    if timed_out:
        record["status"], record["reason"] = "timeout", f"killed after {timeout_s:.0f}s"
    elif result is not None and result.get("skipped"):
        record["status"], record["reason"] = "skipped", result["skipped"]
    elif proc.returncode != 0 or result is None:
        record["status"] = "failed"
        record.setdefault("reason", f"exit status {proc.returncode}")
        record["reason"] += f" (see {log_path.name})"
    else:
        record["status"] = "ok"
    return record


def _jsonable(o: Any) -> Any:
    return o.model_dump() if hasattr(o, "model_dump") else str(o)


def _fmt(x: Any, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def run_profile(
    profile: Profile,
    results_dir: Path,
    docs_dir: Path,
    data_dir: Path | None = None,
    systems: set[str] | None = None,
    log=print,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    results_dir.mkdir(parents=True, exist_ok=True)
    data_dir = data_dir or results_dir / "data" / profile.name
    manifest = generate_dataset(data_dir, profile.data)
    log(
        f"data: {manifest.splits['train'].rows} train / {manifest.splits['test'].rows} test rows in {data_dir} "
        f"(teacher test AUC {manifest.teacher.test_auc:.4f}, vocab {sum(manifest.vocab_sizes)} IDs)"
    )
    persia_reason = None
    launcher = None
    wants_persia = any(s.system.startswith("persia") for m in profile.models for s in m.systems)
    if wants_persia and (systems is None or any(s.startswith("persia") for s in systems)):
        persia_reason = launcher_unavailable_reason()
        launcher = None if persia_reason else find_launcher()
        if persia_reason:
            log(f"our system: not yet measured ({persia_reason})")

    runs: list[dict[str, Any]] = []
    skip_reason: dict[tuple[str, str], str] = {}
    logs_dir = results_dir / "logs"
    for old in logs_dir.glob("*.log"):  # a previous run's logs would read as this run's
        old.unlink()
    for i, spec in enumerate(plan_runs(profile, str(data_dir), systems)):
        key = (spec.system, spec.mlp)
        base = {"spec": spec.model_dump(), "label": spec.label, "mlp": spec.mlp, "seed": spec.seed}
        if spec.system.startswith("persia") and persia_reason:
            skip_reason[key] = f"not yet measured: {persia_reason}"
        if key in skip_reason:
            runs.append({**base, "status": "skipped", "reason": skip_reason[key], "result": None, "memory": {}})
            continue
        argv, env = command_for(spec, launcher)
        rec = execute(argv, env, spec.timeout_s, logs_dir / f"{i:03d}-{spec.mlp}-{spec.label.replace(' ', '_').replace('=', '')}-s{spec.seed}.log")
        rec = {**base, **rec}
        runs.append(rec)
        res = rec["result"] or {}
        log(
            f"[{i + 1}] {spec.mlp:7s} {spec.label:32s} seed {spec.seed}: {rec['status']:7s} "
            f"{_fmt(res.get('samples_per_sec'), '9.0f')} samples/s  AUC {_fmt(res.get('auc'))}  "
            f"wall {rec['wall_seconds']:.1f}s" + (f"  ({rec.get('reason')})" if rec["status"] != "ok" else "")
        )
        if rec["status"] == "skipped":
            skip_reason[key] = rec["reason"]

    adult: dict[str, Any] = {"status": "skipped", "reason": "not part of this profile"}
    if profile.adult_income:
        if systems is not None and not any(s.startswith("persia") for s in systems):
            adult = {"status": "skipped", "reason": "not run: --systems leaves out our system"}
        elif launcher is None:
            adult = {"status": "skipped", "reason": f"not yet measured: {persia_reason or 'persia-launcher not available'}"}
        else:
            cmd = adult_income_command(launcher)
            if isinstance(cmd, str):
                adult = {"status": "skipped", "reason": f"not yet measured: {cmd}"}
            else:
                adult = execute(cmd[0], cmd[1], profile.run_timeout_s, logs_dir / "adult-income.log")
        log(f"adult-income: {adult['status']} AUC {_fmt((adult.get('result') or {}).get('auc'))} {adult.get('reason', '')}")

    doc = {
        "profile": json.loads(json.dumps(asdict(profile), default=_jsonable)),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "data": {
            "train_rows": manifest.splits["train"].rows,
            "test_rows": manifest.splits["test"].rows,
            "teacher_test_auc": manifest.teacher.test_auc,
            "train_positive_rate": manifest.splits["train"].positive_rate,
            "vocab_ids": sum(manifest.vocab_sizes),
            "cardinalities": manifest.cardinalities,
            "generation_seconds": manifest.generation_seconds,
            "config": manifest.config.model_dump(),
        },
        "runs": runs,
        "adult_income": adult,
        "total_seconds": time.perf_counter() - t0,
    }
    (results_dir / "runs.json").write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
    from bench.report import write_report  # late: matplotlib only when reporting

    headline = write_report(doc, docs_dir=docs_dir, results_dir=results_dir)
    doc["total_seconds"] = time.perf_counter() - t0
    log(f"total {doc['total_seconds']:.0f}s; wrote {results_dir / 'e2e.json'} and {docs_dir / 'benchmarks.md'}")
    for k, v in headline.items():
        if k not in ("notes", "targets"):
            log(f"  {k} = {v}" + (f"  ({headline['notes'][k]})" if k in headline["notes"] else ""))
    for t in headline["targets"].values():
        verdict = {True: "PASS", False: "FAIL", None: "not yet measured"}[t["passed"]]
        log(f"  target {t['what']} {t['target']}: {_fmt(t['value'])} {verdict}")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES), default="full")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the smoke profile into a temporary directory, checked and removed (= python -m bench.smoke)",
    )
    p.add_argument(
        "--output-root",
        type=Path,
        help="write results/ and docs/ under this directory instead of bench/results and docs/",
    )
    p.add_argument("--data-dir", type=Path, help="dataset directory (default: <results>/data/<profile>)")
    p.add_argument("--systems", help="comma list to run only these: torch,torchrec,persia-hybrid,persia-sync")
    p.add_argument("--repeats", type=int, help="override the profile's repeats")
    a = p.parse_args(argv)
    install_interrupt_handler()
    if a.smoke:
        from bench.smoke import main as smoke_main

        return smoke_main([])
    profile = PROFILES[a.profile]
    if a.repeats is not None:
        if a.repeats < 1:
            p.error(f"--repeats must be >= 1, got {a.repeats}")
        profile = replace(profile, repeats=a.repeats)
    systems = None
    if a.systems:
        systems = {s.strip() for s in a.systems.split(",") if s.strip()}
        unknown = systems - {"torch", "torchrec", "persia-hybrid", "persia-sync"}
        if unknown:
            p.error(f"unknown --systems {sorted(unknown)}")
    if a.output_root:
        results_dir, docs_dir = a.output_root / "results", a.output_root / "docs"
    else:
        results_dir, docs_dir = RESULTS_DIR, DOCS_DIR
    run_profile(profile, results_dir, docs_dir, a.data_dir, systems)
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install_interrupt_handler() -> None:
    """SIGTERM unwinds like Ctrl-C, so ``execute`` kills the run in progress (its own session)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


if __name__ == "__main__":
    sys.exit(main())
