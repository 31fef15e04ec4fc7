"""A data loader sends batches two to a message on each leg (``PERSIA_DATA_GROUP``, the default):
real nats-server, real embedding worker and PS on loopback, a real DataCtx (in a thread), a real
TrainCtx with torch. A passive NATS subscriber counts the messages on each subject."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from persia.bus import NatsBus
from persia.ctx import DataCtx, TrainCtx
from persia.data import DataLoader, StreamingDataset
from persia.data_loader import stream as loader_stream
from persia.data_loader.stream import end_of_stream
from persia.embedding.optim import SGD
from persia.errors import PersiaError
from persia.nn_worker.accounting import ACCOUNT

from tests.polling import poll_until

from .cluster import GLOBAL_CONFIG, cluster
from .old_workers import without_slot_list
from .test_training_path import Model, make_batch

pytestmark = pytest.mark.integration

LEGS = ("forward", "forward_group", "batch", "batch_group")


def on_arrival(monkeypatch, methods, note) -> None:
    """``note(method, message)`` for every message that reaches a role's handler on the data
    subjects ``methods`` (e.g. "batch_group"), as the bus hands it over."""
    serve = NatsBus.serve

    def noting(self, subj, handler, **kwargs):
        method = subj.split(".")[3]
        if method in methods:
            def wrap(fn):
                def run(obj):
                    note(method, obj)
                    return fn(obj)
                return run

            handler = wrap(handler)
            if kwargs.get("try_first") is not None:
                kwargs["try_first"] = wrap(kwargs["try_first"])
        return serve(self, subj, handler, **kwargs)

    monkeypatch.setattr(NatsBus, "serve", noting)


def noting_arrivals(monkeypatch) -> set:
    """Every (subject method, batch ids) that reaches a role's handler on the four data subjects,
    noted as the bus hands it over (a retried message is the same entry)."""
    arrived: set = set()
    on_arrival(monkeypatch, LEGS, lambda method, obj: arrived.add(
        (method, tuple(int(b["batch_id"]) for b in obj.get("batches", [obj])))))
    return arrived


def send_all(ctx, batches, errors, _trained) -> None:
    for b in batches:
        try:
            ctx.send_data(b)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)


def train_grouped(monkeypatch, batches, forward_buffer_size: int = 8, send=send_all):
    """Train ``batches`` sent by one data loader thread (``send(ctx, batches, errors, trained)``,
    by default each in turn, going on after a failed send; ``trained`` is the list of batch ids
    trained so far); ``(batch ids trained, send errors, {subject method: the batch-id tuples that
    reached it})``."""
    config = {**GLOBAL_CONFIG, "embedding_worker_config": {"forward_buffer_size": forward_buffer_size}}
    arrived = noting_arrivals(monkeypatch)
    errors, seen = [], []
    with cluster(global_config=config):
        loader_stream.reset()

        def loader():
            with DataCtx() as ctx:
                send(ctx, batches, errors, seen)
            end_of_stream()

        t = threading.Thread(target=loader, daemon=True)
        t.start()
        model = Model()
        with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1),
                      dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            for batch in DataLoader(StreamingDataset(4), embedding_staleness=1, reproducible=True):
                seen.append(batch.batch_id)
                out, labels = ctx.forward(batch)
                ctx.backward(torch.nn.functional.binary_cross_entropy(out, labels[0]))
        t.join(60)
    messages: dict = {}
    for method, ids in sorted(arrived):
        messages.setdefault(method, []).append(ids)
    return seen, errors, messages


def test_batches_go_two_to_a_message_and_the_last_one_at_close(persia_env, monkeypatch):
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    seen, errors, messages = train_grouped(monkeypatch, [make_batch(i) for i in range(5)])
    assert errors == [] and seen == [0, 1, 2, 3, 4]
    # 0+1 and 2+3 in one message on each leg; batch 4, held for a partner, went when the
    # DataCtx closed, alone
    assert messages == {"forward_group": [(0, 1), (2, 3)], "batch_group": [(0, 1), (2, 3)],
                        "forward": [(4,)], "batch": [(4,)]}
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 5 and result["batches_trained"] == 5 and result["batches_failed"] == {}


def test_a_group_of_one_sends_every_batch_alone(persia_env, monkeypatch):
    monkeypatch.setenv("PERSIA_DATA_GROUP", "1")
    seen, errors, messages = train_grouped(monkeypatch, [make_batch(i) for i in range(3)])
    assert errors == [] and seen == [0, 1, 2]
    assert messages == {"forward": [(0,), (1,), (2,)], "batch": [(0,), (1,), (2,)]}


def test_a_batch_the_worker_refuses_fails_alone_and_its_group_partner_trains(persia_env, monkeypatch):
    without_slot_list(monkeypatch)  # the worker, not the data loader, refuses the unknown slot
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    batches = [make_batch(0), make_batch(1, unknown_slot=True), make_batch(2), make_batch(3)]
    seen, errors, messages = train_grouped(monkeypatch, batches)
    assert messages == {"forward_group": [(0, 1), (2, 3)], "batch_group": [(0, 1), (2, 3)]}
    assert seen == [0, 2, 3]
    # raised by the send_data that sent the group, naming the batch and why
    assert len(errors) == 1 and isinstance(errors[0], PersiaError)
    assert "refused the ID features of batch 1: UnknownSlotError: unknown slot 'not_a_slot'" in str(errors[0])
    assert batches[1].batch_id is None and batches[0].batch_id == 0  # only the refused one may go again
    result = ACCOUNT.as_result()
    # the NN rank got batch 1's dense part: it is in its count, failed with the reason
    assert result["batches_sent"] == 4 and result["batches_trained"] == 3
    assert result["batches_failed"] == {"lost_id_features": 1}


def test_a_batch_too_large_to_share_a_message_goes_alone_after_the_one_held(persia_env, monkeypatch):
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    batches = [make_batch(i) for i in range(4)]
    batches[1].meta = b"m" * (20 << 20)  # two of it would take more than half of NATS' 64 MiB max_payload
    seen, errors, messages = train_grouped(monkeypatch, batches)
    assert errors == [] and seen == [0, 1, 2, 3]  # in order: the held batch 0 went first
    assert messages == {"forward": [(0,), (1,)], "batch": [(0,), (1,)],
                        "forward_group": [(2, 3)], "batch_group": [(2, 3)]}


def test_a_group_that_finds_the_worker_buffer_full_is_retried_without_doubles(persia_env, monkeypatch):
    """A forward buffer of one batch: a group's second batch is refused busy while the first waits
    for its lookup; the retry of the group buffers only the second (the first is known by its key)."""
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    seen, errors, messages = train_grouped(monkeypatch, [make_batch(i) for i in range(6)], forward_buffer_size=1)
    assert errors == [] and seen == [0, 1, 2, 3, 4, 5]
    assert messages == {"forward_group": [(0, 1), (2, 3), (4, 5)], "batch_group": [(0, 1), (2, 3), (4, 5)]}
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 6 and result["batches_trained"] == 6 and result["batches_failed"] == {}


def test_a_held_batch_goes_alone_when_its_partner_is_late(persia_env, monkeypatch):
    """A loader that waits for the trainer before it sends its next batch (an online loader, data
    that arrives slowly): the held batch goes alone after its hold, instead of waiting for ever."""
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    monkeypatch.setenv("PERSIA_DATA_GROUP_HOLD_MS", "20")

    def send_after_training(ctx, batches, errors, trained):
        for i, b in enumerate(batches):
            ctx.send_data(b)
            end = time.monotonic() + 20
            while i not in trained and time.monotonic() < end:  # polled with a deadline
                time.sleep(0.005)
            if i not in trained:
                errors.append(AssertionError(f"batch {i} was not trained while the loader waited"))

    seen, errors, messages = train_grouped(monkeypatch, [make_batch(i) for i in range(3)], send=send_after_training)
    assert errors == [] and seen == [0, 1, 2]
    assert messages == {"forward": [(0,), (1,), (2,)], "batch": [(0,), (1,), (2,)]}  # each alone, after its hold


class CountedWaits:
    """Stands in for the hold thread's condition and counts its waits: ``waits`` entered,
    ``wakeups`` returned from (by a notify or a deadline), whatever the scheduler does meanwhile."""

    def __init__(self, cond: threading.Condition):
        self._cond = cond
        self.waits = self.wakeups = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1  # under the condition's lock, as every change to these counts
        try:
            return self._cond.wait(timeout)
        finally:
            self.wakeups += 1

    def __getattr__(self, name):
        return getattr(self._cond, name)


def counting_waits(ctx) -> CountedWaits:
    """The hold thread's waits on ``ctx``, counted from here on (before its first ``send_data``)."""
    counted = ctx._hold_wake = CountedWaits(ctx._hold_wake)
    return counted


def waiting(counted: CountedWaits, what: str) -> int:
    """Once the hold thread sits in a wait: its wake-ups so far."""
    poll_until(lambda: counted.waits > counted.wakeups, what, deadline_s=20)
    return counted.wakeups


def test_the_hold_thread_sleeps_while_nothing_is_held(persia_env, monkeypatch):
    """An idle loader (one waiting for its trainer) costs no CPU for the hold: with a hold of 20 ms
    and nothing held, the hold thread is not woken. It had ticked every half hold, about 50 times in
    this half second."""
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    monkeypatch.setenv("PERSIA_DATA_GROUP_HOLD_MS", "20")
    woken: dict = {}

    def one_group_then_idle(ctx, batches, errors, _trained):
        counted = counting_waits(ctx)
        ctx.send_data(batches[0])  # held: the hold thread starts
        ctx.send_data(batches[1])  # the group goes; nothing is held from here
        # one hold more (batches were held since it last looked), then the wait without deadline
        poll_until(lambda: ctx._holder_idle, "the hold thread waiting with nothing held", deadline_s=20)
        before = waiting(counted, "the hold thread in its wait")
        time.sleep(0.5)  # the window measured, not a synchronisation
        woken["idle"] = counted.wakeups - before
        ctx.send_data(batches[2])  # held again, and sent alone after its hold
        end = time.monotonic() + 20
        while 2 not in _trained and time.monotonic() < end:  # polled with a deadline
            time.sleep(0.005)

    seen, errors, messages = train_grouped(monkeypatch, [make_batch(i) for i in range(3)], send=one_group_then_idle)
    assert errors == [] and seen == [0, 1, 2]
    assert messages == {"forward_group": [(0, 1)], "batch_group": [(0, 1)], "forward": [(2,)], "batch": [(2,)]}
    assert woken["idle"] == 0, f"the hold thread was woken {woken['idle']} times with nothing held"


def test_a_batch_held_while_an_older_hold_runs_does_not_wake_the_hold_thread(persia_env, monkeypatch):
    """A busy loader: its batches are held while the thread sleeps towards an older batch's hold
    (or one hold past it, when the loader was busy meanwhile), which ends first, so none of them
    wakes it (one wake a held batch would be 19 here)."""
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    monkeypatch.setenv("PERSIA_DATA_GROUP_HOLD_MS", "1000")
    woken: dict = {}

    def groups_in_a_row(ctx, batches, errors, _trained):
        counted = counting_waits(ctx)
        ctx.send_data(batches[0])
        ctx.send_data(batches[1])
        before, t0 = waiting(counted, "the hold thread started and waiting"), time.monotonic()
        for b in batches[2:]:
            ctx.send_data(b)
        woken["busy"], woken["seconds"] = counted.wakeups - before, time.monotonic() - t0

    seen, errors, messages = train_grouped(monkeypatch, [make_batch(i) for i in range(40)], send=groups_in_a_row,
                                           forward_buffer_size=64)
    assert errors == [] and seen == list(range(40))
    assert messages["forward_group"] == [(i, i + 1) for i in range(0, 40, 2)] and "forward" not in messages
    # at most the wake-up of batch 2 (when the thread had found nothing held), the one for the
    # wait it was in, and one for each hold (a second) that ran out
    assert woken["busy"] <= 2 + woken["seconds"], woken


def test_a_held_batch_that_fails_after_its_hold_raises_from_the_next_call(persia_env, monkeypatch):
    """The hold thread sends a lone held batch the worker refuses: the loader's next ``send_data``
    raises that error before its own batch takes an id, so the caller may send it again."""
    without_slot_list(monkeypatch)  # the worker, not the data loader, refuses the unknown slot
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    monkeypatch.setenv("PERSIA_DATA_GROUP_HOLD_MS", "20")
    outcome: dict = {}

    def refused_then_next(ctx, batches, errors, _trained):
        bad, good = batches
        ctx.send_data(bad)  # held, then sent alone by the hold thread, and refused
        # the NN rank counted it, and the hold thread's send has ended (its error is kept by then:
        # the NN rank may count it before the hold thread has the worker's refusal)
        poll_until(lambda: ACCOUNT.as_result()["batches_failed"]
                   and ctx._metrics.get("data_loader_sends_in_flight") == 0,
                   "the held batch refused and its send ended", deadline_s=20)
        try:
            ctx.send_data(good)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        outcome["after_error"] = good.batch_id
        ctx.send_data(good)  # the same object, now sent (it never took an id)

    seen, errors, messages = train_grouped(monkeypatch, [make_batch(0, unknown_slot=True), make_batch(1)],
                                           send=refused_then_next)
    assert len(errors) == 1 and "unknown slot 'not_a_slot'" in str(errors[0])
    assert outcome["after_error"] is None
    assert seen == [1]
    # batch 0 alone after its hold; batch 1, held for a partner that never came, alone at the close
    assert messages == {"forward": [(0,), (1,)], "batch": [(0,), (1,)]}
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 2 and result["batches_trained"] == 1
    assert result["batches_failed"] == {"lost_id_features": 1}


def test_a_large_batch_is_sent_even_when_the_batch_held_before_it_fails(persia_env, monkeypatch):
    """The held batch goes first, alone, and the worker refuses it; the large batch after it is
    still sent (before, the first failure skipped it: sent by nobody, counted by nobody)."""
    without_slot_list(monkeypatch)  # the worker, not the data loader, refuses the unknown slot
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    batches = [make_batch(0, unknown_slot=True), make_batch(1)]
    batches[1].meta = b"m" * (20 << 20)
    seen, errors, messages = train_grouped(monkeypatch, batches)
    assert messages == {"forward": [(0,), (1,)], "batch": [(0,), (1,)]}
    assert len(errors) == 1 and "unknown slot 'not_a_slot'" in str(errors[0])
    assert seen == [1]
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 2 and result["batches_trained"] == 1
    assert result["batches_failed"] == {"lost_id_features": 1}


def test_threads_sending_on_one_context_each_batch_goes_once(persia_env, monkeypatch):
    """Two threads call ``send_data`` on one DataCtx at once: they form groups from each other's
    batches and send in parallel; the close waits for both before the epoch ends."""
    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")

    def two_threads(ctx, batches, errors, _trained):
        def send(part):
            for b in part:
                try:
                    ctx.send_data(b)
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)

        threads = [threading.Thread(target=send, args=(batches[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    seen, errors, messages = train_grouped(monkeypatch, [make_batch(i) for i in range(12)], send=two_threads)
    assert errors == [] and sorted(seen) == list(range(12))
    sent = sorted(i for ids in messages.get("batch_group", []) + messages.get("batch", []) for i in ids)
    assert sent == list(range(12))  # each batch in exactly one message
    result = ACCOUNT.as_result()
    assert result["batches_sent"] == 12 and result["batches_trained"] == 12 and result["batches_failed"] == {}


def test_a_loader_that_refills_one_buffer_sends_each_batch_as_it_was(persia_env, monkeypatch):
    """A batch held for its group partner was encoded only when the group went, from the user's
    own arrays: a loader that refills one buffer per batch (a common pattern) trained batch N's
    IDs with batch N+1's dense features and labels. The dense leg is copied when the batch is
    made into a message."""
    import numpy as np

    from persia.embedding.data import Label, NonIDTypeFeature, PersiaBatch

    monkeypatch.setenv("PERSIA_DATA_GROUP", "2")
    dense = np.zeros((16, 2), dtype=np.float32)  # BS rows: one buffer, refilled for every batch
    label = np.zeros((16, 1), dtype=np.float32)

    def refilling(ctx, batches, errors, _trained):
        for i, template in enumerate(batches):
            dense[:] = i
            label[:] = i % 2
            ctx.send_data(PersiaBatch(template.id_type_features, non_id_type_features=[NonIDTypeFeature(dense, name="dense")],
                                      labels=[Label(label, name="y")], requires_grad=True))

    got: dict[int, tuple[float, float]] = {}

    def keep(_method, obj):  # what the NN rank receives, as it receives it
        for b in obj.get("batches", [obj]):
            got[int(b["batch_id"])] = (float(np.asarray(b["non_id"][0]["data"]).max()),
                                       float(np.asarray(b["labels"][0]["data"]).max()))

    on_arrival(monkeypatch, ("batch", "batch_group"), keep)
    seen, errors, _ = train_grouped(monkeypatch, [make_batch(i) for i in range(5)], send=refilling)
    assert errors == [] and seen == [0, 1, 2, 3, 4]
    assert got == {i: (float(i), float(i % 2)) for i in range(5)}, got
