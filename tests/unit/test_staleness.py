"""The ramped staleness bound (persia.nn_worker.staleness): schedule, setting, permits. No servers:
the bound is a pure schedule plus a condition variable, exercised here with real threads."""

from __future__ import annotations

import threading

import pytest

from persia.data import DataLoader, IterableDataset, Lookahead
from persia.nn_worker.staleness import (
    DEFAULT_WARMUP_STEPS,
    ENV_WARMUP,
    RampedStalenessBound,
    ramped_bound,
    staleness_bound,
    warmup_steps_setting,
)


def test_the_ramp_is_synchronous_for_the_warm_up_then_grows_like_the_square_root():
    bounds = [ramped_bound(s, 10, 100) for s in range(3000)]
    assert set(bounds[:100]) == {1}  # the first W steps: the synchronous reference
    assert bounds[100] == 2 and bounds[224] == 2 and bounds[225] == 3
    assert bounds[399] == 3 and bounds[400] == 4 and bounds[900] == 6
    assert bounds[2499] == 9 and set(bounds[2500:]) == {10}  # reached, and capped by the target
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))  # never shrinks: a permit is never owed


def test_the_ramp_respects_small_targets_and_can_be_turned_off():
    assert [ramped_bound(s, 2, 100) for s in (0, 99, 100, 10_000)] == [1, 1, 2, 2]
    assert ramped_bound(10_000, 1, 100) == 1  # staleness 1 stays synchronous
    assert ramped_bound(0, 10, 0) == 10  # W = 0: the full bound from the first step (the old behaviour)
    assert ramped_bound(0, None, 0) is None
    # no user bound: starts synchronous like any other, and keeps growing
    assert [ramped_bound(s, None, 100) for s in (0, 100, 2500, 250_000)] == [1, 2, 10, 100]


@pytest.mark.parametrize("args, word", [((-1, 10, 100), "step"), ((0, 0, 100), "embedding_staleness"),
                                        ((0, 10, -5), "warm-up")])
def test_the_ramp_rejects_bad_input_naming_it(args, word):
    with pytest.raises(ValueError, match=word):
        ramped_bound(*args)


def test_the_warm_up_setting_comes_from_the_argument_then_the_environment_then_the_default():
    assert warmup_steps_setting(None, {}) == DEFAULT_WARMUP_STEPS
    assert warmup_steps_setting(None, {ENV_WARMUP: " 40 "}) == 40
    assert warmup_steps_setting(0, {ENV_WARMUP: "40"}) == 0  # the argument wins
    with pytest.raises(ValueError, match=rf"{ENV_WARMUP}.*'ten'"):
        warmup_steps_setting(None, {ENV_WARMUP: "ten"})
    with pytest.raises(ValueError, match=rf"{ENV_WARMUP}.*'-3'"):
        warmup_steps_setting(None, {ENV_WARMUP: "-3"})
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match=rf"staleness_warmup_steps.*{bad!r}"):
            warmup_steps_setting(bad, {})


class _Empty(IterableDataset):
    def __iter__(self):
        return iter(())


def test_the_data_loader_validates_the_setting_when_it_is_built(monkeypatch):
    with pytest.raises(ValueError, match="staleness_warmup_steps.*-1"):
        DataLoader(_Empty(), staleness_warmup_steps=-1)
    monkeypatch.setenv(ENV_WARMUP, "soon")
    with pytest.raises(ValueError, match=f"{ENV_WARMUP}.*'soon'"):
        DataLoader(_Empty(), embedding_staleness=10)
    monkeypatch.setenv(ENV_WARMUP, "30")
    assert DataLoader(_Empty(), embedding_staleness=10).staleness_warmup_steps == 30
    assert DataLoader(_Empty(), staleness_warmup_steps=0).staleness_warmup_steps == 0


def test_no_bound_and_no_warm_up_means_no_permits():
    assert staleness_bound(None, 0) is None
    assert staleness_bound(10, 0).limit == 10
    assert staleness_bound(None, 100).limit == 1


def test_permits_follow_the_ramp_and_a_waiting_lookup_wakes_when_the_step_count_raises_it():
    bound = RampedStalenessBound(10, warmup_steps=100)
    assert bound.acquire(timeout=0)  # one batch looked up, not yet applied: synchronous
    assert not bound.acquire(timeout=0)
    got = threading.Event()
    waiter = threading.Thread(target=lambda: bound.acquire(timeout=30) and got.set(), daemon=True)
    waiter.start()
    bound.set_step(50)  # still in the warm-up: the second lookup keeps waiting
    assert not got.wait(0.2)
    bound.set_step(100)  # bound 2
    assert got.wait(10)
    waiter.join(10)
    assert bound.held == 2 and not bound.acquire(timeout=0)
    bound.set_step(40)  # a smaller count (another context's) never lowers it
    assert bound.limit == 2
    bound.release()
    assert bound.acquire(blocking=False)


def test_a_release_wakes_a_waiting_lookup_and_over_release_is_an_error():
    bound = RampedStalenessBound(3, warmup_steps=100, step=0)
    assert bound.acquire(timeout=0)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: bound.acquire(timeout=30) and done.set(), daemon=True)
    waiter.start()
    bound.release()  # the update was applied
    assert done.wait(10)
    bound.release()
    with pytest.raises(ValueError, match="released more times"):
        bound.release()


def test_a_bound_started_late_resumes_the_ramp_where_training_is():
    # a second epoch (a new DataLoader iteration in the same TrainCtx) does not restart at 1
    assert RampedStalenessBound(10, 100, step=400).limit == 4


def test_the_lookahead_depth_is_capped_whatever_the_buffer():
    assert Lookahead(10).limit == Lookahead.MAX_DEPTH
    assert Lookahead(2).limit == 2
    assert Lookahead(10, max_depth=8).limit == 8


class CountingCondition(threading.Condition):
    """A condition that counts its notify_all calls: each one wakes every waiter (the dispatcher
    and, before it had a condition of its own, the update flusher) and costs a GIL hand-off."""

    def __init__(self):
        super().__init__(threading.RLock())
        self.notified = 0

    def notify_all(self):
        self.notified += 1
        super().notify_all()


def test_steps_notify_the_permit_waiters_only_when_they_raise_the_bound():
    cond = CountingCondition()
    bound = RampedStalenessBound(10, warmup_steps=100, cond=cond)
    for step in range(1, 100):
        bound.set_step(step)  # bound 1 throughout the warm-up
    assert cond.notified == 0
    bound.set_step(100)  # 1 -> 2
    assert cond.notified == 1
    for step in range(101, 5_000):
        bound.set_step(step)
    assert bound.limit == 10
    raises = sum(1 for s in range(100, 5_000) if ramped_bound(s + 1, 10, 100) > ramped_bound(s, 10, 100))
    assert cond.notified == 1 + raises  # once per raise: 2 -> 3 ... -> 10
    before = cond.notified
    for step in range(5_000, 6_000):
        bound.set_step(step)  # past the ramp: the bound stays 10
    assert cond.notified == before


def test_an_unbounded_ramp_notifies_as_it_grows_and_a_bound_without_ramp_never():
    cond = CountingCondition()
    growing = RampedStalenessBound(None, warmup_steps=100, cond=cond)
    for step in range(1, 1_000):
        growing.set_step(step)
    assert growing.limit == 6 and cond.notified == 5  # 1 -> 2 -> ... -> 6
    cond = CountingCondition()
    flat = RampedStalenessBound(10, warmup_steps=0, cond=cond)
    for step in range(1, 500):
        flat.set_step(step)
    assert cond.notified == 0


def test_the_lookahead_wakes_a_waiting_dispatcher_only_when_the_pipeline_deepens():
    ahead = Lookahead(4)
    ahead._cond = cond = CountingCondition()
    ahead.record_lookup(0.001)  # nothing measured before: depth was the limit, now it falls
    ahead.record_step(0.010)  # depth 2
    assert cond.notified == 0
    for _ in range(20):
        ahead.record_step(0.010)  # unchanged
    assert cond.notified == 0
    ahead.record_lookup(0.050)  # lookups got slower: depth grows
    assert cond.notified == 1
    ahead.release()  # a batch trained: always a slot for the dispatcher
    assert cond.notified == 2
