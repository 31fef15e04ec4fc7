"""The PS shard locks: readers share, a writer excludes the readers and writers of its shards
(and only those), "every shard" conflicts with any shard, a waiting writer holds back new readers,
and every release wakes whoever waits (threads synchronised by events, never sleeps)."""

from __future__ import annotations

import threading

import pytest

from persia.embedding_ps.rwlock import ShardLocks

DEADLINE_S = 10.0
HELD_BACK_S = 0.2  # how long a blocked thread is given to (wrongly) get through


def _in_thread(fn) -> threading.Event:
    done = threading.Event()

    def run():
        fn()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def _read(locks, which=None):
    return _in_thread(lambda: locks.release_read(locks.acquire_read(which)))


def _write(locks, which=None, then=None):
    def go():
        ks = locks.acquire_write(which)
        if then:
            then()
        locks.release_write(ks)

    return _in_thread(go)


def _until(pred) -> None:
    end = threading.Event()
    while not pred():  # polled, bounded by the deadline
        assert not end.wait(0.001)


def _idle(locks: ShardLocks) -> bool:
    return (locks._sleepers == 0 and locks._shard_reads == 0 and locks._shard_writes == 0
            and locks._all_readers == 0 and not locks._all_writer and locks._shard_waiting == 0
            and locks._all_waiting == 0 and not any(locks._readers) and not any(locks._writer))


def test_readers_share_and_a_writer_waits_for_the_last_reader():
    locks = ShardLocks(4)
    held = locks.acquire_read([1, 2])
    assert _read(locks, [2, 3]).wait(DEADLINE_S)  # readers share
    assert _read(locks).wait(DEADLINE_S)  # every shard for reading shares too
    writer_in = _write(locks, [2])
    assert not writer_in.wait(HELD_BACK_S)  # held back by our read of shard 2
    locks.release_read(held)  # the last reader leaves: the writer must be woken
    assert writer_in.wait(DEADLINE_S)
    assert _idle(locks)


def test_a_writer_excludes_only_its_own_shards():
    locks = ShardLocks(4)
    held = locks.acquire_write([0, 1])
    assert _read(locks, [2, 3]).wait(DEADLINE_S)
    assert _write(locks, [3]).wait(DEADLINE_S)
    _held_back_until_released(locks, held, [_read(locks, [1]), _read(locks), _write(locks, [0, 3]), _write(locks)])


def test_every_shard_for_writing_excludes_any_shard():
    locks = ShardLocks(3)
    held = locks.acquire_write()
    _held_back_until_released(locks, held, [_read(locks, [0]), _write(locks, [2]), _read(locks)])


def _held_back_until_released(locks: ShardLocks, held, blocked: list[threading.Event]) -> None:
    assert not any(b.wait(HELD_BACK_S) for b in blocked)
    locks.release_write(held)
    assert all(b.wait(DEADLINE_S) for b in blocked)
    assert _idle(locks)


def test_naming_every_shard_is_the_whole_store_mode():
    locks = ShardLocks(3)
    held = locks.acquire_read([2, 0, 1])
    assert held is None and locks._all_readers == 1
    locks.release_read(held)
    assert _idle(locks)


def test_a_waiting_writer_holds_back_new_readers_of_its_shards():
    locks = ShardLocks(4)
    held = locks.acquire_read([1])
    order: list[str] = []
    writer_in = _write(locks, [1], then=lambda: order.append("writer"))
    _until(lambda: locks._waiting[1])
    reader_in = _in_thread(lambda: (locks.release_read(locks.acquire_read([0, 1])), order.append("reader")))
    assert not reader_in.wait(HELD_BACK_S)  # writer preference: the new reader waits behind the writer
    assert _read(locks, [2]).wait(DEADLINE_S)  # a reader of other shards does not
    locks.release_read(held)
    assert writer_in.wait(DEADLINE_S) and reader_in.wait(DEADLINE_S)
    assert order == ["writer", "reader"]
    assert _idle(locks)


def test_a_waiting_whole_store_writer_goes_before_later_shard_writers():
    locks = ShardLocks(4)
    held = locks.acquire_read([0])
    order: list[str] = []
    whole = _write(locks, None, then=lambda: order.append("all"))
    _until(lambda: locks._all_waiting)
    shard = _write(locks, [3], then=lambda: order.append("shard 3"))  # free, but queued behind "all"
    assert not shard.wait(HELD_BACK_S)
    locks.release_read(held)
    assert whole.wait(DEADLINE_S) and shard.wait(DEADLINE_S)
    assert order == ["all", "shard 3"]
    assert _idle(locks)


def test_shards_out_of_range_are_refused():
    locks = ShardLocks(2)
    with pytest.raises(IndexError, match="out of range"):
        locks.acquire_read([2])
    with pytest.raises(IndexError, match="out of range"):
        locks.acquire_write([-1])
    with pytest.raises(ValueError, match="at least one shard"):
        ShardLocks(0)
    assert _idle(locks)
