"""The NN worker flushes denormal floats to zero on its training thread and torch's OpenMP team.

The decision and the maps parsing are pure. The rest runs in fresh processes, because the setting
is per thread and lasts for the process: each child builds torch's OpenMP team first (as a model
built before the context does), then multiplies denormals on two threads and counts what was not
flushed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from persia.nn_worker.denormals import ENV_SWITCH, denormal_plan
from persia.nn_worker.openmp_team import openmp_library


@pytest.mark.parametrize("value", [None, "1", "on", "TRUE", " 1 "])
def test_flushing_is_the_default_and_on_means_on(value):
    environ = {} if value is None else {ENV_SWITCH: value}
    assert denormal_plan(environ)[0] is True


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_off_keeps_ieee_denormals(value):
    enabled, why = denormal_plan({ENV_SWITCH: value})
    assert enabled is False and ENV_SWITCH in why


def test_a_bad_value_is_refused_naming_it():
    with pytest.raises(ValueError, match=rf"{ENV_SWITCH} must be 1/on or 0/off, got 'sometimes'"):
        denormal_plan({ENV_SWITCH: "sometimes"})


def test_the_openmp_runtime_is_found_in_the_maps():
    maps = (
        "7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f10-7f20 rw-p 00000000 00:00 0 \n"
        "7f20-7f30 r-xp 00000000 08:01 13 /venv/site-packages/torch/lib/libgomp.so.1\n"
    )
    assert openmp_library(maps) == "/venv/site-packages/torch/lib/libgomp.so.1"
    assert openmp_library("7f00-7f10 r-xp 00000000 08:01 13 /opt/intel/libiomp5.so\n") == "/opt/intel/libiomp5.so"
    assert openmp_library(maps.splitlines()[0] + "\n") is None


CHILD = r"""
import json, sys, threading
import torch

torch.set_num_threads(2)
x = torch.full((1 << 20,), 1e-39)  # a denormal float32, on two OpenMP threads (4 chunks of the grain)
def unflushed():
    return int((x * 1.0).count_nonzero())
def in_new_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(unflushed()))
    t.start(); t.join()
    return seen[0]
got = {"before": unflushed()}  # also makes torch's OpenMP team, as building a model first does
mode = sys.argv[1]
if mode == "user-flushes":
    torch.set_flush_denormal(True)
if mode == "context" or mode == "user-flushes":
    from persia.nn_worker.infer_ctx import InferCtx
    with InferCtx(["127.0.0.1:9"]):  # no lookup is made: nothing connects
        got["inside"], got["new_thread"] = unflushed(), in_new_thread()
else:
    from persia.nn_worker.denormals import FlushDenormals
    span = FlushDenormals()
    got["why"] = span.start()
    got["inside"], got["new_thread"] = unflushed(), in_new_thread()
    span.stop()
got["after"] = unflushed()
print(json.dumps(got))
"""


def _child(mode: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != ENV_SWITCH}
    environ.update(env, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


ALL = 1 << 20


def test_the_entering_thread_its_openmp_team_and_new_threads_flush_until_stop():
    got = _child("span")
    assert got["before"] == ALL  # nothing flushed before: the test can tell
    assert got["inside"] == 0, got  # the OpenMP thread's half too, not only the caller's
    assert got["new_thread"] == 0
    assert got["why"] == "flush to zero on the calling thread and its OpenMP team's 2 threads"
    assert got["after"] == ALL  # IEEE again on both threads: nothing leaks past the span


def test_the_nn_worker_context_flushes_for_its_with_block():
    got = _child("context")
    assert (got["inside"], got["new_thread"], got["after"]) == (0, 0, ALL)


def test_a_thread_that_already_flushed_keeps_flushing():
    got = _child("user-flushes")
    assert (got["inside"], got["after"]) == (0, 0)


def test_switched_off_nothing_is_flushed():
    got = _child("span", **{ENV_SWITCH: "0"})
    assert (got["inside"], got["new_thread"], got["after"]) == (ALL, ALL, ALL)


def test_the_context_refuses_a_bad_setting_naming_it(monkeypatch):
    from persia.nn_worker.infer_ctx import InferCtx

    monkeypatch.setenv(ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match=rf"{ENV_SWITCH} must be 1/on or 0/off, got 'maybe'"):
        InferCtx(["127.0.0.1:9"])
