"""``make bench-gpu`` (bench/gpu_bench.py): its plan, its summary, its refusal without a GPU, and
one small run of its pipeline on the CPU (the CUDA runs themselves need a GPU machine:
docs/benchmarks.md, "GPU")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_bench
from bench.gpu_bench import GpuSystem, GpuWorkload, markdown, plan, ratios, run
from bench.spec import RunSpec
from bench.summary import summarize
from synthetic_ctr.manifest import GeneratorConfig
from synthetic_ctr.settings import ENV_NAMES, ExampleSettings

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_plan_interleaves_seeds_and_runs_the_ratio_sides_every_seed():
    planned = plan("d", repeats=2, threads=16)
    per_workload = [s for k, s in planned if k == "mlp400"]
    assert [s.seed for s in per_workload] == [0, 0, 0, 0, 0, 1, 1]
    seed1 = {s.label for s in per_workload if s.seed == 1}
    assert seed1 == {"torch fused threads=16 cuda", "persia-hybrid st=10 ps=1 ew=1 nn-threads=auto cuda"}
    labels = {s.label for s in per_workload}
    assert "persia-hybrid st=10 ps=1 ew=1 nn-threads=auto cuda amp" in labels
    assert "persia-hybrid st=10 ps=1 ew=1 nn-threads=auto" in labels  # the same on the CPU
    assert "persia-sync ps=1 ew=1 nn-threads=auto cuda" in labels
    assert {k for k, _ in planned} == {w.key for w in gpu_bench.WORKLOADS}


def test_mixed_precision_is_refused_where_nothing_would_use_it():
    with pytest.raises(ValueError, match="mixed_precision=True needs device='cuda'.*device='cpu'"):
        RunSpec(system="persia-hybrid", data_dir="d", mixed_precision=True)
    with pytest.raises(ValueError, match="system='torch'"):
        RunSpec(system="torch", data_dir="d", device="cuda", mixed_precision=True)


def test_device_settings_reach_the_nn_worker_through_the_environment():
    from bench.persia_local import example_settings

    spec = RunSpec(system="persia-hybrid", data_dir="d", device="cuda", mixed_precision=True)
    env = example_settings(spec).to_env()
    assert env[ENV_NAMES["device"]] == "cuda" and env[ENV_NAMES["mixed_precision"]] == "1"
    assert ExampleSettings.from_env(env).device == "cuda"
    with pytest.raises(ValueError, match="SYNTHETIC_CTR_DEVICE='gpu'"):
        ExampleSettings.from_env({ENV_NAMES["data_dir"]: "d", ENV_NAMES["device"]: "gpu"})


def _run(key, label, device, sps, auc, seed=0, amp=False, gpu=None):
    result = {"samples_per_sec": sps, "auc": auc, "train_seconds": 1.0}
    if gpu:
        result["gpu_memory_mb"] = gpu
    return {"mlp": key, "label": label, "seed": seed, "status": "ok", "wall_seconds": 5.0,
            "spec": {"system": label.split()[0], "device": device, "mixed_precision": amp}, "result": result}


def test_ratios_and_table_use_the_medians_of_the_matching_device():
    runs = [
        _run("ffnn", "torch fused threads=16 cuda", "cuda", 40_000, 0.70, gpu={"allocated": 100.0, "reserved": 120.0}),
        _run("ffnn", "torch fused threads=16 cuda", "cuda", 20_000, 0.70, seed=1),
        _run("ffnn", "persia-hybrid st=10 cuda", "cuda", 9_000, 0.69),
        _run("ffnn", "persia-hybrid st=10 cuda", "cuda", 11_000, 0.69, seed=1),
        _run("ffnn", "persia-hybrid st=10 cuda amp", "cuda", 50_000, 0.69, amp=True),
        _run("ffnn", "persia-hybrid st=10", "cpu", 2_500, 0.69),
    ]
    summary = gpu_bench.with_gpu_memory(summarize(runs), runs)
    r = ratios(summary, ["ffnn"])["ffnn"]
    assert r["hybrid_over_torch_gpu"] == pytest.approx(10_000 / 30_000)  # medians, not the AMP run
    assert r["hybrid_gpu_over_cpu"] == pytest.approx(10_000 / 2_500)
    table = markdown(summary, ["ffnn"])
    assert "| ffnn | torch fused threads=16 cuda | 2/2 | 30,000 (20,000-40,000) | 0.7000 | 100 / 120 |" in table
    assert "hybrid_over_torch_gpu 0.333" in table


def test_a_failed_side_leaves_no_ratio_and_says_so():
    runs = [_run("mlp400", "torch fused threads=16 cuda", "cuda", 30_000, 0.8)]
    failed = {**_run("mlp400", "persia-hybrid st=10 cuda", "cuda", None, None), "status": "failed",
              "reason": "exit status 1 (see x.log)", "result": None}
    summary = summarize(runs + [failed])
    assert ratios(summary, ["mlp400"])["mlp400"]["hybrid_over_torch_gpu"] is None
    table = markdown(gpu_bench.with_gpu_memory(summary, runs + [failed]), ["mlp400"])
    assert "failed: exit status 1 (see x.log)" in table and "no ratio (a side failed or did not run)" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_refuses_naming_why(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_bench", "--output", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "sees no CUDA device" in proc.stderr
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.slow
def test_the_pipeline_runs_a_small_cpu_plan_end_to_end(tmp_path):
    """The same run loop on the CPU: data, every run's record, gpu.json, the table."""
    systems = (GpuSystem("torch", device="cpu", fused=True), GpuSystem("persia-hybrid", device="cpu"))
    workload = GpuWorkload("mlp400", "mlp400", 256, 2_000, 1_000)
    planned = plan(str(tmp_path / "data"), repeats=1, threads=1, workloads=(workload,), systems=systems)
    lines: list[str] = []
    doc = run(planned, tmp_path, tmp_path / "data", ["mlp400"],
              data=GeneratorConfig(train_rows=2_000, test_rows=1_000, seed=0, scale=0.001), log=lines.append)
    assert [r["status"] for r in doc["runs"]] == ["ok", "ok"], [r.get("reason") for r in doc["runs"]]
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert len(saved["runs"]) == 2 and saved["runs"][1]["result"]["device"] == "cpu"
    assert saved["runs"][1]["result"]["gpu_memory_mb"] is None
    assert any("| mlp400 | torch fused threads=1 |" in line for line in lines)
    assert saved["ratios"]["mlp400"] == {"hybrid_over_torch_gpu": None, "hybrid_gpu_over_cpu": None}
