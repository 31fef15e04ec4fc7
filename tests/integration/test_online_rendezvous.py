"""Online training's rendezvous with real processes: ``persia-launcher data-loader`` with
``PERSIA_RENDEZVOUS=nats`` (as the operator's Deployments and local mode's online example run it),
a real nats-server, the index table of PS replica 0 served in this process, real SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.polling import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

# a data loader script that only says which index it got and waits to be stopped
SCRIPT = """import os, sys, time
print("index", os.environ["REPLICA_INDEX"], flush=True)
while not os.path.exists(sys.argv[0] + ".stop"):
    time.sleep(0.1)
"""


def _launch(script: Path, log: Path, size: int) -> subprocess.Popen:
    # every process of one machine: the same hostname (local mode, or pods sharing the node's)
    env = {k: v for k, v in os.environ.items() if k != "HOSTNAME"}
    env.update(PERSIA_RENDEZVOUS="nats", PYTHONPATH=str(ROOT))
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "persia.launcher", "data-loader", str(script),
                                 "--replica-size", str(size)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(procs: list[subprocess.Popen], tmp_path: Path) -> None:
    """Every loader's script told to end; a process still there after 20 s is SIGKILLed."""
    (tmp_path / "loader.py.stop").write_text("")
    for p in procs:
        if p.poll() is None:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture
def rendezvous(persia_env, tmp_path):
    """``rendezvous(ttl_s)``: PS replica 0's index table, served in this process, and the loader
    script; the loaders the test appends to ``procs`` are stopped at its end."""
    from persia.bus import NatsBus
    from persia.rendezvous import RendezvousServer

    keeper = NatsBus(name="rdzv-keeper")
    script = tmp_path / "loader.py"
    script.write_text(SCRIPT)
    procs: list[subprocess.Popen] = []
    try:
        yield lambda ttl_s: (RendezvousServer(keeper, ttl_s=ttl_s), script, procs)
    finally:
        _stop(procs, tmp_path)
        keeper.close()


def _index(log: Path, proc: subprocess.Popen) -> int | None:
    m = re.search(r"dl index (\d+) of", log.read_text(errors="replace"))
    if m is None and proc.poll() is not None:
        raise AssertionError(f"the data loader exited {proc.returncode}:\n{log.read_text(errors='replace')}")
    return None if m is None else int(m.group(1))


def test_loaders_of_one_machine_get_distinct_indices_and_a_killed_one_rejoins_at_its_index(rendezvous, tmp_path):
    """Two data-loader processes on one machine each claimed an index under their hostname, the
    member name: the second was answered the first's index (\"the same one again\"), so both ran as
    loader 0 (batch ids and resume positions shared, loader 1's stream never sent, its NN ranks
    waiting for it for ever). Then one is SIGKILLed and started again: it gets the freed index
    back once its lease expires, and the other keeps its own."""
    table, script, procs = rendezvous(ttl_s=1.5)
    logs = [tmp_path / "dl-a.log", tmp_path / "dl-b.log"]
    procs.append(_launch(script, logs[0], 2))
    poll_until(lambda: _index(logs[0], procs[0]) is not None, "the first loader's index", deadline_s=60)
    procs.append(_launch(script, logs[1], 2))
    poll_until(lambda: _index(logs[1], procs[1]) is not None, "the second loader's index", deadline_s=60)
    first, second = _index(logs[0], procs[0]), _index(logs[1], procs[1])
    assert sorted([first, second]) == [0, 1], (first, second, table._table("dl").leases)
    # the first loader is SIGKILLed (its whole group: launcher and script); a new process rejoins
    os.killpg(procs[0].pid, signal.SIGKILL)
    procs[0].wait(timeout=30)
    logs.append(tmp_path / "dl-c.log")
    procs.append(_launch(script, logs[2], 2))
    poll_until(lambda: _index(logs[2], procs[2]) is not None, "the restarted loader's index", deadline_s=60)
    assert _index(logs[2], procs[2]) == first
    # the survivor kept its index and its lease all along (renewed, never lost)
    time.sleep(2 * 1.5)
    assert procs[1].poll() is None, logs[1].read_text()
    assert sorted(i for i, _ in table._table("dl").leases.values()) == [0, 1]


def test_a_loader_that_exits_gives_its_index_back_at_once(rendezvous, tmp_path):
    """A launcher stopped with SIGTERM (a rolling update's old pod) gives its index back as it
    exits. Before, the index stayed held until its lease expired (the TTL, 30 s by default: here
    60 s), and the new pod waited that long for it."""
    table, script, procs = rendezvous(ttl_s=60.0)
    logs = [tmp_path / "dl-old.log", tmp_path / "dl-new.log"]
    procs.append(_launch(script, logs[0], 1))
    poll_until(lambda: _index(logs[0], procs[0]) == 0, "the old loader's index", deadline_s=60)
    # its script runs (the launcher supervises it, SIGTERM forwarded): stopped as a pod is
    poll_until(lambda: re.search(r"^index 0$", logs[0].read_text(), re.MULTILINE), "the script", deadline_s=60)
    os.killpg(procs[0].pid, signal.SIGTERM)
    procs[0].wait(timeout=30)
    assert "dl index 0 given back to the NATS rendezvous" in logs[0].read_text(), logs[0].read_text()
    assert table._table("dl").leases == {}
    procs.append(_launch(script, logs[1], 1))
    # well within the 60 s lease the old one held
    poll_until(lambda: _index(logs[1], procs[1]) == 0, "the new loader's index", deadline_s=30)
