"""Role classification and per-role peak memory of a real process tree."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.procmem import PeakMemorySampler, classify_role, descendants, summarize


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
        (["sleep", "1"], "other"),
    ],
)
def test_roles_from_command_lines(argv, role):
    assert classify_role(argv) == role


def test_summary_keeps_largest_process_sum_and_count():
    out = summarize([("ps", 100.0), ("ps", 140.0), ("nats", 10.0)])
    assert out["ps"] == {"max_mb": 140.0, "sum_mb": 240.0, "processes": 2}
    assert out["nats"]["processes"] == 1


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
        assert peaks["other"]["processes"] == 1  # the grandchild, found through its parent
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
