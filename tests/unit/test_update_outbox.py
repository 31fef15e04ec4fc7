"""The NN worker's update outbox: what a lookup carries, what is sent alone, and when."""

from __future__ import annotations

import threading
import time

import pytest

from persia.nn_worker.outbox import PendingUpdate, UpdateOutbox
from persia.nn_worker.staleness import RampedStalenessBound
from tests.polling import poll_until


def upd(worker: int, ref: int, permit: bool = True) -> PendingUpdate:
    return PendingUpdate(worker=worker, ref=ref, grads=[None], scale=1.0, holds_permit=permit)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_lookup_carries_every_update_of_its_worker_oldest_first():
    box = UpdateOutbox(lambda u: None, start_flusher=False)
    for w, ref in [(0, 1), (1, 2), (0, 3), (1, 4)]:
        box.put(upd(w, ref))
    assert [u.ref for u in box.claim_for(0)] == [1, 3]
    assert [u.ref for u in box.claim_for(0)] == []
    assert len(box) == 2 and box.carried == 2


def test_a_permit_is_taken_over_only_from_an_update_that_holds_one():
    box = UpdateOutbox(lambda u: None, start_flusher=False)
    box.put(upd(0, 1, permit=False))
    box.put(upd(1, 2, permit=True))
    box.put(upd(0, 3, permit=True))
    assert box.claim_permit().ref == 2  # the oldest holding one; the one without is skipped
    assert box.claim_permit().ref == 3
    assert box.claim_permit() is None
    assert [u.ref for u in box.claim_for(0)] == [1]


def test_updates_held_past_the_limit_are_due_in_order():
    clock = Clock()
    box = UpdateOutbox(lambda u: None, max_hold_s=0.05, clock=clock, start_flusher=False)
    box.put(upd(0, 1))
    clock.t += 0.03
    box.put(upd(0, 2))
    assert box.due(clock()) == []
    clock.t += 0.03
    assert [u.ref for u in box.due(clock())] == [1]  # 60 ms old; the second is 30 ms old
    clock.t += 0.03
    assert [u.ref for u in box.due(clock())] == [2]


class Recorder:
    """``send_alone`` for a flusher under test: the refs it sent, and an event set at each send."""

    def __init__(self):
        self.sent: list[int] = []
        self.done = threading.Event()

    def __call__(self, u: PendingUpdate) -> None:
        self.sent.append(u.ref)
        self.done.set()


def test_the_flusher_sends_an_update_no_lookup_claimed():
    send = Recorder()
    sent, done = send.sent, send.done
    box = UpdateOutbox(send, max_hold_s=0.01)
    try:
        box.put(upd(0, 7))
        assert done.wait(10), "the held update was never sent"
        assert sent == [7] and box.sent_alone == 1 and len(box) == 0
    finally:
        box.close()


def test_flush_sends_everything_and_a_closed_outbox_refuses_more():
    sent: list[int] = []
    box = UpdateOutbox(lambda u: sent.append(u.ref), max_hold_s=3600)
    box.put(upd(0, 1))
    box.put(upd(1, 2))
    box.close()
    assert sent == [1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        box.put(upd(0, 3))


def test_a_dispatcher_out_of_permits_takes_over_an_update_the_moment_it_is_put():
    """The permits share the outbox's condition: a put wakes the waiting dispatcher (it would
    otherwise only see it at its next poll, 30 s here)."""
    box = UpdateOutbox(lambda u: None, start_flusher=False)
    permits = RampedStalenessBound(1, 0, cond=box.condition)
    assert permits.acquire(blocking=False)  # the one permit is held (by the batch now training)
    threading.Timer(0.05, lambda: box.put(upd(0, 1))).start()
    t0 = time.monotonic()
    got, taken = permits.acquire_or_take_over(box.claim_permit, threading.Event(), poll_s=30)
    assert time.monotonic() - t0 < 25
    assert got and taken.ref == 1 and len(box) == 0


def test_a_dispatcher_out_of_permits_wakes_for_a_release_and_stops_when_told():
    box = UpdateOutbox(lambda u: None, start_flusher=False)
    permits = RampedStalenessBound(1, 0, cond=box.condition)
    assert permits.acquire(blocking=False)
    threading.Timer(0.05, permits.release).start()
    t0 = time.monotonic()
    assert permits.acquire_or_take_over(box.claim_permit, threading.Event(), poll_s=30) == (True, None)
    assert time.monotonic() - t0 < 25
    stop = threading.Event()
    stop.set()
    assert permits.acquire_or_take_over(box.claim_permit, stop, poll_s=30) == (False, None)
    assert permits.held == 1


def test_negative_hold_is_refused():
    with pytest.raises(ValueError, match="max_hold_s must be >= 0, got -1"):
        UpdateOutbox(lambda u: None, max_hold_s=-1, start_flusher=False)


def test_a_reserved_permit_leaves_its_update_in_place_for_whoever_sends_next():
    """With own-update replay updates go out in order, so a permit taken over is only reserved."""
    box = UpdateOutbox(lambda u: None, start_flusher=False)
    box.put(upd(0, 1, permit=False))
    box.put(upd(1, 2))
    box.put(upd(0, 3))
    first = box.reserve_permit()
    assert first.ref == 2 and first.reserved and len(box) == 3  # still queued, in its place
    assert box.reserve_permit().ref == 3  # the next one not reserved yet
    assert box.reserve_permit() is None
    assert [u.ref for u in box.claim_for(1)] == [2]  # goes out with its worker's lookup, in order
    assert box.take(first) is False  # no longer pending: already sent
    third = next(u for u in list(box._items) if u.ref == 3)
    assert box.take(third) is True and len(box) == 1


def test_the_flusher_sends_under_the_send_lock():
    lock = threading.RLock()
    held = []
    box = UpdateOutbox(lambda u: held.append(lock._is_owned()), max_hold_s=0.0, send_lock=lock)
    try:
        box.put(upd(0, 1))
        deadline = time.monotonic() + 5
        while not held and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        box.close()
    assert held and all(held)


def test_permit_traffic_on_the_shared_condition_does_not_wake_the_flusher():
    """The staleness permits notify ``box.condition`` on every release and step; the flusher
    waits on a condition of its own, woken only by a put into an empty outbox (and close)."""
    box = UpdateOutbox(lambda u: None, max_hold_s=3600)
    try:
        poll_until(lambda: box._flusher_idle, "the flusher to wait for updates", deadline_s=10.0)
        for _ in range(200):
            with box.condition:
                box.condition.notify_all()
        assert box.flusher_notified == 0
        box.put(upd(0, 1))
        poll_until(lambda: box.flusher_notified >= 1, "the put to wake the flusher", deadline_s=10.0)
        poll_until(lambda: not box._flusher_idle, "the flusher to wait for the update's deadline", deadline_s=10.0)
        box.put(upd(0, 2))  # the flusher already waits for an earlier deadline: not woken
        for _ in range(50):
            with box.condition:
                box.condition.notify_all()
        assert box.flusher_notified == 1
    finally:
        box.close()


def test_an_update_put_while_the_flusher_waits_for_an_earlier_deadline_is_still_sent():
    send = Recorder()
    sent, done = send.sent, send.done
    clock = Clock()  # the updates fall due when the test moves it, not while it is descheduled
    box = UpdateOutbox(send, max_hold_s=0.5, clock=clock)
    try:
        poll_until(lambda: box._flusher_idle, "the flusher to wait for updates", deadline_s=10.0)
        box.put(upd(0, 1))
        poll_until(lambda: box.flusher_notified >= 1, "the flusher to wait for the first update's deadline", deadline_s=10.0)
        assert [u.ref for u in box.claim_for(0)] == [1]  # a lookup carried it
        box.put(upd(0, 2))  # no lookup will: the flusher's next look finds it
        clock.t += 0.5  # the second update's deadline has come
        assert done.wait(10), "the second update was never sent"
        assert sent == [2] and len(box) == 0
    finally:
        box.close()
