"""Local mode under faults, with real processes and real signals: a dead nats-server, a killed PS,
a killed NN rank, a killed launcher, Ctrl-C, a role that cannot reach NATS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.localjob import LocalRun, alive, children_of, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]


def test_nats_server_killed_is_restarted_and_training_completes():
    run = LocalRun(job="f-nats")
    run.wait_for(r"nn_worker: batch 50 ")
    # the nats-server is the launcher's child that is not a role
    roles = {run.pid_of(r) for r in ("ps-0", "ew-0", "nn", "dl-0")}
    nats_pid = next(p for p in children_of(run.proc.pid) if p not in roles and "nats-server" in
                    open(f"/proc/{p}/cmdline").read())
    os.kill(nats_pid, signal.SIGKILL)
    assert run.finish() == 0, run.text[-4000:]
    assert "nats-server killed by SIGKILL; restarting it on" in run.text
    assert '"train_steps": 255' in run.text  # every batch trained, none lost in the outage
    for role in ("ps-0", "ew-0", "nn", "dl-0"):
        lost = [l for l in run.lines if l.startswith(f"[{role}]") and "lost the NATS connection" in l]
        back = [l for l in run.lines if l.startswith(f"[{role}]") and "is back after" in l]
        assert len(lost) == 1 and len(back) == 1, (role, lost, back)  # one warning per outage
    assert "Traceback" not in run.text


@pytest.mark.scenario  # about 45 s each on 2 cores
@pytest.mark.parametrize("server", ["ps-0", "ew-0", "ew-ps-0"])
def test_a_server_killed_restarts_the_job(server):
    # a PS's embeddings, an embedding worker's buffered batches die with it: the whole job restarts
    # (from the latest checkpoint when one is configured), nothing half-trained, new servers used;
    # ew-ps-0 is a worker with its PS replica inside (--colocate-ps): both die, both come back
    run = LocalRun(*(["--colocate-ps"] if server == "ew-ps-0" else []), job=f"f-{server}")
    pid = run.pid_of(server)
    run.wait_for(r"nn_worker: batch 50 ")
    os.kill(pid, signal.SIGKILL)
    assert run.finish() == 0, run.text[-4000:]
    assert f"server {server} exited (killed by SIGKILL); restarting the job (1/3)" in run.text
    assert "after 1 restart(s)" in run.text
    assert '"batches_trained": 255' in run.text


def test_nn_rank_killed_without_restarts_fails_naming_role_and_signal():
    run = LocalRun("--max-restarts", "0", job="f-nn")
    nn = run.pid_of("nn")
    run.wait_for(r"nn_worker: batch 50 ")
    rank = next(p for p in children_of(nn) if "train.py" in open(f"/proc/{p}/cmdline").read())
    os.kill(rank, signal.SIGKILL)
    assert run.finish(120) == 1
    assert "nn-worker rank 0 killed by SIGKILL" in run.text
    assert "nn exit code 137 (SIGKILL); no restarts left (0 of --max-restarts 0 used)" in run.text


def test_program_error_is_not_restarted(tmp_path):
    bad = tmp_path / "bad_loader.py"
    bad.write_text("raise SystemExit(3)\n")
    run = LocalRun(loader=bad, job="f-bad")
    assert run.finish(120) == 1
    assert "dl-0 exit code 3: not restarted" in run.text
    assert "restarting the job" not in run.text


def test_launcher_killed_leaves_no_process_behind():
    run = LocalRun(job="f-orphans")
    run.wait_for(r"nn_worker: batch 0 ")
    descendants = children_of(run.proc.pid)
    assert len(descendants) >= 6  # nats-server, PS, EW, NN launcher + rank, data loader
    os.kill(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    assert wait_gone(descendants) == []


def test_ctrl_c_on_the_process_group_stops_quietly():
    run = LocalRun(job="f-ctrlc")
    run.wait_for(r"nn_worker: batch 0 ")
    descendants = children_of(run.proc.pid)
    os.killpg(run.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    assert run.finish(30) == 130
    assert "SIGINT: stopping every role" in run.text
    assert "Traceback" not in run.text
    assert wait_gone(descendants, 5) == []


def test_role_that_cannot_reach_nats_obeys_sigterm(tmp_path):
    env = dict(os.environ, PERSIA_NATS_URL="nats://no-such-host.invalid:4222", PYTHONUNBUFFERED="1",
               PERSIA_BIND_ADDRESS="127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "persia.launcher", "embedding-parameter-server", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    while not any("cannot reach NATS" in l for l in lines):  # it says it is waiting, not hanging silently
        lines.append(proc.stdout.readline())
        assert lines[-1], "".join(lines)
    assert "cannot reach NATS at nats://no-such-host.invalid:4222 yet" in lines[-1], lines
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 128 + signal.SIGTERM
    assert not alive(proc.pid)


def test_a_job_whose_loaders_send_nothing_says_it_trained_nothing():
    """Before, it ended "done" with every acknowledged batch "accounted for", and nothing said that
    nothing was trained. Now the loader, the NN rank and the launcher's last line each say so."""
    run = LocalRun(loader=Path(__file__).resolve().parent / "empty_loader.py", job="empty")
    assert run.finish() == 0, run.text  # done: the programs did not fail
    assert "data loader 0 ended its stream without sending a batch: its dataset yielded none" in run.text
    assert "NN rank 0: every data loader ended its stream without sending a batch (loaders [0])" in run.text
    assert run.lines[-1].startswith("[local] WARNING: the NN workers trained no batch (batches_trained 0)"), run.lines[-3:]
