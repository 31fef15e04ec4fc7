"""``PERSIA_TORCH_THREADS=auto`` in a real training job: the NN worker trains blocks of steps at each
thread count, then keeps the faster (real nats-server, gRPC PS and embedding worker, torch)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from persia.ctx import TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.optim import Adagrad
from persia.nn_worker import train_ctx
from persia.nn_worker.thread_tuning import TuningPlan

from .cluster import cluster
from .test_training_path import Model, make_batch, send_in_thread

pytestmark = pytest.mark.integration


class CountingModel(Model):
    """Records the torch thread count each training step's forward ran with."""

    def __init__(self):
        super().__init__()
        self.seen: list[int] = []

    def forward(self, non_id, emb):
        if self.training:
            self.seen.append(torch.get_num_threads())
        return super().forward(non_id, emb)


def _short_tuning(monkeypatch):
    monkeypatch.setenv("PERSIA_TORCH_THREADS", "auto")
    # two counts even where the runner has one core (the start, the share of the cores, first);
    # short blocks, so a test-sized run measures
    monkeypatch.setattr(train_ctx, "candidates_for", lambda share: (share, 1) if share > 1 else (1, 2))
    monkeypatch.setattr(train_ctx, "TuningPlan", functools.partial(
        TuningPlan, start_step=2, calibration_steps=2, min_block_s=0.0, min_block_steps=2, rounds=1,
        clear_loss_margin=1e9))  # every block runs, whatever the timings


def _train(model: CountingModel, reproducible: bool):
    errors: list = []
    threads_before = torch.get_num_threads()
    try:
        with cluster():
            sender = send_in_thread([make_batch(i) for i in range(20)], errors)
            with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                          dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
                tuner = ctx._thread_tuner
                for batch in DataLoader(StreamingDataset(4), embedding_staleness=2, reproducible=reproducible):
                    out, labels = ctx.forward(batch)
                    ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
                threads_after = torch.get_num_threads()
            sender.join(30)
    finally:
        torch.set_num_threads(threads_before)
    assert not errors, errors
    assert len(model.seen) == 20  # every batch trained
    return tuner, threads_after


def test_auto_threads_train_blocks_at_each_count_then_keep_the_choice(persia_env, monkeypatch, caplog):
    _short_tuning(monkeypatch)
    caplog.set_level(logging.INFO, logger="persia.nn_worker.train_ctx")
    model = CountingModel()
    tuner, threads_after = _train(model, reproducible=False)
    a, b = tuner.plan.candidates
    # steps 1-4 start and calibrate; blocks of 2 steps at a, b, b, a threads; then the choice
    assert model.seen[:4] == [a] * 4
    assert model.seen[4:12] == [a, a, b, b, b, b, a, a]
    assert tuner.chosen in (a, b) and model.seen[12:] == [tuner.chosen] * 8 and threads_after == tuner.chosen
    assert len(tuner.samples[a]) == 2 and len(tuner.samples[b]) == 2
    assert all(s > 0 for v in tuner.samples.values() for s in v)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch threads: ")]
    assert len(lines) == 1 and "1 thread " in lines[0] and "2 threads " in lines[0], lines


def test_a_reproducible_stream_keeps_the_start_count(persia_env, monkeypatch, caplog):
    """The thread count changes how torch sums; reproducible mode must not depend on timings."""
    _short_tuning(monkeypatch)
    caplog.set_level(logging.INFO, logger="persia.nn_worker.train_ctx")
    model = CountingModel()
    tuner, threads_after = _train(model, reproducible=True)
    start = tuner.plan.candidates[0]
    assert model.seen == [start] * 20 and threads_after == start and tuner.samples == {c: [] for c in tuner.plan.candidates}
    assert any(r.getMessage() == f"torch threads: {start}, not measured (reproducible mode)" for r in caplog.records)


def test_a_fixed_count_is_not_measured(persia_env, monkeypatch):
    monkeypatch.setenv("PERSIA_TORCH_THREADS", "1")
    threads_before = torch.get_num_threads()
    try:
        with cluster():
            model = Model()
            with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                          dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
                assert ctx._thread_tuner is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads_before)


_RANK_SCRIPT = r"""
import json, os, sys
import torch
import torch.distributed as dist
from persia.nn_worker.thread_tuning import ThreadTuner, TuningPlan
from persia.nn_worker.train_ctx import max_over_ranks

rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2)
# simulated step times per count: alone, rank 0 would keep 1 thread and take 15-step blocks
per_threads = {0: {2: 0.021, 1: 0.019}, 1: {2: 0.010, 1: 0.030}}[rank]
state = {"threads": 2, "now": 0.0, "applied": []}

def set_threads(n):
    state["threads"] = n
    state["applied"].append(n)

tuner = ThreadTuner(TuningPlan((2, 1), start_step=2, calibration_steps=2, min_block_s=0.3, rounds=1), set_threads,
                    lambda: state["now"], agree=max_over_ranks(None))
while tuner.measuring:
    state["now"] += per_threads[state["threads"]]
    tuner.step_done()
print(json.dumps({"block": tuner.block, "chosen": tuner.chosen, "applied": state["applied"], "steps": tuner.steps}))
dist.destroy_process_group()
"""


def test_ranks_measure_the_same_blocks_and_keep_the_same_count(tmp_path):
    """Two real processes joined by gloo: the all-reduce gives both the slower calibration's block
    length and the same choice, although alone one of them would have chosen the other count."""
    import json
    import os
    import subprocess
    import sys

    from persia.utils import find_free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port(host="127.0.0.1")),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    assert outs[0]["block"] == 30  # rank 1's 10 ms steps: 0.3 s takes 30 of them
    assert outs[0]["chosen"] == 2 and outs[0]["applied"] == [2, 1, 1, 2, 2]
    assert outs[0]["steps"] == 2 + 2 + 4 * 30
