"""Datasets an NN worker iterates: batches streamed by data loaders over NATS, or a local one."""

from __future__ import annotations

import asyncio
import logging
import numbers
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from persia.bus import BUSY, WOULD_BLOCK, subject
from persia.data_loader.batch import PersiaBatch
from persia.data_loader.resume import loader_count_error
from persia import messages as M
from persia.errors import DataLoaderFailed, PersiaError, PersiaValidationError
from persia.nn_worker import checkpoint_plan as plan
from persia.nn_worker.accounting import ACCOUNT
from persia.recent_keys import RecentKeys

log = logging.getLogger(__name__)

VIEW_HANDOVER_S = 30.0  # a closed loop's view has this long to hand the stream to the next loop
# Batches a data loader's first sends to one rank may arrive ahead of their order: one group held
# per embedding worker while another worker's group goes (``PERSIA_DATA_GROUP``), per worker
REORDER_PER_WORKER = M.MAX_SEND_GROUP
SESSION_MEMORY = 1024  # loader processes a rank remembers having admitted or refused


class _RoomWaiters:
    """Futures of the bus's event loop waiting for room in a buffer, resolved from the consumer's
    thread. A message that finds the buffer full waits on the loop for one of them instead of in a
    pool thread: one wake-up (consumer to loop) instead of three (loop to pool, consumer to pool,
    pool to loop), each of them taken with the GIL held in the NN worker's process."""

    def __init__(self) -> None:
        self._waiting: list[asyncio.Future] = []

    def add(self) -> asyncio.Future:
        """A future on the running loop; the caller holds the buffer's lock."""
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        return fut

    def discard(self, fut: asyncio.Future) -> None:
        """Forget a future whose wait ended without a wake (its deadline); the caller holds the lock."""
        self._waiting = [f for f in self._waiting if f is not fut]

    def wake_all(self) -> None:
        """Resolve every waiting future (the caller holds the buffer's lock): room was made, or the
        buffer closed. A loop already closed has nobody left to wake."""
        waiting, self._waiting = self._waiting, []
        for fut in waiting:
            try:
                fut.get_loop().call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                pass


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class IterableDatasetBase:
    def __init__(self, buffer_size: int = 10):
        if isinstance(buffer_size, (bool, np.bool_)) or not isinstance(buffer_size, numbers.Integral):
            raise PersiaValidationError(
                f"{type(self).__name__}: buffer_size must be an integer >= 1, got {type(buffer_size).__name__} "
                f"{buffer_size!r:.80}")
        if buffer_size < 1:
            raise PersiaValidationError(f"{type(self).__name__}: buffer_size must be >= 1, got {buffer_size}")
        self.buffer_size = int(buffer_size)


@dataclass
class _RankStream:
    """What this NN rank has seen of the data loaders' stream, across every StreamingDataset the
    process iterates (one for the whole stream, or one per epoch)."""

    loader_size: int | None = None
    sent: Counter = field(default_factory=Counter)  # (loader, epoch) -> batches announced
    received: Counter = field(default_factory=Counter)  # (loader, epoch) -> batches arrived
    epochs_ended: dict[int, set] = field(default_factory=dict)
    final: set = field(default_factory=set)  # loaders whose stream ended
    # (loader, session, batch_id) arrived lately: a retried send is trained once
    seen: RecentKeys = field(default_factory=RecentKeys)
    next_epoch: int = 0  # the epoch the next per-epoch view iterates
    carry: list = field(default_factory=list)  # what no view consumed yet: left by one, or come between views
    resume: dict | None = None  # the checkpoint this training session resumed (nn.info's "resume")
    # per loader index, every process of it: batches this rank acknowledged (queued), in arrival
    # order; what a loader restarted in place skips (TrainCtx._live_position)
    delivered: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # one view of the stream at a time (open_view): a second one subscribed beside it would split
    # the messages between them, and take the carry before the first had put its queue there
    view: Any = None  # the open view (a StreamingDataset), if any: ends of stream go to its queue
    view_stop: threading.Event | None = None  # the open view's: set once its loop was closed
    handover: threading.Condition = field(default_factory=threading.Condition, repr=False)  # also guards carry
    # checking a loader process's first batch (``admit``): this rank, its world size and the
    # embedding worker count (the reordering a loader's first sends may show), from the context
    rank: int | None = None
    world_size: int | None = None
    embedding_workers: int = 1
    # (loader, session) -> None (admitted) or why its batches are refused
    sessions: RecentKeys = field(default_factory=lambda: RecentKeys(SESSION_MEMORY), repr=False)

    def admit(self, msg: dict) -> str | None:
        """None when this rank takes the batch ``msg``, else why not. The first batch of a loader
        process this rank has not heard from must follow what the rank has of that loader (the
        resumed checkpoint's position plus what it acknowledged since: ``plan.stream_gap``), as it
        does for a loader that asked ``nn.position``. One that skips ahead streamed on past a
        restart of this rank (SIGKILLed and started again alone, an online Deployment's pod): the
        batches in between went to the dead process, trained after the checkpoint this one resumed
        (now undone) or acknowledged and never trained. Taking its batches would lose those in
        silence and record positions that are no prefix of what was trained, so every batch of
        that process is refused (``refused`` in the answer: the loader stops and is restarted, and
        resends from the position). A rank that resumed nothing only says so: without a
        checkpoint, what came before is not in its model anyway."""
        session, loader, size = msg.get("session"), int(msg.get("loader", 0)), msg.get("loader_size")
        if session is None or size is None or self.world_size is None or self.rank is None:
            return None  # an older sender, or a dataset outside a context: nothing to check against
        key = (loader, session)
        with self.lock:
            if self.sessions.get(key) is not None:
                return self.sessions.get(key)
            batch_id = int(msg["batch_id"])
            routed_for = msg.get("world_size")
            if (routed_for is not None and int(routed_for) != self.world_size) or batch_id % self.world_size != self.rank:
                # sent by a loader that counts another number of NN ranks: it started before the
                # ranks were rescaled (online: the NN Deployment scaled in place, the loaders not)
                counted = f"{routed_for} NN ranks" if routed_for is not None else "another number of NN ranks"
                verdict = (f"NN rank {self.rank} of {self.world_size} got batch {batch_id} of data loader {loader} "
                           f"(process {session}), routed for {counted}: the loader sends to another number of "
                           f"NN ranks than there are (it started before they changed). Its batches are "
                           f"refused: restart data loader {loader}, so that it finds the NN ranks again and "
                           "resends from their positions")
                log.error("%s", verdict)
                self.sessions.add(key, verdict)
                return verdict
            if key in self.sessions:
                return None
            verdict = None
            position = self._position(loader)
            if position is not None:
                gap = plan.stream_gap(batch_id, loader, int(size), self.world_size, position,
                                      self.delivered[loader])
                slack = REORDER_PER_WORKER * max(1, self.embedding_workers)
                if gap > slack:
                    told = (f"NN rank {self.rank} has {position + self.delivered[loader]} of data loader {loader}'s "
                            f"batches (position {position}{self._where()}, {self.delivered[loader]} since), but "
                            f"its process {session} sends batch {msg['batch_id']}, {gap} batches further: it "
                            f"streamed on past a restart of this rank, whose earlier process took those")
                    if self.resume is not None:
                        verdict = (told + ". Its batches are refused: restart data loader " + str(loader) +
                                   " so that it resends from this rank's position (it asks nn.position)")
                        log.error("%s; refusing that process's batches", told)
                    else:
                        log.warning("%s; this rank resumed no checkpoint, so they are not in its model", told)
            self.sessions.add(key, verdict)
            return verdict

    def _position(self, loader: int) -> int | None:
        """This rank's resume position for ``loader`` in the current run, or None when its batch
        ordinals cannot be told (positions of earlier runs with other world sizes)."""
        resume = self.resume or {}
        if any(((run.get("loaders") or {}).get(str(loader)) or {}) for run in resume.get("earlier") or ()):
            return None
        saved = resume.get("world_size")
        if saved is not None and int(saved) != self.world_size:
            return None
        return plan.positions_for_rank(resume.get("loaders") or {}, self.rank).get(loader, 0)

    def _where(self) -> str:
        return f" in {self.resume.get('path')}" if self.resume and self.resume.get("path") else ""

    def on_eos(self, msg: dict) -> Any:
        """An end of stream: to the open view's queue, in order with its batches, or into the
        carry while no view is open (the next one reads it first)."""
        with self.handover:
            view = self.view
            if view is None:  # between views: the next one reads it first
                self.carry.append(("eos", msg))
                return {"ack": True}
        # through the view's queue so it is seen after every batch that loader sent before it
        return {"ack": True} if view._offer(("eos", msg)) else BUSY

    def open_view(self, view: Any, rank: int, stop: threading.Event | None, wait_s: float) -> list:
        """Become the stream's one view: wait (up to ``wait_s``) for a view whose loop was closed
        (``break``, an iterator dropped) to put what it holds back for the next; refuse at once
        while one whose loop is still open (an iterator kept) holds the stream."""
        end = time.monotonic() + wait_s
        with self.handover:
            while self.view is not None:
                if self.view_stop is None or not self.view_stop.is_set():
                    raise PersiaError(
                        f"NN rank {rank}: a DataLoader loop over this stream is still open (an iterator kept "
                        "while a new loop started); a rank's stream is read by one loop at a time: finish that "
                        "loop, or close it (`break` out of it, or call its iterator's close()), first")
                left = end - time.monotonic()
                if left <= 0:
                    raise PersiaError(f"NN rank {rank}: the DataLoader loop closed before this one still held "
                                      f"its stream after {wait_s:g}s")
                self.handover.wait(left)
            self.view, self.view_stop = view, stop
            carry, self.carry = self.carry, []
            return carry  # what earlier views and the time between views left, in arrival order

    def close_view(self, left: list) -> None:
        """The view ends; ``left``, what it did not consume, goes before anything carried since."""
        with self.handover:
            self.carry = left + self.carry
            self.view, self.view_stop = None, None
            self.handover.notify_all()

    def delivered_by_loader(self) -> dict[int, int]:
        with self.lock:
            return dict(self.delivered)

    def see_loader_size(self, size: int) -> None:
        """The number of data loaders, as a batch or an end message says it: the same from every
        loader, and one the resumed checkpoint's positions hold for (checked before a batch of
        theirs is trained, whatever the loaders themselves checked)."""
        if self.loader_size is not None and self.loader_size != size:
            raise PersiaError(f"data loaders disagree on their replica size: {self.loader_size} vs {size}")
        if self.loader_size is None:
            refused = loader_count_error(self.resume, size)
            if refused is not None:
                raise PersiaError(refused)
        self.loader_size = size

    def all_final(self) -> bool:
        return self.loader_size is not None and len(self.final) == self.loader_size

    def stream_done(self) -> bool:
        return self.all_final() and sum(self.received.values()) >= sum(self.sent.values())

    def epoch_done(self, epoch: int) -> bool:
        if self.loader_size is None:
            return False
        loaders = range(self.loader_size)
        if not all(epoch in self.epochs_ended.get(l, ()) or l in self.final for l in loaders):
            return False
        return all(self.received[(l, epoch)] >= self.sent[(l, epoch)] for l in loaders)


_process_streams: dict[int, _RankStream] = {}  # per rank: the stream this process reads
_process_streams_lock = threading.Lock()


def _stream_state(rank: int, owner) -> _RankStream:
    """The rank's stream state, kept by ``owner``, the outermost NN-worker context (a TrainCtx and
    the eval_ctx/DataLoaders inside it), and passed on to the next one of the process: an eval_ctx
    after the TrainCtx, a TrainCtx per epoch, go on with the stream where the last one left it
    (its epoch, the batches it held for later, its counts). Before, each started afresh: the
    batches the last one held were lost and its loop waited for loaders that had connected long
    ago. A context that resumed from a checkpoint starts afresh (the loaders start over from
    the checkpoint's positions), and so does one after a stream that ended."""
    if owner is None:
        return _RankStream()
    streams = owner.__dict__.setdefault("_rank_streams", {})
    if rank not in streams:
        resume = getattr(owner, "_resume_info", None)
        with _process_streams_lock:
            state = _process_streams.get(rank)
            if state is None or resume is not None or state.stream_done():
                state = _process_streams[rank] = _RankStream(resume=resume)
        streams[rank] = state
    return streams[rank]


# ``nn.eos.<rank>`` is answered for the process's life, not per view, and handed to the rank's
# stream of the moment: a data loader's end of stream sent between two contexts (nobody
# subscribed, the rank having said nn.done) was skipped, and the next context's loop waited for
# it until its timeout
_eos_routes: dict[int, tuple[Any, Any]] = {}  # rank -> (bus, subscription)
_eos_routes_lock = threading.Lock()


def route_ends(bus, rank: int) -> None:
    """Answer ``nn.eos.<rank>`` on ``bus`` (once per bus and rank) for the rank's stream state
    in this process at the time each message comes (:meth:`_RankStream.on_eos`)."""
    with _eos_routes_lock:
        route = _eos_routes.get(rank)
        if route is not None and route[0] is bus:
            return
        _eos_routes[rank] = (bus, bus.serve(subject("nn", "eos", rank), lambda msg: _on_eos(rank, msg),
                                            schema=M.EndOfStream))


def _on_eos(rank: int, msg: dict) -> Any:
    # Checked here so a bad one is refused to its sender instead of stopping the trainer.
    if msg["loader"] >= msg["loader_size"]:
        raise ValueError(f"end of stream: loader {msg['loader']} out of range for loader_size {msg['loader_size']}")
    with _process_streams_lock:
        state = _process_streams.get(rank)
    return BUSY if state is None else state.on_eos(msg)


def reset_streams() -> None:
    """Forget the process's streams and stop answering their ends (tests play a fresh NN-worker
    process each)."""
    with _process_streams_lock:
        _process_streams.clear()
    with _eos_routes_lock:
        routes = list(_eos_routes.values())
        _eos_routes.clear()
    for bus, sub in routes:
        try:
            bus.unsubscribe(sub)
        except Exception:  # noqa: BLE001 - its bus closed already: nothing left to stop
            pass


class StreamingDataset(IterableDatasetBase):
    """Batches sent by data loaders over NATS to this NN rank.

    ``until="stream"`` (default, PERSIA's behaviour): every batch, over every epoch, until each data
    loader has ended its stream (its process finished: ``persia.data_loader.end_of_stream``).
    ``until="epoch"``: the batches of one epoch (each data loader leaving one ``DataCtx``), so a
    trainer can evaluate between epochs by iterating a new ``StreamingDataset`` per epoch; batches of
    the next epoch that arrive early wait for it.

    A full buffer answers "busy" (after waiting up to ``busy_wait_s``) and the loader retries:
    back-pressure, never loss.
    """

    def __init__(self, buffer_size: int = 10, busy_wait_s: float = 0.5, until: str = "stream"):
        super().__init__(buffer_size)
        if until not in ("stream", "epoch"):
            raise ValueError(f"until must be 'stream' or 'epoch', got {until!r}")
        self.busy_wait_s = busy_wait_s
        self.until = until
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # notified when the consumer takes an item
        self._room = _RoomWaiters()  # messages waiting on the bus's loop for the same
        self._closed = False
        self._subs: list = []
        self.received_total = 0
        self.epoch: int | None = None
        self._state = _RankStream()  # replaced by the session's when iteration starts

    def _register(self, bus, state: _RankStream, rank: int) -> None:
        self._state = state
        self._subs = [
            bus.serve(subject("nn", "batch", rank), self._on_batch_waiting, schema=M.Batch, blocking=False,
                      try_first=self._on_batch_now),
            bus.serve(subject("nn", "batch_group", rank), self._on_group_waiting, schema=M.BatchGroup,
                      blocking=False, try_first=self._on_group_now),
        ]
        bus.flush()

    def _close(self, bus, state: _RankStream) -> list:
        """Stop answering (a later StreamingDataset of this process takes over); whatever arrived
        but was not consumed is kept for it, so an acknowledged batch is never dropped here.
        Closed first, so that offers under way answer busy at once (their senders retry, and
        reach the next view), then the subscriptions drained: every message they received is
        answered (cancelled mid-way, a sender waited out its 10 s request timeout, at every
        epoch's end and every loop opened again)."""
        with self._space:
            self._closed = True
            self._space.notify_all()  # waiting offers answer at once instead of at their deadline
            self._room.wake_all()
        for sub in self._subs:
            bus.unsubscribe(sub, drain=True)
        self._subs = []
        left = []
        with self._space:
            while True:
                try:
                    left.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        return left

    def _offer(self, item: tuple, wait: bool = True) -> bool:
        """Queue ``item``, waiting up to ``busy_wait_s`` for room (woken by the consumer, not by
        polling: a data loader ahead of training keeps a request waiting here for every batch);
        ``wait=False``: only if there is room now."""
        end = time.monotonic() + (self.busy_wait_s if wait else 0.0)
        with self._space:
            while True:
                if self._closed:
                    return False
                try:
                    self._queue.put_nowait(item)
                    return True
                except queue.Full:
                    pass
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._space.wait(left)

    def _on_batch(self, msg: dict, wait: bool = True) -> Any:
        refused = self._state.admit(msg)
        if refused is not None:
            return {"queued": False, "refused": refused}
        return self._enqueue(msg, wait)

    def _enqueue(self, msg: dict, wait: bool) -> Any:
        """An admitted batch into the buffer, once (a retried send whose first reply was lost is
        answered as queued again)."""
        # a restarted data loader counts its ids from 0 again: its session tells its batches apart
        key = (int(msg.get("loader", 0)), msg.get("session"), int(msg["batch_id"]))
        with self._lock:
            if key in self._state.seen:
                return {"queued": True, "duplicate": True}
            self._state.seen.add(key)
        if self._offer(("batch", msg), wait):
            with self._state.lock:
                self._state.delivered[key[0]] += 1
            return {"queued": True}
        with self._lock:
            self._state.seen.discard(key)
        return BUSY if wait else WOULD_BLOCK

    def _on_group(self, msg: dict, wait: bool = True) -> Any:
        """Several batches of one data loader (``PERSIA_DATA_GROUP``), queued in order as lone
        ones would be. A full buffer answers busy (or, tried first, would-block) after queueing
        those before it: they count as seen, so the retry of the group queues only the rest."""
        for batch in msg["batches"]:  # a refused one refuses the group before any of it is queued
            refused = self._state.admit(batch)
            if refused is not None:
                return {"queued": False, "refused": refused}
        for batch in msg["batches"]:
            answer = self._enqueue(batch, wait)
            if answer is BUSY or answer is WOULD_BLOCK:
                return answer
        return {"queued": True}

    def _on_group_now(self, msg: dict) -> Any:
        """``_on_group`` on the bus's loop thread while the buffer has room (see ``_on_batch_now``)."""
        return self._on_group(msg, wait=False)

    async def _wait_for_room(self, offer) -> Any:
        """``offer()`` (a never-waiting ``_on_batch`` / ``_on_group``) until it finds room, waiting on
        the bus's loop between tries for the consumer to take an item, for up to ``busy_wait_s``;
        then busy (the loader retries). A closed buffer answers busy at once."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.busy_wait_s
        while True:
            answer = offer()
            if answer is not WOULD_BLOCK:
                return answer
            with self._space:
                if self._closed:
                    return BUSY
                # registered under the lock the consumer takes to wake: room made after the offer
                # failed is either seen here or wakes this future, never lost
                room = None if not self._queue.full() else self._room.add()
            left = end - loop.time()
            if left <= 0:
                return BUSY
            if room is not None:
                try:
                    await asyncio.wait_for(room, left)
                except asyncio.TimeoutError:
                    self._forget(room)
                    return BUSY
                except asyncio.CancelledError:  # the subscription stopped (the rank stopped serving)
                    self._forget(room)
                    raise

    def _forget(self, room: asyncio.Future) -> None:
        with self._space:
            self._room.discard(room)

    def _on_batch_waiting(self, msg: dict) -> Any:
        """``_on_batch`` for a full buffer, awaited on the bus's loop (``_wait_for_room``)."""
        return self._wait_for_room(lambda: self._on_batch(msg, wait=False))

    def _on_group_waiting(self, msg: dict) -> Any:
        """``_on_group`` for a full buffer, awaited on the bus's loop (``_wait_for_room``)."""
        return self._wait_for_room(lambda: self._on_group(msg, wait=False))

    def _on_batch_now(self, msg: dict) -> Any:
        """``_on_batch`` on the bus's loop thread when the buffer has room (most batches): no
        hand-off to a pool thread; a full buffer passes the batch to ``_on_batch_waiting``, which
        waits on the loop for room."""
        return self._on_batch(msg, wait=False)

    def has_ready(self) -> bool:
        """Whether the next message waiting is a batch this view yields at once (not an end of
        stream, nor a later epoch's batch): the dispatcher then looks it up together with the
        one before it without waiting for the data loaders (``persia.nn_worker.lookup_group``)."""
        with self._queue.mutex:  # queue.Queue's own lock over its deque: a peek, nothing taken
            if not self._queue.queue:
                return False
            kind, msg = self._queue.queue[0]
        return kind == "batch" and (self.epoch is None or int(msg.get("epoch", 0)) <= self.epoch)

    def _take(self, timeout_s: float) -> tuple:
        """The next queued item (``queue.Empty`` after ``timeout_s``); wakes what waits for room."""
        item = self._queue.get(timeout=timeout_s)
        with self._space:
            self._space.notify()
            self._room.wake_all()
        return item

    def _take_unless(self, stop, timeout_s: float) -> tuple | None:
        """``_take``, or None once ``stop`` (an Event) is set: looked at every 0.2 s."""
        if stop is None:
            return self._take(timeout_s)
        end = time.monotonic() + timeout_s
        while not stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                raise queue.Empty
            try:
                return self._take(min(left, 0.2))
            except queue.Empty:
                continue
        return None

    def source(self, bus, rank: int, timeout_s: float, owner=None, stop=None) -> Iterator[dict]:
        """Messages in arrival order, until the stream (or this epoch) ends, or ``stop`` (an
        Event) is set: a loop closed early, whose unconsumed messages the next view gets.
        ``owner``: the context whose training session this is (the stream's state lives with it)."""
        state = _stream_state(rank, owner)
        if owner is not None and getattr(owner, "world_size", None) is not None:
            state.rank, state.world_size = rank, int(owner.world_size)
            state.embedding_workers = len(getattr(owner, "_workers", None) or ()) or 1
        route_ends(bus, rank)  # ends of stream reach the stream of the moment, views or not
        pending = state.open_view(self, rank, stop, VIEW_HANDOVER_S)
        self._closed = False  # this dataset's earlier view closed it (the same dataset, a new loop)
        try:
            self._register(bus, state, rank)
        except BaseException:
            state.close_view(pending)
            raise
        if self.until == "epoch":
            self.epoch = state.next_epoch
        ended = False  # this epoch (or the stream) ended: not closed early, not failed
        later: list = []  # messages of a later epoch, for the view that reads it
        try:
            while not self._finished(state):
                if pending:
                    kind, msg = pending.pop(0)
                else:
                    try:
                        taken = self._take_unless(stop, timeout_s)
                    except queue.Empty:
                        raise TimeoutError(f"NN rank {rank}: no batch for {timeout_s:g} s ({self._waiting(state)})") from None
                    if taken is None:
                        return  # closed early: not the end of the stream (nor of this epoch)
                    kind, msg = taken
                if kind == "eos":
                    self._on_end(state, msg)
                    continue
                epoch = int(msg.get("epoch", 0))
                if self.epoch is not None and epoch > self.epoch:
                    later.append((kind, msg))  # the next epoch's: its own view yields it
                    continue
                if msg.get("loader_size") is not None:
                    state.see_loader_size(int(msg["loader_size"]))
                state.received[(int(msg.get("loader", 0)), epoch)] += 1
                self.received_total += 1
                ACCOUNT.received_from(int(msg.get("loader", 0)), msg.get("session"))
                yield msg
            ended = True
        finally:
            left = pending + later
            try:
                left += self._close(bus, state)
            finally:
                if ended and self.epoch is not None:  # before the next view may open
                    state.next_epoch = self.epoch + 1
                state.close_view(left)

    def _finished(self, state: _RankStream) -> bool:
        if self.epoch is None:
            return state.stream_done()
        if state.epoch_done(self.epoch):
            return True
        return False

    def _on_end(self, state: _RankStream, msg: dict) -> None:
        loader, size, epoch = int(msg["loader"]), int(msg["loader_size"]), int(msg.get("epoch", 0))
        if msg.get("failed"):
            raise DataLoaderFailed(f"data loader {loader} failed: {msg['failed']}")
        state.see_loader_size(size)
        state.sent[(loader, epoch)] += int(msg["sent"])
        ACCOUNT.announced(loader, msg.get("session"), int(msg["sent"]), bool(msg.get("final", True)),
                          msg.get("failed_sends") or {})
        if msg.get("final", True):
            state.final.add(loader)
            log.info("data loader %d/%d ended its stream", loader, size)
        else:
            state.epochs_ended.setdefault(loader, set()).add(epoch)
            log.info("data loader %d/%d ended epoch %d: %s batches for this rank", loader, size, epoch, msg["sent"])

    @staticmethod
    def _waiting(state: _RankStream) -> str:
        if state.loader_size is None:
            return "no data loader has connected"
        missing = sorted(set(range(state.loader_size)) - state.final)
        return f"data loaders {missing} have not ended their stream; {sum(state.received.values())} batches received"

    def __iter__(self):
        raise TypeError("StreamingDataset is consumed through persia.data.DataLoader, not iterated directly")


class IterableDataset(IterableDatasetBase):
    """A local, finite dataset (e.g. the test set): subclass and yield PersiaBatch from __iter__."""

    def __iter__(self) -> Iterator[PersiaBatch]:
        raise NotImplementedError
