import pytest

from persia.embedding_worker.buffer import ExpiringBuffer


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_full_owner_gets_none_and_others_are_unaffected():
    buf = ExpiringBuffer("fb", capacity_per_owner=2, expired_sec=100, clock=Clock())
    assert buf.put(0, "a") is not None
    assert buf.put(0, "b") is not None
    assert buf.put(0, "c") is None  # busy: sender retries
    assert buf.put(1, "x") is not None
    ref = buf.put(1, "y")
    assert buf.take(ref) == "y"
    assert buf.put(1, "z") is not None


def test_entries_expire_with_a_count_and_take_says_why():
    clock = Clock()
    buf = ExpiringBuffer("fb", capacity_per_owner=10, expired_sec=5, clock=clock)
    old = buf.put(0, "old")
    clock.t = 6
    new = buf.put(0, "new")
    assert buf.expired == 1
    with pytest.raises(KeyError, match="expired after 5s; 1 expired so far"):
        buf.take(old)
    assert buf.take(new) == "new"


def test_refs_are_unique():
    buf = ExpiringBuffer("fb", capacity_per_owner=1000, expired_sec=100, clock=Clock())
    refs = {buf.put(i % 7, i) for i in range(500)}
    assert len(refs) == 500


def test_varying_owner_ids_cannot_grow_the_buffer_past_its_total():
    # a sender that invents a new loader id per batch used to grow the buffer without bound
    buf = ExpiringBuffer("fb", capacity_per_owner=10, expired_sec=100, clock=Clock(), capacity_total=10)
    refs = [buf.put(owner, owner) for owner in range(2500)]
    assert sum(r is not None for r in refs) == 10 and len(buf) == 10
    assert all(r is None for r in refs[10:])  # "busy": the senders retry
    for r in refs[:10]:
        buf.take(r)
    assert len(buf) == 0 and buf._per_owner == {}  # no count kept for owners holding nothing
    assert buf.put(4000, "x") is not None
