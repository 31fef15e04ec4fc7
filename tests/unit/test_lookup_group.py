"""Lookup groups (persia.nn_worker.lookup_group): how many batches one lookup call asks for, and
the non-waiting pieces the dispatcher builds a group from."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from persia.data import Lookahead, StreamingDataset
from persia.messages import MessageError, PsStep, WorkerStep, validate
from persia.nn_worker.lookup_group import group_under_bound, lookup_group_setting, lookup_group_size
from persia.nn_worker.staleness import RampedStalenessBound


def test_the_setting_is_an_integer_from_1_to_8_or_auto_and_a_bad_one_is_named():
    assert lookup_group_setting({}) is None
    assert lookup_group_setting({"PERSIA_LOOKUP_GROUP": " auto "}) is None
    assert lookup_group_setting({"PERSIA_LOOKUP_GROUP": "3"}) == 3
    for bad in ("0", "9", "two", "1.5"):
        with pytest.raises(ValueError, match=rf"PERSIA_LOOKUP_GROUP .* got '{bad}'"):
            lookup_group_setting({"PERSIA_LOOKUP_GROUP": bad})


def test_two_batches_per_call_by_default_only_where_every_missed_update_is_replayed():
    assert lookup_group_size(None, replays_own_updates=True, world_size=1) == 2
    assert lookup_group_size(None, replays_own_updates=True, world_size=2) == 1  # other ranks' updates
    assert lookup_group_size(None, replays_own_updates=False, world_size=1) == 1  # stale reads uncorrected
    assert lookup_group_size(4, replays_own_updates=False, world_size=8) == 4  # the setting wins


def test_a_group_is_at_most_half_the_staleness_bound():
    assert group_under_bound(2, None) == 2 and group_under_bound(2, 4) == 2 and group_under_bound(3, 10) == 3
    assert group_under_bound(4, 6) == 3  # smaller, not none
    assert group_under_bound(2, 3) == 1 and group_under_bound(2, 1) == 1  # synchronous: one per lookup
    assert group_under_bound(1, None) == 1


def test_the_lookahead_takes_a_groups_second_batch_without_waiting():
    la = Lookahead(limit=2)
    stop = threading.Event()
    assert la.acquire(stop) and la.acquire(stop)
    la.add()  # past the depth: the group goes when its first batch would have gone alone
    assert la.outstanding == 3
    stop.set()
    assert not la.acquire(stop)  # full: a lone acquire waits (here: gives up on stop)
    la.release()
    la.release()
    assert la.outstanding == 1


def test_a_permit_for_a_group_is_taken_now_or_not_at_all():
    bound = RampedStalenessBound(target=2, warmup_steps=0)
    claims: list = []
    assert bound.try_acquire_or_take_over(lambda: claims.append(1)) == (True, None)  # a free one
    assert bound.try_acquire_or_take_over(lambda: None) == (True, None)
    assert bound.held == 2 and claims == []
    assert bound.try_acquire_or_take_over(lambda: None) == (False, None)  # none free, none to take over
    pending = object()
    assert bound.try_acquire_or_take_over(lambda: pending) == (True, pending)
    assert bound.held == 2  # a taken-over permit is the update's, not a new one


def test_only_a_batch_at_the_head_of_the_queue_is_ready():
    ds = StreamingDataset(buffer_size=4)
    assert not ds.has_ready()
    ds._queue.put_nowait(("eos", {"loader": 0, "loader_size": 1, "sent": 1}))
    assert not ds.has_ready()  # the end of a stream: reading past it may wait
    ds._queue.get_nowait()
    ds._queue.put_nowait(("batch", {"batch_id": 0, "epoch": 1}))
    assert ds.has_ready()
    ds.epoch = 0  # a per-epoch view: a later epoch's batch is kept for the next view
    assert not ds.has_ready()
    ds.epoch = 1
    assert ds.has_ready() and ds._queue.qsize() == 1  # a peek: nothing taken


def test_a_step_is_one_batch_or_a_list_and_the_error_names_the_fields():
    lookups = [{"ref": 1}, {"ref": 2, "replay": {"source": 3, "since": 1}}]
    assert validate(WorkerStep, {"lookups": lookups})["lookups"] == lookups
    assert validate(WorkerStep, {"ref": 5})["ref"] == 5
    for bad, words in (({"ref": 1, "lookups": lookups}, "'ref' or field 'lookups'"),
                       ({}, "not both and not neither"),
                       ({"lookups": lookups, "replay": {"source": 3, "since": 1}}, "each lookup has its own"),
                       ({"lookups": [{"ref": i} for i in range(9)]}, "lookups")):
        with pytest.raises(MessageError, match=words):
            validate(WorkerStep, bad)
    table = {"dim": 4, "signs": np.array([1, 2], dtype=np.uint64)}
    assert validate(PsStep, {"lookups": [None, {"train": False, "tables": [table]}]})
    with pytest.raises(MessageError, match="'lookup' and 'lookups' are exclusive"):
        validate(PsStep, {"lookup": {"train": False, "tables": [table]}, "lookups": [None]})
