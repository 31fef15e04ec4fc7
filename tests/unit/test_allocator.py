"""glibc malloc settings (persia.allocator): the decision, the effect on page faults, the wiring."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from persia import allocator
from persia.allocator import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, allocator_plan

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
