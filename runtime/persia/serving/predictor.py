"""One model batch: merged requests -> embedding lookup on the inference workers -> jit model."""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np
import torch

from persia.data_loader.batch import PersiaBatch
from persia.errors import RemoteError
from persia.nn_worker.infer_ctx import InferCtx
from persia.serving.model import DenseModel
from persia.serving.request import RequestError, merge, split


class ModelNotLoaded(RuntimeError):
    """No model file could be loaded yet (answered 503)."""


class Predictor:
    def __init__(self, embedding_workers: list[str], model: DenseModel):
        # InferCtx is used as an object, never entered: lookups and tensors only, no context stack.
        self.ctx = InferCtx(list(embedding_workers))
        self.model = model
        self._ready_at = 0.0
        self._ready: tuple[bool, str] = (False, "not checked yet")
        self._ready_lock = threading.Lock()

    def _predict(self, batch: PersiaBatch) -> np.ndarray:
        model = self.model.current()
        if model is None:
            raise ModelNotLoaded(self.model.last_error or "no model loaded")
        training_batch = self.ctx.get_embedding_from_data(batch)
        non_id, emb, _ = self.ctx.prepare_features(training_batch)
        with torch.no_grad():
            out = model(non_id, emb)
        out = out.detach().float().cpu().numpy()
        return out.reshape(-1, 1) if out.ndim == 1 else out

    def run(self, batches: Sequence[PersiaBatch]) -> list[np.ndarray]:
        """Outputs of ``batches`` run as one model batch. A request the embedding worker refuses
        (an unknown slot) fails alone: the batch is then rerun request by request."""
        try:
            return split(self._predict(merge(batches)), [b.batch_size for b in batches])
        except RemoteError as exc:
            if exc.kind != "INVALID_ARGUMENT":
                raise
            if len(batches) == 1:
                raise RequestError("id_type_features", exc.remote_message) from None
        out = []
        for b in batches:
            try:
                out.append(self._predict(b))
            except RemoteError as exc:
                if exc.kind != "INVALID_ARGUMENT":
                    raise
                out.append(RequestError("id_type_features", exc.remote_message))
        return out

    def readiness(self, max_age_s: float = 1.0) -> tuple[bool, str]:
        """(ready, why): a model is loaded and every embedding worker can look up: its PS replicas
        answer, each the replica its position says (cached ``max_age_s``)."""
        with self._ready_lock:
            if time.monotonic() - self._ready_at < max_age_s:
                return self._ready
            if self.model.current() is None:
                self._ready = (False, self.model.last_error or "no model loaded")
            else:
                self._ready = (True, "ready")
                for client in self.ctx._workers:
                    try:
                        answer = client.call("Ready", None, timeout=3.0)
                    except Exception as exc:  # noqa: BLE001
                        self._ready = (False, f"embedding worker {client.address}: {exc}")
                        break
                    if not answer["ready"]:
                        self._ready = (False, f"embedding worker {client.address}: {answer['why']}")
                        break
            self._ready_at = time.monotonic()
            return self._ready
