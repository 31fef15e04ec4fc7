"""What a training script does besides forward-then-backward on each batch: a backward that raises,
a batch skipped or a loop left after a forward at staleness 1, a batch forwarded twice before its
backward or again after it, embeddings cleared or loaded while updates are pending, an exception
that leaves the context. Real nats-server, real gRPC PS and embedding worker on loopback, a real
DataCtx in a thread, a real TrainCtx with torch. Each case ended, before, in a hang until the
loop's timeout (which blamed the data), a wrong embedding update, a dead training run, or a batch
nobody accounted for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from persia.ctx import TrainCtx, eval_ctx
from persia.data import DataLoader, StreamingDataset
from persia.embedding.data import IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia.embedding.optim import SGD
from persia.errors import PersiaError
from persia.nn_worker.accounting import ACCOUNT
from tests.polling import poll_until

from .cluster import cluster
from .test_training_path import BS, Eval, Model, adagrad_ctx, make_batch, send_in_thread, train_step

pytestmark = pytest.mark.integration

N = 8
LOOP = dict(timeout_ms=15_000)  # a loop that hangs fails in seconds, not 10 minutes


def start(n: int = N):
    errors: list = []
    return send_in_thread([make_batch(i) for i in range(n)], errors), errors


def finished(sender, errors) -> None:
    sender.join(30)
    assert not sender.is_alive() and not errors, errors


def test_a_backward_that_raises_lets_its_batch_go_and_the_loop_goes_on(persia_env):
    """Before, the batch kept its staleness permit and its embedding-worker entry: at staleness 1
    the next batch was never looked up, and the loop failed at its timeout blaming the data."""
    with cluster():
        sender, errors = start()
        failed = 0
        with adagrad_ctx(Model()) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, **LOOP):
                out, labels = ctx.forward(batch)
                loss = torch.nn.functional.binary_cross_entropy(out, labels[0])
                if batch.batch_id in (2, 3):
                    loss = loss.detach()  # a script's mistake: backward raises
                try:
                    ctx.backward(loss)
                except RuntimeError:
                    failed += 1
        finished(sender, errors)
    result = ACCOUNT.as_result()
    assert failed == 2
    assert result["batches_trained"] == N - 2 and result["batches_failed"] == {"backward_failed": 2}, result
    assert ACCOUNT.unaccounted() == 0


@pytest.mark.parametrize("how", ["continue", "break"])
def test_at_staleness_1_a_batch_without_backward_does_not_stop_the_next_one(persia_env, how):
    """``continue`` past a batch, or ``break`` after a forward and a new loop: the batch without a
    backward holds the one permit, so the next batch could not be looked up and the loop waited
    until its timeout. Now it is let go (``no_backward``) when the loop asks for the next one."""
    with cluster():
        sender, errors = start()
        trained = 0
        with adagrad_ctx(Model()) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, **LOOP):
                if batch.batch_id == 2:
                    ctx.forward(batch)
                    if how == "break":
                        break
                    continue
                train_step(ctx, batch)
                trained += 1
            if how == "break":
                for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, **LOOP):
                    train_step(ctx, batch)
                    trained += 1
        finished(sender, errors)
    failed = ACCOUNT.as_result()["batches_failed"]
    # what the left loop had pulled is handed back as "abandoned" (test_loop_left_early.py)
    assert failed.pop("no_backward") == 1 and set(failed) <= {"abandoned"}, failed
    assert trained + 1 + failed.get("abandoned", 0) == N and ACCOUNT.unaccounted() == 0, (trained, failed)


class UserSum(torch.nn.Module):
    """The sum of the user slot's embeddings: each row's gradient is how often it occurs."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(1, 1)  # the dense optimizer needs a parameter

    def forward(self, non_id, emb):
        return emb[0].sum()


def user_batch(users: np.ndarray, requires_grad: bool = True) -> PersiaBatch:
    return PersiaBatch([IDTypeFeatureWithSingleID("user", users.astype(np.uint64))],
                       non_id_type_features=[NonIDTypeFeature(np.zeros((len(users), 2), np.float32), name="dense")],
                       labels=[Label(np.zeros((len(users), 1), np.float32), name="y")],
                       requires_grad=requires_grad)


def user_rows(model, users: np.ndarray) -> np.ndarray:
    """The user slot's embedding of each of ``users``, as an eval context reads it."""
    with eval_ctx(model=model) as ctx:
        [batch] = list(DataLoader(Eval([user_batch(users, requires_grad=False)])))
        _, emb, _ = ctx.prepare_features(batch)
        return emb[0].detach().numpy().copy()


def one_update(step) -> np.ndarray:
    """How one training batch moves each user's row under ``step(ctx, batch)`` (SGD lr 1)."""
    users = np.arange(BS) % 4  # user u occurs 4 times
    model = UserSum()
    with cluster():
        errors: list = []
        sender = send_in_thread([user_batch(users)], errors)
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=1.0),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.0)) as ctx:
            before = None
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, **LOOP):
                before = user_rows(model, users)  # the rows exist once looked up for training
                step(ctx, batch)
            ctx.wait_for_pending_updates()
        finished(sender, errors)
        return user_rows(model, users) - before


def test_a_batch_forwarded_twice_before_its_backward_gets_both_gradients(persia_env):
    """R-drop style: two forwards of one batch, one backward of both. Before, only the second
    forward's embedding gradient was sent (each forward made new leaves, and only the last set
    was read)."""
    once = one_update(lambda ctx, b: ctx.backward(ctx.forward(b)[0]))

    def twice(ctx, b):
        first, _ = ctx.forward(b)
        second, _ = ctx.forward(b)
        ctx.backward(first + second)

    np.testing.assert_allclose(once, -4.0)  # lr 1, each user 4 times
    np.testing.assert_allclose(one_update(twice), 2 * once)


def test_a_batch_forwarded_again_after_its_backward_is_only_evaluated(persia_env):
    """A forward after the step (to log the new output): before, the batch became the current one
    again, and the next batch's forward released it a second time."""
    with cluster():
        sender, errors = start()
        with adagrad_ctx(Model()) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=2, **LOOP):
                train_step(ctx, batch)
                with torch.no_grad():
                    ctx.forward(batch)
            ctx.wait_for_pending_updates()
            after, _ = ctx.forward(batch)
            with pytest.raises(PersiaError, match="already trained"):
                ctx.backward(after.sum())
        finished(sender, errors)
    result = ACCOUNT.as_result()
    assert result["batches_trained"] == N and not result["batches_failed"], result


@pytest.mark.parametrize("replace", ["clear_embeddings", "load_embedding"])
def test_embeddings_replaced_while_updates_are_pending_training_goes_on(persia_env, tmp_path, replace):
    """``clear_embeddings()`` or ``load_embedding()`` in the middle of a loop with updates still
    pending: before, the updates numbered before the replacement and those after went to the
    embedding worker in one call, which refused it, and training died."""
    n = 20
    with cluster():
        sender, errors = start(n)
        with adagrad_ctx(Model()) as ctx:
            for i, batch in enumerate(DataLoader(StreamingDataset(4), embedding_staleness=None, **LOOP)):
                train_step(ctx, batch)
                if i == 3:
                    ctx.dump_checkpoint(str(tmp_path / "ckpt"))
                if i == 6:
                    if replace == "clear_embeddings":
                        ctx.clear_embeddings()
                    else:
                        ctx.load_embedding(str(tmp_path / "ckpt"))
            ctx.wait_for_pending_updates()
        finished(sender, errors)
    assert ACCOUNT.as_result()["batches_trained"] == n


def test_a_context_left_by_an_exception_accounts_for_its_batch_in_training(persia_env):
    """An exception between forward and backward leaves the context: its batch is counted
    ``abandoned`` and let go on the embedding worker, and the next context trains the rest.
    Before, nobody counted it."""
    with cluster():
        sender, errors = start()
        model = Model()
        trained = 0
        with pytest.raises(ValueError, match="the script's own error"):
            with adagrad_ctx(model) as ctx:
                for batch in DataLoader(StreamingDataset(4), embedding_staleness=2, **LOOP):
                    out, labels = ctx.forward(batch)
                    if batch.batch_id == 3:
                        raise ValueError("the script's own error")
                    ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
                    trained += 1
        with adagrad_ctx(model) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=2, **LOOP):
                train_step(ctx, batch)
                trained += 1
        finished(sender, errors)
    result = ACCOUNT.as_result()
    assert result["batches_failed"].get("abandoned", 0) >= 1, result
    assert result["batches_trained"] == trained and ACCOUNT.unaccounted() == 0, result


class SlowLookups(TrainCtx):
    """A TrainCtx whose lookups of batches from ``slow_from`` on wait for ``go``."""

    def __init__(self, *args, slow_from: int, go, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow_from, self.go = slow_from, go

    def _lookup_message(self, msg, holds_permit, transferred=None):
        if int(msg["batch_id"]) >= self.slow_from:
            assert self.go.wait(30)
        return super()._lookup_message(msg, holds_permit, transferred)


def test_lookups_cancelled_when_a_loop_is_left_give_their_permits_back(persia_env):
    """A loop left while lookups wait for the pool's one thread: they are cancelled, and their
    staleness permits, the context's (the next loop's too), come back. Before, each was lost."""
    import threading

    go = threading.Event()
    with cluster():
        sender, errors = start()
        model = Model()
        with SlowLookups(model=model, embedding_optimizer=SGD(lr=0.1), slow_from=1, go=go,
                         dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            loop = DataLoader(StreamingDataset(4), embedding_staleness=3, num_workers=1, **LOOP)
            it = iter(loop)
            train_step(ctx, next(it))
            # batch 1's lookup holds the one thread; 2 and 3 wait for it, a permit each
            poll_until(lambda: ctx._permits.held == 3, what="three lookups dispatched")
            it.close()  # the loop is left (what dropping it at a `break` does): waiting lookups are cancelled
            go.set()
            ctx.wait_for_pending_updates()
            poll_until(lambda: ctx._permits.held == 0, what="every permit back")
            rest = sum(1 for batch in DataLoader(StreamingDataset(4), embedding_staleness=3, **LOOP)
                       if train_step(ctx, batch) is None)
        finished(sender, errors)
    failed = ACCOUNT.as_result()["batches_failed"]
    assert 1 + rest + failed.get("abandoned", 0) == N and ACCOUNT.unaccounted() == 0, (rest, failed)
