"""Data-loader send groups (``PERSIA_DATA_GROUP``): the pure decisions, and the NN rank's side of
``nn.batch_group`` on a real ``StreamingDataset`` (no bus: its handler is called as the bus would)."""

from __future__ import annotations

import numpy as np
import pytest

from persia.bus import BUSY, WOULD_BLOCK
from persia.data_loader.grouping import (
    DEFAULT_GROUP,
    MAX_GROUP,
    HeldBatch,
    SendGroups,
    data_group_setting,
    fits_group,
    id_leg_failures,
    message_bytes,
)
from persia.messages import MAX_SEND_GROUP
from persia.nn_worker.datasets import StreamingDataset


def held(batch_id: int, worker: int = 0, rank: int = 0, dense_bytes: int = 64) -> HeldBatch:
    dense = {"batch_id": batch_id, "non_id": [{"name": "x", "data": np.zeros(dense_bytes // 4, np.float32)}]}
    return HeldBatch(worker, rank, batch_id, ref=1000 + batch_id, ids={"features": np.zeros(4, np.uint64)},
                     dense=dense, batch=None)


@pytest.mark.parametrize("raw, expected", [(None, DEFAULT_GROUP), ("", DEFAULT_GROUP), ("1", 1), (" 4 ", 4),
                                           (str(MAX_GROUP), MAX_GROUP)])
def test_group_setting(raw, expected):
    assert data_group_setting({} if raw is None else {"PERSIA_DATA_GROUP": raw}) == expected
    assert MAX_GROUP == MAX_SEND_GROUP  # the receivers' schemas take every group a loader makes


@pytest.mark.parametrize("raw", ["0", "-2", str(MAX_GROUP + 1), "two", "2.5"])
def test_bad_group_setting_is_refused_naming_it(raw):
    with pytest.raises(ValueError, match=f"PERSIA_DATA_GROUP must be an integer from 1 to {MAX_GROUP}, got '{raw}'"):
        data_group_setting({"PERSIA_DATA_GROUP": raw})


def test_groups_complete_per_destination_in_order():
    groups = SendGroups(2)
    assert groups.add(held(0, rank=0)) is None
    assert groups.add(held(1, rank=1)) is None  # another rank: its own group
    assert len(groups) == 2
    done = groups.add(held(2, rank=0))
    assert [b.batch_id for b in done] == [0, 2]
    assert groups.add(held(3, worker=1, rank=1)) is None  # another worker too
    assert [[b.batch_id for b in g] for g in groups.drain()] == [[1], [3]]
    assert len(groups) == 0 and groups.drain() == [] and groups.oldest is None


def test_a_group_of_one_sends_each_batch_at_once():
    groups = SendGroups(1)
    assert [b.batch_id for b in groups.add(held(7))] == [7]
    assert len(groups) == 0


def test_take_hands_back_what_one_destination_holds():
    groups = SendGroups(3)
    groups.add(held(0))
    groups.add(held(1))
    groups.add(held(2, rank=1))
    assert [[b.batch_id for b in g] for g in groups.take(0, 0)] == [[0, 1]]
    assert groups.take(0, 0) == []
    assert len(groups) == 1


@pytest.mark.parametrize("size", [0, MAX_GROUP + 1])
def test_group_size_out_of_range_is_refused(size):
    with pytest.raises(ValueError, match=f"got {size}"):
        SendGroups(size)


def test_message_bytes_counts_arrays_and_bytes():
    arr = np.zeros(1000, np.float64)
    assert 8000 <= message_bytes({"a": arr, "meta": b"x" * 500}) <= 8000 + 500 + 200


def test_a_batch_too_large_to_share_a_message_goes_alone():
    max_payload = 1 << 20
    assert fits_group(held(0, dense_bytes=100_000), 2, max_payload)
    # two of these would take more than half of max_payload
    assert not fits_group(held(0, dense_bytes=300_000), 2, max_payload)
    assert fits_group(held(0, dense_bytes=300_000), 1, max_payload)


def test_id_leg_failures_are_per_batch():
    group = [held(0), held(1), held(2)]
    reply = {"refs": [{"ref": 1000}, None, {"ref": 1002}], "errors": [None, "ValueError: unknown slot 'x'", None]}
    assert [(b.batch_id, why) for b, why in id_leg_failures(group, reply)] == [(1, "ValueError: unknown slot 'x'")]
    assert id_leg_failures(group, {"refs": [{}, {}, {}], "errors": [None, None, None]}) == []
    # the whole leg failed: every batch of it
    assert [b.batch_id for b, _ in id_leg_failures(group, TimeoutError("no reply"))] == [0, 1, 2]
    # a reply that does not say: every batch, not none
    lost = id_leg_failures(group, {"refs": []})
    assert [b.batch_id for b, _ in lost] == [0, 1, 2] and "malformed reply" in lost[0][1]
    # a lone batch's refusal is an error reply (an exception); its success has no errors
    assert id_leg_failures([held(5)], {"ref": 1005, "worker": 0}) == []


def dense_message(batch_id: int) -> dict:
    return {"batch_id": batch_id, "loader": 0, "session": "s", "epoch": 0, "ref": 1000 + batch_id, "worker": 0}


def queued_ids(ds: StreamingDataset) -> list[int]:
    out = []
    while not ds._queue.empty():
        kind, msg = ds._queue.get_nowait()
        out.append(msg["batch_id"])
    return out


def test_a_group_that_finds_room_for_part_queues_the_rest_on_retry_once_each():
    ds = StreamingDataset(buffer_size=1, busy_wait_s=0.05)
    group = {"batches": [dense_message(0), dense_message(1)]}
    # tried on the bus's loop first: batch 0 fits, batch 1 would block
    assert ds._on_group_now(group) is WOULD_BLOCK
    assert queued_ids(ds) == [0]  # the trainer takes batch 0
    # the bus then hands the same message to a pool thread, which may wait: only batch 1 is new
    assert ds._on_group(group) == {"queued": True}
    assert queued_ids(ds) == [1]
    assert ds._state.delivered[0] == 2  # each batch counted once, as delivered to this rank


def test_a_group_that_finds_no_room_answers_busy_and_keeps_what_it_queued():
    ds = StreamingDataset(buffer_size=1, busy_wait_s=0.01)
    group = {"batches": [dense_message(0), dense_message(1)]}
    assert ds._on_group(group) is BUSY  # batch 1 waited 10 ms for room, then the loader retries
    assert ds._on_group(group) is BUSY  # nothing taken yet: batch 0 is not queued twice
    assert queued_ids(ds) == [0]
    assert ds._on_group(group) == {"queued": True}
    assert queued_ids(ds) == [1] and ds._state.delivered[0] == 2


def test_a_rank_remembers_recent_batch_keys_only():
    """A retried send is trained once while its key is remembered; the memory is bounded (it
    was a set of every key of the run), the oldest keys forgotten first."""
    from persia.recent_keys import RETRY_MEMORY, RecentKeys

    ds = StreamingDataset(buffer_size=8)
    assert isinstance(ds._state.seen, RecentKeys) and ds._state.seen.capacity == RETRY_MEMORY
    ds._state.seen = RecentKeys(2)
    for batch_id in (0, 1, 2):
        assert ds._on_batch(dense_message(batch_id)) == {"queued": True}
    assert ds._on_batch(dense_message(2)) == {"queued": True, "duplicate": True}  # remembered: once
    assert ds._on_batch(dense_message(0)) == {"queued": True}  # forgotten: a new arrival
    assert queued_ids(ds) == [0, 1, 2, 0] and len(ds._state.seen) == 2


@pytest.mark.parametrize("raw, expected", [(None, 0.05), ("5", 0.005), ("1500.5", 1.5005)])
def test_hold_setting(raw, expected):
    from persia.data_loader.grouping import hold_setting

    assert hold_setting({} if raw is None else {"PERSIA_DATA_GROUP_HOLD_MS": raw}) == pytest.approx(expected)


@pytest.mark.parametrize("raw", ["0", "-1", "60001", "soon", "nan"])
def test_bad_hold_setting_is_refused_naming_it(raw):
    from persia.data_loader.grouping import hold_setting

    with pytest.raises(ValueError, match=f"PERSIA_DATA_GROUP_HOLD_MS must be a number of milliseconds from 1 to 60000, "
                                         f"got '{raw}'"):
        hold_setting({"PERSIA_DATA_GROUP_HOLD_MS": raw})


def test_groups_held_past_their_time_are_taken_oldest_first():
    groups = SendGroups(3)
    for batch_id, rank, at in ((0, 1, 10.0), (1, 0, 5.0), (2, 1, 11.0), (3, 2, 20.0)):
        b = held(batch_id, rank=rank)
        b.held_at = at
        groups.add(b)
    assert groups.oldest == 5.0
    # rank 0's group (held at 5) and rank 1's (its first batch at 10), not rank 2's (at 20)
    assert [[b.batch_id for b in g] for g in groups.take_held_since(12.0)] == [[1], [0, 2]]
    assert groups.oldest == 20.0 and len(groups) == 1
    assert groups.take_held_since(19.0) == []
