"""Property: whatever sequence of training, checkpoint writes (some killed part-way) and restarts
happens, a restart resumes exactly the state of the last *published* checkpoint: every PS
replica's rows (weights and optimizer state), the dense model and optimizer, the step and the
loader positions. Real PS stores and the trainer's own checkpoint writer (``write_cut``) and
resume choice; no servers (a kill is an exception at a chosen point of the write)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persia.embedding_ps import AdagradConfig, EmbeddingStore, HyperParameters
from persia.embedding_ps.checkpoint import mark_checkpoint_complete
from persia.hashing import PS_SHARD_SALT, shard_of
from persia.nn_worker import checkpoint_plan as plan
from persia.nn_worker import periodic
from persia.nn_worker.periodic import read_progress, scan, write_cut

REPLICAS = 2
DIM = 3
UNIVERSE = np.array([i * 104729 + 7 for i in range(40)], dtype=np.uint64)
KEEP = 2


class Killed(Exception):
    pass


class Job:
    """What one incarnation of a job holds: PS replicas, the dense model and optimizer, counters."""

    def __init__(self):
        self.stores = []
        for i in range(REPLICAS):
            s = EmbeddingStore(1000, 2, seed=i)
            s.configure(HyperParameters(init_lower=-0.1, init_upper=0.1))
            s.register_optimizer(AdagradConfig(lr=0.1))
            self.stores.append(s)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(DIM, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.step = 0
        self.loaders = {0: 0, 1: 0}

    def train(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        signs = np.unique(rng.choice(UNIVERSE, size=6))
        owner = shard_of(signs, REPLICAS, PS_SHARD_SALT)
        for i, store in enumerate(self.stores):
            mine = signs[owner == i]
            if mine.size:
                store.lookup(mine, DIM, True)
                store.update(mine, rng.standard_normal((mine.size, DIM)).astype(np.float32))
        self.model.weight.grad = torch.from_numpy(rng.standard_normal((1, DIM)).astype(np.float32))
        self.model.bias.grad = torch.zeros(1)
        self.opt.step()
        self.step += 1
        self.loaders[seed % 2] += 1

    def state(self) -> dict:
        rows = []
        for store in self.stores:
            found, weights, state, _ = store.read_rows(UNIVERSE, DIM)
            order = np.argsort(found)
            rows.append((found[order].copy(), weights[order].copy(), state[order].copy()))
        return {"step": self.step, "loaders": dict(self.loaders), "rows": rows,
                "dense": {k: v.clone() for k, v in self.model.state_dict().items()},
                "momentum": [self.opt.state[p]["momentum_buffer"].clone() if p in self.opt.state else None
                             for p in self.model.parameters()]}


def dump(job: Job, directory: Path, kill_at: int | None, monkeypatch) -> dict | None:
    """The trainer's cut with ``kill_at`` = where the writer dies (None: it completes):
    0 after the dense files, 1 after replica 0's shard, 2 after every shard, 3 after COMPLETE."""

    def parts(tmp: Path) -> None:
        torch.save(job.model.state_dict(), tmp / "dense.pt")
        torch.save(job.opt.state_dict(), tmp / "opt.pt")
        if kill_at == 0:
            raise Killed
        for i, store in enumerate(job.stores):
            store.dump(tmp, i, 2, replica_size=REPLICAS, fsync=False)
            if kill_at == 1:
                raise Killed
        mark_checkpoint_complete(tmp, REPLICAS)
        if kill_at == 2:
            raise Killed

    real_replace = os.replace

    def dying_replace(src, dst):
        if kill_at == 3 and Path(src).name.startswith(plan.TMP_PREFIX):
            raise Killed  # COMPLETE is written, the rename is not done
        return real_replace(src, dst)

    progress = {"step": job.step, "world_size": 1, "loaders": {str(k): {"0": v} for k, v in job.loaders.items()}}
    monkeypatch.setattr(periodic.os, "replace", dying_replace)
    try:
        write_cut(directory, progress, parts, KEEP)
        return job.state()
    except Killed:
        return None
    finally:
        monkeypatch.setattr(periodic.os, "replace", real_replace)


def restart(directory: Path) -> Job:
    """A new incarnation: fresh processes, then the resume path's choice, stage and commit."""
    job = Job()
    choice = plan.resume_choice("auto", scan(directory))
    if choice is None:
        return job
    path = directory / choice[1]
    for i, store in enumerate(job.stores):
        store.stage(path, i, REPLICAS, 2)
    for store in job.stores:
        store.commit_staged()
    job.model.load_state_dict(torch.load(path / "dense.pt", weights_only=True))
    job.opt.load_state_dict(torch.load(path / "opt.pt", weights_only=True))
    progress = read_progress(path)
    job.step = progress["step"]
    job.loaders = {int(k): v["0"] for k, v in progress["loaders"].items()}
    return job


def assert_same(state: dict, expected: dict) -> None:
    assert state["step"] == expected["step"]
    assert state["loaders"] == expected["loaders"]
    for (s1, w1, o1), (s2, w2, o2) in zip(state["rows"], expected["rows"]):
        np.testing.assert_array_equal(s1, s2)
        np.testing.assert_array_equal(w1, w2)
        np.testing.assert_array_equal(o1, o2)
    for k in expected["dense"]:
        torch.testing.assert_close(state["dense"][k], expected["dense"][k], rtol=0, atol=0)
    for a, b in zip(state["momentum"], expected["momentum"]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


ops = st.lists(st.one_of(
    st.tuples(st.just("train"), st.integers(0, 2**16)),
    st.tuples(st.just("dump"), st.one_of(st.none(), st.integers(0, 3))),
    st.tuples(st.just("restart"), st.none()),
), min_size=1, max_size=14)


@pytest.fixture(scope="module")
def mp():
    with pytest.MonkeyPatch.context() as m:
        yield m


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_restart_resumes_the_last_published_checkpoint(mp, sequence):
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d)
        job = Job()
        published = Job().state()  # nothing published yet: a restart starts from scratch
        for kind, arg in sequence + [("restart", None)]:
            if kind == "train":
                job.train(arg)
            elif kind == "dump":
                if published["step"] == job.step and scan(directory):
                    continue  # the trainer never writes the same step twice
                state = dump(job, directory, arg, mp)
                if state is not None:
                    published = state
            else:
                job = restart(directory)
                assert_same(job.state(), published)
            complete = scan(directory)
            assert len(complete) <= KEEP
            if complete:
                assert complete[-1][0] == published["step"]


def test_a_failed_cut_leaves_no_temporary_directory_and_the_next_removes_a_killed_writers(tmp_path):
    """A cut that fails (a full disk, a PS restarted mid-dump) removes its own temporary directory:
    each failed cut left up to a whole checkpoint behind, until the trainer restarted. What a
    killed writer left, the next cut removes."""
    killed = tmp_path / plan.tmp_name(5)  # a writer killed at step 5 left this
    killed.mkdir()
    (killed / "dense.pt").write_bytes(b"x" * 1000)

    def disk_full(tmp: Path) -> None:
        (tmp / "dense.pt").write_bytes(b"x" * 1000)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_cut(tmp_path, {"step": 10, "world_size": 1, "loaders": {}}, disk_full, KEEP)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # its own and the killed writer's are gone
    killed.mkdir()
    marker = write_cut(tmp_path, {"step": 20, "world_size": 1, "loaders": {}},
                       lambda tmp: (tmp / "dense.pt").write_bytes(b"y"), KEEP)
    assert sorted(p.name for p in tmp_path.iterdir()) == [plan.checkpoint_name(20)]
    assert marker["step"] == 20 and scan(tmp_path) == [(20, plan.checkpoint_name(20))]
