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
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench import machine as machine_probe
from bench._paths import DOCS_DIR, RESULTS_DIR, child_env
from bench.persia_local import adult_income_command, find_launcher, launcher_unavailable_reason, synthetic_command
from bench.procmem import PeakMemorySampler, cpu_between
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
    nn_threads: int | str | None = None  # our system only; None: the profile's persia_nn_threads
    fused: bool = False  # torch only: torch's own optimizers instead of the PS's formula
    colocate_ps: bool = False  # our system only: the PS inside the embedding worker's process
    replay: bool = True  # our system only: False reads stale embeddings, as PERSIA does
    cpu_placement: str = "auto"  # our system only: "off" leaves every thread's CPU to the kernel


LAUNCHER_DEFAULT = 0  # SystemPlan.nn_threads: leave the NN worker's threads to the launcher's default


@dataclass(frozen=True)
class ModelPlan:
    mlp: str
    train_rows: int
    test_rows: int
    systems: tuple[SystemPlan, ...]
    curve_eval_rows: int | None = None  # None: the profile's
    batch_size: int | None = None  # None: the profile's
    name: str | None = None  # the group its runs are reported under; None: ``mlp``

    @property
    def key(self) -> str:
        return self.name or self.mlp


@dataclass(frozen=True)
class LatencyPlan:
    """``make bench-latency``: every connection between our roles through a delaying proxy
    (bench/latency_run.py), at each one-way delay; torch (no network) beside it, once per seed."""

    train_rows: int
    test_rows: int
    # Hybrid runs here measure latency hiding, so they skip the staleness warm-up: with the
    # default 200 synchronous steps a 235-step run is mostly synchronous (its cost at 2 ms is in
    # docs/benchmarks.md, item 2). None: the runtime's default.
    hybrid_warmup_steps: int | None = 0
    delays_ms: tuple[float, ...] = (0.0, 0.5, 2.0)
    systems: tuple[SystemPlan, ...] = (
        SystemPlan("persia-sync"),
        SystemPlan("persia-hybrid"),  # the profile's headline bound
        # PERSIA's examples' bound with stale reads: context (the headline is the same bound), one seed
        SystemPlan("persia-hybrid", staleness=10, replay=False, repeats=1),
    )
    baseline: SystemPlan | None = SystemPlan("torch", threads=2, fused=True)
    repeats: int | None = None  # None: the profile's
    mlp: str = "mlp400"


@dataclass(frozen=True)
class PathPlan:
    """A path CPU measurement of the headline configuration on another model or batch size: the
    CPU per sample that bounds throughput target ``target`` (a ``bench.summary.TARGETS`` key)."""

    target: str
    mlp: str
    batch_size: int
    rows: tuple[int, int]  # training rows of the small and the large run of each pair
    pairs: int = 2


@dataclass(frozen=True)
class DensePlan:
    """The NN worker's dense step alone (bench/dense_step.py) on the model and batch size of
    throughput target ``target``, at each thread count the NN worker may train on: what bounds that
    target from the critical path's side (``bench.summary.dense_bound``)."""

    target: str
    mlp: str
    batch_size: int
    steps: int


def latency_group(delay_ms: float | None) -> str:
    """The report group of a latency run: one per delay; the undelayed torch baseline its own."""
    return "latency_torch" if delay_ms is None else f"latency_{delay_ms:g}ms"


@dataclass(frozen=True)
class Planned:
    group: str  # what the report groups by (with the label): a model key or a latency group
    spec: RunSpec
    delay_ms: float | None = None  # through the delaying proxies (latency runs of our system)


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
    latency: LatencyPlan | None = None
    # the headline hybrid configuration (ratio_*, auc_gap_hybrid_sync): its staleness bound, and
    # the torch threads of our NN worker in every run (None: the launcher's thread budget)
    hybrid_staleness: int = DEFAULT_HYBRID_STALENESS
    persia_nn_threads: int | str | None = None
    # CPU per sample by role (bench/path_cpu.py): training rows of the small and the large run of
    # each pair (one pair per repeat, headline configuration); None: not measured
    path_cpu_rows: tuple[int, int] | None = None
    # more path CPU measurements, one per other throughput target, for what the cores allow it
    # (bench.summary.cpu_bound)
    path_cpu_targets: tuple["PathPlan", ...] = ()
    # pairs of the same measurement with each PS inside its embedding worker (--colocate-ps); 0: not
    # measured (``python -m bench.path_cpu --colocate-ps`` measures it alone)
    path_cpu_colocated_pairs: int = 0
    # the dense step alone per throughput target (what one training thread allows it)
    dense_step_targets: tuple[DensePlan, ...] = ()
    notes: tuple[str, ...] = field(default=())


# One process gets the whole machine with torch's default threading (2 threads spin-waiting as
# OpenMP does by default). The PS-formula variant is the AUC reference; the ratios are to the
# fastest torch configuration of the same model in the same run. The targets' configurations (the
# headline hybrid, the synchronous reference, the baselines that can be the fastest) run every
# repeat; the configurations that only give context run once, so that `make bench`
# fits its 30 minutes (docs/benchmarks.md, "Sizes and time budget").
_SYSTEMS_MLP400 = (
    # the AUC reference, every repeat, as at batch 1024: one run of it read 41,984 against the fused
    # median of 38,695 (session 25), and a ratio to one run against a median of three is biased
    SystemPlan("torch", threads=2),
    SystemPlan("torch", threads=2, fused=True),
    SystemPlan("torchrec", threads=2, repeats=1),
    SystemPlan("persia-hybrid"),  # the profile's hybrid_staleness: the headline configuration
    SystemPlan("persia-hybrid", staleness=10, replay=False, repeats=1),  # stale reads, as PERSIA trains
    SystemPlan("persia-sync"),
    SystemPlan("persia-hybrid", colocate_ps=True, repeats=1),  # the headline with --colocate-ps
    SystemPlan("persia-hybrid", cpu_placement="off", repeats=1),  # the headline, the kernel placing every thread
)
_SYSTEMS_B1024 = (
    # the AUC reference, every repeat: at batch 1024 it is as often the faster baseline as the
    # fused one, and one run of it read 58,882 against the fused median of 48,546 (session 21)
    SystemPlan("torch", threads=2),
    SystemPlan("torch", threads=2, fused=True),
    SystemPlan("persia-hybrid"),
    SystemPlan("persia-sync", repeats=1),
)
_SYSTEMS_SHORT = (  # the AUC gap of the default setting in a short run (30 steps)
    SystemPlan("persia-hybrid"),
    SystemPlan("persia-hybrid", staleness=10, replay=False, repeats=1),  # stale reads: context
    SystemPlan("persia-sync"),
)
_SYSTEMS_FFNN = (
    SystemPlan("torch", threads=2, repeats=1),  # large GEMMs: 2 threads beat 1 by ~1.7x
    SystemPlan("torch", threads=2, fused=True),
    SystemPlan("persia-hybrid"),
)

PROFILES: dict[str, Profile] = {
    # Sized so that `make bench` (this plus the PS benchmark) stays under 30 minutes on 2 cores; see
    # docs/benchmarks.md, "Sizes". Batch 256: 1,563 steps for the MLP-400 epoch (with 390 steps of
    # 1024 the hybrid-vs-sync AUC gap was a short-run effect: -0.017 at staleness 10).
    "full": Profile(
        name="full",
        data=GeneratorConfig(train_rows=400_000, test_rows=50_000, seed=0, scale=0.01),
        models=(
            ModelPlan("mlp400", train_rows=400_000, test_rows=50_000, systems=_SYSTEMS_MLP400),
            ModelPlan("mlp400", train_rows=400_000, test_rows=20_000, systems=_SYSTEMS_B1024, batch_size=1024,
                      name="mlp400_b1024", curve_eval_rows=5_000),
            ModelPlan("mlp400", train_rows=30 * 256, test_rows=20_000, systems=_SYSTEMS_SHORT, name="mlp400_30steps",
                      curve_eval_rows=5_000),
            ModelPlan("ffnn", train_rows=20_000, test_rows=10_000, systems=_SYSTEMS_FFNN, curve_eval_rows=5_000),
        ),
        batch_size=256,
        curve_eval_rows=10_000,
        # PERSIA's examples' bound: with replay (the default) a looser bound costs no AUC, and it
        # hid the 2 ms delay best (docs/benchmarks.md, "Own-update replay")
        hybrid_staleness=10,
        # the NN worker measures its torch thread count in training (the launcher's default, said in
        # the label): on a 2-core VM one thread stepped MLP 400 at batch 256 13-15% faster than
        # two, while two stepped the FFNN 1.4x faster (docs/benchmarks.md, session 9)
        persia_nn_threads="auto",
        # 157 steps a run: the hybrid runs skip the warm-up, so every step measures latency hiding
        latency=LatencyPlan(train_rows=40_000, test_rows=20_000),
        path_cpu_rows=(30_000, 120_000),
        # one pair each: they say what the cores allow those targets, the targets themselves are
        # measured in the throughput runs (~40 s a pair)
        path_cpu_targets=(PathPlan("ratio_mlp400_b1024", "mlp400", 1024, (80_000, 320_000), pairs=1),
                          PathPlan("ratio_ffnn", "ffnn", 256, (5_000, 20_000), pairs=1)),
        # about 1.5 s of steps each, per thread count (plus a process start)
        dense_step_targets=(DensePlan("ratio_mlp400", "mlp400", 256, 200),
                            DensePlan("ratio_mlp400_b1024", "mlp400", 1024, 60),
                            DensePlan("ratio_ffnn", "ffnn", 256, 8)),
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
        # one delayed run: the proxies, --nats-url and grpc_proxy plumbing (figures need more runs)
        latency=LatencyPlan(train_rows=2_000, test_rows=1_000, delays_ms=(2.0,), systems=(SystemPlan("persia-sync"),), baseline=None),
        path_cpu_rows=(1_000, 3_000),  # plumbing only: figures from a run this short are noise
    ),
}


def profile_data(results_dir: Path, profile: str = "full") -> Path:
    """The synthetic data of a profile under ``results_dir``, generated unless it is there (the
    generator is deterministic); for the tools that run one part of the benchmark."""
    data_dir = results_dir / "data" / PROFILES[profile].name
    generate_dataset(data_dir, PROFILES[profile].data)
    return data_dir


def _nn_threads(s: SystemPlan, profile: Profile) -> int | None:
    if not s.system.startswith("persia"):
        return None
    if s.nn_threads == LAUNCHER_DEFAULT:
        return None
    return s.nn_threads or profile.persia_nn_threads


def _spec(s: SystemPlan, profile: Profile, data_dir: str, mlp: str, seed: int, train_rows: int, test_rows: int,
          batch_size: int | None = None, curve_eval_rows: int | None = None) -> RunSpec:
    return RunSpec(
        system=s.system,
        data_dir=data_dir,
        mlp=mlp,
        batch_size=batch_size or profile.batch_size,
        seed=seed,
        threads=s.threads or profile.baseline_threads,
        train_rows=train_rows,
        test_rows=test_rows,
        eval_points=profile.eval_points,
        curve_eval_rows=min(curve_eval_rows or profile.curve_eval_rows, test_rows),
        num_ps=s.num_ps,
        num_embedding_workers=s.num_embedding_workers,
        staleness=(s.staleness or profile.hybrid_staleness) if s.system == "persia-hybrid" else None,
        nn_threads=_nn_threads(s, profile),
        fused=s.fused,
        colocate_ps=s.colocate_ps,
        replay=s.replay,
        cpu_placement=s.cpu_placement,
        timeout_s=profile.run_timeout_s,
    )


def plan(profile: Profile, data_dir: str, systems: set[str] | None = None, parts: frozenset[str] = frozenset({"models", "latency"}),
         models: set[str] | None = None) -> list[Planned]:
    """Every run, in execution order: per model, round r runs each system once with seed r, so
    the repeats of different systems interleave (drift in machine load hits all of them alike);
    then the latency runs, round r running torch once and every delay x system."""
    out: list[Planned] = []
    for model in profile.models if "models" in parts else ():
        if models is not None and model.key not in models:
            continue
        chosen = [s for s in model.systems if systems is None or s.system in systems]
        rounds = max((s.repeats or profile.repeats for s in chosen), default=0)
        for r in range(rounds):
            for s in chosen:
                if r < (s.repeats or profile.repeats):
                    spec = _spec(s, profile, data_dir, model.mlp, r, model.train_rows, model.test_rows,
                                 model.batch_size, model.curve_eval_rows)
                    out.append(Planned(model.key, spec))
    lat = profile.latency if "latency" in parts else None
    if lat is not None:
        rows = (lat.train_rows, lat.test_rows)
        chosen = [s for s in lat.systems if systems is None or s.system in systems]
        with_base = lat.baseline is not None and (systems is None or lat.baseline.system in systems)
        for r in range(lat.repeats or profile.repeats):
            if with_base:
                out.append(Planned(latency_group(None), _spec(lat.baseline, profile, data_dir, lat.mlp, r, *rows)))
            for d in lat.delays_ms:
                for s in chosen:
                    if r >= (s.repeats or lat.repeats or profile.repeats):
                        continue
                    spec = _spec(s, profile, data_dir, lat.mlp, r, *rows)
                    if s.system == "persia-hybrid":
                        spec = spec.model_copy(update={"staleness_warmup_steps": lat.hybrid_warmup_steps})
                    out.append(Planned(latency_group(d), spec, delay_ms=d))
    return out


def plan_runs(profile: Profile, data_dir: str, systems: set[str] | None = None) -> list[RunSpec]:
    return [p.spec for p in plan(profile, data_dir, systems)]


def command_for(spec: RunSpec, launcher: str | None, delay_ms: float | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one run; ``delay_ms``: our system behind the delaying proxies."""
    if spec.system in BASELINE_MODULES:
        return [sys.executable, "-m", BASELINE_MODULES[spec.system], "--spec", spec.model_dump_json()], child_env(shared_cores=False)
    if launcher is None:
        raise ValueError(f"system={spec.system!r} needs persia-launcher, which is not available")
    argv, env = synthetic_command(spec, launcher)
    if delay_ms is not None:
        argv = [sys.executable, "-m", "bench.latency_run", "--delay-ms", f"{delay_ms:g}", "--", *argv]
    return argv, env


def run_log_name(index: int, group: str, spec: RunSpec, prefix: str = "") -> str:
    """The log file of one planned run: its place in the plan, its group, configuration and seed."""
    return f"{prefix}{index:03d}-{group}-{spec.label.replace(' ', '_').replace('=', '')}-s{spec.seed}.log"


def execute(argv: list[str], env: dict[str, str], timeout_s: float, log_path: Path,
            sample_interval_s: float = 0.2, during: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run one command in its own session, sample its tree's memory and CPU, parse its PERSIA_RESULT.
    A result that names its training window (``train_window_unix``) also gets each role's CPU inside
    it (``training_cpu_s``), start-up and shutdown left out. ``during(pid)``, if given, runs on a
    thread of its own while the command does (what it raises, the caller gets)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    load_at_start = os.getloadavg()[0]  # other work on the machine shows up here (ours adds ~2)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        sampler = PeakMemorySampler(proc.pid, sample_interval_s).start()
        watcher = _Watcher(during, proc.pid) if during is not None else None
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
    if watcher is not None:
        watcher.join()
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
    window = (result or {}).get("train_window_unix")
    if window:
        try:
            record["training_cpu_s"] = cpu_between(sampler.series, *window)
        except ValueError as e:
            record["training_cpu_reason"] = str(e)
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


class _Watcher(threading.Thread):
    """``execute``'s ``during(pid)`` on its own thread; ``join`` raises what it raised."""

    def __init__(self, fn: Callable[[int], None], pid: int):
        super().__init__(name="bench-during", daemon=True)
        self.fn, self.pid, self.error = fn, pid, None
        self.start()

    def run(self) -> None:
        try:
            self.fn(self.pid)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by join()
            self.error = exc

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


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
    only_latency: bool = False,
    models: set[str] | None = None,
) -> dict[str, Any]:
    """Run the profile (or, with ``only_latency``, its latency part, or with ``models`` those model
    groups alone, merged into the runs.json already in ``results_dir``), write runs.json and the
    report."""
    t0 = time.perf_counter()
    results_dir.mkdir(parents=True, exist_ok=True)
    data_dir = data_dir or results_dir / "data" / profile.name
    manifest = generate_dataset(data_dir, profile.data)
    log(
        f"data: {manifest.splits['train'].rows} train / {manifest.splits['test'].rows} test rows in {data_dir} "
        f"(teacher test AUC {manifest.teacher.test_auc:.4f}, vocab {sum(manifest.vocab_sizes)} IDs)"
    )
    machine = machine_probe.probe()  # before any run: what this machine's figures mean
    log(f"machine: {machine_probe.describe(machine)}")
    persia_reason = None
    launcher = None
    # --models re-runs some model groups into the last full run (merge_models); latency has its own
    parts = frozenset({"latency"} if only_latency else {"models"} if models is not None else {"models", "latency"})
    planned = plan(profile, str(data_dir), systems, parts, models)
    wants_persia = any(p.spec.system.startswith("persia") for p in planned)
    if wants_persia and (systems is None or any(s.startswith("persia") for s in systems)):
        persia_reason = launcher_unavailable_reason()
        launcher = None if persia_reason else find_launcher()
        if persia_reason:
            log(f"our system: not yet measured ({persia_reason})")

    runs: list[dict[str, Any]] = []
    skip_reason: dict[tuple[str, str], str] = {}
    logs_dir = results_dir / "logs"
    stale = (["latency-*.log"] if only_latency else [f"*-{m}-*.log" for m in sorted(models)] if models is not None
             else ["*.log"])
    for pattern in stale:  # a previous run's would read as this run's
        for old in logs_dir.glob(pattern):
            old.unlink()
    for i, p in enumerate(planned):
        spec = p.spec
        key = (spec.system, p.group)
        base = {"spec": spec.model_dump(), "label": spec.label, "mlp": p.group, "seed": spec.seed, "delay_ms": p.delay_ms}
        if spec.system.startswith("persia") and persia_reason:
            skip_reason[key] = f"not yet measured: {persia_reason}"
        if key in skip_reason:
            runs.append({**base, "status": "skipped", "reason": skip_reason[key], "result": None, "memory": {}})
            continue
        argv, env = command_for(spec, launcher, p.delay_ms)
        prefix = "latency-" if p.group.startswith("latency") else ""
        rec = execute(argv, env, spec.timeout_s, logs_dir / run_log_name(i, p.group, spec, prefix))
        rec = {**base, **rec}
        runs.append(rec)
        res = rec["result"] or {}
        log(
            f"[{i + 1}/{len(planned)}] {p.group:14s} {spec.label:38s} seed {spec.seed}: {rec['status']:7s} "
            f"{_fmt(res.get('samples_per_sec'), '9.0f')} samples/s  AUC {_fmt(res.get('auc'))}  "
            f"wall {rec['wall_seconds']:.1f}s" + (f"  ({rec.get('reason')})" if rec["status"] != "ok" else "")
        )
        if rec["status"] == "skipped":
            skip_reason[key] = rec["reason"]

    path_cpu: dict[str, Any] = {"status": "skipped", "reason": "not part of this profile"}
    path_cpu_colocated = path_cpu
    path_cpu_targets: dict[str, dict[str, Any]] = {}
    if profile.path_cpu_rows and not only_latency and models is None:
        if launcher is None:
            path_cpu = {"status": "skipped", "reason": f"not yet measured: {persia_reason or 'not run: --systems leaves out our system'}"}
            path_cpu_colocated = path_cpu
            path_cpu_targets = {t.target: path_cpu for t in profile.path_cpu_targets}
        else:
            from bench.path_cpu import measure_pairs

            def path(rows: tuple[int, int], pairs: int, batch_size: int, mlp: str = "mlp400",
                     colocate_ps: bool = False) -> dict[str, Any]:
                try:
                    return {"status": "ok", **measure_pairs(
                        launcher, data_dir, *rows, pairs, logs_dir,
                        staleness=profile.hybrid_staleness, nn_threads=profile.persia_nn_threads or "auto",
                        batch_size=batch_size, log=log, colocate_ps=colocate_ps, mlp=mlp)}
                except RuntimeError as exc:
                    return {"status": "failed", "reason": str(exc)}

            path_cpu = path(profile.path_cpu_rows, profile.repeats, profile.batch_size)
            if profile.path_cpu_colocated_pairs:  # each PS replica inside its embedding worker's process
                path_cpu_colocated = path(profile.path_cpu_rows, profile.path_cpu_colocated_pairs,
                                          profile.batch_size, colocate_ps=True)
            for t in profile.path_cpu_targets:
                path_cpu_targets[t.target] = path(t.rows, min(t.pairs, profile.repeats), t.batch_size, t.mlp)

    dense_step: dict[str, dict[str, Any]] = {}
    if not only_latency and models is None:
        from bench.dense_step import measure_for_bound

        for d in profile.dense_step_targets:
            dense_step[d.target] = measure_for_bound(d.mlp, d.batch_size, d.steps, os.cpu_count())
            per = dense_step[d.target].get("threads") or {}
            log(f"dense step alone, {d.mlp} batch {d.batch_size}: " + (", ".join(
                f"{n} thread(s) {r['ms_per_step']:.1f} ms" for n, r in per.items()) or dense_step[d.target]["reason"]))

    adult: dict[str, Any] = {"status": "skipped", "reason": "not part of this profile"}
    if profile.adult_income and not only_latency and models is None:
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
            **machine,
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
        "path_cpu": path_cpu,
        "path_cpu_colocated": path_cpu_colocated,
        "path_cpu_targets": path_cpu_targets,
        "dense_step": dense_step,
        "total_seconds": time.perf_counter() - t0,
    }
    report_docs: Path | None = docs_dir
    if only_latency:
        if not (results_dir / "runs.json").is_file():
            # the report would show every model as unmeasured: leave the docs to a full `make bench`
            log(f"no earlier {results_dir / 'runs.json'}: latency figures go to e2e.json only, docs untouched")
            report_docs = None
        doc = merge_latency(results_dir / "runs.json", doc)
    elif models is not None:
        doc = merge_models(results_dir / "runs.json", doc)
    (results_dir / "runs.json").write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
    from bench.report import write_report  # late: matplotlib only when reporting

    headline = write_report(doc, docs_dir=report_docs, results_dir=results_dir)
    doc["total_seconds"] = time.perf_counter() - t0
    log(f"total {doc['total_seconds']:.0f}s; wrote {results_dir / 'e2e.json'}" + (f" and {report_docs / 'benchmarks.md'}" if report_docs else ""))
    for k, v in headline.items():
        if k not in ("notes", "targets"):
            log(f"  {k} = {v}" + (f"  ({headline['notes'][k]})" if k in headline["notes"] else ""))
    for t in headline["targets"].values():
        verdict = {True: "PASS", False: "FAIL", None: "not yet measured"}[t["passed"]]
        log(f"  target {t['what']} {t['target']}: {_fmt(t['value'])} {verdict}")
    return doc


def merge_latency(previous: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (latency runs only) merged into the previous runs.json: its model runs, adult-income
    result and profile kept, its latency runs replaced, and the machine probed for them kept beside
    the one the model runs were measured on (``latency_machine``: figures from different days are
    only comparable with their machine's). Without a previous file, ``doc`` alone."""
    if not previous.is_file():
        return doc
    old = json.loads(previous.read_text())
    kept = [r for r in old.get("runs", []) if not str(r.get("mlp", "")).startswith("latency")]
    return {**old, "runs": kept + doc["runs"], "latency_machine": doc["machine"],  # path_cpu kept too
            "latency_updated": time.strftime("%Y-%m-%d %H:%M:%S")}


def merge_models(previous: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (a ``--models`` run: some model groups alone) merged into the previous runs.json:
    the groups it ran replace theirs, every other group, the path CPU and adult-income result are
    kept, and each replaced group records when and on what machine it was measured
    (``groups_updated``), so the report can say which figures come from another run. Without a
    previous file, ``doc`` alone."""
    if not previous.is_file():
        return doc
    old = json.loads(previous.read_text())
    ran = {r["mlp"] for r in doc["runs"]}
    kept = [r for r in old.get("runs", []) if r.get("mlp") not in ran]
    stamp = {"at": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": doc["machine"]}
    updated = {**(old.get("groups_updated") or {}), **{group: stamp for group in sorted(ran)}}
    return {**old, "runs": kept + doc["runs"], "groups_updated": updated}


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
    p.add_argument("--models", help="comma list of model groups to run again (e.g. mlp400,mlp400_b1024), merged into "
                                    "the existing runs.json in place of theirs (no latency, path CPU or adult-income "
                                    "runs); default: the whole profile")
    p.add_argument("--only-latency", action="store_true",
                   help="only the latency runs (make bench-latency), merged into the existing runs.json")
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
        unknown = systems - set(BASELINE_MODULES) - {"persia-hybrid", "persia-sync"}
        if unknown:
            p.error(f"unknown --systems {sorted(unknown)}")
    if a.output_root:
        results_dir, docs_dir = a.output_root / "results", a.output_root / "docs"
    else:
        results_dir, docs_dir = RESULTS_DIR, DOCS_DIR
    models = {m.strip() for m in a.models.split(",") if m.strip()} if a.models else None
    if models is not None and models - {m.key for m in profile.models}:
        p.error(f"unknown --models {sorted(models - {m.key for m in profile.models})}; the profile has {[m.key for m in profile.models]}")
    run_profile(profile, results_dir, docs_dir, a.data_dir, systems, only_latency=a.only_latency, models=models)
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install_interrupt_handler() -> None:
    """SIGTERM unwinds like Ctrl-C, so ``execute`` kills the run in progress (its own session)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


if __name__ == "__main__":
    sys.exit(main())
