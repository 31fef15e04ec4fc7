"""The whole training data path in one process: real nats-server, real gRPC PS and embedding
workers on loopback, a real DataCtx (in a thread) and a real TrainCtx with torch."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from persia.ctx import DataCtx, TrainCtx, eval_ctx
from persia.data_loader import stream as loader_stream
from persia.data_loader.stream import end_of_stream
from persia.data import DataLoader, IterableDataset, StreamingDataset
from persia.embedding.data import IDTypeFeature, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia.embedding.optim import SGD, Adagrad
from persia.errors import DataLoaderFailed, PersiaError, RemoteError
from persia.nn_worker.accounting import ACCOUNT
from persia.nn_worker.datasets import _RankStream
from tests.polling import poll_until

from .cluster import cluster
from .old_workers import without_slot_list

pytestmark = pytest.mark.integration

BS = 16


def make_batch(seed: int, requires_grad: bool = True, unknown_slot: bool = False) -> PersiaBatch:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 50, size=BS, dtype=np.uint64)
    items = [rng.integers(1000, 1100, size=rng.integers(0, 4), dtype=np.uint64) for _ in range(BS)]
    tags = [rng.integers(0, 10, size=rng.integers(0, 5), dtype=np.uint64) for _ in range(BS)]
    feats = [IDTypeFeatureWithSingleID("user", users), IDTypeFeature("item", items), IDTypeFeature("tags", tags)]
    if unknown_slot:
        feats.append(IDTypeFeatureWithSingleID("not_a_slot", users))
    return PersiaBatch(
        feats,
        non_id_type_features=[NonIDTypeFeature(rng.standard_normal((BS, 2)).astype(np.float32), name="dense")],
        labels=[Label((users % 2).astype(np.float32).reshape(-1, 1), name="y")],
        requires_grad=requires_grad,
    )


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 + 4 + 4 + 3 * 4, 1)

    def forward(self, non_id, emb):
        user, item, tags = emb
        assert user.dtype == torch.float32 and user.shape == (BS, 4)
        assert tags.shape == (BS, 3, 4)  # raw slot: (bs, sample_fixed_size, dim + mask)
        return torch.sigmoid(self.lin(torch.cat([non_id[0], user, item, tags.flatten(1)], dim=1)))


def send_in_thread(batches, errors):
    loader_stream.reset()  # each call plays a new data-loader process

    def run():
        try:
            with DataCtx() as ctx:
                for b in batches:
                    ctx.send_data(b)
            end_of_stream()  # this "data loader" is a thread: its process does not end here
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


class Eval(IterableDataset):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __iter__(self):
        yield from self.batches


def eval_embeddings(model, batches):
    out = []
    with eval_ctx(model=model) as ctx:
        for tb in DataLoader(Eval(batches)):
            _, emb, _ = ctx.prepare_features(tb)
            out.append([e.detach().numpy().copy() for e in emb])
    return out


def adagrad_ctx(model) -> TrainCtx:
    """The TrainCtx most tests here train and checkpoint with: Adagrad embeddings, SGD dense."""
    return TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1),
                    dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def train_step(ctx, batch) -> None:
    """One training step on ``batch`` (BCE on its first label)."""
    out, labels = ctx.forward(batch)
    ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))


def train_stream(ctx, staleness: int = 1) -> int:
    """Train ``ctx`` on its stream to the end; the steps trained."""
    trained = 0
    for batch in DataLoader(StreamingDataset(4), embedding_staleness=staleness, reproducible=True):
        train_step(ctx, batch)
        trained += 1
    ctx.wait_for_pending_updates()
    return trained


def train(model, n_batches, staleness, optimizer=None, seed0=0):
    errors: list = []
    sender = send_in_thread([make_batch(seed0 + i) for i in range(n_batches)], errors)
    with TrainCtx(model=model, embedding_optimizer=optimizer or Adagrad(lr=0.1),
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        trained = train_stream(ctx, staleness)
        stats = ctx.get_embedding_size()
    sender.join(30)
    assert not errors, errors
    return trained, stats


def test_every_sent_batch_is_trained_and_embeddings_move(persia_env):
    with cluster(num_ps=2, num_workers=2):
        model = Model()
        probe = [make_batch(999, requires_grad=False)]
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.5),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)):
            before = eval_embeddings(model, probe)
        trained, rows = train(model, 12, staleness=2, optimizer=SGD(lr=0.5))
        assert trained == 12
        assert sum(rows) > 0 and len(rows) == 2
        after = eval_embeddings(model, probe)
        # eval lookups never create rows: before training they were all zeros
        user, item, tags = before[0]
        assert np.all(user == 0) and np.all(item == 0) and np.all(tags[..., :-1] == 0)
        assert tags[..., -1].sum() > 0  # the raw slot's mask channel marks the IDs present
        # users 0..49 were all trained on, so their rows exist and moved away from init
        assert np.abs(after[0][0]).sum() > 0


def test_unknown_slot_is_rejected_with_its_name(persia_env, monkeypatch):
    without_slot_list(monkeypatch)  # the worker refuses it (a data loader checks it first: test_send_checks.py)
    with cluster():
        model = Model()
        errors: list = []
        sender = send_in_thread([make_batch(1, unknown_slot=True)], errors)
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            # the loader's with-block ends with an error: the trainer is told, not left waiting
            with pytest.raises(DataLoaderFailed, match="data loader 0 failed: .*not_a_slot"):
                for batch in DataLoader(StreamingDataset(4)):
                    ctx.forward(batch)
        sender.join(30)
        assert len(errors) == 1
        assert isinstance(errors[0], RemoteError)
        assert "unknown slot 'not_a_slot': not in embedding_config.yml slots_config" in str(errors[0])


@pytest.mark.parametrize("num_ps_after", [1, 3])
def test_checkpoint_round_trip_gives_identical_lookups(persia_env, tmp_path, num_ps_after):
    probe = [make_batch(500 + i, requires_grad=False) for i in range(3)]
    model = Model()
    with cluster(num_ps=2):
        train(model, 8, staleness=1)
        with adagrad_ctx(model) as ctx:
            expected = eval_embeddings(model, probe)
            ctx.dump_checkpoint(str(tmp_path / "ckpt"))
            ctx.clear_embeddings()
            assert sum(ctx.get_embedding_size()) == 0
            ctx.load_checkpoint(str(tmp_path / "ckpt"))
            same = eval_embeddings(model, probe)
    for a, b in zip(expected, same):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    assert (tmp_path / "ckpt" / "embedding_dump_done").exists()
    assert (tmp_path / "ckpt" / "dense.pt").exists() and (tmp_path / "ckpt" / "opt.pt").exists()
    with cluster(num_ps=num_ps_after):
        model2 = Model()
        with TrainCtx(model=model2, embedding_optimizer=Adagrad(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model2.parameters(), lr=0.1)) as ctx:
            ctx.load_checkpoint(str(tmp_path / "ckpt"))
            resharded = eval_embeddings(model2, probe)
        for p, q in zip(model.parameters(), model2.parameters()):
            torch.testing.assert_close(p, q)
    for a, b in zip(expected, resharded):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_loading_an_unfinished_checkpoint_is_refused(persia_env, tmp_path):
    (tmp_path / "partial").mkdir()
    with cluster():
        model = Model()
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            with pytest.raises(FileNotFoundError, match="no embedding_dump_done marker"):
                ctx.load_checkpoint(str(tmp_path / "partial"))


def test_a_dump_that_fails_midway_leaves_no_directory_that_reads_as_a_checkpoint(persia_env, tmp_path):
    """Dumping again into a checkpoint's directory overwrites its dense files first; a dump that
    fails after that (here the TorchScript export of a model that does not script) must not leave
    the old done marker beside the new dense files, a whole checkpoint to every reader but one
    mixing two points of training."""
    model = Model()
    with cluster():
        train(model, 4, staleness=1)
        with adagrad_ctx(model) as ctx:
            ctx.dump_checkpoint(str(tmp_path / "ckpt"))
            ctx.load_checkpoint(str(tmp_path / "ckpt"))  # whole
            with pytest.raises(Exception) as failed:  # noqa: PT011 - whatever TorchScript raises
                ctx.dump_checkpoint(str(tmp_path / "ckpt"), with_jit_model=True)
            assert not isinstance(failed.value, FileNotFoundError)
            with pytest.raises(FileNotFoundError, match="no embedding_dump_done marker"):
                ctx.load_checkpoint(str(tmp_path / "ckpt"))
            ctx.dump_checkpoint(str(tmp_path / "ckpt"))  # a dump that finishes makes it whole again
            ctx.load_checkpoint(str(tmp_path / "ckpt"))


def test_a_dump_without_blocking_that_fails_is_raised_not_lost(persia_env, tmp_path):
    """``dump_checkpoint(..., blocking=False)`` runs the PS dumps on a thread; its error waited
    for ``wait_for_dump_embedding()``. Nobody calling it (the last dump of a script), the context
    exited cleanly and the process with 0; a second dump started meanwhile overwrote the error."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "s0").write_text("a file where the PS writes its shard directory")
    model = Model()
    with cluster():
        train(model, 2, staleness=1)
        with pytest.raises(Exception, match="s0") as at_exit:
            with adagrad_ctx(model) as ctx:
                ctx.dump_checkpoint(str(blocked), blocking=False)
        assert not (blocked / "embedding_dump_done").exists()

        with adagrad_ctx(model) as ctx:
            ctx.dump_embedding(str(blocked), blocking=False)
            with pytest.raises(type(at_exit.value), match="s0"):  # the first one's error, before the next starts
                ctx.dump_embedding(str(tmp_path / "next"), blocking=False)
            ctx.dump_embedding(str(tmp_path / "next"), blocking=False)
            ctx.wait_for_dump_embedding()
        assert (tmp_path / "next" / "embedding_dump_done").exists()


def test_a_checkpoint_without_its_dense_file_is_refused_and_without_its_optimizer_file_warned(
        persia_env, tmp_path, caplog):
    """PERSIA skipped a dense file that was not there and kept the model as it was: a typo in
    ``dense_model_filename`` loaded the embeddings beside an untrained model. The optimizer file
    may be missing (an eval context's checkpoint has none): the dense optimizer starts afresh, said
    in the log."""
    model = Model()
    with cluster():
        train(model, 4, staleness=1)
        with adagrad_ctx(model) as ctx:
            ctx.dump_checkpoint(str(tmp_path / "ckpt"))
            rows = ctx.get_embedding_size()
            ctx.clear_embeddings()
            with pytest.raises(FileNotFoundError, match=r"dense_model\.pt: no dense model file \(dense_filename 'dense_model\.pt'\)"):
                ctx.load_checkpoint(str(tmp_path / "ckpt"), dense_model_filename="dense_model.pt")
            assert sum(ctx.get_embedding_size()) == 0, "embeddings were loaded beside a refused dense file"
            (tmp_path / "ckpt" / "opt.pt").unlink()
            with caplog.at_level("WARNING", logger="persia.nn_worker.train_ctx"):
                ctx.load_checkpoint(str(tmp_path / "ckpt"))
            assert ctx.get_embedding_size() == rows
            assert any("no dense optimizer file (opt_filename 'opt.pt')" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("staleness, warmup", [(1, 0), (3, 0), (3, 5)])
def test_staleness_bounds_batches_looked_up_but_not_applied(persia_env, staleness, warmup):
    with cluster(num_ps=1, num_workers=2) as servers:
        workers = servers[1:]
        model = Model()
        errors: list = []
        sender = send_in_thread([make_batch(i) for i in range(15)], errors)
        seen = []
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            for batch in DataLoader(StreamingDataset(8), embedding_staleness=staleness, forward_buffer_size=8,
                                    staleness_warmup_steps=warmup):
                # every batch looked up and not yet updated sits in a worker's post-forward buffer
                seen.append(sum(len(w.post_buffer) for w in workers))
                out, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
        sender.join(30)
        assert not errors
    assert len(seen) == 15
    assert max(seen) <= staleness
    if staleness == 1:
        assert seen == [1] * 15  # update-before-next-lookup: exactly one batch in flight
    if warmup:
        assert seen[:warmup] == [1] * warmup  # the ramp: synchronous for the first steps


def test_an_update_whose_accounting_fails_in_the_flusher_fails_the_next_wait(persia_env):
    """An update sent alone (the outbox's flusher: nobody waits for it) whose accounting raises
    after the call: the error reaches the training thread at its next wait. Before, its future was
    settled before the accounting ran, and the flusher dropped the exception (a staleness permit
    released into the wrong bound raised there, unseen)."""
    with cluster():
        errors: list = []
        sender = send_in_thread([make_batch(i) for i in range(4)], errors)
        model = Model()
        with adagrad_ctx(model) as ctx:
            loop = iter(DataLoader(StreamingDataset(4), embedding_staleness=4))
            train_step(ctx, next(loop))
            real = ctx._applied

            def broken(update, passes_permit=False):
                real(update, passes_permit)
                raise RuntimeError("accounting broke")

            ctx._applied = broken
            with pytest.raises(PersiaError, match="accounting broke"):
                ctx.wait_for_pending_updates()
            ctx._applied = real
            for batch in loop:
                train_step(ctx, batch)
        sender.join(30)
        assert not errors


def test_synchronous_reference_mode_is_deterministic(persia_env):
    def run():
        torch.manual_seed(0)
        model = Model()
        with cluster(num_ps=2, num_workers=1):
            train(model, 10, staleness=1)
            with adagrad_ctx(model):
                emb = eval_embeddings(model, [make_batch(77, requires_grad=False)])
        return [p.detach().clone() for p in model.parameters()], emb

    params_a, emb_a = run()
    params_b, emb_b = run()
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for x, y in zip(emb_a[0], emb_b[0]):
        np.testing.assert_array_equal(x, y)


def test_tensors_built_in_the_lookup_thread_train_exactly_like_tensors_built_at_forward(persia_env, monkeypatch):
    """The lookup thread builds each batch's tensors and embedding graph ahead of its step
    (``EmbeddingCtx._prebuild``); backward on the training thread must go through that graph to
    the same gradients, and a prebuilt set serves one forward only."""
    from persia.nn_worker.embedding_ctx import EmbeddingCtx

    seen: list[bool] = []
    real_prepare = EmbeddingCtx.prepare_features

    def spying_prepare(self, batch):
        seen.append(batch.prepared is not None)
        out = real_prepare(self, batch)
        assert batch.prepared is None  # consumed: a second forward of this batch builds anew
        return out

    def run(prebuild: bool):
        seen.clear()
        torch.manual_seed(0)
        model = Model()
        with monkeypatch.context() as m:
            m.setattr(EmbeddingCtx, "prepare_features", spying_prepare)
            if not prebuild:
                m.setattr(EmbeddingCtx, "_prebuild", lambda self, batch: None)
            with cluster(num_ps=1, num_workers=1):
                train(model, 8, staleness=1)
                with adagrad_ctx(model):
                    emb = eval_embeddings(model, [make_batch(77, requires_grad=False)])
        return [p.detach().clone() for p in model.parameters()], emb, list(seen)

    params_a, emb_a, seen_a = run(prebuild=True)
    params_b, emb_b, seen_b = run(prebuild=False)
    assert seen_a == [True] * 9  # 8 training batches and the eval batch came prebuilt
    assert seen_b == [False] * 9
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for x, y in zip(emb_a[0], emb_b[0]):
        np.testing.assert_array_equal(x, y)


def test_rendezvous_over_nats_hands_out_distinct_indices(persia_env, monkeypatch):
    from persia.bus import shared_bus
    from persia.errors import BusyError
    from persia.rendezvous import claim_index

    with cluster(num_ps=1, num_workers=1):
        bus = shared_bus()
        got = []
        for pod in ("nn-abc", "nn-def"):
            monkeypatch.setenv("HOSTNAME", pod)
            index, stop = claim_index(bus, "nn", 2)
            got.append(index)
            stop.set()
        assert sorted(got) == [0, 1]
        monkeypatch.setenv("HOSTNAME", "nn-xyz")
        with pytest.raises(BusyError):
            claim_index(bus, "nn", 2, deadline_s=1.0)


def test_a_rendezvous_table_that_restarted_gives_each_member_its_index_back(persia_env, monkeypatch):
    """The index table lives in PS replica 0; restarted, it forgot every lease, each renewal was
    refused and logged while the member ran on, and a pod started next could claim an index in
    use. Now the renewal takes the index back; a member whose index another took stops itself."""
    from persia.bus import NatsBus
    from persia.rendezvous import Assignments, RendezvousServer, claim_index

    keeper_bus, client_bus = NatsBus(name="rdzv-keeper"), NatsBus(name="rdzv-client")
    RendezvousServer(keeper_bus, ttl_s=0.3)
    lost: list = []
    monkeypatch.setenv("HOSTNAME", "nn-abc")
    index, stop = claim_index(client_bus, "nn", 2, on_lost=lambda role, i: lost.append((role, i)))
    try:
        assert index == 0
        keeper_bus.close()  # PS replica 0 restarts: a new table, empty
        keeper_bus = NatsBus(name="rdzv-keeper-2")
        # its clock stands still: no lease it hands out or takes back expires while the test runs,
        # however late the newcomer's claim comes after the member's last renewal
        table = RendezvousServer(keeper_bus, ttl_s=0.3, clock=lambda: 0.0)
        poll_until(lambda: table._table("nn").leases.get("nn-abc", (None,))[0] == 0,
                   "the member's renewal takes index 0 back", deadline_s=5)
        # a newcomer gets the other index, not the one in use
        monkeypatch.setenv("HOSTNAME", "nn-def")
        other, other_stop = claim_index(client_bus, "nn", 2, on_lost=lambda role, i: lost.append((role, i)))
        other_stop.set()
        assert other == 1 and not lost

        class TakenOver(RendezvousServer):
            """A table in which another member claimed index 0 before any renewal came."""

            def _table(self, role):
                if role not in self._tables:
                    self._tables[role] = Assignments(self.ttl_s)
                    self._tables[role].claim("nn-ghi", 2, self._clock())
                return self._tables[role]

        keeper_bus.close()  # again, and this time another member holds index 0 first
        keeper_bus = NatsBus(name="rdzv-keeper-3")
        TakenOver(keeper_bus, ttl_s=0.3)
        poll_until(lambda: lost == [("nn", 0)], "the member whose index was taken stops", deadline_s=5)
    finally:
        stop.set()
        client_bus.close()
        keeper_bus.close()


def test_retried_sends_are_not_duplicated(persia_env):
    """A send retried after a lost reply must not buffer or train a batch twice."""
    from persia.bus import shared_bus, subject
    from persia.ctx import id_features_to_wire
    from persia.data import StreamingDataset

    with cluster(num_workers=1) as servers:
        worker = servers[-1]
        batch = make_batch(5)
        req = {"loader": 0, "batch_id": 7, "batch_size": BS, "requires_grad": True,
               "features": id_features_to_wire(batch)}
        bus = shared_bus()
        first = bus.request(subject("ew", "forward", 0), req)
        second = bus.request(subject("ew", "forward", 0), req)
        assert first == second
        assert len(worker.forward_buffer) == 1
    ds = StreamingDataset(4)
    msg = {"loader": 0, "batch_id": 7}
    assert ds._on_batch(msg) == {"queued": True}
    assert ds._on_batch(msg) == {"queued": True, "duplicate": True}
    assert ds._queue.qsize() == 1


def test_a_batch_takes_the_fast_path_only_when_the_buffer_has_room():
    """``_on_batch_now`` (run on the bus's loop thread) queues a batch when there is room, and
    otherwise answers would-block (the bus then awaits ``_on_batch_waiting``) without marking it
    seen, so it is not answered as a duplicate when it is queued; ``_on_batch`` is the same offer
    made synchronously, waiting in the calling thread."""
    from persia.bus import BUSY, WOULD_BLOCK
    from persia.data import StreamingDataset

    ds = StreamingDataset(1, busy_wait_s=0.05)
    assert ds._on_batch_now({"loader": 0, "batch_id": 1}) == {"queued": True}
    assert ds._on_batch_now({"loader": 0, "batch_id": 2}) is WOULD_BLOCK  # full: no wait here
    assert ds._on_batch({"loader": 0, "batch_id": 2}) is BUSY  # the pool waited busy_wait_s in vain
    ds._queue.get_nowait()
    assert ds._on_batch({"loader": 0, "batch_id": 2}) == {"queued": True}  # not taken for a duplicate
    assert ds._on_batch_now({"loader": 0, "batch_id": 1}) == {"queued": True, "duplicate": True}
    assert ds._state.delivered[0] == 2


def test_a_batch_that_finds_the_buffer_full_waits_on_the_loop_until_the_consumer_makes_room(persia_env):
    """Over a real NATS: a batch sent while the rank's buffer is full is neither refused nor handed
    to a pool thread. It waits on the bus's loop and is queued as soon as the consumer takes an
    item, long before ``busy_wait_s``; with no room it is answered busy at ``busy_wait_s``."""
    from persia.bus import BusyError, NatsBus, subject

    server, client = NatsBus(name="rank"), NatsBus(name="loader")
    ds = StreamingDataset(1, busy_wait_s=30.0)
    ds._register(server, _RankStream(), 0)
    replies: list = []

    def send(batch_id: int, timeout: float = 60.0) -> threading.Thread:
        msg = {"loader": 0, "batch_id": batch_id, "ref": batch_id, "worker": 0}

        def run() -> None:
            try:
                replies.append((batch_id, client.request(subject("nn", "batch", 0), msg, timeout=timeout)))
            except Exception as exc:  # noqa: BLE001 - the test asserts on it
                replies.append((batch_id, exc))

        t = threading.Thread(target=run)
        t.start()
        return t

    try:
        send(1).join(10.0)
        assert replies == [(1, {"queued": True})]
        replies.clear()
        second = send(2)
        poll_until(lambda: ds._room._waiting, "the second batch waiting for room")
        started = time.monotonic()
        kind, first = ds._take(1.0)  # the consumer takes batch 1: room for batch 2
        second.join(10.0)
        assert time.monotonic() - started < 10.0  # not the 30 s deadline
        assert (kind, first["batch_id"]) == ("batch", 1)
        assert replies == [(2, {"queued": True})]
        assert ds._queue.queue[0][1]["batch_id"] == 2
        assert not server._executor._threads  # nothing went through the pool

        replies.clear()
        ds.busy_wait_s = 0.3
        started = time.monotonic()
        send(3).join(10.0)  # no room comes: busy at the deadline, and the loader retries
        assert 0.3 <= time.monotonic() - started < 10.0
        assert [b for b, _ in replies] == [3] and isinstance(replies[0][1], BusyError)
        assert 3 not in {k[2] for k in ds._state.seen}  # not counted: the retry is not a duplicate
        assert not ds._room._waiting
    finally:
        client.close()
        server.close()


def _channel_closed(client) -> bool:
    """grpc refuses a call on a closed channel at once, before anything is sent."""
    try:
        client.call("Ready", None, timeout=5.0)
    except ValueError as exc:
        return "closed channel" in str(exc)
    return False


def test_the_context_that_discovered_the_embedding_workers_closes_their_channels_at_its_exit(persia_env):
    with cluster(num_ps=1, num_workers=2):
        model = Model()
        probe = [make_batch(7, requires_grad=False)]
        with adagrad_ctx(model) as ctx:
            outer = ctx._worker_clients()
            with eval_ctx(model=model) as inner:
                for tb in DataLoader(Eval(probe)):
                    inner.prepare_features(tb)
                assert inner._worker_clients() is outer  # shared from the outer context
            assert not any(_channel_closed(c) for c in outer)  # the inner exit left them open
        assert all(_channel_closed(c) for c in outer) and len(outer) == 2
        again = ctx._worker_clients()  # used after its exit, a context discovers the workers afresh
        assert again is not outer and not any(_channel_closed(c) for c in again)
        for c in again:
            c.close()


def test_a_train_ctx_entered_again_is_refused_at_the_with_naming_what_to_do(persia_env):
    """Its outbox, pools and corrector end at its exit: entered again, it used to fail at the
    first backward with an internal "update outbox is closed"."""
    from persia.errors import UnsupportedError

    with cluster():
        model = Model()
        ctx = adagrad_ctx(model)
        with ctx:
            pass
        with pytest.raises(UnsupportedError, match="can be entered once; make a new TrainCtx"):
            with ctx:
                pass
        with adagrad_ctx(model):  # a new one trains on
            pass


@pytest.mark.parametrize("skipped", ["forward only", "not touched"])
def test_batches_a_loop_skips_without_backward_are_released_and_counted(persia_env, skipped, caplog):
    """A training loop that gives every other batch no backward (a filter, a forward whose loss is
    not used): each such batch held a staleness permit and its embedding-worker entry for good,
    so with a bound of 4 the loop stopped after a few batches and failed 10 minutes later with a
    timeout that blamed the data. Now it is released when the next batch is trained (or at the
    context's exit) and counted ``no_backward``: every batch accounted for."""
    n = 16
    with cluster():
        errors: list = []
        sender = send_in_thread([make_batch(i) for i in range(n)], errors)
        model = Model()
        seen = 0
        with adagrad_ctx(model) as ctx:
            for i, batch in enumerate(DataLoader(StreamingDataset(4), embedding_staleness=4, timeout_ms=30_000)):
                seen += 1
                if i % 2 == 0:
                    if skipped == "forward only":
                        ctx.forward(batch)
                    continue
                train_step(ctx, batch)
            trained = ctx.trained_batches
        sender.join(30)
    assert not errors and seen == n
    result = ACCOUNT.as_result()
    assert trained == n // 2 and result["batches_trained"] == n // 2
    assert result["batches_failed"] == {"no_backward": n // 2}, result
    assert "got no backward" in caplog.text


def _batch_without_tags(seed: int) -> PersiaBatch:
    """``make_batch`` with no sample having a ``tags`` ID (the only slot of dim 3)."""
    batch = make_batch(seed)
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 50, size=BS, dtype=np.uint64)
    items = [rng.integers(1000, 1100, size=2, dtype=np.uint64) for _ in range(BS)]
    return PersiaBatch([IDTypeFeatureWithSingleID("user", users), IDTypeFeature("item", items),
                        IDTypeFeature("tags", [np.zeros(0, np.uint64)] * BS)],
                       non_id_type_features=batch.non_id_type_features, labels=batch.labels)


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_a_batch_where_a_slot_has_no_ids_at_all_trains_with_replay(persia_env, optimizer):
    """A rare multi-hot feature absent from a whole batch, the only slot of its dim, with a stateful
    optimizer and own-update replay (the defaults): the replay refused the empty table's state
    (``expected shape (0, 3) for AdagradConfig, got (0, 0)``) and training stopped."""
    with cluster():
        errors: list = []
        batches = [_batch_without_tags(i) if i == 3 else make_batch(i) for i in range(8)]
        sender = send_in_thread(batches, errors)
        model = Model()
        with TrainCtx(model=model, embedding_optimizer=Adagrad(lr=0.1) if optimizer == "adagrad" else SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            trained = train_stream(ctx, staleness=4)
        sender.join(30)
    assert not errors and trained == 8


def test_batches_sent_without_grad_in_a_training_stream_are_evaluated_and_counted(persia_env):
    """A data loader marking some batches ``requires_grad=False`` in a training stream (the
    defaults: own-update replay on). Before: the lookup asked for a replay its untrained lookup
    could not answer and the loop died (``KeyError: 'replay'``); with staleness 1, a backward on
    such a batch said "without a training batch" and the batch was counted nowhere."""
    with cluster():
        errors: list = []
        sender = send_in_thread([make_batch(i, requires_grad=i % 3 != 1) for i in range(9)], errors)
        model = Model()
        refused = []
        with adagrad_ctx(model) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=4, timeout_ms=30_000):
                if batch.requires_grad:
                    train_step(ctx, batch)
                    continue
                out, labels = ctx.forward(batch)
                with pytest.raises(PersiaError, match=f"batch_id {batch.batch_id}.*requires_grad=False"):
                    ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
                refused.append(batch.batch_id)
            trained = ctx.trained_batches
        sender.join(30)
    assert not errors and trained == 6 and len(refused) == 3
    result = ACCOUNT.as_result()
    assert (result["batches_trained"], result["batches_evaluated"], result["batches_failed"]) == (6, 3, {}), result


def test_a_data_ctx_used_without_with_sends_every_batch_and_its_count_at_the_end_of_stream(persia_env):
    """``ctx = DataCtx()`` with no ``with`` (the process's end ends the stream): its last batch,
    held for a group partner, was never sent and its epoch's count never announced, so the NN
    side trained one batch less and its accounting was off by every batch."""
    with cluster():
        loader_stream.reset()
        errors: list = []

        def run() -> None:
            try:
                ctx = DataCtx()
                for i in range(7):  # odd: the last one waits for a partner to share a message
                    ctx.send_data(make_batch(i))
                end_of_stream()  # what the process's exit runs
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        sender = threading.Thread(target=run, daemon=True)
        sender.start()
        model = Model()
        with adagrad_ctx(model) as ctx:
            trained = train_stream(ctx, staleness=2)
        sender.join(30)
    assert not errors and trained == 7
    result = ACCOUNT.as_result()
    assert (result["batches_sent"], result["batches_trained"], result["batches_unannounced"]) == (7, 7, 0), result
