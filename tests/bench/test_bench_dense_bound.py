"""What the NN worker's dense step allows each throughput target (bench.summary.dense_bound): the
pure bound, its plumbing through headline and the report, and the measurement's failure path.
Figures here are made up; bench/dense_step.py's timing itself is tested in test_bench_dense_step."""

import subprocess

import pytest

from bench.dense_step import measure_for_bound, thread_counts
from bench.report import render_dense_bound
from bench.summary import HYBRID, dense_bound, headline, summarize


def _dense(one_ms: float, one_cpu: float, two_ms: float, two_cpu: float) -> dict:
    return {"1": {"ms_per_step": one_ms, "cpu_per_wall": one_cpu}, "2": {"ms_per_step": two_ms, "cpu_per_wall": two_cpu}}


def test_one_thread_is_bounded_by_its_dense_step_and_two_by_the_cpu_they_leave_the_rest():
    # baseline 51,200 samples/s at batch 1024: 20 ms a step. Our job: 30 µs a sample of CPU in all,
    # trained on 1 thread, whose dense step alone is 24 ms of 24 ms CPU -> 30.72 - 24 = 6.72 ms else.
    b = dense_bound(1024, 51_200.0, 0.8, _dense(24.0, 1.0, 15.0, 1.8), cores=2, all_roles_us=30.0,
                    trained_threads=1, measured_sps=32_000.0)
    assert b["baseline_ms"] == pytest.approx(20.0) and b["rest_ms"] == pytest.approx(6.72)
    one, two = b["threads"]["1"], b["threads"]["2"]
    assert one["limited_by"] == "dense step" and one["ratio_bound"] == pytest.approx(20.0 / 24.0)
    # two threads: 15 ms alone, but 27 ms of CPU + 6.72 on 2 cores is 16.86 ms a step
    assert two["limited_by"] == "CPU" and two["step_bound_ms"] == pytest.approx((27.0 + 6.72) / 2)
    assert b["best"] == "2" and b["ratio_bound"] == pytest.approx(20.0 / 16.86)
    assert b["measured_ratio"] == pytest.approx(0.625)


def test_without_the_jobs_cpu_only_the_dense_step_bounds_and_bad_input_is_refused():
    b = dense_bound(256, 25_600.0, 0.6, _dense(8.0, 1.0, 10.0, 1.5))
    assert b["rest_ms"] is None and b["best"] == "1" and b["ratio_bound"] == pytest.approx(10.0 / 8.0)
    assert b["threads"]["2"]["cpu_bound_ms"] is None and b["measured_ratio"] is None
    # the count the job trained on was not measured alone: its CPU cannot be taken out
    assert dense_bound(256, 25_600.0, 0.6, _dense(8.0, 1.0, 10.0, 1.5), cores=2, all_roles_us=50.0,
                       trained_threads=4)["rest_ms"] is None
    with pytest.raises(ValueError, match="must be positive"):
        dense_bound(256, 0.0, 0.6, _dense(8.0, 1.0, 10.0, 1.5))
    with pytest.raises(ValueError, match="dense measured"):
        dense_bound(256, 25_600.0, 0.6, {})


def _run(mlp: str, label: str, system: str, sps: float, threads: int | None = None) -> dict:
    return {"mlp": mlp, "label": label, "seed": 0, "status": "ok", "wall_seconds": 10.0,
            "spec": {"system": system},
            "result": {"samples_per_sec": sps, "auc": 0.8, "threads": threads, "train_seconds": 5.0}}


def test_headline_and_report_show_the_bound_of_each_measured_target():
    runs = [_run("mlp400_b1024", "torch threads=2", "torch", 51_200.0),
            *(_run("mlp400_b1024", HYBRID, "persia-hybrid", sps, threads)
              for sps, threads in ((32_000.0, 1), (30_000.0, 2), (31_000.0, 1)))]
    summary = summarize(runs)
    assert next(s for s in summary if s["label"] == HYBRID)["threads"] == 1  # most runs' count, not the first's
    path = {"status": "ok", "median_us_per_sample": {"all_roles": 30.0}}
    dense = {"ratio_mlp400_b1024": {"status": "ok", "mlp": "mlp400", "batch_size": 1024,
                                    "threads": _dense(24.0, 1.0, 15.0, 1.8)},
             "ratio_ffnn": {"status": "failed", "reason": "dense step not measured: boom"}}
    h = headline(summary, None, path_cpu_targets={"ratio_mlp400_b1024": path}, cores=2, dense_step=dense)
    bK = h["dense_bound"]["ratio_mlp400_b1024"]
    assert bK["trained_threads"] == 1 and bK["ratio_bound"] == pytest.approx(20.0 / 16.86)
    assert h["dense_bound"]["ratio_ffnn"] == {"missing": "dense step not measured: boom"}
    assert "ratio_mlp400" not in h["dense_bound"]  # not measured at all: no row
    text = render_dense_bound(h["dense_bound"], 2)
    assert ("| 20.00 | 24.0 / 24.0 (dense step) / 0.833 | 15.0 / 16.9 (CPU) / **1.186** | 1 thread(s) | >= 0.8 | "
            "0.605 |") in text
    assert "not measured: dense step not measured: boom |" in text
    assert headline(summary, None)["dense_bound"] == {}


def test_the_measurement_runs_each_thread_count_the_tuner_may_pick_and_says_why_it_failed():
    assert thread_counts(2) == (1, 2) and thread_counts(1) == (1,) and thread_counts(8) == (1, 4, 8)
    calls = []
    slow_minute = iter([1.0, 1.5, 1.3, 1.0, 1.0, 1.2])  # what the host's speed does to each run

    def runner(mlp, batch_size, steps, threads, policy):
        calls.append((threads, policy))
        return {"ms_per_step": 10.0 * threads * next(slow_minute), "samples_per_sec": 1.0, "cpu_per_wall": 1.0}

    got = measure_for_bound("8,8", 32, 3, 2, repeats=3, runner=runner)
    assert got["status"] == "ok" and set(got["threads"]) == {"1", "2"}
    assert calls == [(1, "PASSIVE"), (2, "PASSIVE"), (2, "PASSIVE"), (1, "PASSIVE"), (1, "PASSIVE"), (2, "PASSIVE")]
    # each count keeps its fastest run: a slow minute never makes the dense step look slower than it is
    assert got["threads"]["1"]["ms_per_step"] == 10.0 and got["threads"]["1"]["ms_all"] == [10.0, 10.0, 10.0]
    assert got["threads"]["2"]["ms_per_step"] == 24.0 and got["threads"]["2"]["ms_all"] == [30.0, 26.0, 24.0]

    def failing(*_):
        raise subprocess.CalledProcessError(1, ["python"], stderr="Traceback...\nRuntimeError: no torch here\n")

    bad = measure_for_bound("8,8", 32, 3, 2, runner=failing)
    assert bad["status"] == "failed" and bad["reason"] == "dense step not measured: RuntimeError: no torch here"


def test_the_full_profile_bounds_every_throughput_target_by_its_dense_step():
    from bench.e2e_bench import PROFILES
    from bench.summary import TARGETS

    plans = PROFILES["full"].dense_step_targets
    assert {d.target for d in plans} == {"ratio_mlp400", "ratio_mlp400_b1024", "ratio_ffnn"} <= set(TARGETS)
    assert {(d.mlp, d.batch_size) for d in plans} == {("mlp400", 256), ("mlp400", 1024), ("ffnn", 256)}
