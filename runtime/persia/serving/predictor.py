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


def _list_reads(graph_input) -> int | None:
    """How many elements of a ``List[Tensor]`` graph input the model reads: one past the highest
    constant index it takes (``xs[0]``, ``xs[2]``), or the count a ``prim::ListUnpack`` unpacks.
    None when it reads the list in another way (a loop, ``len``, a computed or negative index,
    passing it on whole): then any length may be meant, and nothing is checked."""
    top = -1
    for use in graph_input.uses():
        node = use.user
        if node.kind() == "prim::ListUnpack":
            return len(list(node.outputs()))
        if node.kind() != "aten::__getitem__" or use.offset != 0:
            return None
        index = list(node.inputs())[1]
        if index.node().kind() != "prim::Constant":
            return None
        value = index.toIValue()
        if not isinstance(value, int) or value < 0:
            return None
        top = max(top, value)
    return top + 1


def model_reads(model) -> tuple[int | None, int | None]:
    """(dense features, ID slots) a TorchScript ``forward(non_id: List[Tensor], emb: List[Tensor])``
    reads, each None when its graph does not say (:func:`_list_reads`; not a TorchScript module, or
    another signature). The jitted model's signature does not bound the lists; its graph does."""
    try:
        inputs = list(model.inlined_graph.inputs())
    except Exception:  # noqa: BLE001 - not a TorchScript module (a test's callable): nothing known
        return None, None
    if len(inputs) != 3 or any(str(i.type()) != "List[Tensor]" for i in inputs[1:]):
        return None, None
    try:
        return _list_reads(inputs[1]), _list_reads(inputs[2])
    except Exception:  # noqa: BLE001 - a graph shape this reading does not know: check nothing
        return None, None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _indices(name: str, n: int) -> str:
    return f"{name}[0]" if n == 1 else f"{name}[0..{n - 1}]"


def extra_features(batch: PersiaBatch, reads: tuple[int | None, int | None]) -> RequestError | None:
    """The first feature of ``batch`` beyond what the model reads (``reads``: :func:`model_reads`),
    as a RequestError naming it; None when there is none (or the model's graph does not say)."""
    dense_n, slots_n = reads
    dense = [p.name for p in batch.non_id_type_features]
    slots = [f.name for f in batch.id_type_features]
    if dense_n is not None and len(dense) > dense_n:
        return RequestError(f"non_id_type_features.{dense[dense_n]}",
                            f"the model does not take this dense feature: it reads "
                            f"{_plural(dense_n, 'dense feature')} ({_indices('non_id', dense_n)}), in the order "
                            f"sent, and this request sends {len(dense)}: {dense}"
                            if dense_n else f"the model does not take this dense feature: it reads no dense "
                                            f"features, and this request sends {len(dense)}: {dense}")
    if slots_n is not None and len(slots) > slots_n:
        return RequestError(f"id_type_features.{slots[slots_n]}",
                            f"the model does not take this ID slot: it reads {_plural(slots_n, 'ID slot')} "
                            f"({_indices('emb', slots_n)}), in the order sent, and this request sends {len(slots)}: "
                            f"{slots}" if slots_n else f"the model does not take this ID slot: it reads no "
                                                       f"embeddings, and this request sends {len(slots)}: {slots}")
    return None


def slot_error(batch: PersiaBatch, message: str) -> RequestError:
    """The embedding worker's refusal of ``batch``'s slots (INVALID_ARGUMENT), naming the slot it
    does not know when its message names one of the request's slots."""
    for f in batch.id_type_features:
        if f"unknown slot {f.name!r}" in message:
            return RequestError(f"id_type_features.{f.name}", message)
    return RequestError("id_type_features", message)


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
        self._reads: tuple[object, tuple] = (None, (None, None))  # (model, model_reads(model))
        # the first sample of the last model call that went through: (signature, non_id, emb), the
        # inputs a reloaded model must take (check_reload)
        self._probe: tuple | None = None
        #: address -> whether its Ready answered ready at the last readiness check
        self.worker_ready: dict[str, bool] = {}

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

    def _model_reads(self, model) -> tuple[int | None, int | None]:
        with self._known_lock:
            if self._reads[0] is not model:
                self._reads = (model, model_reads(model))
            return self._reads[1]

    def _keep_probe(self, sig, non_id: list, emb: list) -> None:
        if self._probe is not None and self._probe[0] == sig:
            return
        if not all(isinstance(t, torch.Tensor) for t in [*non_id, *emb]):
            return
        self._probe = (sig, [t[:1].clone() for t in non_id], [t[:1].clone() for t in emb])

    def check_reload(self, candidate) -> str | None:
        """Why ``candidate`` (a model just loaded to replace the one served) must not be swapped in,
        or None. It must take what the served model takes: the first sample of the last request
        that went through (its embeddings as the embedding workers serve them), without an error,
        and read every feature that request sent (:func:`model_reads`). Before any request went
        through, nothing is known, and any model is taken."""
        probe = self._probe
        if probe is None:
            return None
        sig, non_id, emb = probe
        dense_n, slots_n = model_reads(candidate)
        if dense_n is not None and dense_n < len(non_id) or slots_n is not None and slots_n < len(emb):
            return (f"it reads {_plural(dense_n if dense_n is not None else len(non_id), 'dense feature')} and "
                    f"{_plural(slots_n if slots_n is not None else len(emb), 'ID slot')}, but the requests served "
                    f"send {describe(sig)}: each of them would be refused")
        try:
            with torch.no_grad():
                candidate(list(non_id), list(emb))
        except Exception as exc:  # noqa: BLE001 - torch.jit.Error too
            return (f"it fails on a request the served model answered ({describe(sig)}, with the embedding "
                    f"workers' dims {[tuple(t.shape[1:]) for t in emb]}): {_last_line(exc)}")
        return None

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
        sig = signature(batch)
        self._keep_probe(sig, non_id, emb)
        known = self._known_inputs(model)
        with self._known_lock:
            if len(known) < _KNOWN_INPUTS:
                known.setdefault(sig, True)
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
        reads = self._model_reads(model)
        if extra_features(batches[0], reads) is not None:  # one signature: every request sends the same
            return [extra_features(b, reads) for b in batches]
        try:
            return split(self._predict(merge(batches), model, deadline), [b.batch_size for b in batches])
        except RemoteError as exc:
            if exc.kind != "INVALID_ARGUMENT":
                raise
            if len(batches) == 1:
                raise slot_error(batches[0], exc.remote_message) from None
        out = []
        for b in batches:
            try:
                out.append(self._predict(b, model, deadline))
            except RemoteError as exc:
                if exc.kind != "INVALID_ARGUMENT":
                    raise
                out.append(slot_error(b, exc.remote_message))
            except ModelInputError as exc:
                out.append(exc)
        return out

    def readiness(self, max_age_s: float = 1.0) -> tuple[bool, str]:
        """(ready, why): a model is loaded and every request can be looked up (cached ``max_age_s``).

        Each embedding worker is asked ``Ready`` (at once, 3 s at most): ready when its PS replicas
        answer (loaded), each the replica its position says. Those that do not answer at all
        (UNAVAILABLE: down, unreachable) are tolerated while another answers ready: the lookups
        they would get fail over through the list to one that answers. One that answers not ready,
        or does not answer in time, fails lookups without failover, so it makes the server not
        ready. ``why`` names every worker that is down (``worker_ready`` has each one's state)."""
        with self._ready_lock:
            if time.monotonic() - self._ready_at < max_age_s:
                return self._ready
            if self.model.current() is None:
                self._ready = (False, self.model.last_error or "no model loaded")
            else:
                self._ready = self._workers_ready()
            self._ready_at = time.monotonic()
            return self._ready

    def _workers_ready(self) -> tuple[bool, str]:
        workers = self.ctx._workers
        calls: list[tuple] = []  # (future, None) or (None, the error): a gRPC future is an Exception too
        for client in workers:
            try:
                calls.append((client.future("Ready", None, timeout=3.0), None))
            except Exception as exc:  # noqa: BLE001
                calls.append((None, exc))
        up: list[bool] = []
        down: dict[int, str] = {}  # not answering: its lookups fail over to the next worker
        failing: list[str] = []  # answering not ready, or too late: its lookups fail
        for i, (client, (call, error)) in enumerate(zip(workers, calls)):
            try:
                if error is not None:
                    raise error
                answer = client.result("Ready", call)
            except RemoteError as exc:
                if exc.kind == "UNAVAILABLE" and len(workers) > 1:
                    down[i] = f"{client.address}: {exc}"
                else:
                    failing.append(f"embedding worker {client.address}: {exc}")
                up.append(False)
                continue
            except Exception as exc:  # noqa: BLE001
                failing.append(f"embedding worker {client.address}: {type(exc).__name__}: {exc}")
                up.append(False)
                continue
            up.append(bool(answer["ready"]))
            if not answer["ready"]:
                failing.append(f"embedding worker {client.address}: {answer['why']}")
        self.worker_ready = {c.address: ok for c, ok in zip(workers, up)}
        if not any(up):
            if len(workers) == 1:
                return False, failing[0]
            return False, ("no embedding worker can look up: " + "; ".join(
                failing + [f"embedding worker {d}" for d in down.values()]))
        if failing:
            return False, failing[0]
        if down:  # their lookups go on through the list to one that answers
            return True, (f"ready: {sum(up)} of {len(workers)} embedding workers answer, lookups fail over "
                          f"from those down: " + "; ".join(down.values()))
        return True, "ready"
