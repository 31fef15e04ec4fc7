"""Request batching with a bounded latency.

The first request of a batch waits at most ``max_latency_s`` for others; a batch closes early
once it holds ``max_batch_size`` samples. Requests whose slots or dense columns differ are never
merged (they run as separate batches). The queue is bounded: a full queue refuses at once
(``QueueFull``, answered 503) instead of letting latency grow without limit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from persia.data_loader.batch import PersiaBatch
from persia.serving.request import signature

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests wait than ``max_queue``."""


def take_batch(pending: list[tuple[PersiaBatch, Future]], max_batch_size: int) -> tuple[list, list]:
    """Pure decision: the requests of the first request's signature that fit ``max_batch_size``
    samples (the first always goes, even alone over the limit), and the rest in arrival order."""
    if not pending:
        return [], []
    sig = signature(pending[0][0])
    taken, rest, samples = [], [], 0
    for item in pending:
        n = item[0].batch_size
        if signature(item[0]) == sig and (not taken or samples + n <= max_batch_size):
            taken.append(item)
            samples += n
        else:
            rest.append(item)
    return taken, rest


class Batcher:
    """``submit(batch)`` returns a Future of that request's output rows; ``run(batches)`` gets
    the requests of one model batch and returns one output per request."""

    def __init__(self, run: Callable[[Sequence[PersiaBatch]], list], max_batch_size: int,
                 max_latency_s: float, max_queue: int = 1024, workers: int = 2,
                 on_batch: Callable[[int], None] | None = None):
        self._run = run
        self.max_batch_size = max_batch_size
        self.max_latency_s = max_latency_s
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="serve-batch")
        self._slots = threading.BoundedSemaphore(workers)  # never collect more batches than run
        self._on_batch = on_batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, name="serve-batcher", daemon=True)
        self._thread.start()

    def depth(self) -> int:
        return self._queue.qsize()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, batch: PersiaBatch) -> Future:
        if self._stop.is_set():
            raise RuntimeError("the model server is stopping")
        fut: Future = Future()
        try:
            self._queue.put_nowait((batch, fut))
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None
        return fut

    def _collect(self) -> None:
        pending: list[tuple[PersiaBatch, Future]] = []
        while not self._stop.is_set():
            if not pending:
                try:
                    pending.append(self._queue.get(timeout=0.2))
                except queue.Empty:
                    continue
            deadline = time.monotonic() + self.max_latency_s
            while sum(b.batch_size for b, _ in pending) < self.max_batch_size:
                left = deadline - time.monotonic()
                try:
                    pending.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
                except queue.Empty:
                    break
            taken, pending = take_batch(pending, self.max_batch_size)
            self._slots.acquire()
            self._pool.submit(self._execute, taken)
        for _, fut in pending:
            fut.set_exception(RuntimeError("the model server is stopping"))

    def _execute(self, taken: list[tuple[PersiaBatch, Future]]) -> None:
        try:
            live = [(b, f) for b, f in taken if f.set_running_or_notify_cancel()]
            if not live:
                return
            if self._on_batch is not None:
                self._on_batch(sum(b.batch_size for b, _ in live))
            try:
                outputs = self._run([b for b, _ in live])
            except BaseException as exc:  # every waiting request gets the error
                for _, f in live:
                    f.set_exception(exc)
                return
            for (_, f), out in zip(live, outputs):  # an exception in place of an output fails that request
                f.set_exception(out) if isinstance(out, BaseException) else f.set_result(out)
        finally:
            self._slots.release()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        while True:
            try:
                _, fut = self._queue.get_nowait()
            except queue.Empty:
                break
            fut.set_exception(RuntimeError("the model server is stopping"))
