"""``bench.machine``: the wake-up and compute probe every ``make bench`` report opens with."""

from __future__ import annotations

import os

import pytest

from bench.machine import describe, matmul_gflops_one_thread, wake_round_trip_us
from bench.report import write_report
from tests.bench.test_bench_report import _doc


def test_a_round_trip_between_two_pinned_processes_is_timed():
    cpus = sorted(os.sched_getaffinity(0))
    same = wake_round_trip_us(cpus[0], cpus[0], round_trips=200, repeats=1)
    assert 0 < same < 100_000
    assert os.sched_getaffinity(0) == set(cpus)  # the caller's own CPU mask is given back
    if len(cpus) > 1:
        assert wake_round_trip_us(cpus[0], cpus[-1], round_trips=200, repeats=1) > 0


def test_a_cpu_this_process_may_not_use_is_refused_by_number():
    absent = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"cpu {absent} "):
        wake_round_trip_us(0, absent)
    with pytest.raises(ValueError, match="round_trips"):
        wake_round_trip_us(0, 0, round_trips=0)


def test_one_torch_threads_matmul_speed_is_measured():
    gflops = matmul_gflops_one_thread()
    assert gflops is not None and gflops > 0.1


def _report(doc, where) -> str:
    write_report(doc, docs_dir=where / "docs", results_dir=where / "results")
    return (where / "docs" / "benchmarks.md").read_text()


def test_the_report_says_what_machine_its_figures_come_from(tmp_path):
    probed = {"wake_round_trip_us_same_cpu": 9.2, "wake_round_trip_us_cross_cpu": 131.4,
              "matmul_gflops_one_thread": 85.7, "guest_halt_poll_ns": 0}
    line = describe(probed)
    assert "131 µs (9 µs on one CPU)" in line and "86 GFLOPS" in line and "halt polling 0 ns" in line
    doc = _doc()
    doc["machine"].update(probed)
    assert "2 CPUs (a wake-up round trip across CPUs 131 µs" in _report(doc, tmp_path / "new")
    # a runs.json from before the probe (no figures) renders as it did
    old = _doc()
    assert describe(old["machine"]) == ""
    assert "2 CPUs, every role" in _report(old, tmp_path / "old")
