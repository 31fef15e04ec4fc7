"""The baselines' building blocks: PERSIA-exact Adagrad, the fused table, one real training run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.spec import RunSpec
from bench.torch_baseline import FusedEmbeddingModel, PersiaAdagrad, TorchBaseline
from bench.trainloop import run_training
from synthetic_ctr.reader import read_chunks


def test_persia_adagrad_uses_the_old_accumulator_and_clips():
    w = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.95, 0.0]]))
    opt = PersiaAdagrad([w], lr=0.1, initial_accumulator_value=0.01, eps=1e-10, weight_bound=10.0)
    grad = torch.sparse_coo_tensor([[0, 2, 0]], torch.tensor([[0.5, 0.5], [-1.0, 0.0], [0.5, -1.0]]), (3, 2), check_invariants=True)
    w.grad = grad
    opt.step()
    g0 = torch.tensor([1.0, -0.5])  # row 0's gradients are summed (coalesced)
    expected0 = torch.tensor([1.0, 2.0]) - 0.1 * g0 / torch.sqrt(torch.tensor(0.01 + 1e-10))
    assert torch.allclose(w.data[0], expected0)
    assert torch.equal(w.data[1], torch.tensor([3.0, 4.0]))  # untouched row
    assert w.data[2, 0].item() == 10.0  # 9.95 + 1.0 clipped to the weight bound
    acc = opt.state[w]["sum"]
    assert torch.allclose(acc[0], 0.01 + g0 * g0) and torch.allclose(acc[1], torch.tensor([0.01, 0.01]))
    w.grad = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


def test_fused_table_looks_up_each_slot_in_its_own_rows():
    model = FusedEmbeddingModel(num_rows=26 * 3, hidden=(4,), oov_rows=np.array([77]))
    rows = torch.arange(26).reshape(1, 26) * 3 + 1  # row 1 of each slot's block
    with torch.no_grad():
        model.embedding.weight.zero_()
        model.embedding.weight[rows.reshape(-1)] = torch.arange(26, dtype=torch.float32).unsqueeze(1)
    pooled = model.embedding(rows.reshape(-1), torch.arange(26)).reshape(1, -1)
    assert torch.equal(pooled.reshape(26, 16)[:, 0], torch.arange(26, dtype=torch.float32))
    assert model.embedding.weight[77].abs().sum() == 0


def test_torch_baseline_learns_and_reports_every_field(small_dataset):
    out, manifest = small_dataset
    spec = RunSpec(system="torch", data_dir=str(out), batch_size=128, threads=1, eval_points=2, curve_eval_rows=500)
    result = run_training(spec, TorchBaseline)
    json.dumps(result)  # the PERSIA_RESULT payload must serialise
    assert result["train_samples"] == 2500 and result["test_samples"] == 1500
    assert result["samples_per_sec"] > 0 and result["threads"] == 1
    assert [p["samples"] for p in result["auc_curve"]] == [1280, 2500]
    assert 0.5 < result["auc"] <= 1.0  # one epoch on 2.5k rows already ranks better than chance
    assert result["peak_rss_mb"]["trainer"] > 50
    assert result["teacher_auc"] == manifest.teacher.test_auc


def test_baseline_only_updates_rows_it_saw(small_dataset):
    out, _ = small_dataset
    spec = RunSpec(system="torch", data_dir=str(out), batch_size=64, threads=1)
    trainer = TorchBaseline(spec)
    before = trainer.model.embedding.weight.detach().clone()
    batch = next(iter(read_chunks(out, 64)))
    trainer.train_step(batch)
    changed = (trainer.model.embedding.weight.detach() != before).any(dim=1).nonzero().flatten()
    seen = np.unique(trainer.index.rows(batch.ids))
    assert set(changed.tolist()) <= set(seen.tolist()) and len(changed) > 0


@pytest.mark.slow
def test_torchrec_baseline_trains_or_says_why_not(small_dataset):
    """In a subprocess: TorchRec initialises a torch.distributed group that must not leak into
    other tests. Without torchrec installed the run must report a skip with the reason."""
    from bench.e2e_bench import command_for, execute

    out, _ = small_dataset
    spec = RunSpec(system="torchrec", data_dir=str(out), batch_size=256, threads=1, eval_points=1, curve_eval_rows=300)
    argv, env = command_for(spec, None)
    record = execute(argv, env, 120, out.parent / "torchrec.log")
    if record["status"] == "skipped":
        assert record["reason"].startswith("torchrec not importable")
        return
    assert record["status"] == "ok", record.get("reason")
    result = record["result"]
    assert result["train_samples"] == 2500 and result["samples_per_sec"] > 0
    assert 0.0 <= result["auc"] <= 1.0
    assert record["memory"]["trainer"]["max_mb"] > 50
