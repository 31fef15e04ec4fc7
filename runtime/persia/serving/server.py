"""The model server: HTTP/JSON and gRPC in front of the batcher and the predictor (answers to
failures: :mod:`persia.serving.answers`)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from persia.data_loader.batch import PersiaBatch
from persia.serving.answers import ServeError, classify
from persia.serving.batcher import Batcher
from persia.serving.budget import ByteBudget
from persia.serving.config import ServeConfig
from persia.serving.metrics import ServingMetrics
from persia.serving.model import DenseModel
from persia.serving.predictor import Predictor

log = logging.getLogger(__name__)


class ModelServer:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.metrics = ServingMetrics()
        self.model = DenseModel(config.model, config.model_poll_seconds,
                                on_load=self._on_model_load, check=self._check_reload,
                                on_refused=self._on_model_refused)
        self.predictor = Predictor(config.embedding_workers, self.model, config.max_batch_size,
                                   on_model_call=self.metrics.batch_size.observe)
        # HTTP request bodies held at once, and JSON parsed one at a time (persia.serving.budget)
        self.body_budget = ByteBudget(config.max_bytes_in_flight)
        self.json_parsing = threading.Lock()
        self._stopping = False  # stop() began: /ready answers 503 "stopping"
        self._hurry = threading.Event()  # cuts stop()'s drain short
        self.batcher = Batcher(self.predictor.run, config.max_batch_size, config.max_latency_ms / 1000.0,
                               config.max_queue, config.workers)
        self.model.start()
        from persia.serving.http_api import start_http

        self._http = start_http(self, config.host, config.http_port)
        self.http_port = self._http.server_address[1]
        self._grpc = None
        self.grpc_port = None
        if config.grpc_port is not None:
            from persia.serving.grpc_api import start_grpc

            self._grpc, self.grpc_port = start_grpc(self, config.host, config.grpc_port)
        # read at each scrape: the requests waiting for a batch, and the gRPC calls waiting for a
        # handler thread (each will wait for a batch too)
        self.metrics.queue_depth.set_function(
            lambda: self.batcher.depth() + (self._grpc.backlog() if self._grpc is not None else 0))
        log.info("model server: HTTP on %s:%d, gRPC on %s", config.host, self.http_port,
                 f"{config.host}:{self.grpc_port}" if self.grpc_port else "off")

    def _on_model_load(self, ok: bool) -> None:
        self.metrics.model_loads.labels(result="ok" if ok else "failed").inc()
        if ok:
            self.metrics.model_loaded.set(time.time())
            self.metrics.model_refused.set(0.0)

    def _check_reload(self, candidate) -> str | None:
        return self.predictor.check_reload(candidate)

    def _on_model_refused(self, _why: str) -> None:
        self.metrics.model_loads.labels(result="refused").inc()
        self.metrics.model_refused.set(1.0)

    def predict(self, batch: PersiaBatch, protocol: str, timeout_s: float | None = None,
                started: float | None = None) -> np.ndarray:
        """Output rows for one request; raises ServeError. Records the request's metrics.

        The request has ``request_timeout_s`` (or the caller's ``timeout_s``, a gRPC deadline, if
        shorter) from ``started`` (``time.monotonic()`` when it was received: for HTTP when its
        request line was read, so reading and parsing its body count; default now); its embedding
        lookup gets what is left of that. A request not answered in time is cancelled: it is
        answered 504 and, if it has not started, never runs. The latency metric counts from
        ``started`` too."""
        t0 = time.monotonic() if started is None else started
        code = 200
        limit = self.config.request_timeout_s if timeout_s is None else min(timeout_s, self.config.request_timeout_s)
        deadline = t0 + limit
        try:
            fut = self.batcher.submit(batch, deadline)
            try:
                out = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                fut.cancel()  # its batch has not started: it never will
                raise
            self.metrics.samples.inc(batch.batch_size)
            return out
        except BaseException as exc:
            err = classify(exc)
            code = err.status
            self.metrics.errors.labels(kind=err.kind).inc()
            if err.status == 500:
                log.error("prediction failed: %s", err)
            raise err from None
        finally:
            self.metrics.requests.labels(protocol=protocol, code=str(code)).inc()
            self.metrics.latency.labels(protocol=protocol).observe(time.monotonic() - t0)

    def count_refused(self, protocol: str, err: ServeError) -> None:
        """A request refused before it reached the batcher (unparsable body)."""
        self.metrics.errors.labels(kind=err.kind).inc()
        self.metrics.requests.labels(protocol=protocol, code=str(err.status)).inc()

    def ready(self) -> tuple[bool, str]:
        if self._stopping:  # at once on SIGTERM: the load balancer takes the replica out while it drains
            self.metrics.ready.set(0.0)
            return False, "stopping"
        ok, why = self.predictor.readiness()
        for address, up in self.predictor.worker_ready.items():
            self.metrics.embedding_worker_ready.labels(embedding_worker=address).set(1.0 if up else 0.0)
        refused = self.model.refused
        if ok and refused is not None:  # the old model serves on: ready, but the refusal is said
            why = f"{why}; refused to reload the model: {refused}"
        self.metrics.ready.set(1.0 if ok else 0.0)
        return ok, why

    def live(self) -> tuple[bool, str]:
        return (True, "live") if self.batcher.alive() else (False, "batcher thread died")

    def hurry(self) -> None:
        """Cut a running ``stop()``'s drain short (a second SIGTERM/SIGINT)."""
        self._hurry.set()

    def stop(self, drain_s: float = 0.0, grace_s: float = 1.0) -> None:
        """Stop gracefully within ``max(drain_s, grace_s)`` seconds altogether.

        1. ``/ready`` answers 503 ("stopping") at once; for ``drain_s`` both protocols keep serving
           (HTTP answers carry ``Connection: close``, so clients reconnect, to another replica once
           the load balancer has taken this one out).
        2. A new prediction on an open HTTP connection (one waiting to be accepted too), or a new
           gRPC call, is refused with 503 / UNAVAILABLE; the listeners close; idle kept-alive
           connections are closed (one that has not sent a request yet gets 2 s to send it).
        3. Requests in flight finish, until the time is up; any still waiting then is answered 503
           (``unavailable``, "the model server is stopping"), never 500."""
        end = time.monotonic() + max(drain_s, grace_s)
        self._stopping = True
        self.metrics.ready.set(0.0)
        self._http.drain()
        drain_end = time.monotonic() + drain_s
        while (left := drain_end - time.monotonic()) > 0 and not self._hurry.wait(min(left, 0.2)):
            pass  # short waits: a second signal's handler (hurry) runs in this, the main, thread
        self._http.refuse_new_requests()  # before the listener closes: a refused connect means refusing
        self._http.stop_accepting()
        grpc_done = None
        if self._grpc is not None:
            grpc_done = self._grpc.stop(grace=max(0.0, end - time.monotonic()))
        if not self._http.wait_requests(end):
            log.warning("model server: HTTP connections still open at the end of the grace period")
        if grpc_done is not None:
            grpc_done.wait(max(0.0, end - time.monotonic()))
        self.batcher.stop(max(0.0, end - time.monotonic()))
        self.model.stop()
        self._http.server_close()
