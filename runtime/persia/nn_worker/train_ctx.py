"""Hybrid training on the NN worker: dense parameters synchronously (DDP), embedding gradients
sent back asynchronously, releasing a staleness permit when the PS has applied them."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from persia import env
from persia.allocator import LargeBuffers, has_large_buffers
from persia.bus import subject
from persia.errors import (BatchLost, PersiaError, PersiaValidationError, RemoteError, TooManyWaiting, UnsupportedError,
                           answered_with)
from persia.metrics import Metrics
from persia.nn_worker.embedding_ctx import (
    EmbeddingCtx,
    PreprocessMode,
    configure_embedding_parameter_servers,
    register_optimizer_on_all_ps,
)
from persia.nn_worker.progress import TrainingProgress
from persia.nn_worker import checkpoint_plan
from persia.nn_worker.checkpoint import check_optimizer_state, load_state_file, require_whole, write_atomically
from persia.nn_worker.cpu_placement import TrainingPlacement
from persia.nn_worker.periodic import GracefulStop, PeriodicCheckpointing
from persia.nn_worker.accounting import ACCOUNT, attach_metrics, log_summary
from persia.nn_worker.lookup_group import lookup_group_setting, lookup_group_size
from persia.nn_worker.outbox import PendingUpdate, UpdateOutbox
from persia.nn_worker import embedding_tensors
from persia.nn_worker.next_batch_correction import NextBatchCorrector
from persia.nn_worker.own_updates import OwnUpdates, replay_setting
from persia.nn_worker.staleness import DEFAULT_WARMUP_STEPS
from persia.nn_worker.thread_tuning import ThreadTuner, TuningPlan, candidates_for
from persia.nn_worker.training_batch import PersiaTrainingBatch
from persia.messages import NoPayload
from persia.security import bind_address
from persia.utils import advertise_host, unclaimed_ports

log = logging.getLogger(__name__)


class TrainCtx(PeriodicCheckpointing, EmbeddingCtx):
    """Hybrid training: dense parameters synchronously (DDP), embeddings asynchronously.

    Periodic checkpoints and resume (docs/reliability.md): ``checkpoint_dir``,
    ``checkpoint_interval_steps``, ``checkpoint_interval_seconds``, ``checkpoint_keep`` and
    ``resume`` ("auto", "never" or a checkpoint path) override ``checkpointing_config`` and the
    ``PERSIA_CHECKPOINT_*``/``PERSIA_RESUME`` env variables. After entering, ``ctx.resumed_from``
    is the checkpoint loaded (or None) and ``ctx.start_step`` its step; ``ctx.step`` counts steps
    over the whole job.
    """

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
        checkpoint_dir: str | None = None,
        checkpoint_interval_steps: int | None = None,
        checkpoint_interval_seconds: float | None = None,
        checkpoint_keep: int | None = None,
        resume: str | None = None,
        replay_own_updates: bool | None = None,
        **kwargs,
    ):
        super().__init__(PreprocessMode.TRAIN, *args, **kwargs)
        self._init_checkpointing(checkpoint_plan.settings_from(
            _checkpointing_config(), checkpoint_dir=checkpoint_dir, interval_steps=checkpoint_interval_steps,
            interval_seconds=checkpoint_interval_seconds, keep=checkpoint_keep, resume=resume))
        if self.model is None:
            raise PersiaValidationError("TrainCtx needs model=...")
        if embedding_optimizer is None or not hasattr(embedding_optimizer, "to_wire"):
            raise TypeError(f"embedding_optimizer must be a persia.embedding.optim optimizer, got {embedding_optimizer!r}")
        if grad_scalar_update_factor <= 1:
            raise PersiaValidationError(f"grad_scalar_update_factor must be > 1, got {grad_scalar_update_factor}")
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
        # hybrid training reads its own writes: missed updates re-applied to looked-up rows
        self._own = (OwnUpdates(embedding_optimizer.config, self.embedding_config.weight_bound)
                     if replay_setting(replay_own_updates) and hasattr(embedding_optimizer, "config") else None)
        # replay is exact when the PS applies our updates in seq order: the calls carrying them go
        # one at a time, each holding this from taking its updates out until the PS answered
        self._send_order = threading.RLock() if self._own is not None else None
        # the next batch's replay while the training thread steps (next_batch_correction)
        self._corrector = (NextBatchCorrector(self._correct_next, order=lambda b: int(b.replay["since"]))
                           if self._own is not None else None)
        self._outbox = UpdateOutbox(self._send_alone, max_hold_s=_update_hold_s(), send_lock=self._send_order,
                                    start_flusher=False)  # started at the entry
        self._group_setting = lookup_group_setting()  # PERSIA_LOOKUP_GROUP, checked here
        self._current_batch: PersiaTrainingBatch | None = None
        # training batches a DataLoader handed out and no backward consumed yet, in that order
        self._handed: deque[PersiaTrainingBatch] = deque()
        self._forwarded_no_grad: PersiaTrainingBatch | None = None  # the last forward's, if requires_grad=False
        self._no_backward = 0
        self._subs: list = []  # this context's NATS answers, unsubscribed at its exit
        self._entered = False
        self._control_group = None
        self._thread_tuner: ThreadTuner | None = None
        self._placement: TrainingPlacement | None = None
        self._large_buffers = LargeBuffers()  # reads PERSIA_MALLOC_TUNING now: a bad value fails here
        self._ddp_free_port = env.switch_on("PERSIA_DDP_FREE_PORT", os.environ)  # likewise (it was "1" or not)
        self.trained_batches = 0
        self.skipped_non_finite = 0
        self._last_progress = 0.0
        self._progress = TrainingProgress(self.rank)

    def _leaves_for_good(self, exc: BaseException | None) -> bool:
        return exc is None or isinstance(exc, GracefulStop)  # SIGTERM: the job is being stopped

    def _entry_spans(self) -> list:
        # while it trains on the CPU, a large model's weight gradients come from the heap instead of
        # being mapped and faulted in every step (persia.allocator.LargeBuffers)
        large = self.device.type == "cpu" and has_large_buffers(
            p.numel() * p.element_size() for p in self.model.parameters())
        return super()._entry_spans() + ([self._large_buffers] if large else [])

    def _enter(self) -> None:
        if self._entered:  # its update outbox, pools and corrector ended at its exit
            raise UnsupportedError("this TrainCtx was entered before: a TrainCtx can be entered once; make a new "
                                   "TrainCtx for the next `with` (the embeddings stay on the PS, the dense model "
                                   "in the model object)")
        self._entered = True
        self._outbox.start()
        super()._enter()
        if self.world_size > 1:
            self._init_distributed()
        configure_embedding_parameter_servers(self, self.embedding_config)
        register_optimizer_on_all_ps(self.embedding_optimizer, self)
        self._resume_at_enter()  # before data loaders are answered: they learn where to start
        self._subs += self._serve_checkpoint_subjects()  # nn.position too, before nn.info
        self._start_streaming()  # nn.info, after the resume: data loaders learn where to start
        self._worker_clients()
        self._install_sigterm()
        self.metrics = Metrics("nn_worker", self.rank)
        attach_metrics(self.metrics)
        self._placement = self._place_training_thread()
        self._thread_tuner = self._make_thread_tuner()
        log.info("NN worker rank %d/%d ready on %s", self.rank, self.world_size, self.device)

    def _make_thread_tuner(self) -> ThreadTuner | None:
        """``PERSIA_TORCH_THREADS=auto`` on CPU: measure which torch thread count trains fastest."""
        if not self.tune_torch_threads or self.device.type != "cpu":
            return None
        agree = max_over_ranks(self._control_group) if self.world_size > 1 and self._control_group is not None else None
        plan = TuningPlan(candidates_for(torch.get_num_threads()))
        return ThreadTuner(plan, self._set_torch_threads, time.perf_counter, agree=agree, log=log.info) if plan.tunes else None

    def _place_training_thread(self) -> TrainingPlacement | None:
        """``PERSIA_TRAINING_CPUS`` on CPU: the training thread on a CPU of its own (after the
        helper threads started, so that they stay on the shared CPUs)."""
        if self.device.type != "cpu":
            return None
        placement = TrainingPlacement.from_env(local_rank=env.get_local_rank() or 0)
        return placement.start(torch.get_num_threads()) if placement is not None else None

    def _set_torch_threads(self, threads: int) -> None:
        torch.set_num_threads(threads)
        if self._placement is not None:
            self._placement.threads_changed(threads)

    def _info(self, _req) -> dict:
        """``nn.info``: what a data loader needs, including where to resume its stream."""
        return {**super()._info(_req), "resume": self._resume_info}

    @property
    def _in_step(self) -> bool:
        """Between forward and the end of backward: SIGTERM waits for the step to finish."""
        return self._current_batch is not None or self._in_backward

    def _init_distributed(self) -> None:
        option = self.distributed_option or _default_option(self.device_id)
        master_addr = option.master_addr
        joined = torch.distributed.is_initialized()  # by an earlier TrainCtx: the option reuses it
        if not joined and not option.init_with_env_file() and master_addr is None:
            if self.rank == 0:
                master_addr = advertise_host()
                if option.master_port == 23456 and self._ddp_free_port:
                    # below the ephemeral range: the other ranks may connect before the store
                    # listens, and a port-0 pick could be their connect's own source port
                    option.master_port = unclaimed_ports(1, host=bind_address())[0]
                info = {"addr": master_addr, "port": option.master_port}
                # answered until this context's exit: a later one's ranks must not find this port
                self._subs.append(self.bus.serve(subject("nn", "master"), lambda _o: info, blocking=False,
                                                 schema=NoPayload))
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

    def _dispatched(self, msg: dict, staleness_target: int | None) -> dict:
        """Note below which seq every update of ours is applied as this lookup is dispatched
        (synchronous training, staleness 1, never misses one: nothing to note)."""
        own = self._own
        if own is None or staleness_target == 1 or not msg.get("requires_grad", True):
            return msg  # a batch sent with requires_grad=False is looked up without training: no replay
        return {**msg, "replay": own.query(own.since())}

    def _default_warmup_steps(self) -> int:
        """A DataLoader's staleness ramp when neither it nor the environment sets one: none while
        stale reads are corrected (they cost no AUC, and synchronous steps cost throughput)."""
        return 0 if self._own is not None else DEFAULT_WARMUP_STEPS

    def clear_embeddings(self) -> None:
        """Every PS replica's rows dropped, once this context's pending updates are applied (after
        the clear they would only be dropped as updates of missing rows)."""
        self._wait_for_updates()
        super().clear_embeddings()

    def load_embedding(self, src_dir: str, blocking: bool = True) -> None:
        """Every PS replica's rows loaded, once this context's pending updates are applied: what
        was saved is what is loaded, not that plus gradients of the rows it replaced."""
        self._wait_for_updates()
        super().load_embedding(src_dir, blocking)

    def _embeddings_replaced(self) -> None:
        """A PS that cleared or loaded its rows forgot which of our updates it applied (and the rows
        no longer hold them): our updates are numbered afresh, under a new source; batches looked
        up before are trained on as they were read (and replayed on by the lookup thread)."""
        if self._own is not None:
            self._own = self._own.renewed()

    def _prebuild(self, batch: PersiaTrainingBatch) -> None:
        """In the lookup thread: replay the updates already sent that the read missed, then build
        the tensors from the corrected rows."""
        own = self._own
        if batch.replay is not None and batch.requires_grad and own is not None:
            own.correct_ahead(batch.emb_tables, batch.replay)
        super()._prebuild(batch)
        if batch.replay is not None and batch.requires_grad and self._corrector is not None:
            self._corrector.ready(batch)  # exists with replay on (own is not None)

    def _correct_next(self, batch: PersiaTrainingBatch) -> None:
        """In the corrector's thread: the updates sent since the batch's read, on its rows and
        the tensors built from them (the corrector exists only with replay on)."""
        self._patch(batch, self._own.correct_next(batch.emb_tables, batch.replay))

    @staticmethod
    def _patch(batch: PersiaTrainingBatch, fixed) -> None:
        """The tensors built ahead read the rows before the updates ``fixed`` replayed."""
        if fixed.replayed and batch.prepared is not None:
            for i, (table, touched) in enumerate(zip(batch.emb_tables, fixed.touched)):
                if touched is not None:
                    embedding_tensors.patch(batch.prepared.slots, i, table["rows"], touched)

    def _prepare_with_replay(self, persia_training_batch: PersiaTrainingBatch):
        batch = persia_training_batch
        if batch.replay is not None and batch.requires_grad and self._own is not None:
            if self._corrector is not None:
                self._corrector.take(batch)
            self._patch(batch, self._own.correct(batch.emb_tables, batch.replay))
        return super().prepare_features(batch)

    def forward(self, batch: PersiaTrainingBatch):
        output, labels = super().forward(batch)
        self._progress.saw(output, labels)  # for the live AUC (nn.progress, /metrics)
        return output, labels

    def _run_model(self, non_id, emb):
        if self.grad_scaler is not None:
            with torch.autocast("cuda", dtype=torch.float16):
                output = self.model(non_id, emb)
            return float32_outputs(output)
        return self.model(non_id, emb)

    # -- backward ---------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, embedding_gradient_check_frequency: int = 20) -> torch.Tensor:
        """Backprop, send embedding gradients (async), step the dense optimizer synchronously; then
        a periodic checkpoint when due, or the end of training when SIGTERM arrived.

        A step whose loss or gradients are not finite changes nothing (no dense step, no embedding
        update), is counted by reason and warned about; every ``embedding_gradient_check_frequency``
        steps the dense parameters are checked, and non-finite ones stop training with an error.
        """
        self._in_backward = True
        try:
            scaled = self._backward_step(loss, embedding_gradient_check_frequency)
        finally:
            self._in_backward = False
        if self._thread_tuner is not None:
            self._thread_tuner.step_done()
        if self._placement is not None:
            self._placement.step_done()
        self._after_step()
        return scaled

    def _backward_step(self, loss: torch.Tensor, check_every: int) -> torch.Tensor:
        self._raise_update_error()
        batch = self._current_batch
        if batch is None:
            raise PersiaError(self._why_no_training_batch())
        self._current_batch = None
        self._consumed(batch)
        # Backward runs before the loss is checked, so that every finiteness question of the step
        # is answered by one read of the device (on a GPU each read waits for its queue to drain,
        # and one before backward would stop the host from queueing backward behind the forward).
        # With DDP every rank runs backward anyway (its all-reduce needs all of them); the
        # all-reduced dense gradients then tell every rank alike whether to step.
        scaled = self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss
        try:
            scaled.backward()
        except BaseException:
            # the script may catch it and go on: this batch must not keep its permit and entry
            self.dense_optimizer.zero_grad(set_to_none=True)
            self._let_go(batch, "backward_failed")
            raise
        grads = []  # one per dim: a row per distinct ID (autograd summed its occurrences)
        non_finite = False
        for grad in batch.embedding_grads():
            if grad is None:
                grads.append(None)
                continue
            g = grad.detach().to("cpu", torch.float32).numpy()
            if not np.isfinite(g).all():
                non_finite = True
            grads.append(g)
        # under AMP the grad scaler checks the dense gradients itself
        loss_finite, dense_finite = finite_step(loss, [] if self.grad_scaler is not None
                                                else _dense_grads(self.dense_optimizer))
        if not loss_finite and self.world_size == 1:
            self.dense_optimizer.zero_grad(set_to_none=True)
            self._skip_step(batch, "non_finite_loss")
            return loss
        if self.grad_scaler is not None:
            # AMP: an overflow is how the scaler finds its scale; it skips the dense step itself
            scale = float(self.grad_scaler.get_scale())
            self._send_update(batch, [None] * len(grads) if non_finite else grads, scale)
            self.grad_scaler.step(self.dense_optimizer)
            self.grad_scaler.update(scale / self.grad_scalar_update_factor if non_finite else None)
            self.dense_optimizer.zero_grad(set_to_none=True)
            if non_finite:
                self._account_skip(batch, "amp_overflow")
            else:
                self._account_trained(batch, loss)
            return scaled
        if not dense_finite:
            self.dense_optimizer.zero_grad(set_to_none=True)
            self._skip_step(batch, "non_finite_dense_grad" if loss_finite else "non_finite_loss")
            return scaled
        if non_finite and self.world_size == 1:
            self.dense_optimizer.zero_grad(set_to_none=True)
            self._skip_step(batch, "non_finite_embedding_grad")
            return scaled
        # (DDP: a rank whose own embedding gradients are not finite still steps the dense part with
        # the others, so the replicas stay equal; only its embedding update is skipped.)
        self._send_update(batch, [None] * len(grads) if non_finite else grads, 1.0)
        self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        if non_finite:
            self._account_skip(batch, "non_finite_embedding_grad")
        else:
            self._account_trained(batch, loss)
        if self.trained_batches % max(1, check_every) == 0:
            self.check_dense_finite()
        return scaled

    def _handed_out(self, batch: PersiaTrainingBatch) -> None:
        """A DataLoader loop yielded ``batch``: a training one must get a backward (or be let go
        of when a later one is trained: :meth:`_release_skipped`)."""
        if batch.requires_grad:
            self._handed.append(batch)

    def _consumed(self, batch: PersiaTrainingBatch) -> None:
        handed = self._handed
        if handed and handed[0] is batch:  # the usual order: O(1)
            handed.popleft()
        else:
            for i, b in enumerate(handed):
                if b is batch:
                    del handed[i]
                    break

    def _why_no_training_batch(self) -> str:
        """What backward() says when no training batch was forwarded since the last one."""
        no_grad = self._forwarded_no_grad
        if no_grad is None:
            return "backward() without a training batch: call ctx.forward(batch) first"
        if no_grad.settled is not None:
            how = ("trained (its backward ran)" if no_grad.settled == "trained" else
                   f"let go without being trained (counted {no_grad.settled})")
            return (f"backward(): the batch of the last forward (batch_id {no_grad.batch_id}) was already {how}: "
                    "a batch is trained once; forward it again only to evaluate it (under torch.no_grad())")
        if no_grad.ref is None:
            return (f"backward(): the batch of the last forward (batch_id {no_grad.batch_id}) was looked up directly "
                    "(an IterableDataset, get_embedding_from_data): only batches streamed from data loaders "
                    "(StreamingDataset) can be trained; evaluate it (under torch.no_grad())")
        return (f"backward(): the batch of the last forward (batch_id {no_grad.batch_id}) was sent with "
                "requires_grad=False: it takes no gradient; evaluate it (under torch.no_grad()) and call "
                "backward() for training batches only (batch.requires_grad)")

    def _let_go(self, batch: PersiaTrainingBatch, outcome: str) -> None:
        """Nothing of ``batch`` is applied: its embedding-worker entry and staleness permit are
        freed (an update without gradients), and it is counted failed with ``outcome``; it was
        consumed by the loop, so a resumed loader skips it (``checkpoint_plan.CONSUMED``)."""
        self._consumed(batch)
        self._send_update(batch, [None] * len(batch.emb_tables), 1.0)
        batch.settled = outcome
        ACCOUNT.fail(outcome)
        self._advance_position(batch.loader, outcome)

    def _release_skipped(self, batch: PersiaTrainingBatch | None) -> None:
        """Training on ``batch`` starts (None: training ends): every training batch handed out
        before it that got no backward (a loop that skips batches, a forward without backward)
        is released, its embedding-worker entry and staleness permit freed, and counted
        ``no_backward``. Before, each held its permit for good: the loop stopped once the bound
        was used up, and failed 10 minutes later with a timeout that blamed the data."""
        skipped = []
        current = self._current_batch
        if current is not None and current is not batch:
            self._current_batch = None
            skipped.append(current)
        handed = self._handed
        if batch is None or any(b is batch for b in handed):
            while handed and handed[0] is not batch:
                b = handed.popleft()
                if b is not current:
                    skipped.append(b)
        for b in skipped:
            self._no_backward_for(b)

    def _no_backward_for(self, batch: PersiaTrainingBatch) -> None:
        self._let_go(batch, "no_backward")
        self._no_backward += 1
        if self._no_backward == 1 or self._no_backward % 100 == 0:
            log.warning("a training batch (batch_id %s) got no backward: it is released, counted 'no_backward' "
                        "(%d so far); every training batch a DataLoader yields needs its own ctx.backward(loss) "
                        "before the next one is trained (a loss over several batches trains the last one's "
                        "embeddings only), or it is skipped this way", batch.batch_id, self._no_backward)

    def _release_beyond(self, limit: int | None) -> None:
        """The loop asks for its next batch: while the training batches handed out without a
        backward hold every staleness permit (``limit``), no further batch can be looked up and
        the loop would wait until its timeout (at staleness 1: a batch skipped with ``continue``,
        or forwarded before a ``break`` and a new loop). The oldest of them are let go
        (``no_backward``) until one permit can be free."""
        if limit is None:
            return
        holding = [b for b in self._handed if b.holds_permit]
        for b in holding[:max(0, len(holding) - limit + 1)]:
            if b is self._current_batch:
                self._current_batch = None
            self._no_backward_for(b)

    def _abandon_in_training(self) -> None:
        """The context is left by an exception: the batches handed out and not trained (the one
        between its forward and backward among them) are counted ``abandoned`` (a resumed loader
        sends them again) and let go on their embedding workers, best effort: the exception may
        be theirs."""
        batches = list(self._handed)
        current, self._current_batch = self._current_batch, None
        if current is not None and all(b is not current for b in batches):
            batches.append(current)
        self._handed.clear()
        for b in batches:
            b.settled = "abandoned"
            ACCOUNT.fail("abandoned")
            if b.holds_permit and self._permits is not None:
                self._permits.release()
        if batches:
            self._release_refs([{"worker": b.worker, "ref": b.ref} for b in batches if b.ref is not None])

    def prepare_features(self, persia_training_batch: PersiaTrainingBatch):
        if persia_training_batch.requires_grad and persia_training_batch.settled is None:
            self._release_skipped(persia_training_batch)
            self._forwarded_no_grad = None
        else:  # sent requires_grad=False, or already trained: backward() on it says why it cannot
            self._forwarded_no_grad = persia_training_batch
        return self._prepare_with_replay(persia_training_batch)

    def _skip_step(self, batch: PersiaTrainingBatch, reason: str) -> None:
        """Nothing of this batch is applied; its embedding-worker entry and permit are released."""
        self._send_update(batch, [None] * len(batch.emb_leaves), 1.0)
        batch.settled = reason
        self._account_skip(batch, reason)
        self.check_dense_finite()  # a model already broken makes every later step non-finite too

    def _account_skip(self, batch: PersiaTrainingBatch, reason: str) -> None:
        """A consumed batch that changed nothing: failed, and not to be sent again on resume."""
        self.skipped_non_finite += 1
        ACCOUNT.fail(reason)
        self._count_trained(batch.loader, reason)
        if self.skipped_non_finite == 1 or self.skipped_non_finite % 100 == 0:
            log.warning("skipped a training step: %s (%d skipped so far: %s)", reason.replace("_", " "),
                        self.skipped_non_finite, dict(ACCOUNT.failed))
        self._report_progress()

    def _account_trained(self, batch: PersiaTrainingBatch, loss: torch.Tensor) -> None:
        self.trained_batches += 1
        ACCOUNT.add("trained")
        self._progress.trained(loss)
        self._count_trained(batch.loader)
        self._report_progress()

    def check_dense_finite(self) -> None:
        """Raise if a dense parameter is NaN/Inf: training on would only spread it."""
        named = list(self.model.named_parameters())
        if all_finite([p for _, p in named]):
            return
        for name, p in named:  # which one (or none: a sum of large finite values overflowed)
            if not bool(torch.isfinite(p.detach()).all()):
                raise NonFiniteModel(
                    f"dense parameter {name!r} became non-finite after {self.trained_batches} trained steps "
                    f"(skipped non-finite steps: {dict(ACCOUNT.failed) or 'none'}); training cannot continue: "
                    "lower the learning rate or check the input data")

    def _send_update(self, batch: PersiaTrainingBatch, grads: list, scale: float) -> None:
        """Leave the batch's gradients for the next lookup to its embedding worker to carry
        (:mod:`persia.nn_worker.outbox`); bounded by ``backward_buffer_size`` updates."""
        self._backward_slots.acquire()
        unused = batch.unused_slots()
        batch.settled = batch.settled or "trained"  # a later forward of it only evaluates
        batch.earlier_leaves = []
        update = PendingUpdate(batch.worker, batch.ref, grads, scale, batch.holds_permit, unused_slots=unused)
        if self._own is not None:
            update.source = self._own.source
            update.seq = self._own.sent(batch.emb_tables, batch.embeddings, grads, scale, unused)
            if self._corrector is not None:
                self._corrector.update_sent()
        self._outbox.put(update)

    def _track(self) -> Future:
        """A future ``_wait_for_updates`` waits for, and whose failure the next step raises."""
        fut: Future = Future()
        with self._pending_lock:
            self._pending.add(fut)
        fut.add_done_callback(self._update_done)
        return fut

    def _applied(self, update: PendingUpdate, passes_permit: bool = False) -> None:
        if update.holds_permit and not passes_permit and not update.reserved and self._permits is not None:
            self._permits.release()
        if self._own is not None:
            self._own.acked(update.seq)
        self._backward_slots.release()

    def _call_applying(self, worker: int, method: str, request: dict, updates: list[PendingUpdate],
                       passes: PendingUpdate | list[PendingUpdate] | None = None, fut: Future | None = None) -> dict:
        """``method`` on embedding worker ``worker``, which applies ``updates``: their future and
        permits follow the call (``passes``: the updates whose permits go on to new lookups)."""
        passing = [] if passes is None else [passes] if isinstance(passes, PendingUpdate) else list(passes)
        fut = fut or self._track()
        error: BaseException | None = None
        try:
            return self._call_worker(worker, method, request)
        except BaseException as exc:
            # BatchLost: the lookup's ID features were lost; the worker applied the updates
            error = None if answered_with(exc, BatchLost) else exc
            raise
        finally:
            try:
                for u in updates:
                    self._applied(u, passes_permit=any(u is p for p in passing))
            except BaseException as exc:
                # the future too: nobody waits for the flusher's sends, and this must not vanish
                error = error or exc
                raise
            finally:
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)

    def _update_now(self, update: PendingUpdate, passes_permit: bool = False, fut: Future | None = None) -> None:
        """Send one update on its own (blocking) and account for it."""
        self._call_applying(update.worker, "Update", update.message(), [update],
                            passes=update if passes_permit else None, fut=fut)

    def _send_alone(self, update: PendingUpdate) -> None:
        """The outbox's flusher: an update no lookup carried in time goes on its own (with
        replay: now, in this thread, in order)."""
        fut = self._track()  # now, so that _wait_for_updates cannot miss it before the pool runs it
        if self._send_order is not None:
            with self._send_order:
                try:
                    self._update_now(update, fut=fut)
                except BaseException:  # noqa: BLE001 - recorded by its future, raised at the next step
                    pass
            return

        def send():
            try:
                self._update_now(update, fut=fut)
            except BaseException:  # noqa: BLE001 - recorded by its future, raised at the next step
                pass

        self._backward_pool.submit(send)

    def _claim_permit(self) -> PendingUpdate | None:
        """For a dispatcher out of staleness permits: a pending update whose permit it may take
        over (the update is applied before its lookup, in the same call). With replay it stays
        in the outbox, reserved, so that no later update overtakes it."""
        if self._send_order is not None:
            return self._outbox.reserve_permit()
        return self._outbox.claim_permit()

    def _transfer_cancelled(self, update: PendingUpdate) -> None:
        """The lookup that took over ``update``'s permit was cancelled (shutdown): the update
        still goes, and the permit is given back."""
        if self._send_order is None:
            self._send_alone(update)
            return
        with self._send_order:
            if self._outbox.take(update):
                update.reserved = False  # its permit is released when it is applied
                self._send_alone(update)
            elif update.holds_permit and self._permits is not None:
                self._permits.release()  # already applied, its permit kept for the lookup

    def _permit_condition(self) -> threading.Condition:
        """The condition a dispatcher out of permits waits on: a permit released and an update
        put both notify it (the permits are made with it)."""
        return self._outbox.condition

    def _lookup_call(self, worker: int, msg: dict, transferred: PendingUpdate | None = None) -> dict:
        """``Step``: this worker's pending updates (and ``transferred``), then the lookup."""
        request = _lookup_request(msg)
        resp = self._carrying(worker, request, [] if transferred is None else [transferred], alone="Lookup")
        return _with_replay(resp, msg.get("replay"))

    def _lookup_messages(self, msgs: list[dict], holds_permit: list[bool], transferred: list) -> list:
        """The lookups of several batches of one embedding worker in one ``Step`` (with this
        worker's pending updates and the ``transferred`` ones, applied first); each batch, or the
        error it alone failed with. A lookup the worker could not start because too many wait for
        their ID features is sent again on its own, as a lone lookup would be."""
        worker = int(msgs[0]["worker"])
        lookups = [_lookup_request(m) for m in msgs]
        try:
            resp = self._carrying(worker, {"lookups": lookups}, [t for t in transferred if t is not None], alone="Step")
        except BaseException as exc:  # noqa: BLE001 - every batch of the call fails with it
            return [self._lookup_failed(m, h, exc) for m, h in zip(msgs, holds_permit)]
        out: list = []
        for msg, holds, lookup, answer in zip(msgs, holds_permit, lookups, resp["lookups"]):
            try:
                if "error" in answer:
                    exc = RemoteError(f"embedding worker {worker}: Step, lookup of ref {lookup['ref']}",
                                      answer["error"], kind=answer["kind"])
                    if not answered_with(exc, TooManyWaiting):
                        raise exc
                    answer = self._call_worker(worker, "Lookup", lookup)
            except BaseException as exc:  # noqa: BLE001 - that batch's future raises it
                out.append(self._lookup_failed(msg, holds, exc))
                continue
            out.append(self._training_batch(msg, holds, _with_replay(answer, msg.get("replay"))))
        return out

    def _lookup_group_size(self) -> int:
        """Batches per lookup call (``persia.nn_worker.lookup_group``)."""
        return lookup_group_size(self._group_setting, self._own is not None, self.world_size)

    def _carrying(self, worker: int, request: dict, transfers: list[PendingUpdate], alone: str) -> dict:
        """``request`` to embedding worker ``worker`` carrying its pending updates and the
        ``transfers`` (updates whose permits lookups took over), applied before its lookups: a
        ``Step``, or ``alone`` when it carries none."""
        # while another call carries updates, a lookup with no permit to take over carries none
        ordered = self._send_order is not None and self._send_order.acquire(blocking=bool(transfers))
        try:
            carried = [] if self._send_order is not None and not ordered else self._outbox.claim_for(worker)
            for transferred in transfers:
                if self._send_order is not None:
                    # reserved, left in the outbox: applied by an earlier call (in order) if no
                    # longer pending; else carried, or applied now when it belongs to another worker
                    if not any(u is transferred for u in carried) and self._outbox.take(transferred):
                        if transferred.worker == worker:
                            carried.append(transferred)
                        else:
                            self._update_now(transferred)
                elif transferred.worker == worker:
                    carried.append(transferred)
                else:  # another worker's batch: applied first on its own, its permit passes on
                    self._update_now(transferred, passes_permit=True)
            if self._own is not None:
                # Around a replacement of the embeddings (clear, load) the updates numbered under
                # the source before it go first, each alone: a call carries one source's updates.
                for u in [u for u in carried if u.source != self._own.source]:
                    carried.remove(u)
                    self._update_now(u, passes_permit=any(u is t for t in transfers))
            if not carried:
                return self._call_worker(worker, alone, request)
            carried.sort(key=lambda u: u.queued_at)
            request["updates"] = [u.message() for u in carried]
            return self._call_applying(worker, "Step", request, carried, passes=transfers)
        finally:
            if ordered:
                self._send_order.release()

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
        self._outbox.flush()
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
                with self._pending_lock:
                    staleness = len(self._pending) + len(self._outbox)
                # handed to the bus loop without waiting for it (NatsBus.publish_soon)
                self.bus.publish_soon(subject("nn", "progress"),
                                      self._progress.report(self.rank, self.trained_batches, staleness))
            except Exception:  # noqa: BLE001 - progress is best effort
                pass

    # -- checkpoints ------------------------------------------------------------------------------
    def dump_checkpoint(self, dst_dir: str, dense_model_filename: str = "dense.pt",
                        jit_dense_model_filename: str = "jit_dense.pt", opt_filename: str = "opt.pt",
                        blocking: bool = True, with_jit_model: bool = False) -> None:
        self._wait_for_updates()
        directory = self._local_dir(dst_dir)
        self._begin_dump(directory)
        optimizer_state = self.dense_optimizer.state_dict()
        write_atomically(directory / opt_filename, lambda tmp: torch.save(optimizer_state, tmp))
        super().dump_checkpoint(str(directory), dense_model_filename, jit_dense_model_filename, blocking, with_jit_model)

    def load_checkpoint(self, src_dir: str, map_location: str | None = None, dense_model_filename: str = "dense.pt",
                        opt_filename: str = "opt.pt", blocking: bool = True) -> None:
        """Dense model, dense optimizer and every PS shard, all or nothing: every file is read and
        validated, and every PS replica has staged its rows, before anything live changes."""
        self._wait_for_updates()
        directory = self._local_dir(src_dir)
        require_whole(directory)
        appliers = self._dense_appliers(directory, dense_model_filename, opt_filename, map_location)
        self._load_all_or_nothing(directory, appliers, blocking)

    def _dense_appliers(self, directory, dense_filename: str, opt_filename: str, map_location) -> list:
        """Read and validate the dense model and optimizer files; returns what applies them."""
        appliers = self._dense_loader(directory, dense_filename, map_location)
        opt_path = directory / opt_filename
        if not opt_path.is_file():  # a checkpoint an eval or inference context wrote has none
            log.warning("%s: no dense optimizer file (opt_filename %r): the dense optimizer starts afresh",
                        opt_path, opt_filename)
        else:
            opt_state = load_state_file(opt_path, map_location or self.device)  # a damaged one named
            check_optimizer_state(self.dense_optimizer, opt_state, opt_path)
            appliers.append(lambda: self.dense_optimizer.load_state_dict(opt_state))
        return appliers

    def _exit(self, exc: BaseException | None) -> None:
        graceful = isinstance(exc, GracefulStop)
        try:
            if exc is None or graceful:
                self._release_skipped(None)  # the last batches handed out, if no backward took them
                self._wait_for_updates()
                self.check_dense_finite()
            else:
                self._abandon_in_training()
            if graceful:
                self._stop_between_steps()
        finally:
            if self._placement is not None:  # every thread back where the process started, first
                self._placement.stop()
                self._placement = None
            if self._corrector is not None:
                self._corrector.stop()
            log_summary(self.rank, complete=exc is None)
            self._outbox.close()  # what no lookup carried goes on its own, before the pool stops
            log.info("embedding updates: %d carried on lookups, %d sent alone",
                     self._outbox.carried, self._outbox.sent_alone)
            self._restore_sigterm()
            for sub in self._subs:  # a later TrainCtx in this process answers instead
                self.bus.unsubscribe(sub)
            self._subs = []
            self._backward_pool.shutdown(wait=exc is None or graceful)
            self.bus.flush()
            try:
                super()._exit(exc)
            finally:
                self._drop_ddp()

    def _drop_ddp(self) -> None:
        """``model`` is the user's module again, and the DDP wrapper is freed now, while its process
        group is alive: a script may destroy the group while it still holds this context, and a
        DDP reducer freed after that (at the next ``ctx =``) made the group's destructor wait for
        gloo threads that never ended (a hang). The group itself stays for a later TrainCtx."""
        ddp = self.model
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return
        self.model = ddp.module
        self._control_group = None
        alive = weakref.ref(ddp)
        del ddp
        if alive() is not None:  # held by a reference cycle: collect it here, not at some later point
            gc.collect()



class NonFiniteModel(PersiaError):
    """The dense model's parameters are NaN/Inf."""


def _lookup_request(msg: dict) -> dict:
    """A training lookup of a streamed batch (``WorkerLookup``), with its replay query if any."""
    request = {"ref": int(msg["ref"]), "train": True}
    if msg.get("replay") is not None:
        request["replay"] = msg["replay"]
    return request


def _with_replay(resp: dict, replay: dict | None) -> dict:
    """A lookup reply made ready for own-update replay: the source and since it answers about, and
    each table's signs (what the PS applies of this batch's update names rows by sign)."""
    if replay is not None:
        resp["replay"].update(replay)
        for table, extra in zip(resp["tables"], resp["replay"]["tables"]):
            table["signs"] = extra["signs"]
    return resp


def max_over_ranks(group):
    """The element-wise maximum of a list of floats over the ranks of ``group`` (an all-reduce)."""

    def agree(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
        return t.tolist()

    return agree


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN or Inf in any of ``tensors``, with one device sync.

    A NaN or Inf anywhere makes that tensor's sum non-finite, so one sum per tensor answers the
    common case. ``torch.isfinite(t).all()`` per tensor allocates a mask of every element: on the
    FFNN's 12.9M parameters that took 107 ms against 2.7 ms for the sums (docs/benchmarks.md).
    A sum of large finite values can overflow to Inf, so a non-finite sum is confirmed element-wise.
    """
    return finite_step(None, tensors)[1]


def finite_step(loss: torch.Tensor | None, tensors: list[torch.Tensor]) -> tuple[bool, bool]:
    """``(loss has no NaN/Inf, no tensor of tensors has one)``, read from the device at once (the
    rare confirmation below aside): one float per question, finite where the answer is yes.
    ``loss`` None counts as finite."""
    # As few torch calls as it takes (no grad graph, one stack, one read): it runs on the training
    # thread every step, and each call is a chance for another thread to take the GIL.
    with torch.no_grad():
        complex_ok = all(bool(torch.isfinite(t).all()) for t in tensors if t.is_complex())
        floats = [t for t in tensors if t.is_floating_point()]
        # half-precision sums in float32: a float16 sum overflows at 65,504 (stack promotes the rest)
        values = [t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum() for t in floats]
        if loss is not None:  # a scalar loss itself (it cannot overflow); else 1 where all is finite, inf where not
            flag = loss.reshape(()) if loss.numel() == 1 else 1.0 / torch.isfinite(loss).all().float()
            values.insert(0, flag.to(floats[0].device) if floats and flag.device != floats[0].device else flag)
        if not values:
            return True, complex_ok
        read = torch.isfinite(torch.stack(values)).tolist()
        loss_ok = read.pop(0) if loss is not None else True
        # a sum of large finite values can overflow: a non-finite sum is confirmed element-wise
        sums_ok = all(read) or all(bool(torch.isfinite(t).all()) for t in floats)
    return loss_ok, complex_ok and sums_ok


_HALF = (torch.float16, torch.bfloat16)


def _dense_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def float32_outputs(output):
    """Half-precision model outputs as float32, so that the loss runs in float32 outside autocast.

    Under autocast a model ending in ``sigmoid`` returns float16, and ``BCELoss(float16 output,
    float32 label)`` fails ("Found dtype Float but expected Half": the adult-income example on a
    GPU); torch also lists BCE among the ops unsafe in float16. Plain tuples, lists and dicts of
    outputs are converted element by element; anything else is returned as it is.
    """
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() and output.dtype != torch.float32 else output
    if type(output) in (list, tuple):
        return type(output)(float32_outputs(o) for o in output)
    if type(output) is dict:
        return {k: float32_outputs(v) for k, v in output.items()}
    return output


def _update_hold_s() -> float:
    """How long an update may wait for a lookup to carry it (``PERSIA_UPDATE_HOLD_MS``, default 50)."""
    return env.float_in_range("PERSIA_UPDATE_HOLD_MS", os.environ.get("PERSIA_UPDATE_HOLD_MS", "50"),
                              0, 60_000, "milliseconds") / 1000.0


def _checkpointing_config():
    """``checkpointing_config`` of the job's global config (``PERSIA_GLOBAL_CONFIG``), if any."""
    path = os.environ.get("PERSIA_GLOBAL_CONFIG")
    if not path:
        return None
    from persia.config import load_global_config

    return load_global_config(path).common_config.checkpointing_config


def _default_option(device_id):
    from persia.nn_worker.distributed import get_default_distributed_option

    return get_default_distributed_option(device_id)
