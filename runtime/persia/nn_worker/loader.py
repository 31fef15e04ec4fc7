"""NN-worker data path: datasets that receive batches, and the DataLoader that looks their
embeddings up ahead of training with bounded staleness (the hybrid algorithm's embedding side).

Pipeline (all threads, bounded queues so memory is bounded by ``forward_buffer_size``)::

    dataset source --(reorder if reproducible)--> dispatcher: acquire staleness permit,
        submit lookup to a pool of ``num_workers`` --> FIFO of futures --> __next__ (training loop)

When the next batch is already waiting, the dispatcher may look it up in the same call as the one
before (``persia.nn_worker.lookup_group``): one permit and one future per batch, one call per hop.

Gradients go back from ``TrainCtx.backward``; when the PS has applied them the permit is released,
so at most ``embedding_staleness`` batches per NN worker are looked up but not yet applied.
"""

from __future__ import annotations

import logging
import math
import numbers
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np

from persia.context import cnt_ctx, ctx_stack
from persia.errors import BatchLost, ContextRequired, PersiaValidationError
from persia.nn_worker.accounting import ACCOUNT
from persia.nn_worker.datasets import IterableDatasetBase, StreamingDataset
from persia.nn_worker.lookahead import Lookahead
from persia.nn_worker.lookup_group import group_under_bound
from persia.nn_worker.reorder import _reordered
from persia.nn_worker.staleness import DEFAULT_WARMUP_STEPS, warmup_steps_setting
from persia.nn_worker.training_batch import PersiaTrainingBatch

log = logging.getLogger(__name__)

_END = object()


def _int_at_least(name: str, value: Any, low: int, also: str = "") -> int:
    """``value`` as an int >= ``low``: an int (a numpy integer too), not a bool or a float; the
    error names the argument and the value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise PersiaValidationError(
            f"DataLoader: {name} must be an integer >= {low}{also}, got {type(value).__name__} {value!r:.80}")
    if value < low:
        raise PersiaValidationError(f"DataLoader: {name} must be >= {low}{also}, got {value}")
    return int(value)


#: The longest ``timeout_ms``: what a wait takes (``threading.TIMEOUT_MAX``, about 292 years on
#: Linux), less a minute of slack for the waits that add a few seconds to it (``_next_item``).
MAX_TIMEOUT_MS = (threading.TIMEOUT_MAX - 60) * 1000.0


def timeout_setting(timeout_ms: Any) -> float:
    """``timeout_ms`` as seconds: a finite number of milliseconds above 0 and at most
    ``MAX_TIMEOUT_MS``. A NaN wait never ends and a huge one overflows the clock later, in another
    thread: both are refused here, naming ``timeout_ms`` and the value."""
    limit_ms = MAX_TIMEOUT_MS
    if isinstance(timeout_ms, (bool, np.bool_)) or not isinstance(timeout_ms, numbers.Real):
        raise PersiaValidationError(
            f"DataLoader: timeout_ms must be a number of milliseconds, got {type(timeout_ms).__name__} "
            f"{timeout_ms!r:.80}")
    if not (math.isfinite(timeout_ms) and 0 < timeout_ms <= limit_ms):
        raise PersiaValidationError(
            f"DataLoader: timeout_ms must be a finite number of milliseconds > 0 and <= {limit_ms:.6g}, "
            f"got {timeout_ms!r}")
    return float(timeout_ms) / 1000.0


class DataLoader:
    """PERSIA's DataLoader: iterate inside a ``TrainCtx``/``eval_ctx`` to get looked-up batches.

    ``embedding_staleness=k`` bounds the batches whose embeddings were read but whose gradients are
    not yet applied on the PS; ``k=1`` gives the synchronous reference (update before next lookup).
    ``None`` leaves it bounded only by the buffers once warmed up. The bound can ramp up from 1
    over the first steps (``staleness_warmup_steps`` or ``PERSIA_STALENESS_WARMUP_STEPS``; 0 turns
    the ramp off; see ``persia.nn_worker.staleness``). By default there is no ramp when the NN
    worker replays its own updates (``persia.nn_worker.own_updates``, on by default: stale reads
    then cost nothing), and 200 steps when it does not.
    """

    def __init__(
        self,
        dataset: IterableDatasetBase,
        forward_buffer_size: int = 10,
        timeout_ms: int = 1000 * 60 * 10,
        num_workers: int = 10,
        reproducible: bool = False,
        embedding_staleness: int | None = None,
        staleness_warmup_steps: int | None = None,
    ):
        if not isinstance(dataset, IterableDatasetBase):
            raise PersiaValidationError(
                f"DataLoader: dataset must be a persia.data.IterableDatasetBase (a StreamingDataset, or an "
                f"IterableDataset subclass), got {type(dataset).__name__} {dataset!r:.80}")
        forward_buffer_size = _int_at_least("forward_buffer_size", forward_buffer_size, 1)
        num_workers = _int_at_least("num_workers", num_workers, 1)
        if embedding_staleness is not None:
            embedding_staleness = _int_at_least("embedding_staleness", embedding_staleness, 1, " or None")
        if not isinstance(reproducible, (bool, np.bool_)):
            raise PersiaValidationError(
                f"DataLoader: reproducible must be a bool, got {type(reproducible).__name__} {reproducible!r:.80}")
        self.dataset = dataset
        self.forward_buffer_size = forward_buffer_size
        self.timeout_s = timeout_setting(timeout_ms)
        self.num_workers = num_workers
        self.reproducible = bool(reproducible)
        self.embedding_staleness = embedding_staleness
        # None: the context decides (no ramp when it replays its own updates)
        self.staleness_warmup_steps = warmup_steps_setting(staleness_warmup_steps, default=None)

    def __iter__(self) -> Iterator[PersiaTrainingBatch]:
        ctx = cnt_ctx()
        if ctx is None or not hasattr(ctx, "_lookup_message"):
            where = "outside any context" if ctx is None else f"inside a {type(ctx).__name__}"
            raise ContextRequired(f"iterate a persia DataLoader inside a TrainCtx / eval_ctx / InferCtx block, not {where}")
        return _Loop(_LoaderIterator(self, ctx))

    def __len__(self) -> int:
        raise TypeError("a streaming DataLoader has no length")


class _Loop:
    """What iterating a DataLoader returns: the batches of its pipeline. A loop that leaves early
    (``break``, an exception) drops it, and that closes the pipeline at once: the pipeline itself
    stays referenced by its dispatcher thread, so without this its threads and subscriptions lived
    on, one set per loop left. Anything else is the pipeline's."""

    def __init__(self, it: "_LoaderIterator"):
        self._it = it

    def __iter__(self) -> "_Loop":
        return self

    def __next__(self) -> PersiaTrainingBatch:
        return next(self._it)

    def close(self) -> None:
        self._it.close()

    def __del__(self) -> None:
        try:
            self._it.close()
        except Exception:  # noqa: BLE001 - at interpreter exit, say: nothing left to stop
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class _LoaderIterator:
    def __init__(self, loader: DataLoader, ctx):
        self.loader = loader
        self.ctx = ctx
        self._out: queue.Queue = queue.Queue(maxsize=loader.forward_buffer_size)
        self._pool = ThreadPoolExecutor(max_workers=loader.num_workers, thread_name_prefix="persia-forward")
        self._stop = threading.Event()
        self._abandoned = threading.Event()  # closed before its end: stop pulling from the stream
        self._done = False
        self.streaming = isinstance(loader.dataset, StreamingDataset)
        # the outermost NN-worker context of this thread: a TrainCtx and the eval_ctx inside it
        # read one stream (the dispatcher thread below has no context stack of its own)
        self._session = next((c for c in ctx_stack() if hasattr(c, "_lookup_message")), ctx)
        if self.streaming:
            ctx._start_streaming()
        train = bool(getattr(ctx, "is_training", False))
        warmup = loader.staleness_warmup_steps
        if warmup is None:
            warmup = ctx._default_warmup_steps() if hasattr(ctx, "_default_warmup_steps") else DEFAULT_WARMUP_STEPS
        self._permits = (  # the context's, for every loop (the ramp counts its steps: a new epoch does not restart it)
            ctx._training_permits(loader.embedding_staleness, warmup, self._steps(),
                                  cond=ctx._permit_condition() if hasattr(ctx, "_permit_condition") else None)
            if (train and self.streaming)
            else None
        )
        if train and loader.reproducible and getattr(ctx, "_thread_tuner", None) is not None:
            ctx._thread_tuner.hold("reproducible mode")
        # Just-in-time lookups for training streams; eval/infer datasets prefetch freely.
        self._lookahead = Lookahead(loader.forward_buffer_size) if (train and self.streaming) else None
        # Batches per lookup call. Reproducible mode releases batches in id order, so a batch
        # waiting in the queue may not be next: it looks up one at a time.
        self._group = (ctx._lookup_group_size()
                       if train and self.streaming and not loader.reproducible and hasattr(ctx, "_lookup_group_size")
                       else 1)
        self._last_next: float | None = None
        self._thread = threading.Thread(target=self._dispatch, name="persia-dispatch", daemon=True)
        self._thread.start()
        live = getattr(ctx, "_live_loaders", None)
        if live is not None:  # closed at the context's exit if the loop left it open
            live.add(self)

    def close(self) -> None:
        """Stop a pipeline whose loop left before the end: the dispatcher pulls nothing more (the
        stream's unconsumed batches wait for the next loop over it), batches it pulled are handed
        back and counted ``abandoned`` (``_discard_future``), and its threads end. Nothing after
        the end. A pipeline already stopped by a failure stops pulling too (it handed back every
        batch until the stream's end, for nobody)."""
        if self._done and not self._thread.is_alive():
            return
        self._abandoned.set()
        if not self._done:
            self._finish()

    def wait_closed(self, timeout_s: float) -> bool:
        """After :meth:`close`: wait (bounded) until its dispatcher and every lookup it started
        have ended, so each batch it pulled is handed back and counted; False if some did not."""
        end = time.monotonic() + timeout_s
        self._thread.join(max(0.0, end - time.monotonic()))
        # the pool's threads end once every lookup, and its callbacks (the count of a batch handed
        # back), has run; joined from a helper thread so that the wait stays bounded
        joiner = threading.Thread(target=self._pool.shutdown, kwargs={"wait": True}, daemon=True)
        joiner.start()
        joiner.join(max(0.0, end - time.monotonic()))
        return not joiner.is_alive() and not self._thread.is_alive()

    def _steps(self) -> int:
        """The context's training steps (``TrainCtx.step``: a resumed job goes on with its ramp)."""
        return int(getattr(self.ctx, "step", 0) or 0)

    # producer
    def _source(self) -> Iterator[Any]:
        ds = self.loader.dataset
        if self.streaming:
            src = ds.source(self.ctx.bus, self.ctx.rank, self.loader.timeout_s, owner=self._session,
                            stop=self._abandoned)
            if self.loader.reproducible:
                src = _reordered(src, self.ctx.rank, self.ctx.world_size)
            return src
        return iter(ds)

    def _acquire_permit(self) -> tuple[bool, Any]:
        """``(got a permit, the pending update whose permit was taken over or None)``.

        When every permit is held and an update of an earlier batch waits in the context's outbox
        (not yet applied), the lookup takes that update's permit and carries it: the worker
        applies it first, so the bound holds (persia.nn_worker.outbox)."""
        claim = getattr(self.ctx, "_claim_permit", None)
        if claim is None:
            while not self._permits.acquire(timeout=0.5):
                if self._stop.is_set():
                    return False, None
            return True, None
        return self._permits.acquire_or_take_over(claim, self._stop)

    def _give_back_permit(self, transferred: Any) -> None:
        """A permit taken for a lookup that will not be made: a taken-over update still goes
        (and its permit comes back when it is applied), a free one is released."""
        if transferred is not None:
            self.ctx._transfer_cancelled(transferred)
        else:
            self._permits.release()

    def _try_permit(self) -> tuple[bool, Any]:
        """:meth:`_acquire_permit` without waiting (a group's further batches)."""
        claim = getattr(self.ctx, "_claim_permit", None)
        if claim is None:
            return self._permits.acquire(blocking=False), None
        return self._permits.try_acquire_or_take_over(claim)

    def _join(self, item: Any, first: dict) -> tuple[dict, bool, Any] | None:
        """``item`` dispatched into ``first``'s lookup group, if it can go in the same call
        without waiting: a streamed batch for the same embedding worker, with a permit free now."""
        if item is _END or not isinstance(item, dict) or self._stop.is_set():
            return None
        requires_grad = bool(item.get("requires_grad", True))
        if requires_grad != bool(first.get("requires_grad", True)) or int(item["worker"]) != int(first["worker"]):
            return None
        holds_permit = self._permits is not None and requires_grad
        transferred = None
        if holds_permit:
            got, transferred = self._try_permit()
            if not got:
                return None
        if self._lookahead is not None:
            self._lookahead.add()
        target = self._permits.target if self._permits is not None else None
        return self.ctx._dispatched(item, target), holds_permit, transferred

    def _dispatch(self) -> None:
        source = None
        try:
            source = self._source()
            carry: Any = None  # an item read ahead for a group that did not join it
            while True:
                item, carry = (carry, None) if carry is not None else (next(source, _END), None)
                if item is _END:
                    break
                if self._stop.is_set():
                    self._release_unlooked(item)
                    if self._abandoned.is_set():
                        break
                    continue
                if not isinstance(item, dict):
                    self._put(self._pool.submit(self._direct_lookup, item))
                    continue
                if self._lookahead is not None and not self._lookahead.acquire(self._stop):
                    self._release_unlooked(item)
                    continue
                holds_permit = self._permits is not None and bool(item.get("requires_grad", True))
                transferred = None
                if holds_permit:
                    got, transferred = self._acquire_permit()
                    if got and self._abandoned.is_set():
                        # the loop left meanwhile: what it took goes back. The permits are the
                        # context's, and the next loop's: this took over the update the next
                        # loop's release of a batch had just put, and the permit was lost with
                        # the lookup it never made (that loop then waited until its timeout)
                        self._give_back_permit(transferred)
                        got = False
                    if not got:
                        self._release_unlooked(item)
                        continue
                target = self._permits.target if self._permits is not None else None
                group = [(self.ctx._dispatched(item, target), holds_permit, transferred)]
                size = group_under_bound(self._group, self._permits.limit if self._permits is not None else None)
                while len(group) < size and self.loader.dataset.has_ready():
                    nxt = next(source, _END)
                    joined = self._join(nxt, item)
                    if joined is None:
                        carry = nxt
                        break
                    group.append(joined)
                self._submit(group)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            failed: Future = Future()
            failed.set_exception(exc)
            failed.pipeline_failure = True  # type: ignore[attr-defined] - not a batch's lookup
            self._put(failed, force=True)
            return
        finally:
            close = getattr(source, "close", None)
            if close is not None:  # a stream's view: unsubscribes, keeps what it did not yield
                close()
            if self._abandoned.is_set():  # nobody reads the queue again: hand its batches back
                self._drain_abandoned()
        self._put(_END, force=True)

    def _drain_abandoned(self) -> None:
        while True:
            try:
                fut = self._out.get_nowait()
            except queue.Empty:
                return
            if isinstance(fut, Future) and not getattr(fut, "pipeline_failure", False):
                fut.add_done_callback(self._discard_future)

    def _submit(self, group: list[tuple[dict, bool, Any]]) -> None:
        """One lookup task for ``group`` (``(message, holds_permit, transferred update)`` each),
        and its batches' futures in stream order."""
        try:
            if len(group) == 1:
                item, holds_permit, transferred = group[0]
                futures = [self._pool.submit(self._timed_lookup, item, holds_permit, transferred)]
            else:
                futures = [Future() for _ in group]
                task = self._pool.submit(self._timed_lookup_group, group, futures)
                task.add_done_callback(lambda t, fs=futures: _settle(t, fs))
        except RuntimeError:  # the pool was shut down meanwhile: the pipeline stops
            if not self._stop.is_set():
                raise
            for item, holds, transferred in group:  # pulled, never looked up: handed back, counted
                if holds:  # the context's permits: the next loop's lookups wait for them
                    self._give_back_permit(transferred)
                self._release_unlooked(item)
            return
        for (item, holds, transferred), fut in zip(group, futures):
            fut.batch_loader = item.get("loader")  # type: ignore[attr-defined] - whose position a failure moves
            if transferred is not None:  # a lookup cancelled at shutdown still applies it
                fut.add_done_callback(lambda f, u=transferred: f.cancelled() and self.ctx._transfer_cancelled(u))
            elif holds:  # a lookup cancelled at shutdown gives its permit back (the next loop's too)
                fut.add_done_callback(lambda f: f.cancelled() and self._permits.release())
        for fut in futures:
            self._put(fut)

    def _timed_lookup_group(self, group: list[tuple[dict, bool, Any]], futures: list[Future]) -> None:
        """A group's lookup in one call; each batch's future gets its batch or its own error."""
        t0 = time.perf_counter()
        looked = self.ctx._lookup_messages([g[0] for g in group], [g[1] for g in group], [g[2] for g in group])
        for batch, fut in zip(looked, futures):
            if not isinstance(batch, BaseException):
                try:
                    self.ctx._prebuild(batch)
                except BaseException as exc:  # noqa: BLE001 - raised to the training loop by its future
                    batch = exc
            if isinstance(batch, BaseException):
                fut.set_exception(batch)
            else:
                fut.set_result(batch)
        if self._lookahead is not None:
            self._lookahead.record_lookup(time.perf_counter() - t0)

    def _timed_lookup(self, item: dict, holds_permit: bool, transferred: Any = None) -> PersiaTrainingBatch:
        t0 = time.perf_counter()
        batch = (self.ctx._lookup_message(item, holds_permit) if transferred is None
                 else self.ctx._lookup_message(item, holds_permit, transferred))
        self.ctx._prebuild(batch)
        if self._lookahead is not None:  # until the batch is ready to train: that is what to hide
            self._lookahead.record_lookup(time.perf_counter() - t0)
        return batch

    def _direct_lookup(self, batch) -> PersiaTrainingBatch:
        looked = self.ctx._lookup_batch(batch)
        self.ctx._prebuild(looked)
        return looked

    def _put(self, item: Any, force: bool = False) -> None:
        while True:
            if self._abandoned.is_set():  # nobody reads the queue again
                if isinstance(item, Future) and not getattr(item, "pipeline_failure", False):
                    item.add_done_callback(self._discard_future)
                return
            try:
                self._out.put(item, timeout=0.5)
                return
            except queue.Full:
                if self._stop.is_set() and not force:
                    if isinstance(item, Future):  # looked up but nobody will train it: hand back
                        item.add_done_callback(self._discard_future)
                    return

    def _discard_future(self, fut: Future) -> None:
        ACCOUNT.fail("abandoned")
        if not fut.cancelled() and fut.exception() is None:
            self._discard(fut.result())

    def _release_unlooked(self, item: Any) -> None:
        if isinstance(item, dict):
            ACCOUNT.fail("abandoned")  # received, but the training loop stopped before it
            self.ctx._release_refs([item])

    # consumer
    def __iter__(self):
        return self

    def __next__(self) -> PersiaTrainingBatch:
        if self._done:
            raise StopIteration
        now = time.perf_counter()
        if self._lookahead is not None and self._last_next is not None:
            self._lookahead.record_step(now - self._last_next)  # the training step just done
        if self._permits is not None:
            self._permits.set_step(self._steps())
            release_beyond = getattr(self.ctx, "_release_beyond", None)
            if release_beyond is not None:  # TrainCtx: batches without a backward must not hold every permit
                release_beyond(self._permits.limit)
        item = self._next_item()
        self._last_next = time.perf_counter()
        if self._lookahead is not None and item is not _END:
            self._lookahead.release()
        if self.ctx._needs_rank_agreement(self.streaming):
            have = 0 if item is _END else 1
            if not self.ctx._all_ranks_have(have):
                if item is not _END:
                    self._untrained(item.loader, "uneven_tail")
                    self._discard(item)
                self._finish(drain=True)
                raise StopIteration
        if item is _END:
            self._finish()
            raise StopIteration
        if self.streaming and not (getattr(self.ctx, "is_training", False) and item.requires_grad):
            ACCOUNT.add("evaluated")  # a streamed batch consumed by eval_ctx / InferCtx, or not for training
        handed_out = getattr(self.ctx, "_handed_out", None)
        if handed_out is not None:  # TrainCtx: a batch that gets no backward is released, counted
            handed_out(item)
        return item

    def _next_item(self):
        while True:
            try:
                fut = self._out.get(timeout=self.loader.timeout_s + 5)
            except queue.Empty:
                self._finish()
                raise TimeoutError(f"no looked-up batch within {self.loader.timeout_s:g} s (the DataLoader's timeout_ms)") from None
            if fut is _END:
                return _END
            try:
                return fut.result()
            except BatchLost as exc:
                # its data loader gave up on the ID features (or they never came): counted, skipped
                self._lost(exc)
                if self._lookahead is not None:
                    self._lookahead.release()
            except BaseException:
                self._finish()
                raise

    def _untrained(self, loader: int | None, outcome: str) -> None:
        """A batch reached in arrival order but not trained: counted as failed with ``outcome``,
        and, streamed to a training rank, its loader's resume position moves past it
        (``checkpoint_plan.advances_position``)."""
        ACCOUNT.fail(outcome)
        if self.streaming and getattr(self.ctx, "is_training", False) and hasattr(self.ctx, "_advance_position"):
            self.ctx._advance_position(loader, outcome)

    def _lost(self, exc: BatchLost) -> None:
        log.error("%s; counted as failed (lost_id_features)", exc)
        self._untrained(exc.loader, "lost_id_features")

    def _discard(self, batch: PersiaTrainingBatch) -> None:
        """Hand back a looked-up batch nobody trains: its ref on the embedding worker, and its
        staleness permit."""
        if batch.ref is not None:
            self.ctx._release_refs([{"worker": batch.worker, "ref": batch.ref}])
        if batch.holds_permit and self._permits is not None:
            self._permits.release()

    def _finish(self, drain: bool = False) -> None:
        """Stop the pipeline; with ``drain``, hand back every batch already pulled from the stream."""
        self._done = True
        self._stop.set()
        dropped = 0
        if drain:
            deadline = time.monotonic() + self.loader.timeout_s
            while time.monotonic() < deadline:
                try:
                    fut = self._out.get(timeout=0.5)
                except queue.Empty:
                    if not self._thread.is_alive():
                        break
                    continue
                if fut is _END:
                    break
                try:
                    batch = fut.result()
                except BatchLost as exc:  # lost either way: counted as in training
                    self._lost(exc)
                    continue
                except BaseException as exc:  # noqa: BLE001 - dropped anyway; counted and said, not raised
                    if getattr(fut, "pipeline_failure", False):
                        log.error("the lookup pipeline failed while the uneven tail was dropped: %s: %s",
                                  type(exc).__name__, exc)
                        break
                    loader = getattr(fut, "batch_loader", None)
                    log.error("a trailing batch (data loader %s) failed its lookup (%s: %s) after every NN rank "
                              "agreed to stop; counted as failed (uneven_tail)", loader, type(exc).__name__, exc)
                    self._untrained(loader, "uneven_tail")
                    continue
                self._untrained(batch.loader, "uneven_tail")
                self._discard(batch)
                dropped += 1
            if dropped:
                log.warning("dropped %d trailing batches so that every NN rank trains the same number of steps", dropped)
        self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(task: Future, futures: list[Future]) -> None:
    """A group's lookup task ended: a cancelled task (shutdown) cancels its batches' futures, so
    their callbacks run (a taken-over update is still sent); a task that failed outside any one
    batch fails the futures it left unset."""
    if task.cancelled():
        for fut in futures:
            fut.cancel()
        return
    exc = task.exception()
    if exc is not None:
        for fut in futures:
            if not fut.done():
                fut.set_exception(exc)
