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


# -- lookups that arrive before their ID features (the data loader sends both legs at once) --------
import threading  # noqa: E402
import time  # noqa: E402

from persia.errors import BatchLost, TooManyWaiting  # noqa: E402


def _waiting_take(buf: ExpiringBuffer, ref: int, wait_s: float = 60.0) -> tuple[threading.Thread, list]:
    """``buf.take(ref, wait_s)`` in a thread, once it waits; its result or exception in the list."""
    out: list = []

    def run():
        try:
            out.append(buf.take(ref, wait_s=wait_s))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out.append(exc)

    before = buf.waiting
    t = threading.Thread(target=run, daemon=True)
    t.start()
    end = time.monotonic() + 10
    while buf.waiting == before and not out:
        assert time.monotonic() < end, "the take never waited"
        time.sleep(0.001)
    return t, out


def lookup_buffer(**kw) -> ExpiringBuffer:
    return ExpiringBuffer("fb", kw.pop("capacity", 10), 100, remember=100, max_waiters=kw.pop("max_waiters", 2), **kw)


def test_a_take_waits_for_its_ref_and_gets_it_when_it_arrives():
    buf = lookup_buffer()
    t, out = _waiting_take(buf, 123)
    assert buf.put(0, "ids", ref=123) == 123
    t.join(10)
    assert out == ["ids"] and len(buf) == 0 and buf.waiting == 0


def test_a_ref_that_is_waited_for_is_taken_even_when_the_buffer_is_full():
    buf = lookup_buffer(capacity=1)
    assert buf.put(0, "other") is not None
    assert buf.put(0, "late", ref=5) is None  # full, nobody waits for it: busy
    t, out = _waiting_take(buf, 5)
    assert buf.put(0, "late", ref=5) == 5  # its lookup waits: accepted, consumed at once
    t.join(10)
    assert out == ["late"] and len(buf) == 1


def test_releasing_a_ref_fails_its_waiting_take_at_once_and_refuses_it_later():
    buf = lookup_buffer()
    t, out = _waiting_take(buf, 9, wait_s=600)
    assert buf.release(9, "was given up by its data loader") is False
    t.join(10)
    assert not t.is_alive() and isinstance(out[0], BatchLost) and "given up" in str(out[0])
    with pytest.raises(BatchLost, match="given up"):
        buf.put(0, "ids", ref=9)  # a late copy is not buffered for nobody
    with pytest.raises(BatchLost):
        buf.take(9, wait_s=600)  # known lost: no wait


def test_a_take_that_waits_in_vain_fails_and_the_late_copy_is_refused():
    buf = lookup_buffer()
    with pytest.raises(BatchLost, match="did not arrive within the lookup wait"):
        buf.take(77, wait_s=0.01)
    with pytest.raises(BatchLost):
        buf.put(0, "ids", ref=77)
    assert len(buf) == 0


def test_a_ref_already_looked_up_fails_at_once_and_cannot_be_reused():
    buf = lookup_buffer()
    buf.put(0, "ids", ref=4)
    assert buf.take(4, wait_s=600) == "ids"
    with pytest.raises(KeyError, match="already looked up"):
        buf.take(4, wait_s=600)
    with pytest.raises(KeyError, match="already looked up"):
        buf.put(0, "other batch", ref=4)
    buf.put(0, "ids", ref=8)
    with pytest.raises(ValueError, match="already buffered"):
        buf.put(1, "another batch, same ref", ref=8)


def test_waiters_are_bounded():
    buf = lookup_buffer(max_waiters=1)
    t, out = _waiting_take(buf, 1)
    with pytest.raises(TooManyWaiting):
        buf.take(2, wait_s=600)
    buf.put(0, "a", ref=1)
    t.join(10)
    assert out == ["a"]
    assert buf.put(0, "b", ref=2) == 2 and buf.take(2, wait_s=600) == "b"  # the slot is free again
    with pytest.raises(KeyError):  # without waiters allowed, a missing ref fails as before
        ExpiringBuffer("pb", 10, 100).take(3, wait_s=1)
