"""GPU benchmark (``make bench-gpu``), for a machine with a CUDA GPU; ``make bench`` stays CPU-only.

Per workload, interleaved by seed: the fastest torch baseline on the GPU (fused embedding bag and
optimizers, the epoch in GPU memory), our hybrid and synchronous modes with the NN worker's dense
model on the GPU (float32 and mixed precision), and our hybrid mode on the CPU. The embeddings of
our system stay on the PS in host memory, so a GPU run measures how much of the embedding path the
GPU leaves exposed. Every process gets the whole machine. Writes ``gpu.json`` (every run, after
each one, so a run cut short keeps what it measured) and prints a Markdown table of medians for
docs/benchmarks.md, "GPU".

    python -m bench.gpu_bench --output DIR [--repeats 2] [--models mlp400,ffnn]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.e2e_bench import command_for, execute, install_interrupt_handler, run_log_name
from bench.persia_local import find_launcher, launcher_unavailable_reason
from bench.spec import DEFAULT_HYBRID_STALENESS, RunSpec
from bench.summary import summarize
from synthetic_ctr.generate import generate_dataset
from synthetic_ctr.manifest import GeneratorConfig


@dataclass(frozen=True)
class GpuSystem:
    system: str
    device: str = "cuda"
    mixed_precision: bool = False
    fused: bool = False
    repeats: int | None = None  # None: the run's repeats


@dataclass(frozen=True)
class GpuWorkload:
    key: str
    mlp: str
    batch_size: int
    train_rows: int
    test_rows: int


# The ratio's two sides run every seed; the rest give context once.
SYSTEMS = (
    GpuSystem("torch", fused=True),
    GpuSystem("persia-hybrid"),
    GpuSystem("persia-hybrid", mixed_precision=True, repeats=1),
    GpuSystem("persia-sync", repeats=1),
    GpuSystem("persia-hybrid", device="cpu", repeats=1),
)
# The synthetic data of `make bench` (same generator settings), fewer rows: about 470 steps of
# MLP 400 at batch 256 and 230 of batch 1024, enough to pass the NN worker's thread tuning.
DATA = GeneratorConfig(train_rows=240_000, test_rows=20_000, seed=0, scale=0.01)
WORKLOADS = (
    GpuWorkload("mlp400", "mlp400", 256, 120_000, 20_000),
    GpuWorkload("mlp400_b1024", "mlp400", 1024, 240_000, 20_000),
    GpuWorkload("ffnn", "ffnn", 256, 60_000, 10_000),
)
TORCH = "torch fused"  # label prefixes the summary looks for
HYBRID = "persia-hybrid"


def _log(message: str) -> None:
    print(message, flush=True)


def spec_for(s: GpuSystem, w: GpuWorkload, data_dir: str, seed: int, threads: int) -> RunSpec:
    return RunSpec(
        system=s.system, data_dir=data_dir, mlp=w.mlp, batch_size=w.batch_size, seed=seed,
        threads=threads, train_rows=w.train_rows, test_rows=w.test_rows, eval_points=2,
        curve_eval_rows=min(5_000, w.test_rows), fused=s.fused,
        staleness=DEFAULT_HYBRID_STALENESS if s.system == "persia-hybrid" else None,
        nn_threads="auto" if s.system.startswith("persia") else None,
        device=s.device, mixed_precision=s.mixed_precision, timeout_s=300.0,
    )  # fmt: skip


def plan(data_dir: str, repeats: int, threads: int, workloads=WORKLOADS, systems=SYSTEMS) -> list[tuple[str, RunSpec]]:
    """(workload key, spec) in execution order: round r runs every system of a workload with seed r."""
    out = []
    for w in workloads:
        for r in range(repeats):
            out += [(w.key, spec_for(s, w, data_dir, r, threads)) for s in systems if r < (s.repeats or repeats)]
    return out


def _row(summary: list[dict[str, Any]], key: str, startswith: str, device: str, amp: bool = False) -> dict[str, Any] | None:
    for row in summary:
        spec = row["spec"]
        if (row["mlp"] == key and row["label"].startswith(startswith) and spec.get("device") == device
                and bool(spec.get("mixed_precision")) == amp):
            return row
    return None


def ratios(summary: list[dict[str, Any]], keys: list[str]) -> dict[str, dict[str, float | None]]:
    """Per workload: hybrid on the GPU over torch on the GPU, and hybrid on the GPU over hybrid on
    the CPU (medians of samples/s)."""

    def div(a, b):
        return a["sps_median"] / b["sps_median"] if a and b and a["sps_median"] and b["sps_median"] else None

    out = {}
    for key in keys:
        torch_gpu = _row(summary, key, TORCH, "cuda")
        hybrid_gpu = _row(summary, key, HYBRID, "cuda")
        out[key] = {"hybrid_over_torch_gpu": div(hybrid_gpu, torch_gpu),
                    "hybrid_gpu_over_cpu": div(hybrid_gpu, _row(summary, key, HYBRID, "cpu"))}
    return out


def markdown(summary: list[dict[str, Any]], keys: list[str]) -> str:
    """One row per configuration: median samples/s (range), AUC, peak GPU memory."""
    lines = ["| workload | configuration | runs | samples/s, median (range) | test AUC | GPU MiB allocated / reserved |",
             "|---|---|---|---|---|---|"]
    for row in summary:
        if row["mlp"] not in keys:
            continue
        sps = row["sps_median"]
        cell = "failed: " + "; ".join(row["reasons"])[:120] if sps is None else (
            f"{sps:,.0f}" + (f" ({row['sps_min']:,.0f}-{row['sps_max']:,.0f})" if row["ok_runs"] > 1 else ""))
        auc = "—" if row["auc_mean"] is None else f"{row['auc_mean']:.4f}"
        mem = row.get("gpu_memory_mb")
        mem_cell = "—" if not mem else f"{mem['allocated']:.0f} / {mem['reserved']:.0f}"
        lines.append(f"| {row['mlp']} | {row['label']} | {row['ok_runs']}/{row['runs']} | {cell} | {auc} | {mem_cell} |")
    for key, r in ratios(summary, keys).items():
        parts = [f"{name} {value:.3f}" for name, value in r.items() if value is not None]
        lines.append(f"\n{key}: " + (", ".join(parts) if parts else "no ratio (a side failed or did not run)"))
    return "\n".join(lines)


def with_gpu_memory(summary: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The largest GPU memory any run of a configuration reported, beside its summary row."""
    for row in summary:
        peaks = [((r.get("result") or {}).get("gpu_memory_mb")) for r in runs
                 if r["mlp"] == row["mlp"] and r["label"] == row["label"]]
        peaks = [p for p in peaks if p]
        row["gpu_memory_mb"] = ({k: max(p[k] for p in peaks) for k in ("allocated", "reserved")} if peaks else None)
    return summary


def gpu_unavailable_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def describe_gpu() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_gib": props.total_memory / 2**30, "count": torch.cuda.device_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": str(torch.cuda.nccl.version())}


def run(planned: list[tuple[str, RunSpec]], output: Path, data_dir: Path, keys: list[str],
        machine: dict[str, Any] | None = None, data: GeneratorConfig = DATA, log=_log) -> dict[str, Any]:
    """Generate the data, run the plan, write gpu.json after every run, print the table."""
    t0 = time.perf_counter()
    manifest = generate_dataset(data_dir, data)
    launcher = find_launcher()
    doc: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), **(machine or {})},
                           "data": {"train_rows": manifest.splits["train"].rows, "teacher_test_auc": manifest.teacher.test_auc},
                           "runs": []}
    log(f"bench-gpu: {doc['machine']}; {len(planned)} runs")
    for i, (key, spec) in enumerate(planned):
        argv, env = command_for(spec, launcher)
        rec = execute(argv, env, spec.timeout_s, output / "logs" / run_log_name(i, key, spec))
        doc["runs"].append({"spec": spec.model_dump(), "label": spec.label, "mlp": key, "seed": spec.seed, **rec})
        res = rec["result"] or {}
        sps, auc = res.get("samples_per_sec"), res.get("auc")
        log(f"[{i + 1}/{len(planned)}] {key:13s} {spec.label:48s} seed {spec.seed}: {rec['status']:7s} "
            f"{'-' if sps is None else f'{sps:9.0f}'} samples/s AUC {'-' if auc is None else f'{auc:.4f}'} "
            f"wall {rec['wall_seconds']:.1f}s {rec.get('reason', '')}")
        doc["total_seconds"] = time.perf_counter() - t0
        (output / "gpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    summary = with_gpu_memory(summarize(doc["runs"]), doc["runs"])
    doc["ratios"] = ratios(summary, keys)
    doc["total_seconds"] = time.perf_counter() - t0
    (output / "gpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    log(markdown(summary, keys))
    log(f"total {doc['total_seconds']:.0f}s")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, required=True, help="directory for gpu.json, the data and the run logs")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--models", help=f"comma list of workloads (default all: {','.join(w.key for w in WORKLOADS)})")
    p.add_argument("--no-cpu", action="store_true", help="leave out our hybrid mode on the CPU (context, not a ratio's side)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be >= 1, got {a.repeats}")
    workloads = WORKLOADS
    if a.models:
        wanted = {m.strip() for m in a.models.split(",") if m.strip()}
        unknown = wanted - {w.key for w in WORKLOADS}
        if unknown:
            p.error(f"unknown --models {sorted(unknown)}; known: {[w.key for w in WORKLOADS]}")
        workloads = tuple(w for w in WORKLOADS if w.key in wanted)
    reason = gpu_unavailable_reason() or launcher_unavailable_reason()
    if reason:
        print(f"bench-gpu: cannot run: {reason}", file=sys.stderr)
        return 2
    install_interrupt_handler()
    a.output.mkdir(parents=True, exist_ok=True)
    data_dir = a.output / "data"
    threads = os.cpu_count() or 1
    systems = tuple(s for s in SYSTEMS if not (a.no_cpu and s.device == "cpu"))
    run(plan(str(data_dir), a.repeats, threads, workloads, systems), a.output, data_dir, [w.key for w in workloads],
        {"gpu": describe_gpu()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
