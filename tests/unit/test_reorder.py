import random

from persia.data import BatchReorderer, _reordered


def test_reorder_releases_in_rank_order():
    r = BatchReorderer(rank=1, world_size=2)
    assert r.push(5, "b5") == []
    assert r.push(3, "b3") == []
    assert r.push(1, "b1") == ["b1", "b3", "b5"]
    assert r.push(7, "b7") == ["b7"]


def test_reordered_stream_is_sorted_even_when_ids_are_missing():
    ids = [i for i in range(0, 40, 2)]  # rank 0 of 2
    shuffled = ids[:]
    random.Random(0).shuffle(shuffled)
    shuffled.remove(10)  # a loader ended early: id 10 never comes
    out = [m["batch_id"] for m in _reordered(iter([{"batch_id": i} for i in shuffled]), 0, 2)]
    assert out == sorted(shuffled)


def test_ids_that_never_come_are_given_up_on_once_enough_later_batches_wait(caplog):
    """A resumed stream starts past its trained batches (ids 0..199 never come to this rank): every
    batch was held, untrained, until the stream ended."""
    r = BatchReorderer(rank=0, world_size=1, hold_limit=64)
    released = []
    for i in range(200, 300):
        released += r.push(i, f"b{i}")
        if i == 200 + 63:
            assert released == []  # still waiting for id 0: 64 later batches held
    assert released == [f"b{i}" for i in range(200, 300)]  # the 65th gave up on 0..199, in order from there
    assert "batch ids 0 to 199 (every 1) not come while 65 later batches wait" in caplog.text
    assert r.push(150, "late") == ["late"]  # one given up on that comes after all: at once
    assert r.push(300, "b300") == ["b300"]


def test_lookahead_depth_hides_latency_and_respects_the_limit():
    from persia.data import Lookahead

    assert Lookahead.depth(None, None, 10) == 10  # nothing measured: fill the pipeline
    assert Lookahead.depth(0.005, 0.050, 10) == 2  # lookups 10x faster than steps: one ahead
    assert Lookahead.depth(0.030, 0.010, 10) == 4
    assert Lookahead.depth(1.0, 0.001, 10) == 10
    assert Lookahead.depth(0.0, 0.01, 1) == 1


def test_lookahead_blocks_until_a_batch_is_consumed():
    import threading

    from persia.data import Lookahead

    la = Lookahead(limit=4)
    la.record_lookup(0.001)
    la.record_step(0.1)  # depth 2
    stop = threading.Event()
    assert la.acquire(stop) and la.acquire(stop)
    third = threading.Thread(target=la.acquire, args=(stop,), daemon=True)
    third.start()
    third.join(0.3)
    assert third.is_alive()  # a third lookup would only make embeddings staler
    la.release()
    third.join(5)
    assert not third.is_alive() and la.outstanding == 2
