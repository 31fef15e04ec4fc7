"""glibc malloc settings (persia.allocator): the decision, the effect on page faults, the wiring."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from persia import allocator
from persia.allocator import M_MMAP_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, allocator_plan, large_buffer_plan

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def test_plan_tunes_glibc_by_default():
    settings, why = allocator_plan({}, "glibc")
    assert settings == {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20}
    assert "32 MiB" in why and "64 MiB" in why


@pytest.mark.parametrize("value", ["0", "off", "OFF", "false"])
def test_plan_switched_off(value):
    settings, why = allocator_plan({"PERSIA_MALLOC_TUNING": value}, "glibc")
    assert settings == {} and "defaults" in why


@pytest.mark.parametrize("value", ["1", "on", ""])
def test_plan_switched_on(value):
    assert allocator_plan({"PERSIA_MALLOC_TUNING": value}, "glibc")[0]


def test_plan_names_a_bad_switch_value():
    with pytest.raises(ValueError, match=r"PERSIA_MALLOC_TUNING.*'sometimes'"):
        allocator_plan({"PERSIA_MALLOC_TUNING": "sometimes"}, "glibc")


@pytest.mark.parametrize("var", ["MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                                 "MALLOC_MMAP_MAX_"])
def test_plan_leaves_glibcs_own_settings_alone(var):
    settings, why = allocator_plan({var: "1048576"}, "glibc")
    assert settings == {} and var in why


def test_plan_other_c_libraries_untouched():
    settings, why = allocator_plan({}, "")
    assert settings == {} and "not glibc" in why


# A thread that allocates and frees three 1.4 MB buffers per round, as a role does per batch.
CHURN = textwrap.dedent("""
    import resource, sys, threading
    import numpy as np
    from persia.allocator import tune_allocator

    print(tune_allocator(), file=sys.stderr)

    def rounds(n):
        for _ in range(n):
            bufs = [np.ones(180_000) for _ in range(3)]
            del bufs

    def work(out):
        rounds(5)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        rounds(100)
        out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    out = []
    t = threading.Thread(target=work, args=(out,))
    t.start()
    t.join()
    print(out[0])
""")


def _churn_faults(**env: str) -> tuple[int, str]:
    """Faults of 100 rounds, and what ``tune_allocator`` said."""
    run_env = {k: v for k, v in os.environ.items() if k not in allocator.GLIBC_ENV}
    run_env.update(env)
    out = subprocess.run([sys.executable, "-c", CHURN], env=run_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1]), out.stderr


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_tuning_stops_the_page_fault_churn():
    untuned, _ = _churn_faults(PERSIA_MALLOC_TUNING="0")
    tuned, said = _churn_faults()
    assert "refused" not in said and "mmap threshold 32 MiB" in said, said  # glibc took both values
    # 100 rounds of three buffers of 352 pages each: glibc's defaults hand most of them back
    assert untuned > 100 * 300, f"the workload did not churn under glibc's defaults ({untuned} faults)"
    assert tuned < untuned / 50, f"tuned {tuned} faults against {untuned}"


def test_every_context_tunes_the_allocator(monkeypatch):
    from persia import context

    calls = []
    monkeypatch.setattr(context, "tune_allocator", lambda: calls.append(1))
    context.BaseCtx()
    assert calls == [1]


def test_launcher_names_a_bad_switch_value():
    env = dict(os.environ, PERSIA_MALLOC_TUNING="sometimes")
    out = subprocess.run([sys.executable, "-m", "persia.launcher", "embedding-parameter-server"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "PERSIA_MALLOC_TUNING" in out.stderr and "'sometimes'" in out.stderr


def test_large_buffer_plan_turns_mmap_off_under_the_same_switch():
    settings, why = large_buffer_plan({}, "glibc")
    assert settings == {M_MMAP_MAX: 0} and "heap" in why
    assert large_buffer_plan({"PERSIA_MALLOC_TUNING": "0"}, "glibc")[0] == {}
    assert large_buffer_plan({"MALLOC_MMAP_MAX_": "4"}, "glibc") == ({}, "MALLOC_MMAP_MAX_ set in the environment: glibc applies those")
    assert large_buffer_plan({}, "")[0] == {}


# A 32 MiB weight gradient made and freed every step, as a large model's backward does.
LARGE = textwrap.dedent("""
    import resource, sys
    import torch  # numpy would madvise its large buffers into huge pages; torch's allocator does not
    from persia.allocator import LargeBuffers, tune_allocator

    print(tune_allocator(), file=sys.stderr)
    span = LargeBuffers()
    if sys.argv[1] in ("keep", "after"):
        print(span.start(), file=sys.stderr)
    if sys.argv[1] == "after":
        span.stop()  # training over: large buffers are mapped (and given back) again

    def steps(n):
        for _ in range(n):
            grad = torch.ones((4096, 2048))  # 32 MiB plus malloc's header
            del grad

    def rss_mib():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

    steps(60)  # from the heap, the first steps' freed buffers are too small for the next, aligned one
    before, rss = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, rss_mib()
    steps(20)
    print(rss_mib() - rss, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_keeping_large_buffers_stops_their_page_faults():
    def faults(mode: str) -> tuple[int, float, str]:
        run_env = {k: v for k, v in os.environ.items() if k not in allocator.GLIBC_ENV}
        out = subprocess.run([sys.executable, "-c", LARGE, mode], env=run_env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        grew, n = out.stdout.split()[-2:]
        return int(n), float(grew), out.stderr

    mapped, _, _ = faults("tuned")
    after, _, _ = faults("after")
    kept, grew, said = faults("keep")
    assert "refused" not in said and "no mmap" in said, said
    # twenty steps of 8,192 pages each when every gradient is mapped afresh
    assert mapped > 20 * 8_000, f"the 32 MiB buffers were not mapped each step ({mapped} faults)"
    assert kept < mapped / 50, f"kept {kept} faults against {mapped}"
    assert abs(grew) < 1, f"the heap still grew by {grew:.1f} MiB in 20 steps"  # a steady state, not a leak
    assert after > 20 * 8_000, f"mmap was not back on after the span ({after} faults)"


def test_large_buffer_spans_nest_and_only_the_last_to_stop_turns_mmap_back_on(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_mallopt", lambda settings, why: calls.append(dict(settings)) or why)
    outer, inner = allocator.LargeBuffers({}), allocator.LargeBuffers({})
    if not outer.settings:
        pytest.skip("not glibc: nothing to set")
    outer.start(), inner.start(), inner.start()
    assert calls == [{M_MMAP_MAX: 0}]
    inner.stop(), inner.stop()
    assert calls == [{M_MMAP_MAX: 0}]  # the outer span still trains
    outer.stop()
    assert calls == [{M_MMAP_MAX: 0}, {M_MMAP_MAX: allocator.DEFAULT_MMAP_MAX}]
    off = allocator.LargeBuffers({"PERSIA_MALLOC_TUNING": "0"})
    assert "defaults" in off.start() and len(calls) == 2
    with pytest.raises(ValueError, match="PERSIA_MALLOC_TUNING"):
        allocator.LargeBuffers({"PERSIA_MALLOC_TUNING": "sometimes"})


def test_only_a_model_with_a_parameter_glibc_would_map_needs_large_buffers():
    assert allocator.has_large_buffers([4096 * 2048 * 4, 1024])  # the FFNN's 32 MiB layer
    assert not allocator.has_large_buffers([400 * 400 * 4, 400 * 4])  # the MLP 400's largest
    assert not allocator.has_large_buffers([])
