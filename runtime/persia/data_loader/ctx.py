"""The data loader's context: sends PersiaBatch to embedding workers and NN workers."""

from __future__ import annotations

import logging
import secrets

from persia import env
from persia.bus import NatsBus, shared_bus, subject
from persia.context import BaseCtx
from persia.data_loader.batch import PersiaBatch
from persia.data_loader.resume import StreamPosition, position_from_info
from persia.data_loader.wire import _named_arrays, id_features_to_wire
from persia.errors import PersiaError

log = logging.getLogger(__name__)


_positions: dict[tuple, StreamPosition | None] = {}


def _process_position(resume: dict | None, loader_index: int, world_size: int) -> StreamPosition | None:
    """One position per checkpoint per process: a second ``DataCtx`` in the same process (the next
    epoch) continues where the first stopped skipping instead of skipping again."""
    key = (None if not resume else (resume.get("path"), resume.get("step")), loader_index)
    if key not in _positions:
        position, warning = position_from_info(resume, loader_index, world_size)
        if warning:
            log.warning("%s", warning)
        elif position is not None and position.total:
            log.info("data loader %d resumes after step %s of %s: skipping %d batches already trained",
                     loader_index, position.step, position.path, position.total)
        _positions[key] = position
    return _positions[key]


class DataCtx(BaseCtx):
    """Sends PersiaBatch to the embedding workers (ID features) and NN workers (the rest).

    Round-robin over embedding workers; NN rank = ``batch_id % world_size`` with ``batch_id =
    counter * loader_replica_size + loader_replica_index``. Leaving the ``with`` block sends each
    NN rank an end-of-stream message carrying how many batches this loader sent it.
    """

    def __init__(self, *args, discovery_deadline_s: float = 600.0, send_deadline_s: float = 600.0, **kwargs):
        super().__init__(*args, **kwargs)
        # PERSIA's BaseCtx: a process with a RANK (and no REPLICA_*) is indexed by its rank.
        index, size = env.get_replica_index(), env.get_replica_size()
        self.replica_index = env.get_rank() if index is None else index
        self.replica_size = (env.get_world_size() or 1) if size is None else size
        env.check_replica(self.replica_index, self.replica_size, "data loader")
        self.send_deadline_s = send_deadline_s
        self.bus: NatsBus = shared_bus()
        ew = self.bus.request_retry(subject("ew", "info"), None, deadline_s=discovery_deadline_s, timeout=2.0,
                                    what="waiting for embedding workers")
        self.num_embedding_workers = int(ew["replica_size"])
        nn = self.bus.request_retry(subject("nn", "info"), None, deadline_s=discovery_deadline_s, timeout=2.0,
                                    what="waiting for NN workers")
        self.world_size = int(nn["world_size"])
        self.resume_position = _process_position(nn.get("resume"), self.replica_index, self.world_size)
        self.skipped = 0
        self._counter = 0
        # Batch ids restart at 0 in every DataCtx (a second epoch, a restarted loader): the session
        # keeps the worker from taking a new batch for a retry of an old one with the same id.
        self._session = secrets.token_hex(8)
        self._sent_per_rank = [0] * self.world_size
        self._closed = False
        log.info("data loader %d/%d: %d embedding workers, NN world size %d",
                 self.replica_index, self.replica_size, self.num_embedding_workers, self.world_size)

    def send_data(self, persia_batch: PersiaBatch) -> None:
        if self._closed:
            raise PersiaError("DataCtx is closed: send_data after the with-block ended")
        if not isinstance(persia_batch, PersiaBatch):
            raise TypeError(f"send_data expects a PersiaBatch, got {type(persia_batch).__name__}")
        if persia_batch.batch_id is not None:
            raise PersiaError(f"this PersiaBatch was already sent (batch_id {persia_batch.batch_id})")
        batch_id = self._counter * self.replica_size + self.replica_index
        worker = (self._counter + self.replica_index) % self.num_embedding_workers
        rank = batch_id % self.world_size
        if self.resume_position is not None and self.resume_position.skip(rank):
            # trained before the restart (the checkpoint's position): keep its batch id, send nothing
            persia_batch.batch_id = batch_id
            self._counter += 1
            self.skipped += 1
            return
        ref = self.bus.request_retry(
            subject("ew", "forward", worker),
            {
                "loader": self.replica_index,
                "session": self._session,
                "batch_id": batch_id,  # lets the worker recognise a retried send
                "batch_size": persia_batch.batch_size,
                "requires_grad": persia_batch.requires_grad,
                "features": id_features_to_wire(persia_batch),
            },
            deadline_s=self.send_deadline_s,
            what=f"sending ID features of batch {batch_id} to embedding worker {worker}",
        )
        self.bus.request_retry(
            subject("nn", "batch", rank),
            {
                "batch_id": batch_id,
                "loader": self.replica_index,
                "ref": ref["ref"],
                "worker": ref["worker"],
                "requires_grad": persia_batch.requires_grad,
                "non_id": _named_arrays(persia_batch.non_id_type_features),
                "labels": _named_arrays(persia_batch.labels),
                "meta": persia_batch.meta,
            },
            deadline_s=self.send_deadline_s,
            what=f"sending batch {batch_id} to NN rank {rank}",
        )
        persia_batch.batch_id = batch_id
        self._counter += 1
        self._sent_per_rank[rank] += 1

    @property
    def sent(self) -> int:
        """Batches this context sent (not those it skipped on resume)."""
        return self._counter - self.skipped

    @property
    def start_batch(self) -> int:
        """How many batches of this loader's stream were trained before a restart (0 on a fresh
        job). ``send_data`` skips them by itself; a loader that can seek may skip them instead."""
        return self.resume_position.total if self.resume_position is not None else 0

    def close(self, failure: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        for rank in range(self.world_size):
            self.bus.request_retry(
                subject("nn", "eos", rank),
                {"loader": self.replica_index, "loader_size": self.replica_size,
                 "sent": self._sent_per_rank[rank], "failed": failure},
                deadline_s=self.send_deadline_s,
                what=f"end-of-stream to NN rank {rank}",
            )
        log.info("data loader %d sent %d batches%s", self.replica_index, self._counter - self.skipped,
                 f" (skipped {self.skipped} trained before the restart)" if self.skipped else "")

    def _exit(self, exc: BaseException | None) -> None:
        self.close(None if exc is None else f"{type(exc).__name__}: {exc}")
