"""Checkpoints when storage misbehaves: a full disk mid-write, a damaged file, retention that is
interrupted, a directory shared with checkpoints of higher steps. Real files (a small tmpfs for a
real ENOSPC, skipped where mounting is not permitted), real PS stores, the trainer's own writer
(``write_cut``); no servers."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from persia.embedding_ps import AdagradConfig, EmbeddingStore, HyperParameters
from persia.embedding_ps.checkpoint import dump_store, write_json_atomic
from persia.nn_worker import checkpoint_plan as plan
from persia.nn_worker import periodic
from persia.nn_worker.checkpoint import (
    CheckpointLoadError,
    EmbeddingCheckpoints,
    write_atomically,
)
from persia.nn_worker.periodic import scan, write_cut


def _store(rows: int, dim: int = 32) -> EmbeddingStore:
    s = EmbeddingStore(rows * 2, 4, seed=0)
    s.configure(HyperParameters(init_lower=-0.1, init_upper=0.1))
    s.register_optimizer(AdagradConfig(lr=0.1))
    s.lookup(np.arange(1, rows + 1, dtype=np.uint64) * 7919, dim, True)
    return s


def _publish(directory: Path, step: int, extra: dict | None = None) -> None:
    def parts(tmp: Path) -> None:
        torch.save({"w": torch.zeros(2)}, tmp / "dense.pt")
        write_json_atomic(tmp / "embedding_dump_done", {"num_shards": 0})
    write_cut(directory, {"step": step, "world_size": 1, "loaders": {}, **(extra or {})}, parts, keep=100)


# -- retention ------------------------------------------------------------------------------------
def test_retention_never_deletes_the_checkpoint_just_published():
    complete = [(1000, "ckpt-000000001000"), (2000, "ckpt-000000002000"), (3000, "ckpt-000000003000"),
                (100, "ckpt-000000000100")]
    assert plan.to_delete(complete, 3, published="ckpt-000000000100") == []
    assert plan.to_delete(complete, 3) == ["ckpt-000000000100"]  # without it: what retention did
    assert plan.to_delete(complete, 2, published="ckpt-000000003000") == ["ckpt-000000000100", "ckpt-000000001000"]


def test_a_run_below_older_checkpoints_keeps_its_own(tmp_path):
    """``resume: never`` (or a resume from an older path) into a directory holding ``keep``
    checkpoints of higher steps: each checkpoint of the run was deleted the moment it was
    published (logged as published), and a restart had none of its own to resume from."""
    for step in (1000, 2000, 3000):
        _publish(tmp_path, step, {"run_id": "old"})
    progress = {"step": 100, "world_size": 1, "loaders": {}, "run_id": "new"}
    marker = write_cut(tmp_path, progress, lambda tmp: None, keep=3)
    assert Path(marker["path"]).is_dir(), "the checkpoint just published was deleted by retention"
    assert (100, "ckpt-000000000100") in scan(tmp_path)
    write_cut(tmp_path, {**progress, "step": 200}, lambda tmp: None, keep=3)
    names = [n for _, n in scan(tmp_path)]
    assert "ckpt-000000000200" in names and "ckpt-000000000100" not in names


class Killed(BaseException):
    pass


def test_retention_killed_part_way_leaves_no_checkpoint_a_resume_would_pick(tmp_path, monkeypatch):
    """shutil.rmtree removes files in directory order: a deletion interrupted (a kill, a file it
    cannot remove) left ``ckpt-<step>`` with its COMPLETE marker and files missing."""
    _publish(tmp_path, 10)
    _publish(tmp_path, 20)
    real = shutil.rmtree

    def interrupted(path, *args, **kwargs):
        path = Path(path)
        if (path / "dense.pt").exists():
            (path / "dense.pt").unlink()  # the first files go, then the process dies
            raise Killed()
        return real(path, *args, **kwargs)

    monkeypatch.setattr(periodic.shutil, "rmtree", interrupted)
    with pytest.raises(Killed):
        write_cut(tmp_path, {"step": 30, "world_size": 1, "loaders": {}},
                  lambda tmp: torch.save({}, tmp / "dense.pt"), keep=2)
    monkeypatch.setattr(periodic.shutil, "rmtree", real)
    for _, name in scan(tmp_path):
        assert (tmp_path / name / "dense.pt").is_file(), f"{name} is listed as complete with dense.pt gone"
    assert [n for _, n in scan(tmp_path)] == ["ckpt-000000000020", "ckpt-000000000030"]
    _publish(tmp_path, 40)  # the next cut removes what is left of it
    assert not list(tmp_path.glob(plan.TMP_PREFIX + "*"))


def test_retention_that_cannot_delete_keeps_the_checkpoint_published(tmp_path, monkeypatch, caplog):
    _publish(tmp_path, 10)

    def refuse(src, dst):
        if Path(src).name == "ckpt-000000000010":
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return os.rename(src, dst)

    monkeypatch.setattr(periodic.os, "replace", refuse)
    write_cut(tmp_path, {"step": 20, "world_size": 1, "loaders": {}}, lambda tmp: None, keep=1)
    assert [n for _, n in scan(tmp_path)] == ["ckpt-000000000010", "ckpt-000000000020"]
    assert "ckpt-000000000010" in caplog.text and "Permission denied" in caplog.text


def test_checkpoint_directory_deleted_while_training(tmp_path):
    d = tmp_path / "ckpts"
    _publish(d, 10)
    shutil.rmtree(d)
    _publish(d, 20)  # recreated: the next checkpoint publishes as usual
    assert [n for _, n in scan(d)] == ["ckpt-000000000020"]


# -- a full disk ----------------------------------------------------------------------------------
def test_full_disk_during_a_ps_dump_names_the_file_and_leaves_no_partial_files(small_fs):
    store = _store(8000)  # ~2.2 MB of rows for a 1 MiB filesystem
    with pytest.raises(OSError) as err:
        dump_store(store, small_fs / "ck", 0, 2, 1, fsync=True)
    assert err.value.errno == errno.ENOSPC
    assert str(small_fs) in str(err.value), f"the error does not say where: {err.value}"
    left = [p.name for p in (small_fs / "ck").rglob("*.tmp")]
    assert not left, f"partial files left on the full disk: {left}"


def test_full_disk_during_a_periodic_checkpoint_keeps_the_last_good_one(small_fs):
    d = small_fs / "ckpts"
    _publish(d, 10)
    store = _store(8000)
    before = scan(d)
    with pytest.raises(OSError) as err:
        write_cut(d, {"step": 20, "world_size": 1, "loaders": {}},
                  lambda tmp: dump_store(store, tmp, 0, 2, 1, fsync=True), keep=1)
    assert str(d) in str(err.value)
    assert scan(d) == before and (d / "ckpt-000000000010" / "dense.pt").is_file()
    assert not list(d.glob(plan.TMP_PREFIX + "*"))  # the failed cut's files are gone: the disk has room again
    _publish(d, 30)  # and the next cut, smaller, succeeds
    assert [n for _, n in scan(d)] == ["ckpt-000000000010", "ckpt-000000000030"]


def test_full_disk_while_saving_the_dense_model_names_the_file(small_fs):
    target = small_fs / "dense.pt"
    with pytest.raises(OSError) as err:
        write_atomically(target, lambda tmp: torch.save({"w": torch.zeros(1_000_000)}, tmp))
    assert str(small_fs) in str(err.value) and "free" in str(err.value), str(err.value)
    assert not list(small_fs.iterdir()), "the partial dense file stays on the full disk"


# -- damaged files --------------------------------------------------------------------------------
class _Ctx(EmbeddingCheckpoints):
    def __init__(self):
        self.model = torch.nn.Linear(3, 1)
        self.device = "cpu"


@pytest.mark.parametrize("keep_bytes", [0, 100])
def test_truncated_dense_file_is_an_error_naming_it(tmp_path, keep_bytes):
    path = tmp_path / "dense.pt"
    torch.save(torch.nn.Linear(3, 1).state_dict(), path)
    data = path.read_bytes()
    path.write_bytes(data[:keep_bytes])
    with pytest.raises(CheckpointLoadError) as err:
        _Ctx()._dense_loader(tmp_path, "dense.pt", None)
    assert str(path) in str(err.value) and "truncated" in str(err.value), str(err.value)


def test_directory_turned_read_only_fails_the_cut_naming_it_and_keeps_what_is_there(small_fs):
    d = small_fs / "ckpts"
    _publish(d, 10)
    before = sorted(str(p) for p in d.rglob("*"))
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    with pytest.raises(OSError) as err:
        _publish(d, 20)
    assert err.value.errno == errno.EROFS and str(d) in str(err.value), str(err.value)
    assert sorted(str(p) for p in d.rglob("*")) == before
    assert [n for _, n in scan(d)] == ["ckpt-000000000010"]  # and a resume still reads it


def test_flock_refused_by_the_filesystem_falls_back_to_a_lock_file(tmp_path, monkeypatch):
    import fcntl

    real, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        if calls[-1]:  # NFS: no exclusive lock on a read-only descriptor
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, op)

    monkeypatch.setattr(periodic.fcntl, "flock", flock)
    _publish(tmp_path, 10)
    assert calls == [True, False]
    assert "pid" in (tmp_path / plan.LOCK).read_text()
    assert [n for _, n in scan(tmp_path)] == ["ckpt-000000000010"]


@pytest.mark.parametrize("content", ["", '{"step": 10, "worl'])
def test_truncated_progress_file_is_an_error_naming_it(tmp_path, content):
    _publish(tmp_path, 10)
    progress = tmp_path / "ckpt-000000000010" / plan.PROGRESS
    progress.write_text(content)
    with pytest.raises(ValueError) as err:
        periodic.read_progress(progress.parent)
    assert str(progress) in str(err.value), str(err.value)


def test_truncated_optimizer_file_is_an_error_naming_it(tmp_path):
    """``opt.pt`` was read with a bare ``torch.load``: a damaged one said only torch's reader
    error, naming no file."""
    from persia.ctx import TrainCtx
    from persia.embedding.optim import Adagrad

    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters())
    ctx = TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1), dense_optimizer=opt)
    torch.save(model.state_dict(), tmp_path / "dense.pt")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    data = (tmp_path / "opt.pt").read_bytes()
    (tmp_path / "opt.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointLoadError) as err:
        ctx._dense_appliers(tmp_path, "dense.pt", "opt.pt", None)
    assert str(tmp_path / "opt.pt") in str(err.value) and "truncated" in str(err.value), str(err.value)
