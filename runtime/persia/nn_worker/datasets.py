"""Datasets an NN worker iterates: batches streamed by data loaders over NATS, or a local one."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator

from persia import messages as M
from persia.bus import BUSY, subject
from persia.data_loader.batch import PersiaBatch
from persia.errors import DataLoaderFailed, PersiaError

log = logging.getLogger(__name__)


class IterableDatasetBase:
    def __init__(self, buffer_size: int = 10):
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.buffer_size = buffer_size


class StreamingDataset(IterableDatasetBase):
    """Batches sent by data loaders over NATS to this NN rank, until every loader says "done".

    A full buffer answers "busy" (after waiting up to ``busy_wait_s``) and the loader retries:
    back-pressure, never loss. The stream ends when every data loader has sent its end-of-stream
    message and every batch it announced has arrived.
    """

    def __init__(self, buffer_size: int = 10, busy_wait_s: float = 0.5):
        super().__init__(buffer_size)
        self.busy_wait_s = busy_wait_s
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._registered = False
        self._lock = threading.Lock()
        self._eos: dict[int, dict] = {}
        self._loader_size: int | None = None
        self._received: dict[int, int] = {}
        self._seen: set[tuple[int, int]] = set()
        self.received_total = 0

    def _register(self, bus, rank: int) -> None:
        with self._lock:
            if self._registered:
                return
            self._subs = [
                bus.serve(subject("nn", "batch", rank), self._on_batch, schema=M.Batch),
                bus.serve(subject("nn", "eos", rank), self._on_eos, schema=M.EndOfStream),
            ]
            bus.flush()
            self._registered = True

    def _unregister(self, bus) -> None:
        """A finished stream stops answering, so a later StreamingDataset in this process gets
        the next stream's batches (NATS would otherwise fan them out to both)."""
        for sub in getattr(self, "_subs", []):
            bus.unsubscribe(sub)
        self._subs = []

    def _on_batch(self, msg: dict) -> Any:
        key = (int(msg.get("loader", 0)), int(msg["batch_id"]))
        with self._lock:
            if key in self._seen:  # a retried send whose first reply was lost: train it once
                return {"queued": True, "duplicate": True}
            self._seen.add(key)
        try:
            self._queue.put(("batch", msg), timeout=self.busy_wait_s)
        except queue.Full:
            with self._lock:
                self._seen.discard(key)
            return BUSY
        return {"queued": True}

    def _on_eos(self, msg: dict) -> Any:
        # Checked here so a bad one is refused to its sender instead of stopping the trainer.
        if msg["loader"] >= msg["loader_size"]:
            raise ValueError(f"end of stream: loader {msg['loader']} out of range for loader_size {msg['loader_size']}")
        # Goes through the same queue so it is seen after every batch that loader sent before it.
        try:
            self._queue.put(("eos", msg), timeout=self.busy_wait_s)
        except queue.Full:
            return BUSY
        return {"ack": True}

    def source(self, bus, rank: int, timeout_s: float) -> Iterator[dict]:
        """Messages in arrival order; ends after the last loader's end-of-stream."""
        self._register(bus, rank)
        while True:
            if self._loader_size is not None and len(self._eos) == self._loader_size:
                expected = sum(int(e["sent"]) for e in self._eos.values())
                if self.received_total >= expected:
                    self._unregister(bus)
                    return
            try:
                kind, msg = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                waiting = (
                    "no data loader has connected"
                    if self._loader_size is None
                    else f"data loaders {sorted(set(range(self._loader_size)) - set(self._eos))} "
                    f"have not finished; {self.received_total} batches received"
                )
                raise TimeoutError(f"NN rank {rank}: no batch for {timeout_s:.0f}s ({waiting})") from None
            if kind == "batch":
                self.received_total += 1
                loader = int(msg.get("loader", 0))
                self._received[loader] = self._received.get(loader, 0) + 1
                yield msg
            else:
                loader = int(msg["loader"])
                if msg.get("failed"):
                    raise DataLoaderFailed(f"data loader {loader} failed: {msg['failed']}")
                size = int(msg["loader_size"])
                if self._loader_size is not None and self._loader_size != size:
                    raise PersiaError(f"data loaders disagree on their replica size: {self._loader_size} vs {size}")
                self._loader_size = size
                self._eos[loader] = msg
                log.info("data loader %d/%d finished: %s batches for this rank", loader, size, msg["sent"])

    def eos_info(self) -> dict[int, dict]:
        return dict(self._eos)

    def __iter__(self):
        raise TypeError("StreamingDataset is consumed through persia.data.DataLoader, not iterated directly")


class IterableDataset(IterableDatasetBase):
    """A local, finite dataset (e.g. the test set): subclass and yield PersiaBatch from __iter__."""

    def __iter__(self) -> Iterator[PersiaBatch]:
        raise NotImplementedError
