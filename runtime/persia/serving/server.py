"""The model server: HTTP/JSON and gRPC in front of the batcher and the predictor (answers to
failures: :mod:`persia.serving.answers`)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from persia.data_loader.batch import PersiaBatch
from persia.serving.answers import ServeError, classify
from persia.serving.batcher import Batcher
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
                                on_load=self._on_model_load)
        self.predictor = Predictor(config.embedding_workers, self.model, config.max_batch_size,
                                   on_model_call=self.metrics.batch_size.observe)
        self.batcher = Batcher(self.predictor.run, config.max_batch_size, config.max_latency_ms / 1000.0,
                               config.max_queue, config.workers, on_batch=self._on_batch)
        self.model.start()
        from persia.serving.http_api import start_http

        self._http = start_http(self, config.host, config.http_port)
        self.http_port = self._http.server_address[1]
        self._grpc = None
        self.grpc_port = None
        if config.grpc_port is not None:
            from persia.serving.grpc_api import start_grpc

            self._grpc, self.grpc_port = start_grpc(self, config.host, config.grpc_port)
        log.info("model server: HTTP on %s:%d, gRPC on %s", config.host, self.http_port,
                 f"{config.host}:{self.grpc_port}" if self.grpc_port else "off")

    def _on_model_load(self, ok: bool) -> None:
        self.metrics.model_loads.labels(result="ok" if ok else "failed").inc()
        if ok:
            self.metrics.model_loaded.set(time.time())

    def _on_batch(self, samples: int) -> None:
        self.metrics.queue_depth.set(self.batcher.depth())

    def predict(self, batch: PersiaBatch, protocol: str, timeout_s: float | None = None) -> np.ndarray:
        """Output rows for one request; raises ServeError. Records the request's metrics.

        The request has ``request_timeout_s`` (or the caller's ``timeout_s``, a gRPC deadline, if
        shorter); its embedding lookup gets what is left of that. A request not answered in time
        is cancelled: it is answered 504 and, if it has not started, never runs."""
        t0 = time.monotonic()
        code = 200
        limit = self.config.request_timeout_s if timeout_s is None else min(timeout_s, self.config.request_timeout_s)
        deadline = t0 + limit
        try:
            fut = self.batcher.submit(batch, deadline)
            self.metrics.queue_depth.set(self.batcher.depth())
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
        ok, why = self.predictor.readiness()
        self.metrics.ready.set(1.0 if ok else 0.0)
        return ok, why

    def live(self) -> tuple[bool, str]:
        return (True, "live") if self.batcher.alive() else (False, "batcher thread died")

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait()
        self.batcher.stop()
        self.model.stop()
