"""PERSIA's contexts: DataCtx (data loaders), TrainCtx / eval_ctx / InferCtx (NN workers).

A context owns the process's NATS bus, discovers the embedding workers and PS replicas, and turns
looked-up batches into torch tensors. TrainCtx adds synchronous dense training (DDP) and sends
embedding gradients back asynchronously, releasing a staleness permit when the PS has applied them.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from persia import env
from persia.bus import NatsBus, shared_bus, subject
from persia.data import PersiaTrainingBatch
from persia.embedding import EmbeddingConfig, get_default_embedding_config
from persia.embedding.data import PersiaBatch
from persia.embedding_worker.service import SERVICE as WORKER_SERVICE
from persia.embedding_worker.service import discover
from persia.errors import PersiaError
from persia.rpc import Client
from persia.utils import advertise_host, find_free_port

log = logging.getLogger(__name__)

EMBEDDING_DUMP_DONE = "embedding_dump_done"
CHECKPOINT_FORMAT = "persia-k8s-checkpoint/1"

_ctx_stack: list["BaseCtx"] = []


def cnt_ctx() -> "BaseCtx | None":
    """The innermost active context (PERSIA's name)."""
    return _ctx_stack[-1] if _ctx_stack else None


def _role_name() -> str:
    rank = env.get_rank()
    if rank is not None:
        return f"nn-worker-{rank}"
    return f"data-loader-{env.get_replica_index()}"


class PreprocessMode(Enum):
    TRAIN = 1
    EVAL = 2
    INFERENCE = 3


# -- wire helpers shared by DataCtx and the direct-lookup path -------------------------------------
def id_features_to_wire(batch: PersiaBatch) -> list[dict]:
    out = []
    for f in batch.id_type_features:
        values, offsets = f.to_csr()
        out.append({"name": f.name, "values": values, "offsets": offsets})
    return out


def _named_arrays(items) -> list[dict]:
    return [{"name": x.name, "data": np.asarray(x.data)} for x in (items or [])]


class BaseCtx:
    def __init__(self, threadpool_worker_size: int = 10, device_id: int | None = None):
        if not logging.getLogger().handlers:  # a user script that set up no logging: PERSIA's default
            from persia.logger import setup_logging

            setup_logging(_role_name())
        self.threadpool_worker_size = threadpool_worker_size
        if device_id is not None:
            if not torch.cuda.is_available():
                raise ValueError(f"device_id={device_id} but CUDA is not available; pass device_id=None for CPU")
            if not 0 <= device_id < torch.cuda.device_count():
                raise ValueError(f"device_id={device_id} out of range: {torch.cuda.device_count()} GPUs visible")
            torch.cuda.set_device(device_id)
        self.device_id = device_id
        self.device = torch.device(f"cuda:{device_id}") if device_id is not None else torch.device("cpu")
        threads = os.environ.get("PERSIA_TORCH_THREADS")
        if threads:
            torch.set_num_threads(int(threads))

    def __enter__(self):
        self._enter()
        _ctx_stack.append(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            log.error("leaving %s with an exception:\n%s", type(self).__name__,
                      "".join(traceback.format_exception(exc_type, exc, tb)))
        try:
            self._exit(exc)
        finally:
            if _ctx_stack and _ctx_stack[-1] is self:
                _ctx_stack.pop()
        return False

    def _enter(self) -> None:
        pass

    def _exit(self, exc: BaseException | None) -> None:
        pass


# ---------------------------------------------------------------------------------------------------
class DataCtx(BaseCtx):
    """Sends PersiaBatch to the embedding workers (ID features) and NN workers (the rest).

    Round-robin over embedding workers; NN rank = ``batch_id % world_size`` with ``batch_id =
    counter * loader_replica_size + loader_replica_index``. Leaving the ``with`` block sends each
    NN rank an end-of-stream message carrying how many batches this loader sent it.
    """

    def __init__(self, *args, discovery_deadline_s: float = 600.0, send_deadline_s: float = 600.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.replica_index = env.get_replica_index()
        self.replica_size = env.get_replica_size()
        env.check_replica(self.replica_index, self.replica_size, "data loader")
        self.send_deadline_s = send_deadline_s
        self.bus: NatsBus = shared_bus()
        ew = self.bus.request_retry(subject("ew", "info"), None, deadline_s=discovery_deadline_s, timeout=2.0,
                                    what="waiting for embedding workers")
        self.num_embedding_workers = int(ew["replica_size"])
        nn = self.bus.request_retry(subject("nn", "info"), None, deadline_s=discovery_deadline_s, timeout=2.0,
                                    what="waiting for NN workers")
        self.world_size = int(nn["world_size"])
        self._counter = 0
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
        ref = self.bus.request_retry(
            subject("ew", "forward", worker),
            {
                "loader": self.replica_index,
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
        return self._counter

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
        log.info("data loader %d sent %d batches", self.replica_index, self._counter)

    def _exit(self, exc: BaseException | None) -> None:
        self.close(None if exc is None else f"{type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------------
class EmbeddingCtx(BaseCtx):
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
        super().__init__(*args, **kwargs)
        self.preprocess_mode = preprocess_mode
        self.model = model
        self.embedding_config = embedding_config or get_default_embedding_config()
        self.discovery_deadline_s = discovery_deadline_s
        self.bus: NatsBus | None = None
        self.rank = env.get_rank() or 0
        ws = env.get_world_size()
        self.world_size = ws if ws is not None else 1
        self._workers: list[Client] | None = None
        self._rr = 0
        self._rr_lock = threading.Lock()
        self._dump_thread: threading.Thread | None = None
        self._dump_error: BaseException | None = None
        self._load_thread: threading.Thread | None = None
        self._load_error: BaseException | None = None
        self._permits: threading.BoundedSemaphore | None = None

    # -- discovery --------------------------------------------------------------------------------
    def _enter(self) -> None:
        if self.bus is None:
            self.bus = shared_bus()
        if self.model is not None:
            self.model.to(self.device)

    def _worker_clients(self) -> list[Client]:
        if self._workers is None:
            parent = next((c for c in reversed(_ctx_stack) if isinstance(c, EmbeddingCtx) and c._workers), None)
            if parent is not None and parent is not self:
                self._workers = parent._workers
            else:
                entries = discover(self.bus, "ew", self.discovery_deadline_s)
                self._workers = [Client(e["address"], WORKER_SERVICE) for e in entries]
        return self._workers

    def _ps_count(self) -> int:
        info = self.bus.request_retry(subject("ps", "info"), None, deadline_s=self.discovery_deadline_s,
                                      timeout=2.0, what="discovering PS replicas")
        return int(info["replica_size"])

    def _ps_all(self, method: str, payload: Any, timeout: float = 3600.0) -> list[Any]:
        """Call ``method`` on every PS replica in parallel; raise the first failure."""
        n = self._ps_count()
        with ThreadPoolExecutor(max_workers=min(n, 16)) as pool:
            futs = [
                pool.submit(self.bus.request_retry, subject("ps", method, i), payload,
                            deadline_s=timeout, timeout=timeout, retry_busy=True, what=f"PS {i} {method}")
                for i in range(n)
            ]
            return [f.result() for f in futs]

    # -- lookups ----------------------------------------------------------------------------------
    def _attach_permits(self, permits) -> None:
        self._permits = permits

    def _lookup_message(self, msg: dict, holds_permit: bool) -> PersiaTrainingBatch:
        worker = int(msg["worker"])
        try:
            resp = self._worker_clients()[worker].call("Lookup", {"ref": int(msg["ref"])})
        except BaseException:
            if holds_permit and self._permits is not None:
                self._permits.release()
            raise
        return PersiaTrainingBatch(
            non_id_type_features=[f["data"] for f in msg["non_id"]],
            non_id_type_feature_names=[f["name"] for f in msg["non_id"]],
            labels=[f["data"] for f in msg["labels"]],
            label_names=[f["name"] for f in msg["labels"]],
            embeddings=resp["slots"],
            meta=msg.get("meta"),
            batch_id=int(msg["batch_id"]),
            ref=int(msg["ref"]),
            worker=worker,
            requires_grad=bool(msg.get("requires_grad", True)) and self.is_training,
            holds_permit=holds_permit,
        )

    def _next_worker(self) -> Client:
        workers = self._worker_clients()
        with self._rr_lock:
            self._rr = (self._rr + 1) % len(workers)
            return workers[self._rr]

    def _lookup_batch(self, batch: PersiaBatch) -> PersiaTrainingBatch:
        """Direct lookup of a local batch (eval/infer datasets): never creates or trains rows."""
        resp = self._next_worker().call(
            "LookupDirect", {"batch_size": batch.batch_size, "features": id_features_to_wire(batch)}
        )
        return PersiaTrainingBatch(
            non_id_type_features=[np.asarray(f.data) for f in batch.non_id_type_features],
            non_id_type_feature_names=[f.name for f in batch.non_id_type_features],
            labels=[np.asarray(f.data) for f in (batch.labels or [])],
            label_names=[f.name for f in (batch.labels or [])],
            embeddings=resp["slots"],
            meta=batch.meta,
            batch_id=batch.batch_id,
        )

    def _release_refs(self, msgs: list[dict]) -> None:
        by_worker: dict[int, list[int]] = {}
        for m in msgs:
            by_worker.setdefault(int(m["worker"]), []).append(int(m["ref"]))
        for w, refs in by_worker.items():
            try:
                self._worker_clients()[w].call("Release", {"refs": refs})
            except Exception as exc:  # noqa: BLE001
                log.warning("could not release %d batches on embedding worker %d: %s", len(refs), w, exc)

    def _release_trained_refs(self, batches: list[PersiaTrainingBatch]) -> None:
        self._release_refs([{"worker": b.worker, "ref": b.ref} for b in batches if b.ref is not None])
        for b in batches:
            if b.holds_permit and self._permits is not None:
                self._permits.release()

    def _needs_rank_agreement(self, streaming: bool) -> bool:
        return False

    def _all_ranks_have(self, have: int) -> bool:
        return bool(have)

    # -- tensors ----------------------------------------------------------------------------------
    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.array(arr, copy=True)).to(self.device, non_blocking=True)

    def prepare_features(self, batch: PersiaTrainingBatch):
        """``(non_id_type_feature_tensors, id_type_feature_embedding_tensors, label_tensors)``.

        Summed slots give float32 ``(bs, dim)``; raw slots give ``(bs, sample_fixed_size, dim+1)``
        whose last channel is the mask, as in PERSIA.
        """
        non_id = [self._tensor(x) for x in batch.non_id_type_features]
        labels = [self._tensor(x) for x in batch.labels] if batch.labels else None
        requires_grad = batch.requires_grad and self.is_training
        leaves, emb = [], []
        for slot in batch.embeddings:
            if "emb" in slot:
                leaf = self._tensor(slot["emb"]).requires_grad_(requires_grad)
                leaves.append(leaf)
                emb.append(leaf)
            else:
                leaf = self._tensor(slot["distinct"]).requires_grad_(requires_grad)
                index = torch.from_numpy(np.array(slot["index"], dtype=np.int64)).to(self.device)
                gathered = leaf[index]
                mask = (index != 0).to(gathered.dtype).unsqueeze(-1)
                leaves.append(leaf)
                emb.append(torch.cat([gathered, mask], dim=-1))
        batch.emb_leaves = leaves
        if requires_grad:
            self._current_batch = batch
        return non_id, emb, labels

    def forward(self, batch: PersiaTrainingBatch):
        """``(model_output, label_tensors)``, PERSIA's contract."""
        if self.model is None:
            raise PersiaError(f"{type(self).__name__} has no model: pass model=... to use forward()")
        non_id, emb, labels = self.prepare_features(batch)
        return self._run_model(non_id, emb), labels

    def _run_model(self, non_id, emb):
        return self.model(non_id, emb)

    # -- direct embedding access ------------------------------------------------------------------
    def get_embedding_from_data(self, persia_batch: PersiaBatch, device_id: int | None = None) -> PersiaTrainingBatch:
        return self._lookup_batch(persia_batch)

    def get_embedding_from_bytes(self, data: bytes, device_id: int | None = None) -> PersiaTrainingBatch:
        return self._lookup_batch(PersiaBatch.from_bytes(data))

    # -- checkpoints ------------------------------------------------------------------------------
    @staticmethod
    def _local_dir(path: str | os.PathLike) -> Path:
        s = str(path)
        if "://" in s and not s.startswith("file://"):
            raise ValueError(f"checkpoint directory {s!r}: only local paths are supported (no hdfs:// yet)")
        return Path(s.removeprefix("file://"))

    def _wait_for_updates(self) -> None:
        pass

    def dump_embedding(self, dst_dir: str, blocking: bool = True) -> None:
        """Every PS writes its own shard files; then a top-level done marker says the dump is whole."""
        directory = self._local_dir(dst_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self._wait_for_updates()

        def run():
            marker = directory / EMBEDDING_DUMP_DONE
            marker.unlink(missing_ok=True)
            results = self._ps_all("dump", {"dir": str(directory.resolve())})
            marker.write_text(json.dumps({
                "format": CHECKPOINT_FORMAT,
                "num_shards": len(results),
                "rows": [r["rows"] for r in results],
                "datetime": _dt.datetime.now(_dt.timezone.utc).isoformat(),
            }))

        self._run_maybe_async(run, blocking, "dump")

    def load_embedding(self, src_dir: str, blocking: bool = True) -> None:
        directory = self._local_dir(src_dir)
        marker = directory / EMBEDDING_DUMP_DONE
        if not marker.exists():
            raise FileNotFoundError(
                f"{directory}: no {EMBEDDING_DUMP_DONE} marker: not an embedding checkpoint, or its dump did not finish"
            )

        def run():
            self._ps_all("load", {"dir": str(directory.resolve())})

        self._run_maybe_async(run, blocking, "load")

    def _run_maybe_async(self, fn, blocking: bool, kind: str) -> None:
        if blocking:
            fn()
            return

        def wrapper():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait_for_*
                setattr(self, f"_{kind}_error", exc)

        t = threading.Thread(target=wrapper, name=f"persia-{kind}", daemon=True)
        setattr(self, f"_{kind}_thread", t)
        setattr(self, f"_{kind}_error", None)
        t.start()

    def _wait_kind(self, kind: str) -> None:
        t = getattr(self, f"_{kind}_thread")
        if t is not None:
            t.join()
        err = getattr(self, f"_{kind}_error")
        setattr(self, f"_{kind}_error", None)
        if err is not None:
            raise err

    def wait_for_dump_embedding(self) -> None:
        self._wait_kind("dump")

    def wait_for_load_embedding(self) -> None:
        self._wait_kind("load")

    def _dense_module(self) -> torch.nn.Module:
        m = self.model
        return m.module if isinstance(m, torch.nn.parallel.DistributedDataParallel) else m

    def dump_checkpoint(self, dst_dir: str, dense_filename: str = "dense.pt",
                        jit_dense_filename: str = "jit_dense.pt", blocking: bool = True,
                        with_jit_model: bool = False) -> None:
        directory = self._local_dir(dst_dir)
        directory.mkdir(parents=True, exist_ok=True)
        if self.model is not None:
            dense = self._dense_module()
            torch.save(dense.state_dict(), directory / dense_filename)
            if with_jit_model:
                torch.jit.save(torch.jit.script(dense), str(directory / jit_dense_filename))
        self.dump_embedding(str(directory), blocking)

    def load_checkpoint(self, src_dir: str, map_location: str | None = None,
                        dense_filename: str = "dense.pt", blocking: bool = True) -> None:
        directory = self._local_dir(src_dir)
        dense_path = directory / dense_filename
        if self.model is not None and dense_path.exists():
            state = torch.load(dense_path, map_location=map_location or self.device, weights_only=True)
            self._dense_module().load_state_dict(state)
        self.load_embedding(str(directory), blocking)

    def get_embedding_size(self) -> list[int]:
        return [int(s["rows"]) for s in self._ps_all("stats", None, timeout=60)]

    def clear_embeddings(self) -> None:
        self._ps_all("clear", None, timeout=60)


def eval_ctx(*args, **kwargs) -> EmbeddingCtx:
    """Evaluation: lookups never create rows; nothing is trained."""
    return EmbeddingCtx(PreprocessMode.EVAL, *args, **kwargs)


def configure_embedding_parameter_servers(ctx: EmbeddingCtx, config: EmbeddingConfig) -> None:
    lower, upper = config.emb_initialization
    ctx._ps_all("configure", {"init_lower": float(lower), "init_upper": float(upper),
                              "admit_probability": float(config.admit_probability),
                              "weight_bound": float(config.weight_bound)}, timeout=120)


def register_optimizer_on_all_ps(optimizer, ctx: EmbeddingCtx | None = None) -> None:
    ctx = ctx or cnt_ctx()
    if not isinstance(ctx, EmbeddingCtx):
        ctx = EmbeddingCtx(PreprocessMode.TRAIN)
        ctx._enter()
    ctx._ps_all("register_optimizer", optimizer.to_wire(), timeout=120)


# ---------------------------------------------------------------------------------------------------
class TrainCtx(EmbeddingCtx):
    """Hybrid training: dense parameters synchronously (DDP), embeddings asynchronously."""

    is_training = True

    def __init__(
        self,
        embedding_optimizer,
        dense_optimizer: torch.optim.Optimizer,
        grad_scalar_update_factor: float = 4,
        backward_buffer_size: int = 10,
        backward_workers_size: int = 8,
        grad_update_buffer_size: int = 60,
        lookup_emb_directly: bool = True,
        mixed_precision: bool = True,
        distributed_option=None,
        *args,
        **kwargs,
    ):
        super().__init__(PreprocessMode.TRAIN, *args, **kwargs)
        if self.model is None:
            raise ValueError("TrainCtx needs model=...")
        if embedding_optimizer is None or not hasattr(embedding_optimizer, "to_wire"):
            raise TypeError(f"embedding_optimizer must be a persia.embedding.optim optimizer, got {embedding_optimizer!r}")
        if grad_scalar_update_factor <= 1:
            raise ValueError(f"grad_scalar_update_factor must be > 1, got {grad_scalar_update_factor}")
        self.embedding_optimizer = embedding_optimizer
        self.dense_optimizer = dense_optimizer
        self.grad_scalar_update_factor = grad_scalar_update_factor
        if mixed_precision and self.device.type != "cuda":
            log.info("mixed_precision needs CUDA; training in float32 on CPU")
            mixed_precision = False
        self.mixed_precision = mixed_precision
        self.grad_scaler = torch.amp.GradScaler("cuda") if mixed_precision else None
        self.distributed_option = distributed_option
        self._backward_pool = ThreadPoolExecutor(max_workers=max(1, backward_workers_size),
                                                 thread_name_prefix="persia-backward")
        self._backward_slots = threading.BoundedSemaphore(max(1, backward_buffer_size))
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        self._update_error: BaseException | None = None
        self._current_batch: PersiaTrainingBatch | None = None
        self._control_group = None
        self.trained_batches = 0
        self.skipped_non_finite = 0
        self._last_progress = 0.0

    def _enter(self) -> None:
        super()._enter()
        self.bus.serve(subject("nn", "info"), lambda _o: {"world_size": self.world_size}, queue="nn",
                       blocking=False)
        if self.world_size > 1:
            self._init_distributed()
        configure_embedding_parameter_servers(self, self.embedding_config)
        register_optimizer_on_all_ps(self.embedding_optimizer, self)
        self._worker_clients()
        log.info("NN worker rank %d/%d ready on %s", self.rank, self.world_size, self.device)

    def _init_distributed(self) -> None:
        option = self.distributed_option or _default_option(self.device_id)
        master_addr = option.master_addr
        if not option.init_with_env_file() and master_addr is None:
            if self.rank == 0:
                master_addr = advertise_host()
                if option.master_port == 23456 and os.environ.get("PERSIA_DDP_FREE_PORT", "1") == "1":
                    option.master_port = find_free_port("0.0.0.0")
                info = {"addr": master_addr, "port": option.master_port}
                self.bus.serve(subject("nn", "master"), lambda _o: info, blocking=False)
                self.bus.flush()
            else:
                info = self.bus.request_retry(subject("nn", "master"), None, deadline_s=self.discovery_deadline_s,
                                              timeout=2.0, what="DDP master address from NN rank 0")
                master_addr, option.master_port = info["addr"], int(info["port"])
        self.model, self.dense_optimizer = option.convert2distributed_model(
            self.model, self.world_size, self.rank, self.device_id, master_addr, self.dense_optimizer
        )
        # Step agreement (uneven streams) runs on gloo even when the dense path uses NCCL.
        self._control_group = torch.distributed.new_group(backend="gloo")

    def _needs_rank_agreement(self, streaming: bool) -> bool:
        return streaming and self._control_group is not None

    def _all_ranks_have(self, have: int) -> bool:
        t = torch.tensor([have], dtype=torch.int32)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self._control_group)
        return bool(t.item())

    def _run_model(self, non_id, emb):
        if self.grad_scaler is not None:
            with torch.autocast("cuda", dtype=torch.float16):
                return self.model(non_id, emb)
        return self.model(non_id, emb)

    # -- backward ---------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, embedding_gradient_check_frequency: int = 20) -> torch.Tensor:
        """Backprop, send embedding gradients (async), step the dense optimizer synchronously."""
        self._raise_update_error()
        batch = self._current_batch
        if batch is None:
            raise PersiaError("backward() without a training batch: call ctx.forward(batch) first")
        self._current_batch = None
        scaled = self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss
        scaled.backward()
        grads = []
        non_finite = False
        for leaf in batch.emb_leaves:
            if leaf.grad is None:
                grads.append(None)
                continue
            g = leaf.grad.detach().to("cpu", torch.float32).numpy()
            if not np.isfinite(g).all():
                non_finite = True
            grads.append(g)
        scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
        self._send_update(batch, grads, scale)
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.dense_optimizer)
            if non_finite:
                self.grad_scaler.update(scale / self.grad_scalar_update_factor)
            else:
                self.grad_scaler.update()
        else:
            self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        if non_finite:
            self.skipped_non_finite += 1
        self.trained_batches += 1
        self._report_progress()
        return scaled

    def _send_update(self, batch: PersiaTrainingBatch, grads: list, scale: float) -> None:
        self._backward_slots.acquire()
        client = self._worker_clients()[batch.worker]

        def send():
            try:
                client.call("Update", {"ref": batch.ref, "grads": grads, "scale": scale})
            finally:
                if batch.holds_permit and self._permits is not None:
                    self._permits.release()
                self._backward_slots.release()

        fut = self._backward_pool.submit(send)
        with self._pending_lock:
            self._pending.add(fut)
        fut.add_done_callback(self._update_done)

    def _update_done(self, fut: Future) -> None:
        with self._pending_lock:
            self._pending.discard(fut)
        exc = fut.exception()
        if exc is not None and self._update_error is None:
            log.error("embedding gradient update failed: %s", exc)
            self._update_error = exc

    def _raise_update_error(self) -> None:
        if self._update_error is not None:
            err, self._update_error = self._update_error, None
            raise PersiaError(f"an embedding gradient update failed: {err}") from err

    def _wait_for_updates(self) -> None:
        while True:
            with self._pending_lock:
                pending = list(self._pending)
            if not pending:
                break
            for f in pending:
                f.exception()
        self._raise_update_error()

    wait_for_pending_updates = _wait_for_updates

    def _report_progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress >= 0.5:
            self._last_progress = now
            try:
                self.bus.publish(subject("nn", "progress"), {"rank": self.rank, "trained": self.trained_batches})
            except Exception:  # noqa: BLE001 - progress is best effort
                pass

    # -- checkpoints ------------------------------------------------------------------------------
    def dump_checkpoint(self, dst_dir: str, dense_model_filename: str = "dense.pt",
                        jit_dense_model_filename: str = "jit_dense.pt", opt_filename: str = "opt.pt",
                        blocking: bool = True, with_jit_model: bool = False) -> None:
        self._wait_for_updates()
        directory = self._local_dir(dst_dir)
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.dense_optimizer.state_dict(), directory / opt_filename)
        super().dump_checkpoint(str(directory), dense_model_filename, jit_dense_model_filename, blocking, with_jit_model)

    def load_checkpoint(self, src_dir: str, map_location: str | None = None, dense_model_filename: str = "dense.pt",
                        opt_filename: str = "opt.pt", blocking: bool = True) -> None:
        self._wait_for_updates()
        directory = self._local_dir(src_dir)
        opt_path = directory / opt_filename
        if opt_path.exists():
            self.dense_optimizer.load_state_dict(
                torch.load(opt_path, map_location=map_location or self.device, weights_only=True))
        super().load_checkpoint(str(directory), map_location, dense_model_filename, blocking)

    def _exit(self, exc: BaseException | None) -> None:
        try:
            if exc is None:
                self._wait_for_updates()
        finally:
            self._backward_pool.shutdown(wait=exc is None)
            self.bus.flush()


def _default_option(device_id):
    from persia.distributed import get_default_distributed_option

    return get_default_distributed_option(device_id)


# ---------------------------------------------------------------------------------------------------
class InferCtx(EmbeddingCtx):
    """Inference without NATS: talks straight to the given embedding workers (``host:port``)."""

    def __init__(self, embedding_worker_address_list: list[str], *args, **kwargs):
        super().__init__(PreprocessMode.INFERENCE, *args, **kwargs)
        if not embedding_worker_address_list:
            raise ValueError("InferCtx needs at least one embedding worker address")
        self._workers = [Client(a, WORKER_SERVICE) for a in embedding_worker_address_list]

    def _enter(self) -> None:
        if self.model is not None:
            self.model.to(self.device)

    def wait_for_serving(self, deadline_s: float = 300.0) -> None:
        end = time.monotonic() + deadline_s
        for c in self._workers:
            while True:
                try:
                    c.call("Stats", None, timeout=2.0)
                    break
                except Exception:  # noqa: BLE001
                    if time.monotonic() > end:
                        raise
                    time.sleep(0.2)
