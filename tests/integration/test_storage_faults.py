"""Two jobs pointed at the same ``checkpoint_dir``: real processes writing periodic checkpoints
(the trainer's own ``write_cut``) at the same step. No servers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from persia.nn_worker import checkpoint_plan as plan
from persia.nn_worker import periodic
from persia.nn_worker.periodic import scan, write_cut

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from persia.nn_worker.periodic import write_cut
    d, who, pause = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])

    def parts(tmp):
        (tmp / "part-1").write_text(who)
        time.sleep(pause)  # a large dump: the other job's cut comes meanwhile
        (tmp / "part-2").write_text(who)

    write_cut(d, {"step": 100, "world_size": 1, "loaders": {}, "run_id": who}, parts, keep=3)
    print("published", flush=True)
""")


def _start_writer(directory: Path, who: str, pause: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(directory), who, str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out")
        time.sleep(0.02)


def _whole(ckpt: Path) -> str:
    """The one writer whose files the published checkpoint holds (all of them), else fails."""
    marker = json.loads((ckpt / plan.COMPLETE).read_text())
    files = sorted(p.name for p in ckpt.iterdir() if p.name != plan.COMPLETE)
    assert files == sorted(marker["parts"]) == ["part-1", "part-2", "progress.json"], files
    writers = {(ckpt / f).read_text() for f in ("part-1", "part-2")}
    writers.add(json.loads((ckpt / "progress.json").read_text())["run_id"])
    assert len(writers) == 1, f"{ckpt} mixes the files of {writers}"
    return writers.pop()


def test_two_jobs_writing_the_same_step_never_remove_each_others_checkpoint(tmp_path):
    """Before: the second cut removed the first one's ``.tmp-ckpt-<step>`` as a killed writer's
    while it was being written; the first job's checkpoint failed (or was published with the
    other's files)."""
    first = _start_writer(tmp_path, "job-a", 1.5)
    try:
        _wait_for(lambda: (tmp_path / plan.tmp_name(100) / "part-1").exists())

        def parts(tmp: Path) -> None:
            (tmp / "part-1").write_text("job-b")
            (tmp / "part-2").write_text("job-b")

        write_cut(tmp_path, {"step": 100, "world_size": 1, "loaders": {}, "run_id": "job-b"}, parts, keep=3)
        out, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0 and "published" in out, f"job-a's checkpoint failed:\n{err[-2000:]}"
    assert _whole(tmp_path / plan.checkpoint_name(100)) == "job-b"  # the later one, whole
    assert not list(tmp_path.glob(plan.TMP_PREFIX + "*"))


def test_a_writer_that_holds_the_directory_too_long_is_a_clear_error(tmp_path, monkeypatch):
    first = _start_writer(tmp_path, "job-a", 3.0)
    try:
        _wait_for(lambda: (tmp_path / plan.tmp_name(100) / "part-1").exists())
        monkeypatch.setattr(periodic, "LOCK_WAIT_S", 0.3)
        t0 = time.monotonic()
        with pytest.raises(OSError) as err:
            write_cut(tmp_path, {"step": 100, "world_size": 1, "loaders": {}}, lambda tmp: None, keep=3)
        assert time.monotonic() - t0 < 3.0
        msg = str(err.value)
        assert str(tmp_path) in msg and f"pid {first.pid}" in msg and "same checkpoint_dir" in msg, msg
        assert (tmp_path / plan.tmp_name(100) / "part-1").exists()  # job-a's write goes on
        first.communicate(timeout=60)
        assert first.returncode == 0 and _whole(tmp_path / plan.checkpoint_name(100)) == "job-a"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert [n for _, n in scan(tmp_path)] == [plan.checkpoint_name(100)]


# -- a full disk under a training job: real nats-server, PS replicas, embedding workers -----------
def _fill(directory: Path) -> None:
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.mark.integration
def test_a_full_disk_fails_the_checkpoint_naming_the_path_and_training_goes_on(persia_env, small_fs, caplog):
    from .cluster import cluster
    from .test_checkpoint_resume import Model, run_job

    with cluster(num_ps=2):
        run_job(Model(), 4, small_fs, checkpoint_interval_steps=2, checkpoint_keep=1)
    root = small_fs / "ckpts"
    assert [n for _, n in scan(root)] == [plan.checkpoint_name(4)]
    good = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    _fill(small_fs)
    with cluster(num_ps=2):
        ctx = run_job(Model(), 8, small_fs, checkpoint_interval_steps=2, checkpoint_keep=1)
    assert (ctx.start_step, ctx.step) == (4, 8)  # resumed, trained on through two failed checkpoints
    assert ctx.checkpoint_failures == 2 and ctx.metrics.get("checkpoint_failures") == 2
    failed = [r.getMessage() for r in caplog.records if "checkpoint of step" in r.getMessage()]
    assert len(failed) == 2, failed
    for line in failed:
        assert "training goes on" in line and str(root) in line, line  # which disk is full
        assert f"the last published checkpoint, {root / plan.checkpoint_name(4)}, stands" in line, line
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == good  # the last good one, untouched
