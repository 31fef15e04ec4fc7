"""The embedding parameter server process: gRPC lookups/updates over an :class:`EmbeddingStore`,
NATS for discovery and control (configure, optimizer, dump, load, stats)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from persia import messages as M
from persia import rpc
from persia.bus import NatsBus, subject
from persia.embedding_ps.checkpoint import checkpoint_layout
from persia.embedding_ps.optimizers import optimizer_from_wire, state_width
from persia.embedding_ps.store import EmbeddingStore, HyperParameters
from persia.metrics import Metrics, register_stats, start_exporter
from persia.recent_keys import RecentKeys
from persia.security import check_under_root, checkpoint_root

log = logging.getLogger(__name__)

SERVICE = "persia.EmbeddingParameterServer"


class NotConfiguredError(RuntimeError):
    pass


# What a reply carries beyond its arrays (msgpack framing, keys, array headers, the applied seqs of
# a usual replay): kept free below rpc.MAX_MESSAGE_BYTES when a lookup's reply is sized up front.
_REPLY_SLACK = 1 << 20


def _first_bad(grads: np.ndarray) -> str:
    """Where and what the first non-finite gradient is (for the error; the refused path only)."""
    row, col = np.argwhere(~np.isfinite(grads))[0]
    return f"grads[{row}, {col}] = {grads[row, col]}"


class EmbeddingParameterServer:
    def __init__(
        self,
        global_config,
        replica_index: int,
        replica_size: int,
        port: int = 0,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        bus: NatsBus | None = None,
    ):
        pc = global_config.embedding_parameter_server_config
        self.global_config = global_config
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.store = EmbeddingStore(pc.capacity, pc.num_hashmap_internal_shards, seed=replica_index)
        self.num_workers = global_config.common_config.checkpointing_config.num_workers
        self.metrics = Metrics("embedding_parameter_server", replica_index)
        if start_exporter() is not None:
            register_stats("embedding_parameter_server", replica_index,
                           lambda: {k: v for k, v in self.stats().items() if k not in ("replica_index", "replica_size")})
        self._configured = False
        self._optimizer = None
        self._status = {"state": "idle", "error": None}
        self._status_lock = threading.Lock()
        # a restarted PS is another incarnation: the operations its callers started are gone
        self.incarnation = uuid.uuid4().hex
        self._operations = RecentKeys(64)  # ps.start's ids -> their outcome, for ps.status
        self.incremental = None
        if pc.enable_incremental_update and global_config.common_config.job_type != "Infer":  # Infer applies them
            from persia.embedding_ps.incremental import IncrementalDumper

            self.incremental = IncrementalDumper(
                self.store, pc.incremental_dir, replica_index, pc.incremental_buffer_size, self.num_workers,
                retention_s=pc.incremental_retention_seconds,
            )
        # what gRPC serves, and what an embedding worker in this process calls directly
        # (persia.embedding_worker.colocated)
        self.methods: dict[str, rpc.Method] = {
            "Lookup": (self.lookup, M.PsLookup),
            "Update": (self.update, M.PsUpdate),
            "Step": (self.step, M.PsStep),
            "Stats": (lambda _r: self.stats(), M.NoPayload),
        }
        ic = global_config.common_config.infer_config
        self.applier = None
        infer = global_config.common_config.job_type == "Infer"
        if infer and pc.incremental_dir and pc.enable_incremental_update:
            from persia.embedding_ps.incremental import poll_interval_s

            poll_s = poll_interval_s()  # a bad PERSIA_INCREMENTAL_POLL_SECONDS fails before loading or serving
        # the checkpoint an inference PS loaded at start and the embedding layout it records
        # (Stats: its embedding workers compare it with their embedding_config.yml, checkpoint.py)
        self.loaded_checkpoint: dict | None = None
        if infer and ic.embedding_checkpoint:
            # before the port opens: a lookup during the load would read the rows not loaded yet as
            # zeros, and the pod's readiness (its port) would say it serves
            self._load_dir(Path(ic.embedding_checkpoint))  # from the config, not the network
            self.loaded_checkpoint = {"dir": str(ic.embedding_checkpoint),
                                      "embedding_layout": checkpoint_layout(Path(ic.embedding_checkpoint))}
            if self.loaded_checkpoint["embedding_layout"] is None:
                log.warning("PS %d: checkpoint %s records no embedding layout (written before it was recorded): "
                            "nothing checks that the embedding workers' embedding_config.yml is the one it was "
                            "trained with (another slot order reads every ID as a miss)", replica_index,
                            ic.embedding_checkpoint)
        self._server, self.port = rpc.serve(SERVICE, self.methods, port, host=host, max_workers=8)
        self.address = f"{advertise_host or host}:{self.port}"
        if infer:
            self._configured = True
            if pc.incremental_dir and pc.enable_incremental_update:
                # PERSIA's inference PS scans the training PS's incremental dumps every 10 s;
                # PERSIA_INCREMENTAL_POLL_SECONDS changes that (docs/serving.md, "Refresh").
                from persia.embedding_ps.incremental import IncrementalApplier

                self.applier = IncrementalApplier(self.store, pc.incremental_dir, replica_index, replica_size)
                self.applier.start(poll_s)
        log.info("embedding PS %d/%d on %s (capacity %d rows)", replica_index, replica_size, self.address, pc.capacity)
        self.bus = bus
        if bus is not None:
            self._register_nats(bus)

    def _register_nats(self, bus: NatsBus) -> None:
        me = {"address": self.address, "replica_index": self.replica_index, "replica_size": self.replica_size}
        i = self.replica_index
        none = M.NoPayload
        bus.serve(subject("ps", "address", i), lambda _o: me, blocking=False, schema=none)
        bus.serve(subject("ps", "info"), lambda _o: me, queue="ps", blocking=False, schema=none)
        bus.serve(subject("ps", "configure", i), self.configure, schema=M.Configure)
        bus.serve(subject("ps", "register_optimizer", i), self.register_optimizer, schema=M.RegisterOptimizer)
        bus.serve(subject("ps", "dump", i), self.dump, schema=M.CheckpointDir)
        bus.serve(subject("ps", "load", i), self.load, schema=M.CheckpointDir)
        bus.serve(subject("ps", "stage", i), self.stage, schema=M.CheckpointDir)
        bus.serve(subject("ps", "commit", i), self.commit, schema=none)
        bus.serve(subject("ps", "abort", i), self.abort, schema=none)
        bus.serve(subject("ps", "start", i), self.start, schema=M.StartOperation)
        bus.serve(subject("ps", "status", i), self.status, blocking=False, schema=M.StatusQuery)
        bus.serve(subject("ps", "stats", i), lambda _o: self.stats(), schema=none)
        bus.serve(subject("ps", "clear", i), self.clear, schema=none)
        if i == 0:  # replica indices for Deployment-run roles (online training)
            from persia.rendezvous import RendezvousServer

            self.rendezvous = RendezvousServer(bus)
        bus.flush()

    # -- control ----------------------------------------------------------------------------------
    def configure(self, req: dict) -> dict:
        self.store.configure(HyperParameters(**req))
        self._configured = True
        return {"configured": True}

    def register_optimizer(self, req: dict) -> dict:
        cfg = optimizer_from_wire(req)
        if self._optimizer is not None and self._optimizer == cfg:
            return {"registered": False}  # idempotent: every NN rank registers the same optimizer
        self.store.register_optimizer(cfg)
        self._optimizer = cfg
        return {"registered": True}

    def _run_status(self, state: str, fn) -> dict:
        with self._status_lock:
            if self._status["state"] not in ("idle", "failed"):
                raise RuntimeError(f"PS {self.replica_index} is busy {self._status['state']}")
            self._status = {"state": state, "error": None}
        try:
            fn()
        except Exception as exc:
            with self._status_lock:
                self._status = {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
            raise
        with self._status_lock:
            self._status = {"state": "idle", "error": None}
        return {"done": True, "rows": len(self.store)}

    def _checkpoint_path(self, path: str) -> Path:
        """Paths sent over NATS must lie under the checkpoint root (persia.security)."""
        configured = self.global_config.common_config.checkpointing_config.checkpoint_dir
        return check_under_root(path, checkpoint_root(config_dir=configured))

    def dump(self, req: dict) -> dict:
        directory = self._checkpoint_path(req["dir"])
        log.info("PS %d: dumping to %s", self.replica_index, directory)
        return self._run_status(
            "dumping",
            lambda: self.store.dump(directory, self.replica_index, self.num_workers, replica_size=self.replica_size),
        )

    def load(self, req: dict) -> dict:
        return self._load_dir(self._checkpoint_path(req["dir"]))

    def stage(self, req: dict) -> dict:
        """Validate a checkpoint and build its tables beside the live ones; ``commit`` swaps them in.
        The trainer commits only once every replica staged (all-or-nothing across replicas)."""
        directory = self._checkpoint_path(req["dir"])
        log.info("PS %d: staging %s", self.replica_index, directory)
        staged = {}
        out = self._run_status("staging", lambda: staged.setdefault(
            "rows", self.store.stage(directory, self.replica_index, self.replica_size, self.num_workers)))
        out["staged_rows"] = staged["rows"]
        return out

    def commit(self, _req: Any) -> dict:
        rows = self.store.commit_staged()
        log.info("PS %d: committed the staged checkpoint (%d rows)", self.replica_index, rows)
        return {"done": True, "rows": rows}

    def abort(self, _req: Any) -> dict:
        dropped = self.store.discard_staged()
        if dropped:
            log.info("PS %d: dropped the staged checkpoint", self.replica_index)
        return {"dropped": dropped}

    def _load_dir(self, directory: Path) -> dict:
        log.info("PS %d: loading from %s", self.replica_index, directory)
        return self._run_status(
            "loading",
            lambda: self.store.load(directory, self.replica_index, self.replica_size, self.num_workers),
        )

    def clear(self, _req: Any) -> dict:
        log.info("PS %d: clearing %d rows", self.replica_index, len(self.store))
        self.store.clear()
        return {"rows": 0}

    def status(self, req: dict | None = None) -> dict:
        """The PS's state (idle, dumping, staging, loading, failed), its incarnation, and with an
        ``id`` that ``start``ed operation's outcome (None: not known to this incarnation)."""
        with self._status_lock:
            out = dict(self._status, incarnation=self.incarnation)
            if req and req.get("id"):
                out["operation"] = self._operations.get(req["id"])
            return out

    def start(self, req: dict) -> dict:
        """``ps.start.<i>``: a dump or a stage on a thread of its own, answered at once; the caller
        polls ``ps.status.<i>`` with the operation's id. A reply lost to a NATS restart costs a
        retry: an id already known is answered again, not run again (a dump of minutes was one
        request whose lost reply left its caller waiting for an hour)."""
        op_id = req["id"]
        with self._status_lock:
            if self._operations.get(op_id) is not None:
                return {"incarnation": self.incarnation}
        directory = self._checkpoint_path(req["dir"])
        run = self.dump if req["op"] == "dump" else self.stage
        with self._status_lock:
            if self._operations.get(op_id) is not None:
                return {"incarnation": self.incarnation}
            if self._status["state"] not in ("idle", "failed"):
                raise RuntimeError(f"PS {self.replica_index} is busy {self._status['state']}")
            self._operations.add(op_id, {"state": "running"})
        threading.Thread(target=self._operate, args=(op_id, run, {"dir": str(directory)}),
                         name=f"persia-ps-{req['op']}", daemon=True).start()
        return {"incarnation": self.incarnation}

    def _operate(self, op_id: str, run, request: dict) -> None:
        try:
            outcome = {"state": "done", "result": run(request)}
        except Exception as exc:  # noqa: BLE001 - the caller reads it with ps.status
            log.exception("PS %d: operation %s failed", self.replica_index, op_id)
            outcome = {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
        with self._status_lock:
            self._operations.add(op_id, outcome)

    def stats(self) -> dict:
        out = dict(self.store.stats())
        out["replica_index"] = self.replica_index
        out["replica_size"] = self.replica_size
        loaded = getattr(self, "loaded_checkpoint", None)
        if loaded is not None:  # not a number: not exported as a metric
            out["loaded_checkpoint"] = loaded
        applier, dumper = getattr(self, "applier", None), getattr(self, "incremental", None)  # early scrapes
        if applier is not None:  # inference PS: how fresh the served embeddings are
            out["incremental_packets_applied"] = applier.packets_applied
            out["incremental_packets_rejected"] = applier.packets_rejected
            out["incremental_rows_applied"] = applier.rows_applied
            out["incremental_dir_missing"] = int(applier.dir_missing)  # 1: serving frozen embeddings
            if applier.last_delay_sec is not None:
                out["incremental_delay_seconds"] = applier.last_delay_sec
        if dumper is not None:  # training PS: what it shipped
            out["incremental_packets_written"] = dumper.packets_written
            out["incremental_packets_deleted"] = dumper.packets_deleted  # after incremental_retention_seconds
            out["incremental_rows_written"] = dumper.rows_written
            out["incremental_write_failures"] = dumper.write_failures  # their rows are retried
            out["incremental_rows_dropped"] = dumper.rows_dropped
        return out

    # -- data path --------------------------------------------------------------------------------
    def _reply_bytes(self, lookups: list) -> int:
        """Bytes of the arrays the replies to ``lookups`` (PsLookup dicts) will carry: float32
        rows, and with ``state`` the rows' optimizer state and the int32 ``absent`` positions
        (all of them at worst). The request's element limit bounds the rows only; the state is up
        to ``2*dim + 1`` floats more per ID (Adam)."""
        total = 0
        opt = self.store.optimizer
        tables = self.store._tables  # dim -> DimTable (read-only look at the state widths)
        for q in lookups:
            if q is None:
                continue
            want_state = bool(q.get("state", False))
            for t in q["tables"]:
                n, dim = len(t["signs"]), int(t["dim"])
                per_id = dim
                if want_state:
                    table = tables.get(dim)
                    per_id += max(state_width(opt, dim), table.state_width if table is not None else 0) + 1
                total += 4 * n * per_id
        return total

    def _check_reply_fits(self, lookups: list, field: str) -> None:
        """Refuse (ValueError: INVALID_ARGUMENT) a request whose reply could not be sent, before
        anything is applied or created: gRPC refuses an oversized reply only after the handler
        ran, so a Step's gradients were applied (and a training lookup's rows created) while its
        caller got an error, and sending the same Step again applied them twice."""
        limit = rpc.MAX_MESSAGE_BYTES - _REPLY_SLACK
        size = self._reply_bytes(lookups)
        if size > limit:
            raise ValueError(
                f"PS replica {self.replica_index}: field {field!r} asks for a reply of {size} bytes (rows"
                f"{' and optimizer state' if any(q and q.get('state') for q in lookups) else ''}), more than "
                f"the {limit} one gRPC message may carry (rpc.MAX_MESSAGE_BYTES less {_REPLY_SLACK} of framing); "
                "nothing was applied: send fewer IDs per request")

    def lookup(self, req: dict) -> dict:
        self._check_reply_fits([req], "tables")
        return self._lookup(req)

    def _lookup(self, req: dict) -> dict:
        train = bool(req["train"])
        if train and not self._configured:
            raise NotConfiguredError(
                f"PS replica {self.replica_index} got a training lookup before its hyperparameters: "
                "TrainCtx configures them when it is entered"
            )
        t0 = time.perf_counter()
        nonce = req.get("nonce")
        want_state, query = bool(req.get("state", False)), req.get("applied")
        if not want_state and query is None:
            rows = [self.store.lookup(np.asarray(t["signs"], dtype=np.uint64), int(t["dim"]), train, nonce)
                    for t in req["tables"]]
            self.metrics.observe("ps_lookup_time_cost_sec", time.perf_counter() - t0)
            return {"rows": rows}
        applied = None if query is None else (query["source"], query["since"])
        got = [self.store.lookup_full(np.asarray(t["signs"], dtype=np.uint64), int(t["dim"]), train, nonce,
                                      state=want_state, applied=applied)
               for t in req["tables"]]
        out: dict[str, Any] = {"rows": [r.rows for r in got]}
        if want_state:
            out["state"] = [r.state for r in got]
            out["absent"] = [r.absent for r in got]
        if query is not None:
            out["applied"] = [r.applied for r in got]
        self.metrics.observe("ps_lookup_time_cost_sec", time.perf_counter() - t0)
        return out

    def update(self, req: dict) -> dict:
        if self._optimizer is None:
            raise NotConfiguredError(
                f"PS replica {self.replica_index} got gradients before an optimizer was registered"
            )
        t0 = time.perf_counter()
        tables = req["tables"]
        prepared = []
        for i, t in enumerate(tables):  # every table before any is applied: a refused request changes nothing
            try:
                M.check_grad_table(t["dim"], t["signs"], t["grads"])
            except ValueError as exc:
                raise ValueError(f"PS replica {self.replica_index}, tables[{i}]: {exc}") from None
            grads = np.asarray(t["grads"])
            if grads.dtype != np.float32:
                with np.errstate(over="ignore"):  # refused below, not warned about
                    grads = grads.astype(np.float32)
            # a NaN or infinite gradient makes its rows NaN for good (clipping keeps NaN), and a
            # float64 one past float32's range becomes inf here: checked after the conversion
            if not np.isfinite(grads).all():
                raise ValueError(f"PS replica {self.replica_index}, tables[{i}] (dim {t['dim']}): field 'grads' "
                                 f"holds values that are not finite ({_first_bad(grads)}); nothing was applied")
            prepared.append((np.asarray(t["signs"], dtype=np.uint64), grads))
        missing = self.store.update_tables(prepared, source=req.get("source"), seqs=req.get("seqs") or ())
        self.metrics.observe("ps_update_time_cost_sec", time.perf_counter() - t0)
        return {"missing": missing}

    def step(self, req: dict) -> dict:
        """Gradients of earlier batches, then the next batch's lookup, in one call: the embedding
        worker's way of saving a round trip (and a gRPC call on each end) per batch. The reply
        is the lookup's (``state``, ``absent``, ``applied`` when asked) plus ``missing``. With
        ``lookups`` (several batches' lookups, for one call instead of one each), the reply's
        ``lookups`` holds each one's answer in order (None where none was asked)."""
        if req.get("lookups"):
            self._check_reply_fits(req["lookups"], "lookups")
        elif req.get("lookup"):
            self._check_reply_fits([req["lookup"]], "lookup")
        missing = self.update(req["update"])["missing"] if req.get("update") else 0
        if req.get("lookups"):
            return {"lookups": [None if q is None else self._lookup(q) for q in req["lookups"]], "missing": missing}
        out = self._lookup(req["lookup"]) if req.get("lookup") else {"rows": []}
        out["missing"] = missing
        return out

    def stop(self) -> None:
        try:
            if self.incremental is not None:
                self.incremental.close()  # raises if its last packet failed: those rows were never shipped
        finally:
            if self.applier is not None:
                self.applier.stop()
            self._server.stop(grace=1.0)

    def wait(self) -> None:
        self._server.wait_for_termination()
