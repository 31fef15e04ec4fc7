"""The embedding worker process: NATS for data loaders and discovery, gRPC for NN workers, gRPC
client of every PS replica."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from persia.bus import BUSY, NatsBus, subject
from persia.embedding_worker import pipeline
from persia.embedding_worker.buffer import ExpiringBuffer
from persia.embedding_worker.colocated import InProcessPs
from persia.embedding_ps.checkpoint import embedding_layout, layout_differences
from persia.errors import (INPUT_ERRORS, BatchLost, DiscoveryTimeout, EmbeddingLayoutMismatch, ServersMisplaced,
                           TooManyWaiting)
from persia.metrics import Metrics, start_exporter
from persia import messages as M
from persia import rpc
from persia.recent_keys import RETRY_MEMORY, RecentKeys
from persia.security import Unauthorized, batch_ref

log = logging.getLogger(__name__)

SERVICE = "persia.EmbeddingWorker"
GRPC_THREADS = 8
MAX_WAITING_LOOKUPS = GRPC_THREADS // 2  # lookups waiting for ID features never hold every thread
PS_SERVICE = "persia.EmbeddingParameterServer"


def slot_specs(embedding_config) -> dict[str, pipeline.SlotSpec]:
    """Adapt the parsed ``embedding_config.yml`` (resolved slots) to what the pipeline needs."""
    return {
        name: pipeline.SlotSpec(
            name=name,
            dim=slot.dim,
            index_prefix=slot.index_prefix,
            embedding_summation=slot.embedding_summation,
            sqrt_scaling=slot.sqrt_scaling,
            sample_fixed_size=slot.sample_fixed_size,
            hash_stack_rounds=slot.hash_stack_rounds,
            hash_stack_embedding_size=slot.hash_stack_embedding_size,
        )
        for name, slot in embedding_config.slots.items()
    }


@dataclass
class _Looked:
    prepared: pipeline.PreparedBatch
    positions: list[dict[int, np.ndarray]]


def discover(bus: NatsBus, service: str, deadline_s: float) -> list[dict]:
    """Addresses of every replica of ``service`` ("ps" or "ew"), in replica order."""
    info = bus.request_retry(subject(service, "info"), None, deadline_s=deadline_s, timeout=2.0,
                             what=f"discovering {service} replicas")
    size = int(info["replica_size"])
    out = []
    for i in range(size):
        out.append(bus.request_retry(subject(service, "address", i), None, deadline_s=deadline_s,
                                     timeout=2.0, what=f"{service} replica {i} address"))
    for i, entry in enumerate(out):
        if entry["replica_index"] != i or entry["replica_size"] != size:
            raise DiscoveryTimeout(
                f"{service} replica {i} answered as {entry['replica_index']}/{entry['replica_size']}, "
                f"expected {i}/{size}: two replicas share an index?"
            )
    return out


def servers_mismatch(addresses: list[str], answers: list[dict]) -> str | None:
    """Why a static PS address list (``infer_config.servers``) does not match the replicas that
    answer at those addresses, or None when it does (pure). Replica ``i`` owns the IDs that shard
    to ``i``: a list in another order, or of another length, would look IDs up where they are not
    and read them as zeros."""
    for i, (address, answer) in enumerate(zip(addresses, answers)):
        index, size = answer.get("replica_index"), answer.get("replica_size")
        if index != i or (size is not None and size != len(addresses)):
            of = "" if size is None else f" of {size}"
            return (f"infer_config.servers[{i}] = {address!r} is PS replica {index}{of}, but the list puts it at "
                    f"position {i} of {len(addresses)}: list the inference PS replicas in replica order, all of them")
    return None


def _replay(req: dict, train: bool) -> dict | None:
    """The NN worker's ``replay`` query of a training lookup (None: not asked, or not training)."""
    replay = req.get("replay")
    return {"source": int(replay["source"]), "since": int(replay["since"])} if replay and train else None


class EmbeddingWorker:
    def __init__(
        self,
        embedding_config,
        global_config,
        replica_index: int,
        replica_size: int,
        port: int = 0,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        bus: NatsBus | None = None,
        ps_addresses: list[str] | None = None,
        discovery_deadline_s: float = 600.0,
        colocated_ps: InProcessPs | None = None,
    ):
        """``colocated_ps``: the PS replica running in this process, called directly instead of
        over gRPC (:mod:`persia.embedding_worker.colocated`); matched to the discovered replicas
        by its address."""
        self.replica_index = replica_index
        self.replica_size = replica_size
        self.slots = slot_specs(embedding_config)
        self.prefix_bit = embedding_config.feature_index_prefix_bit
        # where each slot's rows live (checkpoint.embedding_layout): recorded in the checkpoints the
        # trainer dumps, compared with the one an inference PS loaded before its first lookup
        self.layout = embedding_layout(embedding_config)
        self._layout_noted: set[str] = set()
        wc = global_config.embedding_worker_config
        # Bounded per data loader and in total: a sender that varies its loader id gets "busy" too.
        # Remembers the refs that left it, so that a lookup of one fails at once instead of waiting.
        self.forward_buffer = ExpiringBuffer("forward buffer", wc.forward_buffer_size, wc.buffered_data_expired_sec,
                                             capacity_total=wc.forward_buffer_size, remember=RETRY_MEMORY,
                                             max_waiters=MAX_WAITING_LOOKUPS,
                                             on_wait=lambda: self.metrics.inc("lookup_waited"))
        self.lookup_wait_s = float(wc.lookup_wait_sec)
        # One post-forward entry per in-flight training batch; bounded by staleness on the NN side,
        # so a generous cap only guards against a runaway client.
        self.post_buffer = ExpiringBuffer("post-forward buffer", 1 << 20, wc.buffered_data_expired_sec)
        self._recent = RecentKeys()  # (loader, session, batch_id) -> ref, to answer retried sends idempotently
        self._recent_lock = threading.Lock()
        self.metrics = Metrics("embedding_worker", replica_index)
        start_exporter()
        self.metrics.set("forward_buffer_capacity", wc.forward_buffer_size)
        self.bus = bus
        self._server, self.port = rpc.serve(
            SERVICE,
            {
                "Lookup": (self.lookup, M.WorkerLookup),
                "LookupDirect": (self.lookup_direct, M.WorkerLookupDirect),
                "Update": (self.update, M.WorkerUpdate),
                "Step": (self.step, M.WorkerStep),
                "Release": (self.release, M.WorkerRelease),
                "Stats": (lambda _req: self.stats(), M.NoPayload),
                "Ready": (lambda _req: self.ready(), M.NoPayload),
            },
            port,
            host="0.0.0.0" if host == "0.0.0.0" else host,
            max_workers=GRPC_THREADS,
        )
        self.address = f"{advertise_host or host}:{self.port}"
        # discovery checks each replica's index; a static list is checked before its first use
        self._ps_checked = ps_addresses is None
        if ps_addresses is None:
            if bus is None:
                raise ValueError("embedding worker needs either a NATS bus or a static PS address list")
            ps_addresses = [e["address"] for e in discover(bus, "ps", discovery_deadline_s)]
        if colocated_ps is not None and colocated_ps.address not in ps_addresses:
            raise ValueError(f"the colocated PS {colocated_ps.address} is not among the discovered PS replicas "
                             f"{ps_addresses}")
        self.ps = [colocated_ps if colocated_ps is not None and a == colocated_ps.address else rpc.Client(a, PS_SERVICE)
                   for a in ps_addresses]
        log.info("embedding worker %d/%d on %s; %d PS replicas%s", replica_index, replica_size, self.address,
                 len(self.ps), "" if colocated_ps is None else f", {colocated_ps.address} in this process")
        if bus is not None:
            self._register_nats(bus)

    # -- NATS -------------------------------------------------------------------------------------
    _ref_key: bytes | None = None  # the job's batch-ref key (set by _register_nats): forwards' refs are checked

    def _register_nats(self, bus: NatsBus) -> None:
        self._ref_key = bus.ref_key
        me = {"address": self.address, "replica_index": self.replica_index, "replica_size": self.replica_size}
        # the slot names too: a data loader refuses a batch with another ID feature when it is sent
        # (DataCtx.send_data), not later from whichever send or thread reaches this worker with it
        info = {**me, "slots": list(self.slots), "layout": self.layout}
        bus.serve(subject("ew", "address", self.replica_index), lambda _o: me, blocking=False, schema=M.NoPayload)
        bus.serve(subject("ew", "info"), lambda _o: info, queue="ew", blocking=False, schema=M.NoPayload)
        bus.serve(subject("ew", "forward", self.replica_index), self.on_forward, blocking=False, schema=M.Forward)
        bus.serve(subject("ew", "forward_group", self.replica_index), self.on_forward_group, blocking=False,
                  schema=M.ForwardGroup)
        # a data loader whose batch did not go through hands the ID features back (or, when they
        # never arrived here, says they never will: a lookup waiting for them fails now)
        # signed with the job secret (it destroys batches); on the bus's pool, not its loop: a
        # release of thousands of refs must not hold up the forwards meanwhile
        bus.serve(subject("ew", "release", self.replica_index), self.release, blocking=True, schema=M.WorkerRelease)
        bus.flush()

    def on_forward_group(self, req: dict) -> Any:
        """Several batches' ID features (``PERSIA_DATA_GROUP``), each taken as ``on_forward`` takes
        a lone one, so each has its own outcome: ``refs[i]`` (None where it was refused) and
        ``errors[i]`` (why, else None). A full buffer answers busy after buffering those before
        it; the loader's retry of the group finds them under the refs they got."""
        refs: list = []
        errors: list = []
        for batch in req["batches"]:
            try:  # a ref not keyed with the job secret (Unauthorized) refuses the rest of the group
                answer = self.on_forward(batch)
            except INPUT_ERRORS as exc:  # this batch's input
                refs.append(None)
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            if answer is BUSY:
                return BUSY
            refs.append(answer)
            errors.append(None)
        return {"refs": refs, "errors": errors}

    def on_forward(self, req: dict) -> Any:
        """A data loader's ID features: validate now (a bad batch is rejected at the sender), buffer
        under the ``ref`` the loader chose (it gave the same to the NN worker, at the same time)."""
        key = self._forward_key(req)
        batch_size = int(req["batch_size"])
        pipeline.validate_features(req["features"], batch_size, self.slots)
        loader = key[0]
        with self._recent_lock:
            if key[2] is not None and key in self._recent:
                # a retry of a send whose reply was lost: same ref, not a second copy
                return {"ref": self._recent.get(key), "worker": self.replica_index}
            ref = self.forward_buffer.put(loader, req, ref=req.get("ref"))
            if ref is None:
                self.metrics.inc("forward_busy")
                return BUSY
            if key[2] is not None:
                self._recent.add(key, ref)
        self.metrics.set("num_pending_batches", len(self.forward_buffer))
        return {"ref": ref, "worker": self.replica_index}

    def _forward_key(self, req: dict) -> tuple:
        """The key a retried send of ``req`` is recognised by; with a job secret, first checks that
        its ``ref`` is the keyed ``batch_ref`` of its (session, loader, batch_id): a forward sent
        ahead of a batch by somebody without the secret would otherwise buffer its IDs under the
        batch's ref, and the loader's own send be answered as a retry of it (Unauthorized)."""
        loader = int(req.get("loader", 0))
        key = (loader, req.get("session"), req.get("batch_id"))
        if self._ref_key is None:
            return key
        ref = req.get("ref")
        if ref is None:  # the worker chooses the ref: kept apart from the loaders' keyed sends
            return (*key, None)
        if key[2] is None or ref != batch_ref(key[1], loader, key[2], self._ref_key):
            if self.forward_buffer.would_refuse(int(ref)):
                return (*key, ref)  # buffered or gone already: the buffer refuses it, as without a secret
            raise Unauthorized(
                f"ew.forward of data loader {loader} (session {key[1]!r}, batch {key[2]}): ref {ref} is not this "
                f"job's ref of that batch (refs are keyed with PERSIA_JOB_SECRET; a sender without it, or "
                f"with another job's)")
        return key

    # -- gRPC -------------------------------------------------------------------------------------
    def _call_ps(self, method: str, requests: list[dict | None]) -> list[Any]:
        """``method`` on every PS replica with a request (None: skip it), in parallel; the replies
        in replica order. One replica is called directly: a gRPC future costs about twice the CPU
        of a blocking call (channel-managed call plus a hand-off), for nothing to overlap with."""
        if not self._ps_checked:
            self._check_servers()
        live = [s for s, r in enumerate(requests) if r is not None]
        if len(live) == 1:
            s = live[0]
            return [self.ps[s].call(method, requests[s]) if i == s else None for i in range(len(requests))]
        futures: list = [None] * len(requests)
        for s in sorted(live, key=lambda s: isinstance(self.ps[s], InProcessPs)):  # remote calls first
            futures[s] = self.ps[s].future(method, requests[s])
        return [None if f is None else self.ps[s].result(method, f) for s, f in enumerate(futures)]

    def _lookup_requests(self, prepared: pipeline.PreparedBatch, train: bool,
                         nonce: int | None = None, replay: dict | None = None) -> tuple[list, list[dict | None]]:
        """Per PS replica: the positions (into ``prepared.tables``) of the signs it owns and its
        lookup request (None when it owns none). ``replay`` (``{source, since}``): the NN worker
        re-applies its own updates the read missed, so the rows come with their optimizer state
        and the seqs of its updates already applied (:mod:`persia.nn_worker.replay`)."""
        positions = pipeline.split_by_shard(prepared.tables, len(self.ps))
        extra = {} if nonce is None else {"nonce": nonce}  # the batch id: sharding-free admission draws
        if replay is not None:
            extra.update(state=True, applied=replay)
        requests = [
            {"train": train, "tables": [{"dim": d, "signs": prepared.tables[d][p]} for d, p in positions[s].items()],
             **extra}
            if positions[s] else None
            for s in range(len(self.ps))
        ]
        return positions, requests

    @staticmethod
    def _reply(prepared: pipeline.PreparedBatch, positions: list, replies: list, replay: bool = False) -> dict:
        """The NN's lookup reply from the PS replicas' answers (None: a replica not asked)."""
        rows = pipeline.assemble_rows(prepared.tables, positions,
                                      [None if r is None else r["rows"] for r in replies])
        reply = pipeline.lookup_reply(prepared, rows)
        if replay:
            reply["replay"] = pipeline.replay_reply(prepared.tables, positions, replies)
        return reply

    def _lookup_prepared(self, prepared: pipeline.PreparedBatch, train: bool,
                         nonce: int | None = None, replay: dict | None = None) -> tuple[dict, list]:
        positions, requests = self._lookup_requests(prepared, train, nonce, replay)
        replies = self._call_ps("Lookup", requests)
        return self._reply(prepared, positions, replies, replay is not None), positions

    def _take_for_lookup(self, req: dict) -> tuple[int, dict, pipeline.PreparedBatch, bool]:
        ref = int(req["ref"])
        try:
            batch = self.forward_buffer.take(ref, wait_s=self.lookup_wait_s)
        except BatchLost:
            self.metrics.inc("lookup_lost")
            raise
        except TooManyWaiting:
            self.metrics.inc("lookup_wait_refused")
            raise
        prepared = pipeline.prepare(batch["features"], int(batch["batch_size"]), self.slots, self.prefix_bit,
                                    checked=True)  # validated by on_forward when it arrived
        # an eval/infer NN context asks train=False: no rows created, no gradients awaited
        train = bool(batch.get("requires_grad", True)) and bool(req.get("train", True))
        return ref, batch, prepared, train

    def _looked_up(self, ref: int, batch: dict, prepared: pipeline.PreparedBatch, positions: list,
                   train: bool, t0: float) -> None:
        if train:
            self.post_buffer.put(0, _Looked(prepared, positions), ref=ref)
            self.metrics.inc("staleness")
        self.metrics.set("num_pending_batches", len(self.forward_buffer))
        self.metrics.inc("worker_lookup_ids", pipeline.num_ids(batch["features"]))
        self.metrics.observe("lookup_total_time_cost_sec", time.perf_counter() - t0)

    def lookup(self, req: dict) -> dict:
        t0 = time.perf_counter()
        ref, batch, prepared, train = self._take_for_lookup(req)
        reply, positions = self._lookup_prepared(prepared, train, batch.get("batch_id"), _replay(req, train))
        self._looked_up(ref, batch, prepared, positions, train, t0)
        return reply

    def lookup_direct(self, req: dict) -> dict:
        """Look up raw ID features sent by the NN worker itself (eval / inference): never creates rows."""
        t0 = time.perf_counter()
        prepared = pipeline.prepare(req["features"], int(req["batch_size"]), self.slots, self.prefix_bit)
        reply, _ = self._lookup_prepared(prepared, train=False)
        self.metrics.inc("worker_lookup_ids", pipeline.num_ids(req["features"]))
        self.metrics.observe("lookup_direct_time_cost_sec", time.perf_counter() - t0)
        return reply

    @staticmethod
    def _tagged(tables: list[dict], updates: list[dict]) -> dict | None:
        """A PS update request: ``tables``, and the NN worker's seqs of ``updates`` when they have
        them (the PS then applies the request in one piece and records the seqs as applied)."""
        if not tables:
            return None
        seqs = [int(u["seq"]) for u in updates if u.get("seq") is not None]
        if not seqs:
            return {"tables": tables}
        sources = {u.get("source") for u in updates if u.get("seq") is not None}
        if len(sources) != 1 or None in sources:
            raise ValueError(f"field 'updates': the updates of one call come from one NN worker (one "
                             f"'source' with every 'seq'), got sources {sorted(map(str, sources))}")
        return {"tables": tables, "source": int(sources.pop()), "seqs": seqs}

    def _update_tables(self, req: dict) -> tuple[list[list[dict]], list[str]]:
        """One NN update (``WorkerUpdate``) as gradient tables per PS replica; takes the batch's
        post-forward entry."""
        looked: _Looked = self.post_buffer.take(int(req["ref"]))
        self.metrics.dec("staleness")
        checked = pipeline.check_gradients(looked.prepared, req["grads"], float(req.get("scale", 1.0)),
                                           req.get("unused_slots", []))
        for name in checked.skipped_non_finite:
            self.metrics.inc("nan_grad_skipped", feat=name)
        return pipeline.split_gradients(looked.prepared.tables, looked.positions, checked), checked.skipped_non_finite

    def update(self, req: dict) -> dict:
        t0 = time.perf_counter()
        parts, skipped = self._update_tables(req)
        requests = [self._tagged(tables, [req]) for tables in parts]
        missing = sum(int(r["missing"]) for r in self._call_ps("Update", requests) if r is not None)
        self.metrics.observe("update_gradient_time_cost_sec", time.perf_counter() - t0)
        return {"missing": missing, "skipped": skipped}

    def _carried_updates(self, req: dict) -> tuple[list[dict | None], list[str]]:
        """A Step's ``updates`` as one PS update request per replica (None: nothing for it), and
        the slots whose non-finite gradients were skipped."""
        t1 = time.perf_counter()
        carried: list[list[dict]] = [[] for _ in self.ps]
        skipped: list[str] = []
        for u in req.get("updates") or []:
            parts, sk = self._update_tables(u)
            skipped += sk
            for s, tables in enumerate(parts):
                carried[s] += tables
        if req.get("updates"):
            self.metrics.observe("update_gradient_time_cost_sec", time.perf_counter() - t1)
        return [self._tagged(t, req.get("updates") or []) for t in carried], skipped

    def step(self, req: dict) -> dict:
        """Earlier batches' gradients (``updates``, applied first) and the lookup of ``ref``, with
        one call per PS replica: what an NN worker sends instead of Update + Lookup."""
        if req.get("lookups"):
            return self._step_lookups(req)
        t0 = time.perf_counter()
        # The lookup's ID features first (they may still be on their way): TooManyWaiting is then
        # answered before anything is done, so the NN worker can send the same Step again.
        try:
            ref, batch, prepared, train = self._take_for_lookup(req)
            lost = None
        except LookupError as exc:  # the lookup cannot run (expired, released): the gradients still land
            lost = exc
        updates, skipped = self._carried_updates(req)
        if lost is not None:
            self._call_ps("Update", updates)
            raise lost
        replay = _replay(req, train)
        positions, lookups = self._lookup_requests(prepared, train, batch.get("batch_id"), replay)
        requests = [
            {"update": updates[s], "lookup": lookups[s]}
            if updates[s] is not None or lookups[s] is not None else None
            for s in range(len(self.ps))
        ]
        replies = self._call_ps("Step", requests)
        missing = sum(int(r["missing"]) for r in replies if r is not None)
        reply = self._reply(prepared, positions,
                            [r if r is not None and lookups[s] is not None else None for s, r in enumerate(replies)],
                            replay is not None)
        self._looked_up(ref, batch, prepared, positions, train, t0)
        return {**reply, "missing": missing, "skipped": skipped}

    def _step_lookups(self, req: dict) -> dict:
        """A Step with several batches' ``lookups``: the carried updates, then every lookup, in one
        call per PS replica (its per-call cost is most of what a batch costs the worker and the
        PS). Each lookup is answered on its own in ``lookups``: its reply, or ``{"error", "kind"}``
        with the status a lone lookup would have got (its ID features lost or expired, or too many
        lookups waiting for theirs); the others go on. Too many waiting on the first lookup, when
        nothing has been done yet, fails the call as it fails a lone Step, to be sent again."""
        t0 = time.perf_counter()
        taken: list[Any] = []
        for i, lookup in enumerate(req["lookups"]):
            try:
                taken.append(self._take_for_lookup(lookup))
            except TooManyWaiting as exc:
                if i == 0:
                    raise
                taken.append(exc)
            except LookupError as exc:  # expired, released, never sent: the gradients still land
                taken.append(exc)
        updates, skipped = self._carried_updates(req)
        ok = [i for i, t in enumerate(taken) if not isinstance(t, BaseException)]
        asked: dict[int, tuple[list, list[dict | None], bool]] = {}
        for i in ok:
            _ref, batch, prepared, train = taken[i]
            replay = _replay(req["lookups"][i], train)
            positions, lookups = self._lookup_requests(prepared, train, batch.get("batch_id"), replay)
            asked[i] = (positions, lookups, replay is not None)
        if not ok:
            replies = self._call_ps("Update", updates)
        else:
            requests = [
                {"update": updates[s], "lookups": [asked[i][1][s] for i in ok]}
                if updates[s] is not None or any(asked[i][1][s] is not None for i in ok) else None
                for s in range(len(self.ps))
            ]
            replies = self._call_ps("Step", requests)
        missing = sum(int(r["missing"]) for r in replies if r is not None)
        answers: list[dict] = []
        for i, t in enumerate(taken):
            if isinstance(t, BaseException):
                kind, detail = rpc.error_status(t)
                answers.append({"error": detail, "kind": kind})
                continue
            ref, batch, prepared, train = t
            positions, lookups, replay = asked[i]
            k = ok.index(i)
            per_replica = [r["lookups"][k] if r is not None and lookups[s] is not None else None
                           for s, r in enumerate(replies)]
            answers.append(self._reply(prepared, positions, per_replica, replay))
            self._looked_up(ref, batch, prepared, positions, train, t0)
        return {"lookups": answers, "missing": missing, "skipped": skipped}

    def release(self, req: dict) -> dict:
        """Forget batches nobody will train on (the uneven tail across DDP ranks, a batch whose
        data loader gave up on it). A ref not buffered is remembered as lost: its ID features
        are refused if they come later, and a lookup waiting for them fails now. At most
        ``messages.MAX_RELEASE_REFS`` refs a call (the schema refuses more); over NATS signed
        with the job secret."""
        released = 0
        for ref in req.get("refs", []):
            if self.forward_buffer.release(int(ref), "was released before its lookup (its data loader gave up "
                                                      "on the batch, or the NN worker dropped it)"):
                released += 1
                continue
            try:
                self.post_buffer.take(int(ref))
                released += 1
            except KeyError:
                continue
        self.metrics.set("num_pending_batches", len(self.forward_buffer))
        return {"released": released}

    def _check_servers(self) -> None:
        """Raises ``ServersMisplaced`` unless every PS of the static list is the replica its
        position says; a replica that does not answer raises its own error."""
        answers = [ps.call("Stats", None, timeout=2.0) for ps in self.ps]
        problem = servers_mismatch([ps.address for ps in self.ps], answers)
        if problem is not None:
            raise ServersMisplaced(problem)
        for i, answer in enumerate(answers):
            self._check_layout(i, answer.get("loaded_checkpoint"))
        self._ps_checked = True

    def _check_layout(self, replica: int, loaded: dict | None) -> None:
        """Raises ``EmbeddingLayoutMismatch`` when PS ``replica`` loaded a checkpoint trained with
        another embedding layout than this worker's config (every lookup would miss: zeros). A
        checkpoint that records none (older) and slots on one side only are logged once."""
        if not loaded:
            return
        recorded = loaded.get("embedding_layout")
        if recorded is None:
            self._note_once(f"PS replica {replica} serves checkpoint {loaded.get('dir')}, which records no "
                            f"embedding layout (written before it was recorded): not checked against this "
                            f"embedding_config.yml")
            return
        why, notes = layout_differences(recorded, self.layout)
        if why is not None:
            raise EmbeddingLayoutMismatch(
                f"PS replica {replica} serves checkpoint {loaded.get('dir')}, trained with another embedding "
                f"layout than this embedding_config.yml: {why}; every lookup would miss and read zeros. Serve it "
                f"with the embedding_config.yml it was trained with")
        for note in notes:
            self._note_once(f"checkpoint {loaded.get('dir')}: {note}")

    def _note_once(self, message: str) -> None:
        if message not in self._layout_noted:
            self._layout_noted.add(message)
            log.warning("%s", message)

    def ready(self) -> dict:
        """Whether lookups can be answered: every PS replica answers (an inference PS opens its port
        once its checkpoint is loaded) and is the replica its position says. What the model
        server's readiness and ``InferCtx.wait_for_serving`` ask (PERSIA's ``ready_for_serving``).
        ``misplaced``: a misconfiguration that waiting does not heal (the static PS list, or with
        ``layout_mismatch`` a checkpoint trained with another embedding config)."""
        try:
            self._check_servers()
        except EmbeddingLayoutMismatch as exc:
            return {"ready": False, "misplaced": True, "layout_mismatch": True, "why": str(exc)}
        except ServersMisplaced as exc:
            return {"ready": False, "misplaced": True, "why": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a PS not up yet (loading) is an answer here, not a failure
            return {"ready": False, "misplaced": False, "why": f"{type(exc).__name__}: {exc}"}
        return {"ready": True, "misplaced": False, "why": f"{len(self.ps)} PS replicas answer"}

    def stats(self) -> dict:
        return {
            "pending": len(self.forward_buffer),
            "in_flight": len(self.post_buffer),
            "expired_forward": self.forward_buffer.expired,
            "expired_post_forward": self.post_buffer.expired,
        }

    def stop(self) -> None:
        self._server.stop(grace=1.0)
        for c in self.ps:
            c.close()

    def wait(self) -> None:
        self._server.wait_for_termination()
