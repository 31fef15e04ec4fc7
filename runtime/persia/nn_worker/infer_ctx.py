"""Inference without NATS: an embedding context that talks straight to given embedding workers."""

from __future__ import annotations

import time

from persia.embedding_worker.service import SERVICE as WORKER_SERVICE
from persia.embedding_worker.service import discover
from persia.errors import EmbeddingLayoutMismatch, ServersMisplaced
from persia.nn_worker.embedding_ctx import EmbeddingCtx, PreprocessMode
from persia.rpc import Client


class InferCtx(EmbeddingCtx):
    """Inference without NATS: talks straight to the given embedding workers (``host:port``)."""

    def __init__(self, embedding_worker_address_list: list[str], *args, **kwargs):
        super().__init__(PreprocessMode.INFERENCE, *args, **kwargs)
        if not embedding_worker_address_list:
            raise ValueError("InferCtx needs at least one embedding worker address")
        self._workers = [Client(a, WORKER_SERVICE) for a in embedding_worker_address_list]
        self._streamed_from: list[Client] | None = None

    def _enter(self) -> None:
        if self.model is not None:
            self.model.to(self.device)

    def wait_for_serving(self, deadline_s: float = 300.0) -> None:
        """Until every embedding worker can look up: its PS replicas answer (an inference PS opens
        its port once its checkpoint is loaded). A static PS list in the wrong order raises at once;
        anything else still failing at the deadline raises ``TimeoutError`` saying why."""
        end = time.monotonic() + deadline_s
        for c in self._workers:
            while True:
                try:
                    answer = c.call("Ready", None, timeout=3.0)
                except Exception as exc:  # noqa: BLE001 - the worker not up yet
                    answer = {"ready": False, "misplaced": False, "why": f"{type(exc).__name__}: {exc}"}
                if answer["ready"]:
                    break
                if answer["misplaced"]:
                    error = EmbeddingLayoutMismatch if answer.get("layout_mismatch") else ServersMisplaced
                    raise error(f"embedding worker {c.address}: {answer['why']}")
                if time.monotonic() > end:
                    raise TimeoutError(f"embedding worker {c.address} not serving after {deadline_s:g} s: "
                                       f"{answer['why']}")
                time.sleep(0.2)

    def wait_servers_ready(self) -> None:
        """InferCtx has no PS to wait for: its embedding workers answering is ready."""
        self.wait_for_serving()

    def _stream_clients(self) -> list[Client]:
        """Streamed batches name the embedding worker that holds them by its replica index, so
        they are looked up on the workers found over NATS, not on the given address list."""
        if self._streamed_from is None:
            entries = discover(self.bus, "ew", self.discovery_deadline_s)
            self._streamed_from = [Client(e["address"], WORKER_SERVICE) for e in entries]
        return self._streamed_from
