"""RecentKeys: a receiver's memory of recent message keys stays bounded and forgets the oldest."""

from __future__ import annotations

import pytest

from persia.recent_keys import RETRY_MEMORY, RecentKeys


def test_the_oldest_keys_are_forgotten_past_the_capacity():
    keys = RecentKeys(3)
    for k in range(5):
        keys.add(k)
    assert len(keys) == 3 and list(keys) == [2, 3, 4]
    assert 1 not in keys and 2 in keys


def test_a_key_added_again_counts_as_recent():
    keys = RecentKeys(2)
    keys.add("a")
    keys.add("b")
    keys.add("a")
    keys.add("c")  # forgets b, the oldest, not a
    assert list(keys) == ["a", "c"]


def test_a_key_keeps_its_latest_value_until_it_is_forgotten():
    refs = RecentKeys(2)
    refs.add((0, "s", 1), 1001)
    refs.add((0, "s", 1), 1002)  # added again: the newest value, still one key
    refs.add((0, "s", 2), 1003)
    assert refs.get((0, "s", 1)) == 1002 and len(refs) == 2
    refs.add((0, "s", 3), 1004)
    assert refs.get((0, "s", 1)) is None and refs.get((0, "s", 1), "gone") == "gone"


def test_discard_forgets_a_key_and_ignores_an_unknown_one():
    keys = RecentKeys(2)
    keys.add((0, "s", 1))
    keys.discard((0, "s", 1))
    keys.discard((0, "s", 2))
    assert (0, "s", 1) not in keys and len(keys) == 0


def test_a_long_stream_stays_at_the_capacity():
    keys = RecentKeys()
    for batch_id in range(RETRY_MEMORY + 5_000):
        keys.add((0, "session", batch_id))
    assert len(keys) == RETRY_MEMORY
    assert (0, "session", 4_999) not in keys and (0, "session", 5_000) in keys


@pytest.mark.parametrize("bad", [0, -1])
def test_a_capacity_below_one_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"capacity must be >= 1, got {bad}"):
        RecentKeys(bad)
