"""The data loader's context: sends PersiaBatch to embedding workers and NN workers."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any, Callable

import nats.errors

from persia import env, security
from persia.bus import NatsBus, shared_bus, subject
from persia.config import UnknownSlotError
from persia.context import BaseCtx
from persia.data_loader.batch import PersiaBatch
from persia.data_loader.grouping import (HeldBatch, SendGroups, data_group_setting, fits_group, hold_setting,
                                        id_leg_failures)
from persia.data_loader.resume import StreamPosition, live_resume, loader_count_error, position_from_info
from persia.data_loader.trainers import TRAINER_GRACE_S, TrainerGone, TrainerRestarted
from persia.data_loader.wire import _named_arrays, id_features_to_wire
from persia.data_loader import stream as loader_stream
from persia import messages as M
from persia.errors import PersiaError
from persia.metrics import Metrics, start_exporter

log = logging.getLogger(__name__)


_positions: dict[tuple, StreamPosition | None] = {}


_ENV_SECRET = object()


def batch_ref(session: str, loader: int, batch_id: int, key: bytes | None | object = _ENV_SECRET) -> int:
    """The ref under which a batch's ID features wait on their embedding worker: chosen by the
    loader, so that it can name them to the NN worker before the worker has them. Unique per
    (loader process, batch) in practice (62 random-looking bits; the worker refuses a ref it
    already holds), and the same for a retried send. Keyed with the job secret when there is one
    (``key``: ``security.ref_key`` of it; by default this process's ``PERSIA_JOB_SECRET``): the
    worker recomputes it and refuses a forward whose ref does not match (docs/security.md)."""
    if key is _ENV_SECRET:
        key = security.ref_key(security.job_secret())
    return security.batch_ref(session, loader, batch_id, key)


def _process_position(session: str, resume: dict | None, live, loader_index: int,
                      world_size: int) -> StreamPosition | None:
    """One position per process: a second ``DataCtx`` in the same process (the next epoch)
    continues where the first stopped skipping instead of skipping again. ``live()``: where the
    NN ranks are now (``resume.live_resume``), asked once, by the process's first ``DataCtx``."""
    key = (session, loader_index)
    if key not in _positions:
        current = live()
        position, _ = position_from_info(current, loader_index, world_size)
        saved, note = position_from_info(resume, loader_index, world_size)  # the checkpoint's alone
        if note:
            log.info("%s", note)
        saved_total = saved.total if saved is not None else 0
        if position is not None and position.total > saved_total:
            log.warning("data loader %d: the NN ranks already have %d of this loader's batches (%d trained before "
                        "the job's resume point, %s): restarted while training went on, skipping them all",
                        loader_index, position.total, saved_total, (resume or {}).get("path") or "none")
        elif position is not None and position.total:
            log.info("data loader %d resumes after step %s of %s: skipping %d batches already trained",
                     loader_index, position.step, position.path, position.total)
        _positions[key] = position
    return _positions[key]


def _batches(group: list[HeldBatch]) -> str:
    return f"batch{'es' if len(group) > 1 else ''} {', '.join(str(b.batch_id) for b in group)}"


class DataCtx(BaseCtx):
    """Sends PersiaBatch to the embedding workers (ID features) and NN workers (the rest).

    Round-robin over embedding workers; NN rank = ``batch_id % world_size`` with ``batch_id =
    counter * loader_replica_size + loader_replica_index``. Batches for the same worker and rank go
    ``PERSIA_DATA_GROUP`` (default 2) to a message on each leg, so ``send_data`` may return holding
    its batch for the next one (``persia.data_loader.grouping``). Leaving the ``with`` block sends
    what is held, then each NN rank an end-of-stream message carrying how many batches this loader
    sent it. Serves ``/metrics`` (role ``data_loader``) when metrics are on: docs/metrics.md.

    A send to an NN rank that said it finished training (``nn.done``) and has not answered since
    fails ``trainer_grace_s`` after that, once nobody listens for the rank (``TrainerGone``),
    instead of retrying until ``send_deadline_s``: ``persia.data_loader.trainers``.
    """

    def __init__(self, *args, discovery_deadline_s: float = 600.0, send_deadline_s: float = 600.0,
                 trainer_grace_s: float = TRAINER_GRACE_S, **kwargs):
        super().__init__(*args, **kwargs)
        # PERSIA's BaseCtx: a process with a RANK (and no REPLICA_*) is indexed by its rank.
        index, size = env.get_replica_index(), env.get_replica_size()
        self.replica_index = env.get_rank() if index is None else index
        self.replica_size = (env.get_world_size() or 1) if size is None else size
        env.check_replica(self.replica_index, self.replica_size, "data loader")
        # before discovery, which may wait minutes for the workers: the scrape target is up meanwhile
        start_exporter()
        self._metrics = Metrics("data_loader", self.replica_index)
        self.send_deadline_s = send_deadline_s
        self.trainer_grace_s = trainer_grace_s
        self._groups = SendGroups(data_group_setting(os.environ))  # checked before anything is sent
        self._hold_s = hold_setting(os.environ)
        # guards the held batches; the sends themselves run outside it, so threads send in parallel
        lock = threading.RLock()
        self._sending = threading.Condition(lock)  # notified when the last send in flight ends
        self._hold_wake = threading.Condition(lock)  # wakes the hold thread from a wait without deadline, and at close
        self._holder_idle = False  # the hold thread waits without a deadline (nothing was held)
        self._holds = 0  # batches held so far: tells the hold thread whether the loader is busy
        self._in_flight = 0  # sends under way outside the lock (send_data's, the hold thread's)
        self._late: BaseException | None = None  # a send of the hold thread that failed, raised next
        self._holder: threading.Thread | None = None
        self._show_sending()
        self.bus: NatsBus = shared_bus()
        ew = self.bus.request_retry(subject("ew", "info"), None, deadline_s=discovery_deadline_s, timeout=2.0,
                                    what="waiting for embedding workers")
        self.num_embedding_workers = int(ew["replica_size"])
        # the embedding config's slot names (None from a worker that does not say: not checked here)
        slots = ew.get("slots")
        self._slots: list[str] | None = [str(s) for s in slots] if isinstance(slots, list) else None
        self._slot_set = frozenset(self._slots) if self._slots is not None else None
        nn = self.bus.request_retry(subject("nn", "info"), None, deadline_s=discovery_deadline_s, timeout=2.0,
                                    what="waiting for NN workers")
        self.world_size = int(nn["world_size"])
        if self.world_size < 1:  # batch ids go to rank batch_id % world_size
            raise PersiaError(f"data loader {self.replica_index}: the NN workers report world_size "
                              f"{self.world_size} (their WORLD_SIZE); it must be >= 1")
        self.skipped = 0
        self._stream = loader_stream.current()
        if self._stream.ended:
            raise PersiaError("this data loader already ended its stream (end_of_stream()); "
                              "open every DataCtx before that")
        self._closed = False
        refused = loader_count_error(nn.get("resume"), self.replica_size)
        if refused is not None:
            # before anything is sent; the NN ranks hear it too (DataLoaderFailed), instead of
            # waiting for a stream that will not come
            log.error("data loader %d/%d: %s", self.replica_index, self.replica_size, refused)
            self.close(failure=refused)
            raise PersiaError(refused)
        self.resume_position = _process_position(
            self._stream.session, nn.get("resume"), lambda: self._live_resume(nn, discovery_deadline_s),
            self.replica_index, self.world_size)
        loader_stream.set_finisher(self._send_end_of_stream)
        if not self._stream.watching_trainers:
            self._stream.watching_trainers = True
            trainers = self._stream.trainers
            self.bus.subscribe_events(subject("nn", "done"), lambda m: trainers.done(int(m["rank"])),
                                      schema=M.TrainerDone)
        log.info("data loader %d/%d: %d embedding workers, NN world size %d (epoch %d)",
                 self.replica_index, self.replica_size, self.num_embedding_workers, self.world_size,
                 self._stream.epoch)

    def _live_resume(self, nn: dict, deadline_s: float) -> dict | None:
        """Where the NN ranks are now (``resume.live_resume``): every rank of a training job
        (``TrainCtx``, whose ``nn.info`` carries ``resume``) says what it has of each loader."""
        if "resume" not in nn:  # eval_ctx / InferCtx: nothing is resumed
            return nn.get("resume")
        answers = [self.bus.request_retry(subject("nn", "position", rank), None, deadline_s=deadline_s, timeout=2.0,
                                          what=f"the stream position of NN rank {rank}")
                   for rank in range(self.world_size)]
        return live_resume(nn["resume"], answers, self.world_size)

    def send_data(self, persia_batch: PersiaBatch) -> None:
        if self._closed:
            raise PersiaError("DataCtx is closed: send_data after the with-block ended")
        if not isinstance(persia_batch, PersiaBatch):
            raise TypeError(f"send_data expects a PersiaBatch, got {type(persia_batch).__name__}")
        if persia_batch.batch_id is not None:
            raise PersiaError(f"this PersiaBatch was already sent (batch_id {persia_batch.batch_id})")
        if self._slot_set is not None:  # the embedding worker would refuse it, later and elsewhere
            for feature in persia_batch.id_type_features:
                if feature.name not in self._slot_set:
                    raise UnknownSlotError(feature.name, self._slots)
        with self._sending:
            self._raise_late()  # before this batch takes an id: it was not sent, and may be again
        # The id is spent even if a leg fails below: a retried batch gets a new one, so nobody ever
        # answers it with another batch's buffered features.
        batch_id = self._stream.next_id(self.replica_index, self.replica_size)
        worker = (batch_id // self.replica_size + self.replica_index) % self.num_embedding_workers
        rank = batch_id % self.world_size
        if self.resume_position is not None and self.resume_position.skip(batch_id):
            # trained before the restart (the checkpoint's position): keep its batch id, send nothing
            persia_batch.batch_id = batch_id
            self.skipped += 1
            self._metrics.inc("data_loader_batches_skipped")
            return
        ref = batch_ref(self._stream.session, self.replica_index, batch_id, self.bus.ref_key)
        leg = "id_features"
        try:
            ids = {
                "loader": self.replica_index,
                "batch_id": batch_id,  # with the session: lets the worker recognise a retried send
                "session": self._stream.session,
                "ref": ref,
                "batch_size": persia_batch.batch_size,
                "requires_grad": persia_batch.requires_grad,
                "features": id_features_to_wire(persia_batch),
            }
            leg = "dense"
            dense = {
                "batch_id": batch_id,
                "loader": self.replica_index,
                "loader_size": self.replica_size,  # recorded in checkpoints, checked on resume
                "world_size": self.world_size,  # the ranks it routes for: a rescaled rank refuses another count
                "session": self._stream.session,
                "ref": ref,
                "worker": worker,
                "requires_grad": persia_batch.requires_grad,
                "non_id": _named_arrays(persia_batch.non_id_type_features),
                "labels": _named_arrays(persia_batch.labels),
                "meta": persia_batch.meta,
            }
        except Exception as exc:
            self._failed(leg, batch_id, exc)
            raise
        held = HeldBatch(worker, rank, batch_id, ref, ids, dense, persia_batch, held_at=time.monotonic())
        persia_batch.batch_id = batch_id  # held or sent: this object is not sent twice
        # held or sent from here on: acknowledged or failed in the epoch it is stamped with
        dense["epoch"] = self._stream.stamp()
        with self._sending:
            if self._groups.size > 1 and not fits_group(held, self._groups.size, self.bus.max_payload):
                # too large to share a message: whatever waits for its worker and rank goes first
                groups = self._groups.take(worker, rank) + [[held]]
            else:
                group = self._groups.add(held)
                groups = [] if group is None else [group]
                if group is None:
                    self._holds += 1
                    if self._holder_idle:
                        self._holder_idle = False  # one wake-up, however many are held before it runs
                        self._hold_wake.notify()  # else it wakes by this batch's hold end anyway
                if group is None and self._holder is None:
                    self._holder = threading.Thread(target=self._send_overdue, name="persia-data-group-hold",
                                                    daemon=True)
                    self._holder.start()
            if groups:
                self._in_flight += 1
            self._show_sending()
        if groups:
            self._send_in_flight(groups)

    def _send_in_flight(self, groups: list[list[HeldBatch]], *, late: bool = False) -> None:
        """Send ``groups`` (counted in flight by the caller, under the lock); every one is tried,
        then the first failure raised, or with ``late`` (the hold thread) kept for the next
        ``send_data``: kept under the lock that ends the send, so once no send is in flight its
        error is there to raise."""
        first = None
        try:
            for group in groups:
                try:
                    self._send_group(group)
                except Exception as exc:  # noqa: BLE001 - counted and logged by _send_group
                    first = first or exc
            if first is not None and not late:
                raise first
        finally:
            with self._sending:
                if late and first is not None:
                    self._late = self._late or first
                self._in_flight -= 1
                self._show_sending()
                if self._in_flight == 0:
                    self._sending.notify_all()

    def _send_overdue(self) -> None:
        """The hold thread: sends the groups whose first batch has waited a hold (a loader that
        produces slowly is not held back by its group), until the close."""
        while (due := self._next_overdue()) is not None:
            self._send_in_flight(due, late=True)  # a failure is counted, logged, raised by the next call

    def _next_overdue(self) -> list[list[HeldBatch]] | None:
        """Wait for the next groups due (counted in flight), or None at the close.

        Sleeps until the oldest held batch's hold ends. With nothing held, it waits one hold more
        if batches were held since it last looked (a busy loader: a batch held meanwhile needs no
        wake-up, its hold ends after that wait), else without a deadline until a batch is held.
        A busy loader wakes it about once a hold, an idle one (waiting for a full NN rank) not at
        all (it had ticked every half hold); no held batch waits past its hold."""
        with self._sending:
            seen = self._holds
            while not self._closed:
                oldest = self._groups.oldest
                if oldest is not None:
                    left = oldest + self._hold_s - time.monotonic()
                    if left > 0:
                        self._hold_wake.wait(left)
                        continue
                    due = self._groups.take_held_since(time.monotonic() - self._hold_s)
                    if due:
                        self._in_flight += 1
                        self._show_sending()
                        return due
                elif self._holds != seen:
                    seen = self._holds
                    self._hold_wake.wait(self._hold_s)
                else:
                    self._holder_idle = True
                    self._hold_wake.wait()
                    self._holder_idle = False
            return None

    def _show_sending(self) -> None:
        """The gauges of what is held and in flight (under the lock, after each change): a loader
        whose sends stall shows it here before its deadline fails them."""
        self._metrics.set("data_loader_batches_held", len(self._groups))
        self._metrics.set("data_loader_sends_in_flight", self._in_flight)

    def _raise_late(self) -> None:
        """A send of the hold thread failed: raised from the next ``send_data`` (or the close)."""
        late, self._late = self._late, None
        if late is not None:
            raise late

    def _send_group(self, group: list[HeldBatch]) -> None:
        """Send batches of one (embedding worker, NN rank), one message per leg; each is counted
        as acknowledged, or as failed and the error raised, naming it."""
        worker, rank = group[0].worker, group[0].rank
        what = _batches(group)
        if len(group) == 1:
            legs = (("forward", group[0].ids), ("batch", group[0].dense))
        else:
            legs = (("forward_group", {"batches": [b.ids for b in group]}),
                    ("batch_group", {"batches": [b.dense for b in group]}))
        # Both legs at once (one round trip, not two): the NN worker names the ID features by the
        # ref chosen here, and its lookup waits for them on the worker if it comes first.
        started = time.monotonic()

        async def both_legs() -> list[Any]:
            return await asyncio.gather(
                self.bus.arequest_retry(subject("ew", legs[0][0], worker), legs[0][1], deadline_s=self.send_deadline_s,
                                        what=f"sending ID features of {what} to embedding worker {worker}"),
                self._arequest_rank(subject("nn", legs[1][0], rank), legs[1][1], rank,
                                    patience_s=self.trainer_grace_s, deadline_s=self.send_deadline_s,
                                    what=f"sending {what} to NN rank {rank}",
                                    unsent=f"{len(group)} batch{'es' if len(group) > 1 else ''} ({what})"),
                return_exceptions=True)

        try:
            id_leg, dense_leg = self.bus.run(both_legs())
        except BaseException as exc:  # the bus itself (closed, its loop gone): nothing known delivered
            id_leg = dense_leg = exc
        self._metrics.observe("data_loader_send_time_cost_sec", time.monotonic() - started)
        if isinstance(dense_leg, dict) and dense_leg.get("refused"):
            # not taken: the rank restarted, or the ranks were rescaled, while this process streamed on
            dense_leg = TrainerRestarted(rank, str(dense_leg["refused"]), what)
        if isinstance(dense_leg, BaseException):
            # not delivered: their ID features wait on the worker for nobody (handed back), and
            # their ids are spent (a retried batch gets a new one, never another batch's features)
            self._release(worker, [b.ref for b in group])
            leg = "id_features" if isinstance(id_leg, BaseException) else "dense"
            for b in group:
                b.batch.batch_id = None
                self._failed(leg, b.batch_id, dense_leg)
                self._stream.settled(b.dense["epoch"])  # its epoch's end need not wait for it
            raise dense_leg
        for b in group:  # the NN rank has them all: each is in its count, trained or failed there
            self._stream.acknowledged(rank, b.dense["epoch"])
        self._metrics.inc("data_loader_batches_sent", len(group))
        lost = id_leg_failures(group, id_leg)
        if not lost:
            return
        # Their ID features will never come: the worker is told, so a lookup waiting for them
        # fails now, and the NN rank counts them as failed (lost_id_features).
        self._release(worker, [b.ref for b, _ in lost])
        for b, why in lost:
            b.batch.batch_id = None
            self._metrics.inc("data_loader_batches_failed", feat="lost_id_features")
            log.error("batch %d: ID features not sent (%s); NN rank %d counts it as failed (lost_id_features)",
                      b.batch_id, why, rank)
        if isinstance(id_leg, BaseException):
            raise id_leg
        raise PersiaError(f"embedding worker {worker} refused the ID features of "
                          + "; ".join(f"batch {b.batch_id}: {why}" for b, why in lost))

    async def _arequest_rank(self, subj: str, obj: Any, rank: int, *, patience_s: float, deadline_s: float,
                             what: str, unsent: str, timeout: float = 10.0) -> Any:
        """``NatsBus.arequest_retry`` to one NN rank's subject, which also raises ``TrainerGone``
        once the rank is gone (``trainers.rank_gone`` with ``patience_s``: only "no responders"
        proves the request reached nobody), and records each answer as the rank's news. A request
        in flight is never cut, so a batch is never delivered while counted as not sent. Runs on
        the bus loop, which records the answer before it handles any ``nn.done`` received after."""
        trainers = self._stream.trainers

        def give_up(last: Exception) -> TrainerGone | None:
            nobody = isinstance(last, nats.errors.NoRespondersError)
            return trainers.gone_error(rank, unsent) if trainers.gone(rank, patience_s, nobody_listens=nobody) else None

        return await self.bus.arequest_retry(subj, obj, deadline_s=deadline_s, timeout=timeout, what=what,
                                             on_answer=lambda: trainers.answered(rank), give_up=give_up)

    def _request_rank(self, rank: int, message: dict, what: str, *, patience_s: float, deadline_s: float,
                      timeout: float = 10.0) -> Any:
        """``_arequest_rank`` to the rank's end-of-stream subject, from a loader thread. Bounded:
        at exit (``end_of_stream`` from atexit) the bus may be closed already, its loop stopped,
        and a coroutine handed to it would be waited for for ever."""
        if self.bus.nc.is_closed:
            raise nats.errors.ConnectionClosedError
        return self.bus.run(self._arequest_rank(subject("nn", "eos", rank), message, rank, patience_s=patience_s,
                                                deadline_s=deadline_s, what=f"{what} to NN rank {rank}",
                                                unsent=f"the {what}", timeout=timeout),
                            deadline_s + timeout + 5.0)

    def _failed(self, leg: str, batch_id: int, exc: BaseException) -> None:
        reason = f"send_{leg}"
        with self._stream.lock:
            self._stream.failed[reason] += 1
        self._metrics.inc("data_loader_batches_failed", feat=reason)
        log.error("batch %d not sent (%s: %s); it is counted as failed (%s)", batch_id, type(exc).__name__, exc, reason)

    def _release(self, worker: int, refs: list[int]) -> None:
        try:
            self.bus.request(subject("ew", "release", worker), {"refs": [int(r) for r in refs]}, timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - the worker's buffer expires them anyway, with a count
            log.warning("could not release batch refs %s on embedding worker %d: %s", refs, worker, exc)

    @property
    def sent(self) -> int:
        """Batches this process sent and had acknowledged (not those skipped on resume)."""
        return self._stream.sent_total

    @property
    def start_batch(self) -> int:
        """How many batches of this loader's stream were trained before a restart (0 on a fresh
        job), for logs and progress. ``send_data`` skips them by itself, by counting the batches it
        is given: give it the stream from its start. A loader that seeks past them instead would
        have as many of the batches after them skipped too (their batch ids are the skipped ones)."""
        return self.resume_position.total if self.resume_position is not None else 0

    def _tell_ranks(self, message_for: Callable[[int], dict], what: str, best_effort: bool) -> None:
        """Send ``message_for(rank)`` to every NN rank's end-of-stream subject. ``best_effort``
        (end of stream, failures): a trainer that no longer listens has nothing left to learn.
        Otherwise (an epoch's end: its count) a rank gone after ``nn.done`` (``trainers``) fails
        it like a send, raised once every other rank has been told."""
        gone: TrainerGone | None = None
        for rank in range(self.world_size):
            if not best_effort:
                try:
                    self._request_rank(rank, message_for(rank), what, patience_s=self.trainer_grace_s,
                                       deadline_s=self.send_deadline_s)
                except TrainerGone as exc:
                    log.error("%s", exc)
                    gone = gone or exc
                continue
            # Nobody answering may be a trainer between two per-epoch datasets (back in moments)
            # or one that finished training (nn.done, and nothing answered for it since): wait
            # for either, trainer_grace_s at most.
            try:
                self._request_rank(rank, message_for(rank), what, patience_s=0.0,
                                   deadline_s=self.trainer_grace_s, timeout=2.0)
            except TrainerGone:
                log.info("NN rank %d finished training (nn.done): not sent the %s", rank, what)
            except Exception as exc:  # noqa: BLE001 - not taken in time, or NATS gone: nobody left to tell
                log.warning("NN rank %d did not take the %s: %s", rank, what, exc)
        if gone is not None:
            raise gone

    def _send_end_of_stream(self) -> None:
        if not self._closed:  # used without ``with``: its epoch ends here, its held batches sent first
            try:
                self.close()
            except Exception as exc:  # noqa: BLE001 - at exit: said, and the stream still ends
                log.error("data loader %d: ending the epoch of a DataCtx never closed failed: %s: %s",
                          self.replica_index, type(exc).__name__, exc)
        s = self._stream
        message = {"loader": self.replica_index, "loader_size": self.replica_size, "session": s.session,
                   "epoch": s.epoch, "sent": 0, "final": True, "failed_sends": dict(s.failed)}
        self._tell_ranks(lambda _rank: message, "end of stream", best_effort=True)
        log.info("data loader %d: end of stream after %d epochs, %d batches acknowledged, failed sends %s",
                 self.replica_index, s.epoch, s.sent_total, dict(s.failed) or "none")
        if s.sent_total == 0 and not self.skipped and not s.failed:
            log.warning("data loader %d ended its stream without sending a batch: its dataset yielded none "
                        "(an empty file or glob, a filter that drops every row, a shard past the end); "
                        "the NN ranks train nothing from it", self.replica_index)

    def _stop_sending(self, send_held: bool) -> list:
        """Wait for other threads' sends (acknowledged or failed), stop the hold thread and take
        the batches it held; with ``send_held`` they count as in flight, to be sent by the caller."""
        with self._sending:
            while self._in_flight:
                self._sending.wait()
            held = self._groups.drain()
            self._closed = True  # the hold thread takes nothing more
            self._hold_wake.notify()
            if held and send_held:
                self._in_flight += 1
            self._show_sending()
        if self._holder is not None:
            self._holder.join()
        return held

    def _abandon(self) -> None:
        """Stop after an NN rank refused this process's batches (``TrainerRestarted``), telling the
        ranks nothing: no end of epoch (its counts include what the rank's earlier process took)
        and no end of stream at exit (the rank would stop waiting for this loader). Batches still
        held are dropped unsent; the restarted process sends them."""
        if self._closed:
            return
        dropped = self._stop_sending(send_held=False)
        self._stream.ended = True
        log.error("data loader %d: stopped without ending its stream (an NN rank refused its batches: it restarted, "
                  "or the ranks were rescaled; %d held batches not sent): restart this data loader, it resends from "
                  "where the NN ranks are", self.replica_index,
                  sum(len(g) for g in dropped))

    def close(self, failure: str | None = None) -> None:
        """End this epoch (or, with ``failure``, the whole stream, so the trainer stops and says why)."""
        if self._closed:
            return
        held = self._stop_sending(send_held=True)
        held_failed = None
        if held:  # before the end of the epoch, which counts them
            try:
                self._send_in_flight(held)
            except Exception as exc:  # noqa: BLE001 - raised below, after the epoch ends
                held_failed = exc
        with self._sending:
            held_failed = held_failed or self._late
            self._late = None
        if isinstance(held_failed, TrainerRestarted):
            # the stream does not end: a restarted process goes on with it (nothing told to the ranks)
            self._stream.ended = True
            raise held_failed
        if held_failed is not None and failure is None:
            # as if the send_data that held them had raised in the with-block: the stream fails
            failure = f"{type(held_failed).__name__}: {held_failed}"
        else:
            held_failed = None
        epoch, sent = self._stream.end_epoch()
        message = {"loader": self.replica_index, "loader_size": self.replica_size, "session": self._stream.session,
                   "epoch": epoch, "final": failure is not None, "failed": failure,
                   "failed_sends": dict(self._stream.failed)}
        self._tell_ranks(lambda rank: dict(message, sent=sent.get(rank, 0)), f"end of epoch {epoch}",
                         best_effort=failure is not None)
        if failure is not None:
            self._stream.ended = True
        log.info("data loader %d: epoch %d done, %d batches%s", self.replica_index, epoch, sum(sent.values()),
                 f" (skipped {self.skipped} trained before the restart)" if self.skipped else "")
        if held_failed is not None:
            raise held_failed  # the batches held for a group were not delivered: not silently

    def _exit(self, exc: BaseException | None) -> None:
        if isinstance(exc, TrainerRestarted):
            self._abandon()
            return
        self.close(None if exc is None else f"{type(exc).__name__}: {exc}")
