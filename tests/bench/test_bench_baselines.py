"""The baselines' building blocks: the PS's Adagrad (torch's formula), the fused table, one real training run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.spec import RunSpec
from bench.torch_baseline import FusedEmbeddingModel, SparseAdagrad, TorchBaseline
from bench.trainloop import run_training
from synthetic_ctr.reader import read_chunks


def _sparse_grad(rows, values, shape):
    return torch.sparse_coo_tensor([rows], torch.tensor(values), shape, check_invariants=True)


def test_sparse_adagrad_matches_torch_adagrad_over_several_steps():
    torch.manual_seed(0)
    start = torch.randn(6, 4)
    ours = torch.nn.Parameter(start.clone())
    ref = torch.nn.Parameter(start.clone())
    opt = SparseAdagrad([ours], lr=0.1, initial_accumulator_value=0.01, eps=1e-10, weight_bound=0.0)
    ref_opt = torch.optim.Adagrad([ref], lr=0.1, initial_accumulator_value=0.01, eps=1e-10)
    for step in range(5):
        rows = [step % 6, 5, (step * 2) % 6, 5]  # repeated rows are summed (coalesced) first
        values = torch.randn(4, 4).tolist()
        ours.grad = _sparse_grad(rows, values, (6, 4))
        ref.grad = _sparse_grad(rows, values, (6, 4))
        opt.step()
        with torch.sparse.check_sparse_tensor_invariants(enable=True):  # torch's own sparse tensors, checked
            ref_opt.step()
        assert torch.allclose(ours.data, ref.data, atol=1e-6), step
        assert torch.allclose(opt.state[ours]["sum"], ref_opt.state[ref]["sum"], atol=1e-6)
    assert not torch.equal(ours.data, start)


def test_sparse_adagrad_is_the_embedding_ps_update_and_clips():
    """Like for like: the baseline's step is the PS's ``apply_step`` (torch's formula), clip included."""
    from persia.embedding_ps.optimizers import AdagradConfig, apply_step

    w0 = np.array([[1.0, 2.0], [3.0, 4.0], [9.95, 0.0]], dtype=np.float32)
    w = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = SparseAdagrad([w], lr=0.1, initial_accumulator_value=0.01, eps=1e-10, weight_bound=10.0)
    w.grad = _sparse_grad([0, 2, 0], [[0.5, 0.5], [-1.0, 0.0], [0.5, -1.0]], (3, 2))
    opt.step()
    ps_w, ps_state = w0[[0, 2]].copy(), np.full((2, 2), 0.01, dtype=np.float32)
    apply_step(AdagradConfig(lr=0.1, initial_accumulator_value=0.01, eps=1e-10), ps_w, ps_state,
               np.array([[1.0, -0.5], [-1.0, 0.0]], dtype=np.float32), weight_bound=10.0)
    assert np.allclose(w.data.numpy()[[0, 2]], ps_w, atol=1e-6)
    assert np.allclose(opt.state[w]["sum"].numpy()[[0, 2]], ps_state, atol=1e-6)
    assert torch.equal(w.data[1], torch.tensor([3.0, 4.0]))  # untouched row
    assert w.data[2, 0].item() == 10.0  # 9.95 + 0.1 * 1 / sqrt(1.01) clipped to the weight bound
    # torch's formula, not PERSIA's: the new accumulator is in the denominator
    assert abs(w.data[0, 0].item() - (1.0 - 0.1 * 1.0 / (np.sqrt(0.01 + 1.0) + 1e-10))) < 1e-6
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


def test_fused_variant_uses_torchs_own_optimizers_and_learns(small_dataset):
    out, _ = small_dataset
    spec = RunSpec(system="torch", data_dir=str(out), batch_size=128, threads=1, eval_points=1, curve_eval_rows=500, fused=True)
    assert spec.label == "torch fused threads=1"
    trainer = TorchBaseline(spec)
    assert type(trainer.sparse_opt) is torch.optim.Adagrad and trainer.dense_opt.defaults["fused"] is True
    result = run_training(spec, lambda _spec: trainer)
    assert 0.5 < result["auc"] <= 1.0 and result["train_cpu_seconds"] > 0


def test_baseline_only_updates_rows_it_saw(small_dataset):
    out, _ = small_dataset
    spec = RunSpec(system="torch", data_dir=str(out), batch_size=64, threads=1)
    trainer = TorchBaseline(spec)
    before = trainer.model.embedding.weight.detach().clone()
    batch = next(iter(read_chunks(out, 64)))
    trainer.train_step(trainer.prepare(batch))
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
