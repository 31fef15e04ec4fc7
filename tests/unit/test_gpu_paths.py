"""The NN worker's GPU paths that can be decided without a GPU: which device an evaluation context
opened inside a training context uses, and the dtype of a mixed-precision forward's output.

Where a test pretends that one CUDA device exists (``one_fake_gpu``) it stands in for
``torch.cuda``'s device queries only: that tensors really land on the GPU, autocast and NCCL are
checked on a GPU machine (docs/benchmarks.md, "GPU"), and by the ``cuda`` test here when one is
present.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from persia.context import BaseCtx
from persia.ctx import eval_ctx
from persia.nn_worker.embedding_ctx import inherited_device_id
from persia.nn_worker.train_ctx import float32_outputs


class _Ctx:
    def __init__(self, device_id):
        self.device_id = device_id


@pytest.mark.parametrize(
    ("given", "enclosing", "expected"),
    [
        (None, None, None),  # no enclosing context: CPU
        (None, _Ctx(None), None),  # enclosing context on the CPU
        (None, _Ctx(0), 0),  # eval_ctx inside a CUDA TrainCtx: that GPU
        (1, _Ctx(0), 1),  # an explicit device wins
        (0, None, 0),
    ],
)
def test_inherited_device_id(given, enclosing, expected):
    assert inherited_device_id(given, enclosing) == expected


@pytest.fixture
def one_fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda _d: None)


def test_eval_ctx_inside_a_gpu_context_keeps_its_device(one_fake_gpu):
    with BaseCtx(device_id=0):
        inner = eval_ctx(model=None)
        explicit = eval_ctx(None, None, 10, None)  # positional device_id=None still inherits
    assert inner.device_id == 0 and inner.device == torch.device("cuda:0")
    assert explicit.device == torch.device("cuda:0")
    outside = eval_ctx(model=None)
    assert outside.device_id is None and outside.device == torch.device("cpu")


def test_out_of_range_device_still_rejected_by_name(one_fake_gpu):
    with pytest.raises(ValueError, match="device_id=3 out of range"):
        eval_ctx(model=None, device_id=3)


def test_half_outputs_become_float32_and_bce_then_works():
    label = torch.rand(4, 1)
    half = torch.rand(4, 1).half()
    with pytest.raises(RuntimeError, match="dtype"):
        F.binary_cross_entropy(half, label)  # what the adult-income example hit on a GPU
    out = float32_outputs(half)
    assert out.dtype == torch.float32
    assert torch.equal(out, half.float())
    assert torch.isfinite(F.binary_cross_entropy(out, label))


def test_float32_outputs_keeps_other_values_and_containers():
    f32 = torch.rand(3)
    ids = torch.arange(3)
    assert float32_outputs(f32) is f32
    assert float32_outputs(ids) is ids
    t = float32_outputs((torch.rand(2).half(), ids))
    assert isinstance(t, tuple) and t[0].dtype == torch.float32 and t[1] is ids
    lst = float32_outputs([torch.rand(2).bfloat16()])
    assert isinstance(lst, list) and lst[0].dtype == torch.float32
    d = float32_outputs({"p": torch.rand(2).half(), "n": 3})
    assert d["p"].dtype == torch.float32 and d["n"] == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autocast_sigmoid_output_trains_with_bce_and_grad_scaler():
    model = torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Sigmoid()).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    x, y = torch.randn(16, 8, device="cuda"), torch.rand(16, 1, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        raw = model(x)
    assert raw.dtype == torch.float16
    loss = F.binary_cross_entropy(float32_outputs(raw), y)
    before = model[0].weight.detach().clone()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(before, model[0].weight.detach())
