"""One model batch: merged requests -> embedding lookup on the inference workers -> jit model."""

from __future__ import annotations

import re
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from persia.data_loader.batch import PersiaBatch
from persia.errors import RemoteError
from persia.nn_worker.infer_ctx import InferCtx
from persia.serving.model import DenseModel
from persia.serving.request import RequestError, describe, merge, rows, signature, split

#: what torch says when a model gets tensors of shapes (or a number of them) it does not take
_SHAPE_ERROR = re.compile(r"shape|size|dimension|index out of range|expected \d+ elements|mat1 and mat2|must match",
                          re.IGNORECASE)
_NOT_SHAPE = re.compile(r"memory|allocat|cuda|device", re.IGNORECASE)
#: input layouts remembered per model as having worked (to tell a request's mistake from the server's)
_KNOWN_INPUTS = 16


class ModelNotLoaded(RuntimeError):
    """No model file could be loaded yet (answered 503)."""


class ModelInputError(ValueError):
    """The model refused the request's features (answered 400 with what the model was served)."""


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


class Predictor:
    """``run(batches, deadline)``: one model batch. ``max_batch_size``: samples per model call (a
    larger request runs in chunks); ``on_model_call(samples)``: before each model call."""

    def __init__(self, embedding_workers: list[str], model: DenseModel, max_batch_size: int | None = None,
                 on_model_call: Callable[[int], None] | None = None):
        # InferCtx is used as an object, never entered: lookups and tensors only, no context stack.
        self.ctx = InferCtx(list(embedding_workers))
        self.model = model
        self.max_batch_size = max_batch_size
        self._on_model_call = on_model_call
        self._ready_at = 0.0
        self._ready: tuple[bool, str] = (False, "not checked yet")
        self._ready_lock = threading.Lock()
        self._known_lock = threading.Lock()
        self._known: tuple[object, dict] = (None, {})  # (model, input signatures it has taken)

    @staticmethod
    def _time_left(deadline: float | None) -> float:
        if deadline is None:
            return 60.0
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed before its embedding lookup")
        return left

    def _known_inputs(self, model) -> dict:
        with self._known_lock:
            if self._known[0] is not model:  # a reloaded model may take other inputs
                self._known = (model, {})
            return self._known[1]

    def _model_error(self, exc: RuntimeError, batch: PersiaBatch, model) -> BaseException:
        """A model call's error as the request's fault (400) or the server's (the error, 500).

        Only shape errors can be the request's: a missing slot, another dense width. They are not
        when a request of the same layout (slots, dense names and widths) went through this model
        before: then the shapes came from the server (the embedding workers' config does not match
        the model, a bug) and the error stays a 500. Until a first request has gone through, a
        shape error is answered 400; its message says so if the server could be at fault."""
        text = _last_line(exc)  # the error itself, not the TorchScript code listing above it
        if not _SHAPE_ERROR.search(text) or _NOT_SHAPE.search(text):
            return exc
        sig = signature(batch)
        known = self._known_inputs(model)
        if sig in known:
            return exc
        if known:
            hint = f"this model serves requests with {describe(next(iter(known)))}"
        else:
            hint = ("no request has gone through this model yet: check the request's slots (in training order) "
                    "and dense widths, or that the embedding workers' slots config matches the model")
        return ModelInputError(f"the model does not take this request's features, {describe(sig)}: "
                               f"{text} ({hint})")

    def _predict(self, batch: PersiaBatch, model, deadline: float | None) -> np.ndarray:
        if self.max_batch_size is not None and batch.batch_size > self.max_batch_size:  # one big request
            step = self.max_batch_size
            return np.concatenate([self._predict(rows(batch, i, min(i + step, batch.batch_size)), model, deadline)
                                   for i in range(0, batch.batch_size, step)])
        training_batch = self.ctx._lookup_batch(batch, timeout=self._time_left(deadline), failover=True)
        non_id, emb, _ = self.ctx.prepare_features(training_batch)
        if self._on_model_call is not None:
            self._on_model_call(batch.batch_size)
        with torch.no_grad():
            try:
                out = model(non_id, emb)
            except RuntimeError as exc:  # torch.jit.Error too
                err = self._model_error(exc, batch, model)
                if err is exc:
                    raise
                raise err from None
        out = out.detach().float().cpu().numpy()
        known = self._known_inputs(model)
        with self._known_lock:
            if len(known) < _KNOWN_INPUTS:
                known.setdefault(signature(batch), True)
        return out.reshape(-1, 1) if out.ndim == 1 else out

    def run(self, batches: Sequence[PersiaBatch], deadline: float | None = None) -> list:
        """Outputs of ``batches`` run as one model batch, with one model version for all of it (a
        reload swaps in between batches). ``deadline`` (``time.monotonic()``) bounds the
        embedding lookups. A request the embedding worker refuses (an unknown slot) fails alone:
        the batch is then rerun request by request. Features the model does not take fail the
        whole batch: its requests share one layout (slots, dense names and widths)."""
        model = self.model.current()
        if model is None:
            raise ModelNotLoaded(self.model.last_error or "no model loaded")
        try:
            return split(self._predict(merge(batches), model, deadline), [b.batch_size for b in batches])
        except RemoteError as exc:
            if exc.kind != "INVALID_ARGUMENT":
                raise
            if len(batches) == 1:
                raise RequestError("id_type_features", exc.remote_message) from None
        out = []
        for b in batches:
            try:
                out.append(self._predict(b, model, deadline))
            except RemoteError as exc:
                if exc.kind != "INVALID_ARGUMENT":
                    raise
                out.append(RequestError("id_type_features", exc.remote_message))
            except ModelInputError as exc:
                out.append(exc)
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
