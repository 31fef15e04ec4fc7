"""bench/threads.py: the /proc parsing and the per-thread arithmetic, and a real process tree whose
threads are found by role and by the names they gave themselves."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from bench.procmem import PROC as PROC_DIR
from bench.threads import (MIN_SHARE, ThreadRate, ThreadSample, outside_training, parse_schedstat, parse_switches,
                           rates, role_totals, sample, table)

LINUX = sys.platform.startswith("linux")


def test_schedstat_gives_cpu_and_wait():
    assert parse_schedstat("123456789 2000 57\n") == (123456789, 2000)
    with pytest.raises(ValueError, match="schedstat"):
        parse_schedstat("")


def test_status_gives_both_switch_counts():
    status = "Name:\tpython\nState:\tS (sleeping)\nvoluntary_ctxt_switches:\t950\nnonvoluntary_ctxt_switches:\t12\n"
    assert parse_switches(status) == (950, 12)
    with pytest.raises(ValueError, match="voluntary"):
        parse_switches("Name:\tpython\n")


def _s(tid, cpu_ms, wait_ms, vol, invol, role="nn-worker", name="t"):
    return ThreadSample(role, 10, tid, name, int(cpu_ms * 1e6), int(wait_ms * 1e6), vol, invol)


def test_rates_per_second_and_per_batch():
    before = [_s(1, 100, 10, 50, 5, name="MainThread"), _s(2, 0, 0, 0, 0, name="replay"), _s(3, 5, 0, 1, 0)]
    after = [_s(1, 950, 60, 1050, 25, name="MainThread"), _s(2, 300, 100, 700, 0, name="replay"),
             _s(4, 10, 0, 3, 0, name="new")]  # 3 ended, 4 started in the window: both left out
    out = rates(before, after, seconds=1.0, batches_per_s=100.0)
    assert [r.tid for r in out] == [1, 2]  # busiest first
    main, replay = out
    assert main.cores == pytest.approx(0.85) and main.waiting == pytest.approx(0.05)
    assert main.sleeps_per_batch == pytest.approx(10.0) and main.preempted_per_batch == pytest.approx(0.2)
    assert replay.cores == pytest.approx(0.3) and replay.sleeps_per_batch == pytest.approx(7.0)


def test_rates_refuse_an_empty_window():
    with pytest.raises(ValueError, match="window"):
        rates([], [], seconds=0.0, batches_per_s=10.0)


def test_role_totals_and_cpu_per_sample():
    per = [ThreadRate("nn-worker", 1, "MainThread", 0.85, 0, 10, 0), ThreadRate("nn-worker", 2, "replay", 0.05, 0, 6, 0),
           ThreadRate("ps", 3, "python", 0.12, 0, 3, 0)]
    totals = role_totals(per, samples_per_s=24_000.0)
    assert list(totals) == ["nn-worker", "ps"]
    assert totals["nn-worker"]["cores"] == pytest.approx(0.9)
    assert totals["ps"]["us_per_sample"] == pytest.approx(0.12 / 24_000 * 1e6)


def test_a_window_outside_training_is_named():
    assert outside_training([100.0, 130.0], 110.0, 115.0) is None
    assert "before the first batch" in outside_training([100.0, 130.0], 98.0, 103.0)
    assert "after the last step" in outside_training([100.0, 130.0], 125.0, 131.5)
    assert "did not report" in outside_training(None, 1.0, 2.0)


def test_table_leaves_out_idle_threads():
    per = [ThreadRate("nn-worker", 1, "MainThread", 0.85, 0.0, 10.0, 0.5),
           ThreadRate("nn-worker", 2, "sigterm-watchdo", MIN_SHARE / 10, 0.0, 0.05, 0.0)]
    text = table(per, role_totals(per, 24_000.0), 24_000.0, 256)
    assert "| nn-worker | MainThread (1) | 0.850 |" in text
    assert "sigterm-watchdo" not in text
    assert "93.8 batches/s" in text


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_sample_finds_a_roles_threads_by_their_names(tmp_path):
    script = tmp_path / "data_loader.py"  # a command line bench.procmem classifies as a data loader
    script.write_text(textwrap.dedent("""
        import sys, threading, time
        from persia.thread_names import name_os_threads
        name_os_threads()
        stop, named = threading.Event(), threading.Semaphore(0)
        def spin():
            named.release()  # a thread names itself as it starts running, before its target
            while not stop.is_set():
                sum(range(1000))
        def idle():
            named.release()
            stop.wait()
        threading.Thread(target=spin, name="persia-busy", daemon=True).start()
        threading.Thread(target=idle, name="persia-idle", daemon=True).start()
        named.acquire(); named.acquire()
        print("ready", flush=True)
        sys.stdin.readline()
        stop.set()
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        first, t0 = sample(proc.pid), time.monotonic()
        names = {s.name for s in first}
        assert {"busy", "idle"} <= names and {s.role for s in first} == {"data-loader"}
        deadline = time.monotonic() + 30
        while True:  # until the spinning thread has used 50 ms more of a CPU
            later = sample(proc.pid)
            busy_then = next(s for s in first if s.name == "busy").cpu_ns
            if next(s for s in later if s.name == "busy").cpu_ns - busy_then >= 50_000_000:
                break
            assert time.monotonic() < deadline, "the spinning thread got no CPU in 30 s"
            time.sleep(0.02)  # between polls
        out = rates(first, later, time.monotonic() - t0, batches_per_s=1.0)
        by_name = {r.name: r for r in out}
        assert out[0].name == "busy" and by_name["busy"].cores > by_name["idle"].cores
        assert by_name["idle"].cores < MIN_SHARE
    finally:
        proc.communicate("\n", timeout=30)


def _result_command(wait_for: str) -> list[str]:
    """A command that prints a result line once ``wait_for`` exists (the watcher creates it)."""
    return [sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        from synthetic_ctr.results import format_result_line
        deadline = time.monotonic() + 30
        while not os.path.exists({wait_for!r}) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(format_result_line({{"samples_per_sec": 1.0, "seen": os.path.exists({wait_for!r})}}), flush=True)
    """)]


def test_execute_runs_during_beside_the_command(tmp_path):
    """bench.threads samples through ``execute(during=)``: it runs while the command does, on the
    command's pid, and what it raises reaches the caller."""
    from bench._paths import child_env
    from bench.e2e_bench import execute

    flag = tmp_path / "flag"
    pids = []

    def during(pid):
        pids.append(pid)
        assert (PROC_DIR / str(pid)).exists()  # the command is running
        flag.touch()

    rec = execute(_result_command(str(flag)), child_env(), 60, tmp_path / "a.log", during=during)
    assert rec["status"] == "ok" and rec["result"]["seen"] is True and len(pids) == 1

    def broken(pid):
        (tmp_path / "flag2").touch()
        raise RuntimeError("the sampler broke")

    with pytest.raises(RuntimeError, match="the sampler broke"):
        execute(_result_command(str(tmp_path / "flag2")), child_env(), 60, tmp_path / "b.log", during=broken)
