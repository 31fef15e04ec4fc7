"""Linear layers' weight gradients on a thread of their own while backward goes on (CPU).

Why: on one torch thread the training thread computes all of backward. For each ``nn.Linear`` (any
``F.linear`` on a 2-D input) backward computes the input's gradient, which the layers below wait
for, and the weight's, ``grad_outᵀ · input``, which nothing in backward needs: about a third of an
MLP's training FLOPs. On a machine whose other CPU the embedding path leaves half idle (local mode
at batch 1024: docs/benchmarks.md, issue 15) those products can run there, beside the rest of
backward, without the OpenMP barriers that make a second torch thread stall whenever another role
takes its core.

How: while the model's forward runs, :class:`DeferWeightGrads` (a thread-local torch function
mode, so no model is changed and no other thread is affected) routes each eligible ``F.linear``
through :class:`_LinearWithDeferredWeight`. Its backward returns the input's and the bias's
gradients at once and queues the weight's product. A worker thread (``persia-weight-grads``, one
torch thread) takes queued products in order; :meth:`WeightGradWorker.finish`, called once
backward is done, computes on the calling thread the products the worker has not started (so a
worker kept off its core costs at most the product it is in), waits for the one in progress and
adds each result to its weight's ``.grad`` in the order backward queued them. The products are the
same torch call on the same tensors as torch's own backward, so the gradients are bit for bit
torch's (``tests/unit/test_weight_grads.py``).

Only where it is safe: a CPU model stepped by ``TrainCtx.backward`` on one NN worker (DDP's
reducer waits for gradients autograd accumulates), one torch thread (on several the OpenMP team
uses the cores already), float32 without autocast, a leaf weight without gradient hooks, and a
model not compiled by ``torch.compile``. ``PERSIA_WEIGHT_GRAD_THREAD=0`` turns it off.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from persia.env import switch_on

ENV_SWITCH = "PERSIA_WEIGHT_GRAD_THREAD"


def weight_grad_plan(environ: Mapping[str, str], device_type: str, world_size: int, compiled: bool) -> tuple[bool, str]:
    """Whether a training context defers weight gradients at all, and why (pure). Whether a given
    step does also depends on the torch thread count then (:func:`defers_now`)."""
    if not switch_on(ENV_SWITCH, environ):
        return False, f"{ENV_SWITCH}=0"
    if device_type != "cpu":
        return False, f"the model trains on {device_type}"
    if world_size > 1:
        return False, "DDP all-reduces gradients as autograd accumulates them"
    if compiled:
        return False, "the model is compiled (torch.compile)"
    return True, "Linear weight gradients on a thread of their own while training on one torch thread"


def defers_now(torch_threads: int) -> bool:
    """On several torch threads the OpenMP team already uses the other cores."""
    return torch_threads == 1


def eligible(inp: torch.Tensor, weight: torch.Tensor) -> bool:
    """An ``F.linear`` whose weight gradient may be computed elsewhere: a 2-D float32 input, a
    leaf float32 weight that wants a gradient, and no hook that autograd would have to run."""
    return (
        isinstance(inp, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and inp.dim() == 2
        and weight.dim() == 2
        and weight.is_contiguous()
        and inp.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.is_leaf
        and weight.requires_grad
        and not weight._backward_hooks
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and inp.device.type == "cpu"
        and weight.device.type == "cpu"
    )


class _Product:
    """One weight's gradient, ``grad_outᵀ · inp``: queued, being computed, or done."""

    __slots__ = ("weight", "grad_out", "inp", "result", "error", "state")
    QUEUED, RUNNING, DONE = 0, 1, 2

    def __init__(self, weight: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor):
        self.weight, self.grad_out, self.inp = weight, grad_out, inp
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.state = self.QUEUED

    def compute(self) -> None:
        try:
            self.result = torch.mm(self.grad_out.t(), self.inp)  # what torch's addmm backward calls
        except BaseException as exc:  # noqa: BLE001 - raised by finish(), on the training thread
            self.error = exc
        self.grad_out = self.inp = None


class WeightGradWorker:
    """The queue of weight products of one backward and the thread that works through it.

    :meth:`queue` is called from backward, :meth:`finish` and :meth:`discard` after it, all on the
    training thread; the worker thread starts with the first product."""

    def __init__(self, name: str = "persia-weight-grads"):
        self._name = name
        self._cond = threading.Condition()
        self._queued: collections.deque[_Product] = collections.deque()
        self._all: list[_Product] = []  # this backward's, in the order queued
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.by_worker = 0  # products the worker computed (the rest the training thread took back)
        self.taken_back = 0

    def queue(self, weight: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
        product = _Product(weight, grad_out, inp)
        with self._cond:
            self._all.append(product)
            if self._stopped:
                return  # finish() computes it here
            self._queued.append(product)
            if self._thread is None:
                self._start()
            self._cond.notify()

    def _start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=self._name, daemon=True)
        self._thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        # one OpenMP/MKL thread for this thread's products (the setting is per thread for both;
        # the process-wide count is 1 whenever products are queued)
        torch.set_num_threads(1)
        ready.set()
        while True:
            with self._cond:
                while not self._queued and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                product = self._queued.popleft()
                product.state = _Product.RUNNING
            product.compute()
            with self._cond:
                product.state = _Product.DONE
                self.by_worker += 1
                self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._all)

    def finish(self) -> None:
        """Every queued product done (here, if the worker has not started it) and added to its
        weight's ``.grad`` in the order backward queued them; a product's failure is raised."""
        with self._cond:
            products, self._all = self._all, []
            mine = [p for p in products if p.state == _Product.QUEUED]
            for p in mine:
                p.state = _Product.RUNNING
            if mine:
                self._queued = collections.deque(p for p in self._queued if p.state == _Product.QUEUED)
        for p in mine:
            p.compute()
            p.state = _Product.DONE
        self.taken_back += len(mine)
        with self._cond:
            while any(p.state != _Product.DONE for p in products):
                self._cond.wait()
        for p in products:
            if p.error is not None:
                raise p.error
        with torch.no_grad():
            for p in products:
                if p.weight.grad is None:
                    p.weight.grad = p.result
                else:
                    p.weight.grad += p.result

    def discard(self) -> None:
        """Backward failed: drop this backward's products (the one in progress ends unused)."""
        with self._cond:
            self._all = []
            self._queued.clear()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._queued.clear()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


class _LinearWithDeferredWeight(torch.autograd.Function):
    """``F.linear`` whose backward queues the weight's gradient instead of returning it."""

    @staticmethod
    def forward(ctx, inp, weight, bias, worker):
        ctx.save_for_backward(inp, weight)
        ctx.worker = worker
        return F.linear(inp, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        inp, weight = ctx.saved_tensors
        grad_in = grad_out.mm(weight) if ctx.needs_input_grad[0] else None
        ctx.worker.queue(weight, grad_out, inp)
        grad_bias = grad_out.sum(0) if ctx.needs_input_grad[2] else None
        return grad_in, None, grad_bias, None


class DeferWeightGrads(TorchFunctionMode):
    """For the span of a forward on the training thread: eligible ``F.linear`` calls record their
    weight's gradient for ``worker`` (see the module docstring)."""

    def __init__(self, worker: WeightGradWorker):
        super().__init__()
        self.worker = worker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"):
            inp = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if eligible(inp, weight) and (bias is None or isinstance(bias, torch.Tensor)):
                return _LinearWithDeferredWeight.apply(inp, weight, bias, self.worker)
        return func(*args, **kwargs)
