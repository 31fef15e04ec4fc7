"""Role classification and per-role peak memory of a real process tree."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.procmem import (PeakMemorySampler, add_cpu, classify_role, cpu_between, cpu_seconds, descendants,
                           role_cpu_at, summarize)


@pytest.mark.parametrize(
    "argv, role",
    [
        (["/v/bin/persia-launcher", "local", "--nn-worker", "train.py", "--data-loader", "data_loader.py"], "launcher"),
        (["/v/bin/nats-server", "-p", "-1"], "nats"),
        (["python", "-m", "persia.launcher", "embedding-parameter-server", "--port", "1"], "ps"),
        (["persia-launcher", "embedding-worker"], "embedding-worker"),
        (["python", "/ex/train.py"], "nn-worker"),
        (["python", "/ex/data_loader.py"], "data-loader"),
        (["python", "-m", "bench.torch_baseline", "--spec", "{}"], "trainer"),
        (["python", "-m", "bench.latency_run", "--delay-ms", "2", "--", "/v/bin/persia-launcher", "local"], "delay-proxy"),
        (["sleep", "1"], "other"),
    ],
)
def test_roles_from_command_lines(argv, role):
    assert classify_role(argv) == role


def test_summary_keeps_largest_process_sum_and_count():
    out = summarize([("ps", 100.0), ("ps", 140.0), ("nats", 10.0)])
    assert out["ps"] == {"max_mb": 140.0, "sum_mb": 240.0, "processes": 2}
    assert out["nats"]["processes"] == 1


def test_cpu_seconds_add_up_per_role():
    out = add_cpu(summarize([("ps", 100.0), ("ps", 140.0)]), [("ps", 1.5), ("ps", 2.0), ("nats", 0.25)])
    assert out["ps"]["cpu_s"] == 3.5 and out["ps"]["max_mb"] == 140.0
    assert out["nats"]["cpu_s"] == 0.25


BUSY = """
import time
t = time.process_time()
while time.process_time() - t < 0.5:
    pass
print("done", flush=True)
input()
"""


def test_cpu_seconds_of_a_busy_process_grow():
    proc = subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "done"  # it has burnt 0.5 s of CPU by now
        assert 0.4 <= cpu_seconds(proc.pid) < 30
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert cpu_seconds(proc.pid) is None  # gone: no figure rather than a wrong one


CHILD = """
import subprocess, sys
block = bytearray(150 * 1024 * 1024)  # touched below, so it is resident
for i in range(0, len(block), 4096):
    block[i] = 1
grandchild = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print("ready", grandchild.pid, flush=True)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


def test_sampler_sees_the_peak_of_every_process_in_the_tree():
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, "data_loader.py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        word, grandchild = proc.stdout.readline().split()  # waits until the memory is touched
        assert word == "ready"
        assert int(grandchild) in descendants(proc.pid)
        sampler = PeakMemorySampler(proc.pid)
        sampler.sample()
        peaks = sampler.result()
        assert peaks["data-loader"]["max_mb"] > 140
        assert peaks["data-loader"]["cpu_s"] > 0  # touching 150 MB takes CPU time
        assert peaks["other"]["processes"] == 1  # the grandchild, found through its parent
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


SERIES = [(100.0, {"launcher": 0.5}), (101.0, {"launcher": 1.0, "ps": 0.2}), (103.0, {"launcher": 1.0, "ps": 1.2})]


def test_role_cpu_is_interpolated_between_the_samples_around_a_time():
    assert role_cpu_at(SERIES, 100.0) == {"launcher": 0.5}
    assert role_cpu_at(SERIES, 101.0) == {"launcher": 1.0, "ps": 0.2}
    mid = role_cpu_at(SERIES, 102.5)
    assert mid["launcher"] == pytest.approx(1.0) and mid["ps"] == pytest.approx(0.95)
    early = role_cpu_at(SERIES, 100.5)  # the PS had not started at 100.0: it had used nothing
    assert early["ps"] == pytest.approx(0.1) and early["launcher"] == pytest.approx(0.75)


def test_cpu_between_leaves_out_what_came_before_and_after_the_window():
    out = cpu_between(SERIES, 101.0, 103.0)
    assert out["ps"] == pytest.approx(1.0) and out["launcher"] == pytest.approx(0.0)


@pytest.mark.parametrize("start, end, match", [(99.0, 101.0, "outside the sampled span 100.000..103.000"),
                                              (101.0, 104.0, "time 104.000 is outside"),
                                              (102.0, 101.0, "ends .* before it starts")])
def test_a_window_the_series_does_not_cover_is_refused(start, end, match):
    with pytest.raises(ValueError, match=match):
        cpu_between(SERIES, start, end)
    with pytest.raises(ValueError, match="empty series"):
        role_cpu_at([], 1.0)


BURST = """
import time
print("idle", time.time(), flush=True)
time.sleep(0.6)
t0 = time.time()
t = time.process_time()
while time.process_time() - t < 0.6:
    pass
print("burst", t0, time.time(), flush=True)
input()
"""


def _burst_series() -> tuple[list, float, float, float]:
    """A real process's CPU series, sampled every 50 ms from a thread here, and the times at
    which it went idle, began its 0.6 s burst and ended it."""
    proc = subprocess.Popen([sys.executable, "-c", BURST, "data_loader.py"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    sampler = PeakMemorySampler(proc.pid, interval_s=0.05).start()
    try:
        word, idle_from = proc.stdout.readline().split()
        assert word == "idle"
        word, start, end = proc.stdout.readline().split()  # the 0.6 s burst has ended by now
        assert word == "burst"
        sampler.sample()
        sampler.stop()
        return sampler.series, float(idle_from), float(start), float(end)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def _around(series: list, t: float, role: str = "data-loader") -> tuple[float, float]:
    """The wall time between the samples either side of ``t``, and the CPU ``role`` used between
    them: interpolating at ``t`` is off by at most that CPU (the true figure lies between the two).
    Infinite when no sample was taken on one side (the sampler started late)."""
    before = [s for s in series if s[0] <= t]
    after = [s for s in series if s[0] >= t]
    if not before or not after:
        return float("inf"), float("inf")
    before, after = before[-1], after[0]
    return after[0] - before[0], after[1].get(role, 0.0) - before[1].get(role, 0.0)


def test_the_series_puts_a_real_process_cpu_inside_the_window_it_was_spent():
    # The sampler is a thread in this process: on a loaded machine it may wake late, and a sample
    # taken long after an edge of the window blurs that edge. A run whose samples around the
    # edges are more than 0.1 s apart (twice the interval; the idle window keeps 0.1 s clear of
    # the burst) says too little, and is run again.
    for _ in range(5):
        series, idle_from, start, end = _burst_series()
        edges = {"idle from": idle_from + 0.1, "idle to": start - 0.1, "burst from": start, "burst to": end}
        around = {name: _around(series, t) for name, t in edges.items()}
        if max(gap for gap, _ in around.values()) <= 0.1:
            break
    else:
        pytest.fail(f"in 5 runs the sampler never kept its samples within 0.1 s around the edges: {around}")
    burst = cpu_between(series, start, end)["data-loader"]
    idle = cpu_between(series, idle_from + 0.1, start - 0.1).get("data-loader", 0.0)
    # the burst's CPU is in its window, give or take what was spent between the samples around
    # either edge (about 0.05 s each at full speed), and 0.07 s for /proc counting in clock ticks
    # (each read up to 0.02 s short: user and system time are rounded down apart)
    slack = around["burst from"][1] + around["burst to"][1] + 0.07
    assert abs(burst - 0.6) <= slack, (burst, around)
    assert idle < 0.1, (idle, around)  # and not in the idle second before it
