"""The PS shard lock: readers share, a writer excludes everyone, a waiting writer holds back new
readers, and every release wakes whoever waits (threads synchronised by events, never sleeps)."""

from __future__ import annotations

import threading

from persia.embedding_ps.rwlock import RWLock

DEADLINE_S = 10.0


def _in_thread(fn) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run():
        fn()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def test_readers_share_and_a_writer_waits_for_the_last_reader():
    lock = RWLock()
    lock.acquire_read()
    _, second_reader = _in_thread(lambda: (lock.acquire_read(), lock.release_read()))
    assert second_reader.wait(DEADLINE_S)  # readers share
    _, writer_in = _in_thread(lambda: (lock.acquire_write(), lock.release_write()))
    assert not writer_in.wait(0.2)  # held back by our read lock
    lock.release_read()  # the last reader leaves: the writer must be woken
    assert writer_in.wait(DEADLINE_S)


def test_a_writer_excludes_readers_and_wakes_them_on_release():
    lock = RWLock()
    lock.acquire_write()
    readers = [_in_thread(lambda: (lock.acquire_read(), lock.release_read()))[1] for _ in range(3)]
    assert not any(r.wait(0.1) for r in readers)
    lock.release_write()
    assert all(r.wait(DEADLINE_S) for r in readers)
    assert lock._sleepers == 0 and lock._readers == 0 and not lock._writer


def test_a_waiting_writer_holds_back_new_readers():
    lock = RWLock()
    lock.acquire_read()
    order: list[str] = []
    _, writer_in = _in_thread(lambda: (lock.acquire_write(), order.append("writer"), lock.release_write()))
    end = threading.Event()
    while not lock._waiting_writers:  # the writer is queued (polled, bounded by the event wait below)
        assert not end.wait(0.001)
    _, reader_in = _in_thread(lambda: (lock.acquire_read(), order.append("reader"), lock.release_read()))
    assert not reader_in.wait(0.2)  # writer preference: the new reader waits behind the writer
    lock.release_read()
    assert writer_in.wait(DEADLINE_S) and reader_in.wait(DEADLINE_S)
    assert order == ["writer", "reader"]
