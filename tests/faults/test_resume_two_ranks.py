"""Two NN ranks (DDP, `--nproc-per-node 2`) with periodic checkpoints: NN rank 1's training
process SIGKILLed after a checkpoint is published restarts the whole job, which resumes from that
checkpoint on both ranks. Real processes, real nats-server, real signals; adult-income with the
paced loader (255 batches; batch id b goes to rank b % 2: 128 to rank 0, 127 to rank 1).

What could go wrong and is checked: a rank resuming from another checkpoint (or not at all), the
loader skipping the wrong number of batches per rank (some trained twice or never), a rank whose
dense model is not the checkpoint's (rank 1 loads it on its own, not through DDP's broadcast), and
accounting that does not add up to the stream on each rank.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from persia.nn_worker.periodic import scan
from tests.faults.localjob import LocalRun, children_of

# the module's killed two-rank run takes about 90 s on 2 cores: make test-scenarios
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.faults, pytest.mark.scenario]

STREAM = 255
PER_RANK = {0: 128, 1: 127}  # the loader's batches per NN rank (batch id % 2)
INTERVAL = 20
DIGEST_TRAINER = Path(__file__).resolve().parent / "digest_trainer.py"


def rank_pid(run: LocalRun, rank: int, start: int = 0, deadline_s: float = 30.0) -> int:
    """The pid of NN rank ``rank``'s training process (a child of the NN launcher, RANK in its env)."""
    nn = run.pid_of("nn", start)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pid in children_of(nn):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            if DIGEST_TRAINER.name.encode() in cmd and f"RANK={rank}".encode() in env:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"no training process of NN rank {rank} under the NN launcher {nn}")


def result(run: LocalRun) -> dict:
    return json.loads([line for line in run.lines if "PERSIA_RESULT " in line][-1].split("PERSIA_RESULT ", 1)[1])


def balance(line: str) -> tuple[int, int, dict]:
    """(sent, trained, failed) of an NN rank's accounting line; nothing unannounced or evaluated."""
    fields = dict(re.findall(r"(\w+) (\d+|\{[^}]*\})", line))
    assert fields.get("unannounced", "0") == "0" and fields["evaluated"] == "0", line
    return int(fields["sent"]), int(fields["trained"]), ast.literal_eval(fields["failed"])


def lines_after(run: LocalRun, start: int, pattern: str) -> list[re.Match]:
    rx = re.compile(pattern)
    return [m for line in run.lines[start:] if (m := rx.search(line))]


@dataclass
class KilledRun:
    run: LocalRun
    ckpt: Path
    restart: int  # index of the line that says the job restarts
    step: int  # the newest complete checkpoint when it restarted


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> KilledRun:
    """The two-rank job, NN rank 1 SIGKILLed once the first checkpoint is published, run to its end."""
    ckpt = tmp_path_factory.mktemp("two-ranks") / "ckpt"
    run = LocalRun("--nproc-per-node", "2", job="f-two-ranks", trainer=DIGEST_TRAINER,
                   env={"PERSIA_CHECKPOINT_DIR": str(ckpt), "PERSIA_CHECKPOINT_INTERVAL_STEPS": str(INTERVAL)})
    try:
        run.wait_for(rf"\[nn\].*checkpoint step {INTERVAL} published", deadline_s=180)
        victim = rank_pid(run, 1)
        killed_at = len(run.lines)
        os.kill(victim, signal.SIGKILL)
        restart, _ = run.wait_index(r"\[local\] nn exit code 137 \(SIGKILL\); restarting the job \(1/3\)",
                                    start=killed_at)
        # the newest checkpoint on disk once the old incarnation is gone (the launcher stops every
        # role before it starts the first of the next): the one the job must resume from. Not
        # the newest "published" line: a checkpoint is complete on disk before rank 0 logs it,
        # so a kill that lands while the next one is written leaves it complete and unlogged.
        # The new incarnation publishes nothing before it has resumed and trained INTERVAL steps.
        run.wait_index(r"\[local\] started ", start=restart)
        on_disk = max(step for step, _ in scan(ckpt))
        assert "nn-worker rank 1 killed by SIGKILL" in "\n".join(run.lines[killed_at:restart + 1])
        run.finish(240)
    finally:
        run.kill()
    published = [int(m.group(1)) for line in run.lines[:restart]
                 if (m := re.search(r"\[nn\].*checkpoint step (\d+) published", line))]
    assert on_disk >= max(published), (on_disk, published)
    return KilledRun(run, ckpt, restart, on_disk)


def test_nn_rank_1_killed_both_ranks_resume_from_the_checkpoint(killed_run):
    run, restart, step = killed_run.run, killed_run.restart, killed_run.step
    assert run.proc.returncode == 0, run.text[-5000:]
    assert step >= INTERVAL and step % INTERVAL == 0
    # both ranks resume from it, with every rank's position: `step` batches each
    for rank in (0, 1):
        m = run.wait_for(rf"\[nn-worker-{rank}\] .*resumed from (\S+)/ckpt-(\d{{12}}): step (\d+), "
                         rf"loader positions (\{{.*\}}) \(", start=restart)
        assert (Path(m.group(1)), int(m.group(2)), int(m.group(3))) == (killed_run.ckpt, step, step), m.group(0)
        assert ast.literal_eval(m.group(4)) == {"0": {"0": step, "1": step}}, m.group(0)
    # the data loader skips exactly the 2 * step batches trained before
    run.wait_for(rf"\[dl-0\] .*data loader 0 resumes after step {step} of \S+/ckpt-{step:012d}: "
                 rf"skipping {2 * step} batches already trained", start=restart)

    # the dense model each rank resumed with, and ended with, is the same on both ranks
    for when in ("resumed", "final"):
        digests = {int(m.group(1)): (int(m.group(2)), m.group(3))
                   for m in lines_after(run, restart, rf"DENSE_DIGEST rank (\d) {when} step (\d+): (\w+)")}
        assert set(digests) == {0, 1} and digests[0] == digests[1], (when, digests)
    assert digests[0][0] == PER_RANK[1]  # final step: the shorter rank's stream

    # accounting after the restart: each rank got exactly its share of the stream minus what it
    # trained before, and trained all of it (the longer rank drops its one uneven tail batch)
    sent = lines_after(run, restart, r"data loader 0: end of stream after 1 epochs, (\d+) batches acknowledged, "
                                     r"failed sends none")
    assert [int(m.group(1)) for m in sent] == [STREAM - 2 * step]
    trained, tail = {}, 0
    for rank in (0, 1):
        [m] = lines_after(run, restart, rf"NN rank {rank} batches: (.*) \(every acknowledged batch accounted for\)")
        n_sent, n_trained, failed = balance(m.group(1))
        assert n_sent == PER_RANK[rank] - step, (rank, m.group(0))
        assert set(failed) <= {"uneven_tail"} and n_trained + sum(failed.values()) == n_sent, (rank, m.group(0))
        trained[rank], tail = n_trained, tail + failed.get("uneven_tail", 0)
    assert trained[0] == trained[1] == PER_RANK[1] - step  # DDP ranks stay in step
    assert 2 * step + sum(trained.values()) + tail == STREAM  # nothing trained twice, nothing lost

    res = result(run)
    assert (res["start_step"], res["train_steps"], res["world_size"]) == (step, trained[0], 2)
    assert "restarting the job (2/3)" not in run.text
    print(f"two ranks: resumed at step {step}, then {trained[0]} steps per rank; AUC {res['auc']:.4f}")


def test_a_two_rank_checkpoint_resumes_with_one_rank(killed_run):
    """The operator's replica change: the same job, now with one NN rank, resumes the two-rank
    job's last checkpoint. Batch b went to rank b % 2 there and goes to rank 0 now: the loader skips
    exactly what the two ranks trained, and the next checkpoint keeps the two-rank run's positions
    as an earlier run (before: the loader started its stream again, training 2 * step batches
    twice, and the next checkpoint's positions no longer matched what was trained)."""
    ckpt = killed_run.ckpt
    last = max(int(p.name.split("-")[1]) for p in ckpt.iterdir() if (p / "COMPLETE").exists())
    run = LocalRun("--nproc-per-node", "1", job="f-one-rank", trainer=DIGEST_TRAINER,
                   env={"PERSIA_CHECKPOINT_DIR": str(ckpt), "PERSIA_CHECKPOINT_INTERVAL_STEPS": "5",
                        "SLOW_S": "0"})  # no fault to place: no pacing (it would pace the skipped batches too)
    try:
        assert run.finish(180) == 0, run.text[-5000:]
    finally:
        run.kill()
    positions = {"0": {"0": last, "1": last}}
    m = run.wait_for(r"\[nn-worker-0\] .*resumed from \S+/ckpt-(\d{12}): step (\d+), loader positions (\{.*\}) "
                     r"written by 2 NN ranks, mapped onto 1")
    assert (int(m.group(1)), int(m.group(2)), ast.literal_eval(m.group(3))) == (last, last, positions), m.group(0)
    run.wait_for(rf"\[dl-0\] .*was written with 2 NN ranks, this job has 1: data loader 0 skips the {2 * last} ")
    run.wait_for(rf"\[dl-0\] .*skipping {2 * last} batches already trained")
    rest = STREAM - 2 * last
    run.wait_for(rf"data loader 0: end of stream after 1 epochs, {rest} batches acknowledged, failed sends none")
    m = run.wait_for(r"NN rank 0 batches: (.*) \(every acknowledged batch accounted for\)")
    assert balance(m.group(1)) == (rest, rest, {}), m.group(0)
    res = result(run)
    assert (res["start_step"], res["train_steps"], res["world_size"]) == (last, rest, 1)
    # a checkpoint of the one-rank run: its own positions, and the two-rank run's kept before them
    mine = max(int(p.name.split("-")[1]) for p in ckpt.iterdir() if (p / "COMPLETE").exists())
    assert mine > last
    progress = json.loads((ckpt / f"ckpt-{mine:012d}" / "progress.json").read_text())
    assert progress["world_size"] == 1 and progress["loaders"] == {"0": {"0": mine - last}}
    assert progress["earlier"] == [{"world_size": 2, "loaders": positions}]


def test_a_checkpoint_resumed_with_another_number_of_data_loaders_fails_at_once(killed_run):
    """The same checkpoint directory, now with two data loaders: batch ids (counter * loaders +
    index) and the loaders' sharding change with their number, so no skip is exact. Every loader
    refuses before sending a batch, naming both numbers and the checkpoint, and the job fails
    (a program error: not restarted) with nothing trained. Before: the loaders skipped by the old
    positions and the job trained on, some batches twice and others never, in silence."""
    ckpt = killed_run.ckpt
    last = max(int(p.name.split("-")[1]) for p in ckpt.iterdir() if (p / "COMPLETE").exists())
    run = LocalRun("--nproc-per-node", "1", "--data-loaders", "2", job="f-two-loaders", trainer=DIGEST_TRAINER,
                   env={"PERSIA_CHECKPOINT_DIR": str(ckpt), "PERSIA_CHECKPOINT_INTERVAL_STEPS": "5", "SLOW_S": "0"})
    try:
        assert run.finish(120) != 0, run.text[-5000:]
    finally:
        run.kill()
    run.wait_for(rf"\[nn-worker-0\] .*resumed from \S+/ckpt-{last:012d}: step {last}")
    refused = lines_after(run, 0, rf"\[dl-(\d)\] .*data loader \1/2: checkpoint \S+/ckpt-{last:012d} was written "
                                  r"with 1 data loaders, this job has 2")
    assert refused, run.text[-5000:]
    run.wait_for(r"\[local\] .*dl-\d exit code 1")
    assert not lines_after(run, 0, r"checkpoint step \d+ published|restarting the job"), run.text[-5000:]
    assert max(int(p.name.split("-")[1]) for p in ckpt.iterdir() if (p / "COMPLETE").exists()) == last
