"""Local mode with periodic checkpoints (PERSIA_CHECKPOINT_DIR, every 50 steps): a role SIGKILLed
mid-training restarts the job, which resumes from the last published checkpoint. Real
processes, real nats-server, real signals; adult-income with the paced loader (255 batches).

Each run checks: the resume line names the checkpoint, the data loader skipped exactly the
batches trained before it, steps before + after the restart add up to the stream (255: nothing
trained twice, nothing lost), and the final test AUC is within 0.005 of an undisturbed run.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.faults.localjob import LocalRun, children_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults]

STEPS = 255  # adult-income: 32561 samples in batches of 128
AUC_TOLERANCE = 0.005


def checkpointed(tmp_path, job: str, *flags: str, **env: str) -> LocalRun:
    return LocalRun(*flags, job=job, env={"PERSIA_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
                                          "PERSIA_CHECKPOINT_INTERVAL_STEPS": "50", **env})


def result(run: LocalRun) -> dict:
    line = [l for l in run.lines if "PERSIA_RESULT " in l][-1]
    return json.loads(line.split("PERSIA_RESULT ", 1)[1])


@pytest.fixture(scope="module")
def undisturbed_auc(tmp_path_factory) -> float:
    run = checkpointed(tmp_path_factory.mktemp("undisturbed"), "f-undisturbed")
    assert run.finish() == 0, run.text[-4000:]
    res = result(run)
    assert res["train_steps"] == STEPS and res["start_step"] == 0
    return res["auc"]


@pytest.mark.scenario  # about 110 s on 2 cores
def test_ps_then_data_loader_then_nn_rank_killed_job_resumes_each_time(tmp_path, undisturbed_auc):
    """One job, three faults (one per role kind, each after a new checkpoint is published, so
    every restart has a newer one to resume from): three restarts (the default --max-restarts),
    three resumes, and the stream still trained exactly once in total."""
    run = checkpointed(tmp_path, "f-resume")
    faults = [
        ("ps-0", 50, lambda start: run.pid_of("ps-0", start), r"server ps-0 exited \(killed by SIGKILL\)"),
        ("dl-0", 100, lambda start: run.pid_of("dl-0", start), r"dl-0 killed by SIGKILL"),
        ("nn", 150, lambda start: next(p for p in children_of(run.pid_of("nn", start))
                                       if "train.py" in open(f"/proc/{p}/cmdline").read()), r"nn exit code 137 \(SIGKILL\)"),
    ]
    start = 0
    for n, (role, step, victim, said) in enumerate(faults, 1):
        _, step = run.published_checkpoint(step, start=start)  # that one, or a later one
        os.kill(victim(start), signal.SIGKILL)
        start = len(run.lines)
        run.wait_for(rf"{said}; restarting the job \({n}/3\)", start=start - 50 if start > 50 else 0)
        m = run.wait_for(r"resumed from \S+/ckpt-(\d{12}): step (\d+)", start=start)
        resumed = int(m.group(2))
        assert resumed >= step and int(m.group(1)) == resumed, (role, m.group(0))
        run.wait_for(rf"skipping {resumed} batches already trained", start=start)
    assert run.finish() == 0, run.text[-4000:]
    res = result(run)
    assert res["start_step"] == resumed
    assert res["start_step"] + res["train_steps"] == STEPS  # nothing trained twice, nothing lost
    print(f"resumed run: AUC {res['auc']:.4f}, undisturbed {undisturbed_auc:.4f}, last resume at step {resumed}")
    assert abs(res["auc"] - undisturbed_auc) <= AUC_TOLERANCE, (res["auc"], undisturbed_auc)


def test_sigterm_to_the_job_writes_a_final_checkpoint_and_stops(tmp_path):
    """What the operator's pod deletion does: SIGTERM. The NN rank finishes its step, flushes its
    updates and publishes a checkpoint of exactly that step (the periodic interval is far away),
    then every role stops, quietly."""
    run = checkpointed(tmp_path, "f-sigterm", PERSIA_CHECKPOINT_INTERVAL_STEPS="1000")
    run.wait_for(r"nn_worker: batch 50 ")
    os.kill(run.proc.pid, signal.SIGTERM)
    assert run.finish(60) == 128 + signal.SIGTERM
    m = run.wait_for(r"\[nn\].*checkpoint step (\d+) published")
    step = int(m.group(1))
    assert 50 <= step < STEPS
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [f"ckpt-{step:012d}"]
    progress = json.loads((tmp_path / "ckpt" / f"ckpt-{step:012d}" / "progress.json").read_text())
    assert progress["loaders"] == {"0": {"0": step}}
    assert "SIGTERM: stopping after the current step" in run.text
    assert "Traceback" not in run.text
