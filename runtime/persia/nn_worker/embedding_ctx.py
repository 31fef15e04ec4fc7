"""The NN worker's embedding context: discovers embedding workers and PS replicas, looks
embeddings up and turns looked-up batches into torch tensors (``prepare_features``/``forward``)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any

import numpy as np
import torch

from persia import env
from persia.bus import NatsBus, shared_bus, subject
from persia.context import BaseCtx, cnt_ctx, ctx_stack
from persia.data_loader.batch import PersiaBatch
from persia.data_loader.wire import id_features_to_wire
from persia.embedding_worker.service import SERVICE as WORKER_SERVICE
from persia.embedding_worker.service import discover
from persia.errors import BatchLost, PersiaError, RemoteError, TooManyWaiting, answered_with
from persia.nn_worker import embedding_tensors
from persia.nn_worker.checkpoint import EmbeddingCheckpoints
from persia.nn_worker.denormals import FlushDenormals
from persia.nn_worker.embedding_config import EmbeddingConfig, get_default_embedding_config
from persia.nn_worker.staleness import RampedStalenessBound, staleness_bound
from persia.nn_worker.training_batch import PersiaTrainingBatch
from persia.messages import NoPayload
from persia.rpc import Client
from persia.utils import embedding_seed

log = logging.getLogger(__name__)


class PreprocessMode(Enum):
    TRAIN = 1
    EVAL = 2
    INFERENCE = 3


def inherited_device_id(device_id: int | None, enclosing: BaseCtx | None) -> int | None:
    """The device of a new embedding context: ``device_id`` when given, else the enclosing context's.

    PERSIA's device is process-wide (its Rust context is a singleton), so ``eval_ctx(model=m)``
    opened inside a CUDA ``TrainCtx`` evaluates on that GPU. Without this it moved the model to
    the CPU, and training after a mid-epoch evaluation failed with a device mismatch.
    """
    if device_id is not None or enclosing is None:
        return device_id
    return enclosing.device_id


LOOP_CLOSE_WAIT_S = 30.0  # how long a context's exit waits for the lookups of a loop left early


class EmbeddingCtx(EmbeddingCheckpoints, BaseCtx):
    """Looks embeddings up and prepares tensors for ``model(non_id_tensors, embedding_tensors)``."""

    is_training = False

    def __init__(
        self,
        preprocess_mode: PreprocessMode,
        model: torch.nn.Module | None = None,
        embedding_config: EmbeddingConfig | None = None,
        *args,
        discovery_deadline_s: float = 600.0,
        **kwargs,
    ):
        device_id = args[1] if len(args) > 1 else kwargs.pop("device_id", None)  # BaseCtx's 2nd argument
        self._denormals = FlushDenormals()  # reads PERSIA_FLUSH_DENORMAL now: a bad value fails here
        super().__init__(*args[:1], device_id=inherited_device_id(device_id, cnt_ctx()), **kwargs)
        self.preprocess_mode = preprocess_mode
        self.model = model
        self.embedding_config = embedding_config or get_default_embedding_config()
        self.discovery_deadline_s = discovery_deadline_s
        self.bus: NatsBus | None = None
        self.rank = env.get_rank() or 0
        ws = env.get_world_size()
        self.world_size = ws if ws is not None else 1
        # before anything starts: a data loader would divide by this world size, in its own process
        env.check_replica(self.rank, self.world_size, "NN worker (env RANK, WORLD_SIZE)")
        self._workers: list[Client] | None = None
        self._discovered: list[Client] = []  # the clients this context made: closed at its exit
        self._borrowed: list[Client] | None = None  # an outer context's, for as long as this one is open
        self._rr = 0
        self._rr_lock = threading.Lock()
        self._dump_thread: threading.Thread | None = None
        self._dump_error: BaseException | None = None
        self._load_thread: threading.Thread | None = None
        self._load_error: BaseException | None = None
        self._permits: RampedStalenessBound | None = None  # _training_permits
        self._nn_info_sub = None
        self._live_loaders: weakref.WeakSet = weakref.WeakSet()  # DataLoader loops, closed at exit
        self._spans: list = []

    def __enter__(self):
        self._spans = self._entry_spans()
        for span in self._spans:
            span.start()
        try:
            return super().__enter__()
        except BaseException:
            self._stop_spans()
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            self._stop_spans()

    def _entry_spans(self) -> list:
        """Process settings this context holds from its entry to its exit (``start()``, ``stop()``):
        the outermost NN worker context flushes denormals on its thread (an eval_ctx inside a
        TrainCtx finds it done); threads it starts inherit the setting."""
        return [self._denormals] if self._outermost() else []

    def _stop_spans(self) -> None:
        spans, self._spans = self._spans, []
        for span in reversed(spans):
            span.stop()

    # -- discovery --------------------------------------------------------------------------------
    def _enter(self) -> None:
        if self.bus is None:
            self.bus = shared_bus()
        if self._workers is None:  # nested in a context that found the workers already: share them
            parent = next((c for c in reversed(ctx_stack()) if isinstance(c, EmbeddingCtx) and c._workers), None)
            if parent is not None:
                self._workers = self._borrowed = parent._workers
        if self.model is not None:
            self.model.to(self.device)

    def _exit(self, exc: BaseException | None) -> None:
        for loop in list(self._live_loaders):  # a loop left early: its threads end, its batches counted
            loop.close()
            if not loop.wait_closed(LOOP_CLOSE_WAIT_S):
                log.warning("a DataLoader loop left early still had lookups running after %gs at the context's "
                            "exit; their batches are counted when they end", LOOP_CLOSE_WAIT_S)
        try:
            self._finish_background(exc)
        finally:
            streamed = self._nn_info_sub is not None
            if self._nn_info_sub is not None:
                self.bus.unsubscribe(self._nn_info_sub)
                self._nn_info_sub = None
            self._close_discovered()
            if streamed and self._leaves_for_good(exc) and self._outermost():
                self._say_done()

    def _leaves_for_good(self, exc: BaseException | None) -> bool:
        """Whether this context's end is one its data loaders may stop waiting for: not after a
        failure (the rank may be restarted in place and resume; its loaders wait for it)."""
        return exc is None

    def _outermost(self) -> bool:
        """No other NN-worker context encloses this one (it need not be on the stack yet)."""
        return not any(isinstance(c, EmbeddingCtx) and c is not self for c in ctx_stack())

    def _say_done(self) -> None:
        """``nn.done``: data loaders still holding an end of stream for this rank need not wait
        for an answer, and a send to it fails after their ``trainer_grace_s`` if no later context
        of the process answers (``persia.data_loader.trainers``)."""
        try:
            self.bus.publish(subject("nn", "done"), {"rank": self.rank})
        except Exception:  # noqa: BLE001 - best effort: they give up after 30 s otherwise
            pass

    def _close_discovered(self) -> None:
        """Close the embedding-worker channels this context discovered (one TCP connection and
        channel state each, for as long as the context object lives); a context used again after
        its exit discovers the workers afresh. Clients shared from an outer context stay open."""
        made, self._discovered = self._discovered, []
        if self._workers is not None and (self._workers is made or self._workers is self._borrowed):
            self._workers = None
        self._borrowed = None
        for client in made:
            client.close()

    def _start_streaming(self) -> None:
        """Answer the data loaders' NN-worker discovery (``nn.info``). Every context that consumes
        a StreamingDataset must (eval_ctx and InferCtx too), or no data loader ever connects."""
        if self.bus is None:
            self.bus = shared_bus()
        if self._nn_info_sub is None:
            if self._outermost():
                # what a loader says once it has its answer (an end of stream, its failure) may
                # come before this context opens its loop: the stream state it is for, and its
                # route, exist first (it went to the previous context's state, or to nobody, and
                # the loop waited out its timeout)
                from persia.nn_worker.datasets import _stream_state, route_ends

                _stream_state(self.rank, self)
                route_ends(self.bus, self.rank)
            self._nn_info_sub = self.bus.serve(subject("nn", "info"), self._info,
                                               queue="nn", blocking=False, schema=NoPayload)
            self.bus.flush()

    def _info(self, _req) -> dict:
        """``nn.info``: what a data loader needs (TrainCtx adds where to resume its stream)."""
        return {"world_size": self.world_size}

    def _stream_clients(self) -> list[Client]:
        """Embedding-worker clients indexed as data loaders index them (by replica index)."""
        return self._worker_clients()

    def _worker_clients(self) -> list[Client]:
        if self._workers is None:  # looked up from pool threads too: the parent was taken at _enter
            entries = discover(self.bus, "ew", self.discovery_deadline_s)
            self._workers = self._discovered = [Client(e["address"], WORKER_SERVICE) for e in entries]
        return self._workers

    def _ps_count(self) -> int:
        info = self.bus.request_retry(subject("ps", "info"), None, deadline_s=self.discovery_deadline_s,
                                      timeout=2.0, what="discovering PS replicas")
        return int(info["replica_size"])

    def _ps_all(self, method: str, payload: Any, timeout: float = 3600.0) -> list[Any]:
        """Call ``method`` on every PS replica in parallel; raise the first failure."""
        n = self._ps_count()
        with ThreadPoolExecutor(max_workers=min(n, 16), thread_name_prefix="persia-ps-all") as pool:
            futs = [
                pool.submit(self.bus.request_retry, subject("ps", method, i), payload,
                            deadline_s=timeout, timeout=timeout, retry_busy=True, what=f"PS {i} {method}")
                for i in range(n)
            ]
            return [f.result() for f in futs]

    # -- lookups ----------------------------------------------------------------------------------
    def _training_permits(self, target: int | None, warmup_steps: int, step: int,
                          cond: threading.Condition | None) -> RampedStalenessBound | None:
        """The context's staleness permits, bounded as a new training loop asks (None: no bound
        yet, and this loop asks for none). One for the context's life, not one per loop: the last
        loop's updates not applied yet hold permits, released here when they are, and the new
        loop's lookups wait for them as its bound says. A bound per loop got those releases
        without having given the permits out: it raised (silently, from the flusher), or counted
        free a permit that one of its own lookups held."""
        if self._permits is None:
            self._permits = staleness_bound(target, warmup_steps, step, cond)
        else:
            self._permits.retarget(target, warmup_steps, step)
        return self._permits

    def _call_worker(self, worker: int, method: str, request: dict, deadline_s: float = 600.0) -> Any:
        """``method`` on embedding worker ``worker``. Asked again while it answers that too many
        lookups wait for their ID features already (it answers so before doing anything)."""
        end = time.monotonic() + deadline_s
        backoff = 0.002
        while True:
            try:
                return self._stream_clients()[worker].call(method, request)
            except RemoteError as exc:
                if not answered_with(exc, TooManyWaiting) or time.monotonic() + backoff > end:
                    raise
            time.sleep(backoff)  # back-off: the waiting lookups end within the worker's lookup wait
            backoff = min(0.1, backoff * 2)

    def _lookup_call(self, worker: int, msg: dict, transferred=None) -> dict:
        """The lookup of a streamed batch (TrainCtx adds earlier batches' gradients to it)."""
        # train=False: an eval/infer context never creates rows, whatever the batch asked for
        return self._call_worker(worker, "Lookup", {"ref": int(msg["ref"]), "train": self.is_training})

    def _lookup_message(self, msg: dict, holds_permit: bool, transferred=None) -> PersiaTrainingBatch:
        """``transferred``: an update whose staleness permit this lookup takes over (TrainCtx)."""
        worker = int(msg["worker"])
        try:
            resp = self._lookup_call(worker, msg, transferred)
        except BaseException as exc:
            failed = self._lookup_failed(msg, holds_permit, exc)
            if failed is exc:
                raise
            raise failed from None
        return self._training_batch(msg, holds_permit, resp)

    def _lookup_group_size(self) -> int:
        """Batches a training stream's dispatcher looks up per call (TrainCtx decides)."""
        return 1

    def _lookup_messages(self, msgs: list[dict], holds_permit: list[bool], transferred: list) -> list:
        """Several streamed batches of one embedding worker looked up (TrainCtx: in one call);
        each one's batch, or the error it alone failed with."""
        out: list = []
        for msg, holds, moved in zip(msgs, holds_permit, transferred):
            try:
                out.append(self._lookup_message(msg, holds, moved))
            except BaseException as exc:  # noqa: BLE001 - that batch's future raises it
                out.append(exc)
        return out

    def _lookup_failed(self, msg: dict, holds_permit: bool, exc: BaseException) -> BaseException:
        """A batch's lookup failed: its staleness permit goes back, and a batch whose ID features
        will never come is a BatchLost naming its loader (counted and skipped, not fatal)."""
        if holds_permit and self._permits is not None:
            self._permits.release()
        if answered_with(exc, BatchLost):
            return BatchLost(f"batch {msg['batch_id']} of data loader {msg.get('loader', 0)}: its ID features "
                             f"never reached embedding worker {int(msg['worker'])}: {exc.remote_message}",
                             loader=int(msg["loader"]) if msg.get("loader") is not None else None)
        return exc

    def _training_batch(self, msg: dict, holds_permit: bool, resp: dict) -> PersiaTrainingBatch:
        worker = int(msg["worker"])
        return PersiaTrainingBatch(
            non_id_type_features=[f["data"] for f in msg["non_id"]],
            non_id_type_feature_names=[f["name"] for f in msg["non_id"]],
            labels=[f["data"] for f in msg["labels"]],
            label_names=[f["name"] for f in msg["labels"]],
            embeddings=resp["slots"],
            emb_tables=resp["tables"],
            meta=msg.get("meta"),
            batch_id=int(msg["batch_id"]),
            ref=int(msg["ref"]),
            worker=worker,
            loader=int(msg["loader"]) if msg.get("loader") is not None else None,
            requires_grad=bool(msg.get("requires_grad", True)) and self.is_training,
            holds_permit=holds_permit,
            replay=resp.get("replay"),
        )

    def _next_worker(self) -> Client:
        workers = self._worker_clients()
        with self._rr_lock:
            self._rr = (self._rr + 1) % len(workers)
            return workers[self._rr]

    def _lookup_batch(self, batch: PersiaBatch, timeout: float = 60.0, failover: bool = False) -> PersiaTrainingBatch:
        """Direct lookup of a local batch (eval/infer datasets): never creates or trains rows.

        ``timeout``: seconds for the whole lookup (a worker that does not answer in time fails it
        with DEADLINE_EXCEEDED). ``failover`` (the model server): a worker answering UNAVAILABLE
        (down, unreachable) is left for the next one in the list, and so on through every worker,
        with the time left, instead of failing the batch: one worker that answers serves them all."""
        request = {"batch_size": batch.batch_size, "features": id_features_to_wire(batch)}
        end = time.monotonic() + timeout
        worker = self._next_worker()
        workers = self._worker_clients()
        start = workers.index(worker)
        for attempt in range(len(workers)):
            worker = workers[(start + attempt) % len(workers)]
            left = end - time.monotonic()
            try:
                resp = worker.call("LookupDirect", request, timeout=timeout if attempt == 0 else left)
                break
            except RemoteError as exc:
                last = attempt == len(workers) - 1
                if not failover or exc.kind != "UNAVAILABLE" or last or end - time.monotonic() <= 0:
                    raise
                log.info("embedding worker %s unavailable, looking up on %s: %s", worker.address,
                         workers[(start + attempt + 1) % len(workers)].address, exc.remote_message)
        return PersiaTrainingBatch(
            non_id_type_features=[np.asarray(f.data) for f in batch.non_id_type_features],
            non_id_type_feature_names=[f.name for f in batch.non_id_type_features],
            labels=[np.asarray(f.data) for f in (batch.labels or [])],
            label_names=[f.name for f in (batch.labels or [])],
            embeddings=resp["slots"],
            emb_tables=resp["tables"],
            meta=batch.meta,
            batch_id=batch.batch_id,
        )

    def _dispatched(self, msg: dict, staleness_target: int | None) -> dict:
        """A streamed batch's message as its lookup is dispatched (TrainCtx notes which of its
        updates every PS replica has applied by then)."""
        return msg

    def _release_refs(self, msgs: list[dict]) -> None:
        by_worker: dict[int, list[int]] = {}
        for m in msgs:
            by_worker.setdefault(int(m["worker"]), []).append(int(m["ref"]))
        for w, refs in by_worker.items():
            try:
                self._stream_clients()[w].call("Release", {"refs": refs})
            except Exception as exc:  # noqa: BLE001
                log.warning("could not release %d batches on embedding worker %d: %s", len(refs), w, exc)

    def _needs_rank_agreement(self, streaming: bool) -> bool:
        return False

    def _all_ranks_have(self, have: int) -> bool:
        return bool(have)

    # -- tensors ----------------------------------------------------------------------------------
    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(arr, copy=True)).to(self.device, non_blocking=True)

    def _build_tensors(self, batch: PersiaTrainingBatch, requires_grad: bool) -> embedding_tensors.PreparedTensors:
        return embedding_tensors.PreparedTensors(
            requires_grad=requires_grad,
            non_id=[self._tensor(x) for x in batch.non_id_type_features],
            labels=[self._tensor(x) for x in batch.labels] if batch.labels else None,
            slots=embedding_tensors.build(batch.emb_tables, batch.embeddings, self.device, requires_grad),
        )

    def _prebuild(self, batch: PersiaTrainingBatch) -> None:
        """Build a looked-up batch's tensors (and its embeddings' autograd graph) in the lookup
        thread, ahead of its training step: the training thread is the pipeline's critical path.
        CPU only (a CUDA copy issued from another thread would run on that thread's stream)."""
        if self.device.type == "cpu":
            batch.prepared = self._build_tensors(batch, batch.requires_grad and self.is_training)

    def prepare_features(self, persia_training_batch: PersiaTrainingBatch):
        """``(non_id_type_feature_tensors, id_type_feature_embedding_tensors, label_tensors)``.

        Summed slots give float32 ``(bs, dim)``; raw slots give ``(bs, sample_fixed_size, dim+1)``
        whose last channel is the mask, as in PERSIA.
        """
        batch = persia_training_batch
        # a batch already trained (or let go) is only evaluated when forwarded again
        requires_grad = batch.requires_grad and self.is_training and batch.settled is None
        built, batch.prepared = batch.prepared, None  # tensors built ahead serve one forward
        if built is None or built.requires_grad != requires_grad or (requires_grad and not torch.is_grad_enabled()):
            built = self._build_tensors(batch, requires_grad)
        if requires_grad and self._current_batch is batch and batch.emb_leaves:
            batch.earlier_leaves.append((batch.emb_leaves, batch.slot_used))  # its backward reads both
        batch.emb_leaves, batch.slot_used = built.slots.leaves, built.slots.used
        if requires_grad:
            self._current_batch = batch
        return built.non_id, built.slots.emb, built.labels

    def forward(self, batch: PersiaTrainingBatch):
        """``(model_output, label_tensors)``, PERSIA's contract."""
        if self.model is None:
            raise PersiaError(f"{type(self).__name__} has no model: pass model=... to use forward()")
        non_id, emb, labels = self.prepare_features(batch)
        return self._run_model(non_id, emb), labels

    def _run_model(self, non_id, emb):
        return self.model(non_id, emb)

    # -- direct embedding access ------------------------------------------------------------------
    def _check_device_id(self, device_id: int | None) -> None:
        """PERSIA's per-call ``device_id``: the batch's tensors are built on the context's device
        (``prepare_features``), so another device is refused rather than ignored."""
        if device_id is not None and device_id != self.device_id:
            raise ValueError(f"device_id={device_id!r}: this context's tensors go to {self.device} (its device_id "
                             f"{self.device_id!r}); create the context with device_id={device_id!r} instead")

    def get_embedding_from_data(self, persia_batch: PersiaBatch, device_id: int | None = None) -> PersiaTrainingBatch:
        self._check_device_id(device_id)
        return self._lookup_batch(persia_batch)

    def get_embedding_from_bytes(self, data: bytes, device_id: int | None = None) -> PersiaTrainingBatch:
        self._check_device_id(device_id)
        return self._lookup_batch(PersiaBatch.from_bytes(data))

    def get_embedding_size(self) -> list[int]:
        return [int(s["rows"]) for s in self._ps_all("stats", None, timeout=60)]

    def clear_embeddings(self) -> None:
        self._ps_all("clear", None, timeout=60)
        self._embeddings_replaced()

    def _embeddings_replaced(self) -> None:
        """Every PS replica's rows were cleared or loaded (TrainCtx: its updates start over)."""

    # -- PERSIA's server controls -----------------------------------------------------------------
    def configure_embedding_parameter_servers(self, embedding_config: EmbeddingConfig | None = None) -> None:
        """Push embedding hyperparameters (default: this context's) to every PS; TrainCtx does it
        on entry."""
        configure_embedding_parameter_servers(self, embedding_config or self.embedding_config)

    def wait_servers_ready(self) -> None:
        """Block until the embedding workers and every PS replica answer (or the discovery
        deadline passes, with an error naming who is missing)."""
        self._worker_clients()
        self._ps_all("stats", None, timeout=self.discovery_deadline_s)


def eval_ctx(*args, **kwargs) -> EmbeddingCtx:
    """Evaluation: lookups never create rows; nothing is trained."""
    return EmbeddingCtx(PreprocessMode.EVAL, *args, **kwargs)


def configure_embedding_parameter_servers(ctx: EmbeddingCtx, config: EmbeddingConfig) -> None:
    """Push ``config`` to every PS (what ``EmbeddingCtx.configure_embedding_parameter_servers`` does)."""
    lower, upper = config.emb_initialization
    ctx._ps_all("configure", {"init_lower": float(lower), "init_upper": float(upper),
                              "admit_probability": float(config.admit_probability),
                              "weight_bound": float(config.weight_bound),
                              "seed": embedding_seed(config.seed)}, timeout=120)


def register_optimizer_on_all_ps(optimizer, ctx: EmbeddingCtx | None = None) -> None:
    ctx = ctx or cnt_ctx()
    if not isinstance(ctx, EmbeddingCtx):
        ctx = EmbeddingCtx(PreprocessMode.TRAIN)
        ctx._enter()
    ctx._ps_all("register_optimizer", optimizer.to_wire(), timeout=120)

