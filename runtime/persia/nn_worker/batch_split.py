"""A training step's batch split across threads: in-process data parallelism on the CPU.

Why: on a machine the roles share, a dense step on several OpenMP threads waits at every parallel
region's barrier for whichever team thread another role preempted, so the NN worker trained
fastest on one thread and the second core did little dense work (docs/benchmarks.md, issue 15).
Here the batch is cut into row chunks that threads take from a shared list as they come free,
each running a chunk's forward (later its backward) on one torch thread. Nothing waits inside a
chunk: a thread that another role slows takes fewer of them. MLP 400-400-400, batch 1024, on its
own: 24.6 ms a step on one thread, 17.4 on two splitting threads; with a 30 % load on the second
CPU, 28.7 against 20.5-21.9 (session 26).

The semantics are DDP's: each chunk's forward sees its rows only, as each rank's forward does under
DDP, and the chunks' gradients sum into ``.grad`` (in another order than one batch's, so the last
bits differ). A model with buffers (BatchNorm's running statistics) is not split: two threads would
write them at once.

How: the model runs per chunk on detached slices of the step's embedding tensors. What the user
gets is the chunks' outputs, detached again as leaves, concatenated; the user's loss and
``backward`` run as before and stop at those leaves. :meth:`BatchSplitter.backward` then runs each
chunk's graph backward from its leaf's gradient on the threads, and the chunks' embedding
gradients, concatenated, go backward once through the step's embedding gather on the calling
thread (so the distinct-row gradients are what one batch would have made).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Rows per chunk the split aims at. Alone, MLP 400 at batch 1024 stepped in 17.4 ms on 4 chunks
# against 19.0 on 2; at batch 256, 2 chunks of 128 took 6.4 ms and 4 of 64 took 7.5 (per-chunk
# Python and smaller GEMMs); under a neighbour's load 8 chunks of 128 were best at batch 1024.
CHUNK_ROWS = 256
MIN_CHUNK_ROWS = 32


def chunk_bounds(rows: int, threads: int, chunk_rows: int = CHUNK_ROWS,
                 min_rows: int = MIN_CHUNK_ROWS) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` of a batch of ``rows`` (pure): about ``chunk_rows`` each, at
    least one per thread while each keeps ``min_rows``; sizes differ by one row at most. One range
    means: do not split."""
    if rows < 1 or threads < 1:
        return [(0, max(rows, 0))]
    chunks = max(threads, -(-rows // chunk_rows))
    chunks = max(1, min(chunks, rows // min_rows))
    base, extra = divmod(rows, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` must not be split, or None (pure)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "the model is wrapped in DistributedDataParallel, which expects one forward per step"
    for name, _ in model.named_buffers():
        return (f"the model has buffers ({name!r}; BatchNorm's running statistics are some), which threads "
                "would write at once")
    return None


class ChunkPool:
    """``threads - 1`` helper threads and the caller run a list of tasks, each thread taking the
    next task nobody took yet. Helpers run torch on one thread each, with the creator's denormal
    flushing."""

    def __init__(self, threads: int, name: str = "persia-split"):
        if threads < 2:
            raise ValueError(f"a chunk pool needs at least 2 threads, got {threads}")
        self.threads = threads
        self._flush = bool((torch.tensor(1e-39, dtype=torch.float32) * 1.0).item() == 0.0)
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._generation = 0
        self._closed = False
        self._helpers = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True)
                         for i in range(threads - 1)]
        for t in self._helpers:
            t.start()
        # their kernel ids: CPU placement lets them run wherever the training thread may
        self.native_ids = frozenset(t.native_id for t in self._helpers)

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run every task once, on the helpers and the calling thread; returns when all ended,
        raising the first task's error."""
        job = _Job(tasks, helpers=len(self._helpers))
        with self._cond:
            if self._closed:
                raise RuntimeError("chunk pool is closed")
            self._job, self._generation = job, self._generation + 1
            self._cond.notify_all()
        job.drain()
        job.wait_helpers()
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._helpers:
            t.join(timeout=5)

    def _serve(self) -> None:
        torch.set_num_threads(1)
        torch.set_flush_denormal(self._flush)
        seen = 0
        while True:
            with self._cond:
                while not self._closed and self._generation == seen:
                    self._cond.wait()
                if self._closed:
                    return
                seen, job = self._generation, self._job
            try:
                job.drain()
            finally:
                job.helper_done()


class _Job:
    def __init__(self, tasks: Sequence[Callable[[], None]], helpers: int):
        self.tasks = tasks
        self._next = itertools.count()  # next() is atomic under the GIL
        self.error: BaseException | None = None
        self._left = helpers
        self._done = threading.Condition()

    def drain(self) -> None:
        while True:
            i = next(self._next)
            if i >= len(self.tasks):
                return
            if self.error is not None:
                continue  # the step fails anyway: take the rest without running them
            try:
                self.tasks[i]()
            except BaseException as exc:  # noqa: BLE001 (re-raised on the calling thread)
                if self.error is None:
                    self.error = exc

    def helper_done(self) -> None:
        with self._done:
            self._left -= 1
            if self._left == 0:
                self._done.notify_all()

    def wait_helpers(self) -> None:
        with self._done:
            while self._left:
                self._done.wait()


@dataclass
class _Chunks:
    """One step's split forward, kept for its backward."""

    outputs: list[list[torch.Tensor]]  # per chunk, the model's output tensors (with their graphs)
    leaves: list[list[torch.Tensor]]  # per chunk, those outputs detached: what the user's loss saw
    emb: list[torch.Tensor]  # the step's embedding tensors (their graph ends at the reply's rows)
    emb_chunks: list[list[torch.Tensor]]  # per chunk, the detached slices the model ran on


class BatchSplitter:
    """Runs a step's forward per chunk on a :class:`ChunkPool` and, after the user's backward, the
    chunks' backward (see the module's docstring)."""

    def __init__(self, threads: int, chunk_rows: int = CHUNK_ROWS):
        self.threads = threads
        self.chunk_rows = chunk_rows
        self.pool = ChunkPool(threads)
        self._pending: _Chunks | None = None

    def close(self) -> None:
        self._pending = None
        self.pool.close()

    def forward(self, model: Callable, non_id: list[torch.Tensor], emb: list[torch.Tensor]):
        """The model's output for the whole batch, computed per chunk; None when this batch cannot
        be split (one chunk, rows that differ between inputs, an output that is not row-wise
        tensors): the caller runs the model whole."""
        self._pending = None
        tensors = [*non_id, *emb]
        if not tensors or any(not isinstance(t, torch.Tensor) or t.dim() == 0 for t in tensors):
            return None
        rows = tensors[0].shape[0]
        if any(t.shape[0] != rows for t in tensors):
            return None
        bounds = chunk_bounds(rows, self.threads, self.chunk_rows)
        if len(bounds) < 2:
            return None
        emb_chunks = [[e[a:b].detach().requires_grad_(e.requires_grad) for e in emb] for a, b in bounds]
        results: list = [None] * len(bounds)

        def task(i: int, a: int, b: int):
            def run():
                with torch.enable_grad():
                    results[i] = model([x[a:b] for x in non_id], emb_chunks[i])
            return run

        self.pool.run([task(i, a, b) for i, (a, b) in enumerate(bounds)])
        shape = _row_outputs(results, bounds)
        if shape is None:
            return None
        outputs = [_as_list(r) for r in results]
        leaves = [[o.detach().requires_grad_(o.requires_grad) for o in outs] for outs in outputs]
        joined = [torch.cat([leaves[c][k] for c in range(len(bounds))]) for k in range(len(outputs[0]))]
        self._pending = _Chunks(outputs, leaves, list(emb), emb_chunks)
        if shape == "tensor":
            return joined[0]
        return tuple(joined) if shape == "tuple" else joined

    def backward(self) -> None:
        """After the user's loss went backward to the joined output: each chunk's graph backward
        from its leaves' gradients (dense ``.grad`` sums over chunks), then the embeddings' gather
        once. No-op when the last forward was not split."""
        step, self._pending = self._pending, None
        if step is None:
            return

        def task(c: int):
            def run():
                pairs = [(o, leaf.grad) for o, leaf in zip(step.outputs[c], step.leaves[c])
                         if leaf.grad is not None and o.requires_grad]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            return run

        self.pool.run([task(c) for c in range(len(step.outputs))])
        tensors, grads = [], []
        for k, e in enumerate(step.emb):
            parts = [chunk[k].grad for chunk in step.emb_chunks]
            if not e.requires_grad or all(p is None for p in parts):
                continue  # no chunk used this slot: as in one batch, backward never reaches it
            parts = [torch.zeros_like(chunk[k]) if p is None else p for p, chunk in zip(parts, step.emb_chunks)]
            tensors.append(e)
            grads.append(torch.cat(parts))
        if tensors:
            torch.autograd.backward(tensors, grads)


def _as_list(output) -> list:
    return [output] if isinstance(output, torch.Tensor) else list(output)


def _row_outputs(results: list, bounds: list[tuple[int, int]]) -> str | None:
    """``"tensor"``, ``"tuple"`` or ``"list"`` when every chunk's output is that, made of tensors
    with one row per input row; None otherwise (pure)."""
    first = results[0]
    kind = "tensor" if isinstance(first, torch.Tensor) else "tuple" if isinstance(first, tuple) \
        else "list" if isinstance(first, list) else None
    if kind is None:
        return None
    width = len(_as_list(first))
    for r, (a, b) in zip(results, bounds):
        if not isinstance(r, type(first)) and not (kind == "tensor" and isinstance(r, torch.Tensor)):
            return None
        parts = _as_list(r)
        if len(parts) != width or width == 0:
            return None
        if any(not isinstance(p, torch.Tensor) or p.dim() == 0 or p.shape[0] != b - a for p in parts):
            return None
    return kind
