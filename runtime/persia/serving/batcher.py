"""Request batching with a bounded latency.

The first request of a batch waits at most ``max_latency_s`` for others; a batch closes early
once it holds ``max_batch_size`` samples. Requests whose slots or dense columns differ are never
merged (they run as separate batches). The queue is bounded: a full queue refuses at once
(``QueueFull``, answered 503) instead of letting latency grow without limit.

Every request carries a deadline: one whose caller gave up (its future cancelled) or whose
deadline passed before its batch ran is dropped, not run, so an overloaded server spends its
time on requests someone still waits for. ``run(batches, deadline)`` gets the earliest deadline
of the batch's requests, for its own calls (the embedding lookup).

``stop(timeout_s)`` drains: new requests are refused at once (``Stopping``, answered 503), the
requests already submitted still run for up to ``timeout_s``, and only those still waiting then
fail with ``Stopping``.
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


class Stopping(RuntimeError):
    """The model server is stopping: the request was refused, or never ran (answered 503)."""

    def __init__(self, message: str = "the model server is stopping"):
        super().__init__(message)


def take_batch(pending: list[tuple], max_batch_size: int) -> tuple[list, list]:
    """Pure decision: the requests (``(batch, ...)`` tuples) of the first request's signature that
    fit ``max_batch_size`` samples (the first always goes, even alone over the limit: the run
    splits it), and the rest in arrival order."""
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


def _expired() -> TimeoutError:
    return TimeoutError("the request's deadline passed before its batch ran")


class Batcher:
    """``submit(batch, deadline)`` returns a Future of that request's output rows (cancel it to
    drop the request); ``run(batches, deadline)`` gets the requests of one model batch and the
    earliest of their deadlines (``time.monotonic()``), and returns one output per request."""

    def __init__(self, run: Callable[[Sequence[PersiaBatch], float | None], list], max_batch_size: int,
                 max_latency_s: float, max_queue: int = 1024, workers: int = 2):
        self._run = run
        self.max_batch_size = max_batch_size
        self.max_latency_s = max_latency_s
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="serve-batch")
        self._slots = threading.BoundedSemaphore(workers)  # never collect more batches than run
        self._stop = threading.Event()
        self._closing = False  # set by stop(): submit refuses
        self._outstanding = 0  # submitted requests not answered yet
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._collect, name="serve-batcher", daemon=True)
        self._thread.start()

    def depth(self) -> int:
        return self._queue.qsize()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, batch: PersiaBatch, deadline: float | None = None) -> Future:
        """``deadline``: ``time.monotonic()`` after which the request is not run any more."""
        fut: Future = Future()
        with self._idle:
            if self._closing:
                raise Stopping()
            try:
                self._queue.put_nowait((batch, fut, deadline))
            except queue.Full:
                raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None
            self._outstanding += 1
        fut.add_done_callback(self._answered)
        return fut

    def _answered(self, _fut: Future) -> None:
        with self._idle:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    @staticmethod
    def _still_wanted(item: tuple) -> bool:
        """False for a request nobody waits for any more: cancelled, or past its deadline (then
        failed with TimeoutError, in case its caller has not given up yet)."""
        _, fut, deadline = item
        if fut.cancelled():
            return False
        if deadline is not None and time.monotonic() >= deadline:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(_expired())
            return False
        return True

    def _collect(self) -> None:
        """A batch is formed once a slot to run it is free: requests that queued meanwhile join
        it, and those nobody waits for any more are dropped then, not run."""
        pending: list[tuple[PersiaBatch, Future, float | None]] = []
        while not self._stop.is_set():
            if not self._slots.acquire(timeout=0.2):
                continue
            taken: list = []
            try:
                taken, pending = self._next_batch(pending)
                if taken:
                    self._pool.submit(self._execute, taken)
            finally:
                if not taken:
                    self._slots.release()
        for _, fut, _ in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(Stopping())

    def _next_batch(self, pending: list) -> tuple[list, list]:
        """(the requests of the next batch, those left waiting); waits for a first request at most
        0.2 s, then at most ``max_latency_s`` for others."""
        pending = [item for item in pending if self._still_wanted(item)]
        if not pending:
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                return [], pending
            if not self._still_wanted(item):
                return [], pending
            pending.append(item)
        close_at = time.monotonic() + self.max_latency_s
        while sum(item[0].batch_size for item in pending) < self.max_batch_size:
            left = close_at - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if self._still_wanted(item):
                pending.append(item)
        return take_batch([item for item in pending if self._still_wanted(item)], self.max_batch_size)

    def _execute(self, taken: list[tuple[PersiaBatch, Future, float | None]]) -> None:
        try:
            live = []
            now = time.monotonic()
            for b, f, deadline in taken:  # it may have waited for a slot: drop what expired meanwhile
                if not f.set_running_or_notify_cancel():
                    continue  # cancelled: its caller got its answer already
                if deadline is not None and now >= deadline:
                    f.set_exception(_expired())
                    continue
                live.append((b, f, deadline))
            if not live:
                return
            deadlines = [d for _, _, d in live if d is not None]
            try:
                outputs = self._run([b for b, _, _ in live], min(deadlines) if deadlines else None)
            except BaseException as exc:  # every waiting request gets the error
                for _, f, _ in live:
                    f.set_exception(exc)
                return
            for (_, f, _), out in zip(live, outputs):  # an exception in place of an output fails that request
                f.set_exception(out) if isinstance(out, BaseException) else f.set_result(out)
        finally:
            self._slots.release()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Refuse new requests (``Stopping``); let those submitted run for up to ``timeout_s``;
        then stop, failing any still waiting with ``Stopping`` (a batch running then finishes)."""
        end = time.monotonic() + timeout_s
        with self._idle:
            self._closing = True
            while self._outstanding > 0 and self._thread.is_alive():
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(min(left, 0.2))
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        while True:
            try:
                _, fut, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(Stopping())
