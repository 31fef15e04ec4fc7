"""The next batch's corrector (persia.nn_worker.next_batch_correction): which batch it corrects,
that the training thread never trains a batch while it is being corrected, and that its
failures reach the training thread. Real threads; every wait has a deadline."""

from __future__ import annotations

import threading
import time

import pytest

from persia.nn_worker.next_batch_correction import NextBatchCorrector

DEADLINE_S = 10.0


class Batch:
    def __init__(self, name: str, order: int):
        self.name, self.order = name, order

    def __repr__(self) -> str:
        return self.name


class Recorder:
    """A correct() that records its batches, and can be held inside a correction."""

    def __init__(self, fail_on: str | None = None):
        self.seen: list[str] = []
        self.cond = threading.Condition()
        self.inside = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_on = fail_on

    def __call__(self, batch: Batch) -> None:
        self.inside.set()
        assert self.release.wait(DEADLINE_S)
        with self.cond:
            self.seen.append(batch.name)
            self.cond.notify_all()
        if batch.name == self.fail_on:
            raise ValueError(f"field 'since': updates below seq 3 were forgotten ({batch.name})")

    def wait_for(self, count: int) -> list[str]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.seen) >= count, DEADLINE_S), self.seen
            return list(self.seen)


@pytest.fixture
def make():
    made: list[NextBatchCorrector] = []

    def _make(correct):
        c = NextBatchCorrector(correct, order=lambda b: b.order)
        made.append(c)
        return c

    yield _make
    for c in made:
        c.stop()


def test_after_each_update_sent_it_corrects_the_ready_batch_that_trains_next(make):
    rec = Recorder()
    c = make(rec)
    late, early = Batch("late", 5), Batch("early", 3)
    c.ready(late)
    c.ready(early)  # came ready after "late" but was dispatched before it: it trains first
    c.update_sent()
    assert rec.wait_for(1) == ["early"]
    c.take(early)
    c.update_sent()
    assert rec.wait_for(2) == ["early", "late"]
    c.take(late)
    c.update_sent()  # nothing ready: nothing to correct
    c.ready(Batch("after", 9))  # ready alone is no reason: corrections follow updates
    c.stop()
    assert rec.seen == ["early", "late"]


def test_take_waits_for_the_correction_in_progress_and_the_batch_is_not_corrected_again(make):
    rec = Recorder()
    rec.release.clear()
    c = make(rec)
    b = Batch("b", 1)
    c.ready(b)
    c.update_sent()
    assert rec.inside.wait(DEADLINE_S)
    taken = threading.Event()
    t = threading.Thread(target=lambda: (c.take(b), taken.set()))
    t.start()
    assert not taken.wait(0.3)  # the corrector still steps b's rows: training it now would race
    rec.release.set()
    assert taken.wait(DEADLINE_S)
    t.join(DEADLINE_S)
    c.update_sent()
    c.stop()
    assert rec.seen == ["b"]


def test_taking_a_batch_drops_the_batches_ordered_before_it(make):
    rec = Recorder()
    c = make(rec)
    skipped, b, later = Batch("skipped", 1), Batch("b", 2), Batch("later", 3)
    for x in (skipped, b, later):
        c.ready(x)
    c.take(b)  # the loader trains in order: "skipped" is not trained next (an uneven tail, say)
    c.update_sent()
    assert rec.wait_for(1) == ["later"]


def test_a_failed_correction_is_raised_by_take_for_that_batch_only(make):
    rec = Recorder(fail_on="bad")
    c = make(rec)
    bad, good = Batch("bad", 1), Batch("good", 2)
    c.ready(bad)
    c.ready(good)
    c.update_sent()
    rec.wait_for(1)
    c.update_sent()  # the failed batch is not corrected again: "good" is next
    assert rec.wait_for(2) == ["bad", "good"]
    with pytest.raises(ValueError, match="forgotten \\(bad\\)"):
        c.take(bad)
    c.take(bad)  # raised once
    c.take(good)


def test_stop_ends_the_thread_after_the_correction_in_progress(make):
    rec = Recorder()
    rec.release.clear()
    c = make(rec)
    c.ready(Batch("b", 1))
    c.update_sent()
    assert rec.inside.wait(DEADLINE_S)
    threading.Timer(0.2, rec.release.set).start()
    t0 = time.monotonic()
    c.stop()
    assert rec.seen == ["b"] and time.monotonic() - t0 < DEADLINE_S
    assert not any(t.name == "persia-replay" for t in threading.enumerate())
    c.ready(Batch("after", 2))  # stopped: nothing starts again
    assert not any(t.name == "persia-replay" for t in threading.enumerate())
