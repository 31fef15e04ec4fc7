"""Periodic checkpoints, resume and all-or-nothing loads, in one process: real nats-server, real
gRPC PS replicas and embedding workers on loopback, a real DataCtx (thread) and TrainCtx."""

from __future__ import annotations

import json
import os
import queue
import signal
import threading

import numpy as np
import pytest
import torch

from persia.bus import shared_bus, subject
from persia.ctx import DataCtx, TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.data_loader import stream as loader_stream
from persia.data_loader.stream import end_of_stream
from persia.embedding.optim import Adagrad
from persia.nn_worker import accounting
from persia.nn_worker import checkpoint_plan as plan
from persia.nn_worker.checkpoint import CheckpointLoadError

from .cluster import cluster
from .test_training_path import Model, eval_embeddings, make_batch, send_in_thread, train_stream

pytestmark = pytest.mark.integration

PROBE = [make_batch(700 + i, requires_grad=False) for i in range(2)]


def run_job(model, n_batches, tmp_path, at_end=None, **ckpt):
    """One training job over batches 0..n-1 (staleness 1: deterministic); returns the ctx."""
    errors: list = []
    sender = send_in_thread([make_batch(i) for i in range(n_batches)], errors)
    with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                  checkpoint_dir=str(tmp_path / "ckpts"), **ckpt) as ctx:
        for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, reproducible=True):
            out, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
        ctx.wait_for_pending_updates()
        if at_end is not None:
            at_end(ctx)
    sender.join(30)
    assert not errors, errors
    return ctx


def test_periodic_checkpoints_are_published_atomically_and_retained(persia_env, tmp_path):
    events: queue.Queue = queue.Queue()
    bus = shared_bus()
    bus.subscribe_events(subject("checkpoint", "published"), events.put)
    with cluster(num_ps=2):
        latest = []
        ctx = run_job(Model(), 8, tmp_path, checkpoint_interval_steps=3, checkpoint_keep=2,
                      at_end=lambda _c: latest.append(bus.request(subject("checkpoint", "latest"), None, timeout=5)))
    root = tmp_path / "ckpts"
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000000000003", "ckpt-000000000006"]
    marker = json.loads((root / "ckpt-000000000006" / "COMPLETE").read_text())
    assert marker["step"] == 6 and marker["format"] == "persia-k8s-checkpoint/2"
    assert {"dense.pt", "opt.pt", "progress.json", "s0", "s1", "embedding_dump_done"} <= set(marker["parts"])
    progress = json.loads((root / "ckpt-000000000006" / "progress.json").read_text())
    assert progress == {"step": 6, "world_size": 1, "loaders": {"0": {"0": 6}}, "loader_size": 1}
    got = [events.get(timeout=10) for _ in range(2)]
    assert [e["step"] for e in got] == [3, 6]
    assert got[1]["path"] == str(root / "ckpt-000000000006")
    assert ctx.step == 8 and ctx.resumed_from is None and len(ctx.checkpoint_seconds) == 2
    assert ctx.metrics.get("checkpoint_time_cost_sec_count") == 2  # on /metrics too
    assert latest[0] == {"step": 6, "time": got[1]["time"], "path": got[1]["path"], "resumed_from": None}


def test_resumed_job_ends_in_the_same_state_as_an_undisturbed_one(persia_env, tmp_path):
    """Job A trains 8 batches. Job B trains 5 (checkpoints at 3), dies; job C (fresh PS and
    workers) resumes from step 3 with the unchanged 8-batch stream: its loader skips the 3 trained
    batches, and the final dense model and embeddings equal A's exactly (staleness 1)."""
    torch.manual_seed(0)
    model_a = Model()
    init = {k: v.clone() for k, v in model_a.state_dict().items()}
    with cluster(num_ps=2):
        run_job(model_a, 8, tmp_path / "a")
        expected = eval_embeddings(model_a, PROBE)
    model_b = Model()
    model_b.load_state_dict(init)
    with cluster(num_ps=2):
        run_job(model_b, 5, tmp_path / "b", checkpoint_interval_steps=3)
    model_c = Model()  # a restarted process: fresh parameters, the checkpoint brings them back
    with cluster(num_ps=2):
        ctx = run_job(model_c, 8, tmp_path / "b", checkpoint_interval_steps=100)
        assert ctx.resumed_from == str(tmp_path / "b" / "ckpts" / "ckpt-000000000003")
        assert (ctx.start_step, ctx.step, ctx.trained_batches) == (3, 8, 5)
        resumed = eval_embeddings(model_c, PROBE)
    for p, q in zip(model_a.parameters(), model_c.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for a, b in zip(expected, resumed):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_resume_never_starts_from_zero(persia_env, tmp_path):
    with cluster():
        run_job(Model(), 4, tmp_path, checkpoint_interval_steps=2)
    with cluster():
        ctx = run_job(Model(), 4, tmp_path, resume="never")
    assert ctx.resumed_from is None and ctx.start_step == 0 and ctx.step == 4


def test_a_resume_that_is_neither_a_mode_nor_a_directory_is_refused_at_entry_naming_where_it_came_from(
        persia_env, tmp_path, monkeypatch):
    """``PERSIA_RESUME=yes`` failed in the load with ``yes: no embedding_dump_done marker``."""
    from persia.errors import PersiaValidationError

    monkeypatch.setenv("PERSIA_RESUME", "yes")
    model = Model()
    with cluster():
        with pytest.raises(PersiaValidationError, match=r"resume='yes' \(from env PERSIA_RESUME='yes'\) must be "
                                                        r"'auto', 'never' or an existing checkpoint directory"):
            with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                          dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          checkpoint_dir=str(tmp_path / "ckpts")):
                pass


def test_a_restart_of_a_run_resumes_from_its_own_checkpoints_whatever_resume_says(persia_env, tmp_path,
                                                                                   monkeypatch):
    """``resume: never`` (or a path) reaches every restart of the job too: a restarted job started
    over from scratch, or from the warm-start path, losing everything since. Checkpoints record
    their run (``PERSIA_RUN_ID``); a restart of that run resumes from its newest one."""
    with cluster():
        run_job(Model(), 4, tmp_path, checkpoint_interval_steps=2)  # an earlier job's checkpoints
    monkeypatch.setenv("PERSIA_RUN_ID", "run-2")
    with cluster():
        first = run_job(Model(), 5, tmp_path, resume="never", checkpoint_interval_steps=3)
    assert first.resumed_from is None and first.start_step == 0  # the job itself starts fresh
    with cluster():  # its restart: the same run, the same settings
        again = run_job(Model(), 5, tmp_path, resume="never", checkpoint_interval_steps=100)
    assert again.resumed_from == str(tmp_path / "ckpts" / "ckpt-000000000003")
    assert (again.start_step, again.step) == (3, 5)
    monkeypatch.setenv("PERSIA_RUN_ID", "run-3")  # a new run with resume: never starts fresh again
    with cluster():
        fresh = run_job(Model(), 2, tmp_path, resume="never", checkpoint_interval_steps=100)
    assert fresh.resumed_from is None and fresh.start_step == 0


def test_a_refused_shard_changes_nothing_on_any_replica_nor_the_dense_model(persia_env, tmp_path):
    with cluster(num_ps=2):
        model = Model()
        run_job(model, 4, tmp_path, checkpoint_interval_steps=4)
        ckpt = tmp_path / "ckpts" / "ckpt-000000000004"
        shard = next((ckpt / "s1").glob("*.emb"))
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0xFF  # replica 1's file is corrupt; replica 0's is fine
        shard.write_bytes(bytes(raw))
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      resume="never") as ctx:
            ctx.clear_embeddings()  # live state differs from the checkpoint: no rows, moved weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            before_dense = {k: v.clone() for k, v in model.state_dict().items()}
            with pytest.raises(CheckpointLoadError, match="PS replica 1 refused the checkpoint.*checksum"):
                ctx.load_checkpoint(str(ckpt))
            assert ctx.get_embedding_size() == [0, 0]  # replica 0 staged its shard but did not switch
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, before_dense[k], rtol=0, atol=0)


def test_a_dense_file_of_another_model_is_refused_before_the_embeddings_load(persia_env, tmp_path):
    with cluster():
        model = Model()
        run_job(model, 2, tmp_path, checkpoint_interval_steps=2)
        ckpt = tmp_path / "ckpts" / "ckpt-000000000002"
        torch.save({"lin.weight": torch.zeros(3, 3)}, ckpt / "dense.pt")
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1), resume="never") as ctx:
            rows = ctx.get_embedding_size()
            ctx.clear_embeddings()
            with pytest.raises(CheckpointLoadError, match="dense.pt: does not match the model"):
                ctx.load_checkpoint(str(ckpt))
            assert sum(ctx.get_embedding_size()) == 0 < sum(rows)  # the embeddings were not loaded either


@pytest.mark.parametrize("when", ["mid-step", "between-steps"])
def test_sigterm_ends_after_a_whole_step_with_a_final_checkpoint(persia_env, tmp_path, when, monkeypatch):
    """SIGTERM to this very process: mid-step it is held until the step (and its embedding update)
    is done; between steps it ends training at once. Either way: updates flushed, a final
    checkpoint of exactly the steps trained, SystemExit(143), and the handler is removed again."""
    monkeypatch.setenv("PERSIA_GRACE_PERIOD_SECONDS", "3600")  # its watchdog must not end pytest
    before = signal.getsignal(signal.SIGTERM)
    errors: list = []
    with cluster():
        sender = send_in_thread([make_batch(i) for i in range(12)], errors)
        model, trained = Model(), 0
        with pytest.raises(SystemExit) as info:
            with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                          dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          checkpoint_dir=str(tmp_path / "ckpts"), checkpoint_interval_steps=1000) as ctx:
                for batch in DataLoader(StreamingDataset(4), embedding_staleness=3):
                    out, labels = ctx.forward(batch)
                    if trained == 4 and when == "mid-step":
                        os.kill(os.getpid(), signal.SIGTERM)
                    ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
                    trained += 1
                    if trained == 4 and when == "between-steps":
                        os.kill(os.getpid(), signal.SIGTERM)
        assert info.value.code == 143
        assert ctx.step == (5 if when == "mid-step" else 4)
        assert ctx._pending == set()  # every embedding update was applied before the checkpoint
        final = tmp_path / "ckpts" / plan.checkpoint_name(ctx.step)
        assert (final / "COMPLETE").is_file()
        assert json.loads((final / "progress.json").read_text())["loaders"] == {"0": {"0": ctx.step}}
    assert signal.getsignal(signal.SIGTERM) is before
    del sender  # it stays blocked on batches nobody takes; the bus closes at teardown


def test_a_checkpoint_that_cannot_be_written_is_an_error_line_not_the_end_of_training(persia_env, tmp_path,
                                                                                      monkeypatch, caplog):
    # the PS refuses to write outside its checkpoint root: every dump of this job fails
    monkeypatch.setenv("PERSIA_CHECKPOINT_ROOT", str(tmp_path / "elsewhere"))
    with cluster():
        ctx = run_job(Model(), 4, tmp_path, checkpoint_interval_steps=2)
    assert ctx.step == 4 and ctx.checkpoint_failures == 2 and ctx.last_checkpoint is None
    assert ctx.metrics.get("checkpoint_failures") == 2
    assert not list((tmp_path / "ckpts").glob("ckpt-*"))
    failed = [r.getMessage() for r in caplog.records if "checkpoint of step" in r.getMessage()]
    assert len(failed) == 2 and "outside the checkpoint root" in failed[0], failed


@pytest.mark.parametrize("loader_checks", [True, False], ids=["loader-refuses", "nn-refuses"])
def test_a_resume_with_another_number_of_data_loaders_fails_before_anything_is_trained(
        persia_env, tmp_path, monkeypatch, loader_checks):
    """A checkpoint of a one-loader job, resumed by a job with two data loaders (loader 0 of 2 here):
    batch ids and sharding differ, so no skip is exact. The loader refuses before sending anything
    and tells the NN rank, which stops with its error; a loader that does not check (an older one,
    played by turning its check off) has its first batch refused by the NN rank before it is
    trained. Before: the loader skipped by the old positions and the job trained on in silence."""
    import threading

    from persia.ctx import DataCtx
    from persia.data_loader import stream as loader_stream
    from persia.data_loader.stream import end_of_stream
    from persia.errors import DataLoaderFailed, PersiaError

    with cluster():
        run_job(Model(), 4, tmp_path, checkpoint_interval_steps=2)
    assert json.loads((tmp_path / "ckpts" / "ckpt-000000000004" / "progress.json").read_text())["loader_size"] == 1
    monkeypatch.setenv("REPLICA_INDEX", "0")
    monkeypatch.setenv("REPLICA_SIZE", "2")
    if not loader_checks:
        monkeypatch.setattr("persia.data_loader.ctx.loader_count_error", lambda *_: None)
    errors, trained = [], []

    def loader():
        try:
            # a failed trainer says no nn.done (it may be restarted in place): the loader's end of
            # stream waits trainer_grace_s for it, as its sends wait send_deadline_s
            with DataCtx(send_deadline_s=3, trainer_grace_s=3) as ctx:
                # more than the NN rank can hold before it stops (batches travel two to a message):
                # the loader's sends then find nobody and it fails, whatever the timing
                for i in range(40):
                    ctx.send_data(make_batch(i))
            end_of_stream()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    expected = r"ckpt-000000000004 was written with 1 data loaders, this job has 2"
    with cluster():
        loader_stream.reset()
        sender = threading.Thread(target=loader, daemon=True)
        sender.start()
        model = Model()
        with pytest.raises(DataLoaderFailed if loader_checks else PersiaError, match=expected):
            with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                          dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          checkpoint_dir=str(tmp_path / "ckpts")) as ctx:
                assert ctx.resumed_from.endswith("ckpt-000000000004")
                for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, reproducible=True):
                    trained.append(batch.batch_id)
                    out, labels = ctx.forward(batch)
                    ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
        sender.join(30)
    assert trained == [] and ctx.step == 4
    assert not sender.is_alive() and len(errors) == 1
    if loader_checks:
        assert isinstance(errors[0], PersiaError) and "this job has 2" in str(errors[0])


def test_a_loader_failure_told_before_the_loop_opens_reaches_the_loop(persia_env, tmp_path, monkeypatch):
    """A data loader connects as soon as the rank answers ``nn.info`` (at the context's entry), so
    what it says may come before the rank opens its loop. Its failed end of stream then went to
    the stream state the process's previous context left (or to nobody), and the loop waited out
    its timeout instead of stopping with the loader's error (a CI failure under load). Here the
    loader refuses (another number of loaders than the checkpoint's) and is done telling the rank
    before the loop opens."""
    from persia.errors import DataLoaderFailed

    with cluster():
        run_job(Model(), 4, tmp_path, checkpoint_interval_steps=2)  # leaves this process's stream state
    monkeypatch.setenv("REPLICA_INDEX", "0")
    monkeypatch.setenv("REPLICA_SIZE", "2")
    told, errors = threading.Event(), []

    def loader():
        try:
            with DataCtx(send_deadline_s=3, trainer_grace_s=3) as ctx:
                ctx.send_data(make_batch(0))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            told.set()

    with cluster():
        loader_stream.reset()
        model = Model()
        with pytest.raises(DataLoaderFailed, match="was written with 1 data loaders, this job has 2"):
            with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                          dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          checkpoint_dir=str(tmp_path / "ckpts")):
                threading.Thread(target=loader, daemon=True).start()
                assert told.wait(60), "the loader never finished"
                for _batch in DataLoader(StreamingDataset(4), embedding_staleness=1, timeout_ms=20_000):
                    raise AssertionError("a batch was trained")
    assert len(errors) == 1 and "this job has 2" in str(errors[0])


class OtherRankHas(TrainCtx):
    """A rank of two whose peer has ``peer_batches`` of each epoch's stream: the agreement DDP
    ranks make before every step (``_all_ranks_have``, a gloo all-reduce in a real job) answered
    here from that count. It cannot check the all-reduce itself; the two-rank scenario
    (tests/faults/test_resume_two_ranks.py) runs it with real processes."""

    def __init__(self, *args, peer_batches: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.peer_batches, self.asked = list(peer_batches), 0

    def _needs_rank_agreement(self, streaming: bool) -> bool:
        return streaming

    def _all_ranks_have(self, have: int) -> bool:
        self.asked += 1
        if self.asked <= self.peer_batches[0]:
            return bool(have)
        self.peer_batches.pop(0)  # the peer's epoch ended: so does this rank's
        self.asked = 0
        return False


def test_the_uneven_tail_moves_the_loaders_position_so_a_later_checkpoint_resumes_exactly(persia_env, tmp_path):
    """Epoch 1 (``StreamingDataset(until="epoch")``, one per epoch) sends this rank 6 batches, its
    peer has 4: it trains 4 and drops the last 2 (the uneven tail). Epoch 2's 4 batches follow them
    in the loader's order; the checkpoint after 2 of them must record 8 spent batches (4 trained +
    2 dropped + 2 trained). It recorded 6, so a resumed loader skipped too few and sent epoch 2's 2
    trained batches again."""
    errors: list = []
    loader_stream.reset()

    def two_epochs():
        try:
            for epoch in (range(6), range(6, 10)):
                with DataCtx() as dctx:
                    for i in epoch:
                        dctx.send_data(make_batch(i))
            end_of_stream()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    sender = threading.Thread(target=two_epochs, daemon=True)
    model = Model()
    with cluster():
        sender.start()
        with OtherRankHas(model=model, embedding_optimizer=Adagrad(lr=0.1), peer_batches=[4, 4],
                          dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          checkpoint_dir=str(tmp_path / "ckpts"), checkpoint_interval_steps=6) as ctx:
            steps = []
            for _epoch in range(2):
                for batch in DataLoader(StreamingDataset(4, until="epoch"), embedding_staleness=1, reproducible=True):
                    out, labels = ctx.forward(batch)
                    ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
                steps.append(ctx.step)
            ctx.wait_for_pending_updates()
            live = ctx._live_position()
        sender.join(30)
    assert not errors, errors
    assert steps == [4, 8]
    progress = json.loads((tmp_path / "ckpts" / "ckpt-000000000006" / plan.PROGRESS).read_text())
    assert progress["loaders"] == {"0": {"0": 8}}, progress
    assert live["loaders"] == {"0": 10}, live  # acknowledged: every batch of both epochs by the end


class TailLookupFails(OtherRankHas):
    """``OtherRankHas`` whose lookups of the batches from ``fail_from`` on fail with an error that
    is not ``BatchLost`` (a PS error, say)."""

    def __init__(self, *args, fail_from: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail_from = fail_from

    def _failing(self, msg: dict) -> bool:
        return int(msg["batch_id"]) >= self.fail_from

    def _lookup_message(self, msg, holds_permit, transferred=None):
        if self._failing(msg):
            raise RuntimeError(f"injected lookup failure of batch {msg['batch_id']}")
        return super()._lookup_message(msg, holds_permit, transferred)

    def _lookup_messages(self, msgs, holds_permit, transferred):
        if any(self._failing(m) for m in msgs):
            return [RuntimeError(f"injected lookup failure of batch {m['batch_id']}") if self._failing(m)
                    else self._lookup_message(m, h, t) for m, h, t in zip(msgs, holds_permit, transferred)]
        return super()._lookup_messages(msgs, holds_permit, transferred)


def test_a_trailing_batch_whose_lookup_fails_is_counted_as_dropped(persia_env, caplog):
    """The peer rank has 4 batches, this one 6: it trains 4 and drops the rest (the uneven tail).
    A dropped batch whose lookup failed was skipped without a count or a word, so the job ended
    with acknowledged batches "NOT accounted for" and no cause."""
    accounting.reset()
    errors: list = []
    sender = send_in_thread([make_batch(i) for i in range(6)], errors)
    model = Model()
    with cluster():
        with caplog.at_level("ERROR", logger="persia.nn_worker.loader"):
            with TailLookupFails(model=model, embedding_optimizer=Adagrad(lr=0.1), peer_batches=[4], fail_from=5,
                                 dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
                train_stream(ctx)
        sender.join(30)
    assert not errors, errors
    assert ctx.step == 4
    assert accounting.ACCOUNT.trained == 4 and dict(accounting.ACCOUNT.failed) == {"uneven_tail": 2}
    assert accounting.ACCOUNT.unaccounted() == 0
    assert any("failed its lookup (RuntimeError: injected lookup failure of batch 5)" in r.getMessage()
               for r in caplog.records)
