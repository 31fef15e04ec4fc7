"""Linear weight gradients on a thread of their own (persia.nn_worker.weight_grads): when a context
defers them, that the gradients are torch's to the bit, that the training thread takes back what
the worker has not started, and that failures and discarded backwards leave nothing behind. Real
threads and real torch; every wait has a deadline."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F

from persia.nn_worker import weight_grads
from persia.nn_worker.weight_grads import DeferWeightGrads, WeightGradWorker, defers_now, eligible, weight_grad_plan

DEADLINE_S = 10.0


@pytest.fixture
def one_thread():
    """Products are deferred on one torch thread; the test process may run on more."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def worker():
    w = WeightGradWorker()
    yield w
    w.stop()


# -- when -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("environ, device, world, compiled, on, why", [
    ({}, "cpu", 1, False, True, "thread of their own"),
    ({"PERSIA_WEIGHT_GRAD_THREAD": "0"}, "cpu", 1, False, False, "PERSIA_WEIGHT_GRAD_THREAD=0"),
    ({"PERSIA_WEIGHT_GRAD_THREAD": "on"}, "cuda", 1, False, False, "cuda"),
    ({}, "cpu", 2, False, False, "DDP"),
    ({}, "cpu", 1, True, False, "compiled"),
])
def test_plan(environ, device, world, compiled, on, why):
    got, reason = weight_grad_plan(environ, device, world, compiled)
    assert got is on and why in reason


def test_plan_refuses_a_bad_switch_naming_it():
    with pytest.raises(ValueError, match="PERSIA_WEIGHT_GRAD_THREAD.*'sometimes'"):
        weight_grad_plan({"PERSIA_WEIGHT_GRAD_THREAD": "sometimes"}, "cpu", 1, False)


def test_only_one_torch_thread_defers():
    assert defers_now(1) and not defers_now(2)


def test_eligible_linears():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(2, 3))
    assert eligible(x, w)
    assert not eligible(torch.randn(2, 4, 3), w)  # 3-D input: torch's matmul path
    assert not eligible(x.double(), w)
    assert not eligible(x, torch.nn.Parameter(torch.randn(2, 3), requires_grad=False))  # frozen
    assert not eligible(x, w * 2)  # not a leaf
    assert not eligible(x, torch.nn.Parameter(torch.randn(3, 2)).t())  # not contiguous
    hooked = torch.nn.Parameter(torch.randn(2, 3))
    hooked.register_hook(lambda g: g)
    assert not eligible(x, hooked)  # autograd must run its hook


# -- what -----------------------------------------------------------------------------------------
class Tower(torch.nn.Module):
    """Linear layers with and without a bias, one used twice, one frozen, and one 3-D call."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 16, bias=False)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.seq = torch.nn.Linear(16, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(torch.relu(self.b(h))))  # the same weight twice
        h = self.frozen(h)
        h = self.seq(h.unsqueeze(1)).squeeze(1)  # (B, 1, 16): not deferred
        return torch.sigmoid(self.out(h))


def _grads(model, x, y, worker=None):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    if worker is None:
        out = model(x)
    else:
        with DeferWeightGrads(worker):
            out = model(x)
    F.binary_cross_entropy(out, y).backward()
    if worker is not None:
        worker.finish()
    return x.grad.clone(), {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def test_gradients_are_torchs_to_the_bit(one_thread, worker):
    torch.manual_seed(0)
    model = Tower()
    for step in range(5):
        x, y = torch.randn(64, 12), torch.randint(0, 2, (64, 1)).float()
        want_x, want = _grads(model, x, y)
        got_x, got = _grads(model, x, y, worker)
        assert torch.equal(got_x, want_x)
        assert got.keys() == want.keys()
        for name in want:
            if want[name] is None:
                assert got[name] is None, name
            else:
                assert torch.equal(got[name], want[name]), name
    # the eligible weights went through the worker: a, b twice, out (seq's 3-D call and the frozen layer did not)
    assert worker.by_worker + worker.taken_back == 5 * 4
    assert worker.pending() == 0


def test_a_forward_without_grad_or_under_autocast_is_torchs(one_thread, worker):
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with DeferWeightGrads(worker), torch.no_grad():
        out = model(x)
    assert out.grad_fn is None
    with DeferWeightGrads(worker), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16 and "Deferred" not in type(out.grad_fn).__name__
    with DeferWeightGrads(worker):
        out = model(x)
    assert "Deferred" in type(out.grad_fn).__name__


def test_the_training_thread_takes_back_what_the_worker_has_not_started(one_thread, worker, monkeypatch):
    """The worker held inside its first product: finish() computes the other two itself, then
    waits for the held one; the gradients are still the sums backward would have made."""
    entered, release = threading.Event(), threading.Event()
    compute = weight_grads._Product.compute

    def held(self):
        if threading.current_thread().name == "persia-weight-grads":
            entered.set()
            assert release.wait(DEADLINE_S)
        compute(self)

    monkeypatch.setattr(weight_grads._Product, "compute", held)
    w = torch.nn.Parameter(torch.randn(5, 3))
    parts = [(torch.randn(7, 5), torch.randn(7, 3)) for _ in range(3)]
    for g, x in parts:
        worker.queue(w, g, x)
    assert entered.wait(DEADLINE_S)
    done = threading.Event()
    failure: list = []

    def finish():
        try:
            worker.finish()
        except BaseException as exc:  # noqa: BLE001
            failure.append(exc)
        done.set()

    threading.Thread(target=finish, daemon=True).start()
    deadline = time.monotonic() + DEADLINE_S
    while worker.taken_back < 2:
        assert time.monotonic() < deadline, "finish() did not take back the two products not started"
        time.sleep(0.001)
    assert not done.is_set()  # it waits for the product in progress
    release.set()
    assert done.wait(DEADLINE_S) and not failure
    want = parts[0][0].t().mm(parts[0][1])
    want += parts[1][0].t().mm(parts[1][1])
    want += parts[2][0].t().mm(parts[2][1])
    assert torch.equal(w.grad, want)
    assert (worker.by_worker, worker.taken_back) == (1, 2)


def test_a_failed_product_is_raised_by_finish(one_thread, worker):
    w = torch.nn.Parameter(torch.randn(5, 3))
    worker.queue(w, torch.randn(7, 5), torch.randn(6, 3))  # 7 rows against 6: mm fails
    with pytest.raises(RuntimeError):
        worker.finish()
    assert w.grad is None and worker.pending() == 0


def test_a_discarded_backward_leaves_the_gradients_alone(one_thread, worker):
    w = torch.nn.Parameter(torch.randn(5, 3))
    w.grad = torch.ones(5, 3)
    worker.queue(w, torch.randn(7, 5), torch.randn(7, 3))
    worker.discard()
    worker.finish()
    assert torch.equal(w.grad, torch.ones(5, 3)) and worker.pending() == 0


def test_stop_ends_the_thread_and_later_products_are_computed_by_finish(one_thread):
    worker = WeightGradWorker()
    w = torch.nn.Parameter(torch.randn(5, 3))
    worker.queue(w, torch.randn(7, 5), torch.randn(7, 3))
    worker.finish()
    thread = worker._thread
    assert thread is not None and thread.is_alive()
    worker.stop()
    assert not thread.is_alive()
    w.grad = None
    g, x = torch.randn(7, 5), torch.randn(7, 3)
    worker.queue(w, g, x)
    worker.finish()
    assert torch.equal(w.grad, g.t().mm(x)) and worker.taken_back >= 1
